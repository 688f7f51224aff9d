"""The counting wrapper is the etcd client it wraps, users and roles included (the controller's identities
need them under password auth)."""

from __future__ import annotations

import pytest

from elastic.etcd.api import EtcdAuth, RolePermission, auth_of
from elastic.etcd.memory import MemoryEtcdClient
from elastic.testing.counting_etcd import CountingEtcdClient

pytestmark = pytest.mark.timeout(30)


def test_users_and_roles_go_to_the_inner_client_and_are_not_counted_as_key_traffic() -> None:
    inner = MemoryEtcdClient()
    counting = CountingEtcdClient(inner)
    auth = auth_of(counting)
    assert isinstance(counting, EtcdAuth)
    assert auth.user_add("job-a", "secret") is True
    assert auth.role_add("job-a-rw") is True
    auth.role_grant_permission("job-a-rw", RolePermission(key="/jobs/a/", perm="readwrite", prefix=True))
    auth.user_grant_role("job-a", "job-a-rw")
    assert auth_of(inner).user_list() == ["job-a"]  # the inner client's users, not a copy
    assert [p.key for p in auth_of(inner).role_permissions("job-a-rw")] == ["/jobs/a/"]
    with counting.record() as tally:
        auth.user_list()
        counting.put("/jobs/a/x", b"1")
    assert tally.by_op == {"put": 1}, tally  # the put only
