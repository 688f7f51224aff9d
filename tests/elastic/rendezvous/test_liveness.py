"""The pure lease-liveness rule applied to torch's rendezvous state (no etcd, no processes)."""

from __future__ import annotations

import pickle
from datetime import datetime, timedelta, timezone

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elastic.rendezvous.etcd_v3_backend import _EPOCH, _apply_liveness

A = _NodeDesc("10.0.0.1", 100, 0)
B = _NodeDesc("10.0.0.2", 200, 0)
C = _NodeDesc("10.0.0.3", 300, 0)


def _state(*, round_: int, participants: list[_NodeDesc], complete: bool = False) -> _RendezvousState:
    s = _RendezvousState()
    s.round = round_
    s.complete = complete
    now = datetime.now(timezone.utc)
    for i, n in enumerate(participants):
        s.participants[n] = i
        s.last_heartbeats[n] = now - timedelta(seconds=1)
    if not complete and participants:
        s.deadline = now + timedelta(seconds=30)
    return s


def _apply(state: _RendezvousState, alive: set[str]) -> _RendezvousState:
    out: _RendezvousState = pickle.loads(_apply_liveness(pickle.dumps(state), alive))
    return out


def test_node_without_alive_key_gets_an_expired_heartbeat() -> None:
    out = _apply(_state(round_=0, participants=[A, B], complete=True), {"10.0.0.1:100"})
    assert out.last_heartbeats[B] == _EPOCH
    assert out.last_heartbeats[A] > _EPOCH


def test_node_with_alive_key_is_shown_fresh_even_if_its_heartbeat_is_old() -> None:
    s = _state(round_=0, participants=[A], complete=True)
    s.last_heartbeats[A] = datetime.now(timezone.utc) - timedelta(minutes=5)
    out = _apply(s, {"10.0.0.1:100"})
    assert datetime.now(timezone.utc) - out.last_heartbeats[A] < timedelta(seconds=5)


def test_reformed_round_holding_every_live_agent_skips_last_call() -> None:
    out = _apply(_state(round_=3, participants=[A, B]), {"10.0.0.1:100", "10.0.0.2:200"})
    assert out.deadline is not None and out.deadline < datetime.now(timezone.utc)


def test_reformed_round_waits_for_a_live_agent_not_yet_joined() -> None:
    out = _apply(_state(round_=3, participants=[A]), {"10.0.0.1:100", "10.0.0.3:300"})
    assert out.deadline is not None and out.deadline > datetime.now(timezone.utc)


def test_first_round_keeps_its_last_call_window() -> None:
    out = _apply(_state(round_=0, participants=[A]), {"10.0.0.1:100"})
    assert out.deadline is not None and out.deadline > datetime.now(timezone.utc)


def test_complete_round_is_left_alone_apart_from_heartbeats() -> None:
    s = _state(round_=2, participants=[A, C], complete=True)
    out = _apply(s, {"10.0.0.1:100", "10.0.0.3:300"})
    assert out.complete and out.participants == s.participants


def test_foreign_payload_is_returned_unchanged() -> None:
    assert _apply_liveness(b"not a pickle", {"x:1"}) == b"not a pickle"
