"""The zygote: one per torchrun agent. It imports the heavy modules once, then forks a worker for each client
that connects, watches client, worker and agent, and reports each worker's exit status to its client.

It stays single-threaded (it forks: a fork of a multi-threaded process may inherit a lock some other thread
held) and one selector loop serves everything; no client can stall it: requests are read without blocking,
as their bytes come, each within :data:`REQUEST_DEADLINE_S` of its connection and at most
:data:`~elastic.prefork.common.MAX_MESSAGE` bytes long, else that connection is dropped with a log line."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import json
import logging
import os
import random
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic.contract.env import PREFORK_PRELOAD
from elastic.interpreter import loading
from elastic.prefork.common import (
    DEFAULT_PRELOAD,
    HEADER_SIZE,
    MAX_MESSAGE,
    Target,
    marker_path,
    message_length,
    record_zygote,
    send_message,
)
from elastic.proctree import set_parent_death_signal

logger = logging.getLogger(__name__)

REQUEST_DEADLINE_S = 10.0  # from connect to the last byte of the request (a client sends it at once)
_CREDS = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


@dataclass
class _Pending:
    """A connection whose request is still coming in."""

    conn: socket.socket
    client_pid: int
    deadline: float
    data: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)

    def drop(self, sel: selectors.BaseSelector, pending: dict[int, _Pending], why: str | None) -> None:
        if why is not None:
            logger.warning("dropping the connection of pid %d: %s", self.client_pid, why)
        pending.pop(self.conn.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(self.conn)
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.conn.close()


# -- the zygote: one per torchrun agent --------------------------------------------------------------------
def _preload() -> None:
    names = os.environ.get(PREFORK_PRELOAD)
    for name in names.split(",") if names is not None else DEFAULT_PRELOAD:
        if name.strip():
            try:
                importlib.import_module(name.strip())
            except Exception:  # a module that fails here fails again, visibly, in the worker
                logger.warning("elastic.prefork: could not preload %s", name, exc_info=True)


def _exit_on_sigterm(_sig: int, _frame: object) -> None:
    raise SystemExit(0)  # the loop's ``finally`` kills the children left and removes the zygote's files


def serve(path: Path, owner: int, grace: float = 0.0) -> int:
    """Serve until ``owner`` dies (then let the children end for up to ``grace`` seconds: their own parents,
    e.g. a torchrun told by its dead node agent's SIGTERM, stop them) or SIGTERM; kill what is left."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefork %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    record_zygote(path, os.getpid())  # first thing: see record_zygote
    owner_fd = os.pidfd_open(owner)
    if sys.path and sys.path[0] == os.getcwd():
        sys.path.pop(0)  # `-m` put the start-up directory first; a worker's sys.path[0] is its script's
    with loading():  # the collector paused while importing, the modules frozen before the first fork
        _preload()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child could not use CUDA
        logger.error("a preloaded module initialised CUDA: no zygote for agent %d (workers start cold)", owner)
        return 1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    listener.bind(str(tmp))
    listener.listen(64)
    listener.setblocking(False)
    os.rename(tmp, path)  # clients see the socket only once the modules are loaded
    logger.info("zygote %d for agent %d ready at %s", os.getpid(), owner, path)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("listen", None))
    sel.register(owner_fd, selectors.EVENT_READ, ("owner", None))
    children: dict[int, tuple[socket.socket, int, int]] = {}  # pid -> (client connection, pidfd, client pid)
    pending: dict[int, _Pending] = {}  # connection fd -> its request so far
    draining: float | None = None  # the owner is gone: the children have until then
    try:
        while draining is None or (children and time.monotonic() < draining):
            deadlines = [p.deadline for p in pending.values()] + ([] if draining is None else [draining])
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            for key, _ in sel.select(timeout):
                what, data = key.data
                if what == "owner":
                    if grace <= 0 or not children:
                        return 0
                    logger.info("agent %d is gone: %d children have %g s to end", owner, len(children), grace)
                    draining = time.monotonic() + grace
                    _stop_listening(sel, listener, owner_fd, path, pending)
                    continue
                if what == "listen":
                    _accept(listener, sel, pending)
                elif what == "request":
                    request = _read_request(data, sel, pending)
                    if request is not None:
                        _start(data, request, sel, children)
                elif what == "client":  # EOF: the client is gone; so must its child be (stray bytes: dropped)
                    pid = data
                    with contextlib.suppress(OSError):
                        if pid in children and not children[pid][0].recv(4096):
                            sel.unregister(children[pid][0])
                            os.kill(pid, signal.SIGKILL)
                elif what == "child":
                    _reap(data, sel, children)
            now = time.monotonic()
            for late in [p for p in pending.values() if p.deadline <= now]:
                late.drop(sel, pending, f"no complete request within {REQUEST_DEADLINE_S:g} s")
        if children:
            logger.warning("%d children did not end within %g s of their owner's death: killed", len(children), grace)
        return 0
    finally:
        for pid, (_, _, client_pid) in children.items():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                marker_path(client_pid).unlink()
        for leftover in (path, *(path.with_suffix(x) for x in (".lock", ".log", ".pid"))):
            with contextlib.suppress(OSError):
                leftover.unlink()


def _stop_listening(
    sel: selectors.BaseSelector, listener: socket.socket, owner_fd: int, path: Path, pending: dict[int, _Pending]
) -> None:
    """No new children: the socket goes (a client finds no zygote and starts cold), pending requests are dropped."""
    for fileobj in (listener, owner_fd):
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(fileobj)
    listener.close()
    with contextlib.suppress(OSError):
        path.unlink()
    for p in list(pending.values()):
        p.drop(sel, pending, "the zygote's owner is gone")


def _accept(listener: socket.socket, sel: selectors.BaseSelector, pending: dict[int, _Pending]) -> None:
    try:
        conn, _ = listener.accept()
    except (BlockingIOError, InterruptedError, ConnectionAbortedError):
        return
    conn.setblocking(False)
    client_pid = _CREDS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))[0]
    request = _Pending(conn, client_pid, time.monotonic() + REQUEST_DEADLINE_S)
    pending[conn.fileno()] = request
    sel.register(conn, selectors.EVENT_READ, ("request", request))


def _read_request(p: _Pending, sel: selectors.BaseSelector, pending: dict[int, _Pending]) -> dict[str, Any] | None:
    """Read what has come of ``p``'s request, never more than it announced; the request once it is complete
    (the connection is then no longer pending), else None (more to come, or dropped)."""
    length = message_length(p.data) if len(p.data) >= HEADER_SIZE else None
    want = HEADER_SIZE - len(p.data) if length is None else HEADER_SIZE + length - len(p.data)
    try:
        chunk, fds, _, _ = socket.recv_fds(p.conn, min(want, 1 << 16), 3)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as exc:
        p.drop(sel, pending, str(exc))
        return None
    p.fds.extend(fds)
    if not chunk:  # closed (a probe of prestart() does that at once): nothing to say
        p.drop(sel, pending, None if not p.data else f"closed after {len(p.data)} bytes of a request")
        return None
    p.data += chunk
    if length is None and len(p.data) == HEADER_SIZE:
        length = message_length(p.data)
        if length > MAX_MESSAGE:
            p.drop(sel, pending, f"refusing a {length}-byte request (limit {MAX_MESSAGE} bytes)")
            return None
    if length is None or len(p.data) < HEADER_SIZE + length:
        return None
    try:
        request = json.loads(bytes(p.data[HEADER_SIZE:]))
        if not isinstance(request, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        p.drop(sel, pending, f"unreadable request ({exc})")
        return None
    if len(p.fds) != 3:
        p.drop(sel, pending, f"{len(p.fds)} descriptors instead of stdin, stdout and stderr")
        return None
    pending.pop(p.conn.fileno())
    sel.unregister(p.conn)
    return request


def _start(p: _Pending, request: dict[str, Any], sel: selectors.BaseSelector, children: dict[int, Any]) -> None:
    """Fork the worker ``request`` asks for (here, in the zygote's only thread) and watch it and its client."""
    conn, fds, client_pid = p.conn, p.fds, p.client_pid
    conn.setblocking(True)  # from here on only small replies are sent to it
    pid = os.fork()
    if pid == 0:
        _child(request, fds, keep=conn)  # never returns
    try:
        marker_path(client_pid).write_text(str(pid))
    except OSError as exc:  # forked_worker() will not know this worker; it runs all the same
        logger.warning("no marker for the worker %d of client %d: %s", pid, client_pid, exc)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    children[pid] = (conn, pidfd, client_pid)
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
        set_parent_death_signal(signal.SIGKILL)
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
        # as a fresh interpreter starts: SIGPIPE and SIGXFSZ ignored (a write to a closed socket then raises
        # BrokenPipeError instead of killing the worker: found by the chaos suite's storage outage), SIGINT
        # raising KeyboardInterrupt
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
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
            buffered,
            encoding="utf-8",
            errors="backslashreplace" if fd == 2 else "strict",
            line_buffering=tty or fd == 2,
            write_through=unbuffered and fd > 0,
        )
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
