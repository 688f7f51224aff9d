"""A pass-through :class:`EtcdClient` that counts requests and payload bytes, per thread, while asked to.

``with counting.record() as tally:`` counts every request the calling thread (and the threads it hands the plan's
transactions to, ``etrain-apply*``) makes through the client until the block ends (no other thread):
``tally.requests``, ``tally.bytes_read`` (keys and values returned), ``tally.bytes_written`` (keys and values
sent, compares included). Bytes are the payload, not the gRPC framing. Any operation of the interface that is
not counted below is passed through uncounted (the interface may grow; the bench keeps working).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from elastic.etcd import EtcdClient, KeyValue
from elastic.etcd.config import EtcdConfig
from elastic.etcd.txn import GetResult

__all__ = ["CountingClient", "CountingClientBase", "Tally"]


@dataclass
class Tally:
    requests: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    by_op: dict[str, int] = field(default_factory=dict)


def _kv_bytes(kvs: Sequence[KeyValue]) -> int:
    return sum(len(kv.key) + len(kv.value) for kv in kvs)


class CountingClientBase(EtcdClient):
    def __init__(self, inner: EtcdClient) -> None:
        self._inner = inner
        self._tally: Tally | None = None
        self._owner = 0
        self._count_lock = threading.Lock()

    # -- bookkeeping ---------------------------------------------------------------------------------
    @contextmanager
    def record(self) -> Iterator[Tally]:
        tally = Tally()
        self._tally, self._owner = tally, threading.get_ident()
        try:
            yield tally
        finally:
            self._tally = None

    def _note(self, op: str, read: int = 0, written: int = 0) -> None:
        tally = self._tally
        if tally is not None and (
            threading.get_ident() == self._owner or threading.current_thread().name.startswith("etrain-apply")
        ):
            with self._count_lock:
                tally.requests += 1
                tally.bytes_read += read
                tally.bytes_written += written
                tally.by_op[op] = tally.by_op.get(op, 0) + 1

    # -- identity ------------------------------------------------------------------------------------
    @property
    def config(self) -> EtcdConfig:
        return self._inner.config

    @property
    def endpoints_label(self) -> str:
        return self._inner.endpoints_label

    def ping(self, timeout: timedelta | None = None) -> int:
        self._note("ping")
        return self._inner.ping(timeout)

    def close(self) -> None:
        self._inner.close()

    # -- reads ---------------------------------------------------------------------------------------
    def get(self, key: str) -> tuple[KeyValue | None, int]:
        kv, rev = self._inner.get(key)
        self._note("get", read=_kv_bytes([kv]) if kv else 0, written=len(key))
        return kv, rev

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        kvs, rev = self._inner.get_prefix(prefix)
        self._note("get_prefix", read=_kv_bytes(kvs), written=len(prefix))
        return kvs, rev

    def count_prefix(self, prefix: str) -> int:
        self._note("count_prefix", written=len(prefix))
        return self._inner.count_prefix(prefix)

    def get_with_prefix(self, key: str, prefix: str) -> tuple[KeyValue | None, list[KeyValue], int]:
        kv, kvs, rev = self._inner.get_with_prefix(key, prefix)
        self._note("get_with_prefix", read=_kv_bytes(kvs) + (_kv_bytes([kv]) if kv else 0), written=len(key))
        return kv, kvs, rev

    def read_prefixes(self, prefixes: Sequence[str]) -> tuple[list[list[KeyValue]], int]:
        lists, rev = self._inner.read_prefixes(prefixes)
        self._note("read_prefixes", read=sum(_kv_bytes(x) for x in lists), written=sum(map(len, prefixes)))
        return lists, rev

    # -- writes --------------------------------------------------------------------------------------
    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        self._note("put", written=len(key) + len(value))
        return self._inner.put(key, value, lease)

    def delete(self, key: str) -> bool:
        self._note("delete", written=len(key))
        return self._inner.delete(key)

    def compare_and_put(self, key: str, value: bytes, *, mod_revision: int, lease: int = 0,
                        read_prefix: str | None = None, guard: tuple[str, int] | None = None,
                        ) -> tuple[bool, KeyValue | None, list[KeyValue], int]:  # fmt: skip
        out = self._inner.compare_and_put(key, value, mod_revision=mod_revision, lease=lease,
                                          read_prefix=read_prefix, guard=guard)  # fmt: skip
        self._note("compare_and_put", read=_kv_bytes(out[2]) + (_kv_bytes([out[1]]) if out[1] else 0),
                   written=len(key) + len(value))  # fmt: skip
        return out

    def commit(self, puts: Sequence[tuple[str, bytes]] = (), deletes: Sequence[str] = (), *,
               delete_prefixes: Sequence[str] = (), expect: Sequence[tuple[str, int]] = (),
               guard: tuple[str, int] | None = None) -> tuple[bool, int]:  # fmt: skip
        written = sum(len(k) + len(v) for k, v in puts) + sum(map(len, deletes)) + sum(map(len, delete_prefixes))
        self._note("commit", written=written + sum(len(k) for k, _ in expect))
        return self._inner.commit(puts, deletes, delete_prefixes=delete_prefixes, expect=expect, guard=guard)

    # -- leases --------------------------------------------------------------------------------------
    def grant_lease(self, ttl: timedelta) -> int:
        self._note("grant_lease")
        return self._inner.grant_lease(ttl)

    def keep_alive_once(self, lease_id: int) -> int:
        self._note("keep_alive_once")
        return self._inner.keep_alive_once(lease_id)

    def revoke_lease(self, lease_id: int) -> None:
        self._note("revoke_lease")
        self._inner.revoke_lease(lease_id)

    # -- watches -------------------------------------------------------------------------------------
    def wait_for_event(self, key: str, start_revision: int, timeout: timedelta, *, prefix: bool = False) -> bool:
        return self._inner.wait_for_event(key, start_revision, timeout, prefix=prefix)

    def watch_revisions(self, key: str, start_revision: int, on_revision: Callable[[int], None],
                        stop: threading.Event, *, prefix: bool = False) -> None:  # fmt: skip
        self._inner.watch_revisions(key, start_revision, on_revision, stop, prefix=prefix)


def _txn(self: CountingClientBase, compare: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = ()) -> Any:
    result = self._inner.txn(compare, success, failure)
    written = sum(len(c.key) + (len(c.value) if isinstance(c.value, bytes) else 0) for c in compare)
    written += sum(len(op.key) + len(getattr(op, "value", b"")) for op in (*success, *failure))
    read = 0
    for r in result.results:
        if isinstance(r, GetResult):
            read += _kv_bytes(r.kvs)
    self._note("txn", read=read, written=written)
    return result


def _pass_through(name: str) -> Callable[..., Any]:
    def method(self: CountingClientBase, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


def _complete() -> type[CountingClientBase]:
    """``CountingClientBase`` with every abstract method of the current interface implemented (``txn`` counted)."""
    abstract = CountingClientBase.__abstractmethods__
    missing = {name: (_txn if name == "txn" else _pass_through(name)) for name in abstract}
    return type("CountingClient", (CountingClientBase,), missing) if missing else CountingClientBase


CountingClient = _complete()
