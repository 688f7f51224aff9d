"""Fuzzing fixtures: the controller's ASGI app on a real etcd (schema-driven API fuzzing, in three modes), and
a harness that runs the controller's passes and read endpoints on a real or in-memory etcd (the store fuzzer).

Case counts: every fuzz test adds to :data:`CASES`; the terminal summary prints them with the time each took.
``ETRAIN_FUZZ_EXAMPLES`` sets the examples per operation (API) or per key family (store) of the long forms,
marked ``slow`` (the CI runs ``-m "not slow"``: the short forms only).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient

from elastic.etcd import EtcdClient, create_client
from elastic.testing.etcd_server import LocalEtcdCluster
from service.api.app import create_app
from service.controller.loop import Controller
from service.core.config import EtcdOptions, Role, Settings, TokenEntry
from service.core.models import NodeInfo
from service.core.store import ServiceStore
from service.core.view import ReconcileConfig

ADMIN_TOKEN = "fuzz-admin-token-0123456789abcdef"
READ_TOKEN = "fuzz-read-token-0123456789abcdef"
TOKENS = (TokenEntry(ADMIN_TOKEN, Role.ADMIN, "fuzz"), TokenEntry(READ_TOKEN, Role.READ, "fuzz-reader"))

#: the examples of a long (``slow``) fuzz run: per API operation, per store key family
LONG_EXAMPLES = int(os.environ.get("ETRAIN_FUZZ_EXAMPLES", "0") or 0)

#: the API fuzzer's modes: authentication on (admin token), off (``tokens=None``), and on with the app's
#: reconcile loop running against two registered nodes, so the fuzzed jobs get scheduled and cancelled
API_MODES = ("auth", "noauth", "controller")
NODE_NAMES = ("n1", "n2")

CASES: Counter[str] = Counter()
_STARTED: dict[str, float] = {}
_SECONDS: Counter[str] = Counter()
NOTES: dict[str, str] = {}


def count_case(run: str) -> None:
    """One generated case of ``run`` (the summary shows cases and seconds per run)."""
    now = time.monotonic()
    _STARTED.setdefault(run, now)
    CASES[run] += 1
    _SECONDS[run] = now - _STARTED[run]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not CASES:
        return
    terminalreporter.section("fuzz cases")
    for run in sorted(CASES):
        note = f"  ({NOTES[run]})" if run in NOTES else ""
        terminalreporter.write_line(f"{run}: {CASES[run]} cases in {_SECONDS[run]:.1f} s{note}")


def register_nodes(store: ServiceStore, capacity: int) -> int:
    """Live node records (on a lease, as agents keep them) for the controller to schedule onto; the lease id."""
    lease = store.client.grant_lease(timedelta(seconds=3600))
    now = datetime.now(timezone.utc)
    for name in NODE_NAMES:
        store.register_node(NodeInfo(name=name, capacity=capacity, incarnation="fuzz", registered_at=now), lease)
    return lease


@dataclass
class ApiTarget:
    """What the API fuzz test needs to know about the app under test."""

    mode: str
    headers: dict[str, str]
    store: ServiceStore
    controller: Controller


@pytest.fixture(params=API_MODES)
def api_mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def api_target(api_mode: str, etcd_server: LocalEtcdCluster, key_prefix: str, tmp_path: Path) -> Iterator[Any]:
    """The app on a real etcd in ``api_mode``; yields (schema, target). With the controller, the app's
    lifespan (which schemathesis runs) starts the reconcile loop; at teardown every job the fuzzer cancelled
    must have been cancelled by that loop, and no pass may have crashed."""
    controller_on = api_mode == "controller"
    settings = Settings(
        etcd=EtcdOptions(etcd_server.endpoints),
        prefix=key_prefix,
        tokens=None if api_mode == "noauth" else TOKENS,
        checkpoint_root=f"file://{tmp_path / 'checkpoints'}",
        reconcile_interval=timedelta(seconds=0.1),
        run_controller=controller_on,  # off: the API only, no leader campaign, nothing scheduled
    )
    client = create_client(settings.etcd.config())
    app = create_app(settings, client=client)
    store: ServiceStore = app.state.store
    lease = register_nodes(store, capacity=1024) if controller_on else None
    headers = {} if api_mode == "noauth" else {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        yield (
            schemathesis.openapi.from_asgi("/openapi.json", app),
            ApiTarget(api_mode, headers, store, app.state.controller),
        )
        if controller_on:
            _check_controller_run(app, store, f"api[{api_mode}]")
    finally:
        app.state.controller.stop()
        if lease is not None:
            client.revoke_lease(lease)
        client.close()


def _check_controller_run(app: Any, store: ServiceStore, run: str) -> None:
    controller: Controller = app.state.controller
    running = controller._thread is not None
    deadline = time.monotonic() + 15
    while True:
        jobs = store.list_jobs()
        waiting = [e.record.id for e in jobs if e.cancel_requested and not e.status.state.terminal]
        if not waiting or time.monotonic() > deadline:
            break
        if not running:  # the lifespan ended first: one pass by hand
            controller.tick()
        time.sleep(0.1)
    scheduled = sum(1 for e in jobs if e.status.generation > 0)
    cancelled = sum(1 for e in jobs if e.status.state.value == "cancelled")
    NOTES[run] = f"{len(jobs)} jobs kept: {scheduled} were scheduled, {cancelled} cancelled by the controller"
    errors = app.state.metrics.registry.get_sample_value("etrain_reconcile_errors_total") or 0
    assert errors == 0, f"{errors} reconcile passes failed while the fuzzer ran (see the log)"
    assert not waiting, f"cancel requests the running controller did not apply within 15 s: {waiting}"


@pytest.fixture
def api_schema(api_target: tuple[Any, ApiTarget]) -> Any:
    return api_target[0]


@pytest.fixture
def api(api_target: tuple[Any, ApiTarget]) -> ApiTarget:
    return api_target[1]


# -- the store fuzzer's harness ----------------------------------------------------------------------------
class StoreHarness:
    """One controller (its passes run by hand) and the app's read endpoints over ``client``, with two live
    nodes; finished jobs are deleted on the next pass (retention 0), so every example starts small."""

    def __init__(self, client: EtcdClient, prefix: str, endpoints: str = "127.0.0.1:2379") -> None:
        self.settings = Settings(
            etcd=EtcdOptions(endpoints),
            prefix=prefix,
            tokens=TOKENS,
            reconcile=ReconcileConfig(terminal_retention=timedelta(0)),
            run_controller=False,  # passes by hand: tick()
        )
        self.app = create_app(self.settings, client=client)
        self.store: ServiceStore = self.app.state.store
        self.controller: Controller = self.app.state.controller
        self.http = TestClient(self.app, raise_server_exceptions=False)
        self.lease = register_nodes(self.store, capacity=8)

    def get(self, path: str, token: str = READ_TOKEN) -> Any:
        return self.http.get(path, headers={"Authorization": f"Bearer {token}"})

    def post(self, path: str, token: str = ADMIN_TOKEN) -> Any:
        return self.http.post(path, headers={"Authorization": f"Bearer {token}"})

    def close(self) -> None:
        self.controller.stop()
        self.http.close()
        self.store.client.revoke_lease(self.lease)


@pytest.fixture
def etcd_harness(etcd_server: LocalEtcdCluster, etcd_client: EtcdClient, key_prefix: str) -> Iterator[StoreHarness]:
    harness = StoreHarness(etcd_client, key_prefix, etcd_server.endpoints)
    yield harness
    harness.close()


@pytest.fixture
def memory_harness(key_prefix: str) -> Iterator[StoreHarness]:
    from elastic.etcd.memory import MemoryEtcdClient

    client = MemoryEtcdClient()
    harness = StoreHarness(client, key_prefix)
    yield harness
    harness.close()
    client.close()
