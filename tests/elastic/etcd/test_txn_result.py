"""A transaction's results read by name (:meth:`TxnResult.reads`), not by position."""

from __future__ import annotations

import pytest

from elastic.etcd import GetOp, GetResult, MemoryEtcdClient, PutOp


@pytest.mark.timeout(20)
def test_reads_are_the_get_results_alone_so_a_write_added_before_them_shifts_nothing() -> None:
    client = MemoryEtcdClient()
    client.put("/a", b"1")
    for writes in ([], [PutOp("/w", b"x")], [PutOp("/w", b"x"), PutOp("/v", b"y")]):
        res = client.txn([], [*writes, GetOp("/a"), GetOp("/missing")], [])
        a, missing = res.reads()
        assert a.kvs[0].value == b"1" and missing == GetResult((), 0)
    with pytest.raises(ValueError):
        [_only] = client.txn([], [GetOp("/a"), GetOp("/a", keys_only=True)], []).reads()  # a read without its name
