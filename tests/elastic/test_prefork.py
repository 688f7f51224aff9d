"""Warm worker starts (elastic.prefork) with real processes: an owner process (a shell standing in for the
torchrun agent, or real torchrun), real clients, a real zygote, real signals."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.prefork import forked_worker
from elastic.proctree import process_stat
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.wait import wait_until

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    warm = "torch" in sys.modules  # before the script imports anything
    out = os.environ["OUT"]
    def on_term(sig, frame):
        open(out + ".term", "w").write("got SIGTERM")
        sys.exit(143)
    signal.signal(signal.SIGTERM, on_term)
    def started(pid):  # start time in clock ticks
        raw = open(f"/proc/{pid}/stat").read()
        return int(raw[raw.rfind(")") + 2:].split()[19])
    client = int(os.environ.get("ETRAIN_PREFORK_CLIENT", os.getpid()))
    info = {"warm": warm, "pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:], "cwd": os.getcwd(),
            "env": os.environ.get("PREFORK_TEST"), "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
            "zygote_started": started(os.getppid()), "client_started": started(client)}
    with open(out, "a") as f:
        f.write(json.dumps(info) + "\\n")
    print("stdout reaches the client's stdout", flush=True)
    mode = os.environ.get("MODE", "exit")
    if mode == "pool":  # an idle non-daemon pool thread, never shut down: interpreter exit must still end
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(1)  # referenced until exit, as a checkpoint manager's pool is
        pool.submit(print, "pool thread ran", flush=True).result()
    if mode == "sleep":
        time.sleep(60)
    if mode == "die-first" and info["restart"] == "0":
        if "LOCAL_WORLD_SIZE" in os.environ:  # under torchrun: every local rank records its first start, then
            while sum('"restart": "0"' in line for line in open(out)) < int(os.environ["LOCAL_WORLD_SIZE"]):
                time.sleep(0.05)  # (else torchrun may stop a sibling before it has started)
            if os.environ["LOCAL_RANK"] != "0":
                time.sleep(60)  # stopped by torchrun when local rank 0 dies
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(os.environ.get("CODE", "0")))
    """
)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    short = tempfile.mkdtemp(prefix="pf", dir="/tmp")  # a Unix socket path must stay under 108 bytes
    monkeypatch.setenv("ETRAIN_PREFORK_DIR", short)  # for forked_worker() in this process
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "job.py").write_text(SCRIPT)
    e = dict(os.environ, ETRAIN_PREFORK_DIR=short, OUT=str(tmp_path / "out.jsonl"), PREFORK_TEST="yes",
             PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # fmt: skip
    yield e
    for sock in Path(short).glob("*.sock"):  # a zygote left by a failed test: end it
        subprocess.run(["pkill", "-KILL", "-f", f"elastic.prefork --serve {sock}"], check=False)
    shutil.rmtree(short, ignore_errors=True)


def _records(e: dict[str, str]) -> list[dict[str, object]]:
    path = Path(e["OUT"])
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _zygotes(e: dict[str, str]) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"elastic.prefork --serve {e['ETRAIN_PREFORK_DIR']}/"],
                         capture_output=True, text=True)  # fmt: skip
    return [int(p) for p in out.stdout.split()]


CLIENT = f"{sys.executable} -m elastic.prefork job.py --flag 'a b'"


def test_workers_are_forked_warm_from_one_zygote_with_their_args_env_cwd_and_exit_code(
    env: dict[str, str], tmp_path: Path
) -> None:
    owner = subprocess.run(
        ["bash", "-c", f"{CLIENT}; echo first=$?; CODE=7 {CLIENT}; echo second=$?"],
        cwd=tmp_path / "work", env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert "first=0" in owner.stdout and "second=7" in owner.stdout, owner.stderr
    assert owner.stdout.count("stdout reaches the client's stdout") == 2
    first, second = _records(env)
    assert first["warm"] and second["warm"]  # torch was imported before the script's first line
    assert first["ppid"] == second["ppid"]  # both forked by the same zygote ...
    assert first["argv"] == ["--flag", "a b"] and first["env"] == "yes"
    assert first["cwd"] == str(tmp_path / "work")
    # ... which ended with its owner (the shell standing in for the torchrun agent)
    assert wait_until(lambda: process_stat(int(str(first["ppid"]))) is None, 10)
    assert not [p for p in Path(env["ETRAIN_PREFORK_DIR"]).iterdir() if p.name != "clients"]  # nothing left behind


def test_signals_reach_the_worker_and_a_killed_client_takes_its_worker_along(
    env: dict[str, str], tmp_path: Path
) -> None:
    env = dict(env, MODE="sleep")
    owner = subprocess.Popen(["bash", "-c", f"{CLIENT}; echo rc=$?; {CLIENT}; sleep 30"],
                             cwd=tmp_path / "work", env=env, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert wait_until(lambda: len(_records(env)) == 1, 60)
        client = int(subprocess.check_output(["pgrep", "-P", str(owner.pid), "-f", "elastic.prefork"]).split()[0])
        assert wait_until(lambda: forked_worker(client) is not None, 10)
        worker = forked_worker(client)
        assert worker == _records(env)[0]["pid"] and worker != client
        os.kill(client, signal.SIGTERM)  # torchrun stopping its workers: the script's handler runs
        assert wait_until(lambda: Path(env["OUT"] + ".term").exists(), 10)
        assert wait_until(lambda: process_stat(worker) is None, 10)
        assert wait_until(lambda: len(_records(env)) == 2, 30)
        client2 = int(subprocess.check_output(["pgrep", "-P", str(owner.pid), "-f", "elastic.prefork"]).split()[0])
        assert wait_until(lambda: forked_worker(client2) is not None, 10)
        worker2 = forked_worker(client2)
        assert worker2 is not None
        os.kill(client2, signal.SIGKILL)  # a SIGKILLed client cannot forward anything: the zygote acts
        assert wait_until(lambda: process_stat(worker2) is None, 5)
    finally:
        owner.kill()
        out, _ = owner.communicate(timeout=10)
    assert "rc=143" in out
    assert wait_until(lambda: not _zygotes(env), 10)  # the owner is gone: so is its zygote


def test_a_worker_exits_like_python_does_with_an_idle_thread_pool_left_open(
    env: dict[str, str], tmp_path: Path
) -> None:
    # Found by the chaos suite: joining the pool's idle non-daemon thread without the threading atexit hooks
    # hung the worker until torchrun's SIGKILL, 30 s later.
    run = subprocess.run(["bash", "-c", f"MODE=pool CODE=3 {CLIENT}; echo rc=$?"], cwd=tmp_path / "work", env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "pool thread ran" in run.stdout and "rc=3" in run.stdout, run.stderr


def test_worker_dying_of_a_signal_makes_the_client_die_of_it_and_prefork_off_runs_in_process(
    env: dict[str, str], tmp_path: Path
) -> None:
    cmd = f"MODE=die-first TORCHELASTIC_RESTART_COUNT=0 {CLIENT}; echo rc=$?; ETRAIN_PREFORK=0 {CLIENT}"
    owner = subprocess.run(["bash", "-c", cmd], cwd=tmp_path / "work", env=env, capture_output=True, text=True,
                           timeout=90)  # fmt: skip
    assert "rc=137" in owner.stdout, owner.stderr  # 128 + SIGKILL, as if the client itself had been killed
    killed, cold = _records(env)
    assert killed["warm"] and not cold["warm"]  # ETRAIN_PREFORK=0: an ordinary cold start in the client


@pytest.mark.timeout(180)
def test_torchrun_restarts_a_killed_worker_from_the_warm_zygote_started_during_the_rendezvous(
    env: dict[str, str], tmp_path: Path, etcd_server: LocalEtcdCluster
) -> None:
    env = dict(env, MODE="die-first")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
           "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={etcd_server.endpoints}", f"--rdzv-id=pf-{os.getpid()}",
           "--monitor-interval=0.1", "-m", "elastic.prefork", "job.py", "--flag", "x"]  # fmt: skip
    started = time.monotonic()
    run = subprocess.run(cmd, cwd=tmp_path / "work", env=env, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stderr[-3000:]
    records = _records(env)
    assert sorted(str(r["restart"]) for r in records) == ["0", "0", "1", "1"]
    assert all(r["warm"] and r["argv"] == ["--flag", "x"] for r in records)
    assert len({r["ppid"] for r in records}) == 1  # one zygote served the first start and the restart
    # the etcd-v3 handler started it in the agent, before torchrun spawned the first worker (client)
    assert all(int(str(r["zygote_started"])) <= int(str(r["client_started"])) for r in records)
    assert time.monotonic() - started < 150
    assert wait_until(lambda: not _zygotes(env), 10)


def test_workers_die_with_their_agent_even_when_only_the_agent_is_killed(env: dict[str, str], tmp_path: Path) -> None:
    # Without prefork, SIGKILL of torchrun alone leaves its workers (in sessions of their own) training on.
    env = dict(env, MODE="sleep")
    owner = subprocess.Popen(["bash", "-c", f"{CLIENT}; sleep 60"], cwd=tmp_path / "work", env=env)
    try:
        assert wait_until(lambda: len(_records(env)) == 1, 60)
        worker = int(str(_records(env)[0]["pid"]))
        owner.kill()  # the "agent" only: the client and the worker are not signalled
        owner.wait(timeout=10)
        assert wait_until(lambda: process_stat(worker) is None, 5)
        assert wait_until(lambda: not _zygotes(env), 5)
    finally:
        owner.kill()
