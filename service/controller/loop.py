"""The reconcile loop: campaign for leadership, read the cluster, decide (pure), apply (fenced).

Every replica runs a :class:`Controller`; only the elected leader reconciles. The loop wakes on any
change under the service prefix (an etcd watch from the revision it last read) or every
``reconcile_interval``, whichever comes first, and never more often than ``_MIN_SPACING``.

The leader keeps its view of the cluster between passes (:class:`~service.core.view_cache.ViewCache`): a
full read when it becomes leader (and after a failed pass), then each pass reads only what changed, and the
view it hands to :func:`reconcile` is the same as a full read at that revision.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from elastic.etcd import EtcdError, KeyValue
from service.controller.identities import SHARED_IDENTITY_WARNING, JobIdentities, password_auth
from service.controller.leader import LeaderElection, create_election
from service.controller.metrics import SCHEDULER_ACTIONS, Metrics
from service.controller.reconcile import reconcile
from service.controller.retention import sweep_expired
from service.core.config import Settings
from service.core.metric_store import MetricsRecorder
from service.core.store import ServiceStore
from service.core.view import ClusterView, Plan, PlanOutcome, WriteFailure
from service.core.view_cache import ViewCache

logger = logging.getLogger(__name__)

__all__ = ["FAILING_AFTER", "Controller", "ReconcileHealth", "create_controller"]

_MIN_SPACING = 0.25
#: consecutive failed passes after which the leader reports itself not ready (``/readyz``)
FAILING_AFTER = 3


@dataclass(frozen=True)
class ReconcileHealth:
    """How this replica's reconcile passes go: ``failing`` once ``FAILING_AFTER`` passes in a row failed as
    leader (``/readyz`` then answers 503 with ``last_error``)."""

    consecutive_failures: int
    last_error: str | None
    seconds_since_success: float | None  # None: no pass succeeded yet

    @property
    def failing(self) -> bool:
        return self.consecutive_failures >= FAILING_AFTER


class Controller:
    """Runs the reconcile loop in a daemon thread (``start``/``stop``); ``tick`` runs one pass."""

    def __init__(self, store: ServiceStore, settings: Settings, metrics: Metrics | None = None) -> None:
        self._store = store
        self._settings = settings
        self._metrics = metrics
        self._election: LeaderElection = create_election(
            store.client, store.keys.leader, settings.replica_id, settings.leader_ttl
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_failures: dict[str, WriteFailure] = {}  # job id -> etcd refusing its updates
        # each job's own etcd user, when the control plane authenticates with a password (else None)
        self._identities = JobIdentities(store) if password_auth(store.client) else None
        self._cache: ViewCache | None = None  # the leader's view, kept between passes
        self._cache_fence: tuple[str, int] | None = None  # the leadership it was read under
        # the jobs' metric series: appended to as progress reports arrive, written batched (leader only)
        self._recorder = MetricsRecorder(
            store.client, store.keys, flush_every=settings.metrics_flush_interval.total_seconds()
        )
        # job id -> events written since its events were last counted (absent: count at its next event)
        self._events_since_trim: dict[str, int] = {}
        self._failures = 0  # passes failed in a row, as leader
        self._last_error: str | None = None
        self._last_success: float | None = None  # time.monotonic() of the last pass that succeeded

    @property
    def health(self) -> ReconcileHealth:
        """How the reconcile passes go (``/readyz``)."""
        since = None if self._last_success is None else time.monotonic() - self._last_success
        return ReconcileHealth(self._failures, self._last_error, since)

    def _passed(self) -> None:
        self._failures, self._last_error, self._last_success = 0, None, time.monotonic()

    def _failed(self, error: str) -> None:
        """A pass failed: counted, and, as leader, the jobs past retention deleted by a sweep of their own
        (``service.controller.retention``), so that what made the pass fail cannot keep the store growing."""
        self._failures += 1
        self._last_error = error[:500]
        if self._metrics is not None:
            self._metrics.reconcile_errors.inc()
        fence = self._election.fence if self._election.is_leader else None
        if fence is None:
            return
        try:
            sweep_expired(self._store, fence, datetime.now(timezone.utc), self._settings.reconcile)
        except Exception as exc:  # best effort: the next failed pass sweeps again
            logger.warning("the retention sweep after a failed pass failed too: %s", exc)

    def _drop_cache(self) -> None:
        self._recorder.reset()
        self._events_since_trim.clear()
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    @property
    def election(self) -> LeaderElection:
        return self._election

    def tick(self, now: datetime | None = None) -> int | None:
        """One pass if this replica leads: returns the revision read, or None when not leader."""
        if not self._election.campaign():
            if self._metrics is not None:
                self._metrics.is_leader.set(0)
            self._drop_cache()
            return None
        if self._metrics is not None:
            self._metrics.is_leader.set(1)
        started = time.monotonic()
        fence = self._election.fence
        if fence is None:
            self._drop_cache()
            return None
        cache = self._cache
        if cache is None:
            cache = self._cache = ViewCache(self._store.client, self._store.keys)
        if fence != self._cache_fence:  # (newly) leader: whatever was cached, read everything again
            cache.reset()
            self._recorder.reset()
            self._cache_fence = fence
        try:
            return self._pass(cache, fence, now, started)
        except BaseException:
            cache.reset()  # a pass that failed half-way: the next one reads everything
            raise

    def _pass(self, cache: ViewCache, fence: tuple[str, int], now: datetime | None, started: float) -> int:
        view = replace(cache.read(), write_failures=dict(self._write_failures))
        now = now or datetime.now(timezone.utc)
        plan = reconcile(view, now, self._settings.reconcile)
        if self._identities is not None:
            plan = self._identities.prepare(view, plan, fence, now)
        if not plan.empty:
            written: list[KeyValue] = []
            outcome = self._store.apply_plan(plan, fence, written)
            cache.written(written)
            if outcome.refused and self._metrics is not None:
                self._metrics.refused_updates.inc(outcome.refused)
            self._count_write_failures(plan, outcome)
            self._count_actions(plan, written)
            self._trim_events(plan, outcome)
            for update in plan.updates:
                for event in update.events:
                    logger.info("job %s: %s", update.job_id, event.message)
                if update.purge and update.job_id not in outcome.failed:
                    logger.info(
                        "job %s: deleted with its events (finished longer ago than the retention)", update.job_id
                    )
        self._record_metrics(view, plan, fence)
        if self._metrics is not None:
            self._metrics.reconcile_seconds.observe(time.monotonic() - started)
        return view.revision

    def _record_metrics(self, view: ClusterView, plan: Plan, fence: tuple[str, int]) -> None:
        """The jobs' new progress reports into their metric series, written batched. After the plan, and never
        its failure: the series must not hold up reconciling (a job deleted by the plan is left out)."""
        try:
            self._recorder.observe(view)
            self._recorder.forget(u.job_id for u in plan.updates if u.purge)
            self._recorder.flush(fence)
        except EtcdError as exc:
            logger.warning("metric series not recorded this pass: %s", exc)
        except Exception:
            logger.exception("metric series not recorded this pass")
            self._recorder.reset()

    def _count_actions(self, plan: Plan, written: list[KeyValue]) -> None:
        """``etrain_scheduler_actions_total``: the scheduling events (``SCHEDULER_ACTIONS``) of the updates
        that were applied (their event keys were written; a refused update is decided again next pass)."""
        if self._metrics is None:
            return
        applied = {kv.key for kv in written}
        for update in plan.updates:
            prefix = self._store.keys.events_of(update.job_id)
            for event in update.events:
                if event.type in SCHEDULER_ACTIONS and prefix + event.id in applied:
                    self._metrics.scheduler_actions.labels(event.type).inc()

    def _trim_events(self, plan: Plan, outcome: PlanOutcome) -> None:
        """Keep each job's events to ``event_limit`` (the newest): its events are counted at its first event
        after this replica became leader, then after every tenth of the limit written, and the excess deleted."""
        limit = self._settings.reconcile.event_limit
        every = max(1, limit // 10)
        for update in plan.updates:
            if update.purge:
                self._events_since_trim.pop(update.job_id, None)
                continue
            if not update.events or update.job_id in outcome.failed:
                continue
            since = self._events_since_trim.get(update.job_id, every - 1) + len(update.events)
            if since < every:
                self._events_since_trim[update.job_id] = since
                continue
            self._events_since_trim[update.job_id] = 0
            try:
                dropped = self._store.trim_events(update.job_id, limit)
            except EtcdError as exc:
                logger.warning("job %s: cannot delete its oldest events: %s", update.job_id, exc)
                continue
            if dropped:
                logger.info("job %s: deleted its %d oldest events (keeping %d)", update.job_id, dropped, limit)

    def _count_write_failures(self, plan: Plan, outcome: PlanOutcome) -> None:
        """Consecutive refusals per job (the reconciler fails a job at ``write_failure_limit``)."""
        for update in plan.updates:
            message = outcome.failed.get(update.job_id)
            if message is None:
                self._write_failures.pop(update.job_id, None)
            else:
                before = self._write_failures.get(update.job_id)
                self._write_failures[update.job_id] = WriteFailure((before.count if before else 0) + 1, message[:500])

    def _run(self) -> None:
        interval = self._settings.reconcile_interval
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                revision = self.tick()
                if revision is None:
                    self._election.wait_for_change(min(interval * 2, self._settings.leader_ttl))
                else:
                    self._passed()
                    self._store.client.wait_for_event(self._store.keys.root + "/", revision + 1, interval, prefix=True)
            except EtcdError as exc:
                logger.warning("reconcile pass failed: %s", exc)
                self._failed(f"{type(exc).__name__}: {exc}")
                self._stop.wait(interval.total_seconds())
            except Exception as exc:
                logger.exception("reconcile pass crashed; retrying")
                self._failed(f"{type(exc).__name__}: {exc}")
                self._stop.wait(interval.total_seconds())
            spent = time.monotonic() - began
            if spent < _MIN_SPACING:
                self._stop.wait(_MIN_SPACING - spent)

    def start(self) -> None:
        if self._thread is not None:
            return
        if self._identities is None:
            logger.warning(SHARED_IDENTITY_WARNING)
        else:
            self._identities.check()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="etrain-reconcile", daemon=True)
        self._thread.start()

    def stop(self, resign: bool = True) -> None:
        """Stop the loop; with ``resign`` hand leadership over at once (revoke the lease)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._settings.reconcile_interval.total_seconds() * 3 + 5)
            self._thread = None
        try:  # the metric series' last reports, not yet written (batched): before leadership is handed over
            if self._cache_fence is not None:
                self._recorder.flush(self._cache_fence, force=True)
        except EtcdError as exc:
            logger.warning("could not write the jobs' metric series: %s", exc)
        self._drop_cache()
        if resign:
            try:
                self._election.resign()
            except EtcdError as exc:
                logger.warning("could not resign leadership: %s", exc)


def create_controller(store: ServiceStore, settings: Settings, metrics: Metrics | None = None) -> Controller:
    return Controller(store, settings, metrics)
