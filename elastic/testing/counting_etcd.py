"""An :class:`EtcdClient` that counts the requests made through it, for tests and benchmarks.

It forwards every call to a real client (ours, so this is a working implementation of our own
interface, not a mock of etcd) and counts calls per method, and the bytes of values read and written.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from elastic.etcd import EtcdClient, GetResult, KeyValue, PutOp, TxnResult

__all__ = ["CountingEtcdClient"]


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
    if name == "put" and len(args) >= 2:
        return len(args[0]) + len(args[1])
    if name == "txn":
        ops = [
            *(args[1] if len(args) > 1 else kwargs.get("success", ())),
            *(args[2] if len(args) > 2 else kwargs.get("failure", ())),
        ]
        return sum(len(op.key) + len(op.value) for op in ops if isinstance(op, PutOp))
    return 0


class CountingEtcdClient(EtcdClient):
    """Counts ``counts[method]`` and ``read_bytes``/``written_bytes`` for calls through it (thread-safe)."""

    def __init__(self, inner: EtcdClient) -> None:
        self.inner = inner
        self.counts: Counter[str] = Counter()
        self.read_bytes = 0
        self.written_bytes = 0
        self._count_lock = threading.Lock()

    def snapshot(self) -> dict[str, int]:
        with self._count_lock:
            return dict(self.counts)

    def reset(self) -> None:
        with self._count_lock:
            self.counts.clear()
            self.read_bytes = self.written_bytes = 0

    def _counted(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = getattr(self.inner, name)(*args, **kwargs)
        read, written = _read_bytes(result), _written_bytes(name, args, kwargs)
        with self._count_lock:
            self.counts[name] += 1
            self.read_bytes += read
            self.written_bytes += written
        return result

    @property
    def config(self) -> Any:
        return self.inner.config

    @property
    def endpoints_label(self) -> str:
        return self.inner.endpoints_label


def _forwarder(name: str) -> Callable[..., Any]:
    def method(self: CountingEtcdClient, *args: Any, **kwargs: Any) -> Any:
        if name in ("watch_revisions", "wait_for_event"):  # long calls: count when they start
            with self._count_lock:
                self.counts[name] += 1
            return getattr(self.inner, name)(*args, **kwargs)
        return self._counted(name, args, kwargs)

    method.__name__ = name
    return method


for _name in sorted(EtcdClient.__abstractmethods__ - {"config", "endpoints_label"}):
    setattr(CountingEtcdClient, _name, _forwarder(_name))
CountingEtcdClient.__abstractmethods__ = frozenset()
