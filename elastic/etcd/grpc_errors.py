"""What a gRPC failure from etcd means for the call that got it: one pure decision, apart from the client.

:func:`classify` reads a status code and its details and answers with a :class:`RpcFailure`; the client in
:mod:`elastic.etcd.client` acts on it (retry, authenticate again, raise). Keeping the table here gives it
one home and a unit test without a server.

etcd's transient refusals, all retried until the operation's deadline:

- ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED``: no connection, or the call's own gRPC timeout.
- ``UNKNOWN`` with "context deadline exceeded": the *server's* request context timed out, typically a
  linearizable read waiting for a read index while the cluster elects a new leader after losing a member.
- "etcdserver: request timed out", "leader changed", "no leader", "too many requests", "timed out waiting
  for read index": the same election window, named by etcd (``rpctypes`` in etcd's ``api/v3rpc``).
- ``INVALID_ARGUMENT`` "revision of auth store is old": a user or role changed while the request was in
  flight; etcd refused it unapplied (the Go client retries this too).
- ``UNKNOWN`` "No status received": the call's stream ended without a status (seen while users and roles changed
  under concurrent requests).
- ``FAILED_PRECONDITION`` "authentication is not enabled" to a client that has a user: etcd's users are about to
  be turned on (the chart's agents may start before the controller's ``etrain etcd-bootstrap`` has run). The
  client logs in again until the deadline, then says what it waited for.

A retried write is safe in this project: puts are idempotent and every compare-and-set compares a value or
revision, so a write that did apply before its answer was lost makes the retry's compare fail, which the
callers already read as "someone else got there".
"""

from __future__ import annotations

from enum import Enum

import grpc

__all__ = ["RpcFailure", "classify", "is_deadline"]

AUTH_OLD_REVISION = "revision of auth store is old"
LEASE_NOT_FOUND = "requested lease not found"
AUTH_NOT_ENABLED = "authentication is not enabled"
TOO_LARGE = "larger than max"  # gRPC's "Received message larger than max (4195544 vs. 4194304)"
COMPACTED = "required revision has been compacted"

_TRANSIENT_DETAILS = (
    "context deadline exceeded",
    "etcdserver: request timed out",
    "etcdserver: leader changed",
    "etcdserver: no leader",
    "etcdserver: too many requests",
    "etcdserver: timed out waiting for read index",
    "etcdserver: server stopped",
    AUTH_OLD_REVISION,
    # the call's stream ended without a status (gRPC's own words): seen while several `etrain etcd-bootstrap`
    # runs changed etcd's users and roles at once; the request's effect is unknown, and retrying is safe (above)
    "No status received",
)


class RpcFailure(str, Enum):
    """What the client does with a failed call."""

    RETRY = "retry"  # transient: try again (another endpoint, after a pause) until the deadline
    REAUTHENTICATE = "reauthenticate"  # the auth token expired: a new client logs in again, then retry
    AUTH_OFF = "auth_off"  # a user is configured but etcd's authentication is not on (yet): log in again, later
    LEASE_GONE = "lease_gone"  # the lease expired or was revoked: EtcdLeaseNotFoundError
    TOO_LARGE = "too_large"  # the answer is over the client's receive limit: EtcdResponseTooLargeError (ask less)
    COMPACTED = "compacted"  # a read at a revision etcd has compacted away: EtcdCompactedError
    REFUSED = "refused"  # a real refusal (bad request, permission denied): EtcdError at once


def classify(code: grpc.StatusCode | None, details: str) -> RpcFailure:
    """The meaning of a call that failed with status ``code`` and message ``details``."""
    if code == grpc.StatusCode.UNAUTHENTICATED or (code == grpc.StatusCode.INVALID_ARGUMENT and "token" in details):
        return RpcFailure.REAUTHENTICATE
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return RpcFailure.RETRY
    if code == grpc.StatusCode.FAILED_PRECONDITION and AUTH_NOT_ENABLED in details:
        return RpcFailure.AUTH_OFF
    if code == grpc.StatusCode.NOT_FOUND and LEASE_NOT_FOUND in details:
        return RpcFailure.LEASE_GONE
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and TOO_LARGE in details:
        return RpcFailure.TOO_LARGE
    if code == grpc.StatusCode.OUT_OF_RANGE and COMPACTED in details:
        return RpcFailure.COMPACTED
    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
        if any(phrase in details for phrase in _TRANSIENT_DETAILS):
            return RpcFailure.RETRY
    return RpcFailure.REFUSED


def is_deadline(code: grpc.StatusCode | None, details: str) -> bool:
    """The call's own timeout passed. A watch stream cut by its deadline may also end with status UNKNOWN
    and the details "context deadline exceeded" (seen with etcd 3.x): that is a timeout, not a failure."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    return code == grpc.StatusCode.UNKNOWN and "deadline" in details
