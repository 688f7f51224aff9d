"""The supported torch range, and the one home of everything this project takes from torch's private API.

The ``etcd-v3`` rendezvous implements torch's public ``RendezvousHandler`` itself (it no longer subclasses
torch's ``DynamicRendezvousHandler`` or touches its private state). The few private or version-dependent
names left are each reached only through a function here, and :func:`check_torch` verifies the
rendezvous' needs at start-up: on a torch outside :data:`TORCH_REQUIREMENT`, or one whose API differs, the
agent or worker stops with one line saying what is wrong.

What is used, and since which torch it holds (``tests/elastic/test_compat.py`` checks each one on the
installed torch; ``scripts/compat.sh`` runs that and the rendezvous, store, loop, prefork and checkpoint
suites on the oldest and newest torch of the range):

- ``torch.distributed.checkpoint`` ``FsspecReader``/``FsspecWriter``: public since torch 2.15, from the
  private ``_fsspec_filesystem`` module before (:func:`fsspec_checkpoint_io`).
- ``FsspecReader``/``FsspecWriter(path, **storage_options)``: torch 2.6 takes no storage options and builds
  its file system from the URL alone, so :func:`fsspec_dcp_io` rebuilds it (its private ``fs.fs``).
- torch 2.6's agent closing the rendezvous when a signal stops it (:func:`shutdown_on_death_signal`).
- ``RendezvousStoreInfo.build(local_addr=...)``: public, but not on torch 2.6 (:func:`rendezvous_store_info`).
- :func:`destroy_process_group`: not private API, a torch 2.6 deadlock worked around (see there).
- ``dcp.save``/``async_save``/``load(no_dist=...)``: public, but only since torch 2.7; torch 2.6 infers
  it from whether a process group exists (:func:`dcp_no_dist`).
- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``: not private, a knob set for a torch 2.13 hang
  (:func:`disable_shared_rdzv_store`).
- FSDP2's ``FSDPModule``: public in ``torch.distributed.fsdp`` on the supported torch releases; reached
  through :func:`fsdp_module_class`, which falls back to its older home ``torch.distributed._composable.fsdp``
  (:func:`fsdp_modules`, :func:`is_sharded_module`).
- ``torch.cuda.get_per_process_memory_fraction``: public, read where this torch has it
  (:func:`cuda_memory_fraction`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import logging
import os
import re
import sys
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

__all__ = [
    "DISABLE_SHARED_RDZV_STORE",
    "TORCH_BELOW",
    "TORCH_MIN",
    "TORCH_REQUIREMENT",
    "TorchCompatError",
    "UnsupportedTorchError",
    "abort_process_group",
    "check_torch",
    "check_torch_once",
    "check_torch_version",
    "cuda_memory_fraction",
    "dcp_no_dist",
    "default_check_cache",
    "destroy_process_group",
    "disable_shared_rdzv_store",
    "fsdp_module_class",
    "fsdp_modules",
    "fsspec_checkpoint_io",
    "fsspec_dcp_io",
    "is_sharded_module",
    "parse_version",
    "private_api_problems",
    "rendezvous_store_info",
    "shutdown_on_death_signal",
]

#: The oldest supported torch (major, minor), and the first unsupported one. ``pyproject.toml`` states the
#: same range (a test keeps them equal).
TORCH_MIN = (2, 6)
TORCH_BELOW = (2, 16)
TORCH_REQUIREMENT = f"torch>={TORCH_MIN[0]}.{TORCH_MIN[1]},<{TORCH_BELOW[0]}.{TORCH_BELOW[1]}"


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


def private_api_problems() -> list[str]:
    """What the rendezvous needs of torch that the installed torch lacks (empty: all there).

    Only public API is used now (``RendezvousHandler``, ``RendezvousInfo``, ``RendezvousStoreInfo.build``);
    this checks their shape, so that a torch that changed them is refused at start-up with one line.
    """
    problems: list[str] = []
    try:
        from torch.distributed.elastic.rendezvous import RendezvousHandler, api
    except ImportError as exc:  # pragma: no cover - torch without torch.distributed
        return [f"torch.distributed.elastic cannot be imported ({exc})"]
    info = getattr(api, "RendezvousInfo", None)
    if info is None or list(inspect.signature(info).parameters)[:4] != [
        "store",
        "rank",
        "world_size",
        "bootstrap_store_info",
    ]:
        problems.append("rendezvous.api.RendezvousInfo(store, rank, world_size, bootstrap_store_info)")
    store_info = getattr(api, "RendezvousStoreInfo", None)
    if store_info is None or not callable(getattr(store_info, "build", None)):
        problems.append("rendezvous.api.RendezvousStoreInfo.build")
    missing = [
        m
        for m in ("next_rendezvous", "num_nodes_waiting", "set_closed", "is_closed", "shutdown", "get_run_id")
        if not callable(getattr(RendezvousHandler, m, None))
    ]
    if missing:
        problems.append(f"RendezvousHandler methods {', '.join(missing)}")
    return problems


def rendezvous_store_info(rank: int, store: Any, local_addr: str) -> Any:
    """``RendezvousStoreInfo.build(rank, store, local_addr=...)``: rank 0 publishes its address and a free
    port in the round's store, every rank reads them. torch before 2.7 takes no ``local_addr`` (rank 0
    then publishes its FQDN)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    if "local_addr" in inspect.signature(RendezvousStoreInfo.build).parameters:
        return RendezvousStoreInfo.build(rank, store, local_addr=local_addr)
    return RendezvousStoreInfo.build(rank, store)  # type: ignore[call-arg]  # torch 2.6


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


#: the files of a torch installation whose identity (path, inode, size, modification time) stands for it in
#: :func:`check_torch_once`'s record, with this module's own source (a changed check is run again)
_INSTALLATION_FILES = ("__init__.py", "version.py", "distributed/elastic/rendezvous/api.py")
logger = logging.getLogger(__name__)


def default_check_cache() -> Path:
    """Where :func:`check_torch_once` records a passed check: ``$XDG_CACHE_HOME/elastic-train`` (``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "elastic-train"


def _installation_key() -> str | None:
    """A digest naming the torch that ``import torch`` would load, found without importing it (None: not found)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    package = Path(spec.origin).parent
    digest = hashlib.sha256("\0".join((sys.executable, sys.version, spec.origin)).encode())
    try:
        for name in _INSTALLATION_FILES:
            st = (package / name).stat()
            digest.update(f"\0{name}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}".encode())
        digest.update((package / "version.py").read_bytes())
        digest.update(Path(__file__).read_bytes())
    except OSError:
        return None
    return digest.hexdigest()[:40]


def check_torch_once(cache: Path | None = None) -> None:
    """:func:`check_torch` for a process that does not import torch itself (the node agent: its torchrun does),
    run once per torch installation: a pass is recorded in ``cache`` (:func:`default_check_cache`) under a digest
    of the installation (:func:`_installation_key`) and of this module, and a later start that finds it skips
    the check and its import of torch (about 3 CPU seconds). A failed check is never recorded; with torch
    already imported (whose version a caller may have changed), or the installation not found, the check
    always runs. torchrun's own start (:mod:`elastic.rendezvous.plugin`) checks again in any case."""
    from elastic.runtime_dir import private_dir

    key = None if "torch" in sys.modules else _installation_key()
    cache = cache if cache is not None else default_check_cache()
    record = cache / f"torch-ok-{key}"
    if key is not None:
        try:
            private_dir(cache)  # ours alone: a record anyone else could leave is never trusted
            if record.is_file():
                return
        except OSError as exc:
            logger.debug("torch check: no record kept or read in %s: %s", cache, exc)
            key = None
    check_torch()
    if key is not None:
        try:
            record.touch()
        except OSError as exc:  # the check passed; only its record could not be kept
            logger.debug("torch check: cannot record the pass in %s: %s", cache, exc)


# -- agent internals ----------------------------------------------------------------------------------
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


# -- CUDA memory ---------------------------------------------------------------------------------------
def cuda_memory_fraction(device: int) -> float:
    """The share of ``device``'s memory torch's caching allocator may hold in this process
    (``torch.cuda.set_per_process_memory_fraction``; 1.0 where this torch cannot say)."""
    import torch

    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return 1.0 if get is None else float(get(device))


# -- FSDP2 ---------------------------------------------------------------------------------------------
def fsdp_module_class() -> type | None:
    """FSDP2's ``FSDPModule`` (the class ``fully_shard`` mixes into a module), or None where torch has none."""
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            cls = getattr(importlib.import_module(name), "FSDPModule", None)
        except ImportError:  # pragma: no cover - torch without torch.distributed
            continue
        if isinstance(cls, type):
            return cls
    return None  # pragma: no cover - every supported torch has one


def fsdp_modules(model: Any) -> list[Any]:
    """The modules of ``model`` (itself included) that ``fully_shard`` sharded, outermost first."""
    cls = fsdp_module_class()
    if cls is None:  # pragma: no cover
        return []
    return [m for m in model.modules() if isinstance(m, cls)]


def is_sharded_module(model: Any) -> bool:
    """Whether ``model`` or one of its submodules was sharded with FSDP2's ``fully_shard``."""
    return bool(fsdp_modules(model))


#: How long :func:`destroy_process_group` lets other threads run before the group is destroyed.
GLOO_DRAIN = 0.05
#: The torch releases before which :func:`abort_process_group` drains a gloo group too (the deadlock was seen on
#: 2.6.0, in live mode's re-form right after a collective; not on 2.13 or 2.15).
GLOO_DRAIN_BELOW = (2, 7)


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


def abort_process_group() -> bool:
    """Abort the default process group without waiting for its collectives: NCCL's communicators are
    aborted (``torch.distributed.distributed_c10d._abort_process_group``, torch >= 2.6, else the backend's
    ``abort``), so a rank blocked in a collective with a dead peer returns. Returns False where the backend
    has no abort (gloo: its collectives fail by themselves when a peer's connections close); the group is
    then only destroyed."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    backend = dist.get_backend()
    if backend == "nccl":
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            abort()
            return True
        pg = dist.group.WORLD
        import torch

        backend_obj = pg._get_backend(torch.device("cuda"))  # type: ignore[union-attr]
        backend_obj.abort()
        dist.destroy_process_group()
        return True
    import torch

    if parse_version(str(torch.__version__)) < GLOO_DRAIN_BELOW:
        # a healthy group re-formed at a step boundary (live mode admitting a joiner) may still be releasing
        # its last collective's work: torch 2.6's teardown deadlock (see destroy_process_group)
        destroy_process_group()
    else:
        dist.destroy_process_group()  # no collective in flight: nothing to drain
    return False


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
