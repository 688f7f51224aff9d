"""The process group of a job's live group: formed per generation, re-formed in place when it breaks.

:class:`LiveGroup` joins the group (:meth:`~LiveGroup.join`), and after a failure or at a step boundary
with joiners waiting tears the process group down (NCCL: aborted; gloo: its collectives already failed when
the dead peer's connections closed) and builds the next one over a fresh store prefix in etcd with the
ranks of the new generation (:meth:`~LiveGroup.reform`).

The group owns its generation's store (:attr:`LiveGroup.store`) from formation to teardown: torch's C++ side
keeps only the C++ half of a Python ``Store`` (its ``PrefixStore`` wraps it), so a store held by nobody in
Python is collected, and the next call through torch's trampoline (NCCL's lazy communicator set-up at the
first collective, a sub-group's creation) fails with "Not implemented". NCCL groups are also initialised
eagerly (``device_id``), so a broken group fails at formation, not at the first step.

A watchdog covers what gloo cannot: a member whose lease expired (dead or partitioned, connections not
closed) while this process is stuck in a step; it aborts an NCCL group, so the step fails and the group
re-forms, or, under gloo, exits the worker with :data:`EXIT_LIVE_FALLBACK` so that its agent restarts it:
the restart path, logged as such, never a hang.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic import compat
from elastic.contract.env import TorchrunEnv
from elastic.etcd import EtcdClient
from elastic.live.membership import LiveMembership, MembershipError
from elastic.live.protocol import Generation, LiveKeys, ReformReason
from elastic.rendezvous.etcd_v3_store import EtcdV3Store

logger = logging.getLogger(__name__)

__all__ = ["EXIT_LIVE_FALLBACK", "LiveGroup", "LiveGroupFormationError", "is_peer_failure"]

#: The exit status of a worker that falls back to the restart path (its agent restarts it; it re-joins).
EXIT_LIVE_FALLBACK = 75

_MARKERS = (
    "gloo",
    "connection",
    "nccl",
    "timed out",
    "timeout",
    "processgroup",
    "broken pipe",
    "reset by peer",
    "closed",
    "socket",
    "abort",
)


class LiveGroupFormationError(RuntimeError):
    """A generation's process group could not be formed for a reason other than a lost peer (a wrong
    device, a misconfigured NCCL): re-forming would fail the same way."""


def _is_usage_error(exc: BaseException) -> bool:
    """NCCL's own misuse reports ("invalid usage", "invalid argument") mention NCCL but are no lost peer."""
    text = str(exc).lower()
    return "invalid usage" in text or "invalid argument" in text


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a collective, means the group broke (a peer died or was aborted), as
    opposed to an error of the training code itself."""
    if isinstance(exc, LiveGroupFormationError):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(m in text for m in _MARKERS)


class LiveGroup:
    """See the module docstring. ``backend``: ``"gloo"`` or ``"nccl"``; ``timeout``: of the collectives;
    ``device``: this worker's GPU under NCCL (made current, and the communicator is created on it at once)."""

    def __init__(
        self,
        client: EtcdClient,
        keys: LiveKeys,
        membership: LiveMembership,
        backend: str,
        timeout: timedelta,
        store_timeout: timedelta = timedelta(seconds=60),
        device: torch.device | None = None,
    ) -> None:
        self._client, self._keys, self.membership = client, keys, membership
        self._backend, self._timeout, self._store_timeout = backend, timeout, store_timeout
        if backend == "nccl" and (device is None or device.type != "cuda"):
            device = torch.device("cuda", TorchrunEnv.from_environ().local_rank)
        self._device = device if backend == "nccl" else None
        # the current generation's store: torch's C++ side does not keep its Python object alive
        self._store: EtcdV3Store | None = None
        self.generation: Generation | None = None
        self.reforms = 0  # generations this worker went through after its first
        # the last re-form went on without this worker, which then joined a later generation: its state may
        # hold a step the others did again, so it takes theirs, as a joiner does
        self.left_behind = False
        self._boundaries = 0  # step boundaries passed: the watchdog's sign of progress
        self._reforming = False  # between generations (no collective to be stuck in)
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def store(self) -> EtcdV3Store | None:
        """The store of the current generation's process group (None between generations)."""
        return self._store

    @property
    def wid(self) -> str:
        return self.membership.wid

    def join(self) -> Generation:
        """Wait for a generation that includes this worker and form its process group."""
        self._reforming = True
        try:
            gen = self.membership.join()
            self._form(gen)
        finally:
            self._reforming = False
        return gen

    def reform(self, reason: ReformReason) -> Generation:
        """Leave the current process group and form the next generation's (joining a later one when this
        worker came too late for the next). Raises :class:`MembershipError` when no group can form."""
        current = self.generation
        self._teardown()
        if current is None:
            return self.join()
        self._reforming = True  # not in a collective: the watchdog stands aside
        try:
            return self._reform(current, reason)
        finally:
            self._reforming = False

    def _reform(self, current: Generation, reason: ReformReason) -> Generation:
        gen = self.membership.reform(current, reason)
        self.left_behind = gen.rank(self.wid) is None
        if self.left_behind:
            logger.warning("live group: generation %d formed without worker %s; joining the next", gen.number, self.wid)
            gen = self.membership.join()
        self._form(gen)
        self.reforms += 1
        return gen

    def _form(self, gen: Generation) -> None:
        rank = gen.rank(self.wid)
        if rank is None:
            raise MembershipError(f"worker {self.wid} is not a member of generation {gen.number}")
        started = time.perf_counter()
        store = EtcdV3Store(self._client, self._keys.gen_store(gen.number), timeout=self._store_timeout)
        if self._device is not None:  # NCCL: the communicator now (a broken group fails here, not at step 1)
            torch.cuda.set_device(self._device)
        self._store = store  # before init: NCCL calls back into it from C++ (see the module docstring)
        try:
            dist.init_process_group(
                self._backend,
                store=store,
                rank=rank,
                world_size=len(gen.members),
                timeout=self._timeout,
                device_id=self._device,
            )
        except Exception as exc:
            self._teardown()
            if isinstance(exc, RuntimeError) and is_peer_failure(exc) and not _is_usage_error(exc):
                raise  # a member died while the group formed: the caller re-forms
            raise LiveGroupFormationError(
                f"live group: generation {gen.number}'s {self._backend} process group (rank {rank} of "
                f"{len(gen.members)}{', device ' + str(self._device) if self._device is not None else ''}) "
                f"could not be formed: {exc}"
            ) from exc
        self.generation = gen
        logger.info(
            "live group: generation %d (%s) formed in %.3f s: rank %d of %d",
            gen.number,
            gen.reason.value,
            time.perf_counter() - started,
            rank,
            len(gen.members),
        )

    def _teardown(self) -> None:
        if dist.is_initialized():
            try:
                compat.abort_process_group()
            except Exception:  # a broken group may fail its own teardown: the next one does not need it
                logger.warning("live group: tearing down the broken process group failed", exc_info=True)
        self._store = None  # the group that called back into it is gone

    # -- the watchdog --------------------------------------------------------------------------------
    def boundary(self) -> None:
        """The loop passed a step boundary (the watchdog's sign that collectives complete)."""
        self._boundaries += 1

    def start_watchdog(self, grace: timedelta, on_stuck: Callable[[], None] | None = None) -> None:
        """Watch the members' leases: a member gone for ``grace`` while no step boundary passed means this
        worker is stuck in a collective with it; abort (NCCL) or fall back to a restart (gloo)."""
        self._watchdog = threading.Thread(target=self._watch, args=(grace, on_stuck), name="live-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self, grace: timedelta, on_stuck: Callable[[], None] | None) -> None:
        missing_since: float | None = None
        seen_boundaries = -1
        while not self._stop.wait(0.25):
            gen = self.generation
            if gen is None:
                continue
            try:
                alive = self.membership.alive()
            except Exception:
                logger.debug("live watchdog: could not read the workers", exc_info=True)
                continue
            gone = [m for m in gen.members if m not in alive]
            if not gone or self._boundaries != seen_boundaries or self._reforming:
                missing_since = time.monotonic() if gone else None
                seen_boundaries = self._boundaries
                continue
            if missing_since is not None and time.monotonic() - missing_since >= grace.total_seconds():
                logger.error(
                    "live group: member(s) %s of generation %d lost their lease and no step completed "
                    "for %.1f s: stuck in a collective with them",
                    ", ".join(gone),
                    gen.number,
                    grace.total_seconds(),
                )
                if on_stuck is not None:
                    on_stuck()
                    missing_since = time.monotonic()
                    continue
                if self._backend == "nccl":
                    compat.abort_process_group()
                    missing_since = time.monotonic()
                    continue
                logger.error(
                    "live group: gloo cannot abort a collective: falling back to the restart path (exit %d; the "
                    "agent restarts this worker, which re-joins)",
                    EXIT_LIVE_FALLBACK,
                )
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os._exit(EXIT_LIVE_FALLBACK)

    def close(self, finished: bool = False) -> None:
        """Leave the group; ``finished``: the job is done (rank 0 marks it, so that late joiners exit)."""
        self._stop.set()
        if dist.is_initialized() and self._store is not None:
            self._teardown()  # the caller left the group up: its store may not go before it
        self._store = None
        if finished:
            try:
                self.membership.finish()
            except MembershipError:
                logger.warning("live group: could not mark the job finished", exc_info=True)
        self.membership.close()
