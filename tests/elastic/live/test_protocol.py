"""Live recovery's pure decisions (:mod:`elastic.live.protocol`): who is in the next generation, when a
re-form or a founding commits, how a generation reads back from etcd, and how a new generation syncs."""

from __future__ import annotations

from datetime import timedelta

import pytest

from elastic.live.protocol import (
    CommitNow,
    Generation,
    LiveKeys,
    LiveProtocolError,
    MemberState,
    ReformReason,
    StepAttempt,
    SyncPlan,
    WaitUntil,
    found_decision,
    next_members,
    reform_decision,
    sync_plan,
    whole_groups,
)

pytestmark = pytest.mark.timeout(30)

GEN = Generation(4, ("c", "a", "d", "b"), ReformReason.FOUNDED)  # rank order is not id order
SETTLE = timedelta(seconds=0.25)
LAST_CALL = timedelta(seconds=1)


def s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


# -- next_members ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ready", "joining", "max_workers", "expected"),
    [
        pytest.param({"a", "b", "c", "d"}, (), 8, ("c", "a", "d", "b"), id="all-ready-keep-rank-order"),
        pytest.param({"b", "c"}, (), 8, ("c", "b"), id="survivors-in-old-rank-order-not-id-order"),
        pytest.param({"b", "a"}, ("z", "e", "f"), 8, ("a", "b", "e", "f", "z"), id="joiners-after-in-id-order"),
        pytest.param({"c", "a"}, ("d", "b", "e"), 8, ("c", "a", "e"), id="a-member-is-never-a-joiner"),
        pytest.param({"c", "a", "d"}, ("f", "e"), 4, ("c", "a", "d", "e"), id="capped-at-max-joiners-dropped"),
        pytest.param({"a", "b", "c", "d"}, ("e",), 2, ("c", "a"), id="capped-at-max-survivors-dropped"),
        pytest.param({"a", "x"}, ("e", "e"), 8, ("a", "e"), id="ready-non-member-ignored-joiner-deduplicated"),
    ],
)
@pytest.mark.timeout(10)
def test_next_members_keeps_survivors_rank_order_then_joiners_in_id_order_capped_at_max(
    ready: set[str], joining: tuple[str, ...], max_workers: int, expected: tuple[str, ...]
) -> None:
    assert next_members(GEN, ready, joining, max_workers) == expected


@pytest.mark.parametrize(
    ("ready", "joining", "max_workers", "expected"),
    [
        pytest.param({"a", "c"}, ("e",), 8, ("c", "a"), id="one-joiner-of-a-pair-waits-for-its-partner"),
        pytest.param({"a", "c"}, ("f", "e"), 8, ("c", "a", "e", "f"), id="a-whole-pair-is-admitted"),
        pytest.param({"a", "c"}, ("g", "f", "e"), 8, ("c", "a", "e", "f"), id="the-odd-joiner-waits"),
        pytest.param({"a", "c", "d"}, ("e",), 8, ("c", "a", "d", "e"), id="a-joiner-completes-a-broken-pair"),
        pytest.param({"a", "c", "d"}, (), 8, ("c", "a", "d"), id="survivors-are-never-dropped-to-round-down"),
        pytest.param({"a", "c"}, ("f", "e"), 3, ("c", "a"), id="max-would-split-a-pair"),
    ],
)
@pytest.mark.timeout(10)
def test_next_members_with_a_granularity_admits_joiners_only_in_whole_groups(
    ready: set[str], joining: tuple[str, ...], max_workers: int, expected: tuple[str, ...]
) -> None:
    assert next_members(GEN, ready, joining, max_workers, granularity=2) == expected


@pytest.mark.timeout(10)
def test_whole_groups_rounds_down_but_never_below_at_least_and_refuses_granularity_zero() -> None:
    assert [whole_groups(n, 2) for n in range(6)] == [0, 0, 2, 2, 4, 4]
    assert whole_groups(3, 2, at_least=3) == 3 and whole_groups(5, 4, at_least=2) == 4
    with pytest.raises(ValueError, match="granularity"):
        whole_groups(4, 0)


@pytest.mark.timeout(10)
def test_found_decision_with_a_granularity_founds_whole_groups_only() -> None:
    assert found_decision(["a", "b", "c"], 2, 4, s(2), LAST_CALL, granularity=2) == CommitNow(("a", "b"))
    assert found_decision(["a", "b", "c", "d"], 2, 4, s(0), LAST_CALL, granularity=2) == CommitNow(("a", "b", "c", "d"))
    assert found_decision(["a"], 1, 4, s(2), LAST_CALL, granularity=2) is None  # no whole group yet


# -- reform_decision ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ready", "alive", "since", "joining", "expected"),
    [
        pytest.param(
            {"a", "b", "c", "d"},
            {"a", "b", "c", "d"},
            0.0,
            (),
            CommitNow(("c", "a", "d", "b")),
            id="every-member-ready",
        ),
        pytest.param(
            {"a", "b", "c"},
            {"a", "b", "c"},
            0.0,
            (),
            CommitNow(("c", "a", "b")),
            id="the-missing-member-is-not-alive-commit-at-once",
        ),
        pytest.param(
            {"a", "c"},
            {"a", "c", "x"},
            0.0,
            ("x",),
            CommitNow(("c", "a", "x")),
            id="every-alive-member-ready-with-a-joiner",
        ),
        pytest.param(
            {"a", "b", "c"}, {"a", "b", "c", "d"}, 0.1, (), WaitUntil(s(0.15)), id="alive-not-ready-waits-out-settle"
        ),
        pytest.param(
            {"a", "b", "c"},
            {"a", "b", "c", "d"},
            0.25,
            (),
            CommitNow(("c", "a", "b")),
            id="alive-not-ready-left-behind-at-settle",
        ),
        pytest.param(
            {"a", "b", "c"},
            {"a", "b", "c", "d"},
            7.0,
            ("e",),
            CommitNow(("c", "a", "b", "e")),
            id="alive-not-ready-left-behind-after-settle-joiner-admitted",
        ),
        pytest.param(set(), {"a", "b", "c", "d"}, 0.0, (), WaitUntil(SETTLE), id="nobody-ready"),
        pytest.param(set(), set(), 100.0, ("e",), WaitUntil(SETTLE), id="nobody-ready-nobody-alive-long-after"),
        pytest.param({"e", "x"}, {"e", "x"}, 100.0, ("e",), WaitUntil(SETTLE), id="only-non-members-ready"),
    ],
)
@pytest.mark.timeout(10)
def test_reform_decision_commits_when_every_alive_member_is_ready_or_settle_passed_and_never_without_a_ready_one(
    ready: set[str], alive: set[str], since: float, joining: tuple[str, ...], expected: CommitNow | WaitUntil
) -> None:
    assert reform_decision(GEN, ready, alive, s(since), SETTLE, 8, joining) == expected


@pytest.mark.timeout(10)
def test_reform_decision_caps_the_committed_members_at_max_workers() -> None:
    everyone = {"a", "b", "c", "d", "e"}
    assert reform_decision(GEN, everyone, everyone, s(0), SETTLE, 4, ("e",)) == CommitNow(("c", "a", "d", "b"))


@pytest.mark.timeout(10)
def test_reform_decision_below_min_workers_waits_for_joiners_instead_of_committing() -> None:
    everyone = {"a", "b", "c", "d"}
    assert reform_decision(GEN, {"c", "a"}, {"c", "a"}, s(10), SETTLE, 8, (), min_workers=3) == WaitUntil(SETTLE)
    assert reform_decision(GEN, {"c", "a"}, everyone, s(10), SETTLE, 8, ("e",), min_workers=3) == CommitNow(
        ("c", "a", "e")
    )


# -- found_decision ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("registered", "since", "expected"),
    [
        pytest.param(["d", "b", "c", "a"], None, CommitNow(("a", "b", "c", "d")), id="max-reached-now-id-order"),
        pytest.param(["e", "d", "b", "c", "a"], None, CommitNow(("a", "b", "c", "d")), id="over-max-first-max-by-id"),
        pytest.param(["c", "a"], 1.0, CommitNow(("a", "c")), id="min-reached-at-last-call"),
        pytest.param(["c", "a", "b"], 5.0, CommitNow(("a", "b", "c")), id="min-reached-after-last-call"),
        pytest.param(["c", "a"], 0.4, WaitUntil(s(0.6)), id="min-reached-before-last-call-waits"),
        pytest.param(["c", "a"], None, None, id="min-reached-clock-not-started"),
        pytest.param(["a"], 100.0, None, id="below-min"),
        pytest.param([], None, None, id="nobody"),
    ],
)
@pytest.mark.timeout(10)
def test_found_decision_now_at_max_after_last_call_at_min_none_below_min(
    registered: list[str], since: float | None, expected: CommitNow | WaitUntil | None
) -> None:
    assert found_decision(registered, 2, 4, None if since is None else s(since), LAST_CALL) == expected


# -- Generation --------------------------------------------------------------------------------------
@pytest.mark.parametrize("reason", list(ReformReason))
@pytest.mark.timeout(10)
def test_a_generation_round_trips_through_json(reason: ReformReason) -> None:
    gen = Generation(17, ("w-2", "w-0", "w-1"), reason)
    back = Generation.from_json(gen.to_json())
    assert back == gen
    assert back.rank("w-0") == 1 and back.rank("w-9") is None


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"not json", id="not-json"),
        pytest.param(b"\xff\xfe", id="not-utf8"),
        pytest.param(b"", id="empty-value"),
        pytest.param(b"null", id="json-null"),
        pytest.param(b"[1, 2]", id="json-list"),
        pytest.param(b'"gen"', id="json-string"),
        pytest.param(b'{"number": 1, "members": [], "reason": "founded"}', id="empty-members"),
        pytest.param(b'{"number": 0, "members": ["a"], "reason": "founded"}', id="number-0"),
        pytest.param(b'{"number": -3, "members": ["a"], "reason": "founded"}', id="number-negative"),
        pytest.param(b'{"number": "1", "members": ["a"], "reason": "founded"}', id="number-a-string"),
        pytest.param(b'{"number": 1.0, "members": ["a"], "reason": "founded"}', id="number-a-float"),
        pytest.param(b'{"number": true, "members": ["a"], "reason": "founded"}', id="number-a-bool"),
        pytest.param(b'{"number": 1, "members": "ab", "reason": "founded"}', id="members-a-string"),
        pytest.param(b'{"number": 1, "members": [1, 2], "reason": "founded"}', id="members-not-strings"),
        pytest.param(b'{"number": 1, "members": {"a": 0}, "reason": "founded"}', id="members-a-dict"),
        pytest.param(b'{"number": 1, "members": ["a"], "reason": "exploded"}', id="unknown-reason"),
        pytest.param(b'{"number": 1, "members": ["a"], "reason": 3}', id="reason-a-number"),
        pytest.param(b'{"number": 1, "members": ["a"]}', id="no-reason"),
        pytest.param(b'{"members": ["a"], "reason": "founded"}', id="no-number"),
        pytest.param(b'{"number": 1, "reason": "founded"}', id="no-members"),
    ],
)
@pytest.mark.timeout(10)
def test_a_corrupt_generation_value_raises_live_protocol_error(raw: bytes) -> None:
    with pytest.raises(LiveProtocolError, match="not a live generation"):
        Generation.from_json(raw)


@pytest.mark.timeout(10)
def test_live_keys_lay_out_the_prefix_and_refuse_a_base_without_a_trailing_slash() -> None:
    keys = LiveKeys("/p/run/live/")
    assert keys.worker("w") == "/p/run/live/m/workers/w"
    assert keys.joiner("w") == "/p/run/live/m/join/w"
    assert keys.gen == "/p/run/live/m/gen"
    assert keys.ready_key(3, "w") == "/p/run/live/m/ready/3/w"
    assert keys.gen_store(3) == "/p/run/live/store/3/"
    assert keys.done == "/p/run/live/m/done"
    # no prefix is a prefix of another generation's: ready/1/ does not cover ready/10/
    assert not keys.ready_key(10, "w").startswith(keys.ready(1))
    assert not keys.gen_store(10).startswith(keys.gen_store(1))
    with pytest.raises(ValueError, match="must end with '/'"):
        LiveKeys("/p/run/live")


# -- sync_plan ---------------------------------------------------------------------------------------
def member(
    step: int, attempt: StepAttempt | None = None, recorded: int | None = None, recorded_rank: int | None = None
) -> MemberState:
    return MemberState("w", step, attempt, recorded if recorded is not None else max(step, 0), recorded_rank)


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        pytest.param([member(5), member(5), member(5)], SyncPlan(0, 5, False), id="all-equal-no-broadcast"),
        pytest.param([member(-1), member(5), member(5)], SyncPlan(1, 5, True), id="joiner-first-source-is-next"),
        pytest.param([member(5), member(-1)], SyncPlan(0, 5, True), id="joiner-last"),
        pytest.param([member(4), member(5), member(5)], SyncPlan(1, 5, True), id="first-at-max-step-is-source"),
        pytest.param(
            # a applied step 7 (its all-reduce completed) before the others died: step 7 wins
            [member(6), member(7, StepAttempt(7, 2, 3, True), recorded=6), member(6)],
            SyncPlan(1, 7, True, late=(1,), orphans=(0, 1)),
            id="a-lone-applied-step-wins-and-records-late",
        ),
        pytest.param(
            # old world 3: ranks 0 and 1 survive, rank 2 died; old rank 0 applied step 7, old rank 1 did not
            [member(7, StepAttempt(7, 0, 3, True), recorded=6), member(6, StepAttempt(7, 1, 3, False))],
            SyncPlan(0, 7, True, late=(0, 1), orphans=(2,)),
            id="one-step-behind-records-late-dead-rank-orphan",
        ),
        pytest.param(
            # the applied member had already recorded step 7: it covers its old rank, the other is late
            [member(7, StepAttempt(7, 0, 4, True), recorded=7), member(6, StepAttempt(7, 2, 4, False))],
            SyncPlan(0, 7, True, late=(1,), orphans=(1, 3)),
            id="recorded-member-covers-its-rank-not-late",
        ),
        pytest.param(
            # old world 3: old rank 0's boundary all-reduce of step 7 completed (it recorded step 7 as rank 0 and
            # began step 8) while old rank 1's failed when old rank 2 died: only the dead rank is an orphan
            [
                member(7, StepAttempt(8, 0, 3, False), recorded=7, recorded_rank=0),
                member(7, StepAttempt(7, 1, 3, True), recorded=6),
            ],
            SyncPlan(0, 7, False, late=(1,), orphans=(2,)),
            id="recorded-and-began-next-step-is-no-orphan",
        ),
        pytest.param(
            # the same, its next step not begun yet (it failed in a collective after its record)
            [member(7, recorded=7, recorded_rank=0), member(7, StepAttempt(7, 1, 3, True), recorded=6)],
            SyncPlan(0, 7, False, late=(1,), orphans=(2,)),
            id="recorded-without-attempt-is-no-orphan",
        ),
        pytest.param(
            # everyone recorded step 7: nothing commits late, so nobody records an orphan either
            [member(7, StepAttempt(7, 0, 3, True), recorded=7), member(7, StepAttempt(7, 1, 3, True), recorded=7)],
            SyncPlan(0, 7, False),
            id="all-recorded-no-late-no-orphans",
        ),
        pytest.param(
            # every member was working on step 6 and none applied it: those attempts are dropped, not late
            [member(5, StepAttempt(6, 0, 2, False)), member(5, StepAttempt(6, 1, 2, False))],
            SyncPlan(0, 5, False),
            id="attempts-of-next-step-dropped",
        ),
        pytest.param(
            [member(-1), member(5, StepAttempt(6, 0, 2, False)), member(4, StepAttempt(5, 1, 2, False))],
            SyncPlan(1, 5, True, late=(2,), orphans=(0,)),
            id="mixed-next-step-dropped-behind-one-late",
        ),
    ],
)
@pytest.mark.timeout(10)
def test_sync_plan_continues_from_the_newest_applied_step_and_records_late_steps(
    states: list[MemberState], expected: SyncPlan
) -> None:
    plan = sync_plan(states)
    assert plan == expected
    assert [plan.records_late(r) for r in range(len(states))] == [r in expected.late for r in range(len(states))]


@pytest.mark.parametrize(
    "states",
    [
        pytest.param([member(-1)], id="one-joiner"),
        pytest.param([member(-1)] * 3, id="all-joiners"),
        pytest.param([], id="no-members"),
    ],
)
@pytest.mark.timeout(10)
def test_sync_plan_refuses_a_generation_without_any_state(states: list[MemberState]) -> None:
    with pytest.raises(ValueError, match="generation"):
        sync_plan(states)
