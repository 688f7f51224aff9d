"""The disk the benchmarks write snapshots to: ``dd``'s rates on it, and the snapshot interval it can absorb.

Issue 29's loop goal holds "where the disk absorbs it": a snapshot every K steps keeps >= 0.95 of the loop's
rate without snapshots when the state written per unit of time, ``state / (K x step)``, is at most
:data:`ABSORB_FRACTION` of ``dd``'s sequential write rate. Otherwise the writer is never idle (a snapshot that
falls due while it writes is deferred) and the figure measures the disk, not the loop.
"""

from __future__ import annotations

import math
import subprocess
import time
from pathlib import Path

__all__ = ["ABSORB_FRACTION", "GiB", "MiB", "absorbed_interval", "absorbs", "dd_read_seconds", "dd_write_bytes_per_s"]

MiB = 2**20
GiB = 2**30
#: the share of ``dd``'s write rate a snapshot schedule may use and still count as absorbed by the disk
ABSORB_FRACTION = 0.8


def dd_write_bytes_per_s(directory: Path, nbytes: int) -> float:
    """Bytes/s of ``dd`` writing ``nbytes`` (at least 8 MiB) into ``directory`` in 8 MiB blocks, one fsync at the
    end; the file is removed."""
    target = directory / "dd.bin"
    count = max(1, nbytes // (8 * MiB))
    cmd = ["dd", "if=/dev/zero", f"of={target}", "bs=8M", f"count={count}", "conv=fsync"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    seconds = time.perf_counter() - start
    target.unlink()
    return count * 8 * MiB / seconds


def dd_read_seconds(paths: list[Path]) -> float:
    """Seconds ``dd`` (8 MiB blocks) takes to read ``paths`` one after the other."""
    start = time.perf_counter()
    for p in paths:
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=8M"], check=True, capture_output=True)
    return time.perf_counter() - start


def absorbs(state_bytes: int, every: int, step_s: float, disk_bytes_per_s: float) -> bool:
    """Whether a snapshot of ``state_bytes`` every ``every`` steps of ``step_s`` seconds writes at most
    :data:`ABSORB_FRACTION` of ``disk_bytes_per_s``."""
    if every <= 0:
        return True
    return state_bytes / (every * step_s) <= ABSORB_FRACTION * disk_bytes_per_s


def absorbed_interval(state_bytes: int, step_s: float, disk_bytes_per_s: float, multiple: int = 10) -> int:
    """The shortest interval, a multiple of ``multiple`` steps, at which the disk absorbs the snapshots
    (:func:`absorbs`)."""
    if state_bytes < 0 or step_s <= 0 or disk_bytes_per_s <= 0 or multiple <= 0:
        raise ValueError(
            f"absorbed_interval needs state_bytes >= 0 and a positive step, disk rate and multiple; got "
            f"state_bytes={state_bytes}, step_s={step_s}, disk_bytes_per_s={disk_bytes_per_s}, multiple={multiple}"
        )
    steps = state_bytes / (ABSORB_FRACTION * disk_bytes_per_s * step_s)
    every = max(multiple, math.ceil(steps / multiple) * multiple)
    while not absorbs(state_bytes, every, step_s, disk_bytes_per_s):  # rounding at the boundary
        every += multiple
    return every
