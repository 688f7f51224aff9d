"""Progress reports (elastic/train/progress.py): what any job's rank 0 may write is parsed strictly, and reporting
never blocks the training loop, whatever etcd does.

The reader side: :meth:`Progress.from_json` returns a well-typed :class:`Progress` or raises
:class:`InvalidProgressError` for every input (property tests over arbitrary JSON and bytes). The writer side:
:class:`EtcdProgressReporter` hands each report to a background writer, so ``report()`` returns in microseconds
while a real etcd is stopped, and the latest report lands once it is back.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from elastic.contract.env import JobEnv, WorkerEnv
from elastic.contract.lr import LRPolicy, LRRule
from elastic.contract.progress import InvalidProgressError, Progress
from elastic.etcd import EtcdClient, MemoryEtcdClient, create_client
from elastic.etcd.config import EtcdOptions
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.wait import wait_for
from elastic.train.progress import EtcdProgressReporter, NullProgressReporter, create_reporter

KEY = "/etrain/progress/j-1"
FIELDS = (
    "step",
    "world_size",
    "time",
    "total_steps",
    "loss",
    "generation",
    "restart_count",
    "checkpoint_step",
    "checkpoint_path",
    "nodes",
    "extra",
)


# -- the reader: Progress.from_json ------------------------------------------------------------------------
def _assert_well_typed(p: Progress) -> None:
    """What the controller relies on: exact types, the ranges it converts (a timestamp), strings that encode."""

    def count(v: object, optional: bool = False, minimum: int = 0) -> None:
        if optional and v is None:
            return
        assert type(v) is int and minimum <= v < 2**63, v

    def text(v: object) -> None:
        assert type(v) is str
        v.encode("utf-8")  # no lone surrogates: pydantic and etcd must be able to write it back

    count(p.step)
    count(p.world_size, minimum=1)
    assert type(p.time) is float and math.isfinite(p.time)
    datetime.fromtimestamp(p.time, tz=timezone.utc)  # the controller's conversion
    count(p.total_steps, optional=True)
    assert p.loss is None or (type(p.loss) is float and math.isfinite(p.loss))
    count(p.generation, optional=True)
    count(p.restart_count)
    count(p.checkpoint_step, optional=True)
    if p.checkpoint_path is not None:
        text(p.checkpoint_path)
    if p.nodes is not None:
        assert type(p.nodes) is list
        for n in p.nodes:
            text(n)
    assert type(p.extra) is dict
    json.dumps(p.extra, allow_nan=False, ensure_ascii=False).encode("utf-8")
    assert Progress.from_json(p.to_json()) == p  # what was accepted is written back and read again unchanged


def _parse(raw: bytes) -> Progress | None:
    """``from_json``'s whole contract: a well-typed report or InvalidProgressError, nothing else."""
    try:
        p = Progress.from_json(raw)
    except InvalidProgressError as exc:
        assert isinstance(exc, ValueError) and str(exc)
        return None
    _assert_well_typed(p)
    return p


_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_plausible: dict[str, st.SearchStrategy[Any]] = {
    "step": st.integers(min_value=-3, max_value=10**6),
    "world_size": st.integers(min_value=-1, max_value=64),
    "time": st.floats(min_value=-10.0, max_value=3e11) | st.integers(min_value=0, max_value=2**40),
    "total_steps": st.none() | st.integers(min_value=-1, max_value=10**6),
    "loss": st.none() | st.floats() | st.integers(),
    "generation": st.none() | st.integers(min_value=-1, max_value=100),
    "restart_count": st.integers(min_value=-1, max_value=100),
    "checkpoint_step": st.none() | st.integers(min_value=-1, max_value=10**6),
    "checkpoint_path": st.none() | st.text(max_size=30) | st.just("x" * 100_000),
    "nodes": st.none() | st.lists(st.text(max_size=10), max_size=5),
    "extra": st.dictionaries(st.text(max_size=6), _json, max_size=4),
}
# each field either plausible (in or just out of range) or any JSON at all, plus unknown keys
_documents = st.fixed_dictionaries(
    {}, optional={name: strategy | _json for name, strategy in _plausible.items()}
).flatmap(lambda known: st.dictionaries(st.text(max_size=8), _json, max_size=3).map(lambda junk: {**junk, **known}))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_documents)
@example(doc={"step": 1, "world_size": 2, "time": "soon"})
@example(doc={"step": 1, "world_size": [1, 2], "time": 1.0})
@example(doc={"step": 1, "world_size": 1, "time": 1e300})
@example(doc={"step": 1, "world_size": 1, "time": 2**80})
@example(doc={"step": 1, "world_size": 1, "time": 1.0, "loss": 2**2000})
@example(doc={"step": True, "world_size": 1, "time": 1.0})
@example(doc={"step": 1, "world_size": 1, "time": 1.0, "nodes": ["\ud800"]})
def test_from_json_of_any_object_returns_a_well_typed_report_or_raises_invalid_progress(doc: dict[str, Any]) -> None:
    p = _parse(json.dumps(doc, allow_nan=True).encode("utf-8", "surrogatepass"))
    if p is not None:
        assert all(name in doc for name in ("step", "world_size", "time"))  # required fields are required


@settings(max_examples=500, deadline=None)
@given(doc=_json)
def test_from_json_of_any_json_value_returns_a_report_or_raises_invalid_progress(doc: Any) -> None:
    _parse(json.dumps(doc, allow_nan=True).encode("utf-8", "surrogatepass"))


@settings(max_examples=500, deadline=None)
@given(raw=st.binary(max_size=64))
@example(raw=b'{"step": 1, "world_size": 1, "time": 1.0, "checkpoint_path": "\xff\xfe"}')
@example(raw=b"\xff\xfe{\x00}\x00")  # UTF-16 with a BOM: json.loads would guess the encoding
@example(raw=b"")
def test_from_json_of_any_bytes_returns_a_report_or_raises_invalid_progress(raw: bytes) -> None:
    _parse(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"step": 1, "world_size": 2, "time": "soon"}',
        b'{"step": 1, "world_size": [1, 2], "time": 1.0}',
        b'{"step": 1, "world_size": 2, "time": NaN}',
        b'{"step": 1, "world_size": 2, "time": Infinity}',
        b'{"step": 1, "world_size": 2, "time": 1.0, "loss": -Infinity}',
        b'{"step": -1, "world_size": 2, "time": 1.0}',
        b'{"step": 1, "world_size": 0, "time": 1.0}',
        b'{"step": 1.5, "world_size": 2, "time": 1.0}',
        b'{"step": 1, "world_size": 2, "time": -5.0}',
        b'{"step": 1, "world_size": 2, "time": 1e300}',
        b'{"step": 1, "world_size": 2, "time": 1.0, "restart_count": null}',
        b'{"step": 1, "world_size": 2, "time": 1.0, "nodes": "n1"}',
        b'{"step": 1, "world_size": 2, "time": 1.0, "nodes": [1]}',
        b'{"step": 1, "world_size": 2, "time": 1.0, "extra": []}',
        b'{"step": 1, "world_size": 2, "time": 1.0, "checkpoint_path": "\\ud800"}',
        b'{"step": 1, "world_size": 2, "time": 1.0, "checkpoint_path": "' + b"x" * 100_000 + b'"}',
        b'{"step": 1, "world_size": 2, "time": 1.0, "extra": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
        b'{"step": 1, "world_size": 2, "time": 1.0, "extra": {"a": ' + b"[" * 200 + b"]" * 200 + b"}}",
        b'{"step": 1' + b"0" * 5000 + b', "world_size": 2, "time": 1.0}',
        b'{"world_size": 2, "time": 1.0}',
        b"[1, 2]",
        b'"progress"',
        b"null",
        b"{",
        b"",
        b'{"step": 1, "world_size": 2, "time": 1.0, "checkpoint_path": "\xff"}',
    ],
    ids=lambda raw: raw[:60].decode("utf-8", "replace"),
)
def test_from_json_rejects_each_malformed_value_with_invalid_progress(raw: bytes) -> None:
    with pytest.raises(InvalidProgressError):
        Progress.from_json(raw)


def test_from_json_reads_back_a_full_report_and_ignores_unknown_fields() -> None:
    p = Progress(
        step=7,
        world_size=4,
        time=1_700_000_000.5,
        total_steps=100,
        loss=0.25,
        generation=2,
        restart_count=1,
        checkpoint_step=5,
        checkpoint_path="file:///ck/j-1/step-5",
        nodes=["a", "b"],
        extra={"lr": 0.1, "epoch": 1},
    )
    assert Progress.from_json(p.to_json()) == p
    doc = json.loads(p.to_json())
    doc["written_by_a_newer_version"] = {"x": [1]}
    doc["time"] = 1_700_000_000  # a whole number of seconds is a time too
    assert Progress.from_json(json.dumps(doc).encode()) == Progress(**{**p.__dict__, "time": 1_700_000_000.0})


def test_a_report_with_a_non_finite_loss_is_written_as_valid_json_without_the_loss() -> None:
    p = Progress(step=1, world_size=1, time=1.0, loss=math.nan, extra={"lr": math.inf, "nested": [math.nan]})
    back = Progress.from_json(p.to_json())
    assert back.loss is None and back.extra == {"lr": None, "nested": [None]}


# -- the writer: EtcdProgressReporter ----------------------------------------------------------------------
def _reporter_env(etcd: LocalEtcdCluster | str) -> dict[str, str]:
    job = JobEnv(
        job_name="demo",
        generation=3,
        node_name="n1",
        progress_key=KEY,
        lr_policy=LRPolicy(LRRule.FIXED_GLOBAL_BATCH, 0.05, 2, 16),
        min_nodes=1,
        max_nodes=2,
    )
    endpoints = etcd.endpoints if isinstance(etcd, LocalEtcdCluster) else etcd
    return {**WorkerEnv(job=job, etcd=EtcdOptions(endpoints)).to_environ(), "RANK": "0"}


def _read(client: EtcdClient) -> Progress | None:
    kv, _ = client.get(KEY)
    return Progress.from_json(kv.value) if kv is not None else None


def _wait_for_step(client: EtcdClient, step: int, timeout: float) -> float:
    """Seconds until the key holds ``step``; fails after ``timeout``."""
    start = time.monotonic()
    while True:
        try:
            p = _read(client)
        except Exception:  # etcd may still be starting
            p = None
        if p is not None and p.step == step:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"step {step} not written within {timeout}s (last: {p})"
        time.sleep(0.02)


@pytest.fixture
def watcher(etcd_member: LocalEtcdCluster) -> Iterator[EtcdClient]:
    client = create_client(etcd_member.config(op_timeout=2))
    yield client
    client.close()


@pytest.mark.solo  # 100 reports within 50 ms: runs alone in a parallel scripts/test.sh
@pytest.mark.timeout(90)
def test_report_returns_at_once_while_etcd_is_stopped_and_the_latest_report_lands_when_it_is_back(
    etcd_member: LocalEtcdCluster, watcher: EtcdClient
) -> None:
    reporter = create_reporter(_reporter_env(etcd_member))  # the production client and timeouts
    assert isinstance(reporter, EtcdProgressReporter)
    try:
        reporter.report(0, world_size=2, force=True)
        _wait_for_step(watcher, 0, timeout=5)
        etcd_member.stop_member(0)
        started = time.perf_counter()
        for step in range(1, 101):  # forced: before the fix, each one waited for etcd (~5 s)
            reporter.report(step, world_size=2, loss=1.0 / step, force=step % 10 == 0)
        took = time.perf_counter() - started
        assert took < 0.05, f"100 reports took {took * 1000:.1f} ms while etcd was down"
        time.sleep(1.5)  # the writer meets the outage meanwhile (its put fails, it retries)
        etcd_member.start_member(0)
        etcd_member.wait_healthy(timedelta(seconds=30))
        latency = _wait_for_step(watcher, 100, timeout=3)
        logging.getLogger(__name__).info("latest report written %.2fs after etcd answered again", latency)
        assert _read(watcher) == Progress.from_json(_read_raw(watcher))
    finally:
        reporter.close()


def _read_raw(client: EtcdClient) -> bytes:
    kv, _ = client.get(KEY)
    assert kv is not None
    return kv.value


def test_close_writes_the_last_report_even_when_the_throttle_held_it(
    etcd_member: LocalEtcdCluster, watcher: EtcdClient
) -> None:
    reporter = create_reporter(_reporter_env(etcd_member), min_interval=timedelta(seconds=30))
    reporter.report(1, world_size=2, force=True)
    _wait_for_step(watcher, 1, timeout=5)
    reporter.report(2, world_size=2)  # throttled: within 30 s of the last write
    reporter.report(3, world_size=2, loss=0.5)  # the final report of a training loop, not forced
    started = time.monotonic()
    reporter.close()
    assert time.monotonic() - started < 2
    p = _read(watcher)
    assert p is not None and (p.step, p.loss, p.generation) == (3, 0.5, 3)
    reporter.close()  # a second close is harmless
    reporter.report(4, world_size=2)  # and so is a report after close: dropped
    time.sleep(0.1)
    assert _read(watcher) == p


@pytest.mark.solo  # a 0.9-1.5 s window: runs alone in a parallel scripts/test.sh
@pytest.mark.timeout(60)
def test_close_waits_a_bounded_time_while_etcd_is_stopped(etcd_member: LocalEtcdCluster) -> None:
    reporter = create_reporter(_reporter_env(etcd_member))
    assert isinstance(reporter, EtcdProgressReporter)
    etcd_member.stop_member(0)
    reporter.report(1, world_size=2, force=True)
    started = time.monotonic()
    reporter.close(timeout=timedelta(seconds=1))
    took = time.monotonic() - started
    assert 0.9 <= took < 1.5, took


def test_reports_within_the_interval_are_coalesced_into_one_write_of_the_latest() -> None:
    client = MemoryEtcdClient()
    reporter = EtcdProgressReporter(client, KEY, min_interval=timedelta(seconds=0.5))
    try:
        reporter.report(0, world_size=1)
        deadline = time.monotonic() + 2
        while _read(client) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        first_revision = client.get(KEY)[0].mod_revision  # type: ignore[union-attr]
        for step in range(1, 1001):
            reporter.report(step, world_size=1)
        time.sleep(0.2)
        assert client.get(KEY)[0].mod_revision == first_revision  # type: ignore[union-attr]  # throttled
        _wait_for_step(client, 1000, timeout=5)  # once the interval is over
        kv, _ = client.get(KEY)
        assert kv is not None and Progress.from_json(kv.value).step == 1000  # the latest, not the first after
        assert kv.mod_revision == first_revision + 1  # one write for 1000 reports
    finally:
        reporter.close()


def test_a_forced_report_is_written_without_waiting_for_the_interval() -> None:
    client = MemoryEtcdClient()
    reporter = EtcdProgressReporter(client, KEY, min_interval=timedelta(seconds=60))
    try:
        reporter.report(1, world_size=1, force=True)
        reporter.report(2, world_size=1, checkpoint_step=2, checkpoint_path="/ck/step-2")  # a commit forces
        _wait_for_step(client, 2, timeout=5)  # well within the interval (60 s)
        p = _read(client)
        assert p is not None and (p.step, p.checkpoint_step, p.checkpoint_path) == (2, 2, "/ck/step-2")
        reporter.report(3, world_size=1, force=True)  # the checkpoint is remembered
        _wait_for_step(client, 3, timeout=5)
        p = _read(client)
        assert p is not None and (p.step, p.checkpoint_step) == (3, 2)
    finally:
        reporter.close()


def test_a_report_etcd_would_not_take_back_is_dropped_by_the_writer_not_raised_into_training(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = MemoryEtcdClient()
    reporter = EtcdProgressReporter(client, KEY, min_interval=timedelta(0))
    try:
        reporter.report(1, world_size=1, unserializable=object())  # not JSON
        reporter.report(2, world_size=0)  # a report the controller would refuse
        wait_for(lambda: "progress report dropped" in caplog.text, timeout=5, interval=0.01, what="a drop")
        assert _read(client) is None
        reporter.report(3, world_size=1, force=True)
        _wait_for_step(client, 3, timeout=5)
        kv, _ = client.get(KEY)
        assert kv is not None and kv.version == 1  # its only write: neither bad report reached etcd
    finally:
        reporter.close()
    assert "progress report dropped" in caplog.text


def test_reporter_outside_the_service_does_nothing(tmp_path: Path) -> None:
    assert isinstance(create_reporter({}), NullProgressReporter)
    assert isinstance(create_reporter({**_reporter_env("127.0.0.1:1"), "RANK": "1"}), NullProgressReporter)
