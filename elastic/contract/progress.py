"""The progress wire format: what a job's rank 0 writes to its progress key and the job service reads.

The writer is :mod:`elastic.train.progress` (the workers' reporter); the reader is the service's controller,
which trusts nothing: any job's rank 0 writes its key, so :meth:`Progress.from_json` checks every field's type
and range and raises :class:`InvalidProgressError` for anything else. Nothing here imports torch or an etcd
client.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "LAST_SAVE_SECONDS",
    "LOCAL_SNAPSHOTS_FAILED",
    "LOCAL_SNAPSHOTS_SAVED",
    "LOCAL_SNAPSHOTS_SKIPPED",
    "LOCAL_SNAPSHOT_COUNTERS",
    "MAX_PROGRESS_BYTES",
    "SNAPSHOTS_DEFERRED",
    "SNAPSHOTS_SAVED",
    "SNAPSHOTS_SKIPPED",
    "SNAPSHOT_COUNTERS",
    "InvalidProgressError",
    "Progress",
]

# The counters the elastic loop puts in a report's ``extra`` (one vocabulary: the writers emit these names, the
# service's trace, metric series and CLI read them). Its durable snapshots' (elastic.train.schedule.SnapshotStats):
SNAPSHOTS_SAVED = "snapshots_saved"
SNAPSHOTS_DEFERRED = "snapshots_deferred"
SNAPSHOTS_SKIPPED = "snapshots_skipped"
LAST_SAVE_SECONDS = "last_save_seconds"
SNAPSHOT_COUNTERS = (SNAPSHOTS_SAVED, SNAPSHOTS_DEFERRED, SNAPSHOTS_SKIPPED, LAST_SAVE_SECONDS)
# ... and its node-local tier's, on rank 0's node (elastic.checkpoint.tiers.LocalSnapshotStats):
LOCAL_SNAPSHOTS_SAVED = "local_snapshots_saved"
LOCAL_SNAPSHOTS_SKIPPED = "local_snapshots_skipped"
LOCAL_SNAPSHOTS_FAILED = "local_snapshots_failed"
LOCAL_SNAPSHOT_COUNTERS = (LOCAL_SNAPSHOTS_SAVED, LOCAL_SNAPSHOTS_SKIPPED, LOCAL_SNAPSHOTS_FAILED)

#: The largest progress value :meth:`Progress.from_json` reads (a report is well under 1 KiB plus its nodes).
MAX_PROGRESS_BYTES = 256 * 1024
_MAX_INT = 2**63 - 1  # counts and steps: what etcd's JSON readers (Go int64) take too
_MAX_TIME = 253_402_214_400.0  # 9999-12-31T00:00:00Z: every time below converts to a datetime
_MAX_PATH = 4096  # characters of a checkpoint path
_MAX_NODES = 10_000
_MAX_NODE_NAME = 256
_MAX_EXTRA_DEPTH = 16  # nesting of the free-form ``extra`` values


class InvalidProgressError(ValueError):
    """A progress value that is not a valid report: not UTF-8 JSON, not an object, too large, or a field of
    the wrong type or out of range. The only error :meth:`Progress.from_json` raises."""


@dataclass(frozen=True)
class Progress:
    """One progress report (JSON in etcd). ``checkpoint_*`` describe the latest *committed* checkpoint.

    Read with :meth:`from_json`, every field has exactly its annotated type: counts are ``int`` (never
    ``bool``) within ``[0, 2**63)``, ``world_size`` at least 1, ``time`` a finite ``float`` of seconds since the
    epoch before the year 10000, ``loss`` finite, strings valid Unicode (no lone surrogates).
    """

    step: int
    world_size: int
    time: float
    total_steps: int | None = None
    loss: float | None = None
    generation: int | None = None
    restart_count: int = 0
    checkpoint_step: int | None = None
    checkpoint_path: str | None = None
    #: the service's names of the nodes the workers of this round run on (sorted), when known
    nodes: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        """Strict JSON: a non-finite float (a diverged loss) is written as null. Raises ``TypeError`` or
        ``ValueError`` for values JSON cannot hold (an object in ``extra``)."""
        return json.dumps(_finite(asdict(self)), sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Progress:
        """Parse and check a stored report; unknown fields are ignored (a newer writer). Raises
        :class:`InvalidProgressError`, and nothing else, for any value that is not a valid report."""
        if len(raw) > MAX_PROGRESS_BYTES:
            raise InvalidProgressError(f"a progress report of {len(raw)} bytes (at most {MAX_PROGRESS_BYTES})")
        try:
            data = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float)
        except InvalidProgressError:
            raise
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, an int of too many digits, too deep
            raise InvalidProgressError(f"a progress report must be UTF-8 JSON: {_short(exc)}") from None
        if not isinstance(data, dict):
            raise InvalidProgressError(f"a progress report must be a JSON object, not {type(data).__name__}")
        return cls(
            step=_count(_required(data, "step"), "step"),
            world_size=_count(_required(data, "world_size"), "world_size", minimum=1),
            time=_time(data),
            total_steps=_optional_count(data, "total_steps"),
            loss=_loss(data),
            generation=_optional_count(data, "generation"),
            restart_count=_count(data.get("restart_count", 0), "restart_count"),
            checkpoint_step=_optional_count(data, "checkpoint_step"),
            checkpoint_path=_path(data),
            nodes=_nodes(data),
            extra=_extra(data),
        )


def _reject_constant(name: str) -> Any:
    raise InvalidProgressError(f"a progress report must be strict JSON: {name} is not a number")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):  # 1e400
        raise InvalidProgressError(f"a progress report holds a number out of range: {text[:40]}")
    return number


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:200] + "..."


def _short_repr(v: object) -> str:
    text = repr(v) if not isinstance(v, int) or abs(v) < 10**30 else f"a number of {len(str(abs(v)))} digits"
    return text if len(text) <= 60 else text[:60] + "..."


def _required(data: dict[str, Any], name: str) -> object:
    if name not in data:
        raise InvalidProgressError(f"progress field {name!r} is missing")
    return data[name]


def _count(v: object, name: str, minimum: int = 0) -> int:
    if type(v) is not int:
        raise InvalidProgressError(f"progress field {name!r} must be a whole number, not {type(v).__name__}")
    if not minimum <= v <= _MAX_INT:
        raise InvalidProgressError(f"progress field {name!r} must be within [{minimum}, 2**63), got {_short_repr(v)}")
    return v


def _optional_count(data: dict[str, Any], name: str) -> int | None:
    v = data.get(name)
    return None if v is None else _count(v, name)


def _number(v: object, name: str) -> float:
    if type(v) is not int and type(v) is not float:
        raise InvalidProgressError(f"progress field {name!r} must be a number, not {type(v).__name__}")
    try:
        number = float(v)
    except OverflowError:  # an int beyond any float
        raise InvalidProgressError(f"progress field {name!r} is out of range") from None
    if not math.isfinite(number):
        raise InvalidProgressError(f"progress field {name!r} must be finite")
    return number


def _time(data: dict[str, Any]) -> float:
    t = _number(_required(data, "time"), "time")
    if not 0.0 <= t < _MAX_TIME:
        raise InvalidProgressError(f"progress field 'time' must be seconds since 1970 before 9999, got {t!r}")
    return t


def _loss(data: dict[str, Any]) -> float | None:
    v = data.get("loss")
    return None if v is None else _number(v, "loss")


def _text(v: object, what: str, limit: int) -> str:
    if type(v) is not str:
        raise InvalidProgressError(f"{what} must be a string, not {type(v).__name__}")
    if len(v) > limit:
        raise InvalidProgressError(f"{what} has {len(v)} characters (at most {limit})")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON): no one could write it back
        raise InvalidProgressError(f"{what} is not valid Unicode") from None
    return v


def _path(data: dict[str, Any]) -> str | None:
    v = data.get("checkpoint_path")
    return None if v is None else _text(v, "progress field 'checkpoint_path'", _MAX_PATH)


def _nodes(data: dict[str, Any]) -> list[str] | None:
    v = data.get("nodes")
    if v is None:
        return None
    if type(v) is not list:
        raise InvalidProgressError(f"progress field 'nodes' must be a list of names, not {type(v).__name__}")
    if len(v) > _MAX_NODES:
        raise InvalidProgressError(f"progress field 'nodes' lists {len(v)} nodes (at most {_MAX_NODES})")
    return [_text(n, "a name in progress field 'nodes'", _MAX_NODE_NAME) for n in v]


def _extra(data: dict[str, Any]) -> dict[str, Any]:
    v = data.get("extra", {})
    if type(v) is not dict:
        raise InvalidProgressError(f"progress field 'extra' must be an object, not {type(v).__name__}")
    _check_json(v, 0)
    return v


def _check_json(v: object, depth: int) -> None:
    """Strings valid Unicode, nesting bounded (numbers are finite already: NaN and Infinity are refused)."""
    if depth > _MAX_EXTRA_DEPTH:
        raise InvalidProgressError(f"progress field 'extra' is nested deeper than {_MAX_EXTRA_DEPTH}")
    if isinstance(v, str):
        _text(v, "a string in progress field 'extra'", MAX_PROGRESS_BYTES)
    elif isinstance(v, dict):
        for key, item in v.items():
            _text(key, "a key in progress field 'extra'", MAX_PROGRESS_BYTES)
            _check_json(item, depth + 1)
    elif isinstance(v, list):
        for item in v:
            _check_json(item, depth + 1)


def _finite(v: Any) -> Any:
    """``v`` with every non-finite float (NaN, infinities) replaced by None: strict JSON has none."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v
