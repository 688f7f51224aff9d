"""Live recovery under real torchrun on real etcd (``--rdzv-conf recovery=live``, ``--recovery live``).

Each test runs three torchrun agents of one worker each and checks, over the whole run: the survivors'
worker processes are the ones that started (torchrun restarted none of them); every step is committed once,
by exactly one world's worth of ranks; every sample is served once per epoch; the LR follows the policy
over the worlds the run went through; and after every step, joins included, all replicas are bit-identical
(each record carries a digest of the replica's parameters and optimizer state).
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from elastic.checkpoint import create_checkpoint_manager
from elastic.contract.lr import LRPolicy, LRRule
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.torchrun import TorchrunAgent, torchrun_command
from elastic.testing.wait import wait_until
from tests.integration.training_records import (
    agent_logs,
    assert_every_sample_once_per_epoch,
    assert_exits_ok,
    expected_factors,
    hold_args,
    max_step,
    read_records,
)

WORKER = str(Path(__file__).resolve().parents[2] / "elastic" / "testing" / "train_worker.py")
SAMPLES, BATCH, LR, WARMUP, BASE_WORLD = 360, 4, 0.05, 3, 3


def _args(tmp: Path, epochs: int, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "--recovery",
        "live",
        "--epochs",
        str(epochs),
        "--samples",
        str(SAMPLES),
        "--batch",
        str(BATCH),
        "--lr",
        str(LR),
        "--lr-rule",
        "linear",
        *extra,
        "--base-world",
        str(BASE_WORLD),
        "--warmup",
        str(WARMUP),
        "--save-every",
        "10",
        "--step-sleep",
        "0.08",
        "--checkpoint-url",
        str(tmp / "ck"),
        "--record",
        str(tmp / "rec"),
    ]


def _agent(
    tmp: Path,
    name: str,
    etcd: LocalEtcdCluster,
    run_id: str,
    epochs: int,
    nnodes: str = "2:3",
    nproc: int = 1,
    extra: tuple[str, ...] = (),
    warm: bool = True,
) -> TorchrunAgent:
    """A live-mode agent; ``warm``: its workers fork from the agent's prefork zygote (the service's default). Its
    last epoch's steps wait up to 0.5 s each while ``tmp/hold`` exists (made by :func:`_hold`): a joiner is admitted
    at a step boundary, so the job is slowed, not stopped, until the test saw it join; once the file is gone the
    steps no longer sleep either (the rest of the job runs at full speed)."""
    hold = hold_args(tmp / "hold", epochs, most=0.5, pace=True)
    cmd = torchrun_command(
        backend="etcd-v3",
        endpoint=etcd.endpoints,
        run_id=run_id,
        nnodes=nnodes,
        nproc=nproc,
        rdzv_conf={"recovery": "live", "last_call_timeout": 1},
        max_restarts=5,
        script=WORKER,
        script_args=_args(tmp, epochs, (*extra, *hold)),
        prefork=warm,
    )
    env = {"LOGLEVEL": "WARNING", "TEST_AGENT_NAME": name}
    return TorchrunAgent(cmd, tmp / f"{name}.log", env=env, forked=True).start()


def _hold(tmp: Path) -> Path:
    """The file that slows the last epoch of :func:`_agent`'s job while it exists; the test removes it."""
    path = tmp / "hold"
    path.touch()
    return path


def _by_step(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        out[r["step"]].append(r)
    return dict(out)


def _worlds(records: list[dict[str, Any]]) -> list[int]:
    by = _by_step(records)
    worlds = [by[s][0]["world"] for s in sorted(by)]
    return [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]


def _check_run(
    rec: Path, agents: list[TorchrunAgent], samples: int = SAMPLES, policy: LRPolicy | None = None
) -> dict[int, list[dict[str, Any]]]:
    records = read_records(rec)
    by = _by_step(records)
    steps = sorted(by)
    assert steps == list(range(1, steps[-1] + 1)), "every step committed"
    for s in steps:
        world = {r["world"] for r in by[s]}
        assert len(world) == 1, f"step {s} recorded by two worlds: {by[s]}"
        ranks = sorted(r["rank"] for r in by[s])
        assert ranks == list(range(world.pop())), f"step {s}: one record per rank, exactly once: {ranks}"
        shards: dict[int | None, set[str]] = defaultdict(set)  # sharded (HSDP): one digest per shard index
        for r in by[s]:
            if not r["late"]:
                shards[r.get("shard")].add(r["digest"])
        for shard, digests in shards.items():
            assert len(digests) == 1, f"step {s}, shard {shard}: replicas differ: {digests}"
    assert_every_sample_once_per_epoch(by, samples)
    policy = policy or LRPolicy(LRRule.LINEAR, LR, BASE_WORLD, BATCH, warmup_steps=WARMUP)
    expected = expected_factors(policy, by)
    for s in steps:
        for r in by[s]:
            assert r["lr"] == pytest.approx(LR * expected[s], rel=1e-12), (s, r["lr"], LR * expected[s])
    final = [p for p in rec.glob("final.rank*.json")]
    assert len(final) >= 2
    return by


def _assert_worlds(records: list[dict[str, Any]], expected: list[int]) -> None:
    """The run went through ``expected`` (start, fault, recovery); on a loaded machine the first generation may
    have been founded before the last node's workers registered (they then joined it): a smaller world first."""
    worlds = _worlds(records)
    assert worlds[-len(expected) :] == expected and set(worlds) <= set(expected), worlds


def _fully_recorded(rec: Path, step: int) -> bool:
    """The job is at ``step`` or later and every rank has written its record of the newest committed step: a kill
    now finds the victims after that record (in the step's pacing sleep), not between a commit and its record, which
    would leave a committed step without a victim's record (seen once under the parallel suite's load)."""
    records = read_records(rec)
    newest = max((r["step"] for r in records), default=0)
    at = [r for r in records if r["step"] == newest and not r["late"]]
    return newest >= step and bool(at) and len(at) == at[0]["world"]


def _pids(records: list[dict[str, Any]], agent: str) -> set[int]:
    return {r["pid"] for r in records if r["agent"] == agent and not r["late"]}


@pytest.mark.timeout(300)
def test_live_worker_crash_survivors_keep_their_processes_and_the_restarted_worker_rejoins(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    rec = tmp_path / "rec"
    run_id = f"live-crash-{uuid.uuid4().hex[:6]}"
    # cold starts: a worker forked warm is back in time to join the re-form of its own crash (3 -> 3, seen);
    # this test is about the 3 -> 2 -> 3 path
    hold = _hold(tmp_path)
    agents += [_agent(tmp_path, name, etcd_server, run_id, epochs=8, warm=False) for name in ("a", "b", "c")]
    assert wait_until(lambda: any(r["world"] == 3 for r in read_records(rec)), 120), agent_logs(agents)
    assert wait_until(lambda: _fully_recorded(rec, 20), 120), agent_logs(agents)
    agents[2].kill_workers()  # c's worker crashes: its agent alone restarts it; a and b go on
    assert wait_until(lambda: _worlds(read_records(rec))[-1:] == [3] and len(_worlds(read_records(rec))) >= 3, 120), (
        agent_logs(agents)
    )
    hold.unlink()
    for agent in agents:
        assert_exits_ok(agent, agents, 240)

    records = read_records(rec)
    _check_run(rec, agents)
    _assert_worlds(records, [3, 2, 3])
    assert len(_pids(records, "a")) == 1 and len(_pids(records, "b")) == 1, "a survivor's worker was restarted"
    assert len(_pids(records, "c")) == 2, "c's worker was restarted once and rejoined"
    assert {r["restart"] for r in records if r["agent"] in ("a", "b")} == {0}


@pytest.mark.timeout(300)
def test_live_node_loss_then_a_replacement_node_joins_with_the_state_of_a_peer(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    rec = tmp_path / "rec"
    run_id = f"live-node-{uuid.uuid4().hex[:6]}"
    hold = _hold(tmp_path)
    agents += [_agent(tmp_path, name, etcd_server, run_id, epochs=8) for name in ("a", "b", "c")]
    assert wait_until(lambda: any(r["world"] == 3 for r in read_records(rec)), 120), agent_logs(agents)
    assert wait_until(lambda: _fully_recorded(rec, 20), 120), agent_logs(agents)
    agents[2].kill_tree()  # node c dies with its agent: 3 -> 2
    assert wait_until(lambda: _worlds(read_records(rec))[-1:] == [2], 60), agent_logs(agents)
    shrunk_at = max_step(rec)
    # a replacement node (2 -> 3), started at once: 8 epochs leave it about 200 steps (> 15 s) to join, and the last
    # epoch is slowed until it did
    agents.append(_agent(tmp_path, "d", etcd_server, run_id, epochs=8))
    assert wait_until(lambda: any(r["agent"] == "d" for r in read_records(rec)), 150), agent_logs(agents)
    hold.unlink()
    for agent in (agents[0], agents[1], agents[3]):
        assert_exits_ok(agent, agents, 240)

    records = read_records(rec)
    _check_run(rec, agents)
    _assert_worlds(records, [3, 2, 3])
    assert len(_pids(records, "a")) == 1 and len(_pids(records, "b")) == 1, "a survivor's worker was restarted"
    first_d = min(r["step"] for r in records if r["agent"] == "d")
    assert first_d > shrunk_at, "the replacement trained from the live state, not from step 0"
    # the snapshots hold the bare module's state (a restart, or a re-founded group, restores them)
    with create_checkpoint_manager(str(tmp_path / "ck")) as manager:
        state = manager.load_latest().training_state()
    assert state.model and not any(k.startswith("module.") for k in state.model), list(state.model)


@pytest.mark.timeout(300)
def test_live_hsdp_node_loss_keeps_the_survivors_shards_and_a_joiner_takes_each_shard_from_the_surviving_replica(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    """HSDP, 2 nodes x 2 workers (a node a replica of 2 shards), the trainer sharding the model for each generation
    (``parallelize=``): node b SIGKILLed -> a's workers go on as one replica in the same processes, shards in place;
    node c joins -> each of its workers receives the shard of its index from a's; replicas identical every step."""
    rec = tmp_path / "rec"
    run_id = f"live-hsdp-{uuid.uuid4().hex[:6]}"
    # fixed-global-batch: 2 micro-batches per step on 2 workers; 16 k + 2 samples: the last step of an epoch leaves
    # ranks without samples (a zero-weight micro-batch: FSDP's collectives need every rank)
    samples = 16 * 22 + 2
    hsdp = (
        "--fsdp",
        "--parallelize",
        "--lr-rule",
        "fixed-global-batch",
        "--base-world",
        "4",
        "--samples",
        str(samples),
    )
    hold = _hold(tmp_path)
    agents += [_agent(tmp_path, n, etcd_server, run_id, epochs=10, nnodes="1:2", nproc=2, extra=hsdp) for n in "ab"]
    assert wait_until(lambda: any(r["world"] == 4 for r in read_records(rec)), 120), agent_logs(agents)
    assert wait_until(lambda: _fully_recorded(rec, 15), 120), agent_logs(agents)
    agents[1].kill_tree()  # node b (a replica) dies with its agent: 4 -> 2
    assert wait_until(lambda: _worlds(read_records(rec))[-1:] == [2], 60), agent_logs(agents)
    shrunk_at = max_step(rec)
    agents.append(_agent(tmp_path, "c", etcd_server, run_id, epochs=10, nnodes="1:2", nproc=2, extra=hsdp))
    assert wait_until(lambda: any(r["agent"] == "c" for r in read_records(rec)), 150), agent_logs(agents)
    hold.unlink()
    for agent in (agents[0], agents[2]):
        assert_exits_ok(agent, agents, 240)

    records = read_records(rec)
    policy = LRPolicy(LRRule.FIXED_GLOBAL_BATCH, LR, 4, BATCH, warmup_steps=WARMUP)
    by = _check_run(rec, agents, samples, policy)
    _assert_worlds(records, [4, 2, 4])
    assert len(_pids(records, "a")) == 2, "a survivor's worker was restarted"
    assert {r["restart"] for r in records if r["agent"] == "a"} == {0}
    first_c = min(r["step"] for r in records if r["agent"] == "c")
    assert first_c > shrunk_at, "the joiner trained from the live shards, not from a snapshot or step 0"
    # the joiner's first step: its shards (digest per shard index) are the surviving replica's
    for r in by[first_c]:
        assert r["shard"] == r["rank"] % 2
    assert {r["shard"] for r in by[first_c] if r["agent"] == "c"} == {0, 1}
