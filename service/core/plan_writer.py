"""The leader's writes of a plan (``service.controller.reconcile``'s :class:`~service.core.view.Plan`) to etcd,
each job's part in one transaction fenced by the leader's key.

:meth:`PlanWriter.apply` commits one job's update (its status, events, assignments and report deletions, or its
purge) only if the job's status key still has the revision the plan was decided on and the leader key is still
the caller's (``fence``); :meth:`PlanWriter.apply_plan` applies every job's part, ordering the jobs that release
nodes before those that take them. The plain reads and writes of the service's records are
:class:`service.core.store.ServiceStore`'s, which holds a :class:`PlanWriter` (``store.plans``) and passes its
``apply`` and ``apply_plan`` on.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from elastic.etcd import EtcdClient, EtcdConnectionError, EtcdError, KeyValue
from service.core.keys import Keys, dump
from service.core.view import JobUpdate, Plan, PlanOutcome

logger = logging.getLogger("service.core.store")  # the name its lines had before the split

__all__ = ["PlanWriter"]

_APPLY_THREADS = 8  # job transactions of one plan in flight at once


class PlanWriter:
    """Applies the leader's plans under its fence; safe to share between threads."""

    def __init__(self, client: EtcdClient, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._pool: ThreadPoolExecutor | None = None  # apply_plan's senders, made at the first plan
        self._pool_lock = threading.Lock()

    def apply(self, update: JobUpdate, fence: tuple[str, int], written: list[KeyValue] | None = None) -> bool:
        """Commit one job's update if its status is unchanged and ``fence`` still holds; with ``written``, add
        to it each key put, with its value and the revision of the write as its ``mod_revision``."""
        k = self.keys
        if update.purge:
            ok, _ = self.client.commit(
                deletes=[
                    k.job(update.job_id),
                    k.status_of(update.job_id),
                    k.cancel_of(update.job_id),
                    k.progress_of(update.job_id),
                    *(k.report(update.job_id, node) for node in update.clear_report_nodes),
                ],
                delete_prefixes=[k.events_of(update.job_id), k.metrics_of(update.job_id)],
                expect=[(k.status_of(update.job_id), update.expected_revision)],
                guard=fence,
            )
            return ok
        puts: list[tuple[str, bytes]] = []
        if update.status is not None:
            puts.append((k.status_of(update.job_id), dump(update.status)))
        puts += [(k.events_of(update.job_id) + e.id, dump(e)) for e in update.events]
        stamped = {  # every node of a generation meets under the prefix the controller names
            node: a if a.rdzv_prefix else a.model_copy(update={"rdzv_prefix": k.rdzv})
            for node, a in update.assign.items()
        }
        puts += [(k.assignment(node, update.job_id), dump(a)) for node, a in stamped.items()]
        deletes = [k.assignment(node, update.job_id) for node in update.unassign]
        deletes += [k.report(update.job_id, node) for node in update.clear_report_nodes]
        ok, revision = self.client.commit(
            puts,
            deletes,
            expect=[(k.status_of(update.job_id), update.expected_revision)],
            guard=fence,
        )
        if ok and written is not None:
            written += [KeyValue(key, value, 0, revision) for key, value in puts]
        return ok

    def _apply_one(self, update: JobUpdate, fence: tuple[str, int]) -> tuple[bool, str | None, list[KeyValue]]:
        """``(applied, etcd's refusal or None, what was written)``; raises :class:`EtcdConnectionError`."""
        mine: list[KeyValue] = []
        try:
            return self.apply(update, fence, mine), None, mine
        except EtcdConnectionError:
            raise
        except EtcdError as exc:
            return False, str(exc), []

    def apply_plan(self, plan: Plan, fence: tuple[str, int], written: list[KeyValue] | None = None) -> PlanOutcome:
        """Apply every job's part of ``plan``, each in its own transaction: etcd refusing one job's part
        (too many operations, too large) is that job's failure alone. Unreachable etcd (or lost quorum)
        raises :class:`EtcdConnectionError`: nothing more can be written this pass.

        An update with ``after`` jobs (they release nodes it is assigned) is sent only once their updates were
        applied; if one of them was refused or failed it is held back (counted as refused: the next pass decides
        again), so a node is never assigned to two jobs. The jobs' transactions of one round (disjoint keys) are
        sent ``_APPLY_THREADS`` at a time: one after the other, a pass that updates a few hundred jobs spent most
        of its time waiting for each answer in turn."""
        refused = 0
        failed: dict[str, str] = {}
        done: set[str] = set()  # sent (or held back)
        applied: set[str] = set()
        held: list[str] = []
        pending = list(plan.updates)
        planned = {u.job_id for u in pending}
        while pending:
            stable = False
            while not stable:  # hold back what needs an update that was not applied, then what needs those
                stable = True
                for update in list(pending):
                    # (an ``after`` job missing from the plan had its update taken out: not applied either)
                    missing = [a for a in update.after if a not in planned or (a in done and a not in applied)]
                    if missing:
                        pending.remove(update)
                        held.append(update.job_id)
                        done.add(update.job_id)
                        stable = False
                        logger.warning(
                            "update of job %s held back: the update of job %s, which gives up nodes "
                            "it takes, was not applied",
                            update.job_id,
                            ", ".join(missing),
                        )
            waiting = {u.job_id for u in pending}
            ready = [u for u in pending if not any(a in waiting and a != u.job_id for a in u.after)]
            if not ready and pending:  # a cycle: none of it can be ordered safely
                held += [u.job_id for u in pending]
                break
            for update, (ok, error, kvs) in zip(ready, self._send(ready, fence), strict=True):
                done.add(update.job_id)
                if written is not None:
                    written += kvs
                if error is not None:
                    failed[update.job_id] = error
                    logger.warning("etcd refused the update of job %s: %s", update.job_id, error)
                elif not ok:
                    refused += 1
                    logger.info("update of job %s refused (status changed or leadership lost)", update.job_id)
                else:
                    applied.add(update.job_id)
            sent = {u.job_id for u in ready}
            pending = [u for u in pending if u.job_id not in sent]
        refused += len(held)
        for node, job_id in plan.orphans:  # one by one: a bad key must not keep the others
            try:
                ok, _ = self.client.commit(deletes=[self.keys.assignment(node, job_id)], guard=fence)
            except EtcdConnectionError:
                raise
            except EtcdError as exc:
                logger.warning("cannot delete the orphaned assignment %s/%s: %s", node, job_id, exc)
                continue
            refused += 0 if ok else 1
        return PlanOutcome(refused=refused, failed=failed, held=tuple(held))

    def _send(self, updates: list[JobUpdate], fence: tuple[str, int]) -> list[tuple[bool, str | None, list[KeyValue]]]:
        """Each update's ``_apply_one``, ``_APPLY_THREADS`` at a time when there are several."""
        if len(updates) <= 1:
            return [self._apply_one(u, fence) for u in updates]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_APPLY_THREADS, thread_name_prefix="etrain-apply")
            pool = self._pool
        return list(pool.map(lambda u: self._apply_one(u, fence), updates))
