"""Shared nodes on real agents: priorities shrink and grow jobs back, a drain moves a job off a node.

Real etcd, the controller and three agents as ``etrain`` processes, stock torchrun with the etcd-v3 rendezvous,
the elastic loop's test worker (``elastic/testing/train_worker.py``, per-step records) training with gloo on CPU.
Every planned move must keep the elastic loop's guarantees: each step committed once, every sample once per
epoch, every step's LR the policy's value over the worlds the job ran at, and no failure counted.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from elastic.contract.lr import LRPolicy, LRRule
from service.testing.cluster import REPO, LocalServiceCluster
from tests.integration.scenarios import hold_last_epoch
from tests.integration.service_harness import wait_api
from tests.integration.training_records import assert_every_sample_once_per_epoch, expected_factors, read_records

WORKER = str(REPO / "elastic" / "testing" / "train_worker.py")
BATCH, LR, WARMUP, BASE_WORLD = 4, 0.05, 2, 2


def _spec(
    name: str,
    rec: Path,
    *,
    samples: int,
    epochs: int,
    min_nodes: int,
    max_nodes: int,
    priority: int = 0,
    sleep: float = 0.05,
    recovery: str = "restart",
    hold: Path | None = None,
) -> dict[str, Any]:
    """The test worker's job; with ``hold``, its last epoch waits at each step while that file (created here)
    exists (a live job's steps 0.5 s at most each: it admits joiners at step boundaries)."""
    return {
        "name": name,
        "entrypoint": WORKER,
        "args": [
            "--epochs",
            str(epochs),
            "--samples",
            str(samples),
            "--batch",
            str(BATCH),
            "--lr",
            str(LR),
            "--lr-rule",
            "linear",
            "--base-world",
            str(BASE_WORLD),
            "--warmup",
            str(WARMUP),
            "--save-every",
            "10",
            "--step-sleep",
            str(sleep),
            "--record",
            str(rec),
            *(hold_last_epoch(hold, epochs, 0.5 if recovery == "live" else 0.0) if hold is not None else []),
        ],
        "env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
        "min_nodes": min_nodes,
        "max_nodes": max_nodes,
        "priority": priority,
        "recovery": recovery,
        "rendezvous": {"last_call_timeout": 1},
        "restart_policy": {"backoff_initial": 1},
    }


def _effective(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """For each step, the records of the last attempt that committed it (earlier attempts were rolled back)."""
    by_step: dict[int, dict[Any, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if not r.get("late"):
            by_step[r["step"]][r["attempt"]].append(r)
    return {s: max(a.values(), key=lambda rs: max(r["t"] for r in rs)) for s, a in by_step.items()}


def _worlds(rec: Path) -> list[int]:
    eff = _effective(read_records(rec))
    worlds = [eff[s][0]["world"] for s in sorted(eff)]
    return [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]


def _check_elastic_loop(rec: Path, samples: int) -> list[int]:
    """The elastic loop's checks on a finished job's records; returns its worlds in order."""
    eff = _effective(read_records(rec))
    steps = sorted(eff)
    assert steps == list(range(1, steps[-1] + 1)), "every step committed"
    for s in steps:
        ranks = sorted(r["rank"] for r in eff[s])
        assert ranks == list(range(eff[s][0]["world"])), f"step {s}: one record per rank, exactly once: {ranks}"
    assert_every_sample_once_per_epoch(eff, samples)
    policy = LRPolicy(LRRule.LINEAR, LR, BASE_WORLD, BATCH, warmup_steps=WARMUP)
    expected = expected_factors(policy, eff)
    for s in steps:
        for r in eff[s]:
            assert r["lr"] == pytest.approx(LR * expected[s], rel=1e-12), (s, r["lr"], LR * expected[s])
    return _worlds(rec)


def _cluster_of(cluster: LocalServiceCluster, *names: str, spare: str | None = None) -> Any:
    """The controller and agents ``names`` (and a hot ``spare``), once every agent is registered."""
    api = cluster.start_controller()
    for name in names:
        cluster.start_agent(name)
    if spare is not None:
        cluster.start_agent(spare, spare=True)
    count = len(names) + (spare is not None)
    wait_api(f"{count} nodes", lambda: len(api.nodes()) == count, 60)
    return api


def _finished(api: Any, job_id: str, timeout: float) -> dict[str, Any]:
    final = wait_api(
        f"job {job_id} to end",
        lambda: (j := api.job(job_id))["state"] in ("succeeded", "failed", "cancelled") and j,
        timeout,
    )
    assert final["state"] == "succeeded", (final["message"], final["last_error"])
    return final


@pytest.mark.timeout(420)
def test_a_high_priority_job_shrinks_a_low_one_which_grows_back_both_exactly_once(
    cluster: LocalServiceCluster, tmp_path: Path
) -> None:
    api = _cluster_of(cluster, "node-1", "node-2", "node-3")
    low_rec, high_rec = tmp_path / "low", tmp_path / "high"
    # the low job cannot end before it is back on 3 nodes, however slow the machine: its last epoch waits for this
    # file to go (on a loaded machine it once trained its last steps at world 1 while the high job ran)
    hold = tmp_path / "hold"
    low = api.submit(_spec("low", low_rec, samples=360, epochs=3, min_nodes=1, max_nodes=3, hold=hold))["id"]
    wait_api(
        "the low job at world 3",
        lambda: 3 in _worlds(low_rec) and max((r["step"] for r in read_records(low_rec)), default=0) >= 5,
        150,
    )

    # where the job first trained at world 3: on a loaded machine its three torchruns can start further apart than
    # the rendezvous's last call (1 s), and the job then forms at world 1 or 2 first and grows (not a planned move)
    full = _worlds(low_rec).index(3)

    high = api.submit(_spec("high", high_rec, samples=160, epochs=1, min_nodes=2, max_nodes=2, priority=10))["id"]
    wait_api("the high job on 2 nodes", lambda: len(api.job(high)["nodes"]) == 2, 60)
    shrunk = api.job(low)
    assert len(shrunk["nodes"]) == 1 and shrunk["restarts"]["planned"] == 2, shrunk
    assert not set(shrunk["nodes"]) & set(api.job(high)["nodes"])

    high_final = _finished(api, high, 180)
    wait_api("the low job back on 3 nodes", lambda: len(api.job(low)["nodes"]) == 3, 90)
    wait_api("the low job training at world 3 again", lambda: 3 in _worlds(low_rec)[full + 2 :], 120)
    hold.unlink()
    low_final = _finished(api, low, 240)

    assert _check_elastic_loop(high_rec, 160) == [2]
    low_worlds = _check_elastic_loop(low_rec, 360)
    assert set(low_worlds[:full]) <= {1, 2}, low_worlds
    assert low_worlds[full : full + 2] == [3, 1], low_worlds
    # back to 3: the two freed nodes in one re-form, or (on a loaded machine, the second arriving after the
    # first's last call) one after the other
    back = low_worlds[full + 2 :]
    assert back[:1] == [3] or back[:2] == [2, 3], low_worlds
    for final in (low_final, high_final):
        # the events say which generation failed and why (a loaded parallel run counted one failure now and then)
        assert final["restarts"]["failure"] == 0, (final["restarts"], final["last_error"], api.events(final["id"]))
    assert low_final["restarts"]["planned"] == 2 and low_final["restarts"]["preempted"] == 0
    types = [e["type"] for e in api.events(low)]
    assert "shrunk" in types and types.count("node_joined") == 2


@pytest.mark.timeout(300)
def test_a_drain_moves_a_live_job_off_a_node_with_no_failure_and_no_lost_step(
    cluster: LocalServiceCluster, tmp_path: Path
) -> None:
    api = _cluster_of(cluster, "node-1", "node-2", "node-3")
    rec = tmp_path / "rec"
    job = api.submit(_spec("drained", rec, samples=320, epochs=3, min_nodes=2, max_nodes=2, recovery="live"))["id"]
    wait_api(
        "the job at world 2",
        lambda: 2 in _worlds(rec) and max((r["step"] for r in read_records(rec)), default=0) >= 5,
        150,
    )
    before = api.job(job)
    drained = before["nodes"][0]
    spare = ({"node-1", "node-2", "node-3"} - set(before["nodes"])).pop()
    api.node_op(drained, "drain", reason="maintenance")

    def moved() -> bool:
        return sorted(api.job(job)["nodes"]) == sorted({*before["nodes"], spare} - {drained})

    wait_api("the job to move off the drained node", moved, 60)
    modes = {n["name"]: n["mode"] for n in api.nodes()}
    wait_api("the node drained", lambda: {n["name"]: n["mode"] for n in api.nodes()}[drained] == "drained", 60)
    assert modes[spare] == "active"
    final = _finished(api, job, 200)
    assert final["restarts"]["failure"] == 0 and final["restarts"]["in_place"] == 0, final["restarts"]
    assert final["restarts"]["planned"] == 1 and final["generation"] == 1  # live: the same generation
    worlds = _check_elastic_loop(rec, 320)
    assert set(worlds) <= {1, 2}, worlds
    assert "evacuated" in [e["type"] for e in api.events(job)]


@pytest.mark.timeout(300)
def test_a_hot_spare_replaces_a_killed_node_its_workers_forked_from_its_warm_zygote(
    cluster: LocalServiceCluster, tmp_path: Path
) -> None:
    # A 2 s node lease can lapse on a loaded 2-core machine: the job would then lose a node before the kill, and the
    # spare join it early (seen once in a full run). 4 s keeps this scenario about the kill below.
    cluster.lease_ttl = 4.0
    api = _cluster_of(cluster, "node-1", "node-2", spare="spare-1")
    spare = next(n for n in api.nodes() if n["name"] == "spare-1")
    assert spare["spare"] is True
    rec = tmp_path / "rec"
    # the last epoch holds until the spare's worker trained: on a loaded machine the job could end at world 1 first
    hold = tmp_path / "hold"
    job = api.submit(_spec("spared", rec, samples=320, epochs=3, min_nodes=1, max_nodes=3, recovery="live", hold=hold))[
        "id"
    ]
    wait_api(
        "the job at world 2",
        lambda: 2 in _worlds(rec) and max((r["step"] for r in read_records(rec)), default=0) >= 5,
        150,
    )
    nodes = sorted(api.job(job)["nodes"])
    assert nodes == ["node-1", "node-2"], (nodes, api.events(job))  # held back: the job is below max_nodes
    zygotes = _zygotes_of(spare["pid"])
    assert len(zygotes) == 1, "the spare's agent keeps one zygote warm before any job"

    cluster.kill_agent("node-2")
    wait_api("the spare to join", lambda: sorted(api.job(job)["nodes"]) == ["node-1", "spare-1"], 60)
    wait_api("the spare's worker to train", lambda: any(r["agent"] == "spare-1" for r in read_records(rec)), 90)
    spare_pids = {r["pid"] for r in read_records(rec) if r["agent"] == "spare-1"}
    parents = {_parent(pid) for pid in spare_pids} - {None}
    assert parents == {zygotes[0]}, (spare_pids, parents, zygotes)  # forked from the zygote warm since start
    hold.unlink()
    final = _finished(api, job, 200)
    assert final["restarts"]["failure"] == 0, final["restarts"]
    _check_elastic_loop(rec, 320)


def _zygotes_of(agent_pid: int) -> list[int]:
    """The zygote processes owned by ``agent_pid`` (``python -m elastic.prefork --serve PATH OWNER GRACE``)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a for a in argv if a]
        if b"--serve" in args and args[args.index(b"--serve") + 2 :][:1] == [str(agent_pid).encode()]:
            found.append(int(proc.name))
    return found


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])
