"""FSDP2 models through the elastic loop under real torchrun on real etcd: training, sharded snapshots restored
into any world size, a corrupt shard falling back to the previous snapshot, kill and resume, 4 -> 2 -> 3."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.checkpoint import create_checkpoint_manager
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.torchrun import TorchrunAgent, torchrun_command
from elastic.testing.wait import wait_until
from tests.integration.scenarios import assert_converges, assert_resizes_4_2_3
from tests.integration.training_records import (
    agent_logs,
    assert_exits_ok,
    max_step,
    read_records,
)

WORKER = str(Path(__file__).resolve().parents[2] / "elastic" / "testing" / "train_worker.py")

# 99 samples, a global batch of 16 in 2 micro-batches per worker on 2 workers (fixed-global-batch, 4 x 4): the
# epoch's last step has 3 samples, so one worker's second micro-batch is empty (the zero-weight padding)
COMMON = [
    "--samples",
    "99",
    "--batch",
    "4",
    "--lr",
    "0.05",
    "--lr-rule",
    "fixed-global-batch",
    "--base-world",
    "4",
    "--dropout",
    "0",
]


def _agent(
    tmp: Path,
    name: str,
    etcd: LocalEtcdCluster,
    nproc: int,
    args: list[str],
    run_id: str | None = None,
    nnodes: str = "1",
) -> TorchrunAgent:
    cmd = torchrun_command(
        backend="etcd-v3",
        endpoint=etcd.endpoints,
        run_id=run_id or f"{name}-{uuid.uuid4().hex[:6]}",
        nnodes=nnodes,
        nproc=nproc,
        rdzv_conf={"last_call_timeout": 2},
        max_restarts=5,
        script=WORKER,
        script_args=args,
        prefork=True,
    )
    return TorchrunAgent(cmd, tmp / f"{name}.log", env={"LOGLEVEL": "WARNING"}, forked=True).start()


def _run(
    tmp: Path, name: str, etcd: LocalEtcdCluster, agents: list[TorchrunAgent], nproc: int, args: list[str]
) -> Path:
    """One job to its end; returns its record directory."""
    rec = tmp / name
    a = _agent(tmp, name, etcd, nproc, [*args, "--record", str(rec)])
    agents.append(a)
    assert_exits_ok(a, agents, 200)
    return rec


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal nested state: tensors bit for bit (dtype and shape included), everything else by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _same_full_state(saved: Path, restored: Path) -> None:
    s, r = torch.load(saved), torch.load(restored)
    assert r["step"] == s["step"], (s["step"], r["step"])
    assert s["model"] and s["optim"]["state"], "the dump holds the full state"
    _assert_same(s["model"], r["model"], "model")
    _assert_same(s["optim"], r["optim"], "optim")


@pytest.mark.timeout(300)
def test_fsdp2_model_trains_through_elastic_trainer_on_2_workers_like_ddp(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    """The original failure: a fully_shard'ed model was wrapped in DDP and died at once. Now it trains, with
    gradient accumulation and an empty micro-batch, to the parameters a DDP run of the same job reaches."""
    args = [*COMMON, "--epochs", "2", "--save-every", "4"]
    fsdp = _run(tmp_path, "fsdp", etcd_server, agents, 2, [*args, "--fsdp", "--checkpoint-url", str(tmp_path / "ck1")])
    ddp = _run(tmp_path, "ddp", etcd_server, agents, 2, [*args, "--checkpoint-url", str(tmp_path / "ck2")])

    steps = sorted({r["step"] for r in read_records(fsdp)})
    assert steps == list(range(1, 15)), steps  # 2 epochs of 7 steps (6 x 16 samples + 3)
    got, want = torch.load(fsdp / "final_params.pt"), torch.load(ddp / "final_params.pt")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-6), (k, (got[k] - want[k]).abs().max())
    snapshots = sorted(p.name for p in (tmp_path / "ck1").glob("step-*"))
    assert len(snapshots) >= 2 and snapshots[-1] == "step-000000000014", snapshots  # the last at the epoch's end
    assert list((tmp_path / "ck1" / snapshots[-1]).glob("*/*.distcp")), "a sharded (DCP) snapshot"


@pytest.mark.timeout(400)
def test_fsdp2_snapshot_of_2_workers_restores_the_same_full_state_on_2_1_and_3_workers(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    """Sharded snapshots are resharded on load: parameters and optimizer state (momentum) as saved, gathered in
    full on rank 0, whatever the number of workers that resume; training then goes on."""
    ck = ["--checkpoint-url", str(tmp_path / "ck"), "--save-every", "5", "--epochs", "3"]
    saved = _run(
        tmp_path, "saved", etcd_server, agents, 2, [*COMMON, *ck, "--fsdp", "--max-steps", "10", "--dump-steps", "10"]
    )
    assert (saved / "dump-step10.pt").exists()
    for world in (2, 1, 3):
        rec = _run(
            tmp_path,
            f"resumed{world}",
            etcd_server,
            agents,
            world,
            [*COMMON, *ck, "--fsdp", "--dump-start", "--max-steps", str(10 + world)],
        )
        _same_full_state(saved / "dump-step10.pt", rec / "dump-start.pt")
        steps = sorted({r["step"] for r in read_records(rec)})
        assert steps == list(range(11, 11 + world)), (world, steps)
        assert {r["world"] for r in read_records(rec)} == {world}


@pytest.mark.timeout(300)
def test_fsdp2_corrupt_shard_file_falls_back_to_the_previous_snapshot(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    ck = ["--checkpoint-url", str(tmp_path / "ck"), "--save-every", "5", "--epochs", "3", "--fsdp"]
    dumps = ",".join(str(s) for s in range(5, 11))
    saved = _run(tmp_path, "saved", etcd_server, agents, 2, [*COMMON, *ck, "--max-steps", "10", "--dump-steps", dumps])
    shards = sorted((tmp_path / "ck" / "step-000000000010").glob("*/*.distcp"))
    assert shards, sorted(p.name for p in (tmp_path / "ck").rglob("*"))
    data = bytearray(shards[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit, same size: only the digest can tell
    shards[0].write_bytes(bytes(data))
    # snapshots at 5, 7 (the epoch's end) and 10; on a loaded machine the one due at 7 may be deferred to a later
    # step (the writer still busy with 5's) or skipped: the one before 10 is whichever was committed
    with create_checkpoint_manager(str(tmp_path / "ck")) as manager:
        committed = [s.step for s in manager.list_snapshots()]
    assert committed[-1] == 10 and 5 in committed, committed
    previous = committed[-2]

    # the corrupt 10 is skipped, the previous one (7 unless deferred) restored
    rec = _run(tmp_path, "resumed", etcd_server, agents, 2, [*COMMON, *ck, "--dump-start", "--max-steps", "9"])
    _same_full_state(saved / f"dump-step{previous}.pt", rec / "dump-start.pt")
    assert sorted({r["step"] for r in read_records(rec)}) == list(range(previous + 1, 10))
    assert "checkpoint step 10" in agents[-1].log() and "unusable" in agents[-1].log(), agents[-1].log()[-3000:]


@pytest.mark.timeout(300)
def test_fsdp2_kill_and_resume_at_same_world_gives_bit_identical_final_state(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    """Every worker SIGKILLed mid-run: torchrun restarts the group, which resumes from the last sharded
    snapshot (RNG, cursor, momentum included) and ends with the parameters of an uninterrupted run."""
    args = [*COMMON, "--epochs", "3", "--save-every", "5", "--fsdp", "--dropout", "0.1"]
    ref = _run(tmp_path, "ref", etcd_server, agents, 2, [*args, "--checkpoint-url", str(tmp_path / "ck-ref")])

    run = tmp_path / "run"
    b = _agent(
        tmp_path,
        "run",
        etcd_server,
        2,
        [*args, "--checkpoint-url", str(tmp_path / "ck-run"), "--record", str(run), "--step-sleep", "0.1"],
    )
    agents.append(b)
    assert wait_until(lambda: max_step(run) >= 13, 120), agent_logs(agents)
    b.kill_workers()
    assert_exits_ok(b, agents, 200)

    assert {r["restart"] for r in read_records(run)} == {0, 1}, "killed once, restarted once"
    ref_params, run_params = torch.load(ref / "final_params.pt"), torch.load(run / "final_params.pt")
    assert ref_params.keys() == run_params.keys()
    for k in ref_params:
        assert torch.equal(ref_params[k], run_params[k]), k


@pytest.mark.timeout(420)
def test_fsdp2_resizes_4_2_3_with_kills_commit_every_step_once_and_every_sample_once_per_epoch(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    """A node of a 4-worker FSDP job SIGKILLed (4 -> 2), then a node joins (2 -> 3): each new world reshards the
    last snapshot; the effective steps are 1..N once each, the LR follows the policy and its warmup ramp exactly,
    every sample is consumed once per epoch."""
    assert_resizes_4_2_3(
        tmp_path, etcd_server, agents, "linear", samples=240, epochs=3, step_sleep=0.05, extra=["--fsdp"]
    )


@pytest.mark.timeout(400)
def test_hsdp_2x2_trains_like_ddp_and_its_snapshot_restores_the_same_full_state_as_fsdp_and_as_hsdp_3x1(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    """HSDP (a 2-D mesh: 2 replicas x 2 shards, set up by the script) through the loop: the gradients reduce
    across shards and replicas to the parameters a DDP run of the same job reaches; its snapshot (DCP, resharded
    on load) restores the same full model and optimizer state on 2 workers sharded as FSDP and on 3 workers as
    HSDP 3 x 1, and training goes on."""
    ck = ["--save-every", "5", "--epochs", "2"]
    hsdp = _run(
        tmp_path,
        "hsdp",
        etcd_server,
        agents,
        4,
        [*COMMON, *ck, "--fsdp", "--hsdp-shard", "2", "--dump-steps", "10", "--checkpoint-url", str(tmp_path / "ck")],
    )
    ddp = _run(tmp_path, "ddp", etcd_server, agents, 4, [*COMMON, *ck, "--checkpoint-url", str(tmp_path / "ck-ddp")])
    got, want = torch.load(hsdp / "final_params.pt"), torch.load(ddp / "final_params.pt")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-6), (k, (got[k] - want[k]).abs().max())

    # the same 10 steps again, stopped there, then resumed in other shapes
    stopped = ["--checkpoint-url", str(tmp_path / "ck-stop"), "--save-every", "5", "--epochs", "3"]
    hsdp_2x2 = ["--fsdp", "--hsdp-shard", "2"]
    saved = _run(
        tmp_path,
        "saved",
        etcd_server,
        agents,
        4,
        [*COMMON, *stopped, *hsdp_2x2, "--max-steps", "10", "--dump-steps", "10"],
    )
    for world, shape in ((2, []), (3, ["--hsdp-shard", "1"])):
        rec = _run(
            tmp_path,
            f"resumed{world}",
            etcd_server,
            agents,
            world,
            [*COMMON, *stopped, "--fsdp", *shape, "--dump-start", "--max-steps", str(10 + world)],
        )
        _same_full_state(saved / "dump-step10.pt", rec / "dump-start.pt")
        assert sorted({r["step"] for r in read_records(rec)}) == list(range(11, 11 + world)), world


# slow since 2026-12-06 (the suite's 15 minutes): the sharded resize's mechanics stay in the default suite (the
# 4 -> 2 -> 3 resizes with kills, every step once and every sample once per epoch; the snapshot restored at 2, 1 and
# 3 workers; the same-world resume bit-identical), and the convergence of a resized run in the DDP small form
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp2_resized_run_converges_within_2_percent_of_fixed_world_small_form(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    """An FSDP2 job resized 4 -> 2 -> 3 workers (a node SIGKILLed, then one joins; each world reshards the last
    snapshot) ends within 2 % of the final loss of the same job on 4 workers throughout."""
    assert_converges(tmp_path, etcd_server, agents, "fixed-global-batch", seed=0, extra=["--fsdp"])


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fsdp2_resized_run_converges_within_2_percent_of_fixed_world_3_seeds(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent], seed: int
) -> None:
    assert_converges(tmp_path, etcd_server, agents, "fixed-global-batch", seed, extra=["--fsdp"])
