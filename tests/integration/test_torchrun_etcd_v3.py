"""Stock torchrun on the etcd-v3 backend: real agents, real workers, real signals, real etcd."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from elastic.testing.etcd_server import LocalEtcdCluster, free_port
from elastic.testing.torchrun import TorchrunAgent, read_jsonl, torchrun_command
from elastic.testing.wait import wait_until

RDZV_CONF = {"last_call_timeout": 1, "join_timeout": 60}


def _agent(
    tmp_path: Path,
    name: str,
    endpoint: str,
    run_id: str,
    nnodes: str,
    out: Path,
    steps: int,
    step_time: float = 0.1,
    nproc: int = 1,
    forked: bool = True,
) -> TorchrunAgent:
    """An agent of the all-reduce worker; ``forked``: torchrun itself forked from this process's zygote (no torch
    import per agent, see :class:`TorchrunAgent`) and its workers forked from the same zygote (``prefork``);
    the first test and the hang test run agent and workers as fresh processes, as a user's shell does."""
    cmd = torchrun_command(
        backend="etcd-v3",
        endpoint=endpoint,
        run_id=run_id,
        nnodes=nnodes,
        nproc=nproc,
        rdzv_conf=RDZV_CONF,
        script_args=["--out", str(out), "--steps", str(steps), "--step-time", str(step_time)],
        prefork=forked,
    )
    return TorchrunAgent(cmd, tmp_path / f"{name}.log", forked=forked).start()


def _logs(agents: list[TorchrunAgent]) -> str:
    return "\n".join(f"--- {a.log_path.name}\n{a.log()[-3000:]}" for a in agents)


def _worlds(out: Path) -> list[int]:
    return [r["world"] for r in read_jsonl(out / "steps.jsonl") if r["rank"] == 0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n_agents", [2, 3])
def test_agents_form_one_world_and_allreduce_checks_out(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent], n_agents: int
) -> None:
    out = tmp_path / "out"
    run_id = f"form-{uuid.uuid4().hex[:6]}"
    for i in range(n_agents):
        nnodes = f"{n_agents}:{n_agents}"
        agents.append(_agent(tmp_path, f"a{i}", etcd_server.endpoints, run_id, nnodes, out, steps=5, forked=False))
    for a in agents:
        assert a.wait(timeout=150) == 0, _logs(agents)
    steps = read_jsonl(out / "steps.jsonl")
    assert {r["world"] for r in steps} == {n_agents}
    assert {r["rank"] for r in steps} == set(range(n_agents))
    assert all(r["sum"] == n_agents * (n_agents + 1) / 2 for r in steps)
    assert (out / "done").read_text() == "5"


@pytest.mark.timeout(240)
def test_sigkill_of_one_agent_tree_shrinks_world_then_new_agent_grows_it(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    out = tmp_path / "out"
    run_id = f"kill-{uuid.uuid4().hex[:6]}"
    ep = etcd_server.endpoints
    a = _agent(tmp_path, "a", ep, run_id, "1:2", out, steps=100_000, step_time=0.05)
    b = _agent(tmp_path, "b", ep, run_id, "1:2", out, steps=100_000, step_time=0.05)
    agents += [a, b]
    assert wait_until(lambda: _worlds(out).count(2) >= 10, 120), _logs(agents)

    killed_at = b.kill_tree()
    b.wait(timeout=10)

    def shrunk() -> bool:
        return any(r["world"] == 1 and r["t"] > killed_at for r in read_jsonl(out / "steps.jsonl"))

    assert wait_until(shrunk, 60), _logs(agents)
    first_small = min(r["t"] for r in read_jsonl(out / "steps.jsonl") if r["world"] == 1 and r["t"] > killed_at)
    recovery = first_small - killed_at
    assert a.process is not None and a.process.poll() is None, "the survivor must keep running"

    c = _agent(tmp_path, "c", ep, run_id, "1:2", out, steps=100_000, step_time=0.05)
    agents.append(c)
    joined_at = time.time()

    def regrown() -> bool:
        return any(r["world"] == 2 and r["t"] > joined_at for r in read_jsonl(out / "steps.jsonl"))

    assert wait_until(regrown, 90), _logs(agents)
    steps = [r["step"] for r in read_jsonl(out / "steps.jsonl") if r["rank"] == 0]
    assert steps[-1] > steps[0], "training continued across both resizes"
    # Liveness by lease: well under torch's 15 s heartbeat expiry + 30 s last call.
    assert recovery < 15, f"survivor's next step came {recovery:.1f}s after the kill"


@pytest.mark.timeout(180)
def test_lost_member_whose_workers_hang_instead_of_crashing_is_re_formed_without(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    """b's agent dies while b's worker is frozen: the survivor's all-reduce blocks (no connection error), so
    torchrun alone would wait for the collective timeout. The lost liveness lease makes a's agent re-form."""
    import os
    import signal

    from elastic.proctree import descendants

    out = tmp_path / "out"
    run_id = f"hang-{uuid.uuid4().hex[:6]}"
    a = _agent(tmp_path, "a", etcd_server.endpoints, run_id, "1:2", out, steps=100_000, step_time=0.05, forked=False)
    b = _agent(tmp_path, "b", etcd_server.endpoints, run_id, "1:2", out, steps=100_000, step_time=0.05, forked=False)
    agents += [a, b]
    assert wait_until(lambda: _worlds(out).count(2) >= 10, 120), _logs(agents)
    frozen = [pid for pid, _ in descendants(b.pid)]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)  # b's worker: alive, sockets open, silent
    killed_at = time.time()
    os.kill(b.pid, signal.SIGKILL)  # b's torchrun agent: its lease expires
    try:

        def shrunk() -> bool:
            return any(r["world"] == 1 and r["t"] > killed_at for r in read_jsonl(out / "steps.jsonl"))

        assert wait_until(shrunk, 45), _logs(agents)  # the allreduce_worker's gloo timeout is 60 s
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _train_through_etcd_fault(
    tmp_path: Path, etcd: LocalEtcdCluster, agents: list[TorchrunAgent], fault: Callable[[], None]
) -> None:
    """Two agents train 140 steps; ``fault`` hits etcd mid-run; no worker group may restart."""
    out = tmp_path / "out"
    run_id = f"etcdfault-{uuid.uuid4().hex[:6]}"
    for name in ("a", "b"):
        agents.append(_agent(tmp_path, name, etcd.endpoints, run_id, "2:2", out, steps=140, step_time=0.05))
    assert wait_until(lambda: len(_worlds(out)) >= 10, 120), _logs(agents)
    fault()
    for a in agents:
        assert a.wait(timeout=150) == 0, _logs(agents)
    starts = [r for r in read_jsonl(out / "events.jsonl") if r["event"] == "start"]
    assert {r["restart"] for r in starts} == {0}, "no worker group was restarted"
    assert (out / "done").read_text() == "140"


@pytest.mark.timeout(240)
def test_etcd_restart_during_training_causes_no_worker_failure(
    tmp_path: Path, etcd_member: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    def restart() -> None:
        etcd_member.stop_member(0)
        time.sleep(3)
        etcd_member.start_member(0)

    _train_through_etcd_fault(tmp_path, etcd_member, agents, restart)


@pytest.mark.timeout(240)
def test_losing_one_of_three_etcd_members_causes_no_worker_failure(
    tmp_path: Path, etcd_cluster3: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    def lose_two_members_in_turn() -> None:
        # Two different members, so the member each agent is connected to is lost once.
        etcd_cluster3.stop_member(0)
        time.sleep(2)
        etcd_cluster3.start_member(0)
        etcd_cluster3.wait_healthy(index=0)
        etcd_cluster3.stop_member(1)

    _train_through_etcd_fault(tmp_path, etcd_cluster3, agents, lose_two_members_in_turn)


@pytest.mark.timeout(120)
def test_unreachable_etcd_fails_fast_with_one_line_naming_the_endpoint(tmp_path: Path) -> None:
    port = free_port()
    cmd = torchrun_command(
        backend="etcd-v3",
        endpoint=f"127.0.0.1:{port}",
        run_id="nope",
        nnodes="1:2",
        rdzv_conf={"connect_timeout": 2},
        script_args=["--out", str(tmp_path)],
    )
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if f"127.0.0.1:{port}" in ln]
    assert lines, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # 2 s of connect timeout, the rest torch's start-up (3 s here idle, 18 s seen with the suite in parallel on
    # two cores): far below the rendezvous's join timeout (600 s), what a retrying client would take
    assert elapsed < 2 + 45, f"took {elapsed:.1f}s"


def test_etcd_v3_is_registered_through_the_torchrun_handlers_entry_point() -> None:
    code = (
        "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r;"
        "print(r._registry['etcd-v3'].__module__)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "elastic.rendezvous.entry", proc.stderr
