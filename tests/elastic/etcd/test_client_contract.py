"""The EtcdClient contract, run against both implementations: gRPC on a real etcd, and the in-memory model.

The clusters are ``conftest.py``'s. The real half uses the session's shared etcd, so revisions are compared
with each other, never with absolute numbers, and every test keeps to its own key prefix. Lease time is a
:class:`~elastic.etcd.ManualClock` in the memory half, real time (a real etcd raises a 1 s TTL to 2 s) in
the real half.
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import timedelta

import pytest

from elastic.etcd import (
    Compare,
    CompareOp,
    CompareTarget,
    DeleteOp,
    EtcdAuth,
    EtcdClient,
    EtcdClientClosedError,
    EtcdConfig,
    EtcdConnectionError,
    EtcdError,
    EtcdLeaseNotFoundError,
    GetOp,
    GetResult,
    KeyValue,
    PutOp,
    TxnOp,
    TxnResult,
)
from elastic.etcd.api import RolePermission
from elastic.testing.wait import wait_until
from tests.elastic.etcd.conftest import Cluster, later, watch_in_thread

pytestmark = pytest.mark.timeout(60)

SHORT = timedelta(seconds=0.3)


# -- identity ----------------------------------------------------------------------------------------
def test_config_and_endpoints_label_describe_the_cluster(client: EtcdClient) -> None:
    assert isinstance(client.config, EtcdConfig)
    assert isinstance(client.endpoints_label, str) and client.endpoints_label


def test_ping_returns_the_current_revision(client: EtcdClient, key_prefix: str) -> None:
    revision = client.put(key_prefix + "/k", b"v")
    assert client.ping() >= revision
    assert client.ping(timeout=timedelta(seconds=2)) == client.get(key_prefix + "/k")[1]


def test_close_is_final_requests_and_waits_raise_closed_and_a_running_watch_returns(
    client: EtcdClient, key_prefix: str
) -> None:
    # a thread its owner did not stop must not re-open a connection that nobody would close (each leaked gRPC
    # channel keeps reconnecting and pinging: a suite's worker once spent 0.8 cores on them, idle)
    start = client.put(key_prefix + "/k", b"v")
    seen, stop, watcher = watch_in_thread(client, key_prefix + "/", start + 1, prefix=True)
    client.put(key_prefix + "/k", b"v2")
    assert seen.wait_for(start + 1, 10), seen.seen
    client.close()
    client.close()  # idempotent
    watcher.join(10)
    assert not watcher.is_alive() and not stop.is_set()  # ended by the close alone
    for request in (
        lambda: client.get(key_prefix + "/k"),
        lambda: client.put(key_prefix + "/k", b"v3"),
        client.ping,
        lambda: client.grant_lease(timedelta(seconds=5)),
        lambda: client.wait_for_event(key_prefix + "/k", 0, SHORT),
    ):
        with pytest.raises(EtcdClientClosedError, match="closed"):
            request()
    with pytest.raises(EtcdConnectionError):  # a connection error to callers that handle those
        client.get(key_prefix + "/k")


# -- revisions ---------------------------------------------------------------------------------------
def test_put_returns_a_new_revision_that_get_reports_as_create_and_mod_revision(
    client: EtcdClient, key_prefix: str
) -> None:
    before = client.ping()
    revision = client.put(key_prefix + "/k", b"v1")
    assert revision == before + 1
    kv, read_at = client.get(key_prefix + "/k")
    assert kv is not None
    assert kv == KeyValue(key_prefix + "/k", b"v1", revision, revision, lease=0, version=1)
    assert read_at == revision


def test_overwrite_keeps_create_revision_and_raises_mod_revision_and_version(
    client: EtcdClient, key_prefix: str
) -> None:
    first = client.put(key_prefix + "/k", b"v1")
    second = client.put(key_prefix + "/k", b"v1")  # the same value is still a write
    kv, _ = client.get(key_prefix + "/k")
    assert kv is not None
    assert second == first + 1
    assert (kv.create_revision, kv.mod_revision, kv.version) == (first, second, 2)


def test_get_of_a_missing_key_returns_none_at_the_current_revision(client: EtcdClient, key_prefix: str) -> None:
    revision = client.put(key_prefix + "/other", b"v")
    assert client.get(key_prefix + "/missing") == (None, revision)


def test_reads_leave_the_revision_unchanged(client: EtcdClient, key_prefix: str) -> None:
    revision = client.put(key_prefix + "/a", b"1")
    client.get(key_prefix + "/a")
    client.get_prefix(key_prefix + "/")
    client.count_prefix(key_prefix + "/")
    client.get_with_prefix(key_prefix + "/a", key_prefix + "/")
    client.read_prefixes([key_prefix + "/", key_prefix + "/b"])
    assert client.ping() == revision


def test_delete_reports_whether_the_key_existed_and_only_a_real_delete_raises_the_revision(
    client: EtcdClient, key_prefix: str
) -> None:
    put_at = client.put(key_prefix + "/k", b"v")
    assert client.delete(key_prefix + "/k") is True
    assert client.ping() == put_at + 1
    assert client.delete(key_prefix + "/k") is False
    assert client.ping() == put_at + 1
    assert client.get(key_prefix + "/k")[0] is None


def test_a_recreated_key_gets_a_new_create_revision_and_version_one(client: EtcdClient, key_prefix: str) -> None:
    client.put(key_prefix + "/k", b"1")
    client.put(key_prefix + "/k", b"2")
    client.delete(key_prefix + "/k")
    again = client.put(key_prefix + "/k", b"3")
    kv, _ = client.get(key_prefix + "/k")
    assert kv is not None and (kv.create_revision, kv.mod_revision, kv.version) == (again, again, 1)


def test_an_empty_key_is_refused_with_etcd_error(client: EtcdClient) -> None:
    with pytest.raises(EtcdError):
        client.get("")
    with pytest.raises(EtcdError):
        client.put("", b"v")


# -- prefixes ----------------------------------------------------------------------------------------
def test_get_prefix_returns_the_keys_under_the_prefix_in_byte_order(client: EtcdClient, key_prefix: str) -> None:
    p = key_prefix + "/d/"
    for name in ("b", "é", "a/x", "a", "Z"):
        client.put(p + name, name.encode())
    kvs, revision = client.get_prefix(p)
    assert [kv.key for kv in kvs] == [p + "Z", p + "a", p + "a/x", p + "b", p + "é"]
    assert revision == client.ping()


def test_a_prefix_ends_at_its_last_byte_plus_one_so_siblings_and_the_bare_prefix_are_outside(
    client: EtcdClient, key_prefix: str
) -> None:
    base = key_prefix + "/a"
    for key in (base, base + "/x", base + "b", base + "0", key_prefix + "/b", key_prefix + "/a/"):
        client.put(key, b"v")
    under_slash = [kv.key for kv in client.get_prefix(base + "/")[0]]
    assert under_slash == [base + "/", base + "/x"]  # not "/a" itself, not "/a0" ("0" follows "/")
    under_bare = [kv.key for kv in client.get_prefix(base)[0]]
    assert under_bare == [base, base + "/", base + "/x", base + "0", base + "b"]


def test_count_prefix_counts_only_the_keys_under_the_prefix(client: EtcdClient, key_prefix: str) -> None:
    for key in ("/c/1", "/c/2", "/c/3/x", "/c0", "/d"):
        client.put(key_prefix + key, b"v")
    assert client.count_prefix(key_prefix + "/c/") == 3
    assert client.count_prefix(key_prefix + "/none/") == 0


def test_get_with_prefix_reads_the_key_and_the_prefix_at_one_revision(client: EtcdClient, key_prefix: str) -> None:
    client.put(key_prefix + "/state", b"s")
    client.put(key_prefix + "/alive/1", b"")
    last = client.put(key_prefix + "/alive/2", b"")
    kv, alive, revision = client.get_with_prefix(key_prefix + "/state", key_prefix + "/alive/")
    assert kv is not None and kv.value == b"s"
    assert [a.key for a in alive] == [key_prefix + "/alive/1", key_prefix + "/alive/2"]
    assert revision == last
    missing, nothing, _ = client.get_with_prefix(key_prefix + "/nostate", key_prefix + "/none/")
    assert missing is None and nothing == []


def test_read_prefixes_returns_one_list_per_prefix_in_the_order_asked(client: EtcdClient, key_prefix: str) -> None:
    client.put(key_prefix + "/x/1", b"1")
    last = client.put(key_prefix + "/y/1", b"2")
    (ys, empty, xs), revision = client.read_prefixes([key_prefix + "/y/", key_prefix + "/z/", key_prefix + "/x/"])
    assert [kv.value for kv in ys] == [b"2"] and empty == [] and [kv.value for kv in xs] == [b"1"]
    assert revision == last


# -- compare_and_put ---------------------------------------------------------------------------------
def test_compare_and_put_with_mod_revision_zero_creates_only_a_missing_key(client: EtcdClient, key_prefix: str) -> None:
    ok, kv, _, revision = client.compare_and_put(key_prefix + "/k", b"first", mod_revision=0)
    assert ok and kv is not None and kv.value == b"first" and kv.create_revision == revision
    ok, kv, _, again = client.compare_and_put(key_prefix + "/k", b"second", mod_revision=0)
    assert not ok and kv is not None and kv.value == b"first"
    assert again == revision  # a failed comparison writes nothing


def test_compare_and_put_fails_on_a_stale_mod_revision_and_returns_the_current_value(
    client: EtcdClient, key_prefix: str
) -> None:
    first = client.put(key_prefix + "/k", b"1")
    current = client.put(key_prefix + "/k", b"2")
    ok, kv, _, revision = client.compare_and_put(key_prefix + "/k", b"3", mod_revision=first)
    assert not ok and kv is not None and (kv.value, kv.mod_revision) == (b"2", current)
    assert revision == current


def test_compare_and_put_on_the_current_mod_revision_writes_and_returns_the_new_value(
    client: EtcdClient, key_prefix: str
) -> None:
    current = client.put(key_prefix + "/k", b"1")
    ok, kv, _, revision = client.compare_and_put(key_prefix + "/k", b"2", mod_revision=current)
    assert ok and revision == current + 1
    assert kv == KeyValue(key_prefix + "/k", b"2", current, revision, lease=0, version=2)


def test_compare_and_put_reads_the_prefix_in_the_same_transaction(client: EtcdClient, key_prefix: str) -> None:
    client.put(key_prefix + "/m/a", b"a")
    ok, _, under, _ = client.compare_and_put(key_prefix + "/m/b", b"b", mod_revision=0, read_prefix=key_prefix + "/m/")
    assert ok and [kv.key for kv in under] == [key_prefix + "/m/a", key_prefix + "/m/b"]  # sees its own put
    ok, _, under, _ = client.compare_and_put(key_prefix + "/m/b", b"c", mod_revision=0, read_prefix=key_prefix + "/m/")
    assert not ok and [kv.value for kv in under] == [b"a", b"b"]  # the current values on failure


def test_compare_and_put_refuses_a_stale_fencing_guard_and_writes_nothing(client: EtcdClient, key_prefix: str) -> None:
    fence_at = client.put(key_prefix + "/leader", b"a")
    ok, _, _, _ = client.compare_and_put(
        key_prefix + "/k", b"1", mod_revision=0, guard=(key_prefix + "/leader", fence_at)
    )
    assert ok
    client.delete(key_prefix + "/leader")
    client.put(key_prefix + "/leader", b"b")  # recreated: a new create revision
    kv, _ = client.get(key_prefix + "/k")
    assert kv is not None
    ok, cur, _, _ = client.compare_and_put(
        key_prefix + "/k", b"2", mod_revision=kv.mod_revision, guard=(key_prefix + "/leader", fence_at)
    )
    assert not ok and cur is not None and cur.value == b"1"


def test_compare_and_put_attaches_the_lease_to_the_key(client: EtcdClient, key_prefix: str) -> None:
    lease = client.grant_lease(timedelta(seconds=10))
    ok, kv, _, _ = client.compare_and_put(key_prefix + "/k", b"v", mod_revision=0, lease=lease)
    assert ok and kv is not None and kv.lease == lease
    client.revoke_lease(lease)
    assert client.get(key_prefix + "/k")[0] is None


def test_a_put_on_a_gone_lease_is_refused_and_writes_nothing(client: EtcdClient, key_prefix: str) -> None:
    lease = client.grant_lease(timedelta(seconds=10))
    client.revoke_lease(lease)
    before = client.ping()
    with pytest.raises(EtcdLeaseNotFoundError):
        client.put(key_prefix + "/k", b"v", lease=lease)
    with pytest.raises(EtcdLeaseNotFoundError):
        client.compare_and_put(key_prefix + "/k", b"v", mod_revision=0, lease=lease)
    assert client.get(key_prefix + "/k") == (None, before)


# -- commit ------------------------------------------------------------------------------------------
def test_commit_applies_puts_deletes_and_prefix_deletes_in_one_revision(client: EtcdClient, key_prefix: str) -> None:
    for key in ("/gone", "/r/1", "/r/2", "/r0"):
        client.put(key_prefix + key, b"old")
    before = client.ping()
    ok, revision = client.commit(
        [(key_prefix + "/new", b"n"), (key_prefix + "/r0", b"kept")],
        [key_prefix + "/gone"],
        delete_prefixes=[key_prefix + "/r/"],
    )
    assert ok and revision == before + 1
    kvs, _ = client.get_prefix(key_prefix + "/")
    assert {kv.key: (kv.value, kv.mod_revision) for kv in kvs} == {
        key_prefix + "/new": (b"n", revision),
        key_prefix + "/r0": (b"kept", revision),
    }


def test_commit_with_a_failed_expectation_applies_nothing_and_keeps_the_revision(
    client: EtcdClient, key_prefix: str
) -> None:
    stale = client.put(key_prefix + "/status", b"1")
    client.put(key_prefix + "/status", b"2")
    client.put(key_prefix + "/doomed", b"d")
    before = client.ping()
    ok, revision = client.commit(
        [(key_prefix + "/status", b"3")], [key_prefix + "/doomed"], expect=[(key_prefix + "/status", stale)]
    )
    assert (ok, revision) == (False, before)
    assert [kv.value for kv in client.get_prefix(key_prefix + "/")[0]] == [b"d", b"2"]


def test_commit_expecting_revision_zero_requires_the_key_to_be_absent(client: EtcdClient, key_prefix: str) -> None:
    ok, _ = client.commit([(key_prefix + "/job", b"1")], expect=[(key_prefix + "/job", 0)])
    assert ok
    ok, _ = client.commit([(key_prefix + "/job", b"2")], expect=[(key_prefix + "/job", 0)])
    assert not ok
    assert client.get(key_prefix + "/job")[0].value == b"1"  # type: ignore[union-attr]


def test_commit_guard_fails_once_the_fencing_key_is_deleted_or_recreated(client: EtcdClient, key_prefix: str) -> None:
    fence = (key_prefix + "/leader", client.put(key_prefix + "/leader", b"a"))
    assert client.commit([(key_prefix + "/x", b"1")], guard=fence)[0]
    client.put(key_prefix + "/leader", b"a again")  # rewritten, not recreated: the token holds
    assert client.commit([(key_prefix + "/x", b"2")], guard=fence)[0]
    client.delete(key_prefix + "/leader")
    assert not client.commit([(key_prefix + "/x", b"3")], guard=fence)[0]
    client.put(key_prefix + "/leader", b"b")
    assert not client.commit([(key_prefix + "/x", b"4")], guard=fence)[0]
    assert client.get(key_prefix + "/x")[0].value == b"2"  # type: ignore[union-attr]


def test_commit_that_changes_nothing_keeps_the_revision(client: EtcdClient, key_prefix: str) -> None:
    before = client.put(key_prefix + "/k", b"v")
    result = client.commit(deletes=[key_prefix + "/missing"], delete_prefixes=[key_prefix + "/none/"])
    assert result == (True, before)


def test_commit_puts_carry_no_lease_and_so_detach_the_key(client: EtcdClient, key_prefix: str) -> None:
    lease = client.grant_lease(timedelta(seconds=10))
    client.put(key_prefix + "/k", b"leased", lease=lease)
    client.commit([(key_prefix + "/k", b"plain")])
    client.revoke_lease(lease)
    kv, _ = client.get(key_prefix + "/k")
    assert kv is not None and (kv.value, kv.lease) == (b"plain", 0)


def test_a_transaction_of_more_than_128_operations_is_refused_whole(client: EtcdClient, key_prefix: str) -> None:
    before = client.ping()
    assert client.commit([(key_prefix + f"/n/{i:03d}", b"v") for i in range(128)])[0]
    with pytest.raises(EtcdError):
        client.commit([(key_prefix + f"/m/{i:03d}", b"v") for i in range(129)])
    assert client.count_prefix(key_prefix + "/m/") == 0 and client.ping() == before + 1


def test_a_transaction_that_writes_one_key_twice_is_refused(client: EtcdClient, key_prefix: str) -> None:
    with pytest.raises(EtcdError):
        client.commit([(key_prefix + "/k", b"1"), (key_prefix + "/k", b"2")])
    with pytest.raises(EtcdError):
        client.commit([(key_prefix + "/r/k", b"1")], delete_prefixes=[key_prefix + "/r/"])
    assert client.count_prefix(key_prefix + "/") == 0


def test_a_request_larger_than_the_cluster_accepts_is_refused(client: EtcdClient, key_prefix: str) -> None:
    with pytest.raises(EtcdError):
        client.put(key_prefix + "/big", b"x" * (3 * 1024 * 1024))
    assert client.get(key_prefix + "/big")[0] is None


# -- txn ---------------------------------------------------------------------------------------------
CREATE, MOD, VERSION, VALUE = CompareTarget.CREATE, CompareTarget.MOD, CompareTarget.VERSION, CompareTarget.VALUE
EQ, NE, LT, GT = CompareOp.EQUAL, CompareOp.NOT_EQUAL, CompareOp.LESS, CompareOp.GREATER


def test_txn_creates_a_key_only_if_absent_and_the_failure_branch_reads_the_winner(
    client: EtcdClient, key_prefix: str
) -> None:
    key = key_prefix + "/k"
    absent = [Compare(key, CREATE, EQ, 0)]
    first = client.txn(absent, [PutOp(key, b"1")], [GetOp(key)])
    assert first.succeeded and first.results == (None,)
    second = client.txn(absent, [PutOp(key, b"2")], [GetOp(key)])
    assert not second.succeeded and second.revision == first.revision
    assert second.get(0) == GetResult((KeyValue(key, b"1", first.revision, first.revision, version=1),), 1)
    with pytest.raises(TypeError):
        first.get(0)  # a put's result is no GetResult
    deleted = client.txn([Compare(key, VALUE, EQ, b"1"), Compare(key, VERSION, EQ, 1)], [DeleteOp(key)])
    assert deleted.succeeded and deleted.results == (1,) and deleted.revision == first.revision + 1


def test_a_compare_on_a_missing_key_or_an_empty_prefix_sees_one_zero_key_and_no_value(
    client: EtcdClient, key_prefix: str
) -> None:
    prefix = key_prefix + "/empty/"
    client.put(key_prefix + "/empty", b"bare")  # neither the bare prefix nor a sibling is under it
    client.put(key_prefix + "/empty0", b"sibling")

    def holds(target: CompareTarget, op: CompareOp, value: int | bytes, key: str = prefix) -> bool:
        return client.txn([Compare(key, target, op, value, prefix=key == prefix)], []).succeeded

    for key in (prefix, key_prefix + "/missing"):
        assert holds(CREATE, EQ, 0, key) and holds(MOD, EQ, 0, key) and holds(VERSION, EQ, 0, key)
        assert holds(MOD, LT, 1, key) and holds(CREATE, NE, 5, key)
        assert not holds(MOD, GT, 0, key) and not holds(CREATE, NE, 0, key)
        assert not holds(VALUE, EQ, b"", key) and not holds(VALUE, NE, b"", key)  # no value to compare


def test_a_range_compare_must_hold_for_every_key_under_the_prefix(client: EtcdClient, key_prefix: str) -> None:
    prefix = key_prefix + "/r/"
    first = client.put(prefix + "a", b"1")
    last = client.put(prefix + "b", b"2")
    client.put(key_prefix + "/r0", b"x")  # a sibling written later is outside the range
    quiet = [Compare(prefix, MOD, LT, last + 1, prefix=True)]  # nothing under the prefix written after `last`

    def holds(target: CompareTarget, op: CompareOp, value: int | bytes) -> bool:
        return client.txn([Compare(prefix, target, op, value, prefix=True)], []).succeeded

    assert client.txn(quiet, []).succeeded
    assert holds(VERSION, EQ, 1) and holds(CREATE, GT, first - 1) and not holds(CREATE, GT, first)
    assert holds(VALUE, GT, b"0") and not holds(VALUE, EQ, b"1")
    rewritten = client.put(prefix + "a", b"3")
    outcome = client.txn(quiet, [PutOp(prefix + "c", b"never")], [GetOp(prefix, prefix=True, count_only=True)])
    assert not outcome.succeeded and outcome.revision == rewritten and outcome.get(0).count == 2
    assert not holds(VERSION, EQ, 1) and holds(MOD, GT, first) and holds(MOD, LT, rewritten + 1)
    assert client.txn([Compare(prefix, MOD, LT, rewritten + 1, prefix=True)], []).succeeded


def test_txn_get_ops_count_only_keys_only_and_limit_report_the_total_count(client: EtcdClient, key_prefix: str) -> None:
    prefix = key_prefix + "/g/"
    for name in ("c", "a", "b"):
        client.put(prefix + name, b"v-" + name.encode())
    before = client.ping()
    result = client.txn(
        [],
        [
            GetOp(prefix, prefix=True),
            GetOp(prefix, prefix=True, count_only=True),
            GetOp(prefix, prefix=True, keys_only=True),
            GetOp(prefix, prefix=True, limit=2),
            GetOp(prefix, prefix=True, keys_only=True, limit=1),
            GetOp(prefix + "a"),
            GetOp(prefix + "missing"),
        ],
    )
    assert result.succeeded and result.revision == before and len(result.results) == 7
    full, counted, keys, limited, first_key, one, none = (result.get(i) for i in range(7))
    names = [prefix + "a", prefix + "b", prefix + "c"]
    assert [kv.key for kv in full.kvs] == names and full.count == 3
    assert [kv.value for kv in full.kvs] == [b"v-a", b"v-b", b"v-c"]
    assert counted == GetResult((), 3)
    assert keys.count == 3 and keys.kvs == tuple(replace(kv, value=b"") for kv in full.kvs)
    assert limited == GetResult(full.kvs[:2], 3)
    assert first_key == GetResult((replace(full.kvs[0], value=b""),), 3)
    assert one == GetResult(full.kvs[:1], 1)
    assert none == GetResult((), 0)


def test_txn_ops_apply_in_order_and_delete_ops_return_how_many_keys_they_deleted(
    client: EtcdClient, key_prefix: str
) -> None:
    for key in ("/d/1", "/d/2", "/d/3", "/single", "/d0"):
        client.put(key_prefix + key, b"old")
    before = client.ping()
    result = client.txn(
        [],
        [
            DeleteOp(key_prefix + "/d/", prefix=True),
            DeleteOp(key_prefix + "/single"),
            DeleteOp(key_prefix + "/missing"),
            DeleteOp(key_prefix + "/none/", prefix=True),
            PutOp(key_prefix + "/new", b"n"),
            GetOp(key_prefix + "/", prefix=True),
        ],
    )
    assert result.succeeded and result.revision == before + 1
    assert result.results[:5] == (3, 1, 0, 0, None)
    assert [(kv.key, kv.mod_revision) for kv in result.get(5).kvs] == [
        (key_prefix + "/d0", before),
        (key_prefix + "/new", before + 1),  # the read sees the branch's earlier put
    ]


def test_txn_raises_the_revision_by_one_only_when_the_branch_that_ran_wrote(
    client: EtcdClient, key_prefix: str
) -> None:
    key, other, doomed = key_prefix + "/k", key_prefix + "/other", key_prefix + "/doomed"
    client.put(doomed, b"d")
    before = client.put(key, b"v")
    assert client.txn([], []) == TxnResult(True, before, ())
    reads = client.txn([], [GetOp(key), DeleteOp(key_prefix + "/missing"), DeleteOp(key_prefix + "/no/", prefix=True)])
    assert reads.revision == before and reads.results[1:] == (0, 0)
    failed = client.txn([Compare(key, MOD, NE, before)], [PutOp(key, b"x")], [GetOp(key)])
    assert not failed.succeeded and failed.revision == before and failed.get(0).kvs[0].value == b"v"
    wrote = client.txn([Compare(key, MOD, EQ, before)], [PutOp(key, b"w"), PutOp(other, b"w"), DeleteOp(doomed)])
    assert wrote == TxnResult(True, before + 1, (None, None, 1))
    kvs, _ = client.get_prefix(key_prefix + "/")
    assert {kv.key: (kv.value, kv.mod_revision) for kv in kvs} == {key: (b"w", before + 1), other: (b"w", before + 1)}
    fallback = client.txn([Compare(key, VALUE, EQ, b"nope")], [], [PutOp(key, b"f")])  # the failure branch writes
    assert fallback == TxnResult(False, before + 2, (None,))


def test_a_txn_put_needs_a_live_lease_in_the_branch_that_runs_and_attaches_it(
    client: EtcdClient, key_prefix: str
) -> None:
    key, other = key_prefix + "/k", key_prefix + "/other"
    gone = client.grant_lease(timedelta(seconds=10))
    client.revoke_lease(gone)
    before = client.ping()
    with pytest.raises(EtcdLeaseNotFoundError):
        client.txn([], [PutOp(key, b"v", lease=gone)])
    with pytest.raises(EtcdLeaseNotFoundError):  # checked before anything of the branch is written
        client.txn([Compare(key, CREATE, NE, 0)], [], [PutOp(other, b"v"), PutOp(key, b"v", lease=gone)])
    assert client.get_prefix(key_prefix + "/") == ([], before)
    live = client.grant_lease(timedelta(seconds=10))
    result = client.txn([Compare(key, CREATE, EQ, 0)], [PutOp(key, b"v", lease=live)], [PutOp(key, b"x", lease=gone)])
    assert result.succeeded and result.revision == before + 1
    kv, _ = client.get(key)
    assert kv is not None and (kv.value, kv.lease) == (b"v", live)
    client.revoke_lease(live)
    assert client.get(key)[0] is None


def test_a_txn_of_more_than_128_compares_or_ops_in_either_branch_is_refused(
    client: EtcdClient, key_prefix: str
) -> None:
    key = key_prefix + "/k"
    before = client.ping()
    many = [PutOp(key_prefix + f"/n/{i:03d}", b"v") for i in range(128)]
    assert client.txn([Compare(key, CREATE, EQ, 0)] * 128, many, [GetOp(key)] * 128).revision == before + 1
    too_many = [PutOp(key_prefix + f"/m/{i:03d}", b"v") for i in range(129)]
    for compare, success, failure in (
        ([], too_many, []),
        ([Compare(key, CREATE, EQ, 0)] * 129, [PutOp(key, b"v")], []),
        ([], [PutOp(key, b"v")], [GetOp(key)] * 129),  # even in the branch that does not run
    ):
        with pytest.raises(EtcdError):
            client.txn(compare, success, failure)
    assert client.count_prefix(key_prefix + "/m/") == 0 and client.ping() == before + 1


def test_a_txn_refuses_an_empty_key_and_a_key_both_put_and_deleted(client: EtcdClient, key_prefix: str) -> None:
    cases: list[tuple[list[Compare], list[TxnOp]]] = [
        ([Compare("", CREATE, EQ, 0)], []),
        ([], [GetOp("")]),
        ([], [PutOp(key_prefix + "/r/k", b"v"), DeleteOp(key_prefix + "/r/", prefix=True)]),
        ([], [PutOp(key_prefix + "/k", b"1"), PutOp(key_prefix + "/k", b"2")]),
    ]
    for compare, ops in cases:
        with pytest.raises(EtcdError):
            client.txn(compare, ops)
    assert client.count_prefix(key_prefix + "/") == 0


def test_a_compare_checks_its_value_type_and_takes_its_target_and_op_as_strings() -> None:
    assert Compare("/k", "mod", "<", 3) == Compare("/k", MOD, LT, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Compare("/k", MOD, EQ, b"3")
    with pytest.raises(TypeError):
        Compare("/k", VALUE, EQ, 3)
    with pytest.raises(ValueError):
        Compare("/k", "lease", EQ, 3)  # type: ignore[arg-type]


# -- leases ------------------------------------------------------------------------------------------
def test_a_granted_lease_has_an_id_and_keep_alive_reports_a_positive_ttl(client: EtcdClient) -> None:
    lease = client.grant_lease(timedelta(seconds=5))
    try:
        assert lease != 0
        assert 1 <= client.keep_alive_once(lease) <= 5
    finally:
        client.revoke_lease(lease)


def test_revoking_a_lease_deletes_its_keys_in_one_revision(client: EtcdClient, key_prefix: str) -> None:
    lease = client.grant_lease(timedelta(seconds=10))
    client.put(key_prefix + "/a", b"1", lease=lease)
    before = client.put(key_prefix + "/b", b"2", lease=lease)
    client.put(key_prefix + "/c", b"3")
    client.revoke_lease(lease)
    kvs, revision = client.get_prefix(key_prefix + "/")
    assert [kv.key for kv in kvs] == [key_prefix + "/c"]
    assert revision == before + 2  # the unleased put, then one revision for both deletions


def test_revoking_a_gone_lease_does_nothing_and_keep_alive_reports_it_gone(client: EtcdClient) -> None:
    lease = client.grant_lease(timedelta(seconds=10))
    client.revoke_lease(lease)
    client.revoke_lease(lease)
    assert client.keep_alive_once(lease) <= 0


def test_putting_without_a_lease_detaches_the_key_from_its_lease(client: EtcdClient, key_prefix: str) -> None:
    lease = client.grant_lease(timedelta(seconds=10))
    client.put(key_prefix + "/k", b"leased", lease=lease)
    client.put(key_prefix + "/k", b"plain")
    client.revoke_lease(lease)
    kv, _ = client.get(key_prefix + "/k")
    assert kv is not None and kv.value == b"plain"


def test_an_expired_lease_deletes_its_keys(cluster: Cluster, client: EtcdClient, key_prefix: str) -> None:
    lease = client.grant_lease(timedelta(seconds=1))
    client.put(key_prefix + "/k", b"v", lease=lease)
    client.put(key_prefix + "/plain", b"v")
    cluster.advance(2.5)  # past any TTL a cluster gives a 1 s request (a real etcd's minimum is 2 s)
    assert wait_until(lambda: client.get(key_prefix + "/k")[0] is None, timeout=6)
    assert client.get(key_prefix + "/plain")[0] is not None
    assert client.keep_alive_once(lease) <= 0


def test_keep_alive_once_postpones_expiry(cluster: Cluster, client: EtcdClient, key_prefix: str) -> None:
    lease = client.grant_lease(timedelta(seconds=3))
    ttl = client.keep_alive_once(lease)
    client.put(key_prefix + "/k", b"v", lease=lease)
    cluster.advance(ttl * 0.6)
    assert client.keep_alive_once(lease) == ttl
    cluster.advance(ttl * 0.6)  # past the first deadline, within the refreshed one
    assert client.get(key_prefix + "/k")[0] is not None
    cluster.advance(ttl * 0.6)
    assert wait_until(lambda: client.get(key_prefix + "/k")[0] is None, timeout=6)


# -- watches -----------------------------------------------------------------------------------------
def test_wait_for_event_wakes_on_a_later_write_before_its_timeout(client: EtcdClient, key_prefix: str) -> None:
    key = key_prefix + "/k"
    _, revision = client.get(key)
    later(0.3, lambda: client.put(key, b"v"))
    started = time.monotonic()
    assert client.wait_for_event(key, revision + 1, timedelta(seconds=20)) is True
    assert time.monotonic() - started < 10


def test_wait_for_event_counts_a_change_already_made_at_the_start_revision(client: EtcdClient, key_prefix: str) -> None:
    revision = client.put(key_prefix + "/k", b"v")
    client.put(key_prefix + "/other", b"v")
    assert client.wait_for_event(key_prefix + "/k", revision, SHORT) is True
    assert client.wait_for_event(key_prefix + "/k", revision + 1, SHORT) is False


def test_wait_for_event_returns_false_at_its_timeout_when_nothing_changes(client: EtcdClient, key_prefix: str) -> None:
    started = time.monotonic()
    assert client.wait_for_event(key_prefix + "/quiet", client.ping() + 1, SHORT) is False
    assert time.monotonic() - started >= SHORT.total_seconds() * 0.9


def test_wait_for_event_from_revision_zero_ignores_the_past(client: EtcdClient, key_prefix: str) -> None:
    client.put(key_prefix + "/k", b"v")
    assert client.wait_for_event(key_prefix + "/k", 0, SHORT) is False


def test_wait_for_event_on_a_prefix_wakes_for_a_key_under_it_but_not_for_a_sibling(
    client: EtcdClient, key_prefix: str
) -> None:
    start = client.ping() + 1
    client.put(key_prefix + "/w0", b"sibling")
    assert client.wait_for_event(key_prefix + "/w/", start, SHORT, prefix=True) is False
    later(0.2, lambda: client.put(key_prefix + "/w/deep/key", b"v"))
    assert client.wait_for_event(key_prefix + "/w/", start, timedelta(seconds=20), prefix=True) is True


def test_wait_for_event_on_one_key_ignores_the_keys_under_it(client: EtcdClient, key_prefix: str) -> None:
    start = client.ping() + 1
    client.put(key_prefix + "/k/child", b"v")
    assert client.wait_for_event(key_prefix + "/k", start, SHORT) is False


def test_wait_for_event_wakes_on_a_delete(client: EtcdClient, key_prefix: str) -> None:
    revision = client.put(key_prefix + "/k", b"v")
    later(0.2, lambda: client.delete(key_prefix + "/k"))
    assert client.wait_for_event(key_prefix + "/k", revision + 1, timedelta(seconds=20)) is True


def test_wait_for_event_wakes_when_a_lease_expiry_deletes_the_key(
    cluster: Cluster, client: EtcdClient, key_prefix: str
) -> None:
    lease = client.grant_lease(timedelta(seconds=1))
    revision = client.put(key_prefix + "/k", b"v", lease=lease)
    if cluster.kind == "memory":
        later(0.2, lambda: cluster.advance(2.5))  # a waiter notices a clock's move within memory.TICK
    assert client.wait_for_event(key_prefix + "/k", revision + 1, timedelta(seconds=20)) is True
    assert client.get(key_prefix + "/k")[0] is None


def test_a_second_client_of_the_cluster_sees_the_writes_and_wakes_the_watches_of_the_first(
    cluster: Cluster, client: EtcdClient, key_prefix: str
) -> None:
    other = cluster.new_client()
    start = client.ping() + 1
    writer = later(0.2, lambda: other.put(key_prefix + "/k", b"from other"))
    assert client.wait_for_event(key_prefix + "/k", start, timedelta(seconds=20)) is True
    assert client.get(key_prefix + "/k")[0].value == b"from other"  # type: ignore[union-attr]
    writer.join(20)  # a put applied but not yet answered (a loaded machine) retries: other must stay open till then


def test_watch_revisions_replays_from_its_start_then_reports_new_changes_in_increasing_order(
    client: EtcdClient, key_prefix: str
) -> None:
    first = client.put(key_prefix + "/s/a", b"1")
    seen, stop, thread = watch_in_thread(client, key_prefix + "/s/", first, prefix=True)
    try:
        assert seen.wait_for(first)
        last = 0
        for i in range(3):
            last = client.put(key_prefix + f"/s/{i}", b"v")
        client.put(key_prefix + "/s0", b"sibling")  # outside the prefix
        assert seen.wait_for(last)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert seen.seen == sorted(set(seen.seen)) and seen.seen[0] == first and seen.seen[-1] == last


def test_watch_revisions_returns_promptly_once_stop_is_set(client: EtcdClient, key_prefix: str) -> None:
    seen, stop, thread = watch_in_thread(client, key_prefix + "/quiet", client.ping() + 1, prefix=False)
    time.sleep(0.2)
    started = time.monotonic()
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - started < 5
    assert seen.seen == []


# -- users and roles ---------------------------------------------------------------------------------
def _name(key_prefix: str, kind: str) -> str:
    """A user or role name no other test uses (users and roles are cluster-wide, not under a prefix)."""
    return f"etrain-test-{kind}-{key_prefix.rsplit('/', 1)[-1]}"


def test_user_add_creates_a_user_once_and_user_delete_removes_it_once(auth: EtcdAuth, key_prefix: str) -> None:
    user = _name(key_prefix, "u")
    assert auth.user_add(user, "pw-1") is True
    try:
        assert auth.user_add(user, "pw-2") is False  # exists: a retry after a lost answer meets its effect
        assert user in auth.user_list()
        auth.user_change_password(user, "pw-3")
    finally:
        assert auth.user_delete(user) is True
    assert auth.user_delete(user) is False
    assert user not in auth.user_list()


def test_password_change_and_role_grant_of_a_missing_user_or_role_are_refused(auth: EtcdAuth, key_prefix: str) -> None:
    user, role = _name(key_prefix, "u"), _name(key_prefix, "r")
    with pytest.raises(EtcdError):
        auth.user_change_password(user, "pw")
    with pytest.raises(EtcdError):
        auth.role_grant_permission(role, RolePermission(key_prefix + "/k", "read"))
    auth.user_add(user, "pw")
    try:
        with pytest.raises(EtcdError):
            auth.user_grant_role(user, role)
        assert auth.role_add(role) is True
        auth.user_grant_role(user, role)
        auth.user_grant_role(user, role)  # again: nothing changes
    finally:
        auth.user_delete(user)
        auth.role_delete(role)


def test_a_role_keeps_its_grants_by_key_and_a_second_grant_of_one_range_replaces_its_permission(
    auth: EtcdAuth, key_prefix: str
) -> None:
    role = _name(key_prefix, "r")
    assert auth.role_add(role) is True
    try:
        assert auth.role_add(role) is False
        auth.role_grant_permission(role, RolePermission(key_prefix + "/a/", "readwrite", prefix=True))
        auth.role_grant_permission(role, RolePermission(key_prefix + "/b", "read"))
        auth.role_grant_permission(role, RolePermission(key_prefix + "/b", "write"))
        assert auth.role_permissions(role) == [
            RolePermission(key_prefix + "/a/", "readwrite", prefix=True),
            RolePermission(key_prefix + "/b", "write"),
        ]
    finally:
        assert auth.role_delete(role) is True
    assert auth.role_delete(role) is False
    with pytest.raises(EtcdError):
        auth.role_permissions(role)


def test_managing_users_and_roles_changes_no_revision(client: EtcdClient, auth: EtcdAuth, key_prefix: str) -> None:
    user, role = _name(key_prefix, "u"), _name(key_prefix, "r")
    revision = client.put(key_prefix + "/k", b"v")
    auth.user_add(user, "pw")
    auth.role_add(role)
    auth.role_grant_permission(role, RolePermission(key_prefix + "/", "read", prefix=True))
    auth.user_grant_role(user, role)
    auth.user_delete(user)
    auth.role_delete(role)
    assert client.ping() == revision


# -- reads in pages (no size of a prefix breaks a read) ------------------------------------------------
def test_a_prefix_larger_than_a_grpc_answer_is_read_whole_in_key_order(client: EtcdClient, key_prefix: str) -> None:
    """6 MiB under one prefix: one answer may carry 4 MiB (gRPC's default), and the read failed with
    ``Received message larger than max`` (the controller's list of jobs, after enough of them)."""
    big = b"x" * (60 * 1024)
    keys = [f"{key_prefix}/jobs/{i:04d}" for i in range(100)]
    for i in range(0, len(keys), 10):
        client.commit([(k, big) for k in keys[i : i + 10]])
    kvs, revision = client.get_prefix(key_prefix + "/jobs/")
    assert [kv.key for kv in kvs] == keys and all(kv.value == big for kv in kvs)
    (jobs, other), revision2 = client.read_prefixes([key_prefix + "/jobs/", key_prefix + "/none/"])
    assert [kv.key for kv in jobs] == keys and other == [] and revision2 == revision
    head, under, _ = client.get_with_prefix(keys[0], key_prefix + "/jobs/")
    assert head is not None and head.key == keys[0] and len(under) == 100


def test_more_keys_than_a_page_are_read_whole(client: EtcdClient, key_prefix: str) -> None:
    from elastic.etcd.api import READ_PAGE_KEYS

    n = READ_PAGE_KEYS * 2 + 7
    keys = [f"{key_prefix}/k/{i:05d}" for i in range(n)]
    for i in range(0, n, 100):
        client.commit([(k, b"v") for k in keys[i : i + 100]])
    (kvs, few), _ = client.read_prefixes([key_prefix + "/k/", key_prefix + "/k/0000"])
    assert [kv.key for kv in kvs] == keys
    assert [kv.key for kv in few] == keys[:10]


def test_a_read_at_a_past_revision_sees_the_keys_as_they_were_and_after_skips_to_the_next_page(
    client: EtcdClient, key_prefix: str
) -> None:
    p = key_prefix + "/p/"
    before = client.commit([(p + "a", b"1"), (p + "b", b"1"), (p + "c", b"1")])[1]
    client.commit([(p + "b", b"2"), (p + "d", b"2")], [p + "a"])
    then = client.txn([], [GetOp(p, prefix=True, revision=before)]).get(0)
    assert [(kv.key, kv.value) for kv in then.kvs] == [(p + "a", b"1"), (p + "b", b"1"), (p + "c", b"1")]
    page = client.txn([], [GetOp(p, prefix=True, after=p + "a", revision=before, limit=1)]).get(0)
    assert [kv.key for kv in page.kvs] == [p + "b"] and page.count == 2  # b and c are after a, then
    now = client.txn([], [GetOp(p, prefix=True, after=p + "b")]).get(0)
    assert [(kv.key, kv.value) for kv in now.kvs] == [(p + "c", b"1"), (p + "d", b"2")]
    with pytest.raises(ValueError):
        GetOp(p, after=p + "a")  # a page needs a prefix
