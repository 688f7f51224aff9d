"""The chaos suite's pass conditions, as functions of what a run left behind (records, final files,
checkpoints, the API's view of the job over time). Each returns a list of violations (empty: passed).

Records are the JSON lines ``elastic/testing/train_worker.py`` writes per rank and committed step
(``step, epoch, rank, world, lr, indices, restart, t, attempt, gen, late, pid, agent, digest``); an
*attempt* is one worker group (one rendezvous round). After a failure the group resumes from a snapshot, so
steps after it are done again: the *effective* trajectory keeps, for each step, the records of the last
attempt that committed it.

In live recovery (``recovery: live``) an attempt is one generation of the workers' own group (``gen<N>``,
made unique per job generation by :func:`label_live_attempts`): a re-form continues from the newest step
any member applied, so nothing is done twice and each step has one record set, by one generation. A step
that a generation applied when a member failed is recorded after the re-form, with ``late`` true, by the
survivors for themselves and for the dead (its rank in that step, the survivor's pid); such records
complete the step's world but say nothing of the recording process (its pid, its digest then). Only a
generation *founded* anew (no live member left: the restart path) resumes from storage and re-does steps.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from elastic.checkpoint import CheckpointError, CheckpointOptions, create_checkpoint_manager
from elastic.testing.torchrun import read_jsonl

Record = dict[str, Any]


def read_records(rec: Path) -> list[Record]:
    out: list[Record] = []
    for f in sorted(rec.glob("rank*.jsonl")):
        out.extend(read_jsonl(f))
    return out


class RecordReader:
    """:func:`read_records` of ``rec`` for a poller: each file is read on from where the last call stopped,
    instead of parsing every record again (the runner reads them several times a second, some 3,000 records by
    the short form's end). Returns copies; safe from several threads."""

    def __init__(self, rec: Path) -> None:
        self.rec = rec
        self._files: dict[Path, tuple[int, list[Record]]] = {}  # file -> (bytes consumed, its whole lines' records)
        self._lock = threading.Lock()

    def __call__(self) -> list[Record]:
        out: list[Record] = []
        with self._lock:
            for f in sorted(self.rec.glob("rank*.jsonl")):
                offset, records = self._files.get(f, (0, []))
                try:
                    with f.open("rb") as fh:
                        fh.seek(offset)
                        data = fh.read()
                except FileNotFoundError:
                    data = b""
                end = data.rfind(b"\n") + 1  # whole lines are consumed; a last line without its newline is not
                for line in data[:end].splitlines():
                    with contextlib.suppress(json.JSONDecodeError):  # a line cut by a kill
                        records.append(json.loads(line))
                self._files[f] = (offset + end, records)
                out.extend(dict(r) for r in records)
                with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):  # as read_jsonl: if whole
                    if data[end:].strip():
                        out.append(json.loads(data[end:]))
        return out


def effective(records: Iterable[Record]) -> dict[int, list[Record]]:
    """For each step, the records of the last attempt that committed it (earlier ones were rolled back)."""
    by_step: dict[int, dict[str, list[Record]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_step[r["step"]][r["attempt"]].append(r)
    return {step: max(attempts.values(), key=lambda rs: max(r["t"] for r in rs)) for step, attempts in by_step.items()}


def resume_points(records: Iterable[Record]) -> dict[str, int]:
    """For each attempt, the step it resumed from (its first committed step - 1)."""
    first: dict[str, int] = {}
    for r in records:
        first[r["attempt"]] = min(first.get(r["attempt"], r["step"]), r["step"])
    return {attempt: step - 1 for attempt, step in first.items()}


def check_exactly_once(records: list[Record], samples: int, epochs: int, steps_per_epoch: int) -> list[str]:
    """Steps 1..N each committed once in the effective trajectory, by every rank of its world, and every
    sample seen exactly once per epoch."""
    eff = effective(records)
    problems: list[str] = []
    steps = sorted(eff)
    expected = epochs * steps_per_epoch
    if steps != list(range(1, expected + 1)):
        missing = sorted(set(range(1, expected + 1)) - set(steps))
        problems.append(f"effective steps are not 1..{expected}: {len(steps)} steps, missing {missing[:10]}")
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for s in steps:
        rs = eff[s]
        world = rs[0]["world"]
        ranks = sorted(r["rank"] for r in rs)
        if ranks != list(range(world)):
            problems.append(f"step {s}: ranks {ranks} recorded for a world of {world}")
        for r in rs:
            per_epoch[r["epoch"]].extend(r["indices"])
    for epoch in range(epochs):
        seen = per_epoch.get(epoch, [])
        if sorted(seen) != list(range(samples)):
            counts: dict[int, int] = defaultdict(int)
            for i in seen:
                counts[i] += 1
            twice = sum(1 for c in counts.values() if c > 1)
            never = samples - len(counts)
            problems.append(f"epoch {epoch}: {twice} samples seen more than once, {never} never")
    return problems


def check_replicas_identical(rec: Path, live: bool = False) -> list[str]:
    """Every rank of the attempt that finished wrote the same final parameters. ``live``: the attempt is the
    live group's generation (``gen``; each node's torchrun round is a world of its own there)."""
    finals = {int(p.name.split(".")[1][4:]): json.loads(p.read_text()) for p in rec.glob("final.rank*.json")}
    if 0 not in finals:
        return ["rank 0 wrote no final state"]
    field = "gen" if live else "attempt"
    attempt, world = finals[0][field], finals[0]["world"]
    ranks = sorted(r for r, f in finals.items() if f[field] == attempt)
    if ranks != list(range(world)):
        return [f"final state of ranks {ranks} only, for a world of {world}"]
    ref = torch.load(rec / "final_params.rank0.pt")
    problems = []
    for r in ranks[1:]:
        other = torch.load(rec / f"final_params.rank{r}.pt")
        if ref.keys() != other.keys() or not all(torch.equal(ref[k], other[k]) for k in ref):
            problems.append(f"rank {r}'s final parameters differ from rank 0's")
    return problems


def check_resumed_snapshots_verify(
    records: list[Record],
    checkpoint_url: str,
    storage_options: Mapping[str, Any] | None = None,
    skip: Iterable[int] = (),
    live: bool = False,
) -> tuple[list[str], int]:
    """Every snapshot an attempt resumed from still verifies (checksums) and holds that step: what was
    loaded was a complete, committed snapshot, never a torn one. Returns the problems and how many
    resume points were checked. Attempts that resumed from a node-local snapshot are not re-checked here
    (keep_last=1 has replaced it since); the worker verified its sha256 on load, and a wrong state would
    fail the exactly-once and identical-replica checks."""
    points = sorted(set(durable_resume_points(records, live)) - set(skip))
    problems: list[str] = []
    manager = create_checkpoint_manager(checkpoint_url, CheckpointOptions(storage_options=dict(storage_options or {})))
    try:
        for step in points:
            problems += verify_snapshot(manager, step, f"resumed from step {step}, whose snapshot")
    finally:
        manager.close()
    return problems, len(points)


def durable_resume_points(records: Iterable[Record], live: bool = False) -> dict[int, str]:
    """The steps attempts resumed from out of the durable store (step -> the first such attempt); not those
    that started fresh or resumed from a node-local snapshot. ``live``: only founded generations
    (:func:`founded_attempts`) resumed from storage; a re-formed one continued from its members' state."""
    records = list(records)
    local = {r["attempt"] for r in records if r.get("resumed_from") == "node-local"}
    founded = founded_attempts(records) if live else None
    out: dict[int, str] = {}
    for attempt, step in resume_points(records).items():
        if step > 0 and attempt not in local and (founded is None or attempt in founded):
            out.setdefault(step, attempt)
    return out


# -- live recovery -----------------------------------------------------------------------------------------
def _proc(r: Record) -> tuple[Any, int]:
    """One worker process: its node (the agent's name) and pid."""
    return r.get("agent"), r["pid"]


def label_live_attempts(records: list[Record], generation_starts: Iterable[tuple[float, int]]) -> list[Record]:
    """Live recovery: the records with ``attempt`` ``g<G>.gen<N>``, G the job generation the recording process
    ran in. Each job generation is a torchrun run of its own (run id ``<job>-g<G>``) whose live group numbers
    its generations from 1 again, so ``gen<N>`` alone may name two groups. ``generation_starts``: ``(unix
    time, G)`` of each job generation's start; a process belongs to the newest one started before its first
    record. Records are copied, not changed."""
    starts = sorted(generation_starts)
    first: dict[tuple[Any, int], float] = {}
    for r in records:
        key = _proc(r)
        first[key] = min(first.get(key, r["t"]), r["t"])

    def generation(t: float) -> int:
        return max((g for at, g in starts if at <= t), default=starts[0][1] if starts else 1)

    return [{**r, "attempt": f"g{generation(first[_proc(r)])}.{r['attempt']}"} for r in records]


def founded_attempts(records: Iterable[Record]) -> set[str]:
    """Live recovery: the generations founded anew (from storage, or a fresh start): none of their worker
    processes recorded a step in an earlier generation. A re-formed one keeps at least one survivor."""
    first_attempt: dict[tuple[Any, int], tuple[float, str]] = {}
    members: dict[str, set[tuple[Any, int]]] = defaultdict(set)
    for r in records:
        if r.get("late"):
            continue  # a survivor may record for the dead: its pid says nothing of that step's group
        key = _proc(r)
        members[r["attempt"]].add(key)
        if key not in first_attempt or r["t"] < first_attempt[key][0]:
            first_attempt[key] = (r["t"], r["attempt"])
    return {a for a, procs in members.items() if all(first_attempt[p][1] == a for p in procs)}


def check_step_digests(records: Iterable[Record]) -> list[str]:
    """After every step, every replica of the group that committed it holds the same parameters and optimizer
    state (the records' ``digest``); late records are left out (written after a re-form, for an earlier
    step)."""
    records = list(records)
    groups: dict[tuple[int, str], dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if not r.get("late") and r.get("digest") is not None:
            groups[(r["step"], r["attempt"])][r["digest"]].append(r["rank"])
    problems = []
    for (step, attempt), digests in sorted(groups.items()):
        if len(digests) > 1:
            which = ", ".join(f"ranks {sorted(ranks)} {d}" for d, ranks in sorted(digests.items()))
            problems.append(f"step {step} ({attempt}): replicas differ: {which}")
    missing = sum(1 for r in records if not r.get("late") and r.get("digest") is None)
    if missing:
        problems.append(f"{missing} records carry no digest")
    return problems


def check_reforms_redo_nothing(records: Iterable[Record]) -> list[str]:
    """Live recovery: a re-formed generation continues from the newest step any member applied, so it commits
    no step an earlier generation committed; only a founded one (:func:`founded_attempts`, resumed from
    storage) may re-do steps."""
    records = list(records)
    founded = founded_attempts(records)
    first_t: dict[tuple[int, str], float] = {}
    for r in records:
        key = (r["step"], r["attempt"])
        first_t[key] = min(first_t.get(key, r["t"]), r["t"])
    by_step: dict[int, list[tuple[float, str]]] = defaultdict(list)
    for (step, attempt), t in first_t.items():
        by_step[step].append((t, attempt))
    bad: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for step, attempts in by_step.items():
        ordered = sorted(attempts)
        for _, attempt in ordered[1:]:
            if attempt not in founded:
                bad[attempt].append((step, ordered[0][1]))
    return [
        f"{attempt}, not founded anew, recorded {len(steps)} step(s) that another generation had committed"
        f" before: " + ", ".join(f"{step} (first by {first})" for step, first in sorted(steps)[:10])
        for attempt, steps in sorted(bad.items())
    ]


def redone_steps(records: Iterable[Record]) -> set[int]:
    """Steps committed by more than one attempt (re-done after a resume from a snapshot)."""
    by_step: dict[int, set[str]] = defaultdict(set)
    for r in records:
        by_step[r["step"]].add(r["attempt"])
    return {s for s, attempts in by_step.items() if len(attempts) > 1}


def worker_processes(records: Iterable[Record]) -> dict[Any, list[tuple[float, float, int]]]:
    """Per node (the records' ``agent``), its worker processes as ``(first, last record time, pid)``, in the
    order they started; late records left out."""
    span: dict[tuple[Any, int], list[float]] = {}
    for r in records:
        if r.get("late"):
            continue
        key = _proc(r)
        if key in span:
            span[key][0] = min(span[key][0], r["t"])
            span[key][1] = max(span[key][1], r["t"])
        else:
            span[key] = [r["t"], r["t"]]
    out: dict[Any, list[tuple[float, float, int]]] = defaultdict(list)
    for (node, pid), (a, b) in span.items():
        out[node].append((a, b, pid))
    return {node: sorted(procs) for node, procs in out.items()}


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]


def check_undisturbed_workers_kept(
    records: Iterable[Record], disturbances: Iterable[tuple[float, str | None, str]], sibling_s: float = 1.0
) -> list[str]:
    """Live recovery: a node's worker processes are replaced only after a fault on that node. Each worker
    process that started on a node after the node's first ones must have a disturbance of that node
    (``(unix time, node, what)``; node ``"*"``: every node, for what may restart any; None: no node, named
    in the problems only) after the start of the process it replaced (the newest one on the node that started
    over ``sibling_s`` before it: workers of one torchrun start together) and before its own first record. A
    re-form elsewhere must leave it alone."""
    marks = sorted(disturbances, key=lambda d: d[0])
    procs_by_node = worker_processes(records)
    if None in procs_by_node:
        return ["the records name no node (TEST_AGENT_NAME unset): cannot tell whose workers were replaced"]
    problems = []
    for node, procs in sorted(procs_by_node.items()):
        starts = [first for first, _, _ in procs]
        for first, _, pid in procs:
            before = [s for s in starts if s < first - sibling_s]
            if not before:
                continue  # the node's first workers
            since = before[-1]
            if not any(since < at <= first and who in ("*", node) for at, who, _ in marks):
                near = [f"{what} at {_clock(at)}" for at, _, what in marks if since < at <= first][-3:]
                problems.append(
                    f"worker {pid} on {node} started at {_clock(first)}, replacing one started at "
                    f"{_clock(since)}, with no fault on {node} in between (the last faults then: "
                    f"{'; '.join(near) or 'none'})"
                )
    return problems


def verify_snapshot(manager: Any, step: int, what: str) -> list[str]:
    """Load snapshot ``step`` (checksums verified on the way): the problems, empty if it is whole."""
    try:
        snap = manager.load(step)
    except CheckpointError as exc:
        return [f"{what} does not verify: {exc}"]
    if snap.step != step:
        return [f"{what} holds step {snap.step}"]
    return []


def training_impact(
    records: list[Record], began: float, until: float, lookback: float = 30.0, live: bool = False
) -> dict[str, Any]:
    """What a disturbance that began at ``began`` cost the training job up to ``until`` (unix times; the
    caller gives the end of the disturbance plus a margin, or when the job had settled after it, whichever
    is later), from its records:

    - ``new_groups``: worker groups (attempts) whose first step came in ``[began, until]`` - each one a
      restart of training (``restarted``);
    - ``redone_steps``: steps those groups did again (committed before by an earlier group);
    - ``lost_s``: how much longer the effective trajectory took from its last step before ``began`` to its
      first step after ``until`` than that many steps take at the pace of the ``lookback`` seconds before
      (``step_s``: their time over their number, saves included); ``window_s`` that time, ``lost_pct`` the
      share of it that was lost. None where too few steps surround the window.

    ``live``: a re-formed generation is no restart (its survivors keep their processes, nothing is done
    twice): ``reforms`` counts the generations that began in the window, ``new_groups`` the nodes where new
    worker processes began in it (a torchrun that started its workers again), ``restarted`` either of those
    or steps done twice (a generation founded from storage).
    """
    first_t: dict[str, float] = {}
    first_step: dict[str, int] = {}
    for r in records:
        a = r["attempt"]
        if a not in first_t or r["t"] < first_t[a]:
            first_t[a] = r["t"]
        first_step[a] = min(first_step.get(a, r["step"]), r["step"])
    new = sorted((first_t[a], a) for a in first_t if began <= first_t[a] <= until)
    redone = 0
    for t0, a in new:
        before = max((r["step"] for r in records if r["t"] < t0 and r["attempt"] != a), default=0)
        redone += max(0, before - (first_step[a] - 1))
    out: dict[str, Any] = {
        "restarted": bool(new),
        "new_groups": len(new),
        "redone_steps": redone,
        "lost_s": None,
        "window_s": None,
        "lost_pct": None,
        "step_s": None,
    }
    if live:
        started = {
            node
            for node, procs in worker_processes(records).items()
            if any(began <= first <= until for first, _, _ in procs[1:])
        }
        out.update(reforms=len(new), new_groups=len(started), restarted=bool(started or redone))
    # rank 0 of the effective trajectory: when each step was (last) committed, and by which group
    eff = {step: next((r for r in rs if r["rank"] == 0), rs[0]) for step, rs in effective(records).items()}
    steps = sorted(eff)
    before = [s for s in steps if eff[s]["t"] < began]
    after = [s for s in steps if eff[s]["t"] >= until]
    if not before or not after:
        return out
    s_a, s_b = before[-1], after[0]
    # the pace before: the steps of s_a's group in the lookback (a group's restart is not its pace)
    pre = [s for s in before if eff[s]["t"] >= began - lookback and eff[s]["attempt"] == eff[s_a]["attempt"]]
    if len(pre) < 10 or eff[pre[-1]]["t"] - eff[pre[0]]["t"] < 3.0:
        return out
    pace = (eff[pre[-1]]["t"] - eff[pre[0]]["t"]) / (pre[-1] - pre[0])
    window = eff[s_b]["t"] - eff[s_a]["t"]
    lost = window - (s_b - s_a) * pace  # may come out a little negative: the pace varies
    out.update(
        lost_s=round(lost, 3), window_s=round(window, 3), lost_pct=round(100 * lost / window, 2), step_s=round(pace, 4)
    )
    return out


def check_partitions_dropped_and_rejoined(
    partitions: Iterable[tuple[str, float, float | None]], events: Iterable[dict[str, Any]], rejoin_s: float = 15
) -> list[str]:
    """For each ``(node, began, healed)`` partition (unix times; healed None: not during the run): the
    controller dropped that node after it began (``node_lost``) - its lease expired while it was cut off -
    and added it back after that (``node_joined``), unless the job's workers had finished before the node
    could rejoin (``rejoin_s`` after the heal)."""
    timeline = sorted(
        (datetime.fromisoformat(e["time"]).timestamp(), e["type"], (e.get("data") or {}).get("node"))
        for e in events
        if e["type"] in ("node_lost", "node_joined", "workers_succeeded")
    )
    finished = next((t for t, kind, _ in timeline if kind == "workers_succeeded"), float("inf"))
    problems: list[str] = []
    for node, began, healed in partitions:
        lost = next((t for t, kind, n in timeline if n == node and kind == "node_lost" and t >= began), None)
        if lost is None:
            problems.append(f"{node}, partitioned at {began:.1f}, was never dropped (no node_lost event after it)")
        elif not any(n == node and kind == "node_joined" and t >= lost for t, kind, n in timeline):
            if healed is not None and healed + rejoin_s < finished:
                problems.append(f"{node} was dropped at {lost:.1f} after its partition and never rejoined")
    return problems


class ApiHistory:
    """What the API showed of one job over time: nothing once seen may disappear or go backwards."""

    def __init__(self) -> None:
        self.events: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []
        self.record: dict[str, Any] | None = None
        self.problems: list[str] = []
        self.last_generation = 0
        self.last_restarts: dict[str, int] = {}
        self.polls = 0

    def observe(self, job: dict[str, Any], events: list[dict[str, Any]]) -> None:
        self.polls += 1
        fixed = {k: job.get(k) for k in ("id", "created_at", "spec", "submitted_by")}
        fixed["checkpoint_url"] = (job.get("checkpoint") or {}).get("url")
        if self.record is None:
            self.record = fixed
        elif fixed != self.record:
            self.problems.append(f"the job record changed: {self.record} -> {fixed}")
        if job.get("generation", 0) < self.last_generation:
            self.problems.append(f"generation went back: {self.last_generation} -> {job.get('generation')}")
        self.last_generation = max(self.last_generation, job.get("generation", 0))
        for cause, n in (job.get("restarts") or {}).items():
            if isinstance(n, int):
                if n < self.last_restarts.get(cause, 0):
                    self.problems.append(f"restarts[{cause}] went back: {self.last_restarts[cause]} -> {n}")
                self.last_restarts[cause] = max(n, self.last_restarts.get(cause, 0))
        ids = [e["id"] for e in events]
        for known in self.order:
            if known not in ids:
                self.problems.append(f"event {known} ({self.events[known]['type']}) disappeared")
        for e in events:
            if e["id"] in self.events and e != self.events[e["id"]]:
                self.problems.append(f"event {e['id']} changed: {self.events[e['id']]} -> {e}")
            elif e["id"] not in self.events:
                self.events[e["id"]] = e
                self.order.append(e["id"])
        if ids != sorted(ids, key=lambda i: self.order.index(i)):
            self.problems.append("events came back in another order")
        # keep each problem once
        self.problems = list(dict.fromkeys(self.problems))
