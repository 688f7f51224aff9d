"""The parts of a general etcd v3 transaction (:meth:`~elastic.etcd.api.EtcdClient.txn`).

A transaction is a list of :class:`Compare`, a ``success`` branch that runs when every compare holds and a
``failure`` branch that runs otherwise; a branch is a list of :data:`TxnOp` applied atomically, in order
(a read sees the branch's earlier writes). The semantics are etcd's own:

* A compare looks at ``key``'s create revision, mod revision, version or value; a missing key counts as
  one with all three revisions 0 (a VALUE compare on a missing key is always false).
* With ``prefix=True`` it looks at every key under ``key`` (etcd's ``range_end``): every one must satisfy
  it. An empty range is compared as one zero key (create = mod = version = 0), except that a VALUE
  compare on an empty range is false. So ``Compare(p, MOD, LESS, r + 1, prefix=True)`` says "nothing
  under ``p`` was written after revision ``r``" (and holds when nothing is under ``p``).
* A branch (and the list of compares) holds at most 128 items (etcd's ``--max-txn-ops``); a branch may not
  put one key twice, nor put a key that it also deletes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from elastic.etcd.types import KeyValue

__all__ = [
    "Compare",
    "CompareOp",
    "CompareTarget",
    "DeleteOp",
    "GetOp",
    "GetResult",
    "PutOp",
    "TxnOp",
    "TxnResult",
]


class CompareTarget(str, Enum):
    """What a :class:`Compare` looks at."""

    CREATE = "create"
    MOD = "mod"
    VERSION = "version"
    VALUE = "value"


class CompareOp(str, Enum):
    """How a :class:`Compare` relates the key's actual target to its ``value`` (``actual OP value``)."""

    EQUAL = "="
    NOT_EQUAL = "!="
    LESS = "<"
    GREATER = ">"


@dataclass(frozen=True)
class Compare:
    """``key``'s ``target`` ``op`` ``value`` (or, with ``prefix``, that of every key under ``key``).

    ``value`` is a revision (an int) for CREATE, MOD and VERSION, and bytes for VALUE; a mismatch raises
    :class:`TypeError`. ``target`` and ``op`` may be given as their strings ("mod", "<")."""

    key: str
    target: CompareTarget
    op: CompareOp
    value: int | bytes
    prefix: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", CompareTarget(self.target))
        object.__setattr__(self, "op", CompareOp(self.op))
        if self.target is CompareTarget.VALUE:
            if not isinstance(self.value, bytes):
                raise TypeError(f"a VALUE compare needs bytes, not {type(self.value).__name__}")
        elif not isinstance(self.value, int) or isinstance(self.value, bool):
            raise TypeError(f"a {self.target.name} compare needs an int revision, not {type(self.value).__name__}")


@dataclass(frozen=True)
class PutOp:
    """Write ``key`` (attached to ``lease`` unless 0; the lease must be live, or the transaction fails)."""

    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class DeleteOp:
    """Delete ``key`` (with ``prefix``: every key under it); its result is how many keys were deleted."""

    key: str
    prefix: bool = False


@dataclass(frozen=True)
class GetOp:
    """Read ``key`` (with ``prefix``: every key under it, in key order); its result is a :class:`GetResult`.

    ``count_only`` returns no keys, only the count; ``keys_only`` returns the keys with empty values;
    ``limit`` (0: none) returns at most that many keys, the first in key order. ``after`` (with ``prefix``) reads
    only the keys under ``key`` that sort after this one (the next page of a paged read); ``revision`` (0: the
    newest) reads the keys as they were at that revision (etcd refuses a compacted or future one)."""

    key: str
    prefix: bool = False
    count_only: bool = False
    keys_only: bool = False
    limit: int = 0
    after: str | None = None
    revision: int = 0

    def __post_init__(self) -> None:
        if self.after is not None and not (self.prefix and self.after.startswith(self.key)):
            raise ValueError("GetOp: 'after' needs prefix=True and must lie under the key")
        if self.limit < 0 or self.revision < 0:
            raise ValueError("GetOp: limit and revision must be >= 0")


TxnOp = PutOp | DeleteOp | GetOp


@dataclass(frozen=True)
class GetResult:
    """What a :class:`GetOp` read: the keys returned, and how many keys matched (even beyond ``limit`` or
    with ``count_only``)."""

    kvs: tuple[KeyValue, ...]
    count: int


@dataclass(frozen=True)
class TxnResult:
    """The answer to a transaction.

    ``succeeded``: whether every compare held (so ``success`` ran, else ``failure``). ``revision``: the
    cluster's revision after it (one more than before if the branch wrote something, else unchanged).
    ``results``: one per op of the branch that ran, in order: a :class:`GetResult` for a :class:`GetOp`,
    the number of keys deleted for a :class:`DeleteOp`, None for a :class:`PutOp`.
    """

    succeeded: bool
    revision: int
    results: tuple[GetResult | int | None, ...]

    def get(self, i: int) -> GetResult:
        """``results[i]``, which must be a :class:`GetResult` (the op was a :class:`GetOp`)."""
        result = self.results[i]
        if not isinstance(result, GetResult):
            raise TypeError(f"result {i} of the transaction is {result!r}, not a GetResult")
        return result

    def reads(self) -> tuple[GetResult, ...]:
        """The results of the branch's :class:`GetOp` s alone, in order, to be unpacked into names
        (``closed, head = res.reads()``): a write added to the branch does not shift them, and a read added
        without its name fails the unpacking instead of shifting the others."""
        return tuple(r for r in self.results if isinstance(r, GetResult))
