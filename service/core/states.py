"""The job life cycle as an explicit state machine (pure: no I/O, no clock).

::

    pending ──start──▶ running ──succeed──▶ succeeded
       │                 │  ▲
       │             disrupt│ start / resume
       │                 ▼  │
       │              recovering ──(disrupt: stays)
       │                 │
       └──cancel/fail────┴──cancel/fail──▶ cancelled / failed

``start``: nodes were assigned and workers launched (first time, or after a restart). ``disrupt``: a
node was lost or joined, the workers failed and will be restarted, or the job waits for nodes.
``resume``: the workers report progress again after a disruption. Terminal states accept nothing.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["TERMINAL_STATES", "InvalidTransition", "JobState", "Trigger", "allowed_triggers", "next_state"]


class JobState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


class Trigger(str, Enum):
    START = "start"
    DISRUPT = "disrupt"
    RESUME = "resume"
    SUCCEED = "succeed"
    FAIL = "fail"
    CANCEL = "cancel"


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class InvalidTransition(ValueError):
    """A trigger that the job's current state does not accept (a bug in the caller's decision)."""

    def __init__(self, state: JobState, trigger: Trigger) -> None:
        super().__init__(f"job in state {state.value!r} cannot take {trigger.value!r}")
        self.state = state
        self.trigger = trigger


_TRANSITIONS: dict[tuple[JobState, Trigger], JobState] = {
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


def next_state(state: JobState, trigger: Trigger) -> JobState:
    """The state after ``trigger``; raises :class:`InvalidTransition` if ``state`` does not accept it."""
    try:
        return _TRANSITIONS[(state, trigger)]
    except KeyError:
        raise InvalidTransition(state, trigger) from None


def allowed_triggers(state: JobState) -> frozenset[Trigger]:
    return frozenset(t for (s, t) in _TRANSITIONS if s == state)
