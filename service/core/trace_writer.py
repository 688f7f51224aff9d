"""Writing a Chrome trace (Trace Event Format, JSON Object Format): the tracks, the events on them and the
``traceEvents`` list, with no knowledge of jobs.

:class:`TraceWriter` holds the events as they are emitted onto named tracks (the controller's, the snapshots',
one per node), with times as integer microseconds relative to a time origin, and at the end gives each track its
``tid`` and writes the metadata events and the events in an order Chrome nests correctly. What is drawn and why
(the replay of a job's events) is :mod:`service.core.trace`; the format's rules are checked by
:mod:`service.core.trace_format`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

__all__ = [
    "CONTROLLER",
    "CONTROLLER_TID",
    "FIRST_NODE_TID",
    "PID",
    "SNAPSHOTS",
    "SNAPSHOTS_TID",
    "TraceWriter",
    "Track",
    "json_safe",
    "node_track",
    "utc",
]

PID = 1
CONTROLLER_TID = 0
SNAPSHOTS_TID = 1
FIRST_NODE_TID = 2

_US = timedelta(microseconds=1)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

Track = tuple[str, str]  # ("controller", ""), ("snapshots", ""), ("node", name)
CONTROLLER: Track = ("controller", "")
SNAPSHOTS: Track = ("snapshots", "")


def node_track(name: str) -> Track:
    return ("node", name)


def utc(t: datetime) -> datetime:
    """``t`` with a time zone (a naive time is UTC)."""
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


def json_safe(value: Any, depth: int = 0) -> Any:
    """A copy JSON can hold: non-finite floats become None, keys strings, nesting cut at 8 levels."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if depth >= 8:
        return str(value)[:200]
    if isinstance(value, Mapping):
        return {str(k): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, depth + 1) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)[:200]


class TraceWriter:
    """The events of one process (``pid`` :data:`PID`), by track, with times relative to ``origin``."""

    def __init__(self, origin: datetime) -> None:
        self.origin = utc(origin)
        self.out: list[tuple[Track, dict[str, Any], int]] = []  # (track, event, depth: 1 inside a generation)
        self.nodes: set[str] = set()  # the node tracks, each drawn even when nothing was emitted on it

    @property
    def origin_unix_us(self) -> int:
        return (self.origin - _EPOCH) // _US

    def us(self, t: datetime) -> int:
        return max(0, (utc(t) - self.origin) // _US)

    def emit(self, track: Track, event: dict[str, Any], depth: int = 0) -> None:
        if track[0] == "node":
            self.nodes.add(track[1])
        self.out.append((track, event, depth))

    def span(
        self, track: Track, name: str, start: datetime, end: datetime, args: dict[str, Any], depth: int = 0
    ) -> None:
        ts = self.us(start)
        self.emit(
            track,
            {"name": name, "ph": "X", "ts": ts, "dur": max(0, self.us(end) - ts), "pid": PID, "args": json_safe(args)},
            depth,
        )

    def instant(self, track: Track, name: str, t: datetime, args: dict[str, Any], scope: str = "t") -> None:
        self.emit(track, {"name": name, "ph": "i", "s": scope, "ts": self.us(t), "pid": PID, "args": json_safe(args)})

    def counter(self, name: str, t: datetime, value: object) -> None:
        """A counter on the controller's track; a value that is not a finite number is left out."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return
        self.emit(CONTROLLER, {"name": name, "ph": "C", "ts": self.us(t), "pid": PID, "args": {"value": value}})

    def last(self, track: Track, name: str) -> dict[str, Any] | None:
        """The last event named ``name`` emitted on ``track`` (to add to its args), or None."""
        for at, event, _ in reversed(self.out):
            if at == track and event["name"] == name:
                return event
        return None

    # -- the trace ----------------------------------------------------------------------------------------
    def tids(self) -> dict[Track, int]:
        tids: dict[Track, int] = {CONTROLLER: CONTROLLER_TID, SNAPSHOTS: SNAPSHOTS_TID}
        for i, node in enumerate(sorted(self.nodes)):
            tids[node_track(node)] = FIRST_NODE_TID + i
        return tids

    def track_names(self) -> dict[int, str]:
        """Each track's name by ``tid``, in ``tid`` order."""
        tids = self.tids()
        names = {CONTROLLER_TID: "controller", SNAPSHOTS_TID: "snapshots"}
        names.update({tids[node_track(n)]: f"node {n}" for n in self.nodes})
        return dict(sorted(names.items()))

    def trace_events(self, process_name: str) -> list[dict[str, Any]]:
        """``traceEvents``: the process's and the tracks' names and order, then the events by time."""
        tids = self.tids()
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": PID, "tid": CONTROLLER_TID, "args": {"name": process_name}},
        ]
        for tid, name in self.track_names().items():
            meta.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": name}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid, "args": {"sort_index": tid}})
        # by time; at one time the longer span first, a generation before a re-form of the same length, so that
        # the enclosing one comes first (Chrome nests complete events of one time by their order)
        ordered = sorted(self.out, key=lambda o: (o[1]["ts"], -o[1].get("dur", 0), o[2]))
        return meta + [{**event, "tid": tids[track]} for track, event, _ in ordered]
