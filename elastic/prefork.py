"""Warm worker starts under stock torchrun: a per-agent zygote with torch imported forks the workers.

torchrun re-spawns every worker of every node on each failure or membership change. A fresh Python that
imports torch, and builds its first optimizer (which imports ``torch._dynamo``), spends 2-3 s of CPU before
the script's first line of real work; on every restart that is most of the recovery time. Run the script
through this module instead::

    torchrun --rdzv-backend=etcd-v3 ... -m elastic.prefork train.py --lr 0.1
    torchrun ... -m elastic.prefork -m mypkg.train --lr 0.1

Each worker process torchrun starts is then a small *client*: it asks its agent's *zygote* to fork a child
that runs the script, hands it its stdin/stdout/stderr, environment, working directory and arguments,
forwards the signals it receives (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCONT) to the child and
exits with the child's exit code (or dies of the child's signal). The first worker of an agent starts the
zygote (one per torchrun agent, keyed by the agent's pid and start time) and waits for it: the first
start costs what a cold start costs, every restart after it forks from an interpreter that already has
the modules of ``ETRAIN_PREFORK_PRELOAD`` imported (default :data:`DEFAULT_PRELOAD`).

Lifetimes (no orphans): if the client dies, even by SIGKILL, the zygote SIGKILLs its child; every child
dies with the zygote (``PR_SET_PDEATHSIG``); the zygote exits when its torchrun agent does. A child runs in
a session of its own, as torchrun's workers do; :func:`forked_worker` maps a client's pid to its child's,
for tools that signal workers directly.

Contract and limits: the child is a fork of an interpreter that imported torch but never initialised
CUDA, started a thread of its own or opened a process group, so it behaves like a fresh worker with two
exceptions: ``sys.modules`` already holds the preloaded modules (module-level state they compute from the
environment at import, e.g. ``TORCH_LOGS``, comes from the agent's environment, which is the same for every
worker of a torchrun agent), and Python's hash seed is the zygote's. Interpreter shutdown in the child runs
``atexit`` handlers and joins non-daemon threads, then exits without running object finalisers. With
``ETRAIN_PREFORK=0``, or if the zygote cannot be started, the script runs in the client process itself
(a cold start, with a warning in the second case).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import importlib
import io
import json
import logging
import os
import random
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic.proctree import descendants, process_stat

__all__ = ["DEFAULT_PRELOAD", "Target", "forked_worker", "main", "prestart", "socket_path", "worker_tree"]

logger = logging.getLogger(__name__)

DEFAULT_PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "elastic.loop")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT)  # fmt: skip
_HEADER = struct.Struct("!I")
_START_TIMEOUT_S = 120.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Target:
    """What to run: a script path or a module (``-m``), with its arguments."""

    kind: str  # "script" | "module"
    name: str
    args: tuple[str, ...]

    @classmethod
    def parse(cls, argv: list[str]) -> Target:
        if argv[:1] == ["-m"] and len(argv) >= 2:
            return cls("module", argv[1], tuple(argv[2:]))
        if not argv or argv[0].startswith("-"):
            raise SystemExit("usage: python -m elastic.prefork (SCRIPT | -m MODULE) [ARGS...]")
        return cls("script", argv[0], tuple(argv[1:]))

    def run(self) -> None:
        """Run as ``__main__`` in this process (``sys.argv`` and ``sys.path[0]`` as ``python`` sets them)."""
        if self.kind == "module":
            sys.argv = [self.name, *self.args]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(self.name, run_name="__main__", alter_sys=True)
        else:
            path = os.path.abspath(self.name)
            sys.argv = [self.name, *self.args]
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, run_name="__main__")


# -- where the zygote of an agent lives ----------------------------------------------------------------
def _base_dir() -> Path:
    base = Path(os.environ.get("ETRAIN_PREFORK_DIR") or f"/tmp/etrain-prefork-{os.getuid()}")
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return base


def socket_path(owner: int) -> Path | None:
    """The zygote socket of the torchrun agent ``owner`` (None if that process is gone)."""
    st = process_stat(owner)
    if st is None:
        return None
    return _base_dir() / f"{owner}-{st[1]}.sock"


def _marker(client_pid: int) -> Path:
    folder = _base_dir() / "clients"
    folder.mkdir(exist_ok=True)
    return folder / str(client_pid)


def forked_worker(client_pid: int) -> int | None:
    """The pid of the child a client process runs its script in, or None (not a prefork client, or gone)."""
    try:
        child = int(_marker(client_pid).read_text())
    except (OSError, ValueError):
        return None
    return child if process_stat(child) is not None else None


def worker_tree(root: int) -> list[tuple[int, int]]:
    """:func:`elastic.proctree.descendants` of ``root``, each prefork client followed by the worker it runs
    (which is the zygote's child, not the client's)."""
    out: list[tuple[int, int]] = []
    for pid, start in descendants(root):
        out.append((pid, start))
        child = forked_worker(pid)
        st = process_stat(child) if child is not None else None
        if child is not None and st is not None:
            out.append((child, st[1]))
    return out


# -- messages: a 4-byte length, then JSON ----------------------------------------------------------------
def _send(sock: socket.socket, obj: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    frame = _HEADER.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        sock.sendall(frame[sent:])
    else:
        sock.sendall(frame)


def _recv_exact(sock: socket.socket, n: int, buf: bytes = b"") -> bytes:
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return buf


def _recv(sock: socket.socket, with_fds: bool = False) -> tuple[dict[str, Any], list[int]]:
    fds: list[int] = []
    if with_fds:
        data, fds, _, _ = socket.recv_fds(sock, 65536, 3)
        if not data:
            raise EOFError("connection closed")
    else:
        data = b""
    data = _recv_exact(sock, _HEADER.size, data)
    (length,) = _HEADER.unpack(data[: _HEADER.size])
    body = _recv_exact(sock, _HEADER.size + length, data)
    return json.loads(body[_HEADER.size :]), fds


# -- the client: one per worker torchrun starts ------------------------------------------------------------
def _connect(path: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    return sock


def _zygote_starting(path: Path) -> int | None:
    """The pid of the zygote being started for ``path`` (recorded by whoever started it), if it lives."""
    try:
        pid, start = (int(x) for x in path.with_suffix(".pid").read_text().split())
    except (OSError, ValueError):
        return None
    st = process_stat(pid)
    return pid if st is not None and st[1] == start else None


def _launch(path: Path, owner: int) -> int | None:
    """Under the agent's lock: the zygote already starting for ``owner``, or a new one (its pid)."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pid = _zygote_starting(path)
        if pid is not None:
            return pid
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a zygote that was killed leaves its socket behind
        pid = _spawn_detached([sys.executable, "-m", "elastic.prefork", "--serve", str(path), str(owner)],
                              path.with_suffix(".log"))  # fmt: skip
        st = process_stat(pid) if pid > 0 else None
        if st is None:
            return None
        path.with_suffix(".pid").write_text(f"{pid} {st[1]}")
        return pid


def _start_zygote(path: Path, owner: int) -> socket.socket | None:
    """Connect to the agent's zygote, starting it first if nobody did (one start per agent)."""
    pid = _launch(path, owner)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while pid is not None and time.monotonic() < deadline:
        sock = _connect(path)
        if sock is not None:
            return sock
        if process_stat(pid) is None:
            return _connect(path)
        time.sleep(0.02)
    return None


def prestart(owner: int | None = None) -> None:
    """Start the zygote of torchrun agent ``owner`` (default: this process) now and return at once, so
    that its imports overlap the rendezvous instead of delaying the first worker. Does nothing if
    ``ETRAIN_PREFORK=0`` or if one runs already. Safe in a multi-threaded process (no fork here)."""
    if os.environ.get("ETRAIN_PREFORK", "1") == "0":
        return
    path = socket_path(os.getpid() if owner is None else owner)
    if path is None:
        return
    sock = _connect(path)
    if sock is not None:
        sock.close()
        return
    _launch(path, os.getpid() if owner is None else owner)


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
        out = subprocess.run([sys.executable, "-S", "-c", _DETACH, str(log), *cmd], capture_output=True,
                             text=True, timeout=30, check=True)  # fmt: skip
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


def _run_client(sock: socket.socket, target: Target) -> int:
    request = {
        "target": [target.kind, target.name, list(target.args)],
        "env": dict(os.environ, ETRAIN_PREFORK_CLIENT=str(os.getpid())),
        "cwd": os.getcwd(),
        "unbuffered": bool(getattr(sys.stdout, "write_through", False)),
    }
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
        _send(sock, request, fds=[0, 1, 2])
        reply, _ = _recv(sock)
        child.append(int(reply["pid"]))
        for waiting in pending:
            forward(waiting, None)
        reply, _ = _recv(sock)
        return _exit_like(reply["status"])
    except (EOFError, OSError) as exc:
        print(f"elastic.prefork: lost the zygote ({exc}); the worker is gone", file=sys.stderr, flush=True)
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return _serve(Path(argv[1]), int(argv[2]))
    target = Target.parse(argv)
    path = socket_path(os.getppid()) if os.environ.get("ETRAIN_PREFORK", "1") != "0" else None
    if path is not None:
        sock = _connect(path) or _start_zygote(path, os.getppid())
        if sock is not None:
            with sock:
                return _run_client(sock, target)
        print(f"elastic.prefork: no zygote (see {path.with_suffix('.log')}); running cold", file=sys.stderr)
    target.run()
    return 0


# -- the zygote: one per torchrun agent --------------------------------------------------------------------
def _preload() -> None:
    names = os.environ.get("ETRAIN_PREFORK_PRELOAD")
    for name in names.split(",") if names is not None else DEFAULT_PRELOAD:
        if name.strip():
            try:
                importlib.import_module(name.strip())
            except Exception:  # a module that fails here fails again, visibly, in the worker
                logger.warning("elastic.prefork: could not preload %s", name, exc_info=True)


def _serve(path: Path, owner: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefork %(levelname)s %(message)s")
    owner_fd = os.pidfd_open(owner)
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    listener.bind(str(tmp))
    listener.listen(64)
    os.rename(tmp, path)  # clients see the socket only once the modules are loaded
    logger.info("zygote %d for agent %d ready at %s", os.getpid(), owner, path)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("listen", None))
    sel.register(owner_fd, selectors.EVENT_READ, ("owner", None))
    children: dict[int, tuple[socket.socket, int, int]] = {}  # pid -> (client connection, pidfd, client pid)
    try:
        while True:
            for key, _ in sel.select():
                what, data = key.data
                if what == "owner":
                    return 0
                if what == "listen":
                    _accept(listener, sel, children)
                elif what == "client":  # EOF (or stray bytes): the client is gone; so must its child be
                    pid = data
                    with contextlib.suppress(OSError):
                        if pid in children and not children[pid][0].recv(1, socket.MSG_PEEK):
                            sel.unregister(children[pid][0])
                            os.kill(pid, signal.SIGKILL)
                elif what == "child":
                    _reap(data, sel, children)
    finally:
        for pid, (_, _, client_pid) in children.items():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                _marker(client_pid).unlink()
        for leftover in (path, *(path.with_suffix(x) for x in (".lock", ".log", ".pid"))):
            with contextlib.suppress(OSError):
                leftover.unlink()


def _accept(listener: socket.socket, sel: selectors.BaseSelector, children: dict[int, Any]) -> None:
    conn, _ = listener.accept()
    conn.settimeout(10)
    try:
        request, fds = _recv(conn, with_fds=True)
    except (OSError, EOFError, ValueError):
        conn.close()
        return
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    client_pid = struct.unpack("3i", creds)[0]
    pid = os.fork()
    if pid == 0:
        _child(request, fds, keep=conn)  # never returns
    _marker(client_pid).write_text(str(pid))
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    children[pid] = (conn, pidfd, client_pid)
    conn.settimeout(None)
    with contextlib.suppress(OSError):
        _send(conn, {"pid": pid})
    sel.register(conn, selectors.EVENT_READ, ("client", pid))
    sel.register(pidfd, selectors.EVENT_READ, ("child", pid))


def _reap(pid: int, sel: selectors.BaseSelector, children: dict[int, tuple[socket.socket, int, int]]) -> None:
    conn, pidfd, client_pid = children.pop(pid)
    with contextlib.suppress(OSError):
        _marker(client_pid).unlink()
    _, status = os.waitpid(pid, 0)
    sel.unregister(pidfd)
    os.close(pidfd)
    result = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.waitstatus_to_exitcode(status)}
    with contextlib.suppress(KeyError, ValueError):
        sel.unregister(conn)
    with contextlib.suppress(OSError):
        _send(conn, {"status": result})
    conn.close()


def _child(request: dict[str, Any], fds: list[int], keep: socket.socket) -> None:
    """In the forked child: become the worker the client asked for, run it, exit. Never returns."""
    code = 1
    try:
        os.setsid()
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        zygote = os.getppid()
        if zygote == 1:
            os._exit(1)
        keep.close()  # the zygote watches the client; the child needs neither socket
        _close_fds_except(fds)
        for fd, std in zip(fds, (0, 1, 2), strict=True):
            os.dup2(fd, std)
            os.close(fd)
        for sig in range(1, signal.NSIG):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _reopen_std(bool(request["unbuffered"]))
        root = logging.getLogger()
        for handler in root.handlers[:]:  # the zygote's own logging is not the worker's
            root.removeHandler(handler)
        root.setLevel(logging.WARNING)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()
        kind, name, args = request["target"]
        target = Target(kind, name, tuple(args))
        try:
            target.run()
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:
            traceback.print_exc()
            code = 1
        code = _shutdown(code)
    finally:
        os._exit(code)


def _close_fds_except(keep: list[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _reopen_std(unbuffered: bool) -> None:
    for fd, attr in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        mode = "rb" if fd == 0 else "wb"
        tty = os.isatty(fd)
        raw = io.FileIO(fd, mode, closefd=False)
        buffered: Any = raw if unbuffered and fd else io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
        text = io.TextIOWrapper(
            buffered, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
            line_buffering=tty or fd == 2, write_through=unbuffered and fd > 0,
        )  # fmt: skip
        setattr(sys, attr, text)
        setattr(sys, f"__{attr}__", text)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _shutdown(code: int) -> int:
    """What interpreter exit does that matters to a worker: join non-daemon threads, atexit, flush."""
    try:
        main_thread = threading.main_thread()
        for t in threading.enumerate():
            if t is not main_thread and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
