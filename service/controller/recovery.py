"""Pure recovery rules: restart budgets, exponential backoff, crash-loop detection, node blacklist.

Every function takes the job's :class:`~service.core.models.JobStatus` (a copy the caller may change), its
:class:`~service.core.models.RestartPolicy` and ``now``; none does I/O.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta

from service.core.models import JobStatus, RestartPolicy

__all__ = [
    "FailureVerdict",
    "backoff_delay",
    "blacklisted_nodes",
    "blame_nodes",
    "judge_failure",
    "membership_budget_left",
]


def backoff_delay(failures: int, policy: RestartPolicy) -> timedelta:
    """Delay before restart number ``failures`` (1-based): initial, 2x, 4x, ... capped at the maximum."""
    if failures <= 0:
        return timedelta(0)
    exponent = min(failures - 1, 30)
    delay = policy.backoff_initial * (2**exponent)
    return min(delay, policy.backoff_max)


def blame_nodes(failed: Collection[str], not_failed: Collection[str]) -> list[str]:
    """Nodes to hold responsible for a failed generation.

    If every node's workers failed, the job itself is at fault (a bug, bad input): nobody is blamed.
    If some failed while others kept running, the failure is node-specific: the failed ones are.
    """
    if not failed or not not_failed:
        return []
    return sorted(failed)


def blacklisted_nodes(status: JobStatus, now: datetime) -> set[str]:
    """Nodes the job must avoid at ``now`` (cooldown not yet over)."""
    return {node for node, until in status.blacklist.items() if until > now}


@dataclass(frozen=True)
class FailureVerdict:
    """What to do after a generation failed: ``give_up`` with ``reason``, or restart after ``delay``."""

    give_up: bool
    reason: str
    delay: timedelta = timedelta(0)
    newly_blacklisted: tuple[str, ...] = ()


def judge_failure(
    status: JobStatus,
    policy: RestartPolicy,
    blamed: Collection[str],
    now: datetime,
) -> FailureVerdict:
    """Account one failed generation in ``status`` (mutated) and decide between restart and failure.

    Counts the failure, the start-up failure streak (a generation that failed before its first step),
    and each blamed node's failures; a node reaching ``blacklist_after`` is blacklisted for
    ``blacklist_cooldown`` and its count reset.
    """
    status.restarts.failure += 1
    if status.generation_progressed:
        status.startup_failures = 0
    else:
        status.startup_failures += 1
    # forget expired blacklist entries
    status.blacklist = {n: t for n, t in status.blacklist.items() if t > now}
    newly: list[str] = []
    for node in blamed:
        count = status.node_failures.get(node, 0) + 1
        if count >= policy.blacklist_after:
            status.blacklist[node] = now + policy.blacklist_cooldown
            status.node_failures.pop(node, None)
            newly.append(node)
        else:
            status.node_failures[node] = count
    if status.startup_failures >= policy.crash_loop_threshold:
        return FailureVerdict(
            True,
            f"crash loop at start-up: {status.startup_failures} consecutive generations failed "
            "before their first training step",
            newly_blacklisted=tuple(newly),
        )
    if status.restarts.failure > policy.max_failures:
        return FailureVerdict(
            True,
            f"restart budget exhausted: {status.restarts.failure} failures (max_failures={policy.max_failures})",
            newly_blacklisted=tuple(newly),
        )
    delay = backoff_delay(status.restarts.failure, policy)
    return FailureVerdict(
        False,
        f"restart {status.restarts.failure}/{policy.max_failures} in {delay.total_seconds():g}s",
        delay,
        tuple(newly),
    )


def membership_budget_left(status: JobStatus, policy: RestartPolicy) -> int:
    return max(policy.max_membership_changes - status.restarts.membership, 0)
