"""The controller's decisions, as a pure function of what etcd holds and the time.

:func:`reconcile` takes a :class:`ClusterView` (jobs, their status, live nodes, assignments, the agents'
worker reports, the workers' progress) and returns a :class:`Plan`: per job, the new status, events,
assignments to write and to delete. The executor (``service.controller.loop``) applies each job's part in
one fenced etcd transaction. Nothing here reads a clock or does I/O, so every rule is unit-tested.

Per job, in order: terminal jobs only get their leftovers removed; a cancel request wins; progress
reports update step, world size (and its history), the latest committed checkpoint, and end a
recovery; a worker success finishes the job (after the other nodes exit, or a grace period); a worker
failure restarts the job under its failure budget with backoff, crash-loop detection and node blame; a
lost node leaves the job, which re-forms smaller if it keeps ``min_nodes`` or else is stopped to wait;
jobs without nodes start (FIFO) when enough eligible nodes are free; finally running jobs below
``max_nodes`` grow onto the remaining free nodes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone

from service.controller.capacity import free_capacity
from service.controller.decision import Decision
from service.controller.placement import place_jobs
from service.controller.recovery import blame_nodes, judge_failure
from service.controller.retention import retention_over
from service.core.jobs import checkpoint_claims
from service.core.models import (
    MAX_NODES_PER_JOB,
    NODE_NAME_PATTERN,
    Assignment,
    CheckpointInfo,
    RecoveryMode,
    WorkerReport,
    WorldSizeChange,
    checkpoint_url_within,
)
from service.core.states import JobState, Trigger
from service.core.view import ClusterView, JobEntry, JobUpdate, Plan, ReconcileConfig

__all__ = ["reconcile"]

_NODE_NAME = re.compile(NODE_NAME_PATTERN)


def _finished_job(
    entry: JobEntry, view: ClusterView, now: datetime, current: Mapping[str, Assignment], cfg: ReconcileConfig
) -> JobUpdate | None:
    """A terminal job's update: remove its leftovers (assignments, reports), or after the retention delete it.
    Its status never changes, so nothing is copied: finished jobs cost little however many are kept."""
    reported = sorted(view.reports.get(entry.record.id, {}))
    if not current and retention_over(entry, now, cfg):
        return JobUpdate(
            job_id=entry.record.id,
            expected_revision=entry.status_revision,
            status=None,
            purge=True,
            clear_report_nodes=reported,
        )
    if not (current or reported):
        return None
    return JobUpdate(
        job_id=entry.record.id,
        expected_revision=entry.status_revision,
        status=None,
        unassign=sorted(current),
        clear_reports=bool(reported),
        clear_report_nodes=reported,
    )


def _ts(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


def _node_names(reported: Sequence[str]) -> list[str]:
    """The node names among a progress report's ``nodes``: at most ``MAX_NODES_PER_JOB``, each a valid name."""
    return [n for n in reported if _NODE_NAME.fullmatch(n)][:MAX_NODES_PER_JOB]


def _observe_progress(d: Decision, cfg: ReconcileConfig) -> None:
    prog = d.view.progress.get(d.record.id)
    st = d.st
    if prog is None:
        return
    at = _ts(prog.time)
    if st.progress_at is not None and at <= st.progress_at:
        return
    st.steps_per_s = None
    if st.progress_at is not None and st.step is not None and prog.step >= st.step:
        st.steps_per_s = (prog.step - st.step) / (at - st.progress_at).total_seconds()
    st.progress_at, st.step, st.total_steps, st.loss = at, prog.step, prog.total_steps, prog.loss
    if prog.checkpoint_step is not None and (
        st.checkpoint is None
        or (st.checkpoint.step, st.checkpoint.path) != (prog.checkpoint_step, prog.checkpoint_path)
    ):
        path = prog.checkpoint_path
        own = d.record.checkpoint_url
        if path and own and not checkpoint_url_within(path if "://" in path else f"file://{path}", own):
            d.event("checkpoint_rejected", f"checkpoint {path} is outside the job's prefix {own}", path=path)
        else:
            st.checkpoint = CheckpointInfo(step=prog.checkpoint_step, path=path, committed_at=at)
            d.event(
                "checkpoint",
                f"checkpoint committed at step {prog.checkpoint_step}",
                step=prog.checkpoint_step,
                path=path,
            )
    if prog.generation is not None and prog.generation != st.generation:
        return  # a late report of an earlier generation
    if prog.world_size != st.world_size:
        st.world_size = prog.world_size
        # The workers say which nodes the round holds: a re-formed round reports before the controller
        # has seen the lost node's lease expire, while st.nodes still lists it.
        # (kept in the history and the event: only node names, at most a job's largest size, so that no report can
        # make the status too large to write)
        nodes = _node_names(prog.nodes) if prog.nodes is not None else list(st.nodes)
        st.world_size_history.append(
            WorldSizeChange(at=at, world_size=prog.world_size, nodes=nodes, generation=st.generation)
        )
        del st.world_size_history[: -cfg.history_limit]  # bounded: a status must fit an etcd request
        d.event(
            "world_size",
            f"world size {prog.world_size} on {', '.join(nodes) or '-'}",
            world_size=prog.world_size,
            nodes=nodes,
        )
    if prog.restart_count > st.seen_restart_count:
        st.restarts.in_place += prog.restart_count - st.seen_restart_count
        st.seen_restart_count = prog.restart_count
    first = st.generation_first_step
    if first is None:
        st.generation_first_step = prog.step
    elif prog.step > first and not st.generation_progressed:
        st.generation_progressed = True
        st.startup_failures = 0
    if st.state == JobState.RECOVERING and st.nodes and st.disrupted_at is not None and at > st.disrupted_at:
        st.disrupted_at = None
        d.move(Trigger.RESUME, f"running on {len(st.nodes)} node(s), world size {prog.world_size}")


def _handle_outcomes(d: Decision, cfg: ReconcileConfig) -> bool:
    """Success or failure reports of the current generation; True when the job's pass is over."""
    st = d.st
    reports = {
        node: r
        for node, r in d.view.reports.get(d.record.id, {}).items()
        if r.generation == st.generation and node in st.nodes
    }
    live = [n for n in st.nodes if n in d.view.nodes]
    succeeded = sorted(n for n, r in reports.items() if r.succeeded)
    failed = {n: r for n, r in reports.items() if r.failed}
    if succeeded:
        if st.success_seen_at is None:
            st.success_seen_at = d.now
            d.event("workers_succeeded", f"workers finished on {', '.join(succeeded)}", nodes=succeeded)
        running = [n for n in live if n not in reports or reports[n].state == "running"]
        if not running or d.now - st.success_seen_at >= cfg.success_grace:
            d.move(Trigger.SUCCEED, f"finished at step {st.step}" if st.step is not None else "finished")
        return True
    if not failed:
        return False
    if st.failure_seen_at is None:
        st.failure_seen_at = d.now
    not_failed = [n for n in live if n not in failed]
    if not_failed and d.now - st.failure_seen_at < cfg.failure_settle:
        return True  # wait briefly: did the others fail too (job fault) or only these (node fault)?
    first = min(failed.values(), key=lambda r: r.finished_at or d.now)
    st.last_error = (
        f"generation {st.generation} on {first.node}: "
        + (f"exit code {first.exit_code}" if first.exit_code is not None else first.state)
        + (f"\n{first.error}" if first.error else "")
    )
    d.event(
        "workers_failed",
        f"workers failed on {', '.join(sorted(failed))}",
        nodes=sorted(failed),
        exit_codes={n: r.exit_code for n, r in failed.items()},
    )
    verdict = judge_failure(st, d.policy, blame_nodes(failed, not_failed), d.now)
    for node in verdict.newly_blacklisted:
        d.event("node_blacklisted", f"node {node} avoided for {d.policy.blacklist_cooldown}", node=node)
    st.failure_seen_at = None
    if verdict.give_up:
        d.move(Trigger.FAIL, verdict.reason)
        return True
    if _live_drop(d, failed, not_failed):
        return True
    d.release_all()
    st.backoff_until = d.now + verdict.delay
    st.disrupted_at = d.now
    d.move(Trigger.DISRUPT, verdict.reason)
    return True


def _live_drop(d: Decision, failed: Mapping[str, WorkerReport], not_failed: list[str]) -> bool:
    """Live recovery: when some nodes' torchruns died while the others' workers go on, only those nodes leave
    the job (as a lost node does; added again later, in the same generation, by the scale-up), instead of a
    new generation restarting every node's workers. True when done so.

    Only for a torchrun killed by a signal (or one that never started): one that exited by itself after its
    ``--max-restarts`` closed the generation's rendezvous, which no node can join again; then, as when every
    node failed or fewer than ``min_nodes`` would be left, the job restarts in a new generation."""
    if d.spec.recovery is not RecoveryMode.LIVE or not not_failed or len(not_failed) < d.spec.min_nodes:
        return False
    if not all(r.state == "launch_failed" or (r.exit_code is not None and r.exit_code < 0) for r in failed.values()):
        return False
    st = d.st
    dropped = sorted(failed)
    st.nodes = [n for n in st.nodes if n not in failed]
    st.lost_owed += len(dropped)
    d.unassign |= set(dropped)
    d.clear_report_nodes |= set(dropped)  # a stale failure must not count again once the node is back
    st.disrupted_at = d.now
    d.move(
        Trigger.DISRUPT,
        f"live recovery: going on with {len(st.nodes)} node(s) without {', '.join(dropped)}, "
        f"whose torchrun died (failure {st.restarts.failure}/{d.policy.max_failures})",
    )
    return True


def _handle_lost_nodes(d: Decision) -> bool:
    st = d.st
    lost = [n for n in st.nodes if n not in d.view.nodes]
    if not lost:
        return False
    reports = d.view.reports.get(d.record.id, {})
    for node in lost:
        report = reports.get(node)
        if report is not None and report.planned and report.generation == st.generation:
            # its agent stopped on purpose (SIGTERM: scancel, a walltime, a preemption) after stopping this job's
            # torchrun: the job goes on without the node, and its budget for lost nodes is not spent
            st.restarts.planned += 1
            d.event("node_lost", f"node {node} left (its agent stopped: planned)", node=node, planned=True)
            continue
        st.restarts.membership += 1
        d.event("node_lost", f"node {node} left (lease expired)", node=node)
    st.nodes = [n for n in st.nodes if n not in lost]
    st.lost_owed += len(lost)
    d.unassign |= set(lost)
    if st.restarts.membership > d.policy.max_membership_changes:
        d.move(
            Trigger.FAIL,
            f"membership budget exhausted: {st.restarts.membership} changes "
            f"(max_membership_changes={d.policy.max_membership_changes})",
        )
        return True
    st.disrupted_at = d.now
    if len(st.nodes) >= d.spec.min_nodes:
        d.move(Trigger.DISRUPT, f"re-forming on {len(st.nodes)} node(s) after losing {', '.join(lost)}")
    else:
        kept = len(st.nodes)
        d.release_all()
        d.move(Trigger.DISRUPT, f"waiting for nodes: {kept} left, min_nodes={d.spec.min_nodes}")
    return False


def reconcile(view: ClusterView, now: datetime, cfg: ReconcileConfig | None = None) -> Plan:
    """Decide what every job needs at ``now`` (see the module docstring)."""
    cfg = cfg or ReconcileConfig()
    plan = Plan()
    entries = sorted(view.jobs.values(), key=lambda e: (e.record.created_at, e.record.id))
    active = {e.record.id for e in entries if not e.status.state.terminal}
    pairs = [(node, a) for node, jobs in view.assignments.items() for a in jobs.values()]
    free = free_capacity(view.nodes, pairs, active)
    plan.orphans = sorted((node, a.job_id) for node, a in pairs if a.job_id not in view.jobs)
    claimed = checkpoint_claims(entries, started_only=True)  # the prefixes of started jobs; placement adds more
    by_job: dict[str, dict[str, Assignment]] = {}  # job id -> node -> assignment
    for node, a in pairs:
        by_job.setdefault(a.job_id, {})[node] = a
    schedulable: list[Decision] = []  # what the placement pass may schedule, shrink or preempt
    decisions: list[Decision | JobUpdate] = []
    for entry in entries:
        current = by_job.get(entry.record.id, {})
        if entry.status.state.terminal:
            done = _finished_job(entry, view, now, current, cfg)
            if done is not None:
                decisions.append(done)
            continue
        d = Decision(entry, view, now, current)
        decisions.append(d)
        st = d.st
        # leftovers of earlier generations
        for node, a in d.current.items():
            if a.generation != st.generation or node not in st.nodes:
                d.unassign.add(node)
                if node in free:
                    free[node] += a.spec.nproc_per_node
        if entry.cancel_requested:
            d.move(Trigger.CANCEL, "cancelled by request")
            d.clear_reports = bool(view.reports.get(d.record.id))
            _free_released(d, free)
            continue
        failure = view.write_failures.get(d.record.id)
        if failure is not None and failure.count >= cfg.write_failure_limit:
            d.move(Trigger.FAIL, f"etcd refused this job's updates {failure.count} times: {failure.message}")
            _free_released(d, free)
            continue
        _observe_progress(d, cfg)
        schedulable.append(d)
        if _handle_outcomes(d, cfg) or _handle_lost_nodes(d):
            d.touched = True  # settled by its own rules this pass: counted in quotas and shares, never moved
            _free_released(d, free)
            continue
        _free_released(d, free)
        if st.state == JobState.RECOVERING and st.nodes and st.disrupted_at is not None and st.progress_at is None:
            if now - st.disrupted_at >= cfg.resume_after:
                st.disrupted_at = None
                d.move(Trigger.RESUME, f"running on {len(st.nodes)} node(s) (the job reports no progress)")
    spares = [name for name, info in view.nodes.items() if info.spare]
    owners = {name: info.owner for name, info in view.nodes.items() if info.owner is not None}
    place_jobs(
        [d for d in schedulable if not d.st.state.terminal], free, claimed, view.controls, cfg.quotas, spares, owners
    )
    for decided in decisions:
        upd = decided if isinstance(decided, JobUpdate) else decided.update()
        if upd is not None:
            plan.updates.append(upd)
    _order_releases_first(plan)
    return plan


def _order_releases_first(plan: Plan) -> None:
    """An update assigning a node that another job's update of the plan unassigns is applied only after that one
    (``JobUpdate.after``): a release etcd refuses then holds the new assignment back instead of booking the node
    twice."""
    releasing: dict[str, set[str]] = {}
    for upd in plan.updates:
        for node in upd.unassign:
            releasing.setdefault(node, set()).add(upd.job_id)
    for upd in plan.updates:
        upd.after = sorted({job for node in upd.assign for job in releasing.get(node, ()) if job != upd.job_id})


def _free_released(d: Decision, free: dict[str, int]) -> None:
    """Give back the capacity of nodes this job just released (current generation only)."""
    for node in d.unassign:
        a = d.current.get(node)
        if a is not None and a.generation == d.entry.status.generation and node in d.entry.status.nodes:
            if node in free:
                free[node] += a.spec.nproc_per_node
