"""What the client and the zygote share: the target, where an agent's zygote lives, the message format."""

from __future__ import annotations

import json
import os
import re
import runpy
import signal
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic.contract.env import PREFORK, PREFORK_CLIENT, PREFORK_DIR, PREFORK_GRACE, PREFORK_KEY
from elastic.proctree import descendants, process_stat
from elastic.runtime_dir import private_dir

#: torch.distributed.run: a node agent's zygote forks the job's torchrun too (:mod:`elastic.prefork.torchrun`)
DEFAULT_PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.distributed.run",
    "elastic.train.trainer",
)
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCONT,
)
_HEADER = struct.Struct("!I")
MAX_MESSAGE = 4 << 20  # bytes of JSON: an environment and argv fit in 2 MiB (ARG_MAX) before exec would refuse them


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
def _base_dir(create: bool = True) -> Path:
    """``$ETRAIN_PREFORK_DIR`` or ``/tmp/etrain-prefork-<uid>``, a private directory (created 0700; one that
    another user could own, replace or read is refused with :class:`elastic.runtime_dir.UnsafeDirectoryError`:
    clients send their environment, secrets included, to the socket found there)."""
    return private_dir(Path(os.environ.get(PREFORK_DIR) or f"/tmp/etrain-prefork-{os.getuid()}"), create)


_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class ZygoteKeyError(ValueError):
    """A zygote key (``$ETRAIN_PREFORK_KEY``) that cannot be part of a file name."""


def check_key(key: str | None) -> str | None:
    """``key`` if it can name a zygote of its owner's (letters, digits, ``.``, ``_``, ``-``; at most 64, not
    starting with a separator), None for None or ""; else :class:`ZygoteKeyError`."""
    if not key:
        return None
    if not _KEY.fullmatch(key):
        raise ZygoteKeyError(f"{PREFORK_KEY}={key!r}: use 1-64 letters, digits, '.', '_' or '-'")
    return key


def zygote_key() -> str | None:
    """``$ETRAIN_PREFORK_KEY``: which of its owner's zygotes this process uses (None: the owner's only one)."""
    return check_key(os.environ.get(PREFORK_KEY))


def zygote_grace() -> float:
    """``$ETRAIN_PREFORK_GRACE``: seconds a zygote whose owner died lets its children end (0 if unset or bad)."""
    try:
        return max(0.0, float(os.environ.get(PREFORK_GRACE, "0")))
    except ValueError:
        return 0.0


def record_zygote(path: Path, pid: int) -> bool:
    """Write ``pid start-time`` of the zygote serving ``path`` beside it (``.pid``, replaced at once); False if
    that process is gone or the file cannot be written. Its starter writes it once it has started it, and the
    zygote itself first thing: whoever stops it finds it even if its starter died before recording it."""
    st = process_stat(pid)
    if st is None:
        return False
    tmp = path.with_suffix(f".pid.{os.getpid()}.tmp")
    try:
        tmp.write_text(f"{pid} {st[1]}")
        os.rename(tmp, path.with_suffix(".pid"))
    except OSError:
        return False
    return True


def recorded_zygote(path: Path) -> int | None:
    """The pid of the zygote recorded for ``path`` (:func:`record_zygote`), if that process still runs."""
    try:
        pid, start = (int(x) for x in path.with_suffix(".pid").read_text().split())
    except (OSError, ValueError):
        return None
    st = process_stat(pid)
    return pid if st is not None and st[1] == start else None


def socket_path(owner: int, key: str | None = None) -> Path | None:
    """The socket of the zygote of ``owner`` (a torchrun agent, or a node agent) named ``key`` (None: its only
    one); None if ``owner`` is gone. Raises :class:`elastic.runtime_dir.UnsafeDirectoryError` (an ``OSError``) if
    the directory is not private, :class:`ZygoteKeyError` for a bad key."""
    st = process_stat(owner)
    if st is None:
        return None
    key = check_key(key)
    return _base_dir() / (f"{owner}-{st[1]}.sock" if key is None else f"{owner}-{st[1]}-{key}.sock")


_OWN_FILE = re.compile(r"(\d+)-(\d+)(?:-[A-Za-z0-9][A-Za-z0-9._-]{0,63})?\.(?:sock|lock|log|pid)")


def sweep_stale() -> int:
    """Delete what the zygotes of owners that are gone left behind: a zygote removes its socket, lock, log and pid
    files as it exits, but one SIGKILLed with its node (or its agent) cannot. A zygote still running (its owner died
    and it lets its children end) keeps its files. Returns how many files went."""
    removed = 0
    base = _base_dir()
    for entry in base.iterdir():
        found = _OWN_FILE.fullmatch(entry.name)
        if found is None:
            continue
        st = process_stat(int(found[1]))
        if st is not None and st[1] == int(found[2]):
            continue  # its owner runs
        if recorded_zygote(base / (entry.name.rsplit(".", 1)[0] + ".sock")) is not None:
            continue
        try:
            entry.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def marker_path(client_pid: int, create: bool = True) -> Path:
    return private_dir(_base_dir(create) / "clients", create) / str(client_pid)


def _forked(client_pid: int) -> tuple[int, int] | None:
    """``(pid, start time)`` of the live child a client process runs its script in, else None."""
    try:  # only from a private directory: a planted marker would have us signal any process
        child = int(marker_path(client_pid, create=False).read_text())
    except (OSError, ValueError):
        return None
    st = process_stat(child)
    return (child, st[1]) if st is not None else None


def forked_worker(client_pid: int) -> int | None:
    """The pid of the child a client process runs its script in, or None (not a prefork client, or gone)."""
    found = _forked(client_pid)
    return found[0] if found is not None else None


def worker_tree(root: int) -> list[tuple[int, int]]:
    """:func:`elastic.proctree.descendants` of ``root``, each prefork client followed by the process it runs
    (the zygote's child, not the client's) and that process's own tree. ``root`` itself may be a client: the
    tree then starts with its forked child (e.g. a torchrun agent forked warm, :mod:`elastic.testing.torchrun`)."""
    out: list[tuple[int, int]] = []
    seen: set[int] = {root}

    def follow(pid: int) -> None:
        child = _forked(pid)
        if child is not None and child[0] not in seen:
            seen.add(child[0])
            out.append(child)
            walk(child[0])

    def walk(top: int) -> None:
        for proc in descendants(top):
            if proc[0] in seen:
                continue
            seen.add(proc[0])
            out.append(proc)
            follow(proc[0])

    follow(root)
    walk(root)
    return out


def launcher_pid() -> int:
    """The pid of the process that launched this worker (its torchrun agent): the parent, or for a worker a
    zygote forked, the parent of the client it runs for (the zygote may serve several agents:
    ``ETRAIN_PREFORK_OWNER``)."""
    raw = os.environ.get(PREFORK_CLIENT, "")
    if raw.isascii() and raw.isdigit() and int(raw) != os.getpid():
        st = process_stat(int(raw))
        if st is not None:
            return st[0]
    return os.getppid()


def prefork_enabled() -> bool:
    """False when ``ETRAIN_PREFORK=0``: scripts run in the client process, no zygote is started."""
    return os.environ.get(PREFORK, "1") != "0"


# -- messages: a 4-byte length, then JSON (at most MAX_MESSAGE bytes) ---------------------------------------
HEADER_SIZE = _HEADER.size


class MessageTooLarge(ValueError):
    """A message over :data:`MAX_MESSAGE` bytes (the zygote refuses those)."""


def message_length(header: bytes | bytearray) -> int:
    """The length a message's header announces."""
    (length,) = _HEADER.unpack(header[: _HEADER.size])
    return int(length)


def encode_message(obj: dict[str, Any]) -> bytes:
    """The frame of ``obj``: raises :class:`MessageTooLarge` over :data:`MAX_MESSAGE` bytes."""
    data = json.dumps(obj).encode()
    if len(data) > MAX_MESSAGE:
        raise MessageTooLarge(f"a {len(data)}-byte message is over the prefork limit of {MAX_MESSAGE} bytes")
    return _HEADER.pack(len(data)) + data


def send_message(sock: socket.socket, obj: dict[str, Any] | bytes, fds: list[int] | None = None) -> None:
    """Send ``obj`` (or a frame of :func:`encode_message`), with ``fds`` attached to its first byte."""
    frame = obj if isinstance(obj, bytes) else encode_message(obj)
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


def recv_message(sock: socket.socket, with_fds: bool = False) -> tuple[dict[str, Any], list[int]]:
    fds: list[int] = []
    if with_fds:
        data, fds, _, _ = socket.recv_fds(sock, 65536, 3)
        if not data:
            raise EOFError("connection closed")
    else:
        data = b""
    data = _recv_exact(sock, _HEADER.size, data)
    length = message_length(data)
    if length > MAX_MESSAGE:
        raise MessageTooLarge(f"a {length}-byte message is over the prefork limit of {MAX_MESSAGE} bytes")
    body = _recv_exact(sock, _HEADER.size + length, data)
    return json.loads(body[_HEADER.size :]), fds
