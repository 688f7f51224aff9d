"""The table that decides what the real client does with each gRPC failure from etcd."""

from __future__ import annotations

import grpc
import pytest

from elastic.etcd.grpc_errors import RpcFailure, classify, is_deadline

pytestmark = pytest.mark.timeout(10)

S = grpc.StatusCode


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (S.UNAVAILABLE, "failed to connect to all addresses"),
        (S.DEADLINE_EXCEEDED, "Deadline Exceeded"),
        # The server's own request context timed out while a new leader was elected (seen in CI when one
        # member of three stopped under a linearizable read).
        (S.UNKNOWN, "context deadline exceeded"),
        (S.UNAVAILABLE, "etcdserver: request timed out"),
        (S.UNKNOWN, "etcdserver: request timed out"),
        (S.UNKNOWN, "etcdserver: leader changed"),
        (S.UNAVAILABLE, "etcdserver: no leader"),
        (S.RESOURCE_EXHAUSTED, "etcdserver: too many requests"),
        (S.UNKNOWN, "etcdserver: timed out waiting for read index"),
        (S.INVALID_ARGUMENT, "etcdserver: revision of auth store is old"),
        # several etcd-bootstraps at once (a fresh-clone run, 2026-12-06): the stream ended without a status
        (S.UNKNOWN, "No status received"),
    ],
)
def test_transient_refusals_during_an_election_are_retried(code: grpc.StatusCode, details: str) -> None:
    assert classify(code, details) is RpcFailure.RETRY


@pytest.mark.parametrize(
    ("code", "details"),
    [(S.UNAUTHENTICATED, "etcdserver: invalid auth token"), (S.INVALID_ARGUMENT, "etcdserver: invalid auth token")],
)
def test_an_expired_token_makes_the_client_log_in_again(code: grpc.StatusCode, details: str) -> None:
    assert classify(code, details) is RpcFailure.REAUTHENTICATE


def test_auth_not_yet_on_for_a_client_with_a_user_is_waited_for() -> None:
    assert classify(S.FAILED_PRECONDITION, "etcdserver: authentication is not enabled") is RpcFailure.AUTH_OFF


def test_a_missing_lease_is_reported_as_gone_not_retried() -> None:
    assert classify(S.NOT_FOUND, "etcdserver: requested lease not found") is RpcFailure.LEASE_GONE


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (S.PERMISSION_DENIED, "etcdserver: permission denied"),
        (S.INVALID_ARGUMENT, "etcdserver: duplicate key given in txn request"),
        (S.FAILED_PRECONDITION, "etcdserver: user name already exists"),
        (S.UNKNOWN, "something else broke"),
        (S.NOT_FOUND, "etcdserver: user name not found"),
        (None, "no status at all"),
    ],
)
def test_real_refusals_fail_at_once(code: grpc.StatusCode | None, details: str) -> None:
    assert classify(code, details) is RpcFailure.REFUSED


def test_a_watch_cut_by_its_own_deadline_is_a_timeout() -> None:
    assert is_deadline(S.DEADLINE_EXCEEDED, "")
    assert is_deadline(S.UNKNOWN, "context deadline exceeded")
    assert not is_deadline(S.UNKNOWN, "etcdserver: leader changed")
    assert not is_deadline(S.UNAVAILABLE, "deadline")
