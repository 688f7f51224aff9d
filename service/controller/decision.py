"""One job's changes during a reconcile pass, and the moves the scheduler makes on a job (pure: no I/O).

:class:`Decision` accumulates the new status, events, assignments to write and to delete of one job; the
reconciler's rules and the placement pass (``service.controller.placement``) change it through its methods,
and :meth:`Decision.update` turns it into the job's share of the plan.

Planned moves (a shrink, a drain, a resize, a preemption) never count as failures. Each takes the nodes away
through the agents' stop: torchrun forwards SIGTERM to the workers, which agree on it at the next step boundary
and save that step synchronously before they exit (``elastic.train.snapshots``), so no step is lost. In the
restart mode the job's remaining nodes then start a new generation (torchrun's ``--nnodes`` range and the
rendezvous are per generation), which resumes from that snapshot; in the live mode the remaining workers keep
their processes and re-form in place without the departed ones.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import datetime
from typing import Any

from service.core.models import Assignment, Event, EventMark, JobStatus, RecoveryMode, rdzv_run_id
from service.core.states import JobState, Trigger, next_state
from service.core.view import ClusterView, JobEntry, JobUpdate

__all__ = ["MAX_EVENT_TEXT", "Decision", "copy_status"]

#: characters kept of an event's message and of each text in its data (a worker-chosen checkpoint path can be long)
MAX_EVENT_TEXT = 1000


def _clip(text: str) -> str:
    if len(text) <= MAX_EVENT_TEXT:
        return text
    return f"{text[:MAX_EVENT_TEXT]}... ({len(text) - MAX_EVENT_TEXT} more characters)"


def _event_id(now: datetime, seq: int) -> str:
    return f"{int(now.timestamp() * 1_000_000):017d}-c{seq:03d}"


def copy_status(status: JobStatus) -> JobStatus:
    """A copy the pass may change: what it changes in place (lists, dicts, ``restarts``) copied, the rest shared
    (a deep copy of every status, its world-size history included, was most of a pass at scale)."""
    return status.model_copy(
        update={
            "nodes": list(status.nodes),
            "world_size_history": list(status.world_size_history),  # appended to; the changes themselves never
            "restarts": status.restarts.model_copy(),
            "node_failures": dict(status.node_failures),
            "blacklist": dict(status.blacklist),
        }
    )


class Decision:
    """Accumulates one job's changes during a reconcile pass."""

    def __init__(self, entry: JobEntry, view: ClusterView, now: datetime, current: dict[str, Assignment]) -> None:
        self.entry = entry
        self.record = entry.record
        self.spec = entry.record.spec
        self.policy = self.spec.restart_policy
        self.view = view
        self.now = now
        self.st = copy_status(entry.status)
        self.events: list[Event] = []
        self._seq = -1  # of this pass's event ids
        self.assign: dict[str, Assignment] = {}
        self.unassign: set[str] = set()
        self.clear_reports = False
        self.clear_report_nodes: set[str] = set()  # nodes whose report of this job is deleted
        self.purge = False
        self.current = current  # node -> this job's assignment there
        self.touched = False  # the placement pass moved this job already (one planned move per job and pass)

    # -- scheduling keys -------------------------------------------------------------------------------
    @property
    def priority(self) -> int:
        return self.spec.priority

    @property
    def user(self) -> str | None:
        return self.record.submitted_by

    @property
    def queue(self) -> str | None:
        return self.spec.queue

    def order(self) -> tuple[int, datetime, str]:
        """Scheduling order: higher priority first, then older."""
        return -self.priority, self.record.created_at, self.record.id

    # -- helpers -------------------------------------------------------------------------------------
    def event(self, kind: str, message: str, **data: Any) -> None:
        """Add an event (message and data texts clipped to :data:`MAX_EVENT_TEXT`). The same type and message as
        the job's newest controller event rewrites that one (``data.repeats``: how many times it happened, its
        ``time`` the latest), so a condition seen on every pass adds nothing."""
        message = _clip(message)
        data = {k: _clip(v) if isinstance(v, str) else v for k, v in data.items()}
        last = self.st.last_event
        if last is not None and (last.type, last.message) == (kind, message):
            count = last.count + 1
            self.events = [e for e in self.events if e.id != last.id]
            self.events.append(
                Event(id=last.id, time=self.now, type=kind, message=message, data={**data, "repeats": count})
            )
            self.st.last_event = last.model_copy(update={"count": count})
            return
        self._seq += 1
        event = Event(id=_event_id(self.now, self._seq), time=self.now, type=kind, message=message, data=data)
        self.events.append(event)
        self.st.last_event = EventMark(id=event.id, type=kind, message=message)

    def move(self, trigger: Trigger, message: str, **data: Any) -> None:
        """Take ``trigger``; a change of state is a ``state`` event with ``old``, ``new`` and ``data`` (the
        structured facts that tools read; the message is for people)."""
        old = self.st.state
        self.st.state = next_state(old, trigger)
        self.st.message = message
        if old != self.st.state:
            self.event(
                "state",
                f"{old.value} -> {self.st.state.value}: {message}",
                old=old.value,
                new=self.st.state.value,
                **data,
            )
        if self.st.state.terminal:
            self.st.finished_at = self.now
            self.release_all()

    def release_all(self) -> None:
        self.unassign |= set(self.current)
        self.assign.clear()
        self.st.nodes = []

    def place(self, nodes: Iterable[str]) -> None:
        for node in nodes:
            self.assign[node] = Assignment(
                job_id=self.record.id,
                generation=self.st.generation,
                spec=self.spec,
                checkpoint_url=self.record.checkpoint_url,
                checkpoint_key=self.record.checkpoint_key,
                owner=self.record.submitted_by,
                assigned_at=self.now,
                rdzv_run=rdzv_run_id(self.record.id, self.st.generation),
            )
            self.unassign.discard(node)

    # -- starting and growing --------------------------------------------------------------------------
    def _new_generation(self, nodes: Collection[str]) -> None:
        """The job's next generation on ``nodes`` (its previous nodes not among them are released)."""
        st = self.st
        dropped = set(st.nodes) - set(nodes)
        st.generation += 1
        st.nodes = sorted(nodes)
        st.backoff_until = None
        st.generation_started_at = self.now
        st.generation_progressed = False
        st.generation_first_step = None
        st.seen_restart_count = 0
        st.failure_seen_at = st.success_seen_at = st.disrupted_at = None
        self.unassign |= dropped
        self.place(st.nodes)

    def start(self, nodes: Collection[str]) -> None:
        """Start a new generation on ``nodes`` (the job holds none)."""
        self._new_generation(nodes)
        st = self.st
        st.started_at = st.started_at or self.now
        st.planned_out = st.lost_owed = 0
        self.touched = True
        self.move(
            Trigger.START,
            f"generation {st.generation} on {len(st.nodes)} node(s): {', '.join(st.nodes)}",
            generation=st.generation,
            nodes=list(st.nodes),
        )

    def grow(self, nodes: Collection[str], why: str | None = None) -> None:
        """Add ``nodes`` to the running generation (torchrun admits them; live mode: they join in place)."""
        st = self.st
        st.lost_owed = max(0, st.lost_owed - len(nodes))
        for node in sorted(nodes):
            if st.planned_out > 0:
                st.planned_out -= 1  # giving back what a planned shrink took: not a membership change
            else:
                st.restarts.membership += 1
            self.event("node_joined", f"node {node} added", node=node)
        st.nodes = sorted([*st.nodes, *nodes])
        st.disrupted_at = self.now
        self.place(nodes)
        self.touched = True
        self.move(
            Trigger.DISRUPT,
            f"scaling up to {len(st.nodes)} node(s) with {', '.join(sorted(nodes))}" + (f" ({why})" if why else ""),
        )

    # -- planned moves ---------------------------------------------------------------------------------
    def _planned(self, kind: str, message: str, **data: Any) -> None:
        """The event of a planned move, with what the timeline needs: the generation and members after it."""
        self.event(kind, message, planned=True, generation=self.st.generation, members=list(self.st.nodes), **data)

    def _go_on(self, keep: Collection[str], add: Collection[str] = ()) -> None:
        """Go on with ``keep`` plus ``add``: a new generation (restart mode), or in place (live mode)."""
        st = self.st
        if self.spec.recovery is RecoveryMode.LIVE:
            dropped = set(st.nodes) - set(keep)
            st.nodes = sorted({*keep, *add})
            self.unassign |= dropped
            self.clear_report_nodes |= dropped
            self.place(add)
        else:
            self._new_generation({*keep, *add})
        st.disrupted_at = self.now

    def shrink(self, nodes: Collection[str], kind: str, reason: str) -> None:
        """Take ``nodes`` away (never below ``min_nodes``: the caller's rule), after a snapshot."""
        st = self.st
        taken = sorted(nodes)
        keep = [n for n in st.nodes if n not in nodes]
        self._go_on(keep)
        st.restarts.planned += len(taken)
        st.planned_out += len(taken)
        self.touched = True
        message = f"{reason}: going on with {len(keep)} node(s) without {', '.join(taken)}"
        self._planned(kind, message, nodes=taken)
        self.move(Trigger.DISRUPT, message)

    def swap(self, nodes: Collection[str], replacements: Collection[str], kind: str, reason: str) -> None:
        """Move off ``nodes`` onto as many ``replacements`` (the job keeps its size), after a snapshot."""
        st = self.st
        keep = [n for n in st.nodes if n not in nodes]
        self._go_on(keep, replacements)
        st.restarts.planned += len(nodes)
        self.touched = True
        message = f"{reason}: moved from {', '.join(sorted(nodes))} to {', '.join(sorted(replacements))}"
        self._planned(kind, message, nodes=sorted(nodes), replacements=sorted(replacements))
        self.move(Trigger.DISRUPT, message)

    def restart_planned(self, nodes: Collection[str], kind: str, reason: str) -> None:
        """A planned restart in a new generation on ``nodes`` (both modes: a resize changes the node range
        torchrun and the live group were started with)."""
        st = self.st
        taken = set(st.nodes) - set(nodes)
        self._new_generation(nodes)
        st.disrupted_at = self.now
        st.restarts.planned += len(taken)
        self.touched = True
        message = f"{reason}: generation {st.generation} on {len(st.nodes)} node(s)"
        self._planned(kind, message, nodes=sorted(taken))
        self.move(Trigger.DISRUPT, message)

    def requeue(self, kind: str, reason: str) -> None:
        """Stop every node after a snapshot (its nodes count as ``planned``); the job waits for nodes again."""
        self.st.restarts.planned += len(self.st.nodes)
        self._release_and_wait(kind, reason)

    def preempt(self, reason: str) -> None:
        """:meth:`requeue` for a higher-priority job: counted once as ``preempted``."""
        self.st.restarts.preempted += 1
        self._release_and_wait("preempted", reason)

    def _release_and_wait(self, kind: str, reason: str) -> None:
        st = self.st
        held = sorted(st.nodes)
        st.planned_out = 0
        self.release_all()
        st.disrupted_at = self.now
        st.backoff_until = None
        self.touched = True
        message = f"{reason}; requeued, waiting for nodes"
        self._planned(kind, message, nodes=held)
        self.move(Trigger.DISRUPT, message)

    @property
    def waiting(self) -> bool:
        """Holds no node and wants to start."""
        return not self.st.nodes and self.st.state in (JobState.PENDING, JobState.RECOVERING)

    # -- result ----------------------------------------------------------------------------------------
    def update(self) -> JobUpdate | None:
        if self.clear_reports or self.purge:  # reports are keyed by node: every node that reported, by name
            self.clear_report_nodes |= set(self.view.reports.get(self.record.id, {}))
        if self.purge:
            return JobUpdate(
                job_id=self.record.id,
                expected_revision=self.entry.status_revision,
                status=None,
                purge=True,
                clear_report_nodes=sorted(self.clear_report_nodes),
            )
        changed = self.st != self.entry.status
        if not (
            changed or self.events or self.assign or self.unassign or self.clear_reports or self.clear_report_nodes
        ):
            return None
        status = None
        if changed or self.events:
            self.st.updated_at = self.now
            status = self.st
        return JobUpdate(
            job_id=self.record.id,
            expected_revision=self.entry.status_revision,
            status=status,
            events=self.events,
            assign=self.assign,
            unassign=sorted(self.unassign),
            clear_reports=self.clear_reports,
            clear_report_nodes=sorted(self.clear_report_nodes),
        )
