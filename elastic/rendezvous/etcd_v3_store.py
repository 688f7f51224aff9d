"""A ``torch.distributed.Store`` kept in etcd over the v3 API.

Every key lives under one prefix in an HA etcd cluster, so the store survives the loss of any one
training node (unlike a TCPStore hosted by one of them). Blocking operations (``get`` of a missing key,
``wait``) read the key, then open a watch that starts at the revision right after that read: a write
that lands in between is delivered by the watch, and nothing polls. ``add``, ``append`` and
``compare_set`` are compare-and-swap loops on the key's mod revision.

Keys are attached to an optional lease (the rendezvous' long state lease), so the store of an abandoned
job expires by itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError, Store

from elastic.etcd import EtcdClient, EtcdConnectionError, EtcdError, KeyValue

__all__ = ["EtcdV3Store"]


def _to_bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdV3Store(Store):
    """``torch.distributed.Store`` over etcd v3 (see the module docstring).

    Args:
        client: the etcd adapter.
        prefix: key prefix of this store (a trailing ``/`` is added).
        timeout: default timeout of blocking operations (``get``, ``wait``).
        lease: a callable returning the lease id to attach keys to (0 for none).
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        timeout: timedelta | None = None,
        lease: Callable[[], int] | None = None,
    ) -> None:
        super().__init__()  # required by the pybind trampoline
        self._client = client
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._lease = lease or (lambda: 0)
        if timeout is not None:
            self.set_timeout(timeout)

    @property
    def prefix(self) -> str:
        return self._prefix

    # -- helpers -------------------------------------------------------------------------------------
    def _k(self, key: str) -> str:
        return self._prefix + key

    def _etcd(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except EtcdConnectionError as exc:
            raise DistStoreError(f"etcd store unreachable: {exc}") from exc
        except EtcdError as exc:
            raise DistStoreError(f"etcd store request failed: {exc}") from exc

    def _read(self, key: str) -> tuple[KeyValue | None, int]:
        result: tuple[KeyValue | None, int] = self._etcd(lambda: self._client.get(self._k(key)))
        return result

    def _wait_present(self, keys: Sequence[str], timeout: timedelta) -> dict[str, bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        found: dict[str, bytes] = {}
        for key in keys:
            while True:
                kv, revision = self._read(key)
                if kv is not None:
                    found[key] = kv.value
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    # torch's stores say "wait timeout after ...": torch's code and store tests match on it
                    raise DistStoreError(
                        f"wait timeout after {timeout.total_seconds() * 1000:.0f}ms, keys: {key!r} "
                        f"(etcd store {self._prefix!r})"
                    )
                self._wait_change(key, revision + 1, timedelta(seconds=remaining))
        return found

    def _wait_change(self, key: str, start_revision: int, timeout: timedelta) -> None:
        self._etcd(lambda: self._client.wait_for_event(self._k(key), start_revision, timeout))

    def _timeout(self) -> timedelta:
        value: timedelta = self.timeout  # type: ignore[attr-defined]  # provided by the pybind base
        return value

    def _cas_loop(self, key: str, update: Callable[[bytes | None], bytes | None]) -> bytes | None:
        """Apply ``update(old) -> new`` atomically; ``None`` from ``update`` means: write nothing.

        Returns the value in etcd after the operation.
        """
        full = self._k(key)
        kv, _ = self._read(key)
        while True:
            old = kv.value if kv is not None else None
            new = update(old)
            if new is None:
                return old
            expected = kv.mod_revision if kv is not None else 0
            ok, current = self._put_if(full, new, expected)
            if ok:
                return new
            kv = current

    def _put_if(self, full_key: str, value: bytes, mod_revision: int) -> tuple[bool, KeyValue | None]:
        def op() -> tuple[bool, KeyValue | None]:
            ok, current, _, _ = self._client.compare_and_put(
                full_key, value, mod_revision=mod_revision, lease=self._lease()
            )
            return ok, current

        result: tuple[bool, KeyValue | None] = self._etcd(op)
        return result

    # -- Store API -----------------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        data = _to_bytes(value)
        self._etcd(lambda: self._client.put(self._k(key), data, lease=self._lease()))

    def get(self, key: str) -> bytes:
        return self._wait_present([key], self._timeout())[key]

    def add(self, key: str, value: int) -> int:
        def inc(old: bytes | None) -> bytes:
            return str((int(old) if old else 0) + int(value)).encode()

        result = self._cas_loop(key, inc)
        assert result is not None
        return int(result)

    def append(self, key: str, value: str | bytes) -> None:
        data = _to_bytes(value)
        self._cas_loop(key, lambda old: (old or b"") + data)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        expected, desired = _to_bytes(expected_value), _to_bytes(desired_value)

        def swap(old: bytes | None) -> bytes | None:
            if old is None:
                return desired if expected == b"" else None
            return desired if old == expected else None

        result = self._cas_loop(key, swap)
        # Missing key and a non-empty expectation: torch returns the expected value.
        return result if result is not None else expected

    def delete_key(self, key: str) -> bool:
        return bool(self._etcd(lambda: self._client.delete(self._k(key))))

    def num_keys(self) -> int:
        return int(self._etcd(lambda: self._client.count_prefix(self._prefix)))

    def check(self, keys: list[str]) -> bool:
        return all(self._read(k)[0] is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_present(keys, timeout if timeout is not None else self._timeout())

    def multi_get(self, keys: list[str]) -> list[bytes]:
        found = self._wait_present(keys, self._timeout())
        return [found[k] for k in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def has_extended_api(self) -> bool:
        return True
