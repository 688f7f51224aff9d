"""Finished jobs past the retention period: the one rule of when a job is deleted, and a sweep that applies it on
its own, outside the reconcile pass.

:func:`reconcile` purges a job through :func:`retention_over` as part of its plan. :func:`sweep_expired` deletes the
same jobs from a read of its own (paged, so no number of stored jobs breaks it) and is run by the leader after a
pass that failed: whatever keeps the pass from succeeding, the store does not go on growing because of it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime

from elastic.etcd import EtcdConnectionError, EtcdError
from service.core.store import ServiceStore
from service.core.view import JobEntry, JobUpdate, ReconcileConfig

logger = logging.getLogger(__name__)

__all__ = ["expired_jobs", "retention_over", "sweep_expired"]


def retention_over(entry: JobEntry, now: datetime, cfg: ReconcileConfig) -> bool:
    """Whether ``entry``, a terminal job, finished longer ago than the retention (it is then deleted once it holds
    no assignment)."""
    st = entry.status
    return st.state.terminal and now - (st.finished_at or st.updated_at) >= cfg.terminal_retention


def expired_jobs(
    entries: Iterable[JobEntry],
    assigned: set[str],
    reported: Mapping[str, Iterable[str]],
    now: datetime,
    cfg: ReconcileConfig,
) -> list[JobUpdate]:
    """The purges of the jobs past retention that hold no assignment (``assigned``: job ids that do), each with the
    reports its nodes left (``reported``: job id -> nodes)."""
    return [
        JobUpdate(
            job_id=e.record.id,
            expected_revision=e.status_revision,
            status=None,
            purge=True,
            clear_report_nodes=sorted(reported.get(e.record.id, ())),
        )
        for e in entries
        if e.record.id not in assigned and retention_over(e, now, cfg)
    ]


def sweep_expired(store: ServiceStore, fence: tuple[str, int], now: datetime, cfg: ReconcileConfig) -> int:
    """Delete the jobs past retention, each in its own fenced transaction; returns how many were deleted. Raises
    :class:`EtcdConnectionError` when etcd cannot be reached; a job etcd refuses is left for the next sweep."""
    _, assignments = store.list_nodes()
    assigned = {job_id for jobs in assignments.values() for job_id in jobs}
    reported: dict[str, list[str]] = {}
    for node, job_id in store.report_keys():
        reported.setdefault(job_id, []).append(node)
    deleted = 0
    for update in expired_jobs(store.list_jobs(), assigned, reported, now, cfg):
        try:
            if store.apply(update, fence):
                deleted += 1
        except EtcdConnectionError:
            raise
        except EtcdError as exc:
            logger.warning("job %s: cannot delete it (past retention): %s", update.job_id, exc)
    if deleted:
        logger.info("deleted %d job(s) finished longer ago than the retention, outside the reconcile pass", deleted)
    return deleted
