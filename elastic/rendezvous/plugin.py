"""``torchrun --rdzv-backend=etcd-v3``: the handler factory registered in the ``torchrun.handlers`` group.

The entry point itself is :func:`elastic.rendezvous.entry.plugin` (a module that imports nothing from
torch, see there), which returns a function calling :func:`create_handler`.

Options come from ``--rdzv-endpoint`` (``host:port[,host:port...]``) and ``--rdzv-conf`` (see the README
table, or :data:`OPTIONS`).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.api import RendezvousInfo
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from elastic import compat
from elastic.etcd import EtcdConfig, EtcdConnectionError, create_client
from elastic.etcd.config import EtcdOptions, read_password_file
from elastic.rendezvous.agent_hooks import run_agent_start_hooks
from elastic.rendezvous.etcd_v3_backend import DEFAULT_KEY_PREFIX, EtcdV3RendezvousBackend
from elastic.rendezvous.etcd_v3_store import EtcdV3Store

logger = logging.getLogger(__name__)

__all__ = ["OPTIONS", "EtcdV3RendezvousHandler", "create_handler"]

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
    # torch's DynamicRendezvousHandler settings, with our defaults where they differ from torch's.
    "join_timeout": "600",
    "last_call_timeout": "10",
    "close_timeout": "30",
    "heartbeat_timeout": "5",
    "keep_alive_interval": "5",
    "keep_alive_max_attempt": "3",
    "min_wake_interval": "0.1",
}


_local = threading.local()


def _install_watch_delay() -> None:
    """Let etcd-v3 handlers wait on a watch where torch's op executor sleeps 1 s between polls.

    torch's ``_DistributedRendezvousOpExecutor`` calls the module function ``_delay(seconds=1)`` when a
    node has to wait for others. It is replaced, once, by a function that does exactly the same unless
    the calling thread is inside an etcd-v3 ``next_rendezvous`` (a thread-local waiter is set): then it
    returns as soon as the run's keys change in etcd (and at the latest after the same second). Other
    backends in the process (c10d, ...) are unaffected.
    """

    def make(original: compat.DelayFunction) -> compat.DelayFunction:
        def _delay(seconds: float | tuple[float, float]) -> None:
            waiter = getattr(_local, "waiter", None)
            if waiter is None or isinstance(seconds, tuple):
                original(seconds)
            else:
                waiter(timedelta(seconds=seconds))

        return _delay

    compat.patch_rendezvous_delay(make)


class EtcdV3RendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous on the etcd v3 backend.

    Differences from ``DynamicRendezvousHandler``: while waiting for other nodes it blocks on an etcd
    watch instead of polling every second; ``shutdown`` also revokes this agent's lease.
    """

    _etcd_backend: EtcdV3RendezvousBackend
    _min_wake_interval: float = 0.1
    _last_wake: float = 0.0
    _round_members: int = 0

    def _wait_for_change(self, timeout: timedelta) -> None:
        # Wake on a change, but no more often than every ``min_wake_interval``: with many nodes waiting,
        # every join would otherwise wake all of them at once and their reads would starve the writers.
        spacing = self._last_wake + self._min_wake_interval - time.monotonic()
        if spacing > 0:
            time.sleep(spacing)
        changed = self._etcd_backend.wait_for_change(timeout)
        self._last_wake = time.monotonic()
        if changed:
            compat.invalidate_cached_state(self)  # the cached state is stale: read on next sync

    def next_rendezvous(self) -> RendezvousInfo:
        _local.waiter = self._wait_for_change
        try:
            info = super().next_rendezvous()
        finally:
            _local.waiter = None
        self._round_members = len(compat.handler_state(self).participants)
        return info

    def num_nodes_waiting(self) -> int:
        """torch's count, plus one when a member of this node's round has lost its liveness lease.

        torchrun's agent re-forms the group only when a worker fails or a node waits to join. A member that
        vanishes while the survivors' workers do not crash (blocked in a collective or in process-group
        set-up, or peers frozen) would otherwise leave them stuck until a collective timeout; reporting a
        waiting node makes the agent restart its workers and re-form without the lost member.
        """
        waiting = super().num_nodes_waiting()
        if waiting:
            return waiting
        state = compat.handler_state(self)
        members = self._round_members
        # A finished job's agents close the rendezvous before revoking their leases: not a loss.
        lost = members and len(state.participants) < members
        if lost and state.complete and not state.closed and compat.handler_node(self) in state.participants:
            logger.warning(
                "a node of round %d lost its liveness lease (%d of %d members left): re-forming",
                state.round, len(state.participants), members,
            )  # fmt: skip
            return 1
        return 0

    def shutdown(self) -> bool:
        try:
            if compat.shutdown_on_death_signal():
                # torch 2.6's agent closes the rendezvous when a signal stops it; torch's launcher and later
                # agents leave it open, so that the other nodes re-form without this one (whose liveness
                # lease goes below): do as they do.
                compat.stop_heartbeats(self)
                logger.info("stopped by a signal: leaving the rendezvous open for the other nodes")
                return True
            return super().shutdown()
        finally:
            self._etcd_backend.close()


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

    try:
        compat.check_torch()
    except compat.TorchCompatError as exc:
        if _running_under_torchrun_cli():
            raise SystemExit(f"error: {exc}") from exc
        raise
    _install_watch_delay()
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
    backend = EtcdV3RendezvousBackend(
        client,
        params.run_id,
        key_prefix=_opt(params, "key_prefix"),
        state_ttl=_seconds(params, "state_ttl"),
        node_ttl=_seconds(params, "node_ttl"),
    )
    store = EtcdV3Store(
        client,
        backend.key_base + "store",
        timeout=_seconds(params, "store_timeout"),
        lease=backend.state_lease_id,
    )
    timeout = RendezvousTimeout(
        join=_seconds(params, "join_timeout"),
        last_call=_seconds(params, "last_call_timeout"),
        close=_seconds(params, "close_timeout"),
        heartbeat=_seconds(params, "heartbeat_timeout"),
    )
    handler = compat.handler_from_backend(
        EtcdV3RendezvousHandler,
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=_seconds(params, "keep_alive_interval"),
        keep_alive_max_attempt=int(_opt(params, "keep_alive_max_attempt")),
    )
    handler._etcd_backend = backend
    handler._min_wake_interval = float(_opt(params, "min_wake_interval"))
    node = compat.handler_node(handler)
    backend.register_node(node.addr, node.pid)
    atexit.register(backend.close)
    return handler

