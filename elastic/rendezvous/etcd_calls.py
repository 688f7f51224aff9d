"""The ``etcd-v3`` rendezvous' etcd requests: transactions and reads with etcd's failures translated into
torch's rendezvous errors (``RendezvousConnectionError``; a corrupt record: ``RendezvousStateError``), the
compares it builds, and the refresher of a round's lease."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError

from elastic.etcd import (
    Compare,
    CompareOp,
    CompareTarget,
    EtcdClient,
    EtcdConnectionError,
    EtcdError,
    TxnOp,
    TxnResult,
)
from elastic.rendezvous.protocol import Head, RoundAssignment

logger = logging.getLogger(__name__)

__all__ = ["LeaseRefresher", "absent", "compare", "decode_assignment", "parse_head", "translate", "txn", "wrapped"]

T = TypeVar("T")


def compare(
    key: str, target: CompareTarget, value: int, *, op: CompareOp = CompareOp.EQUAL, prefix: bool = False
) -> Compare:
    return Compare(key, target, op, value, prefix=prefix)


def translate(exc: EtcdError) -> RendezvousConnectionError:
    if isinstance(exc, EtcdConnectionError):
        return RendezvousConnectionError(f"The connection to etcd has failed: {exc}")
    return RendezvousConnectionError(f"etcd rejected a rendezvous request: {exc}")


def absent(key: str) -> Compare:
    return compare(key, CompareTarget.CREATE, 0)


def parse_head(raw: bytes) -> Head:
    try:
        return Head.decode(raw)
    except ValueError as exc:
        raise RendezvousStateError(f"the rendezvous in etcd is corrupt: {exc}") from exc


class LeaseRefresher:
    """Keeps a lease that another process granted alive (the round's keys outlive their closer)."""

    def __init__(self, client: EtcdClient, lease_id: int, interval: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(client, lease_id, interval), name="rdzv-round-lease", daemon=True
        )
        self._thread.start()

    def _run(self, client: EtcdClient, lease_id: int, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                if client.keep_alive_once(lease_id) <= 0:
                    return  # gone: the next round writes its keys on a new lease
            except EtcdError:
                logger.debug("could not refresh the round's lease %x", lease_id, exc_info=True)

    def close(self) -> None:
        self._stop.set()


def decode_assignment(run_id: str, raw: bytes) -> RoundAssignment:
    try:
        return RoundAssignment.decode(raw)
    except ValueError as exc:
        raise RendezvousStateError(f"rendezvous {run_id}: {exc}") from exc


def wrapped(fn: Callable[[], T]) -> T:
    """``fn()``, with etcd's failures raised as torch's ``RendezvousConnectionError``."""
    try:
        return fn()
    except EtcdError as exc:
        raise translate(exc) from exc


def txn(
    client: EtcdClient, compares: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()
) -> TxnResult:
    return wrapped(lambda: client.txn(compares, success, failure))
