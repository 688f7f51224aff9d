"""Process trees from ``/proc`` (Linux): torchrun starts workers in sessions of their own, so a process-group
signal misses them; whoever stops or kills a torchrun tree walks it here. The project's one reader of
``/proc/<pid>/stat``."""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["alive", "descendants", "exec_with_parent_death_signal", "process_stat", "set_parent_death_signal"]


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()  # the name may hold spaces and parentheses


def process_stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time in clock ticks)`` of a process, or None if it is gone."""
    fields = _stat(pid)
    return (int(fields[1]), int(fields[19])) if fields is not None else None


def alive(pid: int, started: int) -> bool:
    """The process recorded as ``(pid, started)`` still runs: same start time (no reused pid), not a zombie."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z" and int(fields[19]) == started


def descendants(root: int) -> list[tuple[int, int]]:
    """``(pid, start time)`` of every live descendant of ``root``, children before grandchildren.

    The start time tells a process from a later one that reused its pid."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = process_stat(int(entry))
        if st is not None:
            children.setdefault(st[0], []).append((int(entry), st[1]))
    out: list[tuple[int, int]] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(0), []):
            out.append(child)
            todo.append(child[0])
    return out


_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> bool:
    """Have the kernel send this process ``sig`` when its parent (thread) dies (``PR_SET_PDEATHSIG``); False where
    that cannot be set (not Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig)) == 0
    except (OSError, AttributeError):
        return False


#: run by ``python -I -S -c`` (the standard library only, nothing of the environment's): arm the parent-death
#: signal ``argv[1]``, stop at once if the parent ``argv[2]`` is already gone, then become ``argv[3:]`` (same pid)
_EXEC_PROGRAM = f"""\
import ctypes, os, sys
sig, parent = int(sys.argv[1]), int(sys.argv[2])
if ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, sig) != 0:
    sys.exit("cannot set the parent-death signal: " + os.strerror(ctypes.get_errno()))
if os.getppid() != parent:
    os.kill(os.getpid(), sig)
try:
    os.execvp(sys.argv[3], sys.argv[3:])
except OSError as exc:
    sys.stderr.write("cannot run " + sys.argv[3] + ": " + str(exc) + "\\n")
    os._exit(127)
"""


def exec_with_parent_death_signal(
    cmd: Sequence[str], sig: int, env: Mapping[str, str] | None = None, python: str = sys.executable
) -> list[str]:
    """``cmd`` as run by a small program that sets ``sig`` as its parent-death signal and then execs ``cmd`` (the
    same process, so the signal holds for ``cmd``): what a ``preexec_fn`` would do, without running Python code
    between ``fork`` and ``exec`` in a copy of a threaded parent (Python's documentation warns it can deadlock; a
    node agent's child once died of a segmentation fault there). The parent is the caller (``os.getpid()``), and
    its thread that starts the process: the signal comes when that thread ends.

    Raises ``FileNotFoundError`` at once when ``cmd[0]`` is not an executable on ``env``'s PATH (the caller's
    ``PATH`` without ``env``), as starting ``cmd`` itself would; a later failure to exec it exits 127 with the reason
    on stderr."""
    if not cmd:
        raise ValueError("no command")
    path = (env if env is not None else os.environ).get("PATH", os.defpath)
    if shutil.which(cmd[0], path=path) is None:
        raise FileNotFoundError(f"{cmd[0]}: no such executable (PATH={path})")
    return [python, "-I", "-S", "-c", _EXEC_PROGRAM, str(int(sig)), str(os.getpid()), *cmd]
