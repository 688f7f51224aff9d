"""Garbage in etcd: arbitrary bytes and JSON written into every key family the service reads, for one "victim"
job, while a well-formed "bystander" job exists. After each write a controller pass must not raise, the read
endpoints must not answer 5xx, and the bystander must still be listed, scheduled, cancelled and deleted.

The short forms run on the real etcd (CI); the long forms (``-m slow``, ``ETRAIN_FUZZ_EXAMPLES`` examples per key
family, default 1000) on the in-memory etcd of the same contract (``elastic.etcd.memory``).
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic.contract.progress import Progress
from service.core.models import (
    Assignment,
    Event,
    JobRecord,
    JobSpec,
    JobStatus,
    NodeControl,
    NodeInfo,
    NodeMode,
    WorkerReport,
)
from service.core.states import JobState
from service.core.store import ServiceStore
from tests.fuzz.conftest import ADMIN_TOKEN, LONG_EXAMPLES, StoreHarness, count_case

VICTIM = "victim-0001"
VICTIM_NODE = "victim-node"
BYSTANDER = "@BYSTANDER@"  # replaced, in a drawn value, by the current bystander's id
FAMILIES = ("jobs", "status", "cancel", "events", "nodes", "assign", "reports", "progress", "rdzv", "nodectl")
T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)


def victim_key(store: ServiceStore, family: str) -> str:
    k = store.keys
    return {
        "jobs": k.job(VICTIM),
        "status": k.status_of(VICTIM),
        "cancel": k.cancel_of(VICTIM),
        "events": k.events_of(VICTIM) + "00000000000000001-zz0000",
        "nodes": k.node(VICTIM_NODE),
        "assign": k.assignment("n1", VICTIM),  # a live node: counted against its capacity
        "reports": k.report(VICTIM, "n1"),  # the victim runs on n1: its reports are looked at
        "progress": k.progress_of(VICTIM),
        "rdzv": f"{k.rdzv}/{VICTIM}.g1/rdzv/state",  # the etcd-v3 rendezvous' state key of the victim's round
        "nodectl": k.nodectl_of(VICTIM_NODE),  # an operator's request about a node (not the bystander's)
    }[family]


def _victim_spec() -> JobSpec:
    return JobSpec(name="victim", entrypoint="train.py", max_nodes=2)


def _records() -> dict[str, Any]:
    """Well-formed records of every family, as JSON values (a "one field wrong" draw starts from these)."""
    spec = _victim_spec()
    status = JobStatus(
        state=JobState.RUNNING,
        generation=1,
        nodes=["n1"],
        created_at=T0,
        updated_at=T0,
        started_at=T0,
        generation_started_at=T0,
    )
    event = Event(id="00000000000000001-zz0000", time=T0, type="note", message="hello", data={"a": 1})
    return {
        "jobs": JobRecord(id=VICTIM, spec=spec, created_at=T0, checkpoint_url="file:///ckpt/victim"),
        "status": status,
        "cancel": event,
        "events": event,
        "nodes": NodeInfo(name=VICTIM_NODE, capacity=4, incarnation="x", registered_at=T0),
        "assign": Assignment(job_id=VICTIM, generation=1, spec=spec, assigned_at=T0),
        "reports": WorkerReport(
            job_id=VICTIM, node="n1", generation=1, state="exited", exit_code=1, started_at=T0, finished_at=T0
        ),
        "progress": json.loads(
            Progress(
                step=5,
                world_size=1,
                time=T0.timestamp(),
                generation=1,
                nodes=["n1"],
                loss=0.5,
                checkpoint_step=4,
                checkpoint_path="/ckpt/victim/4",
            ).to_json()
        ),
        "rdzv": {"round": 1},
        "nodectl": NodeControl(name=VICTIM_NODE, mode=NodeMode.DRAINING, requested_by="op", at=T0, reason="r"),
    }


RECORDS = {f: (r.model_dump(mode="json") if hasattr(r, "model_dump") else r) for f, r in _records().items()}

# -- strategies -----------------------------------------------------------------------------------------------
HUGE = st.sampled_from([2**63, -(2**63) - 1, 10**30, -(10**30), 10**400, 1e308, -1e308, 5e-324, 2**64])
SPECIAL_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, -0.0])
TIMES = st.sampled_from(
    [
        "2025-01-01T00:00:00",  # no time zone
        "2025-01-01T00:00:00+14:00",
        "2025-01-01T00:00:00-12:00",
        "0001-01-01T00:00:00Z",
        "9999-12-31T23:59:59Z",
        "9999-12-31T23:59:59.999999+00:00",
        "0001-01-01T00:00:00",
        "9999-12-31T23:59:59",
        "1970-01-01",
        "not a time",
        "P1D",
        "PT-5S",
        "-1",
        "",
    ]
)
IDS = st.sampled_from([BYSTANDER, VICTIM, "n1", "n2", VICTIM_NODE, "", "../x", "a/b", "\x00", "é" * 3, "x" * 5000])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    HUGE,
    st.floats(allow_nan=True, allow_infinity=True),
    SPECIAL_FLOATS,
    st.text(max_size=20),
    TIMES,
    IDS,
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()  # NaN and Infinity as JavaScript spells them


def _nested(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


@st.composite
def one_field_wrong(draw: st.DrawFn, family: str) -> bytes:
    """A well-formed record of ``family`` with one field (possibly nested) replaced, removed or added."""
    record = json.loads(json.dumps(RECORDS[family]))
    target = record
    path = []
    while isinstance(target, dict) and target:
        key = draw(st.sampled_from(sorted(target)))
        path.append(key)
        if not isinstance(target[key], dict) or not target[key] or draw(st.booleans()):
            break
        target = target[key]
    if not isinstance(target, dict):
        return _dumps(draw(JSON_VALUES))
    key = path[-1] if path else draw(st.text(max_size=8))
    action = draw(st.sampled_from(["replace", "replace", "replace", "remove", "add"]))
    if action == "remove":
        target.pop(key, None)
    elif action == "add":
        target[draw(st.text(max_size=8))] = draw(JSON_VALUES)
    else:
        target[key] = draw(st.one_of(wrong_like(target.get(key)), JSON_VALUES, TIMES, IDS, HUGE, SPECIAL_FLOATS))
    return _dumps(record)


def wrong_like(value: Any) -> st.SearchStrategy[Any]:
    """Values wrong in the way a field of this kind is likely to be: a time without a zone or out of range, an
    integer beyond 64 bits, a non-finite float, an id of another job or node, a list or map of such."""
    if isinstance(value, bool):
        return st.sampled_from([None, 0, 1, 2, "true", "yes", []])
    if isinstance(value, int):
        return st.one_of(HUGE, st.integers(), SPECIAL_FLOATS, st.sampled_from([-1, 0, 1.5, "1", True]))
    if isinstance(value, float):
        return st.one_of(HUGE, SPECIAL_FLOATS, st.floats())
    if isinstance(value, str) and value[:2] in ("19", "20"):  # a time
        return st.one_of(TIMES, HUGE, SPECIAL_FLOATS)
    if isinstance(value, str):
        return st.one_of(IDS, st.text(max_size=30), st.sampled_from(["file://host/x", "s3://", "/a/../b", "/"]))
    if isinstance(value, list):
        return st.lists(st.one_of(IDS, TIMES, HUGE), max_size=4)
    if isinstance(value, dict):
        return st.dictionaries(IDS, st.one_of(TIMES, HUGE, SPECIAL_FLOATS, IDS), max_size=3)
    return st.one_of(TIMES, HUGE, IDS)


def garbage(family: str) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=200),
        st.binary(max_size=50).map(lambda b: b'{"step": "' + b + b'\xff\xfe"}'),  # invalid UTF-8 inside JSON
        st.binary(min_size=1, max_size=50).map(lambda b: b"\xc3\x28" + b),  # invalid UTF-8
        JSON_VALUES.map(_dumps),  # JSON of any (mostly wrong) type
        st.sampled_from(
            [
                b"",
                b" ",
                b"null",
                b"{}",
                b"[]",
                b"0",
                b'""',
                b"NaN",
                b"Infinity",
                b"-Infinity",
                b"1e999999",
                b"9" * 5000,
                b"{",
                b'{"a":1',
                b"\x00",
            ]
        ),
        st.builds(_nested, st.sampled_from([10, 200, 1000, 5000, 20000]), st.sampled_from(["list", "dict"])),
        one_field_wrong(family),
        one_field_wrong(family),
        one_field_wrong(family),
    )


# -- one example ----------------------------------------------------------------------------------------------
class Trial:
    """Resets the victim, adds a fresh bystander, writes the garbage, and checks passes and endpoints."""

    def __init__(self, harness: StoreHarness) -> None:
        self.h = harness
        self.store = harness.store
        self.n = 0

    def reset(self) -> None:
        """A well-formed victim running on n1 (generation 1), and nothing else of it."""
        k, client = self.store.keys, self.store.client
        records = _records()
        client.commit(
            deletes=[victim_key(self.store, fam) for fam in ("cancel", "nodes", "progress", "rdzv", "nodectl")],
            delete_prefixes=[k.events_of(VICTIM), k.reports],
        )
        client.commit(
            puts=[
                (k.job(VICTIM), records["jobs"].model_dump_json().encode()),
                (k.status_of(VICTIM), records["status"].model_dump_json().encode()),
                (k.assignment("n1", VICTIM), records["assign"].model_dump_json().encode()),
            ]
        )

    def run(self, family: str, value: bytes, run_name: str) -> None:
        count_case(run_name)
        h, store = self.h, self.store
        self.reset()
        self.n += 1
        bystander = f"bystander-{self.n:05d}"
        now = datetime.now(timezone.utc)
        record = JobRecord(id=bystander, spec=JobSpec(name="bystander", entrypoint="b.py"), created_at=now)
        store.create_job(record, JobStatus(created_at=now, updated_at=now), _event(now))
        key = victim_key(store, family)
        store.client.put(key, value.replace(BYSTANDER.encode(), bystander.encode()), lease=_lease_of(store, family))
        where = f"{family} {key} = {value[:300]!r}"

        # scheduled: the first pass starts the bystander on a live node; the next leaves it running there
        assert h.controller.tick() is not None, where
        self.read_endpoints(bystander, where)
        entry = store.get_job(bystander)
        assert entry is not None and entry.status.state == JobState.RUNNING, (where, entry)
        assert entry.status.generation == 1 and entry.status.nodes, (where, entry.status)
        for node in entry.status.nodes:
            assigned, _ = store.assignments(node)
            assert bystander in assigned and assigned[bystander].generation == 1, (where, node, assigned)
        assert h.controller.tick() is not None, where
        again = store.get_job(bystander)
        assert again is not None and again.status.state == JobState.RUNNING, (where, again)
        assert (again.status.generation, again.status.nodes) == (1, entry.status.nodes), (where, again.status)

        # cancelled: the API takes the request, the next pass applies it and releases the nodes
        response = h.post(f"/v1/jobs/{bystander}/cancel", ADMIN_TOKEN)
        assert response.status_code == 202, (where, response.status_code, response.text)
        assert h.controller.tick() is not None, where
        entry = store.get_job(bystander)
        assert entry is not None and entry.status.state == JobState.CANCELLED, (where, entry)
        response = h.get(f"/v1/jobs/{bystander}")
        assert response.status_code == 200 and response.json()["state"] == "cancelled", (where, response.text)
        assert not any(bystander in store.assignments(n)[0] for n in ("n1", "n2", VICTIM_NODE)), where

        # deleted: finished jobs are kept 0 s here, so the next pass deletes it with its events
        assert h.controller.tick() is not None, where
        assert store.get_job(bystander) is None, where
        assert store.events(bystander) == [], where

    def read_endpoints(self, bystander: str, where: str) -> None:
        h = self.h
        for path in (
            "/v1/jobs",
            f"/v1/jobs/{bystander}",
            f"/v1/jobs/{VICTIM}",
            f"/v1/jobs/{VICTIM}/events",
            "/v1/nodes",
            "/metrics",
            "/v1/jobs?limit=1",
            "/v1/jobs?after=0",
        ):
            response = h.get(path)
            assert response.status_code < 500, (where, path, response.status_code, response.text[:500])
        listed = [j["id"] for j in h.get("/v1/jobs").json()["jobs"]]
        assert listed.count(bystander) == 1, (where, listed)
        shown = h.get(f"/v1/jobs/{bystander}")
        assert shown.status_code == 200 and shown.json()["spec"]["name"] == "bystander", (where, shown.text)


def _event(now: datetime) -> Event:
    return Event(id=f"{int(now.timestamp() * 1e6):017d}-a000000", time=now, type="submitted", message="fuzz")


FUZZ_SETTINGS = {"deadline": None, "suppress_health_check": list(HealthCheck), "database": None}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES)
def test_garbage_in_a_victim_key_never_crashes_a_pass_or_an_endpoint_nor_stops_a_bystander(
    family: str, etcd_harness: StoreHarness
) -> None:
    """The short form, on the real etcd."""
    trial = Trial(etcd_harness)

    @settings(max_examples=20, **FUZZ_SETTINGS)
    @given(value=garbage(family))
    def check(value: bytes) -> None:
        trial.run(family, value, f"store[{family}]")

    check()


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("family", FAMILIES)
def test_long_run_garbage_in_a_victim_key_in_memory_etcd(family: str, memory_harness: StoreHarness) -> None:
    """The long form, on the in-memory etcd: ``ETRAIN_FUZZ_EXAMPLES`` (default 1000) examples per key family."""
    trial = Trial(memory_harness)

    @settings(max_examples=LONG_EXAMPLES or 1000, **FUZZ_SETTINGS)
    @given(value=garbage(family))
    def check(value: bytes) -> None:
        trial.run(family, value, f"store-long[{family}]")

    check()


def _lease_of(store: ServiceStore, family: str) -> int:
    """A node record is read only on a lease (as agents register): the fuzzed ones get one, so they are parsed."""
    return store.client.grant_lease(timedelta(seconds=300)) if family == "nodes" else 0


def test_the_victims_keys_are_the_ones_the_service_reads(etcd_harness: StoreHarness) -> None:
    """The fuzzer writes where the service looks: a well-formed value at each victim key is read back."""
    store = etcd_harness.store
    Trial(etcd_harness).reset()
    for family in ("events", "nodes", "reports", "progress", "cancel", "nodectl"):
        value = RECORDS[family]
        store.client.put(victim_key(store, family), _dumps(value), lease=_lease_of(store, family))
    view = store.read_view()
    assert VICTIM in view.jobs and view.jobs[VICTIM].cancel_requested
    assert VICTIM_NODE in view.nodes and VICTIM in view.assignments["n1"]
    assert "n1" in view.reports[VICTIM] and VICTIM in view.progress
    assert view.controls[VICTIM_NODE].mode == NodeMode.DRAINING
    assert [e.id for e in store.events(VICTIM)] == [RECORDS["events"]["id"]]
