"""Warm worker starts (elastic.prefork) with real processes: an owner process (a shell standing in for the
torchrun agent, or real torchrun), real clients, a real zygote, real signals."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import struct
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
            "zygote_started": started(os.getppid()), "client_started": started(client),
            "sigpipe_ignored": signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
            "frozen": __import__("gc").get_freeze_count(), "gc_enabled": __import__("gc").isenabled(),
            "launcher": __import__("elastic.prefork.common").prefork.common.launcher_pid()}
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
    e = dict(
        os.environ,
        ETRAIN_PREFORK_DIR=short,
        OUT=str(tmp_path / "out.jsonl"),
        PREFORK_TEST="yes",
        PYTHONUNBUFFERED="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    yield e
    for sock in Path(short).glob("*.sock"):  # a zygote left by a failed test: end it
        subprocess.run(["pkill", "-KILL", "-f", f"elastic.prefork --serve {sock}"], check=False)
    shutil.rmtree(short, ignore_errors=True)


def _records(e: dict[str, str]) -> list[dict[str, object]]:
    path = Path(e["OUT"])
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _zygotes(e: dict[str, str]) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-f", f"elastic.prefork --serve {e['ETRAIN_PREFORK_DIR']}/"], capture_output=True, text=True
    )
    return [int(p) for p in out.stdout.split()]


CLIENT = f"{sys.executable} -m elastic.prefork job.py --flag 'a b'"


def test_workers_are_forked_warm_from_one_zygote_with_their_args_env_cwd_and_exit_code(
    env: dict[str, str], tmp_path: Path
) -> None:
    owner = subprocess.run(
        ["bash", "-c", f"{CLIENT}; echo first=$?; CODE=7 {CLIENT}; echo second=$?"],
        cwd=tmp_path / "work",
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert "first=0" in owner.stdout and "second=7" in owner.stdout, owner.stderr
    assert owner.stdout.count("stdout reaches the client's stdout") == 2
    first, second = _records(env)
    assert first["warm"] and second["warm"]  # torch was imported before the script's first line
    # what the preload created is frozen (elastic.interpreter.loading): torch's objects alone are >100,000
    assert int(str(first["frozen"])) > 100_000 and first["gc_enabled"], first
    assert first["ppid"] == second["ppid"]  # both forked by the same zygote ...
    assert first["argv"] == ["--flag", "a b"] and first["env"] == "yes"
    assert first["cwd"] == str(tmp_path / "work")
    # ... which ended with its owner (the shell standing in for the torchrun agent)
    assert wait_until(lambda: process_stat(int(str(first["ppid"]))) is None, 10)
    assert not [p for p in Path(env["ETRAIN_PREFORK_DIR"]).iterdir() if p.name != "clients"]  # nothing left behind


def test_workers_of_two_launchers_forked_by_one_shared_zygote_each_name_their_own_launcher(
    env: dict[str, str], tmp_path: Path
) -> None:
    """With ``ETRAIN_PREFORK_OWNER`` one zygote forks the workers of several agents (a hot spare's, or a test's):
    a worker's parent is then that zygote, and ``launcher_pid()`` (which live recovery names a worker's node by)
    is still the process that started its client."""
    owner = subprocess.Popen(["sleep", "90"])
    try:
        shared = dict(env, ETRAIN_PREFORK_OWNER=str(owner.pid))
        launchers = [
            subprocess.Popen(["bash", "-c", f"{CLIENT}; true"], cwd=tmp_path / "work", env=shared) for _ in range(2)
        ]
        assert [p.wait(timeout=90) for p in launchers] == [0, 0]
        records = _records(env)
        assert len(records) == 2 and all(r["warm"] for r in records)
        assert len({r["ppid"] for r in records}) == 1 and records[0]["ppid"] not in (p.pid for p in launchers)
        assert sorted(int(str(r["launcher"])) for r in records) == sorted(p.pid for p in launchers)
    finally:
        owner.kill()
        owner.wait()


def test_signals_reach_the_worker_and_a_killed_client_takes_its_worker_along(
    env: dict[str, str], tmp_path: Path
) -> None:
    env = dict(env, MODE="sleep")
    owner = subprocess.Popen(
        ["bash", "-c", f"{CLIENT}; echo rc=$?; {CLIENT}; sleep 30"],
        cwd=tmp_path / "work",
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_until(lambda: len(_records(env)) == 1, 60)
        client = int(subprocess.check_output(["pgrep", "-P", str(owner.pid), "-f", "elastic.prefork"]).split()[0])
        assert wait_until(lambda: forked_worker(client) is not None, 10)
        worker = forked_worker(client)
        assert worker is not None and worker == _records(env)[0]["pid"] and worker != client
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
    run = subprocess.run(
        ["bash", "-c", f"MODE=pool CODE=3 {CLIENT}; echo rc=$?"],
        cwd=tmp_path / "work",
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "pool thread ran" in run.stdout and "rc=3" in run.stdout, run.stderr


def test_worker_dying_of_a_signal_makes_the_client_die_of_it_and_prefork_off_runs_in_process(
    env: dict[str, str], tmp_path: Path
) -> None:
    cmd = f"MODE=die-first TORCHELASTIC_RESTART_COUNT=0 {CLIENT}; echo rc=$?; ETRAIN_PREFORK=0 {CLIENT}"
    owner = subprocess.run(
        ["bash", "-c", cmd], cwd=tmp_path / "work", env=env, capture_output=True, text=True, timeout=90
    )
    assert "rc=137" in owner.stdout, owner.stderr  # 128 + SIGKILL, as if the client itself had been killed
    killed, cold = _records(env)
    assert killed["warm"] and not cold["warm"]  # ETRAIN_PREFORK=0: an ordinary cold start in the client
    assert cold["frozen"] == 0 and cold["gc_enabled"]  # nothing imposed on a script that runs in its own process
    # as in a fresh interpreter, a write to a closed socket raises instead of killing the worker
    assert killed["sigpipe_ignored"] and cold["sigpipe_ignored"]


@pytest.mark.timeout(180)
def test_torchrun_restarts_a_killed_worker_from_the_warm_zygote_started_during_the_rendezvous(
    env: dict[str, str], tmp_path: Path, etcd_server: LocalEtcdCluster
) -> None:
    env = dict(env, MODE="die-first")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--rdzv-backend=etcd-v3",
        f"--rdzv-endpoint={etcd_server.endpoints}",
        f"--rdzv-id=pf-{os.getpid()}",
        "--monitor-interval=0.1",
        "-m",
        "elastic.prefork",
        "job.py",
        "--flag",
        "x",
    ]
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
        # gone, not training on (it sleeps 60 s); the bound leaves room for a loaded machine, where the
        # zygote's exit and the reaping of the orphaned worker (by init, every ~2 s here) take seconds
        assert wait_until(lambda: process_stat(worker) is None, 20)
        assert wait_until(lambda: not _zygotes(env), 20)
    finally:
        owner.kill()


# -- the runtime directory must be private: else no zygote, the worker starts cold ---------------------------
def _unsafe_prefork_dir(kind: str, short: Path) -> Path:
    if kind == "symlink":  # to a private dir of ours, even: whoever could plant it could re-point it
        (short / "real").mkdir(mode=0o700)
        (short / "link").symlink_to(short / "real")
        return short / "link"
    if kind == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another uid needs root")
        os.chown(short, 65534, 65534)  # mode 0700: only the owner is wrong
    else:
        os.chmod(short, int(kind.removeprefix("mode-"), 8))
    return short


@pytest.mark.parametrize("kind", ["mode-0777", "mode-0755", "other-owner", "symlink"])
def test_a_prefork_dir_another_user_could_control_is_refused_and_the_worker_starts_cold_with_a_warning(
    env: dict[str, str], tmp_path: Path, kind: str
) -> None:
    short = Path(env["ETRAIN_PREFORK_DIR"])
    before = os.lstat(short)
    unsafe = _unsafe_prefork_dir(kind, short)
    env = dict(env, ETRAIN_PREFORK_DIR=str(unsafe))
    run = subprocess.run(
        ["bash", "-c", f"{CLIENT}; echo rc=$?"],
        cwd=tmp_path / "work",
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "rc=0" in run.stdout and "stdout reaches the client's stdout" in run.stdout, run.stderr
    (record,) = _records(env)
    assert not record["warm"]  # it ran in the client: nobody else's socket got its environment
    assert f"refusing runtime directory {unsafe} (" in run.stderr and "running cold" in run.stderr, run.stderr
    mode = stat.S_IMODE(os.lstat(unsafe).st_mode)
    assert f"mode 0o{mode:03o}" in run.stderr and f"owned by uid {os.lstat(unsafe).st_uid}" in run.stderr
    assert sorted(p.name for p in short.iterdir()) == (["link", "real"] if kind == "symlink" else [])
    assert not list((short / "real").iterdir()) if kind == "symlink" else True
    assert not _zygotes(env)
    os.chown(short, before.st_uid, before.st_gid)


# -- one client cannot stall the zygote ----------------------------------------------------------------------
def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # closed with what we sent still unread
        return True
    except TimeoutError:
        return False


def test_a_client_that_sends_nothing_or_a_4_gib_length_prefix_does_not_stall_other_worker_starts(
    env: dict[str, str], tmp_path: Path
) -> None:
    owner = subprocess.Popen(
        ["bash", "-c", f"{CLIENT}; echo first=$?; read go; {CLIENT}; echo second=$?; sleep 60"],
        cwd=tmp_path / "work",
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdin is not None
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    huge = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert wait_until(lambda: len(_records(env)) == 1, 60)
        (path,) = Path(env["ETRAIN_PREFORK_DIR"]).glob("*.sock")
        silent.connect(str(path))  # connects and never sends a byte
        huge.connect(str(path))
        huge.sendall(struct.pack("!I", 2**32 - 1) + b'{"target": ')  # 4 GiB announced, 11 bytes sent
        time.sleep(0.5)  # the zygote has both by now
        started = time.monotonic()
        owner.stdin.write("go\n")
        owner.stdin.flush()
        assert wait_until(lambda: len(_records(env)) == 2, 40)
        took = time.monotonic() - started
        first, second = _records(env)
        assert took < 4, f"a warm start took {took:.1f} s behind two stalled clients"
        assert second["warm"] and second["ppid"] == first["ppid"]  # the same zygote served it
        assert _closed_by_peer(huge, 5)  # refused at once, by its header
        log = path.with_suffix(".log").read_text()
        assert "refusing a 4294967295-byte request (limit 4194304 bytes)" in log, log
        assert _closed_by_peer(silent, 20)  # dropped at the per-request deadline
        assert "no complete request within" in path.with_suffix(".log").read_text()
    finally:
        silent.close()
        huge.close()
        owner.kill()
        owner.communicate(timeout=10)
    assert wait_until(lambda: not _zygotes(env), 10)


def test_a_request_over_the_size_cap_starts_the_worker_cold_with_a_warning_instead_of_failing_it(
    env: dict[str, str], tmp_path: Path
) -> None:
    # 1 MB of undecodable bytes in the environment is 6 MB of JSON ("\udcff" each): over the zygote's cap
    big = {f"BIG{i}".encode(): b"\xff" * 100_000 for i in range(10)}
    benv: dict[bytes, bytes] = {**{k.encode(): v.encode() for k, v in env.items()}, **big}
    run = subprocess.run(
        ["bash", "-c", f"{CLIENT}; echo rc=$?"],
        cwd=tmp_path / "work",
        env=benv,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "rc=0" in run.stdout, run.stderr
    (record,) = _records(env)
    assert not record["warm"] and "over the prefork limit" in run.stderr and "running cold" in run.stderr, run.stderr
