"""The convergence scenario shared by the loop's tests (DDP and FSDP2): a 4-worker run against the same run resized
4 -> 2 -> 3 workers, final losses within 2 %; and the torchrun agent those tests start."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from pathlib import Path

from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.torchrun import TorchrunAgent, torchrun_command
from elastic.testing.wait import wait_until
from tests.integration.training_records import agent_logs, max_step, read_records

WORKER = str(Path(__file__).resolve().parents[2] / "elastic" / "testing" / "train_worker.py")


def start_agent(tmp: Path, name: str, etcd: LocalEtcdCluster, run_id: str, nnodes: str, nproc: int,
                args: list[str]) -> TorchrunAgent:  # fmt: skip
    """A torchrun agent of train_worker.py on the etcd-v3 rendezvous (``max_restarts`` 5), logging to ``<name>.log``."""
    cmd = torchrun_command(
        backend="etcd-v3", endpoint=etcd.endpoints, run_id=run_id, nnodes=nnodes, nproc=nproc,
        rdzv_conf={"last_call_timeout": 2}, max_restarts=5, script=WORKER, script_args=args,
    )  # fmt: skip
    return TorchrunAgent(cmd, tmp / f"{name}.log", env={"LOGLEVEL": "WARNING"}).start()


def final_loss(
    tmp: Path, etcd: LocalEtcdCluster, agents: list[TorchrunAgent], rule: str, seed: int, resize: bool,
    extra: Sequence[str] = (),
) -> float:
    """The final loss of a 4-worker run (two agents of 2), fixed or resized 4 -> 2 -> 3 (a node SIGKILLed, then one
    joins); ``extra``: more train_worker.py arguments (``--fsdp``)."""
    rec = tmp / f"{rule}-{seed}-{'resized' if resize else 'fixed'}"
    run_id = f"conv-{uuid.uuid4().hex[:6]}"
    # No dropout and enough epochs to converge: the comparison is about the resizes, not about noise.
    args = ["--epochs", "8", "--samples", "480", "--batch", "4", "--lr", "0.05", "--lr-rule", rule,
            "--base-world", "4", "--warmup", "3", "--save-every", "8", "--seed", str(seed), "--dropout", "0",
            "--checkpoint-url", str(rec / "ck"), "--record", str(rec), *extra]  # fmt: skip
    if not resize:
        a = start_agent(tmp, f"{rec.name}-a", etcd, run_id, "2:2", 2, args)
        b = start_agent(tmp, f"{rec.name}-b", etcd, run_id, "2:2", 2, args)
        agents += [a, b]
        for agent in (a, b):
            assert agent.wait(timeout=300) == 0, agent_logs(agents)
    else:
        slow = [*args, "--step-sleep", "0.05"]
        a = start_agent(tmp, f"{rec.name}-a", etcd, run_id, "1:3", 2, slow)
        b = start_agent(tmp, f"{rec.name}-b", etcd, run_id, "1:3", 2, slow)
        agents += [a, b]
        assert wait_until(lambda: max_step(rec) >= 40, 150), agent_logs(agents)
        b.kill_tree()
        assert wait_until(lambda: any(r["world"] == 2 for r in read_records(rec)), 120), agent_logs(agents)
        shrunk_at = max_step(rec)
        assert wait_until(lambda: max_step(rec) >= shrunk_at + 40, 150), agent_logs(agents)
        c = start_agent(tmp, f"{rec.name}-c", etcd, run_id, "1:3", 1, slow)
        agents.append(c)
        for agent in (a, c):
            assert agent.wait(timeout=300) == 0, agent_logs(agents)
        worlds = [r["world"] for r in sorted(read_records(rec), key=lambda r: r["t"])]
        assert 3 in worlds and 2 in worlds and 4 in worlds
    return float(json.loads((rec / "final.json").read_text())["loss"])


def assert_converges(tmp: Path, etcd: LocalEtcdCluster, agents: list[TorchrunAgent], rule: str, seed: int,
                     extra: Sequence[str] = ()) -> None:  # fmt: skip
    """The resized run's final loss within 2 % of the fixed-world run's (same seed, same data, no dropout)."""
    fixed = final_loss(tmp, etcd, agents, rule, seed, resize=False, extra=extra)
    resized = final_loss(tmp, etcd, agents, rule, seed, resize=True, extra=extra)
    print(f"convergence {rule} seed {seed} {' '.join(extra)}: fixed 4 workers {fixed:.5f}, "
          f"resized 4->2->3 {resized:.5f}, {100 * (resized - fixed) / fixed:+.2f} %")  # fmt: skip
    assert abs(resized - fixed) <= 0.02 * fixed
