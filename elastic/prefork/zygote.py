"""The zygote: one per torchrun agent. It imports the heavy modules once, then forks a worker for each client
that connects, watches client, worker and agent, and reports each worker's exit status to its client."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import io
import logging
import os
import random
import selectors
import signal
import socket
import struct
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from elastic.env import PREFORK_PRELOAD
from elastic.prefork.common import DEFAULT_PRELOAD, Target, marker_path, recv_message, send_message

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


# -- the zygote: one per torchrun agent --------------------------------------------------------------------
def _preload() -> None:
    names = os.environ.get(PREFORK_PRELOAD)
    for name in names.split(",") if names is not None else DEFAULT_PRELOAD:
        if name.strip():
            try:
                importlib.import_module(name.strip())
            except Exception:  # a module that fails here fails again, visibly, in the worker
                logger.warning("elastic.prefork: could not preload %s", name, exc_info=True)


def serve(path: Path, owner: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefork %(levelname)s %(message)s")
    owner_fd = os.pidfd_open(owner)
    if sys.path and sys.path[0] == os.getcwd():
        sys.path.pop(0)  # `-m` put the start-up directory first; a worker's sys.path[0] is its script's
    _preload()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child could not use CUDA
        logger.error("a preloaded module initialised CUDA: no zygote for agent %d (workers start cold)", owner)
        return 1
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
                marker_path(client_pid).unlink()
        for leftover in (path, *(path.with_suffix(x) for x in (".lock", ".log", ".pid"))):
            with contextlib.suppress(OSError):
                leftover.unlink()


def _accept(listener: socket.socket, sel: selectors.BaseSelector, children: dict[int, Any]) -> None:
    conn, _ = listener.accept()
    conn.settimeout(10)
    try:
        request, fds = recv_message(conn, with_fds=True)
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
    marker_path(client_pid).write_text(str(pid))
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    children[pid] = (conn, pidfd, client_pid)
    conn.settimeout(None)
    with contextlib.suppress(OSError):
        send_message(conn, {"pid": pid})
    sel.register(conn, selectors.EVENT_READ, ("client", pid))
    sel.register(pidfd, selectors.EVENT_READ, ("child", pid))


def _reap(pid: int, sel: selectors.BaseSelector, children: dict[int, tuple[socket.socket, int, int]]) -> None:
    conn, pidfd, client_pid = children.pop(pid)
    with contextlib.suppress(OSError):
        marker_path(client_pid).unlink()
    _, status = os.waitpid(pid, 0)
    sel.unregister(pidfd)
    os.close(pidfd)
    result = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.waitstatus_to_exitcode(status)}
    with contextlib.suppress(KeyError, ValueError):
        sel.unregister(conn)
    with contextlib.suppress(OSError):
        send_message(conn, {"status": result})
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
    """What interpreter exit does that matters to a worker, in its order: ``threading._shutdown`` (the
    threading atexit hooks, e.g. concurrent.futures telling its idle pool threads to stop, then joining the
    non-daemon threads; joining them without those hooks waits for ever), ``atexit`` handlers, flush."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code
