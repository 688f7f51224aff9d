"""``torchrun --rdzv-backend=etcd-v3``: the handler factory registered in the ``torchrun.handlers`` group.

The entry point itself is :func:`elastic.rendezvous.entry.plugin` (a module that imports nothing from
torch, see there), which returns a function calling :func:`create_handler`.

Options come from ``--rdzv-endpoint`` (``host:port[,host:port...]``) and ``--rdzv-conf`` (see the README
table, or :data:`OPTIONS`).
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
)

from elastic import compat
from elastic.etcd import EtcdConfig, EtcdConnectionError, create_client
from elastic.etcd.config import EtcdOptions, read_password_file
from elastic.rendezvous.agent_hooks import run_agent_start_hooks
from elastic.rendezvous.etcd_v3_handler import EtcdV3RendezvousHandler, HandlerSettings
from elastic.rendezvous.protocol import RendezvousKeys, RoundRules

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_KEY_PREFIX", "OPTIONS", "EtcdV3RendezvousHandler", "create_handler"]

DEFAULT_KEY_PREFIX = "/torchelastic/rdzv"

#: ``--rdzv-conf`` keys understood by the ``etcd-v3`` backend, with their defaults.
OPTIONS: dict[str, str] = {
    "key_prefix": DEFAULT_KEY_PREFIX,
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
    # torch's rendezvous settings, with our defaults where they differ from torch's.
    "join_timeout": "600",
    "last_call_timeout": "10",
    # the closer reads the join count at most this often while a round forms (batches a burst of joins)
    "min_wake_interval": "0.05",
}
#: Options of torch's former handler that are accepted and ignored (liveness comes from leases now).
IGNORED_OPTIONS = ("close_timeout", "heartbeat_timeout", "keep_alive_interval", "keep_alive_max_attempt")


def _opt(params: RendezvousParameters, key: str) -> str:
    value = params.get(key, None)
    return str(value) if value not in (None, "") else OPTIONS[key]


def _seconds(params: RendezvousParameters, key: str) -> timedelta:
    raw = _opt(params, key)
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"--rdzv-conf {key}={raw!r} is not a number of seconds") from exc
    if value <= 0:
        raise ValueError(f"--rdzv-conf {key}={raw!r} must be positive")
    return timedelta(seconds=value)


def etcd_config_from_params(params: RendezvousParameters) -> EtcdConfig:
    """The etcd connection settings of a torchrun invocation."""
    if not params.endpoint:
        raise ValueError("--rdzv-endpoint is required for the etcd-v3 backend (host:port[,host:port...])")
    password_file = _opt(params, "password_file")
    try:
        password = read_password_file(password_file) if password_file else _opt(params, "password") or None
    except ValueError as exc:
        raise ValueError(f"--rdzv-conf password_file: {exc}") from exc
    return EtcdOptions(
        endpoints=params.endpoint,
        ca_cert=_opt(params, "ca_cert") or None,
        cert=_opt(params, "cert") or None,
        cert_key=_opt(params, "cert_key") or None,
        user=_opt(params, "user") or None,
        password=password,
        request_timeout=_seconds(params, "request_timeout"),
        op_timeout=_seconds(params, "op_timeout"),
        connect_timeout=_seconds(params, "connect_timeout"),
    ).config()


def _running_under_torchrun_cli() -> bool:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return os.path.basename(sys.argv[0]) == "torchrun" or getattr(spec, "name", "") == "torch.distributed.run"


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the ``etcd-v3`` rendezvous handler for one torchrun agent.

    Fails fast, with one line naming the endpoints, when etcd cannot be reached within
    ``connect_timeout``.
    """
    compat.disable_shared_rdzv_store()  # before torch's agent reads it (see there)
    for key in IGNORED_OPTIONS:
        if params.get(key, None) not in (None, ""):
            logger.info("--rdzv-conf %s is not used by the etcd-v3 rendezvous (liveness comes from leases)", key)

    try:
        compat.check_torch()
    except compat.TorchCompatError as exc:
        if _running_under_torchrun_cli():
            raise SystemExit(f"error: {exc}") from exc
        raise
    config = etcd_config_from_params(params)
    client = create_client(config)
    try:
        client.ping(timeout=config.connect_timeout)
    except EtcdConnectionError as exc:
        client.close()
        message = (
            f"etcd-v3 rendezvous: etcd unreachable at {client.endpoints_label} "
            f"(connect_timeout={config.connect_timeout.total_seconds():g}s)"
        )
        if _running_under_torchrun_cli():
            # torchrun would print a long traceback for an exception: exit with one line instead.
            raise SystemExit(f"error: {message}") from exc
        raise RendezvousConnectionError(message) from exc

    if _running_under_torchrun_cli():
        run_agent_start_hooks(sys.argv)  # e.g. the prefork zygote (see elastic.rendezvous.agent_hooks)
    keys = RendezvousKeys.of(_opt(params, "key_prefix"), params.run_id)
    settings = HandlerSettings(
        rules=RoundRules(params.min_nodes, params.max_nodes, _seconds(params, "last_call_timeout")),
        node_ttl=_seconds(params, "node_ttl"),
        state_ttl=_seconds(params, "state_ttl"),
        join_timeout=_seconds(params, "join_timeout"),
        store_timeout=_seconds(params, "store_timeout"),
        min_wake_interval=_seconds(params, "min_wake_interval"),
    )
    handler = EtcdV3RendezvousHandler(client, params.run_id, keys, settings, local_addr=params.local_addr)
    handler.register()
    return handler
