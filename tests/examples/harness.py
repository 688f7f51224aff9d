"""Running an elastic example as its users do (torchrun on etcd-v3, warm workers from the test process's zygote) and
checking it by what it records and saves.

Each ``examples/elastic_<name>.py`` passes ``common.record_steps()`` as its ``on_step`` hook and ends with
``common.log_final(loss)``: with ``$EXAMPLES_RECORD`` set (here), every worker appends each committed step (its rank,
world, sample indices) to ``steps.<pid>.jsonl`` there, rank 0 writes ``final.json``, and a worker waits after step S
while ``hold-S`` exists there, after any step at a world of W while ``hold-world-W`` does (both until torchrun's
SIGTERM), and after every step while ``slow`` does (the seconds in it). :func:`check_example` runs them.
"""

from __future__ import annotations

import fnmatch
import json
import subprocess
import threading
import time
import uuid
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.checkpoint import create_checkpoint_manager
from elastic.contract.rendezvous import DEFAULT_KEY_PREFIX
from elastic.etcd import create_client
from elastic.live.protocol import LiveKeys
from elastic.rendezvous.protocol import RendezvousKeys
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.ports import free_port
from elastic.testing.torchrun import TorchrunAgent, torchrun_command
from elastic.testing.wait import wait_until
from elastic.train.sampler import ElasticSampler
from tests.integration.training_records import agent_logs, assert_exits_ok, effective_records

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RECORD_ENV = "EXAMPLES_RECORD"  # examples/common.py


@dataclass(frozen=True)
class Example:
    """One elastic example with the tests' small settings, and the steps its scenarios act at."""

    name: str  # examples/elastic_<name>.py (its twin: ddp_<name>.py)
    args: tuple[str, ...]
    samples: int  # the size of the data set its sampler draws from
    global_batch: int  # samples per step (the LR policy is fixed-global-batch)
    steps: int  # the run's last step
    kill_at: int  # the step after which the workers are killed (a snapshot committed by then)
    grow_at: int  # the step after which the lone worker (world 1) waits until a new node's agent stops it
    slow: float = 0.1  # live mode: seconds each step waits until the new node's worker is admitted
    twin_rtol: float = 1e-4  # how close the DDP twin's final loss is to the elastic fixed world's (same batches)
    replacement: bool = False  # drawn with replacement (random windows): the stream is the epochs' draws
    loader: bool = False  # the script's own DataLoader serves the loop (see NOT_COMPARED)
    seed: int = 0

    @property
    def script(self) -> Path:
        return EXAMPLES / f"elastic_{self.name}.py"

    def expected_steps(self) -> list[list[int]]:
        """The samples of each step 1..steps, all ranks together: the sampler's stream cut into global batches
        (the last step of an epoch takes what is left), whatever the worlds the steps ran at."""
        kwargs: dict[str, Any] = {"seed": self.seed, "replacement": self.replacement}
        sampler = ElasticSampler(self.samples, **kwargs)
        out = []
        for _ in range(self.steps):
            out.append(sampler.step_indices(self.global_batch))  # rank 0 of a world of 1: the whole step
            sampler.advance(self.global_batch)
        return out


def read_steps(rec: Path) -> list[dict[str, Any]]:
    out = []
    for f in rec.glob("steps.*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a SIGKILL
    return out


def ranks_at(rec: Path, step: int, world: int) -> set[int]:
    return {r["rank"] for r in read_steps(rec) if r["step"] == step and r["world"] == world and not r["late"]}


def full_steps(rec: Path, world: int) -> list[int]:
    """The steps every rank of a world of ``world`` recorded (in order)."""
    records = [r for r in read_steps(rec) if r["world"] == world and not r["late"]]
    ranks: dict[int, set[int]] = defaultdict(set)
    for r in records:
        ranks[r["step"]].add(r["rank"])
    return sorted(s for s, got in ranks.items() if got == set(range(world)))


def final_loss(rec: Path) -> float:
    return float(json.loads((rec / "final.json").read_text())["loss"])


#: set when one of an example's runs failed: the others stop waiting (their agents are stopped too)
ABORT = threading.Event()


def wait(predicate: Callable[[], bool], agents: list[TorchrunAgent], timeout: float = 240) -> None:
    """Until ``predicate`` holds; fails with the agents' logs after ``timeout`` s or once another run failed."""
    assert wait_until(lambda: ABORT.is_set() or predicate(), timeout) and not ABORT.is_set(), agent_logs(agents)


def start(
    tmp: Path,
    name: str,
    etcd: LocalEtcdCluster,
    run_id: str,
    ex: Example,
    rec: Path,
    nnodes: str,
    nproc: int = 1,
    live: bool = False,
    args: Sequence[str] = (),
) -> TorchrunAgent:
    """A torchrun agent of ``ex``'s elastic script (warm: its workers fork from this process's zygote), its records
    in ``rec`` and its snapshots in ``rec/ck``; ``live``: ``--rdzv-conf recovery=live``."""
    rec.mkdir(parents=True, exist_ok=True)
    conf: dict[str, object] = {"last_call_timeout": 1}
    if live:
        conf["recovery"] = "live"
    cmd = torchrun_command(
        backend="etcd-v3",
        endpoint=etcd.endpoints,
        run_id=run_id,
        nnodes=nnodes,
        nproc=nproc,
        rdzv_conf=conf,
        max_restarts=5,
        script=str(ex.script),
        script_args=[*ex.args, *args],
        prefork=True,
    )
    env = {"LOGLEVEL": "WARNING", RECORD_ENV: str(rec), "ETRAIN_CHECKPOINT_URL": str(rec / "ck")}
    return TorchrunAgent(cmd, tmp / f"{rec.name}-{name}.log", env=env, forked=True).start()


def new_run_id(ex: Example) -> str:
    return f"{ex.name}-{uuid.uuid4().hex[:6]}"


def committed(rec: Path) -> int | None:
    """The newest committed snapshot's step under ``rec/ck`` (its manifest written), None before the first."""
    manager = create_checkpoint_manager(str(rec / "ck"))
    try:
        return manager.latest_step()
    finally:
        manager.close()


def snapshot(rec: Path, step: int) -> Mapping[str, Any]:
    manager = create_checkpoint_manager(str(rec / "ck"))
    try:
        return manager.load(step).state
    finally:
        manager.close()


#: what of a snapshot a resumed run may hold otherwise than an uninterrupted one: every worker's Python RNG (each
#: process forked from the zygote seeds it from the OS; none of the examples draws from it), and with the script's
#: DataLoader the torch RNG: each ``iter(loader)`` draws the workers' base seed from it, and a resumed run makes one
#: iterator more than an uninterrupted one, at the resume (reported; none of these scripts draws from the torch RNG
#: in training: no dropout, augmentation seeded per sample, the GAN's noise in its data)
NOT_COMPARED = ("/rng/*/python*",)
NOT_COMPARED_WITH_A_LOADER = ("/rng/*/torch*",)


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two saved states differ, bit for bit (tensors: dtype, shape and every bit; the rest: ==)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [path or "."]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def assert_each_step_once(by_step: Mapping[int, list[dict[str, Any]]], ex: Example) -> list[int]:
    """Steps 1..steps committed once each, by one world's worth of ranks; returns the worlds the run went through
    (each change once, in step order)."""
    steps = sorted(by_step)
    assert steps == list(range(1, ex.steps + 1)), f"steps committed: {steps}"
    worlds = []
    for s in steps:
        world = {r["world"] for r in by_step[s]}
        assert len(world) == 1, f"step {s} committed by two worlds: {world}"
        w = world.pop()
        assert sorted(r["rank"] for r in by_step[s]) == list(range(w)), f"step {s}: one record per rank"
        worlds.append(w)
    return [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]


def assert_every_sample_once(by_step: Mapping[int, list[dict[str, Any]]], ex: Example) -> None:
    """Each step's samples (all its ranks together, by sample id) are the next global batch of the sampler's stream:
    every sample (every draw, with replacement) consumed exactly once, in order, across the kills and resizes."""
    for s, want in enumerate(ex.expected_steps(), start=1):
        got = Counter(i for r in by_step[s] for i in r["indices"])
        assert got == Counter(want), f"step {s}: samples {sorted(got.elements())[:8]}... != {sorted(want)[:8]}..."


def restart_steps(rec: Path) -> dict[int, list[dict[str, Any]]]:
    """Restart mode: for each step, the records of the worker group that committed it last (an attempt killed
    before its snapshot was redone from the snapshot)."""
    return effective_records(read_steps(rec))


def live_steps(rec: Path) -> dict[int, list[dict[str, Any]]]:
    """Live mode: every record (a step applied when a member failed is recorded late, once, by a survivor)."""
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in read_steps(rec):
        out[r["step"]].append(r)
    return dict(out)


def assert_loss_close(got: float, want: float, what: str) -> None:
    print(f"{what}: {got:.6f} vs the fixed-world run's {want:.6f} ({100 * (got - want) / want:+.3f} %)")
    assert abs(got - want) <= 0.02 * abs(want), f"{what}: final loss {got} not within 2 % of {want}"


def fixed_world(tmp: Path, etcd: LocalEtcdCluster, agents: list[TorchrunAgent], ex: Example) -> Path:
    """The reference: 2 workers on one agent, never interrupted; its records (and snapshots) directory."""
    rec = tmp / "fixed"
    agent = start(tmp, "agent", etcd, new_run_id(ex), ex, rec, nnodes="1", nproc=2)
    agents.append(agent)
    assert_exits_ok(agent, agents, 300)
    return rec


def kill_and_resume(tmp: Path, etcd: LocalEtcdCluster, agents: list[TorchrunAgent], ex: Example) -> Path:
    """2 workers on one agent, both SIGKILLed while they wait after ``kill_at`` with a snapshot committed: torchrun
    restarts them, they resume from the newest snapshot at the same world and train to the end."""
    rec = tmp / "killed"
    rec.mkdir()
    hold = rec / f"hold-{ex.kill_at}"
    hold.touch()
    agent = start(tmp, "agent", etcd, new_run_id(ex), ex, rec, nnodes="1", nproc=2)
    agents.append(agent)
    ready = lambda: ranks_at(rec, ex.kill_at, 2) == {0, 1} and committed(rec) is not None  # noqa: E731
    wait(ready, agents)
    agent.kill_workers()
    hold.unlink()
    assert_exits_ok(agent, agents, 300)
    return rec


def resize_2_1_2(tmp: Path, etcd: LocalEtcdCluster, agents: list[TorchrunAgent], ex: Example) -> Path:
    """Restart mode: two 1-worker agents (world 2); one node is lost whole while both workers wait after
    ``kill_at`` (SIGKILL of its agent and worker: the survivor's worker fails in its next collective and its agent
    restarts it alone from the newest snapshot, world 1); while the lone worker waits after ``grow_at`` a new node's
    agent joins (the lone worker is stopped by SIGTERM, saves that step, and the two restart from it: world 2)."""
    rec = tmp / "resized"
    rec.mkdir()
    holds = [rec / f"hold-{ex.kill_at}", rec / f"hold-{ex.grow_at}"]
    for h in holds:
        h.touch()
    run_id = new_run_id(ex)
    a, b = (start(tmp, n, etcd, run_id, ex, rec, nnodes="1:2") for n in ("a", "b"))
    agents += [a, b]
    ready = lambda: ranks_at(rec, ex.kill_at, 2) == {0, 1} and committed(rec) is not None  # noqa: E731
    wait(ready, agents)
    b.kill_tree()
    holds[0].unlink()
    wait(lambda: ranks_at(rec, ex.grow_at, 1) == {0}, agents)
    started = time.time()
    c = start(tmp, "c", etcd, run_id, ex, rec, nnodes="1:2")
    agents.append(c)
    grown = lambda: any(r["world"] == 2 and r["t"] > started for r in read_steps(rec))  # noqa: E731
    wait(grown, agents)
    holds[1].unlink()  # (a resume from an older snapshot would wait there again)
    for agent in (a, c):
        assert_exits_ok(agent, agents, 300)
    return rec


def joiners(etcd: LocalEtcdCluster, run_id: str) -> set[str]:
    """The workers registered in a live job's group that wait to be admitted (their keys in etcd)."""
    keys = LiveKeys(RendezvousKeys.of(DEFAULT_KEY_PREFIX, run_id).live)
    client = create_client(etcd.config(op_timeout=5))
    try:
        return {kv.key for kv in client.get_prefix(keys.joiners)[0]}
    finally:
        client.close()


def live_2_1_2(tmp: Path, etcd: LocalEtcdCluster, agents: list[TorchrunAgent], ex: Example) -> Path:
    """Live mode (``--rdzv-conf recovery=live``): two 1-worker agents; one node is lost whole while both workers wait
    after their first step at world 2 (the survivor drops the next step and re-forms alone in the same process: world
    1; it waits after its first step alone); a new node's agent starts, and once its worker is registered, waiting to
    be admitted, the survivor goes on (each step slowed by ``ex.slow`` s until it is admitted: world 2), then at full
    speed to the end. (The node is lost between steps, so that the scenario is the same whatever the timing; a node lost
    inside a step's commit, its samples recorded late by the survivor, is tests/integration/test_live_recovery.py's.)"""
    rec = tmp / "live"
    rec.mkdir()
    two, alone, slow = rec / "hold-world-2", rec / "hold-world-1", rec / "slow"
    two.touch()
    run_id = new_run_id(ex)
    a, b = (start(tmp, n, etcd, run_id, ex, rec, nnodes="1:3", live=True) for n in ("a", "b"))
    agents += [a, b]
    wait(lambda: bool(full_steps(rec, 2)), agents)
    held = full_steps(rec, 2)[0]  # both wait after it
    alone.touch()
    b.kill_tree()
    two.unlink()
    wait(lambda: any(r["world"] == 1 and r["step"] > held for r in read_steps(rec)), agents)
    before = joiners(etcd, run_id)
    started = time.time()
    c = start(tmp, "c", etcd, run_id, ex, rec, nnodes="1:3", live=True)
    agents.append(c)
    wait(lambda: bool(joiners(etcd, run_id) - before), agents)
    slow.write_text(str(ex.slow))
    alone.unlink()
    wait(lambda: any(r["world"] == 2 and r["t"] > started for r in read_steps(rec)), agents)
    slow.unlink()
    for agent in (a, c):
        assert_exits_ok(agent, agents, 300)
    return rec


#: a plain DDP script on gloo (torch 2.13, CPU) that trained and destroyed its process group hangs at exit in about
#: one run in ten (ddp_gan.py, three at a time: 13 of 129 runs, as it is, with a dist.barrier() before the teardown,
#: or with every rank evaluating before it): when the DDP module is freed, its reducer drops the last reference of the
#: ProcessGroupGloo, whose destructor joins the group's worker threads while holding the GIL, and a worker freeing the
#: last collective's work (whose thread-local state holds a Python object) waits for the GIL (gdb: the main thread in
#: ~ProcessGroupGloo -> std::thread::join, the pt_gloo_runloop thread in ~AsyncWork -> ~ThreadLocalState ->
#: SafePyObject decref -> take_gil). The loop sleeps before its teardown (elastic.compat.destroy_process_group)
TEARDOWN_HANG = "gloo's teardown deadlock (ProcessGroupGloo's destructor joins its threads holding the GIL)"


def ddp_twin(tmp: Path, etcd: LocalEtcdCluster, agents: list[TorchrunAgent], ex: Example) -> Path:
    """``examples/ddp_<name>.py``, the plain-DDP script the elastic one was made from, with the same settings: 2
    workers on one torchrun agent (c10d rendezvous, warm); its final loss in ``tmp/ddp/final.json``."""
    rec = tmp / "ddp"
    rec.mkdir()
    cmd = torchrun_command(
        backend="c10d",
        endpoint=f"127.0.0.1:{free_port()}",
        run_id=new_run_id(ex),
        nnodes="1",
        nproc=2,
        max_restarts=0,
        script=str(EXAMPLES / f"ddp_{ex.name}.py"),
        script_args=list(ex.args),
        prefork=True,
    )
    agent = TorchrunAgent(cmd, tmp / "ddp.log", env={"LOGLEVEL": "WARNING", RECORD_ENV: str(rec)}, forked=True)
    agents.append(agent.start())
    wait(lambda: (rec / "final.json").exists() or agent.process is None or agent.process.poll() is not None, agents)
    try:
        code = agent.wait(timeout=8)  # (it exits in a second or two once the final loss is written)
    except subprocess.TimeoutExpired:  # torch's, not the example's: see TEARDOWN_HANG
        agent.stop()
        warnings.warn(f"ddp_{ex.name}.py trained, then hung at exit: {TEARDOWN_HANG}", stacklevel=1)
        return rec
    assert code == 0, agent_logs(agents)
    return rec


def check_example(tmp: Path, etcd: LocalEtcdCluster, agents: list[TorchrunAgent], ex: Example, live: bool) -> None:
    """The runs of ``ex`` side by side (a fixed world; a kill and resume at the same world; 2 -> 1 -> 2 in restart
    mode; with ``live``, 2 -> 1 -> 2 in live mode), then what each proves:

    - the killed and resumed run's final snapshot is the uninterrupted one's, bit for bit (model, optimizer(s),
      registered state, data cursor, LR ramp; see NOT_COMPARED), and so is its final loss;
    - every run commits every step once, by one world's worth of ranks, consuming every sample (every draw) once;
    - the resized runs go 2 -> 1 -> 2 (the live survivor in one process) and end within 2 % of the fixed world's
      final loss;
    - the DDP twin runs, and ends where the fixed world does (``twin_rtol``: with the same global batches, the same
      loss up to rounding)."""
    scenarios = [fixed_world, kill_and_resume, resize_2_1_2, ddp_twin, *([live_2_1_2] if live else [])]
    ABORT.clear()
    with ThreadPoolExecutor(len(scenarios)) as pool:
        futures = [pool.submit(run, tmp, etcd, agents, ex) for run in scenarios]
        done, _ = futures_wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f.exception() for f in done if f.exception() is not None]
        if failed:
            ABORT.set()  # the others stop waiting; their agents are stopped
            for agent in list(agents):
                agent.stop()
            raise failed[0]
        recs = [f.result() for f in futures]
    fixed, killed, resized, ddp = recs[:4]
    print(f"{ex.name}: final loss {final_loss(fixed):.6f} (fixed world), {final_loss(ddp):.6f} (the DDP twin)")
    assert final_loss(ddp) == pytest.approx(final_loss(fixed), rel=ex.twin_rtol), "the DDP twin trains otherwise"

    assert assert_each_step_once(restart_steps(fixed), ex) == [2]
    assert assert_each_step_once(restart_steps(killed), ex) == [2]
    assert_every_sample_once(restart_steps(killed), ex)
    ignored = NOT_COMPARED + (NOT_COMPARED_WITH_A_LOADER if ex.loader else ())
    diff = [
        d
        for d in differences(snapshot(fixed, ex.steps), snapshot(killed, ex.steps))
        if not any(fnmatch.fnmatch(d, pattern) for pattern in ignored)
    ]
    assert not diff, f"the final state after a kill and resume differs from the uninterrupted run's: {diff[:10]}"
    assert final_loss(killed) == final_loss(fixed)

    by_step = restart_steps(resized)
    assert assert_each_step_once(by_step, ex) == [2, 1, 2]
    assert_every_sample_once(by_step, ex)
    assert_loss_close(final_loss(resized), final_loss(fixed), f"{ex.name}, restart mode 2 -> 1 -> 2")
    if live:
        by_step = live_steps(recs[4])
        worlds = assert_each_step_once(by_step, ex)
        assert worlds[-3:] == [2, 1, 2] and set(worlds) == {1, 2}, worlds  # (a first world of 1: b came late)
        first_alone = min(s for s in by_step if by_step[s][0]["world"] == 1 and by_step[s - 1][0]["world"] == 2)
        lone = {r["pid"] for s in by_step for r in by_step[s] if r["world"] == 1 and s >= first_alone}
        before, after = by_step[first_alone - 1], by_step[ex.steps]
        assert len(lone) == 1 and lone <= {r["pid"] for r in before} & {r["pid"] for r in after}, "survivor restarted"
        assert_every_sample_once(by_step, ex)
        assert_loss_close(final_loss(recs[4]), final_loss(fixed), f"{ex.name}, live mode 2 -> 1 -> 2")
