"""Translation between :mod:`elastic.etcd.txn` and etcd's protobuf messages, for the gRPC client.

:func:`txn_request` builds an ``etcdrpc.TxnRequest`` from compares and ops; :func:`txn_result` reads
the ``TxnResponse`` back into a :class:`~elastic.etcd.txn.TxnResult`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from etcd3 import etcdrpc

from elastic.etcd.api import EtcdError, KeyValue, prefix_end
from elastic.etcd.txn import (
    Compare,
    CompareOp,
    CompareTarget,
    DeleteOp,
    GetResult,
    PutOp,
    TxnOp,
    TxnResult,
)

__all__ = ["key_value", "request_op", "txn_request", "txn_result"]

_TARGETS: dict[CompareTarget, tuple[int, str]] = {  # etcdrpc.Compare.CompareTarget, the target_union field
    CompareTarget.CREATE: (etcdrpc.Compare.CREATE, "create_revision"),
    CompareTarget.MOD: (etcdrpc.Compare.MOD, "mod_revision"),
    CompareTarget.VERSION: (etcdrpc.Compare.VERSION, "version"),
    CompareTarget.VALUE: (etcdrpc.Compare.VALUE, "value"),
}
_RESULTS: dict[CompareOp, int] = {  # etcdrpc.Compare.CompareResult
    CompareOp.EQUAL: etcdrpc.Compare.EQUAL,
    CompareOp.NOT_EQUAL: etcdrpc.Compare.NOT_EQUAL,
    CompareOp.LESS: etcdrpc.Compare.LESS,
    CompareOp.GREATER: etcdrpc.Compare.GREATER,
}


def key_value(msg: Any) -> KeyValue:
    """A ``mvccpb.KeyValue`` as a :class:`KeyValue`."""
    return KeyValue(
        key=msg.key.decode(),
        value=bytes(msg.value),
        create_revision=int(msg.create_revision),
        mod_revision=int(msg.mod_revision),
        lease=int(msg.lease),
        version=int(msg.version),
    )


def _range_end(key: str, prefix: bool) -> bytes:
    return prefix_end(key) if prefix else b""


def _compare(c: Compare) -> Any:
    target, field = _TARGETS[c.target]
    msg = etcdrpc.Compare(key=c.key.encode(), result=_RESULTS[c.op], target=target)
    setattr(msg, field, c.value)
    if c.prefix:
        msg.range_end = prefix_end(c.key)
    return msg


def request_op(op: TxnOp) -> Any:
    """One op as an ``etcdrpc.RequestOp``."""
    if isinstance(op, PutOp):
        return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=op.key.encode(), value=op.value, lease=op.lease))
    if isinstance(op, DeleteOp):
        req = etcdrpc.DeleteRangeRequest(key=op.key.encode(), range_end=_range_end(op.key, op.prefix))
        return etcdrpc.RequestOp(request_delete_range=req)
    rng = etcdrpc.RangeRequest(
        key=op.key.encode() if op.after is None else op.after.encode() + b"\0",
        range_end=_range_end(op.key, op.prefix),
        count_only=op.count_only,
        keys_only=op.keys_only,
        limit=op.limit,
        revision=op.revision,
    )
    return etcdrpc.RequestOp(request_range=rng)


def txn_request(compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp]) -> Any:
    """The ``etcdrpc.TxnRequest`` of a transaction."""
    return etcdrpc.TxnRequest(
        compare=[_compare(c) for c in compare],
        success=[request_op(op) for op in success],
        failure=[request_op(op) for op in failure],
    )


def txn_result(resp: Any) -> TxnResult:
    """A ``TxnResponse`` as a :class:`TxnResult` (one result per response, in order)."""
    results: list[GetResult | int | None] = []
    for r in resp.responses:
        kind = r.WhichOneof("response")
        if kind == "response_range":
            rng = r.response_range
            results.append(GetResult(tuple(key_value(m) for m in rng.kvs), int(rng.count)))
        elif kind == "response_delete_range":
            results.append(int(r.response_delete_range.deleted))
        elif kind == "response_put":
            results.append(None)
        else:  # pragma: no cover - we send no nested transactions
            raise EtcdError(f"etcd answered a transaction with an unexpected {kind!r}")
    return TxnResult(succeeded=bool(resp.succeeded), revision=int(resp.header.revision), results=tuple(results))
