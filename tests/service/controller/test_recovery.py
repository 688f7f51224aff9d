"""Restart budget, exponential backoff, crash-loop detection and node blacklist (pure rules)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from service.controller.recovery import backoff_delay, blacklisted_nodes, blame_nodes, judge_failure
from service.core.models import JobStatus, RestartPolicy

NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)


def _status(**kw: object) -> JobStatus:
    return JobStatus(created_at=NOW, updated_at=NOW, **kw)  # type: ignore[arg-type]


def test_backoff_doubles_from_initial_and_stops_at_the_cap() -> None:
    policy = RestartPolicy(backoff_initial=timedelta(seconds=1), backoff_max=timedelta(seconds=10))
    assert [backoff_delay(n, policy).total_seconds() for n in range(0, 7)] == [0, 1, 2, 4, 8, 10, 10]
    assert backoff_delay(500, policy) == timedelta(seconds=10)  # no overflow for huge counts


def test_blame_only_when_some_nodes_kept_running() -> None:
    assert blame_nodes({"a"}, ["b", "c"]) == ["a"]
    assert blame_nodes({"a", "b"}, []) == []  # everyone failed: the job is at fault, not a node
    assert blame_nodes(set(), ["a"]) == []


def test_failures_restart_with_backoff_until_the_budget_is_spent() -> None:
    policy = RestartPolicy(max_failures=2, crash_loop_threshold=100, backoff_initial=timedelta(seconds=1))
    st = _status(generation_progressed=True)
    first = judge_failure(st, policy, [], NOW)
    assert (first.give_up, first.delay, st.restarts.failure) == (False, timedelta(seconds=1), 1)
    second = judge_failure(st, policy, [], NOW)
    assert (second.give_up, second.delay) == (False, timedelta(seconds=2))
    third = judge_failure(st, policy, [], NOW)
    assert third.give_up and "restart budget exhausted: 3 failures (max_failures=2)" in third.reason


def test_zero_failure_budget_fails_on_first_failure() -> None:
    verdict = judge_failure(_status(generation_progressed=True), RestartPolicy(max_failures=0), [], NOW)
    assert verdict.give_up


def test_consecutive_failures_before_the_first_step_are_a_crash_loop() -> None:
    policy = RestartPolicy(max_failures=50, crash_loop_threshold=3)
    st = _status(generation_progressed=False)
    assert not judge_failure(st, policy, [], NOW).give_up
    assert not judge_failure(st, policy, [], NOW).give_up
    verdict = judge_failure(st, policy, [], NOW)
    assert verdict.give_up and verdict.reason.startswith("crash loop at start-up: 3 consecutive")


def test_a_generation_that_made_progress_resets_the_crash_loop_streak() -> None:
    policy = RestartPolicy(max_failures=50, crash_loop_threshold=2)
    st = _status(generation_progressed=False)
    judge_failure(st, policy, [], NOW)
    st.generation_progressed = True
    assert not judge_failure(st, policy, [], NOW).give_up
    assert st.startup_failures == 0


def test_node_blamed_repeatedly_is_blacklisted_until_cooldown_ends() -> None:
    policy = RestartPolicy(max_failures=50, blacklist_after=2, blacklist_cooldown=timedelta(minutes=5))
    st = _status(generation_progressed=True)
    assert judge_failure(st, policy, ["n1"], NOW).newly_blacklisted == ()
    assert st.node_failures == {"n1": 1}
    verdict = judge_failure(st, policy, ["n1"], NOW)
    assert verdict.newly_blacklisted == ("n1",)
    assert st.node_failures == {}
    assert blacklisted_nodes(st, NOW + timedelta(minutes=4)) == {"n1"}
    assert blacklisted_nodes(st, NOW + timedelta(minutes=5)) == set()
    judge_failure(st, policy, [], NOW + timedelta(minutes=6))
    assert st.blacklist == {}  # expired entries are forgotten
