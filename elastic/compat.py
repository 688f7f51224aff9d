"""The supported torch range, and the one home of everything this project takes from torch's private API.

torch's rendezvous handler has no public hooks for what the ``etcd-v3`` backend changes (waiting on a
watch instead of polling, liveness from leases), so a few private names are used. Each is reached only
through a function here, and :func:`check_torch` verifies all of them at start-up: on a torch outside
:data:`TORCH_REQUIREMENT`, or one whose private layout differs, the agent or worker stops with one line
saying what is wrong instead of training with a silently degraded rendezvous.

What is used, and since which torch it holds (``tests/elastic/test_compat.py`` checks each one on the
installed torch; ``scripts/compat.sh`` runs that and the rendezvous, store, loop, prefork and checkpoint
suites on the oldest and newest torch of the range):

- ``dynamic_rendezvous._delay``: the module function the op executor sleeps in between polls (1 s) while
  a node waits for others; :func:`patch_rendezvous_delay` replaces it.
- ``_RendezvousState`` (the pickled state: ``round``, ``complete``, ``deadline``, ``closed``,
  ``participants``, ``last_heartbeats``) and ``_NodeDesc`` (``addr``, ``pid``): the liveness view rewrites
  heartbeats and the last-call deadline in it.
- ``DynamicRendezvousHandler._state_holder`` (its ``state`` and ``_last_sync_time``) and ``_this_node``.
- ``DynamicRendezvousHandler.from_backend(keep_alive_interval=..., keep_alive_max_attempt=...)``: public,
  but only since torch 2.7; :func:`handler_from_backend` builds the same handler on older torch.
- ``torch.distributed.checkpoint`` ``FsspecReader``/``FsspecWriter``: public since torch 2.15, from the
  private ``_fsspec_filesystem`` module before (:func:`fsspec_checkpoint_io`).
- ``FsspecReader``/``FsspecWriter(path, **storage_options)``: torch 2.6 takes no storage options and builds
  its file system from the URL alone, so :func:`fsspec_dcp_io` rebuilds it (its private ``fs.fs``).
- ``DynamicRendezvousHandler._stop_heartbeats`` and torch 2.6's agent closing the rendezvous when a
  signal stops it (:func:`shutdown_on_death_signal`).
- :func:`destroy_process_group`: not private API, a torch 2.6 deadlock worked around (see there).
- ``dcp.save``/``async_save``/``load(no_dist=...)``: public, but only since torch 2.7; torch 2.6 infers
  it from whether a process group exists (:func:`dcp_no_dist`).
- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``: not private, a knob set for a torch 2.13 hang
  (:func:`disable_shared_rdzv_store`).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from datetime import timedelta
from typing import Any

__all__ = [
    "DISABLE_SHARED_RDZV_STORE",
    "TORCH_BELOW",
    "TORCH_MIN",
    "TORCH_REQUIREMENT",
    "TorchCompatError",
    "UnsupportedTorchError",
    "check_torch",
    "check_torch_version",
    "dcp_no_dist",
    "destroy_process_group",
    "disable_shared_rdzv_store",
    "fsspec_checkpoint_io",
    "fsspec_dcp_io",
    "handler_backend",
    "handler_from_backend",
    "handler_node",
    "handler_state",
    "invalidate_cached_state",
    "parse_version",
    "patch_rendezvous_delay",
    "private_api_problems",
    "shutdown_on_death_signal",
    "stop_heartbeats",
]

#: The oldest supported torch (major, minor), and the first unsupported one. ``pyproject.toml`` states the
#: same range (a test keeps them equal).
TORCH_MIN = (2, 6)
TORCH_BELOW = (2, 16)
TORCH_REQUIREMENT = f"torch>={TORCH_MIN[0]}.{TORCH_MIN[1]},<{TORCH_BELOW[0]}.{TORCH_BELOW[1]}"

#: Fields of torch's ``_RendezvousState`` that the liveness view reads or rewrites.
STATE_FIELDS = ("round", "complete", "deadline", "closed", "participants", "last_heartbeats")
#: Instance attributes of torch's handler and state holder that the handler subclass reads.
HANDLER_FIELDS = ("_this_node", "_state_holder", "_settings")
HANDLER_METHODS = ("_stop_heartbeats",)
STATE_HOLDER_FIELDS = ("_last_sync_time", "_state", "_backend")


class TorchCompatError(RuntimeError):
    """The installed torch cannot be used: outside the supported range, or its private layout differs."""


class UnsupportedTorchError(TorchCompatError):
    """The installed torch's version is outside :data:`TORCH_REQUIREMENT`."""


def parse_version(version: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; ``"2.16.0.dev20261101"`` -> ``(2, 16)``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise TorchCompatError(f"cannot read the torch version {version!r}")
    return int(match.group(1)), int(match.group(2))


def _dynamic_rendezvous() -> Any:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    return dynamic_rendezvous


def _annotations(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        names.update(getattr(klass, "__annotations__", {}))
    return names


def private_api_problems() -> list[str]:
    """What of torch's private API, as this module uses it, the installed torch lacks (empty: all there)."""
    problems: list[str] = []
    try:
        dr = _dynamic_rendezvous()
    except ImportError as exc:  # pragma: no cover - torch without torch.distributed
        return [f"torch.distributed.elastic cannot be imported ({exc})"]
    if not callable(getattr(dr, "_delay", None)):
        problems.append("dynamic_rendezvous._delay (the wait between polls)")
    state_cls = getattr(dr, "_RendezvousState", None)
    if state_cls is None:
        problems.append("dynamic_rendezvous._RendezvousState")
    else:
        missing = [f for f in STATE_FIELDS if f not in _annotations(state_cls)]
        if missing:
            problems.append(f"_RendezvousState fields {', '.join(missing)}")
    node_cls = getattr(dr, "_NodeDesc", None)
    if node_cls is None or not {"addr", "pid"} <= _annotations(node_cls):
        problems.append("dynamic_rendezvous._NodeDesc (addr, pid)")
    missing = [f for f in HANDLER_FIELDS if f not in _annotations(dr.DynamicRendezvousHandler)]
    if missing:
        problems.append(f"DynamicRendezvousHandler attributes {', '.join(missing)}")
    missing = [m for m in HANDLER_METHODS if not callable(getattr(dr.DynamicRendezvousHandler, m, None))]
    if missing:
        problems.append(f"DynamicRendezvousHandler methods {', '.join(missing)}")
    holder_cls = getattr(dr, "_BackendRendezvousStateHolder", None)
    if holder_cls is None or not set(STATE_HOLDER_FIELDS) <= _annotations(holder_cls):
        problems.append(f"dynamic_rendezvous._BackendRendezvousStateHolder ({', '.join(STATE_HOLDER_FIELDS)})")
    if not _from_backend_takes_keep_alive(dr) and not hasattr(dr.DynamicRendezvousHandler, "_node_desc_generator"):
        problems.append("DynamicRendezvousHandler._node_desc_generator (handlers on torch < 2.7)")
    return problems


def check_torch_version(version: str | None = None) -> None:
    """Stop with one line if the installed torch (or ``version``) is outside :data:`TORCH_REQUIREMENT`."""
    if version is None:
        import torch

        version = str(torch.__version__)
    found = parse_version(version)
    if not TORCH_MIN <= found < TORCH_BELOW:
        raise UnsupportedTorchError(
            f"elastic-train supports {TORCH_REQUIREMENT}; the installed torch is {version}: "
            f"install a torch in that range (pip install '{TORCH_REQUIREMENT}')"
        )


def check_torch(version: str | None = None) -> None:
    """:func:`check_torch_version`, then stop with one line if torch lacks the private API used here."""
    check_torch_version(version)
    problems = private_api_problems()
    if problems:
        raise TorchCompatError(
            f"torch {version or 'installed'} lacks what the etcd-v3 rendezvous relies on: "
            f"{'; '.join(problems)} (see elastic/compat.py)"
        )


# -- the wait between polls ---------------------------------------------------------------------------
DelayFunction = Callable[..., None]
_patch_lock = threading.Lock()


def patch_rendezvous_delay(make: Callable[[DelayFunction], DelayFunction]) -> None:
    """Replace ``dynamic_rendezvous._delay`` by ``make(original)``, once per process (later calls do nothing).

    torch's ``_DistributedRendezvousOpExecutor`` calls ``_delay(seconds=1)`` when a node must wait for
    others, and ``_delay(seconds=(low, high))`` for random back-offs.
    """
    dr = _dynamic_rendezvous()
    with _patch_lock:
        if getattr(dr._delay, "_etrain_patched", False):
            return
        replacement = make(dr._delay)
        replacement._etrain_patched = True  # type: ignore[attr-defined]
        dr._delay = replacement


# -- handler internals --------------------------------------------------------------------------------
def handler_state(handler: Any) -> Any:
    """The handler's cached ``_RendezvousState``."""
    return handler._state_holder.state


def handler_node(handler: Any) -> Any:
    """The handler's own ``_NodeDesc`` (``addr``, ``pid``, ``local_id``)."""
    return handler._this_node


def handler_backend(handler: Any) -> Any:
    """The ``RendezvousBackend`` behind a torch ``DynamicRendezvousHandler``."""
    return handler._state_holder._backend


def invalidate_cached_state(handler: Any) -> None:
    """Make the handler's next ``sync`` read the state from the backend instead of its cache."""
    holder = handler._state_holder
    holder._last_sync_time = float("-inf")


def stop_heartbeats(handler: Any) -> None:
    """Stop the handler's keep-alive timer (what ``shutdown`` does before closing the rendezvous)."""
    handler._stop_heartbeats()


def shutdown_on_death_signal() -> bool:
    """Whether the caller runs while torch's agent handles a death signal (SIGTERM, SIGINT, ...).

    torch 2.6's ``LocalElasticAgent._shutdown`` then calls the handler's ``shutdown()``, which closes the
    rendezvous for every node for good, so the survivors of a preempted node exit instead of re-forming.
    torch's launcher deliberately does not close it on a signal ("prevents any additional scaling
    events"), and later agents no longer do. The agent calls it from its ``except SignalException``
    block, so the exception being handled tells.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return isinstance(sys.exc_info()[1], SignalException)


def _from_backend_takes_keep_alive(dr: Any) -> bool:
    return "keep_alive_interval" in inspect.signature(dr.DynamicRendezvousHandler.from_backend).parameters


def handler_from_backend(
    cls: Any,
    run_id: str,
    store: Any,
    backend: Any,
    min_nodes: int,
    max_nodes: int,
    local_addr: str | None,
    timeout: Any,
    *,
    keep_alive_interval: timedelta,
    keep_alive_max_attempt: int,
) -> Any:
    """``cls.from_backend(...)`` with the keep-alive settings, on every supported torch.

    torch >= 2.7 takes them as arguments (whole seconds); torch 2.6 hard-codes 5 s x 3, so the handler is
    built the way its ``from_backend`` builds it, with the settings replaced.
    """
    interval = max(1, round(keep_alive_interval.total_seconds()))  # torch counts whole seconds
    dr = _dynamic_rendezvous()
    if _from_backend_takes_keep_alive(dr):
        return cls.from_backend(
            run_id,
            store,
            backend,
            min_nodes,
            max_nodes,
            local_addr,
            timeout,
            keep_alive_interval=interval,
            keep_alive_max_attempt=keep_alive_max_attempt,
        )
    node = cls._node_desc_generator.generate(local_addr)
    settings = dr.RendezvousSettings(
        run_id,
        min_nodes,
        max_nodes,
        timeout or dr.RendezvousTimeout(),
        keep_alive_interval=timedelta(seconds=interval),
        keep_alive_max_attempt=keep_alive_max_attempt,
    )
    state_holder = dr._BackendRendezvousStateHolder(backend, settings)
    return cls(node, settings, backend.name, store, state_holder)


# -- torch.distributed.checkpoint on fsspec -----------------------------------------------------------
def fsspec_checkpoint_io() -> tuple[type, type]:
    """``(FsspecReader, FsspecWriter)`` of ``torch.distributed.checkpoint``."""
    dcp = importlib.import_module("torch.distributed.checkpoint")
    if not hasattr(dcp, "FsspecReader"):
        dcp = importlib.import_module("torch.distributed.checkpoint._fsspec_filesystem")
    return dcp.FsspecReader, dcp.FsspecWriter


def fsspec_dcp_io(cls: type, path: str, storage_options: dict[str, Any], **kwargs: Any) -> Any:
    """``cls(path, **kwargs)``, an ``FsspecReader``/``FsspecWriter`` (or a subclass), whose file system is
    built with ``storage_options`` (credentials, an S3 endpoint) on every supported torch."""
    takes_options = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(cls).parameters.values())
    if takes_options:
        return cls(path, **kwargs, **storage_options)
    io = cls(path, **kwargs)
    if storage_options:
        from fsspec.core import url_to_fs

        io.fs.fs = url_to_fs(str(path), **storage_options)[0]
    return io


def dcp_no_dist(fn: Callable[..., Any], no_dist: bool) -> dict[str, Any]:
    """Keyword arguments that tell DCP's ``fn`` (``save``, ``async_save``, ``load``) to run in one process.

    ``{"no_dist": no_dist}`` where ``fn`` takes it (torch >= 2.7); torch 2.6 has no such argument and runs
    single-process exactly when no default process group exists, which is when callers here ask for it.
    """
    return {"no_dist": no_dist} if "no_dist" in inspect.signature(fn).parameters else {}


#: How long :func:`destroy_process_group` lets other threads run before the group is destroyed.
GLOO_DRAIN = 0.05


def destroy_process_group(group: Any = None) -> None:
    """``torch.distributed.destroy_process_group(group)``, without torch 2.6's gloo teardown deadlock.

    ``ProcessGroupGloo``'s destructor joins its worker threads while the caller holds the GIL; a worker
    that is still releasing the last collective's work (tensors Python once referenced) waits for the GIL,
    and both hang for good. Seen in the compatibility run on torch 2.6.0 (one run in three of a two-rank
    all-gather followed by the destroy); not on 2.13 or 2.15. Sleeping a moment first lets the worker finish.
    """
    import torch.distributed as dist

    time.sleep(GLOO_DRAIN)
    dist.destroy_process_group(group)


#: torch's switch that keeps the torchrun agent's rendezvous TCPStore from being shared with the workers.
DISABLE_SHARED_RDZV_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def disable_shared_rdzv_store(env: MutableMapping[str, str] | None = None, *, override: bool = False) -> None:
    """Set :data:`DISABLE_SHARED_RDZV_STORE` to ``1`` in ``env`` (default: this process's environment);
    ``override``: replace a value already there (a ``0``), else keep it.

    torch 2.13 hangs on worker restart when the agent shares its TCPStore with the workers (pytorch#135712);
    with the switch, the workers' rank 0 hosts each round's TCPStore instead. torch reads it only in the
    torchrun agent process, in ``DynamicRendezvousHandler`` (``use_agent_store``, which the agent passes to
    its workers as ``TORCHELASTIC_USE_AGENT_STORE``, and ``next_rendezvous``), both after torchrun has built
    the handler: so the etcd-v3 plugin, which sets it when torchrun builds its handler, covers every torchrun
    on that backend, and only a torchrun on another backend (the c10d baselines) needs it set beforehand.
    """
    target = os.environ if env is None else env
    if override:
        target[DISABLE_SHARED_RDZV_STORE] = "1"
    else:
        target.setdefault(DISABLE_SHARED_RDZV_STORE, "1")
