"""Reading the train worker's per-step records (elastic/testing/train_worker.py) and the checks on them that
the integration tests share: the LR policy replayed over a run's worlds, every sample once per epoch."""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

from elastic.contract.lr import LRPolicy
from elastic.testing.torchrun import TorchrunAgent


def read_records(rec: Path) -> list[dict[str, Any]]:
    out = []
    for f in rec.glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by SIGKILL
    return out


def max_step(rec: Path) -> int:
    return max((r["step"] for r in read_records(rec)), default=0)


def agent_logs(agents: list[TorchrunAgent]) -> str:
    return "\n".join(f"--- {a.log_path.name}\n{a.log()[-2500:]}" for a in agents)


def hold_args(path: Path, epochs: int, most: float = 0.0, pace: bool = False) -> list[str]:
    """train_worker.py's arguments that hold each step of the job's last epoch while ``path`` exists (``most``:
    seconds one step waits at most, 0 none; see the worker's docstring); ``pace``: its ``--step-sleep`` only while
    ``path`` exists too (``--pace-file``), so that the steps after the scenario released the job run at full speed."""
    return [
        "--hold-file",
        str(path),
        "--hold-epoch",
        str(epochs - 1),
        "--hold-max",
        str(most),
        *(["--pace-file", str(path)] if pace else []),
    ]


def assert_exits_ok(agent: TorchrunAgent, agents: list[TorchrunAgent], timeout: float) -> None:
    """``agent`` exits 0 within ``timeout`` seconds; a failure or a hang fails with every agent's log tail."""
    try:
        code = agent.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{agent.log_path.name} still running after {timeout} s\n{agent_logs(agents)}") from None
    assert code == 0, f"{agent.log_path.name} exited {code}\n{agent_logs(agents)}"


def effective_records(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """For each step, the records of the last attempt that committed it (earlier attempts were rolled back)."""
    by_step: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_step[r["step"]][r["attempt"]].append(r)
    return {step: max(attempts.values(), key=lambda rs: max(r["t"] for r in rs)) for step, attempts in by_step.items()}


def expected_factors(policy: LRPolicy, eff: dict[int, list[dict[str, Any]]]) -> dict[int, float]:
    """Replay the policy over the effective trajectory: a ramp starts wherever the world changed."""
    steps = sorted(eff)
    world = eff[steps[0]][0]["world"]
    ramp = policy.start_ramp(0, policy.factor(world), world)
    out = {}
    for s in steps:
        w = eff[s][0]["world"]
        if w != world:
            ramp = policy.start_ramp(s - 1, policy.factor_at(s - 1, ramp), w)
            world = w
        out[s] = policy.factor_at(s - 1, ramp)
    return out


def assert_every_sample_once_per_epoch(eff: dict[int, list[dict[str, Any]]], samples: int) -> None:
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for s in sorted(eff):
        for r in eff[s]:
            per_epoch[r["epoch"]].extend(r["indices"])
    for epoch, seen in per_epoch.items():
        assert sorted(seen) == list(range(samples)), f"epoch {epoch}: a sample was skipped or repeated"
