"""Median and p95 of a benchmark's samples (nearest-rank p95: with few trials it is the largest sample)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def p95(samples: Sequence[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def summarize(samples: Sequence[float]) -> dict[str, Any]:
    """``{"median", "p95", "n", "samples"}``; ``None`` figures when there are no samples."""
    values = [float(s) for s in samples]
    if not values:
        return {"median": None, "p95": None, "n": 0, "samples": []}
    return {"median": statistics.median(values), "p95": p95(values), "n": len(values), "samples": values}
