"""A job's history as a Chrome trace (Trace Event Format, JSON Object Format): open it in Perfetto
(https://ui.perfetto.dev, "Open trace file") or chrome://tracing.

:func:`job_trace` is pure (no I/O, no clock): it builds the trace from what the service keeps about a job, the
job record, its status, its events, and optionally the latest progress report and the agents' worker reports.
This module replays the events (what is drawn, on which track, and why); writing the trace's events and tracks
is :mod:`service.core.trace_writer`'s.
:func:`validate_trace` checks a trace against the rules of the format this module relies on; it is useful for
any trace (``python -c 'import json,sys; from service.core.trace import validate_trace;
print(validate_trace(json.load(open(sys.argv[1]))))' job.json``).

**Time.** ``ts`` and ``dur`` are integer microseconds *relative* to ``metadata.time_origin`` (the job's
submission, or an earlier event's time if a clock was behind), whose absolute value is also given as
``metadata.time_origin_unix_us``. ``displayTimeUnit`` is ``"ms"``. The times are the controller's (its reconcile
pass that saw something), except the agents' ``torchrun started/exited`` instants and the latest progress
report's counters (the workers' clocks).

**Tracks** (one process, ``pid`` 1, named ``job <id>``; one ``tid`` per track):

* ``controller`` (tid 0): the job's states as complete (``X``) events, ``pending`` / ``running`` /
  ``recovering``, each from the state change that entered it to the next (its ``args.message`` is why); the end
  state (``succeeded``, ``failed``, ``cancelled``) as a process-scoped instant; job-level instants (``submitted``,
  ``cancel requested``, ``world size N``, events of types this module does not know); and the counters.
* ``snapshots`` (tid 1): each committed checkpoint as an instant ``snapshot committed`` (``args.step``,
  ``args.path``) at the time the controller saw the commit, and rejected ones. The service records no begin
  time of a snapshot (only the commit the workers report), so a snapshot is an instant, never a duration; the
  latest report's snapshot counters (``snapshots_saved``, ``snapshots_deferred``, ``snapshots_skipped``,
  ``last_save_seconds``: the elastic loop's; ``local_snapshots_saved``, ``local_snapshots_skipped``,
  ``local_snapshots_failed``: its node-local tier's on rank 0's node) are in ``metadata.snapshot_stats`` and in
  the args of the last commit.
* one track per node that ever ran the job (tids 2.., by name): ``generation N`` complete events, the node's
  membership in each worker generation (from its assignment, at the generation's start or when it was added,
  to its release: node lost, workers failed, the job restarted, stopped or ended; ``args.ended`` says which),
  and inside them ``re-form`` complete events, from a disruption (a node lost or added, live recovery) to the
  first progress report after it (``world size N`` reported, or the job resuming), ``args.outcome`` being
  ``resumed``, ``interrupted`` (the generation ended first) or ``in progress``. Instants with a cause:
  ``workers failed`` (exit code or signal), ``node lost`` (lease expired), ``node blacklisted``,
  ``workers finished``, ``node joined``, and for the current generation the agent's ``torchrun started`` /
  ``torchrun exited``.

**Counters** (``C`` events on the controller track, each with ``args.value``): ``world_size`` (each change the
workers reported), ``step`` (the committed step at each checkpoint commit, a lower bound of the training step
then, and the latest reported step) and ``loss`` (the latest reported loss only).

**What the service does not record, so the trace cannot show** (also in ``metadata.not_recorded``): a per-step
progress history (the trace uses the latest report only: ``step`` has a point per checkpoint plus the latest,
``loss`` one point; the kept series of reports is ``GET /v1/jobs/{id}/metrics``); a snapshot's begin (commits
only); torchrun's rendezvous rounds within a generation and the
workers' own restarts within one (``status.restarts.in_place`` counts them, with no times); the start and exit
of the torchrun of earlier generations (the agents' reports are replaced each generation); and a world size
that did not change across a re-form (the controller records a change only). Generations and re-forms are
replayed from the controller's events' data (a start's ``generation`` and ``nodes``, a move's ``old`` and ``new``);
only an event recorded without them (by a controller before they were written) is read from its message.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from elastic.contract.progress import LOCAL_SNAPSHOT_COUNTERS, SNAPSHOT_COUNTERS, Progress
from service.core.models import Event, JobRecord, JobStatus, RecoveryMode, WorkerReport
from service.core.states import TERMINAL_STATES
from service.core.trace_format import is_int, validate_trace
from service.core.trace_writer import (
    CONTROLLER,
    CONTROLLER_TID,
    FIRST_NODE_TID,
    PID,
    SNAPSHOTS,
    SNAPSHOTS_TID,
    TraceWriter,
    json_safe,
    node_track,
    utc,
)

__all__ = ["CONTROLLER_TID", "FIRST_NODE_TID", "PID", "SNAPSHOTS_TID", "job_trace", "validate_trace"]

_STATE_MESSAGE = re.compile(r"^(\w+) -> (\w+)(?:: (.*))?$", re.DOTALL)
_START = re.compile(r"^generation (\d+) on \d+ node\(s\): (.*)$", re.DOTALL)  # events without data only
_SNAPSHOT_STATS = (*SNAPSHOT_COUNTERS, *LOCAL_SNAPSHOT_COUNTERS)

NOT_RECORDED = [
    "per-step progress history: the trace draws on the latest progress report only ('step' has a point per "
    "checkpoint commit plus the latest report, 'loss' only the latest); the job's kept series of reports is "
    "GET /v1/jobs/{id}/metrics (etrain metrics)",
    "a snapshot's begin time: only commits are recorded (instants, not durations)",
    "torchrun's rendezvous rounds and the workers' in-place restarts within a generation (counted in "
    "status.restarts.in_place, without times)",
    "torchrun start and exit of earlier generations: the agents' reports are replaced at each generation",
    "a re-form that kept the world size: the controller records world-size changes only",
]


def _cause(code: object) -> str:
    if not isinstance(code, int) or isinstance(code, bool):
        return "launch failed (no exit code)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit code {code}"


def _names(value: object) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _move(ev: Event) -> tuple[str, str, str] | None:
    """``(old, new, message)`` of a ``state`` event: its data, else its message ``old -> new: message``."""
    found = _STATE_MESSAGE.match(ev.message)
    message = (found.group(3) or "") if found else ev.message
    old, new = ev.data.get("old"), ev.data.get("new")
    if isinstance(old, str) and isinstance(new, str):
        return old, new, message
    return (found.group(1), found.group(2), message) if found else None


def _is_start(ev: Event, move: tuple[str, str, str]) -> bool:
    """A new generation's start (``Decision.start``'s move, whose data carry ``generation`` and ``nodes``), not a
    resume; an event without them (recorded before the controller wrote them) by its message,
    ``generation N on K node(s): a, b``."""
    return move[1] == "running" and (is_int(ev.data.get("generation")) or move[2].startswith("generation "))


@dataclass
class _Member:
    """A node's open membership in a generation."""

    generation: int
    since: datetime
    how: str  # "start" | "added"


@dataclass
class _Reform:
    since: datetime
    cause: str


class _Builder:
    def __init__(self, record: JobRecord, status: JobStatus, events: Sequence[Event], now: datetime) -> None:
        self.record = record
        self.status = status
        self.now = utc(now)
        self.events = sorted(events, key=lambda e: (utc(e.time), e.id))
        times = [utc(record.created_at)] + ([utc(self.events[0].time)] if self.events else [])
        self.w = TraceWriter(min(times))  # what is drawn: the replay below decides
        self.generation = 0
        self.members: dict[str, _Member] = {}
        self.planned_at: datetime | None = None  # when the last planned move was drawn
        self.reforms: dict[str, _Reform] = {}
        self.notes: list[str] = []
        self.snapshot_seen: tuple[object, object] | None = None  # (step, path) of the last checkpoint event

    # -- node membership ------------------------------------------------------------------------------
    def join(self, node: str, t: datetime, how: str) -> None:
        if node in self.members:
            self.leave(node, t, "superseded")
        self.members[node] = _Member(self.generation, t, how)
        self.w.nodes.add(node)

    def leave(self, node: str, t: datetime, why: str, ongoing: bool = False) -> None:
        member = self.members.pop(node, None)
        if member is None:
            return
        self.end_reform(node, t, "in progress" if ongoing else "interrupted")
        args: dict[str, Any] = {"generation": member.generation, "joined": member.how, "ended": why}
        if ongoing:
            args["ongoing"] = True
        self.w.span(node_track(node), f"generation {member.generation}", member.since, t, args)

    def leave_all(self, t: datetime, why: str, ongoing: bool = False) -> None:
        for node in sorted(self.members):
            self.leave(node, t, why, ongoing)

    def start_reform(self, t: datetime, cause: str) -> None:
        for node in self.members:
            self.reforms.setdefault(node, _Reform(t, cause))

    def end_reform(self, node: str, t: datetime, outcome: str) -> None:
        reform = self.reforms.pop(node, None)
        if reform is not None:
            args = {"cause": reform.cause, "outcome": outcome}
            self.w.span(node_track(node), "re-form", reform.since, t, args, depth=1)

    def end_reforms(self, t: datetime, outcome: str, nodes: list[str] | None = None) -> None:
        for node in sorted(self.reforms):
            if nodes is None or node in nodes:
                self.end_reform(node, t, outcome)

    # -- the replay -----------------------------------------------------------------------------------
    def replay(self, truncated: bool) -> None:
        state: str | None = None if truncated else "pending"
        since, why = utc(self.record.created_at), "submitted"
        events = self.events
        pass_end = [0] * len(events)  # the index after the last event of each event's pass (same time)
        for i in range(len(events) - 1, -1, -1):
            same = i + 1 < len(events) and utc(events[i + 1].time) == utc(events[i].time)
            pass_end[i] = pass_end[i + 1] if same else i + 1
        for i, ev in enumerate(events):
            t = utc(ev.time)
            later = events[i + 1 : pass_end[i]]  # the rest of the controller's pass
            if ev.type == "state":
                moved = self.on_state(ev, t)
                if moved is not None:
                    _, new, message = moved
                    if state is not None:
                        self.w.span(CONTROLLER, state, since, t, {"message": why})
                    state, since, why = new, t, message
                    if new in TERMINAL_STATES:
                        self.w.instant(CONTROLLER, new, t, {"message": message}, scope="p")
            else:
                self.on_event(ev, t, later)
        terminal = state in TERMINAL_STATES or self.status.state.terminal
        end = self.now
        if terminal:
            end = utc(self.status.finished_at) if self.status.finished_at is not None else since
            end = max(end, since)
        if state is not None and state not in TERMINAL_STATES:  # (ended, though its end's event is not among these)
            self.w.span(CONTROLLER, state, since, end, {"message": why, **({} if terminal else {"ongoing": True})})
        if not terminal and sorted(self.members) != sorted(self.status.nodes):
            self.notes.append(
                f"the nodes replayed from the events, {sorted(self.members)}, differ from the "
                f"status's, {sorted(self.status.nodes)}"
            )
        self.leave_all(end, f"job {self.status.state.value}" if terminal else "still running", ongoing=not terminal)

    def on_state(self, ev: Event, t: datetime) -> tuple[str, str, str] | None:
        moved = _move(ev)
        if moved is None:
            self.w.instant(CONTROLLER, "state", t, {"message": ev.message})
            return None
        old, new, message = moved
        if new in TERMINAL_STATES:
            self.leave_all(t, f"job {new}")
        elif _is_start(ev, moved):
            given, nodes = ev.data.get("generation"), _names(ev.data.get("nodes"))
            start = None if is_int(given) and nodes else _START.match(message)  # an event without the data
            generation = given if is_int(given) else int(start.group(1)) if start is not None else self.generation + 1
            if not nodes and start is not None:
                nodes = [n.strip() for n in start.group(2).split(",") if n.strip()]
            self.leave_all(t, "a new generation started")
            self.generation = generation
            for node in nodes:
                self.join(node, t, "start")
        elif old == "recovering" and new == "running":
            self.end_reforms(t, "resumed")
        elif new == "recovering":
            if self.planned_at == t:
                pass  # a planned move's event of this pass has drawn it (``on_planned``)
            elif message.startswith("waiting for nodes"):
                self.leave_all(t, "released: too few nodes left, waiting for nodes")
            elif message.startswith(("re-forming", "live recovery", "scaling up")):
                self.start_reform(t, message)
            else:  # a failure's verdict: every node is released, a new generation follows after the backoff
                self.leave_all(t, f"released: {message}")
        return old, new, message

    def on_planned(self, ev: Event, t: datetime) -> None:
        """A planned move (a shrink, a drain, a resize, a preemption: ``Decision._planned``): the nodes that
        leave, a new generation's or the same generation's members after it, and the re-form it starts."""
        data = ev.data
        members = _names(data.get("members"))
        gen = data.get("generation")
        self.planned_at = t
        self.w.instant(
            CONTROLLER, ev.type, t, {"message": ev.message, "nodes": _names(data.get("nodes")), "members": members}
        )
        if is_int(gen) and gen != self.generation:
            self.leave_all(t, f"{ev.type}: generation {gen} follows")
            self.generation = gen
            for node in members:
                self.join(node, t, "start")
        else:
            for node in [n for n in self.members if n not in members]:
                self.leave(node, t, ev.type)
            for node in [n for n in members if n not in self.members]:
                self.join(node, t, "added")
        if members:
            self.start_reform(t, ev.message)

    def on_event(self, ev: Event, t: datetime, later: list[Event]) -> None:
        data, kind = ev.data, ev.type
        if data.get("planned") is True:
            self.on_planned(ev, t)
            return
        gen = {"generation": self.generation} if self.generation else {}
        node: str | None = data["node"] if isinstance(data.get("node"), str) else None
        # a state change follows in this pass (not the start of a new generation: the release before one leaves
        # no state event when the job was recovering already), and says what became of the job's nodes
        move = next(((e, m) for e in later if e.type == "state" and (m := _move(e)) is not None), None)
        handled = move is not None and not _is_start(*move)
        if kind == "workers_failed":
            codes: dict[str, Any] = data["exit_codes"] if isinstance(data.get("exit_codes"), dict) else {}
            failed = _names(data.get("nodes"))
            for name in failed:
                code = codes.get(name)
                self.w.instant(
                    node_track(name),
                    "workers failed",
                    t,
                    {"cause": _cause(code), "exit_code": code, **gen, "message": ev.message},
                )
                self.leave(name, t, f"workers failed ({_cause(code)})")
            if not handled:  # the job was recovering already: the pass's move left no event; reconcile's rules
                spec = self.record.spec
                live = (
                    spec.recovery is RecoveryMode.LIVE
                    and len(self.members) >= spec.min_nodes
                    and bool(self.members)
                    and all(not isinstance(codes.get(n), int) or codes[n] < 0 for n in failed)
                )
                if live:
                    self.start_reform(t, f"live recovery without {', '.join(failed)}")
                else:
                    self.leave_all(t, "released: restart after the failure")
        elif kind == "node_lost":
            if node is not None:
                self.w.instant(
                    node_track(node),
                    "node lost",
                    t,
                    {"cause": "lease expired (agent gone)", **gen, "message": ev.message},
                )
                self.leave(node, t, "node lost")
            if not handled and not any(e.type == "node_lost" for e in later):
                if len(self.members) < self.record.spec.min_nodes:
                    self.leave_all(t, "released: too few nodes left, waiting for nodes")
                else:
                    self.start_reform(t, ev.message)
        elif kind == "node_joined":
            if node is not None:
                self.join(node, t, "added")
                self.w.instant(node_track(node), "node joined", t, {**gen, "message": ev.message})
            self.start_reform(t, ev.message)
        elif kind == "workers_succeeded":
            for name in _names(data.get("nodes")):
                self.w.instant(node_track(name), "workers finished", t, {**gen, "message": ev.message})
        elif kind == "node_blacklisted":
            track = node_track(node) if node is not None else CONTROLLER
            self.w.instant(track, "node blacklisted", t, {"cause": ev.message})
        elif kind == "world_size":
            size = data.get("world_size")
            nodes = _names(data.get("nodes")) if isinstance(data.get("nodes"), list) else None
            self.w.counter("world_size", t, size)
            self.w.instant(CONTROLLER, f"world size {size}", t, {"world_size": size, "nodes": nodes, **gen})
            self.end_reforms(t, "resumed", nodes or None)
        elif kind == "checkpoint":
            step = data.get("step")
            self.w.instant(SNAPSHOTS, "snapshot committed", t, {"step": step, "path": data.get("path"), **gen})
            self.w.counter("step", t, step)
            self.snapshot_seen = (step, data.get("path"))
        elif kind == "checkpoint_rejected":
            self.w.instant(SNAPSHOTS, "snapshot rejected", t, {"cause": ev.message, "path": data.get("path")})
        else:
            track = node_track(node) if node is not None and node in self.w.nodes else CONTROLLER
            self.w.instant(track, kind.replace("_", " "), t, {"message": ev.message, "data": data})

    # -- what the status, the latest progress and the agents' reports add ----------------------------------
    def latest(self, progress: Progress | None, reports: Mapping[str, WorkerReport]) -> dict[str, Any]:
        st = self.status
        stats: dict[str, Any] = {}
        if progress is not None:
            stats = {k: progress.extra[k] for k in _SNAPSHOT_STATS if k in progress.extra}
        ckpt = st.checkpoint
        if ckpt is not None and self.snapshot_seen != (ckpt.step, ckpt.path):
            # its event is not among those given (truncated): the status still has the latest commit
            args = {"step": ckpt.step, "path": ckpt.path, **({"snapshot_stats": stats} if stats else {})}
            self.w.instant(SNAPSHOTS, "snapshot committed", ckpt.committed_at, args)
            self.w.counter("step", ckpt.committed_at, ckpt.step)
        elif stats:
            committed = self.w.last(SNAPSHOTS, "snapshot committed")
            if committed is not None:
                committed["args"]["snapshot_stats"] = json_safe(stats)
        at: datetime | None = st.progress_at
        step: int | None = st.step
        loss: float | None = st.loss
        if progress is not None and (at is None or progress.time >= at.timestamp()):
            at = datetime.fromtimestamp(progress.time, tz=timezone.utc)
            step, loss = progress.step, progress.loss
        if at is not None:
            self.w.counter("step", at, step)
            self.w.counter("loss", at, loss)
        for node, report in sorted(reports.items()):
            args = {"generation": report.generation, "pid": report.pid}
            if report.started_at is not None:
                self.w.instant(node_track(node), "torchrun started", report.started_at, args)
            if report.finished_at is not None:
                name = "launch failed" if report.state == "launch_failed" else f"torchrun {report.state}"
                self.w.instant(
                    node_track(node),
                    name,
                    report.finished_at,
                    {
                        **args,
                        "state": report.state,
                        "exit_code": report.exit_code,
                        "cause": _cause(report.exit_code) if report.failed else None,
                    },
                )
        return stats

    # -- the trace ----------------------------------------------------------------------------------------
    def trace(self, stats: dict[str, Any], truncated: bool) -> dict[str, Any]:
        st = self.status
        metadata: dict[str, Any] = {
            "job_id": self.record.id,
            "job_name": self.record.spec.name,
            "state": st.state.value,
            "generation": st.generation,
            "nodes": list(st.nodes),
            "time_origin": self.w.origin.isoformat(),
            "time_origin_unix_us": self.w.origin_unix_us,
            "ts_unit": "microseconds since time_origin",
            "exported_at": self.now.isoformat(),
            "events": len(self.events),
            "events_truncated": truncated,
            "tracks": {str(tid): name for tid, name in self.w.track_names().items()},
            "restarts": st.restarts.model_dump(),
            "snapshot_stats": json_safe(stats),
            "not_recorded": NOT_RECORDED,
            "notes": self.notes,
        }
        events = self.w.trace_events(f"job {self.record.id}")
        return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata}


def job_trace(
    record: JobRecord,
    status: JobStatus,
    events: Sequence[Event],
    now: datetime,
    *,
    progress: Progress | None = None,
    reports: Mapping[str, WorkerReport] | None = None,
    events_truncated: bool = False,
) -> dict[str, Any]:
    """The job's history as a Chrome trace ``{"traceEvents", "displayTimeUnit", "metadata"}`` (see the module
    docstring for the tracks, the time base and what is missing). ``events``: the job's events, all of them
    (any order); ``events_truncated``: only the newest were given (then the first state is unknown and is not
    drawn). ``progress``: the latest progress report; ``reports``: the agents' worker reports by node (the
    current generation's). ``now``: where what is still going on ends. Pure: no I/O, no clock."""
    builder = _Builder(record, status, events, now)
    builder.replay(events_truncated)
    stats = builder.latest(progress, reports or {})
    return builder.trace(stats, events_truncated)


# -- validation ------------------------------------------------------------------------------------------
