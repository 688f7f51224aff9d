"""The records the etcd interface and its transactions share (no behaviour; imported by both
:mod:`elastic.etcd.api` and :mod:`elastic.etcd.txn`, so that neither imports the other's module for a type)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KeyValue"]


@dataclass(frozen=True)
class KeyValue:
    """One key as read from etcd."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0
    version: int = 0
