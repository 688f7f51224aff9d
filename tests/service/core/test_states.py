"""The job state machine: every allowed transition, and everything else refused."""

from __future__ import annotations

import pytest

from service.core.states import TERMINAL_STATES, InvalidTransition, JobState, Trigger, allowed_triggers, next_state

ALLOWED = {
    (JobState.PENDING, Trigger.START): JobState.RUNNING,
    (JobState.PENDING, Trigger.FAIL): JobState.FAILED,
    (JobState.PENDING, Trigger.CANCEL): JobState.CANCELLED,
    (JobState.RUNNING, Trigger.DISRUPT): JobState.RECOVERING,
    (JobState.RUNNING, Trigger.SUCCEED): JobState.SUCCEEDED,
    (JobState.RUNNING, Trigger.FAIL): JobState.FAILED,
    (JobState.RUNNING, Trigger.CANCEL): JobState.CANCELLED,
    (JobState.RECOVERING, Trigger.START): JobState.RUNNING,
    (JobState.RECOVERING, Trigger.RESUME): JobState.RUNNING,
    (JobState.RECOVERING, Trigger.DISRUPT): JobState.RECOVERING,
    (JobState.RECOVERING, Trigger.SUCCEED): JobState.SUCCEEDED,
    (JobState.RECOVERING, Trigger.FAIL): JobState.FAILED,
    (JobState.RECOVERING, Trigger.CANCEL): JobState.CANCELLED,
}


@pytest.mark.parametrize(("state", "trigger"), list(ALLOWED))
def test_allowed_transition_leads_to_documented_state(state: JobState, trigger: Trigger) -> None:
    assert next_state(state, trigger) == ALLOWED[(state, trigger)]


@pytest.mark.parametrize(
    ("state", "trigger"),
    [(s, t) for s in JobState for t in Trigger if (s, t) not in ALLOWED],
)
def test_every_other_transition_is_refused(state: JobState, trigger: Trigger) -> None:
    with pytest.raises(InvalidTransition, match=state.value):
        next_state(state, trigger)


def test_terminal_states_accept_no_trigger_and_say_so() -> None:
    assert (
        {s for s in JobState if s.terminal}
        == TERMINAL_STATES
        == {
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
        }
    )
    for state in TERMINAL_STATES:
        assert allowed_triggers(state) == frozenset()


def test_running_and_recovering_can_always_be_cancelled_or_failed() -> None:
    for state in (JobState.PENDING, JobState.RUNNING, JobState.RECOVERING):
        assert {Trigger.CANCEL, Trigger.FAIL} <= allowed_triggers(state)


def test_states_are_str_enums_that_serialize_as_their_value() -> None:
    assert JobState("recovering") is JobState.RECOVERING
    assert JobState.RUNNING == "running"
