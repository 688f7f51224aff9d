"""The pure snapshot schedule of the elastic loop (elastic/train/schedule.py): inputs -> decision.

Each boundary is fed as the loop feeds it (the flags every rank agreed on); after a ``take`` the test calls
``started`` as the loop's ``save`` does. Times are plain numbers (the loop passes ``time.monotonic()``).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import pytest

from elastic.contract.lr import LRPolicy, LRRule
from elastic.contract.progress import Progress
from elastic.train.schedule import STUCK_AFTER, Boundary, SnapshotDecision, SnapshotSchedule
from elastic.train.trainer import ElasticConfig, WriterBusy

STEP_S = 0.1  # simulated seconds per step


def _walk(
    schedule: SnapshotSchedule,
    steps: range,
    busy: Callable[[int], bool] | None = None,
    *,
    epoch_end: int | None = None,
    save_steps: int = 0,
) -> tuple[SnapshotSchedule, list[int], list[SnapshotDecision]]:
    """Run boundaries ``steps`` with the writer ``busy`` at the steps it names, or else for ``save_steps``
    boundaries after each snapshot taken; returns the schedule after them, the steps taken and each decision."""
    taken: list[int] = []
    decisions: list[SnapshotDecision] = []
    for step in steps:
        now = step * STEP_S
        writer_busy = busy(step) if busy is not None else any(t < step <= t + save_steps for t in taken)
        b = Boundary(step, now, step == epoch_end, time_due=schedule.time_due(now), writer_busy=writer_busy)
        schedule, d = schedule.decide(b)
        decisions.append(d)
        if d.take:
            taken.append(step)
            schedule = schedule.started(step, now, background=True)
    return schedule, taken, decisions


def test_snapshots_fall_due_at_multiples_of_every_steps_when_the_writer_is_free() -> None:
    schedule, taken, _ = _walk(SnapshotSchedule(every_steps=5), range(1, 21), busy=lambda _: False)
    assert taken == [5, 10, 15, 20]
    assert schedule.stats.saved == 4 and schedule.stats.deferred == schedule.stats.skipped == 0


def test_a_snapshot_due_while_the_writer_is_busy_is_deferred_not_taken() -> None:
    schedule, d = SnapshotSchedule(every_steps=5).decide(Boundary(5, 0.5, writer_busy=True))
    assert d == SnapshotDecision(deferred=True)
    assert schedule.stats.deferred == 1 and schedule.stats.pending_since == 5 and schedule.stats.saved == 0


def test_the_deferred_snapshot_is_taken_at_the_first_boundary_with_the_writer_free() -> None:
    _, taken, decisions = _walk(SnapshotSchedule(every_steps=5), range(1, 11), busy=lambda s: 5 <= s <= 7)
    assert taken == [8, 10]  # 5 was due, the writer was busy until step 7's boundary: taken at 8, newer state
    assert decisions[4].deferred and not decisions[5].take and not decisions[6].take


def test_the_schedule_keeps_fixed_multiples_after_a_deferral() -> None:
    schedule, taken, _ = _walk(SnapshotSchedule(every_steps=5), range(1, 21), busy=lambda s: s == 5)
    assert taken == [6, 10, 15, 20]  # not 11, 16, 21: the deferred snapshot does not shift the schedule
    assert schedule.stats.deferred == 1 and schedule.stats.skipped == 0 and schedule.stats.pending_since is None


def test_a_snapshot_due_while_one_is_pending_supersedes_it_and_counts_as_skipped() -> None:
    schedule, taken, decisions = _walk(SnapshotSchedule(every_steps=5), range(1, 17), busy=lambda s: 5 <= s <= 15)
    assert taken == [16]  # one snapshot for the ones due at 5, 10 and 15
    assert [d.skipped for d in decisions[9:15:5]] == [True, True]
    assert schedule.stats.deferred == 1 and schedule.stats.skipped == 2 and schedule.stats.saved == 1


def test_a_due_snapshot_meeting_a_pending_one_as_the_writer_frees_is_one_snapshot() -> None:
    schedule, taken, decisions = _walk(SnapshotSchedule(every_steps=5), range(1, 11), busy=lambda s: 5 <= s <= 9)
    assert taken == [10] and decisions[9] == SnapshotDecision(take=True, skipped=True)
    assert (schedule.stats.deferred, schedule.stats.skipped, schedule.stats.saved) == (1, 1, 1)


def test_every_due_snapshot_is_taken_or_skipped_whatever_the_writer_does() -> None:
    for seed in range(50):
        rng = random.Random(seed)
        busy = {s for s in range(1, 200) if rng.random() < 0.6}
        schedule, taken, _ = _walk(SnapshotSchedule(every_steps=rng.randint(1, 7)), range(1, 200), busy.__contains__)
        assert all(s not in busy for s in taken), seed
        due = sum(1 for s in range(1, 200) if s % (schedule.every_steps or 1) == 0)
        pending = int(schedule.stats.pending_since is not None)
        assert schedule.stats.saved + schedule.stats.skipped + pending == due, seed
        assert schedule.stats.deferred <= schedule.stats.saved + pending, seed


def test_time_based_snapshots_count_from_the_last_one_taken() -> None:
    schedule = SnapshotSchedule(every_steps=None, every=timedelta(seconds=1), clock=0.0)
    assert not schedule.time_due(0.9) and schedule.time_due(1.0)
    schedule, taken, _ = _walk(schedule, range(1, 31), busy=lambda _: False)
    assert taken == [10, 20, 30]


def test_a_deferred_time_based_snapshot_is_not_skipped_again_at_every_step() -> None:
    schedule = SnapshotSchedule(every_steps=None, every=timedelta(seconds=1), clock=0.0)
    schedule, taken, decisions = _walk(schedule, range(1, 26), busy=lambda s: 10 <= s <= 24)
    assert taken == [25]
    assert schedule.stats.deferred == 1 and schedule.stats.skipped == 1  # due again 1 s after the deferral (20)
    assert [i + 1 for i, d in enumerate(decisions) if d.skipped] == [20]


def test_an_epoch_end_is_due_and_deferred_like_any_snapshot() -> None:
    _, taken, _ = _walk(SnapshotSchedule(every_steps=None), range(1, 10), lambda _: False, epoch_end=7)
    assert taken == [7]
    schedule, taken, _ = _walk(SnapshotSchedule(every_steps=None), range(1, 10), lambda s: s <= 8, epoch_end=7)
    assert taken == [9] and schedule.stats.deferred == 1


def test_wait_mode_takes_every_due_snapshot_at_once_even_with_the_writer_busy() -> None:
    schedule = SnapshotSchedule(every_steps=5, when_busy=WriterBusy.WAIT)
    schedule, taken, decisions = _walk(schedule, range(1, 21), busy=lambda _: True)
    assert taken == [5, 10, 15, 20]
    assert schedule.stats.deferred == schedule.stats.skipped == 0
    assert all(d.warning is None for d in decisions)


def test_a_started_save_satisfies_a_pending_snapshot() -> None:
    schedule, _ = SnapshotSchedule(every_steps=5).decide(Boundary(5, 0.5, writer_busy=True))
    schedule = schedule.started(6, 0.6, background=False)  # a final (SIGTERM) or hand-made save
    assert schedule.stats.pending_since is None and schedule.stats.saved == 1 and schedule.writing is None


def test_a_save_is_measured_from_its_start_to_the_first_boundary_with_the_writer_free() -> None:
    schedule, _, _ = _walk(SnapshotSchedule(every_steps=5), range(1, 12), save_steps=3)
    assert schedule.stats.last_save_steps == 4  # saved at 10, busy at 11 (the walk ends there): 5 -> 9 measured
    assert schedule.stats.last_save_seconds == timedelta(seconds=4 * STEP_S)


def test_the_rate_warning_is_given_once_with_what_the_storage_sustains() -> None:
    schedule, taken, decisions = _walk(SnapshotSchedule(every_steps=5), range(1, 200), save_steps=24)
    warnings = [(i + 1, d.warning) for i, d in enumerate(decisions) if d.warning]
    assert len(warnings) == 1, warnings
    step, text = warnings[0]
    assert step == 30  # the save started at 5 was seen finished at 30, after the one due at 10 was deferred
    assert text == (
        "snapshots fall due every 5 steps (0.5 s) but a save takes 2.5 s (~25 steps): taking one every ~25 steps;"
        " set save_every_steps >= 25 or use faster storage"
    )
    assert taken[:3] == [5, 30, 55] and schedule.warned


def test_a_writer_stuck_on_one_save_is_reported_once_while_the_loop_goes_on() -> None:
    schedule, taken, decisions = _walk(SnapshotSchedule(every_steps=5), range(1, 400), save_steps=100)
    assert schedule.warned and schedule.warned_stuck
    warnings = [(i + 1, d.warning) for i, d in enumerate(decisions) if d.warning]
    assert [step for step, _ in warnings] == [5 + 5 * STUCK_AFTER, 106]  # stuck (once), then the rate
    assert warnings[0][1] == (
        "the checkpoint writer has been saving step 5 for 5 s and 10 snapshots fell due meanwhile (none taken"
        " since): storage slow or unreachable?"
    )
    assert "a save takes 10.1 s (~101 steps)" in str(warnings[1][1])
    assert taken[:3] == [5, 106, 207]


def test_no_rate_warning_while_saves_keep_up() -> None:
    _, taken, decisions = _walk(SnapshotSchedule(every_steps=5), range(1, 100), save_steps=3)
    assert taken == list(range(5, 100, 5)) and all(d.warning is None for d in decisions)


def test_the_rate_warning_of_a_time_based_schedule_names_save_every_seconds() -> None:
    schedule = SnapshotSchedule(every_steps=None, every=timedelta(seconds=1), clock=0.0)
    _, _, decisions = _walk(schedule, range(1, 100), save_steps=24)
    (text,) = [d.warning for d in decisions if d.warning]
    assert "every 1.0 s" in text and "set save_every_seconds >= 3 s" in text


def test_stats_go_into_a_progress_report_the_service_reads() -> None:
    schedule, _, _ = _walk(SnapshotSchedule(every_steps=5), range(1, 17), busy=lambda s: 5 <= s <= 15)
    extra = schedule.stats.progress_fields()
    parsed = Progress.from_json(Progress(step=16, world_size=1, time=1.0, extra=extra).to_json())
    assert parsed.extra["snapshots_deferred"] == 1 and parsed.extra["snapshots_skipped"] == 2
    assert parsed.extra["snapshots_saved"] == 1


def test_config_accepts_the_writer_busy_mode_as_a_string_and_rejects_others() -> None:
    policy = LRPolicy(LRRule.LINEAR, 0.1, 1, 8)
    assert ElasticConfig(policy).when_writer_busy is WriterBusy.DEFER
    assert ElasticConfig(policy, when_writer_busy="wait").when_writer_busy is WriterBusy.WAIT  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="when_writer_busy must be one of 'defer', 'wait', got 'later'"):
        ElasticConfig(policy, when_writer_busy="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="save_every_steps must be >= 1"):
        ElasticConfig(policy, save_every_steps=0)


def test_save_every_is_a_deprecated_name_of_save_every_seconds_for_one_release() -> None:
    policy = LRPolicy(LRRule.LINEAR, 0.1, 1, 8)
    ten = timedelta(seconds=10)
    with pytest.warns(DeprecationWarning, match="use save_every_seconds"):
        old = ElasticConfig(policy, save_every=ten)  # type: ignore[call-arg]
    assert old == ElasticConfig(policy, save_every_seconds=ten) and old.save_every_seconds == ten
    with pytest.warns(DeprecationWarning, match="read save_every_seconds"):
        assert old.save_every == ten  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="not both"), pytest.warns(DeprecationWarning):
        ElasticConfig(policy, save_every_seconds=ten, save_every=timedelta(seconds=5))  # type: ignore[call-arg]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name, and a copy of a config, warn nothing
        assert replace(old, seed=1).save_every_seconds == ten
