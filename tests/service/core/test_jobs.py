"""service.core.jobs: the rules of submit, resize and checkpoint-prefix ownership, without a store (the store's
use of them, what it writes and its races, is test_store_node_ops's; the API's, tests/service/api's)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from service.core.jobs import (
    CheckpointOutsideRoot,
    InvalidResize,
    JobFinished,
    checkpoint_claims,
    checkpoint_prefix_conflict,
    new_job,
    plan_resize,
    resize_changes,
    resolve_checkpoint_url,
)
from service.core.models import JobRecord, JobSpec, JobStatus
from service.core.states import JobState
from service.core.view import JobEntry

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _spec(min_nodes: int = 1, max_nodes: int = 3, **kw: Any) -> JobSpec:
    return JobSpec(name="job", entrypoint="train.py", min_nodes=min_nodes, max_nodes=max_nodes, **kw)


def _entry(job_id: str, url: str | None, state: JobState = JobState.PENDING, generation: int = 0) -> JobEntry:
    record = JobRecord(id=job_id, spec=_spec(), created_at=T0, checkpoint_url=url)
    return JobEntry(record, JobStatus(state=state, generation=generation, created_at=T0, updated_at=T0), 1)


# -- checkpoint-prefix ownership -------------------------------------------------------------------------
def test_every_active_job_with_a_prefix_holds_it_from_its_submit() -> None:
    entries = [
        _entry("pending", "file:///ck/a"),
        _entry("running", "file:///ck/b", JobState.RUNNING, generation=1),
        _entry("done", "file:///ck/c", JobState.SUCCEEDED, generation=1),
        _entry("none", None),
    ]
    assert checkpoint_claims(entries) == {"pending": "file:///ck/a", "running": "file:///ck/b"}
    assert checkpoint_claims(entries, started_only=True) == {"running": "file:///ck/b"}


def test_a_new_prefix_conflicts_with_an_active_jobs_prefix_nested_either_way() -> None:
    entries = [_entry("j1", "file:///ck/j1"), _entry("old", "file:///ck/old", JobState.FAILED)]
    for url in ("file:///ck/j1", "file:///ck/j1/nested", "file:///ck", "/ck/j1/", "file:///ck//j1"):
        assert checkpoint_prefix_conflict(url, entries) == "j1", url
    assert checkpoint_prefix_conflict("file:///ck/j10", entries) is None
    assert checkpoint_prefix_conflict("file:///ck/old", entries) is None  # a finished job's prefix is free


# -- submit --------------------------------------------------------------------------------------------------
def test_the_checkpoint_url_defaults_below_the_root_and_must_lie_below_it() -> None:
    assert resolve_checkpoint_url(_spec(), None, "j-1") is None
    assert resolve_checkpoint_url(_spec(checkpoint_url="file:///x"), None, "j-1") == "file:///x"
    assert resolve_checkpoint_url(_spec(), "/ck/", "j-1") == "file:///ck/j-1"
    assert resolve_checkpoint_url(_spec(checkpoint_url="file:///ck/mine"), "/ck", "j-1") == "file:///ck/mine"
    with pytest.raises(CheckpointOutsideRoot, match="below the service's checkpoint root file:///ck") as info:
        resolve_checkpoint_url(_spec(checkpoint_url="file:///elsewhere/x"), "/ck", "j-1")
    assert info.value.url == "file:///elsewhere/x"


def test_a_new_job_is_pending_with_its_submitted_event_and_a_key_of_its_own() -> None:
    record, status, event = new_job(_spec(), "j-1", "file:///ck/j-1", "alice", T0)
    again, _, _ = new_job(_spec(), "j-1", "file:///ck/j-1", "alice", T0)
    assert (record.id, record.checkpoint_url, record.submitted_by, record.created_at) == (
        "j-1",
        "file:///ck/j-1",
        "alice",
        T0,
    )
    assert record.checkpoint_key and record.checkpoint_key != again.checkpoint_key
    assert status.state == JobState.PENDING and status.created_at == T0
    assert event.type == "submitted" and event.message == "submitted by alice"
    assert event.data == {"checkpoint_url": "file:///ck/j-1"}


# -- resize --------------------------------------------------------------------------------------------------
def _record(min_nodes: int = 1, max_nodes: int = 3, **kw: Any) -> JobRecord:
    return JobRecord(id="j-1", spec=_spec(min_nodes, max_nodes, **kw), created_at=T0)


def _status(state: JobState = JobState.RUNNING) -> JobStatus:
    return JobStatus(state=state, created_at=T0, updated_at=T0)


def test_a_resize_rewrites_the_spec_and_names_each_change_in_its_event() -> None:
    planned = plan_resize(_record(1, 3, env={"A": "1"}), _status(), 2, 2, requested_by="alice", now=T0)
    assert planned is not None
    record, event = planned
    spec = record.spec
    assert (spec.min_nodes, spec.max_nodes, spec.env, spec.name) == (2, 2, {"A": "1"}, "job")  # the rest kept
    assert event.type == "resize" and event.message == "min_nodes 1 -> 2, max_nodes 3 -> 2 (by alice)"
    assert event.data["min_nodes"] == {"old": 1, "new": 2} and event.data["max_nodes"] == {"old": 3, "new": 2}
    assert event.time == T0


def test_a_resize_of_one_bound_keeps_the_other_and_the_current_sizes_are_no_change() -> None:
    planned = plan_resize(_record(1, 3), _status(), None, 5, requested_by=None, now=T0)
    assert planned is not None
    assert (planned[0].spec.min_nodes, planned[0].spec.max_nodes) == (1, 5)
    assert planned[1].message == "max_nodes 3 -> 5"
    assert resize_changes(_spec(1, 3), 1, None) == {}
    assert plan_resize(_record(1, 3), _status(), 1, 3, requested_by="alice", now=T0) is None


@pytest.mark.parametrize(
    ("min_nodes", "max_nodes", "field"),
    [(4, None, "max_nodes"), (3, 2, "max_nodes"), (None, 61, "max_nodes"), (0, None, "min_nodes")],
    ids=["min-above-max", "max-below-min", "over-the-per-job-limit", "min-zero"],
)
def test_an_invalid_resize_names_the_field(min_nodes: int | None, max_nodes: int | None, field: str) -> None:
    with pytest.raises(InvalidResize) as info:
        plan_resize(_record(1, 3), _status(), min_nodes, max_nodes, requested_by=None, now=T0)
    assert field in [f for f, _ in info.value.problems], info.value.problems


@pytest.mark.parametrize("state", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
def test_a_finished_job_cannot_be_resized(state: JobState) -> None:
    with pytest.raises(JobFinished, match=f"already {state.value}"):
        plan_resize(_record(), _status(state), None, 2, requested_by=None, now=T0)
