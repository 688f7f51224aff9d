"""The client: the process torchrun starts for each worker. It has the agent's zygote fork the worker, hands
it its stdio, environment, directory and arguments, forwards signals, and exits like the worker did."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from elastic.contract.env import PREFORK_CLIENT, PREFORK_OWNER, TORCHRUN_RUN_ID
from elastic.prefork.common import (
    FORWARDED,
    MessageTooLarge,
    Target,
    ZygoteKeyError,
    encode_message,
    prefork_enabled,
    record_zygote,
    recorded_zygote,
    recv_message,
    send_message,
    socket_path,
    sweep_stale,
    zygote_grace,
    zygote_key,
)
from elastic.proctree import alive, process_stat, set_parent_death_signal

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0


# -- the client: one per worker torchrun starts ------------------------------------------------------------
def _connect(path: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    return sock


def _launch(path: Path, owner: int, grace: float = 0.0) -> int | None:
    """Under the agent's lock: the zygote already starting for ``owner``, or a new one (its pid) that lets its
    children end for up to ``grace`` seconds once ``owner`` has died."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pid = recorded_zygote(path)
        if pid is not None:
            return pid
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a zygote that was killed leaves its socket behind
        with contextlib.suppress(OSError):
            sweep_stale()  # and those of owners gone since (a node SIGKILLed whole) leave all their files
        pid = _spawn_detached(
            [sys.executable, "-m", "elastic.prefork", "--serve", str(path), str(owner), f"{grace:g}"],
            path.with_suffix(".log"),
        )
        return pid if pid > 0 and record_zygote(path, pid) else None


def _start_zygote(path: Path, owner: int) -> socket.socket | None:
    """Connect to the agent's zygote, starting it first if nobody did (one start per agent).

    The zygote recorded may be one that was told to stop (its job left this node and has just come back to the same
    agent): it no longer listens and exits once its children have ended. Once it has exited, one new zygote is
    started in its place, rather than this client running cold."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    for _ in range(2):
        pid = _launch(path, owner, zygote_grace())
        while pid is not None and time.monotonic() < deadline:
            sock = _connect(path)
            if sock is not None:
                return sock
            if process_stat(pid) is None:  # exited without serving us: stopping, or failed at its start
                sock = _connect(path)
                if sock is not None:
                    return sock
                break
            time.sleep(0.02)
        else:
            return None  # none could be started, or the deadline passed
    return None


def zygote_owner_or_none() -> int | None:
    """``$ETRAIN_PREFORK_OWNER`` when it names a live process (a hot spare's node agent keeps a zygote warm
    between jobs), else None."""
    raw = os.environ.get(PREFORK_OWNER, "")
    return int(raw) if raw.isascii() and raw.isdigit() and process_stat(int(raw)) is not None else None


def zygote_owner() -> int:
    """The process whose zygote a worker uses: :func:`zygote_owner_or_none`, else its parent (torchrun's agent)."""
    owner = zygote_owner_or_none()
    return os.getppid() if owner is None else owner


def on_agent_start(argv: Sequence[str]) -> None:
    """The ``elastic.agent_start`` hook (:mod:`elastic.rendezvous.agent_hooks`): in a torchrun agent whose
    workers run through ``elastic.prefork``, start the zygote now, its imports overlapping the rendezvous,
    instead of when the first worker asks for it."""
    if "elastic.prefork" in argv:
        prestart(zygote_owner_or_none())


def prestart(owner: int | None = None, key: str | None = None, grace: float | None = None) -> None:
    """Start the zygote of agent ``owner`` (default: this process) named ``key`` (default
    ``$ETRAIN_PREFORK_KEY``) now and return at once, so that its imports overlap the rendezvous instead of
    delaying the first worker; ``grace``: see :func:`elastic.prefork.common.zygote_grace` (its default). Does
    nothing if ``ETRAIN_PREFORK=0`` or if one runs already. Safe in a multi-threaded process (no fork here)."""
    owner = os.getpid() if owner is None else owner
    try:
        key = zygote_key() if key is None else key
        path = socket_path(owner, key) if prefork_enabled() else None
    except (OSError, ZygoteKeyError) as exc:  # e.g. a directory another user could control: cold starts
        logger.warning("elastic.prefork: no zygote for agent %d: %s", owner, exc)
        return
    if path is None:
        return
    sock = _connect(path)
    if sock is not None:
        sock.close()
        return
    _launch(path, owner, zygote_grace() if grace is None else grace)


#: how long :func:`stop_zygote` waits for a zygote's start in progress (a few hundred ms; more only if its starter
#: is stopped, e.g. by SIGSTOP: the node agent's loop, which calls it, is not held up longer than this)
_STOP_LOCK_WAIT_S = 5.0


def _lock_within(fd: int, timeout: float) -> bool:
    """``flock(fd, LOCK_EX)`` within ``timeout`` seconds; False if it stayed held that long."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def stop_zygote(owner: int, key: str | None = None, wait: float = 0.0) -> bool:
    """Stop the zygote of ``owner`` named ``key`` (e.g. a node agent's for a job that left the node), and any
    child it still has; True if one was running. It removes its socket and files as it exits; with ``wait``,
    this returns once it is gone or after ``wait`` seconds.

    A zygote still being started is waited for (the starter's lock, a few seconds at most) and stopped too: a job's
    first client can be stopped while it starts the job's zygote, which would otherwise serve on for as long as its
    owner lives (the zygote also records itself, for a starter killed before it did)."""
    try:
        path = socket_path(owner, key)
    except (OSError, ZygoteKeyError):
        return False
    if path is None:
        return False
    try:
        lock_fd: int | None = os.open(path.with_suffix(".lock"), os.O_RDWR)  # no lock file: nobody started one
    except OSError:
        lock_fd = None
    try:
        if lock_fd is not None:  # a start in progress has recorded its zygote once the lock is free
            _lock_within(lock_fd, _STOP_LOCK_WAIT_S)
        pid = recorded_zygote(path)
        if pid is None:
            return False
        started = process_stat(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
    deadline = time.monotonic() + wait
    while started is not None and time.monotonic() < deadline and alive(pid, started[1]):
        time.sleep(0.02)
    return True


_DETACH = """import os, sys
log, cmd = sys.argv[1], sys.argv[2:]
pid = os.fork()
if pid == 0:
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(null, 0); os.dup2(out, 1); os.dup2(out, 2)
    os.execv(cmd[0], cmd)
print(pid)
"""


def _spawn_detached(cmd: list[str], log: Path) -> int:
    """Start ``cmd`` in a session of its own and NOT as our descendant (an intermediate process forks it and
    exits: its parent becomes init), so that whoever kills a worker's process tree does not kill the agent's
    zygote with it. Returns its pid (-1 if that failed)."""
    try:
        out = subprocess.run(
            [sys.executable, "-S", "-c", _DETACH, str(log), *cmd],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return int(out.stdout.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        logger.warning("elastic.prefork: could not start a zygote", exc_info=True)
        return -1


def _exit_like(status: dict[str, int]) -> int:
    if "signal" in status:
        sig = status["signal"]
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig
    return status["exit"]


def _request(target: Target) -> bytes:
    """The request frame for ``target``: raises :class:`MessageTooLarge` (the zygote would refuse it)."""
    return encode_message(
        {
            "target": [target.kind, target.name, list(target.args)],
            "env": {**os.environ, PREFORK_CLIENT: str(os.getpid())},
            "cwd": os.getcwd(),
            "unbuffered": bool(getattr(sys.stdout, "write_through", False)),
        }
    )


def _run_client(sock: socket.socket, request: bytes) -> int:
    child: list[int] = []
    pending: list[int] = []

    def forward(sig: int, _frame: object) -> None:
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child[0], sig)
        else:
            pending.append(sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        send_message(sock, request, fds=[0, 1, 2])
        reply, _ = recv_message(sock)
        child.append(int(reply["pid"]))
        for waiting in pending:
            forward(waiting, None)
        reply, _ = recv_message(sock)
        return _exit_like(reply["status"])
    except (EOFError, OSError) as exc:
        print(f"elastic.prefork: lost the zygote ({exc}); the worker is gone", file=sys.stderr, flush=True)
        return 1


def _die_with_torchrun() -> None:
    """A worker's client (torchrun gave it ``TORCHELASTIC_RUN_ID``) dies with its torchrun agent, and the zygote
    then kills the worker: as when the zygote is that torchrun's own (it exits with its owner), also when it is a
    node agent's and outlives a torchrun killed by a signal."""
    if not os.environ.get(TORCHRUN_RUN_ID):
        return
    parent = os.getppid()
    if not set_parent_death_signal(signal.SIGKILL):
        return
    if os.getppid() != parent:  # torchrun died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        from elastic.prefork.zygote import serve  # only the zygote needs it

        return serve(Path(argv[1]), int(argv[2]), float(argv[3]) if len(argv) > 3 else 0.0)
    target = Target.parse(argv)
    try:
        owner = zygote_owner()
        path = socket_path(owner, zygote_key()) if prefork_enabled() else None
        request = _request(target) if path is not None else b""
    except (OSError, MessageTooLarge, ZygoteKeyError) as exc:  # a runtime dir another user could control; a
        # huge environment; a key that cannot name a file
        print(f"elastic.prefork: {exc}; running cold", file=sys.stderr, flush=True)
        path = None
    if path is not None:
        _die_with_torchrun()
        sock = _connect(path) or _start_zygote(path, owner)
        if sock is not None:
            with sock:
                return _run_client(sock, request)
        print(f"elastic.prefork: no zygote (see {path.with_suffix('.log')}); running cold", file=sys.stderr)
    target.run()
    return 0
