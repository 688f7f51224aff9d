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
from elastic.live.membership import JobFinishedError, LiveMembership, LiveSettings, MembershipError, new_worker_id
from elastic.live.protocol import Generation, LiveKeys, MemberState, ReformReason, StepAttempt, sync_plan
from elastic.live.state_sync import broadcast_state
from elastic.prefork.common import launcher_pid
from elastic.train import console
from elastic.train.config import ElasticConfig, StepInfo
from elastic.train.cursor import TrainingCursor
from elastic.train.parallel import ShardedModel, ShardSources, shard_sources, share_shards
from elastic.train.sampler import ElasticSampler

logger = logging.getLogger(__name__)

__all__ = ["Attempt", "LiveRecovery", "LiveSetupError", "join_live_group", "open_live_group"]


class LiveSetupError(RuntimeError):
    """Live recovery was asked for but the worker's environment does not say where its group lives."""


def open_live_group(config: ElasticConfig, granularity: int = 1) -> LiveGroup:
    """Register this worker in its job's live group (it joins with :meth:`LiveGroup.join`); ``granularity``:
    workers join in whole groups of this many (a sharded model's replica size)."""
    env = WorkerEnv.from_environ()
    if env.live is None:
        raise LiveSetupError(
            f"recovery='live' needs {LIVE_PREFIX}: run under torchrun with --rdzv-backend=etcd-v3 "
            "--rdzv-conf recovery=live, or set it and ETRAIN_LIVE_NODES"
        )
    if env.etcd is None:
        raise LiveSetupError("recovery='live' needs the etcd connection (ETRAIN_ETCD_ENDPOINTS)")
    torchrun = TorchrunEnv.from_environ()
    per_node, local_rank = torchrun.local_world_size, torchrun.local_rank
    # outside the service, the host and the torchrun agent (the worker's launcher): agents sharing a host are nodes
    node = env.job.node_name if env.job is not None else f"{socket.gethostname()}.{launcher_pid()}"
    o = config.live
    settings = LiveSettings(
        env.live.min_nodes * per_node,
        env.live.max_nodes * per_node,
        ttl=o.ttl,
        settle=o.settle,
        last_call=o.last_call,
        join_timeout=o.join_timeout,
        reform_timeout=o.reform_timeout,
        granularity=granularity,
    )
    client = create_client(env.etcd.config())
    keys = LiveKeys(env.live.prefix)
    membership = LiveMembership(client, keys, new_worker_id(node, local_rank), settings, node=node)
    backend = config.resolved_backend()
    device = torch.device("cuda", local_rank) if backend == "nccl" else None
    return LiveGroup(client, keys, membership, backend, config.timeout, device=device)


def join_live_group(config: ElasticConfig, granularity: int = 1) -> tuple[LiveGroup, Generation]:
    """Register (:func:`open_live_group`) and wait to be a member of a generation; exit 0 when the job finished
    before this worker was admitted (nothing to do). The loop's console log is set up first
    (:func:`elastic.train.console.attach`)."""
    console.attach()
    group = open_live_group(config, granularity)
    try:
        return group, group.join()
    except JobFinishedError:
        group.close()
        logger.warning("live group: the job finished before this worker was admitted; nothing to do")
        raise SystemExit(0) from None


@dataclass
class Attempt:
    """The step this worker is working on: its record once it commits."""

    info: StepInfo  # step, epoch, rank, world, indices (lr and loss filled in when applied)
    sampler_before: dict[str, Any]  # the data cursor before the step (to name a dead rank's samples)
    global_batch: int
    applied: bool = False


class LiveRecovery:
    """See the module docstring. ``record`` runs the user's step hook; ``restore_from_storage`` restores
    the newest snapshot into a founded generation (a collective), returning whether there was one.
    ``module``: the replicated module, or the :class:`~elastic.train.parallel.ShardedModel` that each generation
    shards anew (its members keep or receive each shard, see :meth:`_sync_shards`)."""

    def __init__(
        self,
        group: LiveGroup,
        module: torch.nn.Module | ShardedModel,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        cursor: TrainingCursor,
        device: torch.device,
        record: Callable[[StepInfo], None],
        restore_from_storage: Callable[[int, int], bool],
        shared: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
    ) -> None:
        self.group = group
        self._sharding = module if isinstance(module, ShardedModel) else None
        self._replicated = module if isinstance(module, torch.nn.Module) else None
        self._optimizer, self._scheduler = optimizer, scheduler
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
                logger.error(
                    "live group: cannot re-form (%s): falling back to the restart path (exit %d)",
                    exc,
                    EXIT_LIVE_FALLBACK,
                )
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
        logger.warning(
            "live group: re-formed (%s) into generation %d of %d workers in %.3f s; continuing at step %d",
            reason.value,
            gen.number,
            len(gen.members),
            self.last_reform_seconds,
            self._cursor.step,
        )
        return gen

    def after_generation(self, gen: Generation) -> None:
        """Make this member's state the generation's (a collective over the new process group)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        kept = self._build_shards(rank, world) if self._sharding is not None else False
        if gen.reason is ReformReason.FOUNDED:
            # no live member to copy from: the newest snapshot, as a restart would (or a fresh start)
            restored = self._restore_from_storage(rank, world)
            if not restored:
                self._cursor.resize(rank, world)
            if self._replicated is not None:
                broadcast_module(self._replicated)  # identical replicas from the start, as DDP's constructor makes them
            elif not restored:  # each shard index's replicas take replica 0's initial values
                n = self._shards.shard_size
                self._share_shard(ShardSources(tuple(range(n)), (True,) * n), rank, world, joiner=False)
            source = 0
        else:
            source = self._sync(gen, rank, world, kept)
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

    @property
    def _shards(self) -> ShardedModel:
        assert self._sharding is not None
        return self._sharding

    def _build_shards(self, rank: int, world: int) -> bool:
        """Shard the model for this generation (see :class:`ShardedModel`); whether this member kept its shard.
        A world that is no whole number of replicas (a node lost part of its workers) takes the restart path."""
        try:
            return self._shards.build(rank, world)
        except ValueError as exc:
            logger.error(
                "live group: %s: cannot shard the model for this generation; falling back to the restart "
                "path (exit %d)",
                exc,
                EXIT_LIVE_FALLBACK,
            )
            raise SystemExit(EXIT_LIVE_FALLBACK) from exc

    def _sync(self, gen: Generation, rank: int, world: int, kept: bool = False) -> int:
        """Bring every member to the newest applied step; returns the source member's rank."""
        states: list[Any] = [None] * world
        dist.all_gather_object(states, self._member_state())
        plan = sync_plan(states)
        if self._sharding is not None:
            if not self._sync_shards(plan.step, states, rank, world, kept):
                self.recorded, self.recorded_rank = self._cursor.step, None  # rolled back: those steps come again
                return plan.source
        elif plan.broadcast:
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

    def _sync_shards(self, step: int, states: list[Any], rank: int, world: int, kept: bool) -> bool:
        """Each member takes its shard from a member of its replicate group that kept it at ``step`` (the shard
        groups of surviving replicas are untouched). No full replica of ``step`` left: every member restores the
        newest durable snapshot (DCP reshards it) and False is returned; no snapshot either: the restart path."""
        claims: list[Any] = [None] * world
        dist.all_gather_object(claims, kept)
        plan = shard_sources([s.step for s in states], [bool(c) for c in claims], step, self._shards.shard_size)
        if plan is not None:
            self._share_shard(plan, rank, world, joiner=states[rank].step < 0)
            return True
        logger.warning(
            "live group: no full replica of step %d survived; restoring the newest durable snapshot "
            "(resharded for %d workers)",
            step,
            world,
        )
        if not self._restore_from_storage(rank, world):
            logger.error(
                "live group: no durable snapshot to restore the sharded model from; falling back to the "
                "restart path (exit %d)",
                EXIT_LIVE_FALLBACK,
            )
            raise SystemExit(EXIT_LIVE_FALLBACK)
        return False

    def _share_shard(self, plan: ShardSources, rank: int, world: int, joiner: bool) -> None:
        """Within this rank's replicate group, the plan's source sends its shard and the loop's state to the
        others, when any of them needs it (a collective over the group; every group decides alike)."""
        source = plan.sources[rank % self._shards.shard_size]
        started = time.perf_counter()
        loop: dict[str, Any] | None = None
        if rank == source:
            ts = capture_training_state(
                self._cursor.step, torch.nn.Module(), None, self._scheduler, gather_rng=False, **self._cursor.state()
            )
            loop = ts.to_dict()
            loop["rng"] = {source: ts.rng[min(ts.rng)]}
        received = share_shards(self._shards, plan, rank, self._device, loop)
        if received is None or rank == source:
            self._cursor.resize(rank, world)
            return
        ts = TrainingState.from_dict(received)
        restore_training_state(ts, None, None, self._scheduler, restore_rng=joiner, rank=source)
        self._cursor.load(ts, rank, world)
        logger.info(
            "live group: received shard %d of step %d from rank %d in %.3f s",
            rank % self._shards.shard_size,
            ts.step,
            source,
            time.perf_counter() - started,
        )

    def _receive(self, source: int, rank: int, world: int, joiner: bool) -> None:
        assert self._replicated is not None
        started = time.perf_counter()
        payload: Any = None
        if rank == source:
            ts = capture_training_state(
                self._cursor.step,
                self._replicated,
                self._optimizer,
                self._scheduler,
                gather_rng=False,
                **self._cursor.state(),
            )
            payload = ts.to_dict()
            payload["rng"] = {source: ts.rng[min(ts.rng)]}
        received = broadcast_state(payload, source, self._device)
        if rank == source:
            self._cursor.resize(rank, world)
            logger.info(
                "live group: sent the training state of step %d to the members behind in %.3f s",
                self._cursor.step,
                time.perf_counter() - started,
            )
            return
        ts = TrainingState.from_dict(received)
        # a joiner takes the source's RNG state; a member a step behind keeps its own
        restore_training_state(ts, self._replicated, self._optimizer, self._scheduler, restore_rng=joiner, rank=source)
        self._cursor.load(ts, rank, world)
        logger.info(
            "live group: received the training state of step %d from rank %d in %.3f s",
            ts.step,
            source,
            time.perf_counter() - started,
        )

    def _record_late(self, orphans: tuple[int, ...]) -> None:
        a = self.attempt
        if a is None:
            return
        info = replace(a.info, late=True)
        self._record(info)
        self.recorded_rank = info.rank
        for old_rank in orphans:  # a member that died after its samples went into the step's gradients
            # the same kind of sampler (with replacement, its draws per epoch): options() names them all
            sampler = ElasticSampler(self._cursor.sampler.dataset_size, **self._cursor.sampler.options())
            sampler.load_state_dict(a.sampler_before)
            sampler.set_world(old_rank, info.world_size)
            indices = sampler.step_indices(a.global_batch)
            self._record(replace(info, rank=old_rank, indices=indices, loss=None))
