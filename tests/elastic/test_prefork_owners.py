"""A node agent's zygotes (elastic.prefork): one per key of one owner, stopped on request, a grace for their
children when the owner dies, and workers that die with their torchrun whichever zygote forked them. Real
processes: a sleeping process stands in for the owner (a node agent), bash for a torchrun agent."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.prefork import socket_path, stop_zygote
from elastic.prefork.common import ZygoteKeyError, check_key
from elastic.proctree import alive, process_stat
from elastic.testing.wait import wait_for, wait_until
from tests.elastic.test_prefork import _records, env  # noqa: F401  (env: the fixture)

pytestmark = pytest.mark.timeout(120)

CLIENT = [sys.executable, "-m", "elastic.prefork", "job.py"]


@pytest.fixture
def owner() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def _run(e: dict[str, str], tmp_path: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(CLIENT, cwd=tmp_path / "work", env={**e, **extra}, capture_output=True, text=True, timeout=90)


def _start(e: dict[str, str], tmp_path: Path, **extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(CLIENT, cwd=tmp_path / "work", env={**e, **extra})


def _zygote(record: dict[str, object]) -> tuple[int, int]:
    return int(str(record["ppid"])), int(str(record["zygote_started"]))


def test_keys_name_zygotes_of_their_own_and_one_that_cannot_name_a_file_is_refused() -> None:
    assert check_key("train-3fa2b1c0") == "train-3fa2b1c0" and check_key("") is None and check_key(None) is None
    for bad in ("../x", "a/b", "-x", "x" * 65, "a b"):
        with pytest.raises(ZygoteKeyError):
            check_key(bad)
    me = os.getpid()
    assert socket_path(me, "a") != socket_path(me, "b") != socket_path(me)


def test_one_owner_keeps_a_zygote_per_key_and_stop_zygote_ends_that_one_and_its_files(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
    owner: subprocess.Popen[bytes],
) -> None:
    mine = {"ETRAIN_PREFORK_OWNER": str(owner.pid)}
    for key in ("job-a", "job-b", "job-a"):
        done = _run(env, tmp_path, **mine, ETRAIN_PREFORK_KEY=key)
        assert done.returncode == 0, done.stderr
    a1, b, a2 = (_zygote(r) for r in _records(env))
    assert a1 == a2 and a1 != b  # job-a's second worker forked by job-a's zygote; job-b has its own
    path = socket_path(owner.pid, "job-a")
    assert path is not None and path.exists()
    assert stop_zygote(owner.pid, "job-a")
    assert wait_until(lambda: not alive(*a1), 10)
    assert wait_until(lambda: not path.exists() and not path.with_suffix(".pid").exists(), 10)
    assert alive(*b) and not stop_zygote(owner.pid, "job-a")  # the other one serves on; nothing left to stop
    owner.kill()
    assert wait_until(lambda: not alive(*b), 10)  # it ends with its owner


def test_a_zygote_whose_starter_died_before_recording_it_is_still_found_and_stopped(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
    owner: subprocess.Popen[bytes],
) -> None:
    # the agent stops a job's first client while it starts the job's zygote: the zygote comes up with no record of
    # its starter's (started here directly, as the starter's detached child would run); it records itself
    path = socket_path(owner.pid, "job")
    assert path is not None
    zygote = subprocess.Popen(
        [sys.executable, "-m", "elastic.prefork", "--serve", str(path), str(owner.pid), "0"],
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        assert wait_until(path.exists, 60), "the zygote never listened"
        # a start in progress holds the starter's lock: stop_zygote waits for it to be released
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            threading.Timer(0.5, lambda: fcntl.flock(lock, fcntl.LOCK_UN)).start()
            started = time.monotonic()
            assert stop_zygote(owner.pid, "job", wait=10)
            assert time.monotonic() - started >= 0.4
        assert zygote.poll() is not None and not path.exists()  # gone, with its socket, within the wait
        assert not stop_zygote(owner.pid, "job")  # nothing left to stop
    finally:
        zygote.kill()
        zygote.wait()


@pytest.mark.parametrize("grace", [0, 30])
def test_when_the_owner_dies_a_zygote_lets_its_children_end_within_its_grace_else_kills_them(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
    owner: subprocess.Popen[bytes],
    grace: int,
) -> None:
    client = _start(
        env,
        tmp_path,
        ETRAIN_PREFORK_OWNER=str(owner.pid),
        ETRAIN_PREFORK_KEY="job",
        ETRAIN_PREFORK_GRACE=str(grace),
        MODE="sleep",
    )
    try:
        record = wait_for(lambda: _records(env), timeout=60)[0]
        zygote = _zygote(record)
        path = socket_path(owner.pid, "job")
        assert path is not None and path.exists()
        owner.kill()
        owner.wait()
        if grace:
            # once the zygote has seen its owner go (it stops listening: its socket goes), the worker's parent (here
            # the client; under a node agent, torchrun told by its parent-death signal) stops it
            assert wait_until(lambda: not path.exists(), 30)
            client.send_signal(signal.SIGTERM)
            code = client.wait(timeout=30)
            assert (code, Path(env["OUT"] + ".term").exists()) == (143, True)  # its SIGTERM handler ran, it chose
        else:
            # killed with the zygote, at once, nobody signalling it: its client lost the zygote (a SIGTERM sent after a
            # fixed 0.5 s could meet a client not yet told, on a loaded machine: once in a parallel run)
            code = client.wait(timeout=30)
            assert (code, Path(env["OUT"] + ".term").exists()) == (1, False)
        assert wait_until(lambda: not alive(*zygote), 10)  # and the zygote is gone either way
    finally:
        client.kill()


@pytest.mark.parametrize("under_torchrun", [True, False])
def test_a_torchrun_workers_client_dies_with_its_torchrun_and_the_zygote_then_kills_the_worker(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
    owner: subprocess.Popen[bytes],
    under_torchrun: bool,
) -> None:
    # bash stands in for torchrun, which gives each worker TORCHELASTIC_RUN_ID; the zygote is the owner's (a
    # node agent's), so it outlives that torchrun
    extra = {"ETRAIN_PREFORK_OWNER": str(owner.pid), "MODE": "sleep"}
    if under_torchrun:
        extra["TORCHELASTIC_RUN_ID"] = "job-g1"
    parent = subprocess.Popen(["bash", "-c", " ".join(CLIENT) + " & wait"], cwd=tmp_path / "work", env={**env, **extra})
    record = wait_for(lambda: _records(env), timeout=60)[0]
    worker = int(str(record["pid"]))
    st = process_stat(worker)
    assert st is not None
    parent.kill()
    parent.wait()
    if under_torchrun:
        assert wait_until(lambda: not alive(worker, st[1]), 10), "the worker outlived its torchrun"
    else:  # a client of no torchrun keeps no such tie: its worker runs on
        time.sleep(2)
        assert alive(worker, st[1])
        os.kill(worker, signal.SIGKILL)


def test_files_of_a_zygote_killed_with_its_owner_are_cleared_when_the_next_zygote_starts(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
    owner: subprocess.Popen[bytes],
) -> None:
    """A node lost whole (its agent and the agent's zygote SIGKILLed, as Slurm's node failure does) left
    ``<owner>-<start>.{sock,lock,log,pid}`` in the prefork directory for good (issue 50); the next zygote started
    there clears what owners that are gone left, and nothing of a live owner's."""
    done = _run(env, tmp_path, ETRAIN_PREFORK_OWNER=str(owner.pid))
    assert done.returncode == 0, done.stderr
    ((zygote, _),) = (_zygote(r) for r in _records(env))
    base = Path(env["ETRAIN_PREFORK_DIR"])
    left = sorted(p.name for p in base.iterdir() if p.name.startswith(f"{owner.pid}-"))
    assert {Path(n).suffix for n in left} >= {".sock", ".lock", ".log", ".pid"}, left
    os.kill(zygote, signal.SIGKILL)  # the node dies: the zygote and its owner at once, no clean-up
    owner.kill()
    owner.wait()
    assert wait_until(lambda: process_stat(zygote) is None, 10)
    assert sorted(p.name for p in base.iterdir() if p.name.startswith(f"{owner.pid}-")) == left  # they stay
    other = subprocess.Popen(["sleep", "300"])
    try:
        done = _run(env, tmp_path, ETRAIN_PREFORK_OWNER=str(other.pid))  # a new agent's first worker
        assert done.returncode == 0, done.stderr
        assert not [p.name for p in base.iterdir() if p.name.startswith(f"{owner.pid}-")]
        assert [p for p in base.iterdir() if p.name.startswith(f"{other.pid}-") and p.suffix == ".sock"]
    finally:
        other.kill()
        other.wait()
