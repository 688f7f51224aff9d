"""The real :class:`~elastic.etcd.api.EtcdClient`: gRPC through ``python3-etcd3`` (imported as ``etcd3``).

This module and its auth mixin (:mod:`elastic.etcd.grpc_auth`) are the project's only users of the etcd
client library, its private parts included (the ``kvstub``/``authstub``/``channel`` stubs, ``timeout``,
``call_credentials``, ``metadata`` of ``etcd3.MultiEndpointEtcd3Client``, which
``tests/elastic/etcd/test_etcd3_surface.py`` pins). Each operation retries across the configured endpoints until
a deadline and turns every third-party failure into :class:`EtcdConnectionError` (naming the endpoints) or
:class:`EtcdError`; :mod:`elastic.etcd.grpc_errors` says which failures are retried.

Blocking waits use an etcd watch stream that starts at a known revision, so no change between a read
and the wait can be missed, and nothing polls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import etcd3
import grpc
from etcd3 import etcdrpc
from etcd3 import exceptions as etcd_exc

from elastic.etcd._grpc_txn import key_value as _kv
from elastic.etcd._grpc_txn import txn_request, txn_result
from elastic.etcd.api import (
    EtcdClient,
    EtcdClientClosedError,
    EtcdCompactedError,
    EtcdConnectionError,
    EtcdError,
    EtcdLeaseNotFoundError,
    EtcdResponseTooLargeError,
    KeyValue,
    TxnEtcdClient,
    prefix_end,
)
from elastic.etcd.config import EtcdConfig
from elastic.etcd.grpc_auth import GrpcAuthMixin
from elastic.etcd.grpc_errors import RpcFailure, classify, is_deadline
from elastic.etcd.txn import Compare, TxnOp, TxnResult

logger = logging.getLogger(__name__)

__all__ = [
    "EtcdClient",
    "EtcdClientClosedError",
    "EtcdConnectionError",
    "EtcdError",
    "GrpcEtcdClient",
    "KeyValue",
    "check_reachable",
    "create_client",
]


@dataclass
class _Retry:
    deadline: float
    attempts: int = 0
    last_exc: BaseException | None = field(default=None)
    auth_off: bool = False  # etcd said its authentication is not on (a user is configured)


def _status(exc: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else None
    return code, str(details if details is not None else exc)


def _is_deadline(exc: grpc.RpcError) -> bool:
    return is_deadline(*_status(exc))


_RETRYABLE = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.InternalServerError,
    etcd_exc.NoServerAvailableError,
)


class GrpcEtcdClient(GrpcAuthMixin, TxnEtcdClient):
    """The real :class:`EtcdClient`: gRPC to one cluster (one or more endpoints, with failover).

    Operations retry on connection failures, moving to the next endpoint, until ``config.op_timeout``
    has passed; then they raise :class:`EtcdConnectionError`. Compare-and-swap operations are safe to
    retry because a repeated attempt fails its comparison and reports the current value.
    """

    def __init__(self, config: EtcdConfig) -> None:
        self._config = config
        self._lock = threading.RLock()
        self._client: Any = None
        # Bumped by every reset. Threads share one client (one channel per endpoint); a thread resets only
        # the generation it saw fail, and an error from a generation already replaced (whose channel another
        # thread's reset closed under it) is retried, never reported.
        self._generation = 0
        self._closed = False  # close() is final: nothing connects again (EtcdClient.close)

    # -- connection ----------------------------------------------------------------------------------
    @property
    def config(self) -> EtcdConfig:
        return self._config

    @property
    def endpoints_label(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self._config.endpoints)

    def _connect(self) -> Any:
        cfg = self._config
        creds = None
        secure = cfg.ca_cert is not None
        if secure:
            assert cfg.ca_cert is not None
            creds = etcd3.MultiEndpointEtcd3Client.get_secure_creds(cfg.ca_cert, cfg.cert_key, cfg.cert)
        opts = [
            ("grpc.keepalive_time_ms", 2000),
            ("grpc.keepalive_timeout_ms", 2000),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        eps = [
            etcd3.Endpoint(host, port, secure=secure, creds=creds, time_retry=0.2, opts=opts)
            for host, port in cfg.endpoints
        ]
        return etcd3.MultiEndpointEtcd3Client(
            endpoints=eps,
            timeout=cfg.request_timeout.total_seconds(),
            user=cfg.user,
            password=cfg.password,
            failover=True,
        )

    def _current(self) -> tuple[Any, int]:
        """The shared library client (connecting it if none) and its generation."""
        with self._lock:
            if self._closed:
                raise EtcdClientClosedError(f"the etcd client of {self.endpoints_label} is closed")
            if self._client is None:
                self._client = self._connect()
            return self._client, self._generation

    def _raw(self) -> Any:
        """The shared library client (connecting it if none)."""
        return self._current()[0]

    def _replaced(self, generation: int) -> bool:
        """Whether another thread's reset replaced (and closed) the client of ``generation``."""
        with self._lock:
            return generation != self._generation

    def _reset(self, generation: int | None = None) -> None:
        """Drop the client so the next call connects afresh. With ``generation`` (the one the caller saw
        fail), only if it is still the current one: a client another thread already replaced stays
        replaced, and a fresh one is not closed under the threads now using it."""
        with self._lock:
            if generation is not None and generation != self._generation:
                return
            client, self._client = self._client, None
            self._generation += 1
        if client is not None:
            logger.debug("etcd client to %s reset (generation %d)", self.endpoints_label, self._generation)
            try:
                client.close()
            except Exception:  # pragma: no cover - best effort
                logger.debug("closing the etcd client failed", exc_info=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._reset()

    def _call(self, fn: Any, *, timeout: timedelta | None = None) -> Any:
        limit = (timeout or self._config.op_timeout).total_seconds()
        retry = _Retry(deadline=time.monotonic() + limit)
        while True:
            generation: int | None = None
            try:
                client, generation = self._current()
                return fn(client)
            except EtcdClientClosedError:
                raise
            except _RETRYABLE as exc:
                retry.last_exc = exc
            except grpc.RpcError as exc:
                failure = classify(*_status(exc))
                if generation is not None and self._replaced(generation):
                    # Another thread's reset closed the channel under this call ("Channel closed!").
                    retry.last_exc = exc
                elif failure is RpcFailure.REAUTHENTICATE:
                    # The auth token expired: a new client authenticates again.
                    retry.last_exc = exc
                    self._reset(generation)
                elif failure is RpcFailure.RETRY:
                    retry.last_exc = exc
                elif failure is RpcFailure.AUTH_OFF:
                    retry.last_exc = exc
                    retry.auth_off = True
                    self._reset(generation)  # log in afresh once etcd's users are on
                elif failure is RpcFailure.LEASE_GONE:
                    raise EtcdLeaseNotFoundError(f"etcd at {self.endpoints_label}: the lease is gone: {exc}") from exc
                elif failure is RpcFailure.TOO_LARGE:
                    raise EtcdResponseTooLargeError(f"etcd at {self.endpoints_label}: {exc}") from exc
                elif failure is RpcFailure.COMPACTED:
                    raise EtcdCompactedError(f"etcd at {self.endpoints_label}: {exc}") from exc
                else:
                    raise EtcdError(f"etcd at {self.endpoints_label} refused the request: {exc}") from exc
            except Exception as exc:
                if generation is None:
                    raise EtcdConnectionError(f"cannot connect to etcd at {self.endpoints_label}: {exc}") from exc
                if not self._replaced(generation):
                    raise EtcdError(f"etcd request to {self.endpoints_label} failed: {exc}") from exc
                # "Cannot invoke RPC on closed channel!": another thread's reset; retry on the new client.
                retry.last_exc = exc
            retry.attempts += 1
            if time.monotonic() >= retry.deadline:
                if retry.auth_off:
                    raise EtcdError(
                        f"etcd at {self.endpoints_label} has no authentication turned on, but user "
                        f"{self._config.user!r} is configured (waited {limit:.1f}s for it to be turned on, e.g. by "
                        "etrain etcd-bootstrap)"
                    ) from retry.last_exc
                raise EtcdConnectionError(
                    f"etcd unreachable at {self.endpoints_label} after {limit:.1f}s ({type(retry.last_exc).__name__})"
                ) from retry.last_exc
            if generation is not None and retry.attempts > 1 and retry.attempts % len(self._config.endpoints) == 0:
                self._reset(generation)
            time.sleep(min(0.05 * retry.attempts, 0.25))

    # -- key/value -----------------------------------------------------------------------------------
    def ping(self, timeout: timedelta | None = None) -> int:
        def op(c: Any) -> int:
            resp = c.get_response("\0")
            return int(resp.header.revision)

        return int(self._call(op, timeout=timeout))

    def get(self, key: str) -> tuple[KeyValue | None, int]:
        def op(c: Any) -> tuple[KeyValue | None, int]:
            resp = c.get_response(key)
            kv = _kv(resp.kvs[0]) if resp.kvs else None
            return kv, int(resp.header.revision)

        result: tuple[KeyValue | None, int] = self._call(op)
        return result

    def count_prefix(self, prefix: str) -> int:
        def op(c: Any) -> int:
            req = etcdrpc.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix), count_only=True)
            resp = c.kvstub.Range(req, c.timeout, credentials=c.call_credentials, metadata=c.metadata)
            return int(resp.count)

        return int(self._call(op))

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        def op(c: Any) -> int:
            req = etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease)
            resp = c.kvstub.Put(req, c.timeout, credentials=c.call_credentials, metadata=c.metadata)
            return int(resp.header.revision)

        return int(self._call(op))

    def delete(self, key: str) -> bool:
        def op(c: Any) -> bool:
            req = etcdrpc.DeleteRangeRequest(key=key.encode())
            resp = c.kvstub.DeleteRange(req, c.timeout, credentials=c.call_credentials, metadata=c.metadata)
            return int(resp.deleted) > 0

        return bool(self._call(op))

    def txn(self, compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()) -> TxnResult:
        # Retried like every request: a caller whose compares do not fail on its own earlier success (a
        # transaction that writes unconditionally) may see it applied twice after a lost answer.
        req = txn_request(compare, success, failure)

        def op(c: Any) -> TxnResult:
            resp = c.kvstub.Txn(req, c.timeout, credentials=c.call_credentials, metadata=c.metadata)
            return txn_result(resp)

        result: TxnResult = self._call(op)
        return result

    # -- leases --------------------------------------------------------------------------------------
    def grant_lease(self, ttl: timedelta) -> int:
        seconds = max(1, round(ttl.total_seconds()))

        def op(c: Any) -> int:
            return int(c.lease(seconds).id)

        return int(self._call(op))

    def keep_alive_once(self, lease_id: int) -> int:
        def op(c: Any) -> int:
            for resp in c.refresh_lease(lease_id):
                return int(resp.TTL)
            return 0

        return int(self._call(op, timeout=self._config.request_timeout))

    def revoke_lease(self, lease_id: int) -> None:
        def op(c: Any) -> None:
            try:
                c.revoke_lease(lease_id)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise

        self._call(op, timeout=self._config.request_timeout)

    # -- watches -------------------------------------------------------------------------------------
    def wait_for_event(self, key: str, start_revision: int, timeout: timedelta, *, prefix: bool = False) -> bool:
        # A broken watch stream (a member restarting) is re-opened from the same revision: no event is lost.
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            generation: int | None = None
            try:
                c, generation = self._current()
                return self._watch_once(c, key, start_revision, remaining, prefix)
            except grpc.RpcError as exc:
                if _is_deadline(exc):
                    continue  # our own timeout (etcd may report it as UNKNOWN): the loop returns False
                replaced = generation is not None and self._replaced(generation)
                if not replaced and exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise EtcdError(f"watch on etcd at {self.endpoints_label} failed: {exc}") from exc
            except _RETRYABLE:
                pass
            except ValueError as exc:  # "Cannot invoke RPC on closed channel!"
                if generation is None or not self._replaced(generation):
                    raise EtcdError(f"watch on etcd at {self.endpoints_label} failed: {exc}") from exc
            if generation is not None:
                self._reset(generation)
            time.sleep(0.1)

    def watch_revisions(
        self,
        key: str,
        start_revision: int,
        on_revision: Callable[[int], None],
        stop: threading.Event,
        *,
        prefix: bool = False,
    ) -> None:
        # A broken stream is re-opened from the revision after the last one delivered. Each stream's request
        # iterator blocks (gRPC reads it in a thread of its own) until that stream is done with; one thread per
        # call cancels the current stream once ``stop`` is set. Nothing is left per re-opened stream: a watch
        # retrying through a long etcd outage (10 tries a second) must not pile up threads.
        next_revision = start_revision
        current: list[tuple[threading.Event, Any]] = []  # the open stream and the event that ends its requests
        guard = threading.Lock()
        returned = threading.Event()

        def cancel_on_stop() -> None:
            while not stop.wait(1.0):
                if returned.is_set():
                    return
            with guard:
                for done, open_stream in current:
                    done.set()
                    open_stream.cancel()

        threading.Thread(target=cancel_on_stop, name=f"etcd-watch-stop:{key}", daemon=True).start()
        try:
            while not stop.is_set():
                generation: int | None = None
                done = threading.Event()
                try:
                    c, generation = self._current()
                    create = etcdrpc.WatchCreateRequest(key=key.encode(), start_revision=next_revision)
                    if prefix:
                        create.range_end = prefix_end(key)

                    def requests(create: Any = create, done: threading.Event = done) -> Iterator[Any]:
                        yield etcdrpc.WatchRequest(create_request=create)
                        done.wait()

                    stream = etcdrpc.WatchStub(c.channel).Watch(
                        requests(), credentials=c.call_credentials, metadata=c.metadata
                    )
                    with guard:
                        current[:] = [(done, stream)]
                    if stop.is_set():  # set before the stream was there to cancel
                        stream.cancel()
                    for resp in stream:
                        if resp.compact_revision:
                            next_revision = int(resp.compact_revision)
                            on_revision(next_revision)
                        if resp.events:
                            revision = max(int(e.kv.mod_revision) for e in resp.events)
                            next_revision = revision + 1
                            on_revision(revision)
                except EtcdClientClosedError:
                    return  # closed under the watch: it ends (EtcdClient.close)
                except grpc.RpcError as exc:
                    if stop.is_set():
                        return
                    logger.debug("watch on %s broke (%s); re-opening", key, exc.code())
                except _RETRYABLE:
                    pass
                except ValueError as exc:  # "Cannot invoke RPC on closed channel!": another thread's reset
                    logger.debug("watch on %s broke (%s); re-opening", key, exc)
                finally:
                    done.set()  # the stream is over: its request iterator returns, gRPC's thread for it ends
                    with guard:
                        current.clear()
                if not stop.is_set():
                    if generation is not None:
                        self._reset(generation)
                    stop.wait(0.1)
        finally:
            returned.set()

    def _watch_once(self, c: Any, key: str, start_revision: int, timeout: float, prefix: bool) -> bool:
        create = etcdrpc.WatchCreateRequest(key=key.encode(), start_revision=start_revision)
        if prefix:
            create.range_end = prefix_end(key)
        done = threading.Event()

        def requests() -> Iterator[Any]:
            yield etcdrpc.WatchRequest(create_request=create)
            done.wait()

        stub = etcdrpc.WatchStub(c.channel)
        stream = stub.Watch(requests(), timeout, credentials=c.call_credentials, metadata=c.metadata)
        try:
            for resp in stream:
                if resp.compact_revision and resp.compact_revision > start_revision:
                    return True  # history compacted: the caller must re-read
                if resp.canceled:
                    raise EtcdError(f"etcd cancelled a watch on {key!r}: {resp.cancel_reason}")
                if resp.events:
                    return True
            return False
        finally:
            done.set()
            stream.cancel()


def create_client(config: EtcdConfig) -> GrpcEtcdClient:
    """Create a client of the real cluster; nothing connects until the first request."""
    return GrpcEtcdClient(config)


def check_reachable(config: EtcdConfig, timeout: timedelta | None = None) -> int:
    """Fail fast, with one line naming the endpoints, when etcd cannot be reached."""
    client = create_client(config)
    try:
        return client.ping(timeout=timeout or config.connect_timeout)
    finally:
        client.close()
