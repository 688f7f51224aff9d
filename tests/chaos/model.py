"""What a chaos run is asked to do and what it found: fault kinds, the configuration, the report.

Both travel as JSON between the runner and its copy running inside the network namespaces
(:meth:`ChaosConfig.to_dict` / :meth:`ChaosReport.from_dict`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from enum import Enum
from typing import Any

from elastic.contract.recovery import RecoveryMode


class FaultKind(str, Enum):
    WORKER_KILL = "worker_kill"
    WORKER_STOP = "worker_stop"
    TORCHRUN_KILL = "torchrun_kill"
    TORCHRUN_STOP = "torchrun_stop"
    AGENT_KILL = "agent_kill"
    AGENT_STOP = "agent_stop"
    CONTROLLER_RESTART = "controller_restart"
    ETCD_MEMBER_LOSS = "etcd_member_loss"
    NETWORK_PARTITION = "network_partition"
    ETCD_OUTAGE = "etcd_outage"
    STORAGE_OUTAGE = "storage_outage"
    TWO_JOBS = "two_jobs"


RECOVERY_MODES = tuple(m.value for m in RecoveryMode)

#: kinds that need the job steady on every node first (nothing pending, no node disturbed), so that what
#: follows them can be attributed to them; the runner measures their impact on training
QUIET_KINDS = (FaultKind.ETCD_OUTAGE, FaultKind.STORAGE_OUTAGE, FaultKind.TWO_JOBS)
#: how long (s) one of them may keep the job training before the next fault, at most: they last longer than
#: the others (a 10 s outage and its recovery; a second job's whole life), so the job needs more steps
LONG_KINDS_S = {FaultKind.ETCD_OUTAGE: 15.0, FaultKind.STORAGE_OUTAGE: 25.0, FaultKind.TWO_JOBS: 40.0}


@dataclass(frozen=True)
class ChaosConfig:
    faults: int = 8
    seed: int = 0
    time_limit: timedelta = timedelta(minutes=30)
    steps_between: int = 10
    kinds: tuple[FaultKind, ...] = tuple(FaultKind)
    nodes: int = 3
    samples: int = 240
    batch: int = 4
    save_every: int = 3
    step_sleep: float = 0.1
    local_every: int = 0  # the job spec's local_snapshot_every (node-local snapshots; 0: off)
    settle_timeout: timedelta = timedelta(seconds=240)
    outage_s: float = 10.0  # length of an etcd_outage and of a storage_outage
    s3_keep_last: int = 6  # the job's keep_last on S3 (each commit reads every kept manifest, see runner)
    recovery: str = "restart"  # the job spec's recovery: "restart" or "live" (RECOVERY_MODES)
    #: the job's last ``hold_epochs`` epochs run slow (each step waits ``hold_max_s`` more) until the runner has
    #: injected its last fault: runway beyond :attr:`epochs` for a loaded machine, where faults settle more slowly
    #: than steps run (a parallel suite's chaos job once neared its end after 9 of 11 faults). ``hold_max_s`` stays
    #: under the 1 s within which a steady job's newest record must be (the runner's ``_quiet``). In CI on 2026-11-28
    #: the short form still neared its end after 9 of 12 (the malformed second job settled in 135 s, 835 steps);
    #: holding a third of the epochs instead, tried in a parallel fresh-clone run, took the session from 483 to
    #: 605 s against its 600 s limit, so it stays at 6: a failure under load is run again alone by scripts/test.sh.
    hold_epochs: int = 6
    hold_max_s: float = 0.5

    def __post_init__(self) -> None:
        if self.recovery not in RECOVERY_MODES:
            raise ValueError(f"recovery must be one of {', '.join(RECOVERY_MODES)}, not {self.recovery!r}")

    @property
    def live(self) -> bool:
        """The job runs in live recovery: its workers re-form in place, the runner checks what that promises."""
        return self.recovery == "live"

    @property
    def on_s3(self) -> bool:
        """The job's checkpoints live on the S3 server (behind the runner's proxy), not in a directory."""
        return FaultKind.STORAGE_OUTAGE in self.kinds

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (seconds for timedeltas, names for kinds); :meth:`from_dict` reads it back."""
        seconds = {"time_limit": self.time_limit.total_seconds(), "settle_timeout": self.settle_timeout.total_seconds()}
        return {**asdict(self), **seconds, "kinds": [k.value for k in self.kinds]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChaosConfig:
        return cls(
            **{
                **data,
                "time_limit": timedelta(seconds=data["time_limit"]),
                "settle_timeout": timedelta(seconds=data["settle_timeout"]),
                "kinds": tuple(FaultKind(k) for k in data["kinds"]),
            }
        )

    def without(self, kind: FaultKind) -> ChaosConfig:
        return replace(self, kinds=tuple(k for k in self.kinds if k != kind))

    @property
    def global_batch(self) -> int:
        return self.batch * self.nodes  # fixed-global-batch with base world = nodes

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.samples / self.global_batch)

    @property
    def epochs(self) -> int:
        """Enough steps for every fault plus a tail, so that all faults hit a running job."""
        # Training runs on while a fault settles and between faults: about 2-2.5x steps_between a fault on
        # average, up to ~5.5x for the slowest (45 steps in CI runs with steps_between=8). The first ten faults
        # get that worst case; over more faults the total stays near the mean (50 faults, steps_between=10:
        # 975-1080 steps measured), so each further one gets 3x. What is left over is an idle tail.
        slots = 6 * min(self.faults + 2, 10) + 3 * max(self.faults + 2 - 10, 0)
        need = slots * self.steps_between + 2 * self.steps_per_epoch
        # The long kinds keep the job training for their length: at most 1/step_sleep steps a second, about
        # half of that measured (steps, saves to S3 and the workers' other work on 2 loaded cores; 150-200
        # steps per long fault on 2026-11-23, since a snapshot deferred during a storage outage no longer
        # stalls the loop; with a third, a 50-fault run ended after 46 faults).
        rounds = math.ceil(self.faults / max(len(self.kinds), 1))
        long_s = sum(LONG_KINDS_S.get(k, 0.0) for k in self.kinds) * rounds
        need += math.ceil(long_s * 0.5 / max(self.step_sleep, 0.01))
        if self.recovery == "live":
            # no restarts: the job trains at full pace through most faults (a 50-fault live run ended after 47
            # faults on 2026-11-25 with the restart mode's length)
            need = math.ceil(need * 1.4)
        return max(2, math.ceil(need / self.steps_per_epoch))


@dataclass
class Fault:
    kind: str
    target: str
    at: float
    step_at: int
    settle_s: float | None = None
    ended: float | None = None  # unix time: the outage ended, or the second job reached its end state
    detail: str = ""  # what happened (the second job's state and last_error, the snapshot kept ...)
    impact: dict[str, Any] | None = None  # on the training job (quiet kinds): see checks.training_impact


@dataclass
class ChaosReport:
    config: dict[str, Any]
    faults: list[Fault] = field(default_factory=list)
    job_id: str = ""
    job_state: str = ""
    duration_s: float = 0.0
    steps: int = 0
    attempts: int = 0
    resume_points_verified: int = 0
    resumed_node_local: int = 0  # attempts that resumed from a node-local snapshot
    api_polls: int = 0
    events: int = 0
    corrupt_warnings: int = 0
    checks: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    stalls: list[str] = field(default_factory=list)
    network: str = "loopback"  # or "netns: <hub namespace>"
    partitions_left_out: str = ""  # why network partitions were not injected (empty: they could be)
    recovery: str = "restart"  # the job's recovery mode
    redone_steps: int = 0  # steps committed by more than one attempt (re-done after a resume from a snapshot)
    reforms: int = 0  # live: generations of the workers' group re-formed in place (survivors kept)
    founded: int = 0  # live: generations founded anew (the first, and any resumed from storage)
    worker_processes: int = 0  # live: worker processes that recorded steps, over every node

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChaosReport:
        data = {k: v for k, v in data.items() if k != "passed"}
        return cls(**{**data, "faults": [Fault(**f) for f in data["faults"]]})

    @property
    def passed(self) -> bool:
        return self.job_state == "succeeded" and not any(self.checks.values()) and bool(self.checks)

    def summary(self) -> str:
        by_kind: dict[str, list[float]] = {}
        for f in self.faults:
            by_kind.setdefault(f.kind, []).append(f.settle_s if f.settle_s is not None else float("nan"))
        local = f" {self.resumed_node_local} from node-local snapshots," if self.config.get("local_every") else ""
        lines = [
            f"chaos seed={self.config['seed']}: {len(self.faults)} faults in {self.duration_s:.0f} s, job {self.job_id}"
            f" {self.job_state}, {self.steps} steps, {self.attempts} worker groups (attempts),"
            f" {self.resume_points_verified} resume snapshots verified,"
            f"{local}"
            f" {self.events} events,"
            f" {self.api_polls} API polls, {self.corrupt_warnings} corrupt-snapshot warnings in worker logs",
            "fault kind            count   settle median / max (s)  [time until the job trained"
            f" {self.config['steps_between']} steps past the fault]",
        ]
        lines.insert(1, f"network: {self.network}")
        if self.recovery == "live":
            lines.insert(
                2,
                f"live recovery: {self.reforms} re-forms in place, {self.founded} generations founded"
                f" (the first and any resumed from storage), {self.worker_processes} worker processes,"
                f" {self.redone_steps} steps done twice",
            )
        if self.partitions_left_out:
            lines.insert(2, f"network partitions left out: {self.partitions_left_out}")
        for kind, settle in sorted(by_kind.items()):
            ok = [s for s in settle if not math.isnan(s)]
            med = f"{statistics.median(ok):6.1f}" if ok else "     —"
            top = f"{max(ok):6.1f}" if ok else "     —"
            lines.append(f"  {kind:20s} {len(settle):5d}   {med} / {top}")
        impacts = [(i, f) for i, f in enumerate(self.faults, 1) if f.impact]
        if impacts:
            lines.append(
                "impact on training [restart: a new worker group or generation; time lost: over the"
                " window from the fault until 5 s after its end or the job settled, against the"
                " steps' pace before it]"
            )
        for i, f in impacts:
            lines.append(f"  #{i:<3d}{f.kind:17s} at step {f.step_at:5d}: {describe_impact(f.impact or {})}")
            if f.detail:
                lines.append(f"       {f.detail}")
        for name, problems in self.checks.items():
            lines.append(f"check {name}: {'ok' if not problems else 'FAILED: ' + '; '.join(problems[:5])}")
        lines += [f"note: {n}" for n in self.notes]
        lines.append("PASSED" if self.passed else "FAILED")
        return "\n".join(lines)


def describe_impact(impact: dict[str, Any]) -> str:
    """One line of :func:`tests.chaos.checks.training_impact`'s measures."""
    gen = impact.get("generation_delta")
    restart = "yes" if impact.get("restarted") else "no"
    groups = "nodes with new worker processes" if "reforms" in impact else "new worker groups"
    parts = [
        f"restart {restart} ({impact.get('new_groups', 0)} {groups}"
        + (f", generation +{gen})" if gen is not None else ")"),
        f"{impact.get('redone_steps', 0)} steps done twice",
    ]
    if "reforms" in impact:
        parts.insert(1, f"{impact['reforms']} live re-forms")
    lost, window, pct = impact.get("lost_s"), impact.get("window_s"), impact.get("lost_pct")
    if lost is not None and window is not None and pct is not None:
        parts.append(
            f"time lost {lost:.1f} s = {pct:.1f} % of the steps' time over {window:.1f} s"
            f" (pace {impact.get('step_s', 0) * 1000:.0f} ms/step)"
        )
    else:
        parts.append("time lost: not measured (too few steps around the fault)")
    return ", ".join(parts)
