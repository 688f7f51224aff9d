"""Which job gets which node, after the per-job rules of a reconcile pass (pure: no I/O, no clock).

In order:

1. **Drains.** A job on a node an operator drains moves off it through a planned move (a snapshot first, never a
   failure): onto a free node if one fits, else it shrinks if it stays at or above ``min_nodes``, else it
   requeues. Cordoned and draining nodes get no new placement.
2. **Hot spares** (agents started with ``--spare``) are held back from every other placement: a job that lost
   nodes (``lost_owed``) takes them first, even while it re-forms, up to what it lost.
3. **Resizes.** A running job whose ``min_nodes``/``max_nodes`` changed (``PATCH /v1/jobs/{id}``) restarts in a
   new generation within the new range (a planned restart).
4. **Starts**, highest priority first (then oldest): a job that does not fit on free nodes shrinks running jobs
   of lower priority toward their ``min_nodes`` and, if still short, preempts whole lower-priority jobs (they
   requeue); running jobs of its own priority give up only what they hold above their fair share (the live,
   schedulable nodes divided among the jobs of that priority). Nothing is taken unless the job then starts.
   A job that cannot start does not hold back lower-priority jobs that fit (backfill): they are preempted
   when it can start.
5. **Growth**, highest priority first: within one priority, free nodes go one at a time to the job holding the
   fewest (fair share); then a job below ``max_nodes`` takes nodes that jobs of lower priority hold above their
   ``min_nodes``. Shrunk jobs thus grow back when nodes free up.

Quotas (``ReconcileConfig.quotas``) bound the nodes a user's and a queue's active jobs hold at once. A job is
moved at most once per pass; a job being re-formed (``recovering``) is never a victim: it is left to settle.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from service.controller.capacity import pick_nodes
from service.controller.decision import Decision
from service.controller.recovery import blacklisted_nodes, membership_budget_left
from service.core.models import NodeControl, NodeMode, checkpoint_prefix_owner
from service.core.states import JobState, Trigger
from service.core.view import Quotas

__all__ = ["place_jobs"]


class _Holdings:
    """Nodes held per user and per queue, against their quotas."""

    def __init__(self, quotas: Quotas, decisions: Iterable[Decision]) -> None:
        self.quotas = quotas
        self.users: dict[str, int] = {}
        self.queues: dict[str, int] = {}
        for d in decisions:
            self.add(d, len(d.st.nodes))

    def add(self, d: Decision, n: int) -> None:
        self.users[d.user or ""] = self.users.get(d.user or "", 0) + n
        if d.queue is not None:
            self.queues[d.queue] = self.queues.get(d.queue, 0) + n

    def room(self, d: Decision) -> tuple[int, str | None]:
        """(nodes ``d`` may still add, what limits it: None when unlimited)."""
        user, queue = d.user or "", d.queue or ""
        limits = [
            (self.quotas.user_limit(d.user), self.users.get(user, 0), f"user {user or 'anonymous'}"),
            (self.quotas.queue_limit(d.queue), self.queues.get(queue, 0), f"queue {queue}"),
        ]
        room, why = 1 << 30, None
        for limit, held, who in limits:
            if limit is not None and limit - held < room:
                room, why = limit - held, f"{who} holds {held} of its quota of {limit} node(s)"
        return max(room, 0), why


@dataclass
class _Release:
    victim: Decision
    nodes: tuple[str, ...]
    whole: bool  # a preemption: every node of the victim


class _Pass:
    def __init__(
        self,
        decisions: Sequence[Decision],
        free: dict[str, int],
        claimed: dict[str, str],
        controls: Mapping[str, NodeControl],
        quotas: Quotas,
        spares: Collection[str],
        owners: Mapping[str, str],
    ) -> None:
        self.decisions = sorted(decisions, key=Decision.order)
        self.owners = owners
        self.controls = controls
        self.spares = set(spares)
        self.free = free  # every live node's free slots (controlled ones included: releases count there too)
        self.claimed = claimed
        self.held = _Holdings(quotas, decisions)

    # -- free capacity ---------------------------------------------------------------------------------
    def open_slots(self, spares: bool = False) -> dict[str, int]:
        """Free slots of the nodes that may get new placements (``spares``: the hot spares' too)."""
        return {n: s for n, s in self.free.items() if n not in self.controls and (spares or n not in self.spares)}

    def spare_slots(self) -> dict[str, int]:
        return {n: s for n, s in self.free.items() if n not in self.controls and n in self.spares}

    def release(self, d: Decision, nodes: Collection[str]) -> None:
        for node in nodes:
            if node in self.free:
                self.free[node] += d.spec.nproc_per_node
        self.held.add(d, -len(nodes))

    def take(self, d: Decision, nodes: Collection[str]) -> None:
        for node in nodes:
            self.free[node] -= d.spec.nproc_per_node
        self.held.add(d, len(nodes))

    def avoid(self, d: Decision) -> set[str]:
        """Nodes ``d`` may not be placed on now: blacklisted, held already, or running only another owner's jobs."""
        foreign = {n for n, owner in self.owners.items() if owner != d.user}
        return blacklisted_nodes(d.st, d.now) | set(d.st.nodes) | foreign

    # -- 1. drains -------------------------------------------------------------------------------------
    def drain(self) -> None:
        draining = {n for n, c in self.controls.items() if c.mode is NodeMode.DRAINING}
        if not draining:
            return
        for d in self.decisions:
            on = sorted(draining & set(d.st.nodes))
            if not on or d.touched or d.st.state.terminal:  # touched: settling a failure; drained next pass
                continue
            reason = f"node {', '.join(on)} draining"
            # a swap does not grow the job: its quota is not consulted
            swap = pick_nodes(self.open_slots(), d.spec.nproc_per_node, len(on), exclude=self.avoid(d))
            if swap and len(d.st.nodes) - len(on) + len(swap) >= d.spec.min_nodes:
                self.release(d, on)
                self.take(d, swap)
                d.swap(on, swap, "evacuated", reason)
            elif len(d.st.nodes) - len(on) >= d.spec.min_nodes:
                self.release(d, on)
                d.shrink(on, "evacuated", reason)
            else:
                self.release(d, list(d.st.nodes))
                d.requeue("evacuated", f"{reason} (no other node fits and min_nodes={d.spec.min_nodes})")

    # -- hot spares ------------------------------------------------------------------------------------
    def replace_lost(self) -> None:
        for d in self.decisions:
            st = d.st
            if (
                d.touched
                or st.lost_owed <= 0
                or not st.nodes
                or st.state not in (JobState.RUNNING, JobState.RECOVERING)
            ):
                continue
            want = min(st.lost_owed, d.spec.max_nodes - len(st.nodes), self.held.room(d)[0])
            got = pick_nodes(self.spare_slots(), d.spec.nproc_per_node, want, exclude=self.avoid(d))
            if got:
                self.take(d, got)
                d.grow(got, f"hot spare{'s' if len(got) > 1 else ''} {', '.join(got)} replacing lost nodes")

    # -- 2. resizes ------------------------------------------------------------------------------------
    def resize(self) -> None:
        for d in self.decisions:
            st = d.st
            if d.touched or not st.nodes or st.state not in (JobState.RUNNING, JobState.RECOVERING):
                continue
            ranges = {
                (a.spec.min_nodes, a.spec.max_nodes)
                for n, a in d.current.items()
                if a.generation == st.generation and n in st.nodes
            }
            want = (d.spec.min_nodes, d.spec.max_nodes)
            if not ranges or ranges == {want}:
                continue
            reason = f"resized to {want[0]}-{want[1]} node(s)"
            keep = st.nodes[: d.spec.max_nodes]
            extra: list[str] = []
            if len(keep) < d.spec.min_nodes:
                room = self.held.room(d)[0]
                need = min(d.spec.min_nodes - len(keep), room)
                extra = pick_nodes(self.open_slots(), d.spec.nproc_per_node, need, exclude=self.avoid(d))
            if len(keep) + len(extra) < d.spec.min_nodes:
                self.release(d, list(st.nodes))
                d.requeue("resized", f"{reason}: {len(keep) + len(extra)} node(s) available")
                continue
            self.release(d, [n for n in st.nodes if n not in keep])
            self.take(d, extra)
            d.restart_planned([*keep, *extra], "resized", reason)

    # -- 3. starts -------------------------------------------------------------------------------------
    def fair_share(self, priority: int) -> int:
        nodes = sum(1 for n in self.free if n not in self.controls and n not in self.spares)
        jobs = sum(
            1
            for d in self.decisions
            if d.priority == priority and not d.st.state.terminal and (d.st.nodes or d.waiting)
        )
        return max(1, nodes // max(jobs, 1))

    def victims(self, d: Decision, equal: bool) -> list[tuple[Decision, int]]:
        """(job, the fewest nodes it may be shrunk to) of running jobs ``d`` may take nodes from, the least
        deserving first (lowest priority, then newest)."""
        out = []
        share = self.fair_share(d.priority) if equal else 0
        for v in self.decisions:
            if v is d or v.touched or v.st.state != JobState.RUNNING or not v.st.nodes:
                continue
            if v.priority < d.priority:
                out.append((v, v.spec.min_nodes))
            elif equal and v.priority == d.priority:
                out.append((v, max(v.spec.min_nodes, share)))
        out.sort(key=lambda p: (p[0].priority, -p[0].record.created_at.timestamp(), p[0].record.id))
        return out

    def reclaim(self, d: Decision, want: int, need: int, preempt: bool, equal: bool) -> list[_Release] | None:
        """Releases after which ``d`` finds at least ``need`` (up to ``want``) nodes; None if none do."""
        avoid = self.avoid(d)
        base = self.open_slots()

        def found(chosen: Sequence[_Release]) -> int:
            trial = dict(base)
            freed = {(r.victim.record.id, node): r.victim.spec.nproc_per_node for r in chosen for node in r.nodes}
            for (_, node), slots in freed.items():  # a node a victim gives up twice (shrink, then whole) counts once
                if node in trial:
                    trial[node] += slots
            return len(pick_nodes(trial, d.spec.nproc_per_node, want, exclude=avoid))

        def shrinks(v: Decision, floor: int) -> list[_Release]:
            spare = sorted(v.st.nodes, key=lambda n: (-base.get(n, -(1 << 30)), n))  # the emptiest nodes first
            return [_Release(v, (node,), False) for node in spare[: max(len(v.st.nodes) - floor, 0)]]

        # lower priorities give way first (shrunk, then preempted: only to reach ``need``), then jobs of d's
        # priority above their fair share
        victims = self.victims(d, equal)
        lower = [(v, floor) for v, floor in victims if v.priority < d.priority]
        shrink_lower = [r for v, floor in lower for r in shrinks(v, floor)]
        shrink_equal = [r for v, floor in victims if v.priority == d.priority for r in shrinks(v, floor)]
        whole = [_Release(v, tuple(v.st.nodes), True) for v, _ in lower] if preempt else []

        def take_until(chosen: list[_Release], more: Sequence[_Release], target: int) -> list[_Release]:
            for c in more:
                if found(chosen) >= target:
                    break
                if c not in chosen:
                    chosen = [*chosen, c]
            return chosen

        chosen = take_until([], [*shrink_lower, *whole, *shrink_equal], need)
        if found(chosen) < need:
            return None
        chosen = take_until(chosen, [*shrink_lower, *shrink_equal], want)
        best = found(chosen)
        for c in reversed(list(chosen)):  # keep only what is needed for the same count
            rest = [r for r in chosen if r is not c]
            if found(rest) >= best:
                chosen = rest
        return chosen

    def apply(self, d: Decision, releases: Sequence[_Release]) -> None:
        by_victim: dict[str, tuple[Decision, set[str], bool]] = {}
        for r in releases:
            v, nodes, whole = by_victim.get(r.victim.record.id, (r.victim, set(), False))
            by_victim[r.victim.record.id] = (v, nodes | set(r.nodes), whole or r.whole)
        why = f"for job {d.record.id} (priority {d.priority})"
        for v, nodes, whole in by_victim.values():
            if whole:
                self.release(v, list(v.st.nodes))
                v.preempt(f"preempted {why}")
            else:
                self.release(v, sorted(nodes))
                v.shrink(nodes, "shrunk", f"shrunk {why}")

    def start(self) -> None:
        for d in self.decisions:
            if not d.waiting or d.touched:
                continue
            st = d.st
            if st.backoff_until is not None and d.now < st.backoff_until:
                continue
            own = d.record.checkpoint_url
            conflict = None if own is None else checkpoint_prefix_owner(own, self.claimed, exclude=d.record.id)
            if conflict is not None:
                d.move(Trigger.FAIL, f"checkpoint prefix {own} is in use by job {conflict}")
                continue
            room, why = self.held.room(d)
            if room < d.spec.min_nodes:
                st.message = f"waiting for quota: {why}, min_nodes={d.spec.min_nodes}"
                continue
            want = min(d.spec.max_nodes, room)
            nodes = []
            if st.lost_owed > 0:  # a job that lost its nodes restarts on hot spares first
                nodes = pick_nodes(
                    self.spare_slots(), d.spec.nproc_per_node, min(want, st.lost_owed), exclude=self.avoid(d)
                )
            nodes += pick_nodes(self.open_slots(), d.spec.nproc_per_node, want - len(nodes), exclude=self.avoid(d))
            if len(nodes) < d.spec.min_nodes:
                releases = self.reclaim(d, want, d.spec.min_nodes, preempt=True, equal=True)
                if releases is None:
                    if "requeued" not in st.message:  # why a requeued job waits stays shown until it starts
                        st.message = f"waiting for nodes: {len(nodes)} eligible, min_nodes={d.spec.min_nodes}"
                    continue
                self.apply(d, releases)
                nodes += pick_nodes(
                    self.open_slots(), d.spec.nproc_per_node, want - len(nodes), exclude=self.avoid(d) | set(nodes)
                )
            self.take(d, nodes)
            if own is not None:
                self.claimed[d.record.id] = own
            d.start(nodes)

    # -- 4. growth -------------------------------------------------------------------------------------
    def room_to_grow(self, d: Decision) -> int:
        return min(
            d.spec.max_nodes - len(d.st.nodes),
            membership_budget_left(d.st, d.policy) + d.st.planned_out,
            self.held.room(d)[0],
        )

    def grow(self) -> None:
        levels = sorted({d.priority for d in self.decisions}, reverse=True)
        for level in levels:
            growable = [
                d
                for d in self.decisions
                if d.priority == level
                and not d.touched
                and d.st.state == JobState.RUNNING
                and len(d.st.nodes) < d.spec.max_nodes
            ]
            gains: dict[str, list[str]] = {d.record.id: [] for d in growable}
            while True:  # water-filling: the job holding the fewest nodes first
                open_ = [d for d in growable if self.room_to_grow(d) - len(gains[d.record.id]) > 0]
                open_.sort(key=lambda d: (len(d.st.nodes) + len(gains[d.record.id]), d.order()))
                granted = False
                for d in open_:
                    got = pick_nodes(
                        self.open_slots(), d.spec.nproc_per_node, 1, exclude=self.avoid(d) | set(gains[d.record.id])
                    )
                    if got:
                        self.take(d, got)
                        gains[d.record.id] += got
                        granted = True
                        break
                if not granted:
                    break
            for d in growable:
                want = self.room_to_grow(d) - len(gains[d.record.id])
                if want > 0 and self.victims(d, equal=False):
                    releases = self.reclaim(d, want, 1, preempt=False, equal=False)
                    if releases:
                        self.apply(d, releases)
                        got = pick_nodes(
                            self.open_slots(),
                            d.spec.nproc_per_node,
                            want,
                            exclude=self.avoid(d) | set(gains[d.record.id]),
                        )
                        self.take(d, got)
                        gains[d.record.id] += got
            for d in growable:
                if gains[d.record.id]:
                    d.grow(gains[d.record.id])


def place_jobs(
    decisions: Sequence[Decision],
    free: dict[str, int],
    claimed: dict[str, str],
    controls: Mapping[str, NodeControl],
    quotas: Quotas,
    spares: Collection[str] = (),
    owners: Mapping[str, str] | None = None,
) -> None:
    """Run the placement pass over the jobs still active after the per-job rules (see the module docstring).
    ``free``: live node -> free slots (changed in place); ``claimed``: started job -> checkpoint prefix; ``spares``:
    the hot spares among the live nodes; ``owners``: node -> the one owner whose jobs it runs (an agent that
    cannot give jobs uids of their own, ``--job-owner``): no other owner's job is placed there."""
    p = _Pass(decisions, free, claimed, controls, quotas, spares, owners or {})
    p.drain()
    p.replace_lost()
    p.resize()
    p.start()
    p.grow()
