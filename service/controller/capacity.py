"""Pure node placement: which live nodes have room for a job's workers.

A node's capacity is the number of worker processes it runs (the agent's ``--nproc-per-node``); a job
uses ``nproc_per_node`` of it on every node it is placed on. Placement is best-fit (the fullest node
that still fits first, then by name), so whole nodes stay free for wide jobs, and deterministic.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from service.core.models import Assignment, NodeInfo

__all__ = ["free_capacity", "pick_nodes"]


def free_capacity(
    nodes: Mapping[str, NodeInfo],
    assignments: Iterable[tuple[str, Assignment]],
    active_jobs: Collection[str],
) -> dict[str, int]:
    """Free worker slots per live node, counting the assignments ``(node, assignment)`` of active jobs."""
    free = {name: info.capacity for name, info in nodes.items()}
    for node, assignment in assignments:
        if node in free and assignment.job_id in active_jobs:
            free[node] -= assignment.spec.nproc_per_node
    return free


def pick_nodes(free: Mapping[str, int], nproc: int, want: int, exclude: Collection[str] = ()) -> list[str]:
    """Up to ``want`` nodes with at least ``nproc`` free slots, best fit first, none from ``exclude``."""
    if want <= 0:
        return []
    fits = [(slots, name) for name, slots in free.items() if slots >= nproc and name not in exclude]
    fits.sort()
    return [name for _, name in fits[:want]]
