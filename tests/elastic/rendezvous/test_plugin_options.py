"""``--rdzv-endpoint`` / ``--rdzv-conf`` parsing of the etcd-v3 plugin (pure, no etcd)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic.rendezvous.plugin import etcd_config_from_params


def _params(endpoint: str, **conf: str) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, "run", 1, 2, **conf)


def test_endpoint_list_and_timeouts_are_parsed() -> None:
    cfg = etcd_config_from_params(_params("h1:2379,https://h2:2380,h3", op_timeout="12"))
    assert cfg.endpoints == (("h1", 2379), ("h2", 2380), ("h3", 2379))
    assert cfg.op_timeout.total_seconds() == 12


def test_password_file_is_read_and_trimmed(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    cfg = etcd_config_from_params(_params("h:2379", user="train", password_file=str(secret), ca_cert="/ca.pem"))
    assert (cfg.user, cfg.password) == ("train", "s3cret")


def test_a_password_without_tls_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    with pytest.raises(ValueError, match="need TLS"):
        etcd_config_from_params(_params("h:2379", user="train", password_file=str(secret)))


def test_unreadable_password_file_names_the_option(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="password_file"):
        etcd_config_from_params(_params("h:2379", user="u", password_file=str(tmp_path / "missing")))


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"cert": "/c.pem"}, "cert_key"),
        ({"user": "u"}, "user and password"),
        ({"op_timeout": "-1"}, "op_timeout"),
        ({"op_timeout": "soon"}, "op_timeout"),
    ],
)
def test_bad_options_fail_with_a_message_naming_them(conf: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        etcd_config_from_params(_params("h:2379", **conf))


def test_bad_endpoint_is_rejected() -> None:
    with pytest.raises(ValueError, match="port"):
        etcd_config_from_params(_params("h:notaport"))
