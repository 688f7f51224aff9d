"""The Chrome trace event format's rules, as a validator: what :func:`service.core.trace.job_trace` writes must
pass it (and so open in Perfetto and chrome://tracing). Kept apart from the builder: one concern per module."""

from __future__ import annotations

import json
import math
from typing import Any, TypeGuard

__all__ = ["is_int", "is_number", "validate_trace"]

_PHASES = frozenset("BEXiICbneSTpFstfPNODMVvRc()=")
_METADATA = frozenset({"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"})
_MAX_ERRORS = 100


def is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_trace(obj: object) -> list[str]:
    """What is wrong with ``obj`` as a Chrome trace (JSON Object or Array Format), as messages; empty: valid.

    Checked: it is JSON-serializable (strictly: no NaN or infinity); ``traceEvents`` is a list of objects;
    ``displayTimeUnit`` is ``"ms"`` or ``"ns"``; every event has a known ``ph``, a string ``name`` (an ``E``
    may omit it), an integer ``pid``, a number ``ts >= 0`` (metadata events excepted), and ``args`` an object
    if present; ``B``, ``E``, ``X`` and ``i``/``I`` events have an integer ``tid``; ``X`` a number ``dur >= 0``;
    instants a scope ``s`` of ``g``, ``p`` or ``t`` if given; counters (``C``) numeric ``args``; metadata
    (``M``) events a known name with its ``args`` (``name`` a string, ``sort_index`` an integer). Per track
    (``pid``, ``tid``), ``B``/``E`` pairs balance (in time order, an ``E`` closes the latest open ``B``, of
    the same name if it has one) and durations (``X`` and ``B``/``E``) nest: none partially overlaps another.
    """
    errors: list[str] = []
    try:
        json.dumps(obj, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        errors.append(f"not JSON-serializable: {str(exc)[:200]}")
    if isinstance(obj, list):
        events: object = obj
    elif isinstance(obj, dict):
        if "traceEvents" not in obj:
            return [*errors, "no 'traceEvents'"]
        events = obj["traceEvents"]
        unit = obj.get("displayTimeUnit", "ms")
        if unit not in ("ms", "ns"):
            errors.append(f"displayTimeUnit must be 'ms' or 'ns', not {unit!r}")
        if "metadata" in obj and not isinstance(obj["metadata"], dict):
            errors.append("'metadata' must be an object")
    else:
        return [*errors, f"a trace is a JSON object or array, not {type(obj).__name__}"]
    if not isinstance(events, list):
        return [*errors, "'traceEvents' must be a list"]
    spans: dict[tuple[object, object], list[tuple[float, float, str]]] = {}  # track -> (start, end, what)
    durations: dict[tuple[object, object], list[tuple[float, int, dict[str, Any]]]] = {}  # track -> B/E events
    for k, ev in enumerate(events):
        if len(errors) >= _MAX_ERRORS:
            errors.append("... (more errors not shown)")
            return errors
        where = f"traceEvents[{k}]"
        if not isinstance(ev, dict):
            errors.append(f"{where}: an event must be an object, not {type(ev).__name__}")
            continue
        ph = ev.get("ph")
        if not isinstance(ph, str) or ph not in _PHASES:
            errors.append(f"{where}: unknown or missing phase 'ph': {ph!r}")
            continue
        where = f"{where} ({ph} {str(ev.get('name'))[:40]!r})"
        if "name" in ev or ph != "E":
            if not isinstance(ev.get("name"), str):
                errors.append(f"{where}: 'name' must be a string")
        if not is_int(ev.get("pid")):
            errors.append(f"{where}: 'pid' must be an integer")
        if "tid" in ev and not is_int(ev["tid"]):
            errors.append(f"{where}: 'tid' must be an integer")
        elif "tid" not in ev and ph in "BEXiI":
            errors.append(f"{where}: 'tid' is missing")
        if "args" in ev and not isinstance(ev["args"], dict):
            errors.append(f"{where}: 'args' must be an object")
        if "cat" in ev and not isinstance(ev["cat"], str):
            errors.append(f"{where}: 'cat' must be a string")
        if ph == "M":
            _check_metadata(ev, where, errors)
            continue
        ts = ev.get("ts")
        if "ts" not in ev:
            errors.append(f"{where}: 'ts' is missing")
            continue
        if not is_number(ts) or ts < 0:
            errors.append(f"{where}: 'ts' must be a finite number >= 0, not {ts!r}")
            continue
        track = (ev.get("pid"), ev.get("tid"))
        if ph == "X":
            dur = ev.get("dur")
            if not is_number(dur) or dur < 0:
                errors.append(f"{where}: 'dur' must be a finite number >= 0, not {dur!r}")
            else:
                spans.setdefault(track, []).append((float(ts), float(ts + dur), where))
        elif ph in "iI":
            if "s" in ev and ev["s"] not in ("g", "p", "t"):
                errors.append(f"{where}: instant scope 's' must be 'g', 'p' or 't', not {ev['s']!r}")
        elif ph == "C":
            args = ev.get("args")
            if not isinstance(args, dict) or not args:
                errors.append(f"{where}: a counter needs 'args' with its values")
            elif not all(is_number(v) for v in args.values()):
                errors.append(f"{where}: counter values must be finite numbers: {args!r}"[:300])
        elif ph in "BE":
            durations.setdefault(track, []).append((float(ts), k, ev))
    for track, pairs in durations.items():
        open_: list[tuple[float, str, str]] = []  # (ts, name, where)
        for ts, k, ev in sorted(pairs, key=lambda p: (p[0], p[1])):
            where = f"traceEvents[{k}] ({ev['ph']} {str(ev.get('name'))[:40]!r})"
            if ev["ph"] == "B":
                open_.append((ts, str(ev.get("name")), where))
                continue
            if not open_:
                errors.append(f"{where}: an 'E' with no open 'B' on track pid={track[0]} tid={track[1]}")
                continue
            begin, name, begun = open_.pop()
            if "name" in ev and ev["name"] != name:
                errors.append(f"{where}: closes {begun}, named {name!r}")
            spans.setdefault(track, []).append((begin, ts, begun))
        for _, _, begun in open_:
            errors.append(f"{begun}: a 'B' never closed by an 'E' on track pid={track[0]} tid={track[1]}")
    for track, items in spans.items():
        stack: list[tuple[float, float, str]] = []
        for start, end, what in sorted(items, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack and end > stack[-1][1]:
                errors.append(
                    f"{what}: partially overlaps {stack[-1][2]} on track pid={track[0]} tid={track[1]} "
                    "(durations on one track must nest)"
                )
                continue
            stack.append((start, end, what))
    return errors[: _MAX_ERRORS + 1]


def _check_metadata(ev: dict[str, Any], where: str, errors: list[str]) -> None:
    name, args = ev.get("name"), ev.get("args")
    if name not in _METADATA:
        errors.append(f"{where}: metadata name must be one of {sorted(_METADATA)}")
        return
    if not isinstance(args, dict):
        errors.append(f"{where}: metadata needs 'args'")
        return
    if str(name).startswith("thread_") and not is_int(ev.get("tid")):
        errors.append(f"{where}: thread metadata needs an integer 'tid'")
    if str(name).endswith("_name") and not isinstance(args.get("name"), str):
        errors.append(f"{where}: args.name must be a string")
    if str(name).endswith("_sort_index") and not is_int(args.get("sort_index")):
        errors.append(f"{where}: args.sort_index must be an integer")
    if name == "process_labels" and not isinstance(args.get("labels"), str):
        errors.append(f"{where}: args.labels must be a string")
