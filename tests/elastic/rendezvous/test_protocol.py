"""The rendezvous protocol's pure decisions: when a round closes, who is in it, who watches whom, and when
the members of a running round re-form."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from elastic.rendezvous.protocol import (
    CloseNow,
    FormingView,
    Head,
    NextRoundView,
    RendezvousKeys,
    RoundAssignment,
    RoundRules,
    WaitUntil,
    close_decision,
    previous_round_full,
    select_members,
    waiting_reason,
)

pytestmark = pytest.mark.timeout(60)

RULES = RoundRules(min_nodes=2, max_nodes=4, last_call=timedelta(seconds=10))
NOTHING = NextRoundView(closer=False, wake=False, assigned=False, closed=False)


def test_a_round_closes_at_once_when_max_nodes_joined() -> None:
    assert isinstance(close_decision(FormingView(0, 4, 9, last_growth=100.0), 100.0, RULES), CloseNow)


def test_a_round_below_min_nodes_waits_without_a_deadline() -> None:
    assert close_decision(FormingView(3, 1, 1, last_growth=None), 100.0, RULES) == WaitUntil(None)


def test_the_first_round_waits_last_call_after_the_latest_join_even_when_all_live_agents_joined() -> None:
    assert close_decision(FormingView(0, 2, 2, last_growth=100.0), 105.0, RULES) == WaitUntil(110.0)
    assert isinstance(close_decision(FormingView(0, 2, 2, last_growth=100.0), 110.0, RULES), CloseNow)


def test_a_re_formed_round_holding_every_live_agent_closes_at_once() -> None:
    assert isinstance(close_decision(FormingView(5, 3, 3, last_growth=100.0), 100.0, RULES), CloseNow)


def test_a_re_formed_round_waits_for_a_live_agent_not_yet_joined() -> None:
    assert close_decision(FormingView(5, 3, 4, last_growth=100.0), 101.0, RULES) == WaitUntil(110.0)


def test_spares_of_a_full_running_round_never_close_a_round_of_their_own() -> None:
    blocked = FormingView(6, 9, 9, last_growth=0.0, previous_full=True)
    assert close_decision(blocked, 1000.0, RULES) == WaitUntil(None)


def test_the_previous_round_blocks_only_while_it_is_the_newest_full_and_complete() -> None:
    full = Head(round=5, size=4)
    assert previous_round_full(full, 6, previous_joined=4, rules=RULES)
    assert not previous_round_full(full, 6, previous_joined=3, rules=RULES)  # a member left or died
    assert not previous_round_full(Head(5, 3), 6, previous_joined=3, rules=RULES)  # room for a joiner
    assert not previous_round_full(full, 7, previous_joined=4, rules=RULES)  # not the previous round
    assert not previous_round_full(None, 0, previous_joined=0, rules=RULES)


def test_members_are_the_first_max_nodes_to_join_ranked_by_node_id() -> None:
    joins = [("d", 14), ("a", 13), ("c", 11), ("b", 12), ("e", 15)]
    assert select_members(joins, 3) == ("a", "b", "c")
    assert select_members(joins, 10) == ("a", "b", "c", "d", "e")


@pytest.mark.parametrize("seed", range(20))
def test_every_member_is_watched_by_exactly_one_other(seed: int) -> None:
    rng = random.Random(seed)
    nodes = {
        f"10.0.{rng.randrange(256)}.{rng.randrange(256)}:{rng.randrange(1, 99999)}:0"
        for _ in range(rng.randrange(2, 40))
    }
    a = RoundAssignment(1, tuple(sorted(nodes)), fence=7)
    watched = [a.successor(n) for n in a.members]
    assert sorted(w for w in watched if w is not None) == sorted(a.members)
    assert all(w != n for n, w in zip(a.members, watched, strict=True))


def test_a_round_of_one_watches_nobody() -> None:
    assert RoundAssignment(0, ("a",), fence=1).successor("a") is None


def test_the_head_round_trips_and_a_malformed_one_is_a_clear_error() -> None:
    assert Head.decode(Head(12, 1024).encode()) == Head(12, 1024)
    with pytest.raises(ValueError, match="malformed rendezvous head"):
        Head.decode(b"12")


def test_an_assignment_round_trips_and_ranks_are_positions() -> None:
    a = RoundAssignment(3, ("n1", "n2", "n3"), fence=42)
    b = RoundAssignment.decode(a.encode())
    assert b == a
    assert [b.rank(n) for n in ("n1", "n2", "n3", "x")] == [0, 1, 2, None]


@pytest.mark.parametrize("raw", [b"", b"{", b'{"round": 1}', b'{"round": "x", "members": [], "fence": 1}', b"[]"])
def test_a_malformed_assignment_is_a_clear_error(raw: bytes) -> None:
    with pytest.raises(ValueError, match="malformed rendezvous assignment"):
        RoundAssignment.decode(raw)


def test_a_node_waiting_counts_only_while_the_round_has_room() -> None:
    waiting = NextRoundView(closer=True, wake=False, assigned=False, closed=False)
    assert waiting_reason(3, 4, waiting, successor_lost=False) is not None
    assert waiting_reason(4, 4, waiting, successor_lost=False) is None  # a full round: the node is a spare


def test_a_lost_or_leaving_member_always_re_forms_the_round_even_a_full_one() -> None:
    assert waiting_reason(4, 4, NOTHING, successor_lost=True) is not None
    assert waiting_reason(4, 4, NextRoundView(closer=True, wake=True, assigned=False, closed=False), False) is not None
    assert waiting_reason(4, 4, NextRoundView(closer=False, wake=False, assigned=True, closed=False), False) is not None


def test_nothing_re_forms_a_closed_rendezvous_or_a_quiet_one() -> None:
    assert waiting_reason(2, 4, NOTHING, successor_lost=False) is None
    assert waiting_reason(2, 4, NextRoundView(True, True, True, closed=True), successor_lost=True) is None


def test_the_layout_keeps_runs_apart_and_refuses_a_bad_run_id() -> None:
    a, b = RendezvousKeys.of("/p/", "job-1"), RendezvousKeys.of("/p", "job-12")
    assert a.base == "/p/job-1/" and not b.base.startswith(a.base)
    assert a.join_key(3, "n").startswith(a.joins(3)) and not a.joins(1).startswith(a.joins(10)[:-1] + "/")
    for bad in ("", "a/b"):
        with pytest.raises(ValueError):
            RendezvousKeys.of("/p", bad)


def test_rules_refuse_an_impossible_range() -> None:
    with pytest.raises(ValueError):
        RoundRules(3, 2, timedelta(seconds=1))
    with pytest.raises(ValueError):
        RoundRules(0, 2, timedelta(seconds=1))
