"""Hash at memory speed (issue 29): digest throughput, and what a save's verification costs against ``dd``.

Two parts, on one local directory (``--dir``, default a temp dir):

- hashing throughput of SHA-256 (``hashlib``, one core) and BLAKE3 (``blake3``, one thread and all threads)
  over a 256 MiB buffer in 8 MiB chunks, the way the writer and the reader hash;
- rounds of a blocking save of ``--gib`` GiB, each paired with ``dd`` writing as many bytes right before it
  (8 MiB blocks, ``conv=fsync``), with: the default settings (BLAKE3, ``verify_after_write="auto"``: ``size`` on a local
  file system), BLAKE3 with ``read_back_uncached``, and the settings before issue 29 (SHA-256, every file
  re-read and re-hashed after writing: ``read_back``).  "write + verify" = data + commit + verification, as in
  bench/checkpoint_bench.py's row of the same name; "% of dd": the median over rounds of each save against
  the ``dd`` beside it.

- with ``--sharded``, also rounds of a blocking *sharded* save (DCP, ``layout="sharded"``, one process) of the
  same state, each beside its own ``dd``: as it is (files hashed while DCP writes them,
  elastic/checkpoint/write_digests.py) and with every data file read back to be hashed (what sharded saves did
  before; the bench turns the hashing while writing off for it).

Goal (issue 29): write + default verification >= 80 % of ``dd`` for 1 GiB.
Prints a table and writes JSON (default bench/results/hash.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import blake3  # noqa: E402

from elastic.checkpoint import CheckpointOptions, StateLayout, create_checkpoint_manager  # noqa: E402
from elastic.checkpoint.filesystems import filesystem_type  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
CHUNK = 8 * MiB

#: (label, digest_algorithm, verify_after_write) of each save configuration measured
CONFIGS = (
    ("default (blake3, auto)", "blake3", "auto"),
    ("blake3, read_back_uncached", "blake3", "read_back_uncached"),
    ("before issue 29 (sha256, read_back)", "sha256", "read_back"),
)


def hash_throughput(nbytes: int = 256 * MiB, repeats: int = 3) -> dict[str, float]:
    """Bytes/s (best of ``repeats``) of each hasher over ``nbytes`` in 8 MiB chunks."""
    data = memoryview(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy().data)
    makers = {
        "sha256": hashlib.sha256,
        "blake3_1_thread": lambda: blake3.blake3(max_threads=1),
        "blake3_all_threads": lambda: blake3.blake3(max_threads=blake3.blake3.AUTO),
    }
    out = {}
    for name, make in makers.items():
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            hasher = make()
            for offset in range(0, nbytes, CHUNK):
                hasher.update(data[offset : offset + CHUNK])
            hasher.hexdigest()
            best = min(best, time.perf_counter() - start)
        out[name] = nbytes / best
    return out


def dd_write(directory: Path, nbytes: int) -> float:
    """Bytes/s of ``dd`` writing ``nbytes`` in 8 MiB blocks with one fsync at the end."""
    target = directory / "dd.bin"
    count = max(1, nbytes // CHUNK)
    cmd = ["dd", "if=/dev/zero", f"of={target}", "bs=8M", f"count={count}", "conv=fsync"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    seconds = time.perf_counter() - start
    target.unlink()
    return count * CHUNK / seconds


def make_state(nbytes: int) -> dict[str, Any]:
    """Four float32 tensors of ``nbytes`` together (random bits: nothing compresses or dedups)."""
    quarter = nbytes // 4 // 4
    low, high = -(2**31), 2**31 - 1
    return {f"w{i}": torch.randint(low, high, (quarter,), dtype=torch.int32).view(torch.float32) for i in range(4)}


def save_once(root: Path, step: int, state: dict[str, Any], algorithm: str, verify: str) -> dict[str, Any]:
    """One blocking save (written from the live tensors, no staging copy); its phase times."""
    options = CheckpointOptions(keep_last=1, digest_algorithm=algorithm, verify_after_write=verify)
    with create_checkpoint_manager(str(root), options) as mgr:
        start = time.perf_counter()
        mgr.save(step, state, blocking=True)
        wall = time.perf_counter() - start
        t = mgr.last_timings
    write_s = t.data_s + t.commit_s
    return {
        "verify_mode": t.verify_mode,
        "write_s": write_s,
        "verify_s": t.verify_s,
        "write_verify_bytes_per_s": t.bytes_written / (write_s + t.verify_s),
        "save_wall_s": wall,
        "bytes": t.bytes_written,
    }


def bench_saves(directory: Path, nbytes: int, repeats: int) -> dict[str, Any]:
    """Rounds of each configuration, each save paired with a ``dd`` of the same size right before it (the VM's
    disk speed drifts by 2x within a minute: a save is compared with the ``dd`` beside it), the order of the
    configurations reversed every other round; ``os.sync()`` between runs: nobody pays another's writes."""
    state = make_state(nbytes)
    dd: list[float] = []
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in CONFIGS}
    save_once(directory / "warm-up", 0, state, "blake3", "none")
    shutil.rmtree(directory / "warm-up")
    for step in range(1, repeats + 1):
        order = list(enumerate(CONFIGS))
        for index, (label, algorithm, verify) in order if step % 2 else reversed(order):
            os.sync()
            dd_bps = dd_write(directory, nbytes)
            dd.append(dd_bps)
            os.sync()
            row = save_once(directory / f"config-{index}", step, state, algorithm, verify)
            row["dd_bytes_per_s"] = dd_bps
            row["fraction_of_dd"] = row["write_verify_bytes_per_s"] / dd_bps
            runs[label].append(row)
    return {"dd_bytes_per_s": dd, "saves": runs}


#: (label, read the data files back to hash them) of each sharded save configuration measured
SHARDED_CONFIGS = (
    ("sharded, hashed while written (default)", False),
    ("sharded, files read back to be hashed (before)", True),
)


def sharded_save_once(root: Path, step: int, state: dict[str, Any], read_back: bool) -> dict[str, Any]:
    """One blocking sharded save (DCP, one process, default options); its wall time."""
    import elastic.checkpoint.sharded as sharded

    options = CheckpointOptions(keep_last=1, layout=StateLayout.SHARDED)
    hash_while_writing = sharded.hash_while_writing
    if read_back:  # the writer is left alone: after_write reads every data file back, as before
        sharded.hash_while_writing = lambda _writer, _digests: False  # type: ignore[assignment]
    try:
        with create_checkpoint_manager(str(root), options) as mgr:
            start = time.perf_counter()
            mgr.save(step, state, blocking=True)
            wall = time.perf_counter() - start
    finally:
        sharded.hash_while_writing = hash_while_writing
    return {"save_wall_s": wall}


def bench_sharded(directory: Path, nbytes: int, repeats: int) -> dict[str, Any]:
    """As :func:`bench_saves`, for :data:`SHARDED_CONFIGS`."""
    state = make_state(nbytes)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in SHARDED_CONFIGS}
    for step in range(1, repeats + 1):
        order = list(enumerate(SHARDED_CONFIGS))
        for index, (label, read_back) in order if step % 2 else reversed(order):
            os.sync()
            dd_bps = dd_write(directory, nbytes)
            os.sync()
            row = sharded_save_once(directory / f"sharded-{index}", step, state, read_back)
            row["dd_bytes_per_s"] = dd_bps
            row["fraction_of_dd"] = nbytes / row["save_wall_s"] / dd_bps
            runs[label].append(row)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="bytes written per save and by dd (GiB)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="local directory to write to (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "hash.json")
    parser.add_argument("--sharded", action="store_true", help="also sharded (DCP) saves, see above")
    args = parser.parse_args()
    nbytes = int(args.gib * GiB)
    workdir = Path(tempfile.mkdtemp(prefix="hash-bench-", dir=args.dir))
    load_before = os.getloadavg()[0]
    print(
        f"disk: {workdir} ({filesystem_type(workdir)})  cpus: {os.cpu_count()}  blake3 {blake3.__version__}  "
        f"load average: {load_before:.1f}"
    )
    try:
        hashing = hash_throughput()
        saves = bench_saves(workdir, nbytes, args.repeats)
        if args.sharded:
            saves["sharded"] = bench_sharded(workdir, nbytes, args.repeats)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg()[0],
        },
        "bytes": nbytes,
        "hash_bytes_per_s": hashing,
        **saves,
    }
    report["summary"] = print_report(report, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


def print_report(r: dict[str, Any], repeats: int) -> dict[str, Any]:
    med = statistics.median
    for name, bps in r["hash_bytes_per_s"].items():
        print(f"  {'hash ' + name:<52} {bps / MiB:8.0f} MiB/s")
    dd_bps = med(r["dd_bytes_per_s"])
    print(f"  {'dd conv=fsync (write), median of all':<52} {dd_bps / MiB:8.0f} MiB/s {r['bytes'] / dd_bps:5.2f} s")
    summary: dict[str, Any] = {"dd_bytes_per_s": dd_bps}
    for label, rows in r["saves"].items():
        full = med(row["write_verify_bytes_per_s"] for row in rows)
        fraction = med(row["fraction_of_dd"] for row in rows)
        verify_ms = med(row["verify_s"] for row in rows) * 1e3
        mode = rows[0]["verify_mode"]
        seconds = med(row["write_s"] + row["verify_s"] for row in rows)
        print(
            f"  {'write + verify, ' + label:<52} {full / MiB:8.0f} MiB/s {seconds:5.2f} s ({fraction * 100:3.0f} % of "
            f"the dd beside it; verify {mode} {verify_ms:.0f} ms)"
        )
        summary[label] = {
            "write_verify_fraction_of_dd": fraction,
            "write_verify_s": seconds,
            "verify_mode": mode,
            "verify_ms": verify_ms,
        }
    for label, rows in r.get("sharded", {}).items():
        fraction = med(row["fraction_of_dd"] for row in rows)
        seconds = med(row["save_wall_s"] for row in rows)
        print(
            f"  {'save, ' + label:<52} {r['bytes'] / seconds / MiB:8.0f} MiB/s {seconds:5.2f} s "
            f"({fraction * 100:3.0f} % of the dd beside it)"
        )
        summary[label] = {"save_fraction_of_dd": fraction, "save_s": seconds}
    default = summary[CONFIGS[0][0]]["write_verify_fraction_of_dd"]
    summary["goal_default_write_verify_ge_80pct_dd"] = default >= 0.80
    print(
        f"medians over {repeats} interleaved rounds of {r['bytes'] / GiB:.2f} GiB (load average at the end: "
        f"{r['machine']['load_average_after']:.1f}); write + default verification = "
        f"{default * 100:.0f} % of dd (goal >= 80 %: {'met' if default >= 0.80 else 'MISSED'})"
    )
    return summary


if __name__ == "__main__":
    main()
