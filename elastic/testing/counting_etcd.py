"""An :class:`EtcdClient` that counts the requests made through it, for tests and benchmarks.

It forwards every call to a real client (ours, so this is a working implementation of our own
interface, not a mock of etcd) and counts calls per method, with the payload bytes read (keys and values
returned) and written (keys, values and compares sent; not the gRPC framing).

Two views of the same counts:

* ``counts`` / ``read_bytes`` / ``written_bytes``: every call from every thread since the last ``reset()``
  (watches count once, when they start);
* ``with client.record(also=...) as tally:`` only the calls the calling thread makes (and threads for which
  ``also()`` is true) until the block ends, watches left out: what one controller pass costs.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from elastic.etcd import EtcdClient, GetResult, KeyValue, PutOp, TxnResult
from elastic.etcd.api import EtcdAuth, auth_of

__all__ = ["CountingEtcdClient", "Tally"]

#: Calls that last (a watch): counted when they start, never in a tally.
_LONG = frozenset({"wait_for_event", "watch_revisions"})
#: Not requests.
_UNCOUNTED = frozenset({"close"})


@dataclass
class Tally:
    requests: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    by_op: dict[str, int] = field(default_factory=dict)


def _read_bytes(result: Any) -> int:
    if isinstance(result, TxnResult):
        return sum(_read_bytes(r) for r in result.results)
    if isinstance(result, GetResult):
        return sum(len(kv.key) + len(kv.value) for kv in result.kvs)
    if isinstance(result, KeyValue):
        return len(result.key) + len(result.value)
    if isinstance(result, (list, tuple)):
        return sum(_read_bytes(r) for r in result)
    return 0


def _written_bytes(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    if name in ("get", "get_prefix", "count_prefix", "get_with_prefix", "delete"):
        return len(args[0]) if args else 0
    if name == "read_prefixes":
        return sum(map(len, args[0])) if args else 0
    if name in ("put", "compare_and_put"):
        return len(args[0]) + len(args[1]) if len(args) >= 2 else 0
    if name == "commit":
        puts = args[0] if args else kwargs.get("puts", ())
        deletes = args[1] if len(args) > 1 else kwargs.get("deletes", ())
        written = sum(len(k) + len(v) for k, v in puts) + sum(map(len, deletes))
        written += sum(map(len, kwargs.get("delete_prefixes", ())))
        return written + sum(len(k) for k, _ in kwargs.get("expect", ()))
    if name == "txn":
        compares = args[0] if args else kwargs.get("compare", ())
        success = args[1] if len(args) > 1 else kwargs.get("success", ())
        failure = args[2] if len(args) > 2 else kwargs.get("failure", ())
        written = sum(len(c.key) + (len(c.value) if isinstance(c.value, bytes) else 0) for c in compares)
        return written + sum(
            len(op.key) + (len(op.value) if isinstance(op, PutOp) else 0) for op in (*success, *failure)
        )
    return 0


class CountingEtcdClient(EtcdClient, EtcdAuth):
    """Counts the calls through it (thread-safe); see the module docstring for the two views."""

    def __init__(self, inner: EtcdClient) -> None:
        self.inner = inner
        self.counts: Counter[str] = Counter()
        self.read_bytes = 0
        self.written_bytes = 0
        self._count_lock = threading.Lock()
        self._tally: Tally | None = None
        self._owner = 0
        self._also: Callable[[], bool] = lambda: False

    def snapshot(self) -> dict[str, int]:
        with self._count_lock:
            return dict(self.counts)

    def reset(self) -> None:
        with self._count_lock:
            self.counts.clear()
            self.read_bytes = self.written_bytes = 0

    @contextmanager
    def record(self, also: Callable[[], bool] = lambda: False) -> Iterator[Tally]:
        """Tally the calling thread's requests (and those of threads where ``also()`` holds) in the block."""
        tally = Tally()
        self._tally, self._owner, self._also = tally, threading.get_ident(), also
        try:
            yield tally
        finally:
            self._tally = None

    def _note(self, name: str, read: int, written: int) -> None:
        with self._count_lock:
            self.counts[name] += 1
            self.read_bytes += read
            self.written_bytes += written
            tally = self._tally
            if tally is not None and name not in _LONG and (threading.get_ident() == self._owner or self._also()):
                tally.requests += 1
                tally.bytes_read += read
                tally.bytes_written += written
                tally.by_op[name] = tally.by_op.get(name, 0) + 1

    @property
    def config(self) -> Any:
        return self.inner.config

    @property
    def endpoints_label(self) -> str:
        return self.inner.endpoints_label


def _forwarder(name: str) -> Callable[..., Any]:
    def method(self: CountingEtcdClient, *args: Any, **kwargs: Any) -> Any:
        call = getattr(self.inner, name)
        if name in _UNCOUNTED:
            return call(*args, **kwargs)
        if name in _LONG:  # counted when they start
            self._note(name, 0, 0)
            return call(*args, **kwargs)
        result = call(*args, **kwargs)
        self._note(name, _read_bytes(result), _written_bytes(name, args, kwargs))
        return result

    method.__name__ = name
    return method


def _auth_forwarder(name: str) -> Callable[..., Any]:
    """Users and roles go to the inner client's (not counted: they are no key/value traffic); a TypeError
    from :func:`auth_of` when the inner client manages none."""

    def method(self: CountingEtcdClient, *args: Any, **kwargs: Any) -> Any:
        return getattr(auth_of(self.inner), name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name in sorted(EtcdClient.__abstractmethods__ - {"config", "endpoints_label"}):
    setattr(CountingEtcdClient, _name, _forwarder(_name))
for _name in sorted(EtcdAuth.__abstractmethods__):
    setattr(CountingEtcdClient, _name, _auth_forwarder(_name))
CountingEtcdClient.__abstractmethods__ = frozenset()
