"""SIGTERM (preemption notice) to a real training process: a final synchronous snapshot, then a clean exit."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.checkpoint import create_checkpoint_manager
from tests.elastic.train._preempt_trainer import model_digest

REPO = Path(__file__).resolve().parents[3]


def _run(url: str, progress: Path, mode: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tests.elastic.train._preempt_trainer", url, str(progress), mode]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def _reaped(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """``proc``, killed and reaped on the way out if it still runs (a failed or timed-out test)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _step(progress: Path) -> int:
    """The step the trainer last wrote to ``progress``, -1 before the first (read once: the trainer rewrites the
    file, and a second read can find it empty, which a serial run once did)."""
    try:
        text = progress.read_text()
    except FileNotFoundError:
        return -1
    return int(text) if text.isdigit() else -1


# hang guards only, generous: each trainer imports torch and torch._dynamo cold (7 CPU-s), and a parallel suite's
# load once stretched that past 50 s
@pytest.mark.timeout(300)
def test_sigterm_writes_a_final_synchronous_snapshot_of_the_current_step(tmp_path: Path) -> None:
    progress = tmp_path / "progress"
    with _reaped(_run(str(tmp_path / "ckpt"), progress, "train")) as proc:
        deadline = time.monotonic() + 180
        while _step(progress) < 7:
            assert proc.poll() is None and time.monotonic() < deadline, "trainer did not get going"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=90)[0].decode()
    assert proc.returncode == 0, output
    word, step_text, digest = progress.read_text().split()
    assert word == "final" and int(step_text) >= 7
    assert "preemption notice (SIGTERM)" in output
    with create_checkpoint_manager(str(tmp_path / "ckpt")) as mgr:
        snap = mgr.load_latest()
    assert snap is not None and snap.step == int(step_text)
    assert snap.state["extras"] == {"preempted": True}
    assert model_digest(dict(snap.state["model"])) == digest


@pytest.mark.timeout(240)
def test_background_save_in_flight_at_interpreter_exit_is_completed(tmp_path: Path) -> None:
    with _reaped(_run(str(tmp_path / "ckpt"), tmp_path / "progress", "exit")) as proc:
        output = proc.communicate(timeout=200)[0].decode()
    assert proc.returncode == 0, output
    with create_checkpoint_manager(str(tmp_path / "ckpt")) as mgr:
        snap = mgr.load_latest()
    assert snap is not None and snap.step == 1


@pytest.mark.timeout(10)
@pytest.mark.parametrize("fd_taken", [False, True], ids=["own-wakeup-fd", "wakeup-fd-of-an-event-loop"])
def test_on_signal_is_called_once_and_another_owners_wakeup_fd_is_left_alone(fd_taken: bool) -> None:
    import threading

    from elastic.train.preemption import PreemptionWatcher

    r, w = os.pipe()
    os.set_blocking(w, False)
    before = signal.set_wakeup_fd(w if fd_taken else -1)
    calls: list[signal.Signals] = []
    got = threading.Event()

    def on_signal(sig: signal.Signals) -> None:
        calls.append(sig)
        got.set()

    watcher = PreemptionWatcher((signal.SIGUSR1,), on_signal=on_signal)
    watcher.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert got.wait(5) and watcher.requested and watcher.signal_name == "SIGUSR1"
        time.sleep(0.2)
        assert calls == [signal.SIGUSR1]
    finally:
        watcher.uninstall()
        now = signal.set_wakeup_fd(before)
        os.close(r)
        os.close(w)
    assert now == (w if fd_taken else -1)  # uninstall gave the owner's fd back (or none)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("teller", ["thread", "handler-tells"])
def test_a_second_sigterm_at_any_point_of_the_handler_runs_it_again_without_deadlock(teller: str) -> None:
    """torchrun's SIGTERM right after the scheduler's: the handler runs inside itself. Before the fix it took a
    lock (``threading.Event.set``) and the second run waited for the first forever, so the worker reached no step
    boundary and exited without its final save."""
    cmd = [sys.executable, "-m", "tests.elastic.train._reentrant_signal", teller]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as exc:  # SIGKILLed by run(): SIGTERM is what hangs it
        raise AssertionError("the handler deadlocked on a second SIGTERM") from exc
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok requested=True signal=SIGTERM second_signals="), proc.stdout
    assert int(proc.stdout.split("second_signals=")[1]) >= 3, proc.stdout  # the hook did interrupt the handler
