"""A SIGTERM'd worker blocked in a collective with a vanished peer exits after ``stop_timeout``.

Two real gloo ranks of ``train_worker.py`` (the ElasticTrainer) without torchrun. Rank 1 is SIGSTOPped: its
sockets stay open and nothing answers, as with a partitioned or dark host, so rank 0 blocks in its next
collective, in C code where Python cannot run the SIGTERM handler. With a stop timeout rank 0 exits soon
after; without one it would hang until torchrun's SIGKILL (30 s later in a real group).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.testing.etcd_server import free_port
from elastic.testing.torchrun import read_jsonl

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "elastic" / "testing" / "train_worker.py"


def _rank(rank: int, port: int, tmp: Path, stop_timeout: float) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    args = [
        "--record",
        str(tmp / "rec"),
        "--checkpoint-url",
        str(tmp / "ck"),
        "--epochs",
        "1000",
        "--samples",
        "64",
        "--batch",
        "4",
        "--base-world",
        "2",
        "--save-every",
        "5",
        "--step-sleep",
        "0.05",
        "--stop-timeout",
        str(stop_timeout),
    ]
    log = open(tmp / f"rank{rank}.log", "wb")
    try:
        return subprocess.Popen([sys.executable, str(WORKER), *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


def _steps(tmp: Path) -> int:
    return max((r["step"] for f in (tmp / "rec").glob("rank0.*.jsonl") for r in read_jsonl(f)), default=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop_timeout", [2.0, 0.0], ids=["with-timeout-exits", "without-timeout-hangs"])
def test_sigterm_with_a_peer_gone_silent_exits_after_the_stop_timeout(tmp_path: Path, stop_timeout: float) -> None:
    port = free_port()
    procs = [_rank(r, port, tmp_path, stop_timeout) for r in (0, 1)]
    try:
        deadline = time.monotonic() + 60
        while _steps(tmp_path) < 8:
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, (
                tmp_path / "rank0.log"
            ).read_text()
            time.sleep(0.1)
        os.kill(procs[1].pid, signal.SIGSTOP)
        time.sleep(0.5)  # rank 0 is now waiting for rank 1 in the next step's collective
        stopped_at = _steps(tmp_path)
        sent = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        try:
            code = procs[0].wait(timeout=8)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - sent
        log = (tmp_path / "rank0.log").read_text()
        if stop_timeout:
            assert code == 143, log
            assert 1.5 < took < 6, f"exited {took:.1f} s after SIGTERM"
            assert "exiting without the final save" in log
        else:
            assert code is None, f"rank 0 exited with {code} without a stop timeout: the peer was not silent\n{log}"
        assert _steps(tmp_path) == stopped_at  # nothing was committed without the peer
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                os.kill(p.pid, signal.SIGCONT)
                p.wait()


_PROGRESSING = """
import signal, time
from datetime import timedelta
from elastic.train.stop_timeout import StopTimeout
timeout = StopTimeout(timedelta(seconds=1), lambda: 7)
timeout.boundary()
timeout.arm(signal.SIGTERM)
started = time.monotonic()
while time.monotonic() - started < 2.5:  # boundaries keep passing (the agreement on the signal is steps away)
    time.sleep(0.2)
    timeout.boundary()
print("still running 2.5 s after the signal", flush=True)
time.sleep(5)  # now blocked: no boundary
print("never exited", flush=True)
"""


@pytest.mark.timeout(60)
def test_the_stop_timeout_counts_from_the_last_step_boundary_so_a_loop_still_stepping_is_not_cut_short() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _PROGRESSING],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    took = time.monotonic() - started
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "still running 2.5 s after the signal" in done.stdout and "never exited" not in done.stdout
    assert "then 1 s without a step boundary (step 7's not reached)" in done.stderr
    assert took < 6, f"{took:.1f} s: the timeout after the last boundary is 1 s"
