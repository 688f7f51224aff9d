"""Process trees from ``/proc`` (Linux): torchrun starts workers in sessions of their own, so a process-group
signal misses them; whoever stops or kills a torchrun tree walks it here. The project's one reader of
``/proc/<pid>/stat``."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

__all__ = ["alive", "descendants", "process_stat"]


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
