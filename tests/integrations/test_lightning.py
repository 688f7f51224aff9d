"""PyTorch Lightning's ``Trainer.fit`` made elastic by one line (elastic/integrations/lightning.py) under real torchrun
on the etcd-v3 rendezvous: a tiny, randomly initialised MLP ``LightningModule`` on data made in the test
(tests/integrations/lightning_worker.py), 2 -> 1 -> 2 workers with a node kill and a worker kill; every sample once per
epoch by id (the ids the module trained on, padding excluded), the policy's LR and global batch at every step, the
final loss within 2 % of an unkilled run, and a kill and resume at the same world bit-identical to the unkilled run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from elastic.contract.env import PREFORK_KEY, PREFORK_PRELOAD
from elastic.contract.lr import LRPolicy, LRRule
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.torchrun import TorchrunAgent, shared_zygote, torchrun_command
from elastic.testing.wait import wait_until
from tests.integration.training_records import (
    agent_logs,
    assert_every_sample_once_per_epoch,
    assert_exits_ok,
    effective_records,
    expected_factors,
    max_step,
    read_records,
)

# found, not imported: importing Lightning in the test process costs seconds that only its workers need
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs elastic-train[lightning]")

WORKER = str(Path(__file__).with_name("lightning_worker.py"))
# the agents' shared zygote of their own (a key) imports Lightning once: every worker, restarted or not, starts warm
PRELOAD = ",".join(
    [
        "torch",
        "torch.distributed",
        "torch.nn.parallel",
        "torch.distributed.run",
        "lightning.pytorch",
        "elastic.integrations.lightning",
    ]
)

# 89 samples: an epoch ends with a step of 1 sample, which a world of 2 splits into a micro-batch and a padding one
SAMPLES, BATCH, LR, BASE_WORLD, WARMUP = 89, 4, 0.05, 2, 2
# the runs compared bit for bit train with dropout (the RNG restored on resume is then part of the check); those whose
# final losses are compared without: another world draws other dropout masks (8 epochs: 0.16 at 1 worker, 0.06 at 2),
# and without dropout 1 and 2 workers end on the same loss to the last digit
DROPOUT = 0.1


def _agent(
    tmp: Path, name: str, etcd: LocalEtcdCluster, run_id: str, nnodes: str, nproc: int, args: list[str]
) -> TorchrunAgent:
    cmd = torchrun_command(
        backend="etcd-v3",
        endpoint=etcd.endpoints,
        run_id=run_id,
        nnodes=nnodes,
        nproc=nproc,
        rdzv_conf={"last_call_timeout": 1},
        max_restarts=5,
        script=WORKER,
        script_args=args,
        prefork=True,
    )
    env = {"LOGLEVEL": "WARNING", PREFORK_PRELOAD: PRELOAD, PREFORK_KEY: "lightning"}
    return TorchrunAgent(cmd, tmp / f"{name}.log", env=env, forked=True).start()


def _args(tmp: Path, name: str, rule: str, epochs: int, dropout: float, *extra: str) -> list[str]:
    return [
        "--samples",
        str(SAMPLES),
        "--epochs",
        str(epochs),
        "--dropout",
        str(dropout),
        "--batch",
        str(BATCH),
        "--lr",
        str(LR),
        "--lr-rule",
        rule,
        "--base-world",
        str(BASE_WORLD),
        "--warmup",
        str(WARMUP),
        "--save-every",
        "3",
        "--checkpoint-url",
        str(tmp / f"ck-{name}"),
        "--record",
        str(tmp / name),
        *extra,
    ]


def _final_loss(rec: Path) -> float:
    return float(json.loads((rec / "final.json").read_text())["loss"])


def _assert_policy_and_exactly_once(rec: Path, rule: str, epochs: int) -> list[int]:
    """Every step committed once, by one rank per worker of its world; the policy's global batch (all ranks' samples
    together; an epoch's last step takes what is left) and accumulation, and its LR (with the ramp after each resize)
    at every step; the ids the module trained on are the step's, and every sample is seen once per epoch. Returns
    the worlds the run went through, in order."""
    eff = effective_records(read_records(rec))
    steps = sorted(eff)
    assert steps == list(range(1, steps[-1] + 1)), "every step committed exactly once"
    policy = LRPolicy(LRRule(rule), LR, BASE_WORLD, BATCH, warmup_steps=WARMUP)
    factors = expected_factors(policy, eff)
    left = {}  # samples not yet consumed in each step's epoch, before it
    for s in steps:
        epoch = eff[s][0]["epoch"]
        left.setdefault(epoch, SAMPLES)
        world = eff[s][0]["world"]
        assert sorted(r["rank"] for r in eff[s]) == list(range(world)), f"step {s}: one record per rank"
        plan = policy.step_plan(world)
        taken = sum(len(r["indices"]) for r in eff[s])
        assert taken == min(plan.global_batch, left[epoch]), f"step {s}: the global batch"
        left[epoch] -= taken
        for r in eff[s]:
            assert r["seen"] == r["indices"], f"step {s}: the module trained on the step's samples"
            assert r["accumulation"] == plan.accumulation_steps, (s, r)
            assert r["lr"] == pytest.approx(LR * factors[s], rel=1e-12), (s, r["lr"])
    assert all(v == 0 for v in left.values()) and sorted(left) == list(range(epochs))
    assert_every_sample_once_per_epoch({s: [{**r, "indices": r["seen"]} for r in eff[s]] for s in steps}, SAMPLES)
    worlds = [eff[s][0]["world"] for s in steps]
    return [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]


def _resize_2_1_2(tmp: Path, etcd: LocalEtcdCluster, agents: list[TorchrunAgent], rule: str, epochs: int) -> Path:
    """Two nodes of one worker (world 2); one node SIGKILLed (2 -> 1); a node joins (1 -> 2); a worker SIGKILLed
    (torchrun restarts the group at 2)."""
    rec = tmp / "resized"
    run_id = f"pl-212-{uuid.uuid4().hex[:6]}"
    hold = tmp / "hold-resized"  # the last epoch waits for the kills and the join (however slow the machine)
    hold.touch()
    args = _args(
        tmp,
        "resized",
        rule,
        epochs,
        0.0,
        "--step-sleep",
        "0.1",
        "--hold-file",
        str(hold),
        "--hold-epoch",
        str(epochs - 1),
    )
    a = _agent(tmp, "a", etcd, run_id, "1:2", 1, args)
    b = _agent(tmp, "b", etcd, run_id, "1:2", 1, args)
    agents += [a, b]

    def world_since(w: int, after: int) -> bool:
        return any(r["world"] == w and r["step"] > after for r in read_records(rec))

    assert wait_until(lambda: max_step(rec) >= 5, 120), agent_logs(agents)
    b.kill_tree()  # a node dies: 2 -> 1
    assert wait_until(lambda: world_since(1, 5), 90), agent_logs(agents)
    c = _agent(tmp, "c", etcd, run_id, "1:2", 1, args)  # a node joins: 1 -> 2
    agents.append(c)
    shrunk = max_step(rec)
    assert wait_until(lambda: world_since(2, shrunk), 90), agent_logs(agents)
    a.kill_workers()  # a worker dies: torchrun restarts the group, at 2 (the held last epoch waits for it)
    hold.unlink()
    for agent in (a, c):
        assert_exits_ok(agent, agents, 150)
    return rec


def _start_killed(
    tmp: Path, etcd: LocalEtcdCluster, agents: list[TorchrunAgent], rule: str, epochs: int
) -> TorchrunAgent:
    """One node of 2 workers, to be SIGKILLed mid-run (:func:`_kill_at_same_world`); from its second epoch on it
    waits for the kill."""
    hold = tmp / "hold-killed"
    hold.touch()
    args = _args(
        tmp, "killed", rule, epochs, DROPOUT, "--step-sleep", "0.05", "--hold-file", str(hold), "--hold-epoch", "1"
    )
    agent = _agent(tmp, "killed", etcd, f"pl-kill-{uuid.uuid4().hex[:6]}", "1", 2, args)
    agents.append(agent)
    return agent


def _kill_at_same_world(tmp: Path, agent: TorchrunAgent, agents: list[TorchrunAgent]) -> Path:
    """Both workers SIGKILLed mid-run: torchrun restarts them from the last snapshot, at the same world."""
    rec = tmp / "killed"
    assert wait_until(lambda: max_step(rec) >= 7, 120), agent_logs(agents)
    agent.kill_workers()
    (tmp / "hold-killed").unlink()
    assert_exits_ok(agent, agents, 150)
    assert {r["restart"] for r in read_records(rec)} == {0, 1}
    return rec


def _assert_join_lost_no_step(rec: Path) -> None:
    """The join (1 -> 2): torchrun SIGTERMs the lone worker, which saves the step it is at, at the step boundary; the
    group of 2 resumes right after it (the snapshot interval is 3 steps: a lost step would show)."""
    attempts: dict[tuple[str, int], list[dict[str, object]]] = {}
    for r in read_records(rec):
        attempts.setdefault((r["attempt"], r["restart"]), []).append(r)
    ordered = sorted(attempts.values(), key=lambda rs: min(float(str(r["t"])) for r in rs))
    worlds = [int(str(rs[0]["world"])) for rs in ordered]
    alone = worlds.index(1)
    last = max(int(str(r["step"])) for r in ordered[alone])
    first = min(int(str(r["step"])) for r in ordered[alone + 1])
    assert first == last + 1, f"the world of 1 committed step {last}, the group that followed began at {first}"


def _assert_bit_identical(ref: Path, rec: Path) -> None:
    ref_params, run_params = torch.load(ref / "final_params.pt"), torch.load(rec / "final_params.pt")
    assert ref_params.keys() == run_params.keys()
    for k in ref_params:
        assert torch.equal(ref_params[k], run_params[k]), k


def _assert_loss_within_2_percent(ref: Path, rec: Path) -> None:
    fixed, resized = _final_loss(ref), _final_loss(rec)
    print(
        f"lightning 2->1->2: unkilled {fixed:.5f}, killed and resized {resized:.5f}, "
        f"{100 * (resized - fixed) / fixed:+.2f} %"
    )
    assert abs(resized - fixed) <= 0.02 * fixed


def _scenario(
    tmp: Path, etcd: LocalEtcdCluster, agents: list[TorchrunAgent], rule: str, epochs: int, same_loss: bool = True
) -> None:
    """Four runs side by side: the run killed and resumed at the same world and its unkilled twin (with dropout), the
    resized run and its unkilled twin (without; ``same_loss``: their final losses within 2 %)."""
    refs = []
    for name, dropout in (("ref", 0.0), ("ref-rng", DROPOUT)):
        refs.append(
            _agent(
                tmp, name, etcd, f"pl-{name}-{uuid.uuid4().hex[:6]}", "1", 2, _args(tmp, name, rule, epochs, dropout)
            )
        )
    agents += refs
    killed_agent = _start_killed(tmp, etcd, agents, rule, epochs)
    killed = _kill_at_same_world(tmp, killed_agent, agents)
    resized = _resize_2_1_2(tmp, etcd, agents, rule, epochs)
    for agent in refs:
        assert_exits_ok(agent, agents, 120)
    assert _assert_policy_and_exactly_once(tmp / "ref", rule, epochs) == [2]
    assert _assert_policy_and_exactly_once(resized, rule, epochs) == [2, 1, 2]
    assert len({(r["attempt"], r["restart"]) for r in read_records(resized)}) >= 4
    _assert_join_lost_no_step(resized)
    assert _assert_policy_and_exactly_once(killed, rule, epochs) == [2]
    if same_loss:
        _assert_loss_within_2_percent(tmp / "ref", resized)
    _assert_bit_identical(tmp / "ref-rng", killed)


@pytest.mark.timeout(300)
def test_lightning_fit_2_1_2_kills_exactly_once_policy_loss_and_bit_identical_resume(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    """The default suite's form, the global batch kept (``fixed-global-batch``: Lightning's accumulate_grad_batches
    is 1 at 2 workers, 2 at 1): the unkilled run (2 workers) runs beside the 2 -> 1 -> 2 run with a node and a worker
    kill, then a run killed and resumed at 2 workers; the resized run keeps every sample once per epoch, the policy's
    LR and global batch at every step and the unkilled run's final loss within 2 %; the killed run ends bit-identical
    to the unkilled one."""
    _scenario(tmp_path, etcd_server, agents, "fixed-global-batch", epochs=3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lightning_fit_2_1_2_linear_rule_rescales_the_lr_with_its_ramp(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    """The same scenario under the ``linear`` rule: the global batch follows the world and the LR is rescaled, with
    the policy's warmup ramp after each resize. The final losses are not compared: the resized run takes other steps
    than the unkilled one (a world of 1 more, smaller ones), and after 10 epochs the two ended at 0.020 and 0.034."""
    _scenario(tmp_path, etcd_server, agents, "linear", epochs=3, same_loss=False)


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_fit.py"


def _run_example(etcd: LocalEtcdCluster, nproc: int, args: list[str]) -> dict[str, float]:
    """examples/lightning_fit.py under the README's torchrun command (warm, on the etcd-v3 rendezvous); rank 0's JSON
    line."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=etcd-v3",
        f"--rdzv-endpoint={etcd.endpoints}",
        f"--rdzv-id=pl-ex-{uuid.uuid4().hex[:6]}",
        "-m",
        "elastic.prefork",
        str(EXAMPLE),
        *args,
    ]
    env = dict(
        os.environ,
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        OMP_NUM_THREADS="1",
        LOGLEVEL="WARNING",
        **shared_zygote(),
        **{PREFORK_PRELOAD: PRELOAD, PREFORK_KEY: "lightning"},
    )
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=EXAMPLE.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1])


@pytest.mark.timeout(240)
def test_lightning_example_trains_on_2_workers_and_resumes_on_1(etcd_server: LocalEtcdCluster, tmp_path: Path) -> None:
    """The example's one elastic line: an epoch on 2 workers, then the same command on 1 worker for a second epoch
    resumes from the first's snapshot by itself (the global batch kept: 29 steps of 64 digits per epoch at both)."""
    pytest.importorskip("sklearn")
    url = str(tmp_path / "ck")
    first = _run_example(etcd_server, 2, ["--epochs", "1", "--checkpoint-url", url])
    assert (first["step"], first["epoch"]) == (29, 1)
    second = _run_example(etcd_server, 1, ["--epochs", "2", "--checkpoint-url", url])
    assert (second["step"], second["epoch"]) == (58, 2)
    assert second["loss"] < 1.0
