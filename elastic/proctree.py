"""Process trees from ``/proc`` (Linux): torchrun starts workers in sessions of their own, so a process-group
signal misses them; whoever stops or kills a torchrun tree walks it here."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["descendants", "process_stat"]


def process_stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time in clock ticks)`` of a process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    return int(fields[1]), int(fields[19])


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
