"""The trainer's live-recovery part: the worker's live group from its environment, and what a worker does at
each step and after each new generation.

:func:`open_live_group` registers the worker in its job's live group: the etcd connection (``ETRAIN_ETCD_*``),
the group's prefix and node range (``ETRAIN_LIVE_*``, written by the ``etcd-v3`` handler with
``recovery=live``), and torchrun's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``.

:class:`LiveRecovery` tracks the step in progress (an *attempt*: applied or not, recorded or not), and when
a generation forms it exchanges every member's :class:`~elastic.live.protocol.MemberState`, lets
:func:`~elastic.live.protocol.sync_plan` decide, copies the state from the source member to those behind
(joiners included) by broadcast, records the steps that committed late, and re-splits data and LR for the
new world through the :class:`~elastic.train.cursor.TrainingCursor`. Everything else of the loop is the
trainer's (:mod:`elastic.train.trainer`).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint.state import TrainingState, capture_training_state, restore_training_state
from elastic.contract.env import LIVE_PREFIX, TorchrunEnv, WorkerEnv
from elastic.etcd import create_client
from elastic.live.grads import broadcast_module
from elastic.live.group import EXIT_LIVE_FALLBACK, LiveGroup, is_peer_failure
from elastic.live.membership import LiveMembership, LiveSettings, MembershipError, new_worker_id
from elastic.live.protocol import Generation, LiveKeys, MemberState, ReformReason, StepAttempt, sync_plan
from elastic.train.config import ElasticConfig, StepInfo
from elastic.train.cursor import TrainingCursor
from elastic.train.sampler import ElasticSampler

logger = logging.getLogger(__name__)

__all__ = ["Attempt", "LiveRecovery", "LiveSetupError", "open_live_group"]


class LiveSetupError(RuntimeError):
    """Live recovery was asked for but the worker's environment does not say where its group lives."""


def open_live_group(config: ElasticConfig) -> LiveGroup:
    """Register this worker in its job's live group (it joins with :meth:`LiveGroup.join`)."""
    env = WorkerEnv.from_environ()
    if env.live is None:
        raise LiveSetupError(f"recovery='live' needs {LIVE_PREFIX}: run under torchrun with --rdzv-backend=etcd-v3 "
                             "--rdzv-conf recovery=live, or set it and ETRAIN_LIVE_NODES")  # fmt: skip
    if env.etcd is None:
        raise LiveSetupError("recovery='live' needs the etcd connection (ETRAIN_ETCD_ENDPOINTS)")
    torchrun = TorchrunEnv.from_environ()
    per_node, local_rank = torchrun.local_world_size, torchrun.local_rank
    node = env.job.node_name if env.job is not None else socket.gethostname()
    o = config.live
    settings = LiveSettings(
        env.live.min_nodes * per_node, env.live.max_nodes * per_node, ttl=o.ttl, settle=o.settle,
        last_call=o.last_call, join_timeout=o.join_timeout, reform_timeout=o.reform_timeout,
    )  # fmt: skip
    client = create_client(env.etcd.config())
    keys = LiveKeys(env.live.prefix)
    membership = LiveMembership(client, keys, new_worker_id(node, local_rank), settings, node=node)
    backend = config.resolved_backend()
    device = torch.device("cuda", local_rank) if backend == "nccl" else None
    return LiveGroup(client, keys, membership, backend, config.timeout, device=device)


@dataclass
class Attempt:
    """The step this worker is working on: its record once it commits."""

    info: StepInfo  # step, epoch, rank, world, indices (lr and loss filled in when applied)
    sampler_before: dict[str, Any]  # the data cursor before the step (to name a dead rank's samples)
    global_batch: int
    applied: bool = False


class LiveRecovery:
    """See the module docstring. ``record`` runs the user's step hook; ``restore_from_storage`` restores
    the newest snapshot into a founded generation (a collective), returning whether there was one."""

    def __init__(
        self,
        group: LiveGroup,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        cursor: TrainingCursor,
        device: torch.device,
        record: Callable[[StepInfo], None],
        restore_from_storage: Callable[[int, int], bool],
        shared: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
    ) -> None:
        self.group = group
        self._module, self._optimizer, self._scheduler = module, optimizer, scheduler
        self._cursor, self._device, self._record = cursor, device, record
        self._restore_from_storage = restore_from_storage
        # (get, set) of per-worker state that decides collectives and must be equal on every member (the
        # snapshot schedule: a joiner's fresh one would take other snapshots than the members' and deadlock)
        self._shared = shared
        self.attempt: Attempt | None = None
        self.recorded = 0  # the newest step whose record this worker wrote
        self.recorded_rank: int | None = None  # this worker's rank in that step's record
        self.has_state = False  # a joiner has none until the first generation's sync
        self.last_reform_seconds: float | None = None

    # -- per step ------------------------------------------------------------------------------------
    def begin(self, info: StepInfo, global_batch: int) -> None:
        self.attempt = Attempt(info, self._cursor.sampler.state_dict(), global_batch)

    def applied(self, lr: float, loss: float | None) -> None:
        if self.attempt is not None:
            self.attempt.info = replace(self.attempt.info, lr=lr, loss=loss)
            self.attempt.applied = True

    def committed(self) -> None:
        if self.attempt is not None:
            self._record(self.attempt.info)
            self.recorded = self.attempt.info.step
            self.recorded_rank = self.attempt.info.rank
        self.attempt = None
        self.group.boundary()

    def joiners_waiting(self, rank: int) -> bool:
        """Rank 0's view: workers wait to be admitted into the next generation (others report False)."""
        gen = self.group.generation
        return rank == 0 and gen is not None and self.group.membership.joiners_waiting(gen)

    # -- generations ---------------------------------------------------------------------------------
    def recover(self, reason: ReformReason, attempts: int = 10) -> Generation:
        """Re-form after a failure or to admit joiners (:meth:`reform`), again while members keep failing as
        the generation forms; the restart path (exit :data:`EXIT_LIVE_FALLBACK`, the agent restarts this
        worker) when no group can form or ``attempts`` re-forms in a row failed."""
        for attempt in range(1, attempts + 1):
            try:
                return self.reform(reason)
            except MembershipError as exc:
                logger.error("live group: cannot re-form (%s): falling back to the restart path (exit %d)", exc,
                             EXIT_LIVE_FALLBACK)  # fmt: skip
                raise SystemExit(EXIT_LIVE_FALLBACK) from exc
            except RuntimeError as exc:  # another member failed while this generation formed
                if not is_peer_failure(exc):
                    raise
                logger.warning("live group: re-forming failed (attempt %d: %s); again", attempt, exc)
                reason = ReformReason.FAILURE
        logger.error("live group: %d re-forms in a row failed: falling back to the restart path", attempts)
        raise SystemExit(EXIT_LIVE_FALLBACK)

    def reform(self, reason: ReformReason) -> Generation:
        """Form the next generation (see :meth:`LiveGroup.reform`) and bring this worker in line with it."""
        started = time.perf_counter()
        self._optimizer.zero_grad(set_to_none=True)  # a dropped step's partial gradients
        gen = self.group.reform(reason)
        if self.group.left_behind:
            self.has_state, self.attempt = False, None
        self.after_generation(gen)
        self.last_reform_seconds = time.perf_counter() - started
        logger.warning("live group: re-formed (%s) into generation %d of %d workers in %.3f s; continuing at step "
                       "%d", reason.value, gen.number, len(gen.members), self.last_reform_seconds,
                       self._cursor.step)  # fmt: skip
        return gen

    def after_generation(self, gen: Generation) -> None:
        """Make this member's state the generation's (a collective over the new process group)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        if gen.reason is ReformReason.FOUNDED:
            # no live member to copy from: the newest snapshot, as a restart would (or a fresh start)
            if not self._restore_from_storage(rank, world):
                self._cursor.resize(rank, world)
            broadcast_module(self._module)  # identical replicas from the start, as DDP's constructor makes them
            source = 0
        else:
            source = self._sync(gen, rank, world)
        if self._shared is not None:
            get, put = self._shared
            box = [get() if rank == source else None]
            dist.broadcast_object_list(box, src=source)
            put(box[0])
        self.attempt = None
        self.has_state = True

    def _member_state(self) -> MemberState:
        a = self.attempt
        attempt = None
        if a is not None:
            attempt = StepAttempt(a.info.step, a.info.rank, a.info.world_size, a.applied)
        step = self._cursor.step if self.has_state else -1
        return MemberState(self.group.wid, step, attempt, self.recorded, self.recorded_rank)

    def _sync(self, gen: Generation, rank: int, world: int) -> int:
        """Bring every member to the newest applied step; returns the source member's rank."""
        states: list[Any] = [None] * world
        dist.all_gather_object(states, self._member_state())
        plan = sync_plan(states)
        if plan.broadcast:
            mine = states[rank]
            self._receive(plan.source, rank, world, joiner=mine.step < 0)
        else:
            self._cursor.resize(rank, world)
        if plan.records_late(rank):
            self._record_late(plan.orphans if rank == plan.late[0] else ())
        elif self.recorded < plan.step:
            self.recorded_rank = None  # the step's record is another member's
        self.recorded = max(self.recorded, plan.step)
        return plan.source

    def _receive(self, source: int, rank: int, world: int, joiner: bool) -> None:
        from elastic.live.state_sync import broadcast_state

        started = time.perf_counter()
        payload: Any = None
        if rank == source:
            ts = capture_training_state(self._cursor.step, self._module, self._optimizer, self._scheduler,
                                        gather_rng=False, **self._cursor.state())  # fmt: skip
            payload = ts.to_dict()
            payload["rng"] = {source: ts.rng[min(ts.rng)]}
        received = broadcast_state(payload, source, self._device)
        if rank == source:
            self._cursor.resize(rank, world)
            logger.info("live group: sent the training state of step %d to the members behind in %.3f s",
                        self._cursor.step, time.perf_counter() - started)  # fmt: skip
            return
        ts = TrainingState.from_dict(received)
        # a joiner takes the source's RNG state; a member a step behind keeps its own
        restore_training_state(ts, self._module, self._optimizer, self._scheduler, restore_rng=joiner, rank=source)
        self._cursor.load(ts, rank, world)
        logger.info("live group: received the training state of step %d from rank %d in %.3f s", ts.step, source,
                    time.perf_counter() - started)  # fmt: skip

    def _record_late(self, orphans: tuple[int, ...]) -> None:
        a = self.attempt
        if a is None:
            return
        info = replace(a.info, late=True)
        self._record(info)
        self.recorded_rank = info.rank
        for old_rank in orphans:  # a member that died after its samples went into the step's gradients
            sampler = ElasticSampler(self._cursor.sampler.dataset_size, seed=self._cursor.sampler.seed,
                                     shuffle=self._cursor.sampler.shuffle)  # fmt: skip
            sampler.load_state_dict(a.sampler_before)
            sampler.set_world(old_rank, info.world_size)
            indices = sampler.step_indices(a.global_batch)
            self._record(replace(info, rank=old_rank, indices=indices, loss=None))
