"""The controller's decisions as a pure function: scheduling, node loss, scale-up, failures, success.

``Cluster`` runs multi-step scenarios tick by tick over the real ``ServiceStore`` on the in-memory etcd: each
tick reads the view, decides, and applies the plan as the leader does.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from elastic.contract.progress import Progress
from service.core.states import JobState
from service.core.view import JobEntry
from tests.service.controller.cluster_sim import CFG, T0, Cluster
from tests.service.controller.cluster_sim import spec as _spec


def _s(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_world_size_history_lists_the_nodes_the_workers_report_not_the_stale_assignment() -> None:
    # The demo showed "2  on node-1, node-2, node-3": the re-formed round reported world size 2 before the
    # controller saw the lost node's lease expire.
    c = Cluster()
    c.add_nodes("a", "b", "c")
    c.add_job("j1", _spec())
    c.tick(_s(1))
    c.progress_at("j1", _s(5), step=10, world=3, nodes=["a", "b", "c"])
    c.tick(_s(5))
    c.progress_at("j1", _s(6), step=11, world=2, nodes=["a", "b"])  # "c" still assigned
    c.tick(_s(6))
    st = c.status("j1")
    assert st.nodes == ["a", "b", "c"]
    assert [(h.world_size, h.nodes) for h in st.world_size_history] == [(3, ["a", "b", "c"]), (2, ["a", "b"])]
    c.progress_at("j1", _s(7), step=12, world=1)  # a report without nodes (a worker outside the loop)
    c.tick(_s(7))
    assert c.status("j1").world_size_history[-1].nodes == ["a", "b", "c"]


def test_pending_job_starts_on_up_to_max_nodes_when_min_are_free() -> None:
    c = Cluster()
    c.add_nodes("a", "b", "c", "d")
    c.add_job("j1", _spec())
    c.tick(_s(1))
    st = c.status("j1")
    assert st.state == JobState.RUNNING and st.generation == 1
    assert st.nodes == ["a", "b", "c"]
    assert c.assigned("j1") == {"a": 1, "b": 1, "c": 1}
    assert c.assignments["a"]["j1"].rdzv_id == "j1.g1"


def test_pending_job_waits_without_holding_nodes_when_fewer_than_min() -> None:
    c = Cluster()
    c.add_nodes("a")
    c.add_job("j1", _spec())
    c.tick(_s(1))
    st = c.status("j1")
    assert st.state == JobState.PENDING and st.message == "waiting for nodes: 1 eligible, min_nodes=2"
    assert c.assigned("j1") == {}
    c.add_nodes("b")
    c.tick(_s(2))
    assert c.status("j1").state == JobState.RUNNING and c.assigned("j1") == {"a": 1, "b": 1}


def test_lost_node_leaves_the_job_which_reforms_smaller_then_resumes_on_progress() -> None:
    c = Cluster()
    c.add_nodes("a", "b", "c")
    c.add_job("j1", _spec())
    c.tick(_s(1))
    c.progress_at("j1", _s(5), step=10, world=3)
    c.tick(_s(5))
    assert [h.world_size for h in c.status("j1").world_size_history] == [3]
    del c.nodes["c"]
    c.tick(_s(6))
    st = c.status("j1")
    assert st.state == JobState.RECOVERING and st.nodes == ["a", "b"]
    assert st.restarts.membership == 1 and st.generation == 1  # re-forms in place, same generation
    assert c.assigned("j1") == {"a": 1, "b": 1}
    assert ("j1", "node_lost") in c.events
    c.progress_at("j1", _s(9), step=11, world=2)
    c.tick(_s(9))
    st = c.status("j1")
    assert st.state == JobState.RUNNING and st.world_size == 2
    assert [(h.world_size, h.nodes) for h in st.world_size_history] == [(3, ["a", "b", "c"]), (2, ["a", "b"])]


def test_a_node_whose_agent_stopped_on_purpose_leaves_without_spending_the_membership_budget() -> None:
    """Slurm's scancel, its walltime or a preemption SIGTERMs the agent, which stops the job's torchrun (reporting it
    ``planned``) and leaves. Before, each was counted as a lost node (``left (lease expired)``): a job with a budget
    of 2 failed on its second planned stop (issue 50). A node lost without such a report still counts."""
    c = Cluster()
    c.add_nodes("a", "b", "c")
    c.add_job("j1", _spec(restart_policy={"max_membership_changes": 1}))
    c.tick(_s(1))
    for at, node in ((2, "c"), (4, "b")):
        c.report("j1", node, "stopped", -15, at=_s(at), planned=True)
        del c.nodes[node]
        c.tick(_s(at + 1))
        st = c.status("j1")
        assert st.state == JobState.RECOVERING and node not in st.nodes, st.message
        assert st.restarts.membership == 0 and st.restarts.planned == (1 if node == "c" else 2)
    assert [e for e in c.events if e == ("j1", "node_lost")] == [("j1", "node_lost")] * 2
    c.add_nodes("d", "e")
    c.tick(_s(6))
    del c.nodes["d"]  # lost: no report that its agent stopped
    c.tick(_s(7))
    assert c.status("j1").restarts.membership == 1


def test_losing_nodes_below_min_stops_the_job_until_enough_return() -> None:
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec(min_nodes=2, max_nodes=2))
    c.tick(_s(1))
    del c.nodes["b"]
    c.tick(_s(2))
    st = c.status("j1")
    assert st.state == JobState.RECOVERING and st.nodes == [] and c.assigned("j1") == {}
    assert "waiting for nodes" in st.message
    c.add_nodes("b2")
    c.tick(_s(3))
    st = c.status("j1")
    assert st.state == JobState.RUNNING and st.generation == 2 and c.assigned("j1") == {"a": 2, "b2": 2}


def test_new_node_scales_a_running_job_up_within_the_membership_budget() -> None:
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec(restart_policy={"max_membership_changes": 1}))
    c.tick(_s(1))
    c.add_nodes("c", "d")
    c.tick(_s(2))
    st = c.status("j1")
    assert st.nodes == ["a", "b", "c"] and st.restarts.membership == 1
    assert c.assigned("j1") == {"a": 1, "b": 1, "c": 1}  # same generation: torchrun admits the new node
    assert st.state == JobState.RECOVERING


def test_scale_up_stops_when_membership_budget_is_spent() -> None:
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec(restart_policy={"max_membership_changes": 0}))
    c.tick(_s(1))
    c.add_nodes("c")
    c.tick(_s(2))
    assert c.status("j1").nodes == ["a", "b"]


def test_node_loss_beyond_membership_budget_fails_the_job() -> None:
    c = Cluster()
    c.add_nodes("a", "b", "c")
    c.add_job("j1", _spec(min_nodes=1, restart_policy={"max_membership_changes": 0}))
    c.tick(_s(1))
    del c.nodes["c"]
    c.tick(_s(2))
    st = c.status("j1")
    assert st.state == JobState.FAILED and "membership budget exhausted" in st.message
    assert c.assigned("j1") == {}


def test_failure_everywhere_restarts_a_new_generation_after_backoff_without_blame() -> None:
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec(restart_policy={"backoff_initial": 4, "max_failures": 2}))
    c.tick(_s(1))
    c.progress_at("j1", _s(2), step=1, world=2)
    c.tick(_s(2))
    c.progress_at("j1", _s(3), step=5, world=2)
    c.tick(_s(3))
    c.report("j1", "a", "exited", 1, at=_s(4))
    c.report("j1", "b", "exited", 1, at=_s(4))
    c.tick(_s(4))
    st = c.status("j1")
    assert st.state == JobState.RECOVERING and st.restarts.failure == 1
    assert st.backoff_until == _s(8) and st.node_failures == {} and c.assigned("j1") == {}
    assert "exit code 1" in (st.last_error or "")
    c.tick(_s(7))
    assert c.status("j1").generation == 1  # still backing off
    c.tick(_s(8))
    st = c.status("j1")
    assert st.state == JobState.RUNNING and st.generation == 2 and c.assigned("j1") == {"a": 2, "b": 2}


def test_failure_on_one_node_waits_to_settle_then_blames_and_blacklists_it() -> None:
    c = Cluster()
    c.add_nodes("a", "b", "c")
    policy = {"backoff_initial": 1, "blacklist_after": 2, "max_failures": 10, "crash_loop_threshold": 10}
    c.add_job("j1", _spec(restart_policy=policy))
    t = 1.0
    for round_ in (1, 2):
        c.tick(_s(t))
        c.report("j1", "c", "exited", 1, at=_s(t + 1))
        c.tick(_s(t + 1))
        assert c.status("j1").state == JobState.RUNNING  # settling: did the others fail too?
        c.tick(_s(t + 3))
        assert c.status("j1").restarts.failure == round_
        t += 5
    st = c.status("j1")
    assert "c" in st.blacklist and ("j1", "node_blacklisted") in c.events
    c.tick(_s(t))
    assert c.status("j1").nodes == ["a", "b"]  # c is avoided during its cooldown


def test_repeated_failures_before_the_first_step_fail_as_crash_loop() -> None:
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec(restart_policy={"backoff_initial": 1, "max_failures": 10, "crash_loop_threshold": 2}))
    c.tick(_s(0))
    for t in (1, 10):
        c.report("j1", "a", "exited", 2, at=_s(t))
        c.report("j1", "b", "exited", 2, at=_s(t))
        c.tick(_s(t))
        c.tick(_s(t + 5))
    st = c.status("j1")
    assert st.state == JobState.FAILED and st.message.startswith("crash loop at start-up")
    assert st.restarts.failure == 2


def test_launch_failure_counts_as_a_failure() -> None:
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec(restart_policy={"max_failures": 0}))
    c.tick(_s(0))
    c.report("j1", "a", "launch_failed")
    c.report("j1", "b", "launch_failed")
    c.tick(_s(1))
    assert c.status("j1").state == JobState.FAILED


def test_success_waits_for_other_nodes_to_exit_or_the_grace_period() -> None:
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec())
    c.tick(_s(0))
    c.report("j1", "a", "exited", 0)
    c.report("j1", "b", "running")
    c.tick(_s(1))
    assert c.status("j1").state == JobState.RUNNING
    c.report("j1", "b", "exited", 0)
    c.tick(_s(2))
    st = c.status("j1")
    assert st.state == JobState.SUCCEEDED and st.finished_at == _s(2) and c.assigned("j1") == {}
    c.tick(_s(3))
    assert "j1" not in c.reports  # a finished job's reports are cleared

    c.add_job("j2", _spec(), at=_s(4))
    c.tick(_s(5))
    c.report("j2", "a", "exited", 0, at=_s(6))
    c.report("j2", "b", "running")
    c.tick(_s(6))
    c.tick(_s(15.9))
    assert c.status("j2").state == JobState.RUNNING
    c.tick(_s(16))
    assert c.status("j2").state == JobState.SUCCEEDED and c.assigned("j2") == {}


def test_cancel_request_releases_every_node() -> None:
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec())
    c.tick(_s(0))
    e = c.jobs["j1"]
    c.jobs["j1"] = JobEntry(e.record, e.status, e.status_revision, cancel_requested=True)
    c.tick(_s(1))
    assert c.status("j1").state == JobState.CANCELLED and c.assigned("j1") == {}


def test_older_jobs_get_nodes_first_and_capacity_is_respected() -> None:
    c = Cluster()
    c.add_nodes("a", "b", "c")
    c.add_job("old", _spec(min_nodes=2, max_nodes=2), at=_s(0))
    c.add_job("new", _spec(min_nodes=2, max_nodes=2), at=_s(1))
    c.tick(_s(2))
    assert c.status("old").nodes == ["a", "b"]
    assert c.status("new").state == JobState.PENDING
    c.add_nodes("d")
    c.tick(_s(3))
    assert c.status("new").nodes == ["c", "d"]


def test_nodes_with_room_for_several_jobs_host_them_side_by_side() -> None:
    c = Cluster()
    c.add_nodes("a", "b", capacity=4)
    c.add_job("j1", _spec(nproc_per_node=2, min_nodes=2, max_nodes=2))
    c.add_job("j2", _spec(nproc_per_node=2, min_nodes=2, max_nodes=2), at=_s(1))
    c.add_job("j3", _spec(nproc_per_node=1, min_nodes=1, max_nodes=1), at=_s(2))
    c.tick(_s(3))
    assert c.status("j1").nodes == ["a", "b"] and c.status("j2").nodes == ["a", "b"]
    assert c.status("j3").state == JobState.PENDING


def test_checkpoint_progress_is_recorded_only_inside_the_jobs_prefix() -> None:
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec(), checkpoint_url="file:///ck/j1")
    c.tick(_s(0))
    c.progress_at("j1", _s(1), step=10, world=2, checkpoint_step=10, checkpoint_path="/ck/j1/step-10.pt")
    c.tick(_s(1))
    ckpt = c.status("j1").checkpoint
    assert ckpt is not None and (ckpt.step, ckpt.path) == (10, "/ck/j1/step-10.pt")
    c.progress_at("j1", _s(2), step=20, world=2, checkpoint_step=20, checkpoint_path="/ck/other/step-20.pt")
    c.tick(_s(2))
    assert c.status("j1").checkpoint.step == 10  # type: ignore[union-attr]
    assert ("j1", "checkpoint_rejected") in c.events


def test_a_job_cannot_start_on_a_checkpoint_prefix_an_active_job_uses() -> None:
    c = Cluster()
    c.add_nodes("a", "b", "c", "d")
    c.add_job("j1", _spec(min_nodes=2, max_nodes=2), checkpoint_url="file:///ck/shared")
    c.add_job("j2", _spec(min_nodes=2, max_nodes=2), at=_s(1), checkpoint_url="file:///ck/shared/sub")
    c.tick(_s(2))
    assert c.status("j1").state == JobState.RUNNING
    st = c.status("j2")
    assert st.state == JobState.FAILED and "in use by job j1" in st.message


def test_jobs_that_report_no_progress_are_assumed_recovered_after_a_while() -> None:
    c = Cluster()
    c.add_nodes("a", "b", "c")
    c.add_job("j1", _spec())
    c.tick(_s(0))
    del c.nodes["c"]
    c.tick(_s(1))
    c.tick(_s(30))
    assert c.status("j1").state == JobState.RECOVERING
    c.tick(_s(31))
    assert c.status("j1").state == JobState.RUNNING


def test_worker_restarts_and_late_reports_of_old_generations() -> None:
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec())
    c.tick(_s(0))
    c.progress_at("j1", _s(1), step=3, world=2, restart_count=2)
    c.tick(_s(1))
    assert c.status("j1").restarts.in_place == 2
    c.progress[("j1")] = Progress(step=4, world_size=7, time=_s(2).timestamp(), generation=0)
    c.tick(_s(2))
    st = c.status("j1")
    assert st.world_size == 2 and st.step == 4  # an old generation's world size is not current


def test_leftover_and_orphan_assignments_are_removed() -> None:
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec())
    c.tick(_s(0))
    stale = c.assignments["a"]["j1"].model_copy(update={"job_id": "gone"})
    c.assignments["b"]["gone"] = stale
    plan = c.tick(_s(1))
    assert plan.orphans == [("b", "gone")]
    assert "gone" not in c.assignments["b"]


def test_nothing_to_do_yields_an_empty_plan() -> None:
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec())
    c.tick(_s(0))
    assert c.tick(_s(1)).empty


def test_finished_jobs_are_deleted_once_the_retention_is_over_and_not_before() -> None:
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec())
    c.add_job("j2", _spec(min_nodes=3, max_nodes=3))  # waits for a third node: stays
    c.tick(_s(0))
    e = c.jobs["j1"]
    c.jobs["j1"] = JobEntry(e.record, e.status, e.status_revision, cancel_requested=True)
    c.tick(_s(1))  # cancelled: assignments released in this pass
    finished = c.status("j1").finished_at
    assert finished is not None and c.assigned("j1") == {}
    retention = CFG.terminal_retention
    assert not any(u.purge for u in c.tick(finished + retention - timedelta(seconds=1)).updates)
    plan = c.tick(finished + retention)
    assert [u.job_id for u in plan.updates if u.purge] == ["j1"]
    assert set(c.jobs) == {"j2"}


def test_world_size_history_keeps_the_newest_changes_up_to_its_limit() -> None:
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec())
    c.tick(_s(0))
    for i in range(CFG.history_limit + 30):
        c.progress_at("j1", _s(1 + i), step=i, world=1 + i % 2)
        c.tick(_s(1 + i))
    history = c.status("j1").world_size_history
    assert len(history) == CFG.history_limit
    assert history[-1].at == _s(CFG.history_limit + 30)  # the last report (its time: 1 + i)


# -- live recovery (recovery: live) -------------------------------------------------------------------
def _live_job(c: Cluster, **policy: Any) -> None:
    c.add_nodes("a", "b", "c")
    c.add_job("j1", _spec(min_nodes=1, recovery="live", restart_policy={"backoff_initial": 4, **policy}))
    c.tick(_s(1))
    c.progress_at("j1", _s(2), step=5, world=3, nodes=["a", "b", "c"])
    c.tick(_s(2))


def test_live_a_world_change_without_a_new_generation_is_history_not_a_failure() -> None:
    # the live group re-formed (a worker died and its torchrun restarted it): only the world size changes
    c = Cluster()
    _live_job(c)
    c.progress_at("j1", _s(3), step=6, world=2, nodes=["a", "b"])
    c.tick(_s(3))
    c.progress_at("j1", _s(4), step=9, world=3, nodes=["a", "b", "c"])
    c.tick(_s(4))
    st = c.status("j1")
    assert st.state == JobState.RUNNING and st.generation == 1 and st.restarts.failure == 0
    assert [h.world_size for h in st.world_size_history] == [3, 2, 3]
    assert c.assigned("j1") == {"a": 1, "b": 1, "c": 1}


def test_live_a_killed_torchrun_drops_its_node_alone_and_the_node_comes_back_in_the_same_generation() -> None:
    c = Cluster()
    _live_job(c)
    c.report("j1", "a", "running")
    c.report("j1", "b", "running")
    c.report("j1", "c", "exited", -9, at=_s(3))  # SIGKILL: its run stays open, the others train on
    c.tick(_s(3))
    assert c.status("j1").state == JobState.RUNNING  # settling: do the others fail too?
    c.tick(_s(5))
    st = c.status("j1")
    assert st.state == JobState.RECOVERING and st.generation == 1 and st.nodes == ["a", "b"]
    assert st.restarts.failure == 1 and st.backoff_until is None and "live recovery" in st.message
    assert c.assigned("j1") == {"a": 1, "b": 1}  # the survivors' torchruns are left alone
    assert "c" not in c.reports["j1"]  # the stale failure must not count again once c is back
    assert ("j1", "workers_failed") in c.events
    c.progress_at("j1", _s(6), step=8, world=2, nodes=["a", "b"])
    c.tick(_s(6))
    c.tick(_s(7))  # running again: grows back onto c, same generation (its worker joins the live group)
    st = c.status("j1")
    assert st.generation == 1 and st.nodes == ["a", "b", "c"] and c.assigned("j1") == {"a": 1, "b": 1, "c": 1}
    assert ("j1", "node_joined") in c.events


def test_live_a_torchrun_that_exited_by_itself_restarts_the_job_in_a_new_generation() -> None:
    # past --max-restarts torchrun closes the generation's rendezvous: no node can join it again
    c = Cluster()
    _live_job(c)
    c.report("j1", "c", "exited", 1, at=_s(3))
    c.tick(_s(3))
    c.tick(_s(5))
    st = c.status("j1")
    assert st.state == JobState.RECOVERING and st.nodes == [] and c.assigned("j1") == {}
    assert st.backoff_until == _s(9)
    c.tick(_s(9))
    assert c.status("j1").generation == 2 and c.assigned("j1") == {"a": 2, "b": 2, "c": 2}


def test_live_a_failure_everywhere_or_below_min_nodes_restarts_the_job() -> None:
    c = Cluster()
    _live_job(c)
    for node in ("a", "b", "c"):
        c.report("j1", node, "exited", -9, at=_s(3))
    c.tick(_s(3))
    assert c.status("j1").nodes == [] and c.assigned("j1") == {}
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec(min_nodes=2, max_nodes=2, recovery="live"))
    c.tick(_s(1))
    c.report("j1", "b", "exited", -9, at=_s(2))
    c.tick(_s(2))
    c.tick(_s(5))
    assert c.status("j1").nodes == [] and c.assigned("j1") == {}  # one node left, min_nodes=2


def test_restart_mode_a_killed_torchrun_still_restarts_every_node() -> None:
    c = Cluster()
    c.add_nodes("a", "b", "c")
    c.add_job("j1", _spec(min_nodes=1))
    c.tick(_s(1))
    c.report("j1", "c", "exited", -9, at=_s(3))
    c.tick(_s(3))
    c.tick(_s(5))
    assert c.status("j1").nodes == [] and c.assigned("j1") == {}
