"""Each job's own etcd identity (service.controller.identities): the pure decisions of which jobs need one made or
revoked and what their assignments carry, and the leader making and revoking them on the in-memory etcd (whose
users and roles are kept, not enforced: tests/service/test_etcd_security.py checks the permissions on a real
etcd with auth enabled)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

import pytest

from elastic.etcd import EtcdConfig, EtcdError, MemoryEtcdClient, MemoryEtcdServer
from elastic.etcd.api import RolePermission
from elastic.rendezvous.protocol import RendezvousKeys
from service.controller.identities import (
    USER_PREFIX,
    IdentityRecord,
    decide_identities,
    job_permissions,
    job_principal,
    with_credentials,
)
from service.controller.loop import Controller
from service.core.config import EtcdOptions, Settings
from service.core.models import Assignment, JobRecord, JobSpec, JobStatus, NodeInfo
from service.core.states import JobState
from service.core.store import Keys, ServiceStore, identity_key, new_event
from service.core.view import ClusterView, JobEntry, JobUpdate, Plan

pytestmark = pytest.mark.timeout(30)

NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)
PASSWORD_AUTH = EtcdConfig(endpoints=(("memory", 0),), ca_cert="ca.pem", user="root", password="control-pw")


# -- pure decisions ----------------------------------------------------------------------------------
def _entry(job_id: str, state: JobState = JobState.PENDING) -> JobEntry:
    record = JobRecord(id=job_id, spec=JobSpec(name="j", entrypoint="t.py"), created_at=NOW)
    return JobEntry(record, JobStatus(state=state, created_at=NOW, updated_at=NOW), 1)


def _view(*entries: JobEntry) -> ClusterView:
    return ClusterView(jobs={e.record.id: e for e in entries}, nodes={}, assignments={})


def _assignment(job_id: str) -> Assignment:
    return Assignment(job_id=job_id, generation=1, spec=JobSpec(name="j", entrypoint="t.py"), assigned_at=NOW)


def _placing(*job_ids: str) -> Plan:
    return Plan(updates=[JobUpdate(j, 1, None, assign={"n1": _assignment(j)}) for j in job_ids])


def _record(job_id: str, ready: bool = True) -> IdentityRecord:
    return IdentityRecord(
        job_id=job_id, user=job_principal(job_id), password=f"pw-{job_id}", ready=ready, created_at=NOW
    )


def test_a_job_the_plan_assigns_needs_its_identity_made_unless_a_ready_one_is_stored() -> None:
    view = _view(_entry("new-1"), _entry("half-1"), _entry("ready-1"), _entry("idle-1"))
    records = {"half-1": _record("half-1", ready=False), "ready-1": _record("ready-1")}
    decision = decide_identities(view, _placing("new-1", "half-1", "ready-1"), records)
    assert (decision.ensure, decision.revoke) == (("half-1", "new-1"), ())
    assert decide_identities(view, Plan(), records).empty  # nothing assigned, nothing finished: no etcd call


def test_jobs_terminal_or_gone_lose_their_identity_and_a_job_the_plan_ends_loses_it_in_the_same_pass() -> None:
    view = _view(
        _entry("done-1", JobState.SUCCEEDED), _entry("live-1", JobState.RUNNING), _entry("ending-1", JobState.RUNNING)
    )
    records = {j: _record(j) for j in ("done-1", "live-1", "ending-1", "purged-1")}
    cancelled = JobStatus(state=JobState.CANCELLED, created_at=NOW, updated_at=NOW)
    plan = Plan(updates=[JobUpdate("ending-1", 1, cancelled, unassign=["n1"])])
    assert decide_identities(view, plan, records).revoke == ("done-1", "ending-1", "purged-1")


def test_listed_users_of_terminal_jobs_without_a_record_are_revoked_but_users_of_unknown_jobs_are_left() -> None:
    view = _view(_entry("done-1", JobState.FAILED), _entry("live-1", JobState.RUNNING))
    users = ["root", USER_PREFIX + "done-1", USER_PREFIX + "live-1", USER_PREFIX + "other-service-job"]
    assert decide_identities(view, Plan(), {}, users).revoke == ("done-1",)
    assert decide_identities(view, Plan(), {}, None).revoke == ()  # users are listed once per leadership term


def test_an_active_jobs_stored_user_that_vanished_from_etcd_is_made_again_once_users_are_listed() -> None:
    view = _view(_entry("live-1", JobState.RUNNING), _entry("kept-1", JobState.RUNNING))
    records = {"live-1": _record("live-1"), "kept-1": _record("kept-1")}
    assert decide_identities(view, Plan(), records, ["root", USER_PREFIX + "kept-1"]).ensure == ("live-1",)
    assert decide_identities(view, Plan(), records, None).empty


def test_assignments_carry_their_jobs_user_and_password_and_an_update_without_a_ready_identity_is_held_back() -> None:
    plan = _placing("ready-1", "half-1", "new-1")
    plan.updates.append(JobUpdate("other-1", 1, None, unassign=["n2"]))
    records = {"ready-1": _record("ready-1"), "half-1": _record("half-1", ready=False)}
    out, held = with_credentials(plan, records)
    assert held == ["half-1", "new-1"]
    assert [u.job_id for u in out.updates] == ["ready-1", "other-1"]
    a = out.updates[0].assign["n1"]
    assert (a.etcd_user, a.etcd_password) == ("etrain-job-ready-1", "pw-ready-1")
    assert plan.updates[0].assign["n1"].etcd_user is None  # the plan given is not changed
    assert "pw-ready-1" not in repr(a)


def test_a_jobs_role_covers_the_rendezvous_of_its_generations_and_its_progress_key_only() -> None:
    from service.core.models import rdzv_run_id

    keys = Keys("/etrain")
    rdzv, progress, ping = job_permissions(keys, "j-1a2b")
    assert (progress, ping) == (RolePermission("/etrain/progress/j-1a2b", "readwrite"), RolePermission("\0", "read"))
    assert rdzv.prefix and rdzv.perm == "readwrite"
    for generation in (1, 2, 17):  # where the etcd-v3 backend keeps the run that the agent names
        layout = RendezvousKeys.of(keys.rdzv, rdzv_run_id("j-1a2b", generation))
        assert all(
            k.startswith(rdzv.key)
            for k in (layout.base, layout.assign(3), layout.store, layout.closed, layout.live + "gen")
        )  # live recovery's group
    for other in (
        "/etrain.rdzv/j-1a2bc.g1/rdzv/state",
        "/etrain.rdzv/j-1a2.g1/rdzv/state",
        "/etrain/progress/j-1a2bc",
        "/etrain.rdzv/j-1a2b-g1/rdzv/state",
    ):
        assert not other.startswith(rdzv.key) and other != progress.key


def test_a_jobs_grant_covers_no_run_of_a_job_named_after_it() -> None:
    """Job ``j-1a2b3c4d`` and a job whose name is ``j-1a2b3c4d-g1`` (a valid name), so whose id starts with the
    first's followed by ``-g``: the first job's grant covers none of the second's rendezvous keys."""
    import re

    from service.core.spec import NAME_PATTERN
    from tests.service.controller.cluster_sim import Cluster
    from tests.service.controller.cluster_sim import spec as sim_spec

    first, second = "j-1a2b3c4d", "j-1a2b3c4d-g1-0badcafe"
    assert re.match(NAME_PATTERN, second.rsplit("-", 1)[0])
    c = Cluster()
    c.add_nodes("a", "b")
    c.add_job(first, sim_spec(min_nodes=1, max_nodes=1))
    c.add_job(second, sim_spec(min_nodes=1, max_nodes=1))
    c.tick(NOW)
    runs = {a.job_id: a.rdzv_id for jobs in c.assignments.values() for a in jobs.values()}
    keys = Keys("/etrain")
    grant = job_permissions(keys, first)[0]
    own, other = (RendezvousKeys.of(keys.rdzv, runs[j]) for j in (first, second))
    assert own.base.startswith(grant.key) and own.store.startswith(grant.key)
    for key in (other.base, other.assign(1), other.store, other.closed, other.live + "gen"):
        assert not key.startswith(grant.key), (key, grant.key)


# -- the leader on the in-memory etcd ------------------------------------------------------------------
class _Cluster:
    def __init__(self, config: EtcdConfig | None = PASSWORD_AUTH) -> None:
        self.server = MemoryEtcdServer()
        self.client = MemoryEtcdClient(self.server, config)
        self.store = ServiceStore(self.client, "/etrain")
        settings = Settings(etcd=EtcdOptions("memory:0"), prefix="/etrain", replica_id="c1")
        self.controller = Controller(self.store, settings)
        lease = self.client.grant_lease(timedelta(seconds=60))
        info = NodeInfo(name="n1", capacity=1, incarnation="i", registered_at=NOW)
        self.store.register_node(info, lease)

    def submit(self, job_id: str) -> None:
        now = datetime.now(timezone.utc)
        record = JobRecord(id=job_id, spec=JobSpec(name="j", entrypoint="t.py"), created_at=now)
        self.store.create_job(record, JobStatus(created_at=now, updated_at=now), new_event("submitted", "t", now))

    def assignment(self, job_id: str) -> Assignment | None:
        return self.store.assignments("n1")[0].get(job_id)


def test_the_leader_makes_the_jobs_user_before_writing_the_assignment_that_carries_it() -> None:
    c = _Cluster()
    c.submit("j-1")
    c.controller.tick()
    a = c.assignment("j-1")
    assert a is not None and a.etcd_user == "etrain-job-j-1" and a.etcd_password
    auth = c.server.auth
    assert auth.password("etrain-job-j-1") == a.etcd_password != "control-pw"
    assert auth.roles_of("etrain-job-j-1") == {"etrain-job-j-1"}
    assert auth.role_permissions("etrain-job-j-1") == sorted(
        job_permissions(c.store.keys, "j-1"), key=lambda p: (p.key, p.prefix)
    )
    kv, _ = c.client.get(identity_key(c.store.keys, "j-1"))
    assert kv is not None and IdentityRecord.model_validate_json(kv.value).ready


def test_a_cancelled_job_loses_its_etcd_user_role_and_record() -> None:
    c = _Cluster()
    c.submit("j-1")
    c.controller.tick()
    c.store.request_cancel("j-1", new_event("cancel_requested", "t", datetime.now(timezone.utc)))
    c.controller.tick()
    entry = c.store.get_job("j-1")
    assert entry is not None and entry.status.state == JobState.CANCELLED
    assert "etrain-job-j-1" not in c.client.user_list()
    with pytest.raises(EtcdError):
        c.client.role_permissions("etrain-job-j-1")
    assert c.client.get(identity_key(c.store.keys, "j-1"))[0] is None
    assert c.assignment("j-1") is None


def test_a_pass_that_died_midway_is_finished_by_the_next_with_the_stored_password() -> None:
    c = _Cluster()
    c.submit("j-1")
    # the record was written, the user made with another password (an older try), then the controller died
    half = _record("j-1", ready=False)
    c.client.put(identity_key(c.store.keys, "j-1"), half.model_dump_json().encode())
    c.client.user_add("etrain-job-j-1", "stale")
    c.controller.tick()
    a = c.assignment("j-1")
    assert a is not None and a.etcd_password == "pw-j-1" == c.server.auth.password("etrain-job-j-1")


def test_a_user_left_by_a_deposed_leader_for_a_finished_job_is_swept_when_a_leader_starts() -> None:
    c = _Cluster()
    c.submit("j-1")
    c.store.request_cancel("j-1", new_event("cancel_requested", "t", datetime.now(timezone.utc)))
    c.client.user_add("etrain-job-j-1", "late")  # no record: made after the revocation
    c.client.user_add("etrain-job-elsewhere-1", "x")  # a job of another service sharing this etcd
    c.controller.tick()
    c.controller.tick()
    assert c.client.user_list() == ["etrain-job-elsewhere-1"]


def test_without_an_etcd_password_jobs_get_no_user_of_their_own_and_start_up_warns_that_they_share_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = _Cluster(config=None)
    c.submit("j-1")
    c.controller.tick()
    a = c.assignment("j-1")
    assert a is not None and a.etcd_user is None and a.etcd_password is None
    assert c.client.user_list() == []
    with caplog.at_level(logging.WARNING, logger="service.controller.loop"):
        c.controller.start()
        c.controller.stop()
    assert any("jobs get its etcd identity" in r.getMessage() for r in caplog.records)


class _NoRootClient(MemoryEtcdClient):
    def role_add(self, name: str) -> bool:
        raise EtcdError("etcdserver: permission denied")

    def user_list(self) -> list[str]:
        raise EtcdError("etcdserver: permission denied")


def test_a_controller_whose_etcd_user_cannot_manage_users_assigns_nothing_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = _Cluster()
    c.client = _NoRootClient(c.server, PASSWORD_AUTH)
    c.store = ServiceStore(c.client, "/etrain")
    c.controller = Controller(c.store, Settings(etcd=EtcdOptions("memory:0"), prefix="/etrain", replica_id="c1"))
    c.submit("j-1")
    with caplog.at_level(logging.INFO):
        c.controller.tick()
        c.controller.tick()
    assert c.assignment("j-1") is None
    entry = c.store.get_job("j-1")
    assert entry is not None and entry.status.state == JobState.PENDING
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "needs the root role" in messages and "cannot make its etcd identity" in messages
