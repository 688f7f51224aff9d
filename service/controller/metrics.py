"""Prometheus metrics of one controller replica, in a registry of its own (several apps per process in tests).

Request and reconcile metrics are counted as they happen; job and node figures are read from etcd at
scrape time by :class:`_ServiceStoreCollector`, so every replica reports the same cluster view.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from elastic.etcd import EtcdError
from service.core.states import JobState
from service.core.store import ServiceStore

logger = logging.getLogger(__name__)

__all__ = ["CONTENT_TYPE", "Metrics", "create_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _ServiceStoreCollector(Collector):
    def __init__(self, store: ServiceStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        try:
            jobs = self._store.list_jobs()
            nodes, _ = self._store.list_nodes()
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
        world = GaugeMetricFamily(
            "etrain_job_world_size", "World size last reported by an active job", labels=["job"]
        )
        step = GaugeMetricFamily("etrain_job_step", "Last reported step of an active job", labels=["job"])
        ckpt = GaugeMetricFamily(
            "etrain_job_checkpoint_step", "Latest committed checkpoint step", labels=["job"]
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
            for cause, n in st.restarts.model_dump().items():
                restarts.add_metric([job, cause], n)
        yield from (world, step, ckpt, restarts)


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
        self.reconcile_errors = Counter(
            "etrain_reconcile_errors", "Failed reconcile passes", registry=self.registry
        )
        self.refused_updates = Counter(
            "etrain_refused_updates", "Job updates refused by etcd (stale or fenced)", registry=self.registry
        )
        self.is_leader = Gauge("etrain_leader", "1 if this replica is the leader", registry=self.registry)
        self.jobs_submitted = Counter(
            "etrain_jobs_submitted", "Jobs accepted by this replica", registry=self.registry
        )

    def attach(self, store: ServiceStore) -> None:
        self.registry.register(_ServiceStoreCollector(store))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def create_metrics(store: ServiceStore | None = None) -> Metrics:
    metrics = Metrics()
    if store is not None:
        metrics.attach(store)
    return metrics
