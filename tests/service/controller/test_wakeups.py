"""The reconcile loop wakes on the service's state, not on torchrun's rendezvous traffic (real etcd)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest

from elastic.etcd import EtcdClient
from elastic.testing.etcd_server import LocalEtcdCluster
from service.controller import loop
from service.controller.loop import Controller
from service.controller.metrics import create_metrics
from service.core.models import NodeControl, NodeMode
from service.core.store import ServiceStore
from service.core.view import ClusterView, Plan, ReconcileConfig
from tests.service.conftest import make_settings

pytestmark = pytest.mark.timeout(60)


def _passes(metrics: object) -> float:
    for family in metrics.registry.collect():  # type: ignore[attr-defined]
        for sample in family.samples:
            if sample.name == "etrain_reconcile_seconds_count":
                return float(sample.value)
    return 0.0


def _passes_while_writing(controller: Controller, metrics: object, client: EtcdClient, prefix: str) -> float:
    before = _passes(metrics)
    deadline = time.monotonic() + 3
    i = 0
    while time.monotonic() < deadline:
        client.put(f"{prefix}/k{i % 10}", b"beat")
        i += 1
        time.sleep(0.01)
    return _passes(metrics) - before


def test_rendezvous_heartbeats_do_not_wake_the_reconcile_loop_but_service_writes_do(
    etcd_server: LocalEtcdCluster, etcd_client: EtcdClient, key_prefix: str
) -> None:
    store = ServiceStore(etcd_client, key_prefix)
    metrics = create_metrics(store)
    settings = make_settings(etcd_server, key_prefix, reconcile_interval=timedelta(seconds=2))
    controller = Controller(store, settings, metrics)
    controller.start()
    try:
        deadline = time.monotonic() + 10
        while _passes(metrics) < 1:  # leading
            assert time.monotonic() < deadline
            time.sleep(0.05)
        rdzv = _passes_while_writing(controller, metrics, etcd_client, f"{store.keys.rdzv}/job-1-g1/rdzv")
        assert rdzv <= 3, f"{rdzv} passes in 3 s of rendezvous traffic (interval 2 s)"
        progress = _passes_while_writing(controller, metrics, etcd_client, store.keys.progress + "job-1")
        assert progress >= 6, f"only {progress} passes in 3 s of progress writes"
    finally:
        controller.stop()


def test_a_cordon_or_uncordon_wakes_a_pass_whose_view_holds_it(
    etcd_server: LocalEtcdCluster, etcd_client: EtcdClient, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node request (``<prefix>/nodectl/<name>``) is under the watched prefix: written, the leader passes at once
    (not at the 8 s interval), and its cached view (read incrementally) holds the request, then its removal."""
    store = ServiceStore(etcd_client, key_prefix)
    metrics = create_metrics(store)
    seen: list[dict[str, str]] = []

    def recording(view: ClusterView, now: datetime, config: ReconcileConfig) -> Plan:
        seen.append({name: c.mode.value for name, c in view.controls.items()})
        return Plan()

    monkeypatch.setattr(loop, "reconcile", recording)
    controller = Controller(
        store, make_settings(etcd_server, key_prefix, reconcile_interval=timedelta(seconds=8)), metrics
    )
    controller.start()
    try:
        deadline = time.monotonic() + 10
        while not seen:  # leading, first pass done
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert seen[-1] == {}
        store.set_node_control(NodeControl(name="n1", mode=NodeMode.DRAINING, at=datetime.now(timezone.utc)))
        deadline = time.monotonic() + 3
        while seen[-1] != {"n1": "draining"}:
            assert time.monotonic() < deadline, f"no pass saw the drain request: {seen}"
            time.sleep(0.05)
        store.clear_node_control("n1")
        deadline = time.monotonic() + 3
        while seen[-1] != {}:
            assert time.monotonic() < deadline, f"no pass saw the uncordon: {seen}"
            time.sleep(0.05)
    finally:
        controller.stop()
