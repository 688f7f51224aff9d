"""Plain-text rendering of API answers for the CLI and the demo (pure functions of JSON dicts)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from elastic.contract.progress import SNAPSHOTS_SAVED

__all__ = [
    "METRIC_COLUMNS",
    "event_line",
    "job_table",
    "job_text",
    "metric_rows",
    "metric_table",
    "node_table",
    "progress_line",
]


def _clock(value: str | None) -> str:
    if not value:
        return "-"
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone().strftime("%H:%M:%S")
    except ValueError:
        return value


def _bar(step: int, total: int, width: int = 24) -> str:
    frac = min(max(step / total, 0.0), 1.0) if total > 0 else 0.0
    filled = round(frac * width)
    return f"[{'#' * filled}{'.' * (width - filled)}] {frac * 100:3.0f}%"


def progress_line(job: dict[str, Any]) -> str:
    """``state | step 40/150 [####....] 27% | loss 0.0123 | world 3 on node-1,node-2 | ckpt 40``."""
    prog = job.get("progress") or {}
    step, total = prog.get("step"), prog.get("total_steps")
    parts = [f"{job['state']:<10}"]
    if step is None:
        parts.append("no progress yet")
    elif total:
        parts.append(f"step {step}/{total} {_bar(step, total)}")
    else:
        parts.append(f"step {step}")
    if prog.get("loss") is not None:
        parts.append(f"loss {prog['loss']:.4g}")
    world = job.get("world_size") or {}
    current = world.get("current")
    nodes = ",".join(job.get("nodes") or [])
    parts.append(f"world {'-' if current is None else current}" + (f" on {nodes}" if nodes else ""))
    ckpt = job.get("checkpoint") or {}
    if ckpt.get("step") is not None:
        parts.append(f"ckpt {ckpt['step']}")
    return " | ".join(parts)


def event_line(event: dict[str, Any]) -> str:
    return f"{_clock(event.get('time'))}  {event.get('type', ''):<18} {event.get('message', '')}"


def job_text(job: dict[str, Any]) -> str:
    """A multi-line status report: state, progress, world size now and history, restarts, checkpoint."""
    spec = job["spec"]
    world = job["world_size"]
    restarts, budget = job["restarts"], job["restart_budget"]
    ckpt = job["checkpoint"]
    lines = [
        f"job        {job['id']}  ({spec['name']})",
        f"state      {job['state']}: {job['message']}"
        + ("  [cancel requested]" if job.get("cancel_requested") else ""),
        f"nodes      {', '.join(job['nodes']) or '-'}  (min {spec['min_nodes']}, max {spec['max_nodes']}, "
        f"{spec['nproc_per_node']} proc/node, generation {job['generation']})",
        f"progress   {progress_line(job)}",
        f"world size now {'-' if world['current'] is None else world['current']}"
        + (f" (expected {world['expected']})" if world.get("expected") is not None else ""),
    ]
    for change in world["history"]:
        lines.append(
            f"           {_clock(change['at'])}  {change['world_size']:>3}"
            f"  on {', '.join(change['nodes']) or '-'}"
            f"  (generation {change['generation']})"
        )
    lines.append(
        f"restarts   failure {restarts['failure']}/{budget['max_failures']}, membership "
        f"{restarts['membership']}/{budget['max_membership_changes']}, in-place {restarts['in_place']}"
    )
    if ckpt.get("step") is not None:
        lines.append(
            f"checkpoint step {ckpt['step']} at {ckpt.get('path') or '-'} ({_clock(ckpt.get('committed_at'))})"
        )
    else:
        lines.append("checkpoint none committed yet")
    lines.append(f"ckpt url   {ckpt.get('url') or '-'}")
    if job.get("blacklist"):
        lines.append("avoiding   " + ", ".join(f"{n} until {_clock(t)}" for n, t in job["blacklist"].items()))
    if job.get("last_error"):
        lines.append("last error " + job["last_error"].replace("\n", "\n           "))
    return "\n".join(lines)


def job_table(jobs: list[dict[str, Any]]) -> str:
    rows: list[tuple[str, ...]] = [("ID", "STATE", "NODES", "WORLD", "STEP", "RESTARTS f/m/i", "CREATED")]
    for j in jobs:
        r = j["restarts"]
        step = (
            "-" if j.get("step") is None else f"{j['step']}" + (f"/{j['total_steps']}" if j.get("total_steps") else "")
        )
        rows.append(
            (
                j["id"],
                j["state"],
                ",".join(j["nodes"]) or "-",
                "-" if j.get("world_size") is None else str(j["world_size"]),
                step,
                f"{r['failure']}/{r['membership']}/{r['in_place']}",
                _clock(j["created_at"]),
            )
        )
    return _table(rows)


def node_table(nodes: list[dict[str, Any]]) -> str:
    rows: list[tuple[str, ...]] = [("NODE", "MODE", "CAPACITY", "FREE", "JOBS", "HOST", "REGISTERED")]
    for n in nodes:
        live = n.get("live", True)
        mode = n.get("mode") or "active"
        rows.append(
            (
                n["name"],
                mode if live else f"{mode} (not live)",
                str(n["capacity"]) if live else "-",
                str(n["free"]) if live else "-",
                ",".join(n["jobs"]) or "-",
                n.get("rdzv_host") or n.get("hostname") or "-",
                _clock(n.get("registered_at")),
            )
        )
    return _table(rows)


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


#: the columns of ``etrain metrics`` (``--csv`` prints them all, in this order)
METRIC_COLUMNS = (
    "time",
    "reports",
    "step",
    "loss",
    "loss_min",
    "loss_max",
    "steps_per_s",
    "steps_per_s_min",
    "steps_per_s_max",
    "world_size",
    "world_size_min",
    "world_size_max",
    "restart_count",
    "checkpoint_step",
    SNAPSHOTS_SAVED,
)
#: the values of a series' windows and points that ``etrain metrics`` shows (the ones with a min and a max: _RANGED)
_SHOWN = ("step", "loss", "steps_per_s", "world_size", "restart_count", "checkpoint_step", SNAPSHOTS_SAVED)
_RANGED = ("loss", "steps_per_s", "world_size")


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
        return str(int(v))
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def metric_rows(series: dict[str, Any]) -> list[dict[str, str]]:
    """One row per window (its reports' last values, with min and max of loss, steps/s and world size) and per
    point of ``GET /v1/jobs/{id}/metrics``, oldest first; ``time`` is the last report's (UTC)."""
    rows: list[dict[str, str]] = []
    for w in series.get("windows", []):
        row = {"time": _iso(w["t_last"]), "reports": str(w["n"])}
        for name in _SHOWN:
            agg = w.get(name)
            row[name] = _value(agg[1]) if agg else ""
            if name in _RANGED:
                row[name + "_min"], row[name + "_max"] = (_value(agg[2]), _value(agg[3])) if agg else ("", "")
        rows.append(row)
    for p in series.get("points", []):
        row = {"time": _iso(p["t"]), "reports": "1"}
        for name in _SHOWN:
            row[name] = _value(p.get(name))
            if name in _RANGED:
                row[name + "_min"] = row[name + "_max"] = row[name]
        rows.append(row)
    return rows


def metric_table(series: dict[str, Any]) -> str:
    """``etrain metrics``: a row per window or point (min..max of a window's loss and steps/s shown)."""
    rows = metric_rows(series)
    if not rows:
        return f"{series.get('job_id', '')}: no progress reported yet"
    out = [("TIME", "REPORTS", "STEP", "LOSS", "LOSS MIN..MAX", "STEPS/S", "WORLD", "RESTARTS", "CKPT")]
    for r in rows:
        span = f"{r['loss_min']}..{r['loss_max']}" if r["reports"] != "1" and r["loss"] else ""
        out.append(
            (
                r["time"],
                r["reports"],
                r["step"],
                r["loss"] or "-",
                span,
                r["steps_per_s"] or "-",
                r["world_size"],
                r["restart_count"],
                r["checkpoint_step"] or "-",
            )
        )
    return _table(out)
