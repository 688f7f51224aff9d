"""Scenarios shared by the loop's tests of DDP and FSDP2 models (train_worker.py; ``extra`` adds ``--fsdp``): the
4 -> 2 -> 3 resize with its LR and exactly-once checks, and the convergence of a resized run against a fixed-world
one; and the torchrun agent those tests start."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from pathlib import Path

from elastic.contract.lr import LRPolicy, LRRule
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.torchrun import TorchrunAgent, torchrun_command
from elastic.testing.wait import wait_until
from tests.integration.training_records import (
    agent_logs,
    assert_every_sample_once_per_epoch,
    assert_exits_ok,
    effective_records,
    expected_factors,
    hold_args,
    max_step,
    read_records,
)

WORKER = str(Path(__file__).resolve().parents[2] / "elastic" / "testing" / "train_worker.py")


def start_agent(
    tmp: Path, name: str, etcd: LocalEtcdCluster, run_id: str, nnodes: str, nproc: int, args: list[str]
) -> TorchrunAgent:
    """A torchrun agent of train_worker.py on the etcd-v3 rendezvous (``max_restarts`` 5), logging to ``<name>.log``.
    Its workers start warm (``-m elastic.prefork``, the service's default): torch is imported once per agent, not
    on every (re)start; cold starts are tested with the same rendezvous in ``test_torchrun_etcd_v3.py``."""
    cmd = torchrun_command(
        backend="etcd-v3",
        endpoint=etcd.endpoints,
        run_id=run_id,
        nnodes=nnodes,
        nproc=nproc,
        rdzv_conf={"last_call_timeout": 2},
        max_restarts=5,
        script=WORKER,
        script_args=args,
        prefork=True,
    )
    return TorchrunAgent(cmd, tmp / f"{name}.log", env={"LOGLEVEL": "WARNING"}, forked=True).start()


def hold_last_epoch(path: Path, epochs: int, most: float = 0.0) -> list[str]:
    """train_worker.py's arguments to hold the job at each step of its last epoch while ``path`` exists (created
    here): the scenario removes it once its kills and joins happened, so a slow machine cannot end the job first.
    ``most``: seconds one step waits at most (0: until the file goes; a live job admits a joiner only at a later
    step boundary, so it needs a bound). Its ``--step-sleep`` ends with the hold too: the steps after the
    scenario's last event run at full speed."""
    path.touch()
    return hold_args(path, epochs, most, pace=True)


def assert_resizes_4_2_3(
    tmp: Path,
    etcd: LocalEtcdCluster,
    agents: list[TorchrunAgent],
    rule: str,
    *,
    samples: int,
    epochs: int,
    step_sleep: float,
    extra: Sequence[str] = (),
) -> None:
    """Two agents of 2 workers (world 4); one SIGKILLed mid-epoch (4 -> 2); then a node of 1 worker joins (2 -> 3).
    Every step is committed exactly once, the LR follows ``rule`` and its warmup ramp exactly (the policy's target
    LR at the end), every record of a step comes from one rank of its world, every sample is consumed once per
    epoch."""
    rec = tmp / "rec"
    run_id = f"resize-{uuid.uuid4().hex[:6]}"
    batch, lr, warmup = 4, 0.05, 3
    args = [
        "--epochs",
        str(epochs),
        "--samples",
        str(samples),
        "--batch",
        str(batch),
        "--lr",
        str(lr),
        "--lr-rule",
        rule,
        "--base-world",
        "4",
        "--warmup",
        str(warmup),
        "--save-every",
        "4",
        "--step-sleep",
        str(step_sleep),
        "--checkpoint-url",
        str(tmp / "ck"),
        "--record",
        str(rec),
        *extra,
        *hold_last_epoch(tmp / "hold", epochs),
    ]
    a = start_agent(tmp, "a", etcd, run_id, "1:3", 2, args)
    b = start_agent(tmp, "b", etcd, run_id, "1:3", 2, args)
    agents += [a, b]

    def world_reached(w: int, after: int = 0) -> bool:
        return any(r["world"] == w and r["step"] > after for r in read_records(rec))

    assert wait_until(lambda: world_reached(4), 150), agent_logs(agents)
    assert wait_until(lambda: max_step(rec) >= 10, 120), agent_logs(agents)
    b.kill_tree()  # a node dies mid-epoch: 4 -> 2
    assert wait_until(lambda: world_reached(2, after=8), 120), agent_logs(agents)
    shrunk_at = max_step(rec)
    assert wait_until(lambda: max_step(rec) >= shrunk_at + 6, 120), agent_logs(agents)
    c = start_agent(tmp, "c", etcd, run_id, "1:3", 1, args)  # a node joins: 2 -> 3
    agents.append(c)
    assert wait_until(lambda: world_reached(3), 150), agent_logs(agents)
    (tmp / "hold").unlink()  # the last epoch may go on
    for agent in (a, c):
        assert_exits_ok(agent, agents, 300)

    eff = effective_records(read_records(rec))
    steps = sorted(eff)
    assert steps == list(range(1, steps[-1] + 1)), "every step committed exactly once"
    worlds = [eff[s][0]["world"] for s in steps]
    changes = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    assert changes == [4, 2, 3], changes
    policy = LRPolicy(LRRule(rule), lr, 4, batch, warmup_steps=warmup)
    expected = expected_factors(policy, eff)
    for s in steps:
        assert len(eff[s]) == eff[s][0]["world"], f"step {s}: one record per rank"
        for r in eff[s]:
            assert r["lr"] == lr * expected[s], (s, r["lr"], lr * expected[s])
    assert eff[steps[-1]][0]["lr"] == policy.target_lr(3)  # steady state after the last resize: the exact target
    assert sorted({r["epoch"] for s in steps for r in eff[s]}) == list(range(epochs))
    assert_every_sample_once_per_epoch(eff, samples)


def final_loss(
    tmp: Path,
    etcd: LocalEtcdCluster,
    agents: list[TorchrunAgent],
    rule: str,
    seed: int,
    resize: bool,
    extra: Sequence[str] = (),
) -> float:
    """The final loss of a 4-worker run (two agents of 2), fixed or resized 4 -> 2 -> 3 (a node SIGKILLed, then one
    joins); ``extra``: more train_worker.py arguments (``--fsdp``)."""
    rec = tmp / f"{rule}-{seed}-{'resized' if resize else 'fixed'}"
    run_id = f"conv-{uuid.uuid4().hex[:6]}"
    # No dropout and enough epochs to converge: the comparison is about the resizes, not about noise.
    args = [
        "--epochs",
        "8",
        "--samples",
        "480",
        "--batch",
        "4",
        "--lr",
        "0.05",
        "--lr-rule",
        rule,
        "--base-world",
        "4",
        "--warmup",
        "3",
        "--save-every",
        "8",
        "--seed",
        str(seed),
        "--dropout",
        "0",
        "--checkpoint-url",
        str(rec / "ck"),
        "--record",
        str(rec),
        *extra,
    ]
    if not resize:
        a = start_agent(tmp, f"{rec.name}-a", etcd, run_id, "2:2", 2, args)
        b = start_agent(tmp, f"{rec.name}-b", etcd, run_id, "2:2", 2, args)
        agents += [a, b]
        for agent in (a, b):
            assert_exits_ok(agent, agents, 300)
    else:
        slow = [*args, "--step-sleep", "0.02", *hold_last_epoch(rec.with_name(f"{rec.name}.hold"), 8)]
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
        assert wait_until(lambda: any(r["world"] == 3 for r in read_records(rec)), 150), agent_logs(agents)
        rec.with_name(f"{rec.name}.hold").unlink()  # the last epoch may go on
        for agent in (a, c):
            assert_exits_ok(agent, agents, 300)
        worlds = [r["world"] for r in sorted(read_records(rec), key=lambda r: r["t"])]
        assert 3 in worlds and 2 in worlds and 4 in worlds
    return float(json.loads((rec / "final.json").read_text())["loss"])


def assert_converges(
    tmp: Path, etcd: LocalEtcdCluster, agents: list[TorchrunAgent], rule: str, seed: int, extra: Sequence[str] = ()
) -> None:
    """The resized run's final loss within 2 % of the fixed-world run's (same seed, same data, no dropout)."""
    fixed = final_loss(tmp, etcd, agents, rule, seed, resize=False, extra=extra)
    resized = final_loss(tmp, etcd, agents, rule, seed, resize=True, extra=extra)
    print(
        f"convergence {rule} seed {seed} {' '.join(extra)}: fixed 4 workers {fixed:.5f}, "
        f"resized 4->2->3 {resized:.5f}, {100 * (resized - fixed) / fixed:+.2f} %"
    )
    assert abs(resized - fixed) <= 0.02 * fixed
