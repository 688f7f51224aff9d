"""The ``--rdzv-conf`` options of the ``etcd-v3`` rendezvous, typed, with their defaults: the one home of
what torchrun's plugin parses (:mod:`elastic.rendezvous.plugin`), what the handler's settings default to
(:class:`elastic.rendezvous.etcd_v3_handler.HandlerSettings`), what the job service's node agent renders
(:func:`service.agent.launcher.rdzv_conf`) and what the job spec defaults to
(:class:`service.core.spec.RendezvousOptions`). The README's options table describes each key.

The etcd timeouts' defaults are the etcd client's (:mod:`elastic.etcd.config`); nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from elastic.contract.recovery import RecoveryMode
from elastic.etcd.config import CONNECT_TIMEOUT, OP_TIMEOUT, REQUEST_TIMEOUT

__all__ = [
    "DEFAULTS",
    "DEFAULT_KEY_PREFIX",
    "IGNORED_KEYS",
    "JOB_SERVICE_LAST_CALL_TIMEOUT",
    "KEYS",
    "RECOVERY_MODES",
    "RendezvousConf",
    "format_seconds",
    "ignored_keys_given",
    "parse",
]

#: ``key_prefix``: the etcd prefix under which run ids live.
DEFAULT_KEY_PREFIX = "/torchelastic/rdzv"
#: ``recovery=``: see :class:`~elastic.contract.recovery.RecoveryMode`.
RECOVERY_MODES = tuple(m.value for m in RecoveryMode)
#: Options of torch's former handler that are accepted and ignored (liveness comes from leases now).
IGNORED_KEYS = ("close_timeout", "heartbeat_timeout", "keep_alive_interval", "keep_alive_max_attempt")
#: The job spec's ``rendezvous.last_call_timeout`` default: shorter than a torchrun user's
#: (:attr:`RendezvousConf.last_call_timeout`), the node agents of a job start within moments of each other.
JOB_SERVICE_LAST_CALL_TIMEOUT = timedelta(seconds=5)


@dataclass(frozen=True)
class RendezvousConf:
    """One ``--rdzv-conf`` of the ``etcd-v3`` backend; a field per key, in the order :meth:`to_params` writes
    them. Durations are positive; the file and user fields are None when not given."""

    key_prefix: str = DEFAULT_KEY_PREFIX
    #: once ``min_nodes`` joined, the round completes this long after the latest join
    last_call_timeout: timedelta = timedelta(seconds=10)
    #: ``next_rendezvous`` must complete within it
    join_timeout: timedelta = timedelta(seconds=600)
    #: TTL of each agent's short lease: failure detection and closer takeover time
    node_ttl: timedelta = timedelta(seconds=2)
    #: start-up reachability check of etcd
    connect_timeout: timedelta = CONNECT_TIMEOUT
    #: restart: job-wide rounds, survivors restarted on a membership change; live: see RecoveryMode
    recovery: RecoveryMode = RecoveryMode.RESTART
    ca_cert: str | None = None
    cert: str | None = None
    cert_key: str | None = None
    password_file: str | None = None  # wins over ``password``
    user: str | None = None
    password: str | None = None
    #: TTL of each agent's long lease (the store's keys, a round's assignment and head)
    state_ttl: timedelta = timedelta(seconds=7200)
    request_timeout: timedelta = REQUEST_TIMEOUT  # one gRPC call
    op_timeout: timedelta = OP_TIMEOUT  # one operation, retries across endpoints included
    store_timeout: timedelta = timedelta(seconds=300)  # default timeout of blocking store operations
    #: the closer reads the join count at most this often while a round forms (batches a burst of joins)
    min_wake_interval: timedelta = timedelta(seconds=0.05)

    def to_params(self, *, always: Iterable[str] = ()) -> dict[str, str]:
        """``key -> value`` of the keys whose value is not the default, and of the keys named in ``always``
        (an unset file or user as ``""``), in field order; :func:`parse` reads it back."""
        wanted = set(always)
        unknown = wanted - set(KEYS)
        if unknown:
            raise ValueError(f"not --rdzv-conf keys of the etcd-v3 backend: {', '.join(sorted(unknown))}")
        out: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in wanted or value != getattr(DEFAULTS, f.name):
                out[f.name] = _format(value)
        return out

    def render(self, *, always: Iterable[str] = ()) -> str:
        """``--rdzv-conf``'s ``key=value,key=value`` form of :meth:`to_params`."""
        return ",".join(f"{k}={v}" for k, v in self.to_params(always=always).items())


#: What a torchrun user gets without ``--rdzv-conf``.
DEFAULTS = RendezvousConf()
#: Every key the backend reads (:data:`IGNORED_KEYS` are accepted too).
KEYS = tuple(f.name for f in dataclasses.fields(RendezvousConf))
_DURATIONS = frozenset(f.name for f in dataclasses.fields(RendezvousConf) if isinstance(f.default, timedelta))


def format_seconds(value: timedelta) -> str:
    """A duration as ``--rdzv-conf`` writes it: seconds, ``%g`` (``5``, ``0.05``) unless that would round."""
    seconds = value.total_seconds()
    short = f"{seconds:g}"
    return short if float(short) == seconds else repr(seconds)


def _format(value: object) -> str:
    if isinstance(value, timedelta):
        return format_seconds(value)
    if isinstance(value, RecoveryMode):
        return value.value
    return "" if value is None else str(value)


def _seconds(key: str, raw: str) -> timedelta:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"--rdzv-conf {key}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"--rdzv-conf {key}={raw!r} must be positive")
    try:
        return timedelta(seconds=value)
    except OverflowError:
        raise ValueError(f"--rdzv-conf {key}={raw!r} is too long") from None


def _recovery(raw: str) -> RecoveryMode:
    mode = raw.strip()
    if mode not in RECOVERY_MODES:
        raise ValueError(f"--rdzv-conf recovery={mode!r} is not supported: use one of {', '.join(RECOVERY_MODES)}")
    return RecoveryMode(mode)


def parse(params: Mapping[str, object]) -> RendezvousConf:
    """The options in ``params`` (torchrun's ``RendezvousParameters.config``: values as given on the command
    line, or as Python values). A key that is absent, None or ``""`` keeps its default; keys the backend
    does not read (torch's own, :data:`IGNORED_KEYS`) are left alone. A bad value is a ValueError naming
    its key."""
    given: dict[str, Any] = {}  # key -> its parsed value
    for key in KEYS:
        value = params.get(key)
        if value is None or value == "":
            continue
        raw = value.value if isinstance(value, RecoveryMode) else str(value)
        if key in _DURATIONS:
            given[key] = _seconds(key, raw)
        elif key == "recovery":
            given[key] = _recovery(raw)
        else:  # key_prefix, the files and the user
            given[key] = raw
    return dataclasses.replace(DEFAULTS, **given)


def ignored_keys_given(params: Mapping[str, object]) -> list[str]:
    """The :data:`IGNORED_KEYS` that ``params`` sets (to be logged as unused)."""
    return [key for key in IGNORED_KEYS if params.get(key) not in (None, "")]
