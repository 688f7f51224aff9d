"""Prometheus metrics of one controller replica, in a registry of its own (several apps per process in tests).

Request and reconcile metrics are counted as they happen; job and node figures are read from etcd at
scrape time by :class:`_ServiceStoreCollector`, so every replica reports the same cluster view.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from elastic.etcd import EtcdError
from service.core.models import NODE_MODES, NodeControl, NodeInfo, node_mode
from service.core.states import JobState
from service.core.store import ServiceStore
from service.core.view import JobEntry
from service.core.view_cache import ViewCache

logger = logging.getLogger(__name__)

__all__ = ["CONTENT_TYPE", "SCHEDULER_ACTIONS", "Metrics", "create_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: the reconciler's event types counted by ``etrain_scheduler_actions_total{action}`` when the leader applies them
SCHEDULER_ACTIONS = ("shrunk", "preempted", "evacuated", "resized")


class _ServiceStoreCollector(Collector):
    """Jobs and nodes as etcd holds them at scrape time, read incrementally (the jobs, statuses, nodes and
    node requests that changed since the last scrape: :class:`ViewCache`), so a scrape costs the changes, not
    the history."""

    def __init__(self, store: ServiceStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._cache: ViewCache | None = None

    def _read(self) -> tuple[list[JobEntry], list[NodeInfo], dict[str, NodeControl]]:
        k = self._store.keys
        with self._lock:
            if self._cache is None:
                self._cache = ViewCache(
                    self._store.client, k, prefixes=[k.jobs, k.status, k.cancel, k.nodes, k.nodectl]
                )
            try:
                view = self._cache.read()
            except BaseException:
                self._cache.reset()
                raise
        jobs = sorted(view.jobs.values(), key=lambda e: (e.record.created_at, e.record.id))
        return jobs, list(view.nodes.values()), dict(view.controls)

    def close(self) -> None:
        with self._lock:
            if self._cache is not None:
                self._cache.close()
                self._cache = None

    def collect(self) -> Iterator[Metric]:
        try:
            jobs, nodes, controls = self._read()
        except EtcdError as exc:
            logger.warning("metrics: cannot read etcd: %s", exc)
            return
        by_state = GaugeMetricFamily("etrain_jobs", "Jobs by state", labels=["state"])
        counts = {s: 0 for s in JobState}
        for e in jobs:
            counts[e.status.state] += 1
        for state, n in counts.items():
            by_state.add_metric([state.value], n)
        yield by_state
        yield GaugeMetricFamily("etrain_nodes", "Live nodes (agents with a lease)", value=len(nodes))
        yield GaugeMetricFamily(
            "etrain_node_capacity", "Worker slots of live nodes", value=sum(n.capacity for n in nodes)
        )
        world = GaugeMetricFamily("etrain_job_world_size", "World size last reported by an active job", labels=["job"])
        step = GaugeMetricFamily("etrain_job_step", "Last reported step of an active job", labels=["job"])
        ckpt = GaugeMetricFamily("etrain_job_checkpoint_step", "Latest committed checkpoint step", labels=["job"])
        loss = GaugeMetricFamily("etrain_job_loss", "Latest loss reported by an active job", labels=["job"])
        rate = GaugeMetricFamily(
            "etrain_job_steps_per_second", "Steps per second between an active job's last two reports", labels=["job"]
        )
        restarts = GaugeMetricFamily(
            "etrain_job_restarts", "Restarts of an active job by cause", labels=["job", "cause"]
        )
        for e in jobs:
            if e.status.state.terminal:
                continue
            job, st = e.record.id, e.status
            if st.world_size is not None:
                world.add_metric([job], st.world_size)
            if st.step is not None:
                step.add_metric([job], st.step)
            if st.checkpoint is not None:
                ckpt.add_metric([job], st.checkpoint.step)
            if st.loss is not None:
                loss.add_metric([job], st.loss)
            if st.steps_per_s is not None:
                rate.add_metric([job], st.steps_per_s)
            for cause, n in st.restarts.model_dump().items():
                restarts.add_metric([job, cause], n)
        yield from (world, step, ckpt, loss, rate, restarts)
        active = [e for e in jobs if not e.status.state.terminal]
        yield GaugeMetricFamily(
            "etrain_queue_length",
            "Active jobs waiting for nodes (pending, or recovering without nodes)",
            value=sum(
                1
                for e in active
                if e.status.state == JobState.PENDING or (e.status.state == JobState.RECOVERING and not e.status.nodes)
            ),
        )
        held = GaugeMetricFamily("etrain_job_nodes", "Nodes held by an active job", labels=["job"])
        for e in active:
            held.add_metric([e.record.id], len(e.status.nodes))
        yield held
        busy = {node for e in active for node in e.status.nodes}
        modes = dict.fromkeys(NODE_MODES, 0)
        for info in nodes:
            modes[node_mode(controls.get(info.name), info.name in busy)] += 1
        by_mode = GaugeMetricFamily(
            "etrain_nodes_by_mode", "Live nodes by mode (drained: draining, no active job holds it)", labels=["mode"]
        )
        for mode, count in modes.items():
            by_mode.add_metric([mode], count)
        yield by_mode


class Metrics:
    """The metrics of one app; ``render()`` gives the Prometheus text format."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "etrain_http_requests", "API requests", ["method", "route", "status"], registry=self.registry
        )
        self.http_seconds = Histogram(
            "etrain_http_request_seconds", "API request latency", ["route"], registry=self.registry
        )
        self.reconcile_seconds = Histogram(
            "etrain_reconcile_seconds", "Duration of one reconcile pass", registry=self.registry
        )
        self.reconcile_errors = Counter("etrain_reconcile_errors", "Failed reconcile passes", registry=self.registry)
        self.refused_updates = Counter(
            "etrain_refused_updates", "Job updates refused by etcd (stale or fenced)", registry=self.registry
        )
        self.is_leader = Gauge("etrain_leader", "1 if this replica is the leader", registry=self.registry)
        self._collector: _ServiceStoreCollector | None = None
        self.jobs_submitted = Counter("etrain_jobs_submitted", "Jobs accepted by this replica", registry=self.registry)
        self.scheduler_actions = Counter(
            "etrain_scheduler_actions",
            "Scheduling actions the leader applied (this replica, while leading), by the reconciler's event type",
            ["action"],
            registry=self.registry,
        )
        for action in SCHEDULER_ACTIONS:
            self.scheduler_actions.labels(action)  # shown at 0 before the first one

    def attach(self, store: ServiceStore) -> None:
        self._collector = _ServiceStoreCollector(store)
        self.registry.register(self._collector)

    def close(self) -> None:
        """Stop the watches the job and node figures are kept with (they start again at the next scrape)."""
        if self._collector is not None:
            self._collector.close()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def create_metrics(store: ServiceStore | None = None) -> Metrics:
    metrics = Metrics()
    if store is not None:
        metrics.attach(store)
    return metrics
