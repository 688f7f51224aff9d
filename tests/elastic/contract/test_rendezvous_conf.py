"""The ``--rdzv-conf`` options of the etcd-v3 rendezvous (elastic/contract/rendezvous.py): one typed home."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from elastic.contract.recovery import RecoveryMode
from elastic.contract.rendezvous import (
    DEFAULT_KEY_PREFIX,
    DEFAULTS,
    IGNORED_KEYS,
    KEYS,
    RendezvousConf,
    format_seconds,
    ignored_keys_given,
    parse,
)

#: What a torchrun user got without --rdzv-conf before the options had this home (the plugin's OPTIONS).
_BEFORE = {
    "key_prefix": "/torchelastic/rdzv",
    "node_ttl": "2",
    "state_ttl": "7200",
    "ca_cert": "",
    "cert": "",
    "cert_key": "",
    "user": "",
    "password": "",
    "password_file": "",
    "connect_timeout": "5",
    "request_timeout": "5",
    "op_timeout": "30",
    "store_timeout": "300",
    "join_timeout": "600",
    "last_call_timeout": "10",
    "min_wake_interval": "0.05",
    "recovery": "restart",
}


def test_the_defaults_are_what_torchrun_users_got_before() -> None:
    assert DEFAULTS == RendezvousConf() == parse({})
    assert DEFAULTS.to_params(always=KEYS) == _BEFORE
    assert set(KEYS) == set(_BEFORE)
    assert DEFAULTS.key_prefix == DEFAULT_KEY_PREFIX
    assert (DEFAULTS.node_ttl, DEFAULTS.state_ttl) == (timedelta(seconds=2), timedelta(hours=2))
    assert (DEFAULTS.join_timeout, DEFAULTS.last_call_timeout) == (timedelta(minutes=10), timedelta(seconds=10))
    assert DEFAULTS.min_wake_interval == timedelta(milliseconds=50)
    assert DEFAULTS.recovery is RecoveryMode.RESTART
    assert DEFAULTS.ca_cert is None and DEFAULTS.password is None
    assert DEFAULTS.render() == "" and parse(_BEFORE) == DEFAULTS  # "" keeps a default


def test_parse_types_every_key() -> None:
    conf = parse(
        {
            "key_prefix": "/p",
            "node_ttl": "1.5",
            "op_timeout": "12",
            "recovery": " live ",
            "ca_cert": "/ca.pem",
            "user": "train",
            "password_file": "/pw",
            "min_wake_interval": 0.1,
            "last_call_timeout": 1,
        }
    )
    assert conf == dataclasses.replace(
        DEFAULTS,
        key_prefix="/p",
        node_ttl=timedelta(seconds=1.5),
        op_timeout=timedelta(seconds=12),
        recovery=RecoveryMode.LIVE,
        ca_cert="/ca.pem",
        user="train",
        password_file="/pw",
        min_wake_interval=timedelta(seconds=0.1),
        last_call_timeout=timedelta(seconds=1),
    )
    assert parse({"recovery": RecoveryMode.LIVE}).recovery is RecoveryMode.LIVE


def test_round_trip_of_render_and_parse() -> None:
    conf = RendezvousConf(
        key_prefix="/etrain/rdzv",
        last_call_timeout=timedelta(seconds=1),
        join_timeout=timedelta(seconds=30),
        node_ttl=timedelta(milliseconds=1500),
        recovery=RecoveryMode.LIVE,
        ca_cert="/ca.pem",
        cert="/c.pem",
        cert_key="/k.pem",
        password_file="/pw",
        user="u",
        state_ttl=timedelta(seconds=1234567.25),
        min_wake_interval=timedelta(microseconds=1),
    )
    text = conf.render()
    assert parse(dict(kv.split("=", 1) for kv in text.split(","))) == conf
    assert parse(conf.to_params(always=KEYS)) == conf
    assert parse(DEFAULTS.to_params(always=KEYS)) == DEFAULTS


def test_render_writes_changed_keys_and_the_ones_asked_for_in_field_order() -> None:
    conf = RendezvousConf(
        key_prefix="/etrain/rdzv", last_call_timeout=timedelta(seconds=1), join_timeout=timedelta(seconds=30)
    )
    always = ("connect_timeout", "node_ttl", "join_timeout", "last_call_timeout", "key_prefix")
    assert conf.render(always=always) == (
        "key_prefix=/etrain/rdzv,last_call_timeout=1,join_timeout=30,node_ttl=2,connect_timeout=5"
    )
    assert conf.render() == "key_prefix=/etrain/rdzv,last_call_timeout=1,join_timeout=30"
    with pytest.raises(ValueError, match="bogus"):
        conf.render(always=("bogus",))


def test_seconds_are_written_short_and_exact() -> None:
    assert [format_seconds(timedelta(seconds=s)) for s in (5, 600, 0.05, 7200)] == ["5", "600", "0.05", "7200"]
    assert float(format_seconds(timedelta(seconds=1234567.25))) == 1234567.25  # %g would round it


@pytest.mark.parametrize(
    ("key", "raw", "message"),
    [
        ("op_timeout", "soon", "not a number of seconds"),
        ("op_timeout", "-1", "must be positive"),
        ("node_ttl", "0", "must be positive"),
        ("join_timeout", "nan", "must be positive"),
        ("state_ttl", "1e30", "too long"),
        ("recovery", "bogus", "use one of restart, live"),
    ],
)
def test_a_bad_value_is_a_value_error_naming_its_key(key: str, raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"--rdzv-conf {key}=.*{message}"):
        parse({key: raw})


def test_unknown_and_legacy_keys_are_accepted_and_left_alone() -> None:
    params = {"timeout": "900", "close_timeout": "30", "keep_alive_interval": "5", "heartbeat_timeout": ""}
    assert parse(params) == DEFAULTS
    assert ignored_keys_given(params) == ["close_timeout", "keep_alive_interval"]
    assert not set(IGNORED_KEYS) & set(KEYS)
