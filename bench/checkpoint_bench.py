"""Checkpoint benchmark: blocking time and write throughput of elastic.checkpoint vs the usual ways.

For a ~200 MB state (``--size-mb``) it measures, on one local directory (``--dir``, default a temp dir):

- ``dd`` writing the same number of bytes with ``conv=fsync`` (the disk's sequential write speed);
- synchronous ``torch.save`` from rank 0 (what a plain training loop blocks for);
- our background save: time the training loop is blocked (copy into reused CPU buffers), and the
  background write throughput (data + fsync + manifest commit);
- ``torch.distributed.checkpoint.async_save`` (DCP): time until it returns, and until it is done;
- a GIL-bound loop running during a background save, relative to the same loop with nothing else running;
- S3 (a local moto server in its own process): save and load throughput, and a raw s3fs PUT of the bytes.

Goals: blocking <= 5 % of the synchronous ``torch.save``; write throughput >= 70 % of ``dd``.
Prints a table and writes JSON (default bench/results/checkpoint.json).  Runs in a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elastic.checkpoint import CheckpointOptions, create_checkpoint_manager  # noqa: E402
from elastic.testing.s3_server import LocalS3Server  # noqa: E402

MiB = 2**20


class Trainer:
    """An MLP and SGD with momentum whose state (parameters + momentum) adds up to about ``size_mb``."""

    def __init__(self, size_mb: int, width: int = 2048) -> None:
        torch.manual_seed(0)
        layers = max(1, round(size_mb * MiB / 2 / (width * width * 4)))
        self.model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4, momentum=0.9)
        self.width = width
        self.train_step()  # creates the momentum buffers

    def forward_backward(self) -> None:
        self.optimizer.zero_grad()
        self.model(torch.randn(16, self.width)).pow(2).mean().backward()

    def train_step(self) -> None:
        self.forward_backward()
        self.optimizer.step()

    def state(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "cursor": {"epoch": 0, "position": step},
        }


def state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def dd_once(directory: Path, nbytes: int) -> float:
    """Bytes/s of ``dd`` writing ``nbytes`` in 8 MiB blocks with one fsync at the end."""
    target = directory / "dd.bin"
    count = max(1, nbytes // (8 * MiB))
    cmd = ["dd", "if=/dev/zero", f"of={target}", "bs=8M", f"count={count}", "conv=fsync"]
    seconds = timed(lambda: subprocess.run(cmd, check=True, capture_output=True))
    target.unlink()
    return count * 8 * MiB / seconds


def torch_save_once(directory: Path, state: dict[str, Any]) -> tuple[float, float]:
    """Seconds ``torch.save`` blocks, without and with an fsync at the end."""
    path = directory / "torch.pt"
    plain = timed(lambda: torch.save(state, path))
    path.unlink()

    def save_fsync() -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    synced = timed(save_fsync)
    path.unlink()
    return plain, synced


class OursRun:
    """Background saves through one manager; each ``once`` saves, records blocking and phase times."""

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.mgr = create_checkpoint_manager(
            url, CheckpointOptions(storage_options=storage_options, keep_last=2)
        )
        self.mgr.check_storage()
        self.step = 0
        self.first_blocking_s: float | None = None
        self.rows: list[dict[str, float]] = []

    def once(self, state: dict[str, Any]) -> None:
        self.step += 1
        state["step"] = self.step
        start = time.perf_counter()
        self.mgr.save(self.step, state)
        blocking = time.perf_counter() - start
        self.mgr.wait()
        total = time.perf_counter() - start
        if self.first_blocking_s is None:  # allocates the staging buffers; reported apart
            self.first_blocking_s = blocking
            return
        t = self.mgr.last_timings
        self.rows.append(
            {
                "blocking_s": blocking,
                "write_s": t.data_s + t.commit_s,
                "write_bytes_per_s": t.bytes_written / (t.data_s + t.commit_s),
                "verify_s": t.verify_s,
                "background_total_s": total,
                "bytes": t.bytes_written,
            }
        )

    def finish(self, state: dict[str, Any]) -> dict[str, Any]:
        self.step += 1
        sync_s = timed(lambda: self.mgr.save(self.step, state, blocking=True))
        load_s = timed(self.mgr.load_latest)
        self.mgr.close()
        nbytes = self.rows[-1]["bytes"]
        return {
            "first_blocking_s": self.first_blocking_s,
            **{key: [row[key] for row in self.rows] for key in self.rows[0]},
            "blocking_save_s": sync_s,
            "load_s": load_s,
            "load_bytes_per_s": nbytes / load_s,
        }


class DcpRun:
    """``dcp.async_save`` with a ``FileSystemWriter`` (no process group: a world of one)."""

    def __init__(self, directory: Path) -> None:
        import warnings

        warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable or uninitialized")
        self.directory = directory
        self.first_blocking_s: float | None = None
        self.blocking: list[float] = []
        self.total: list[float] = []

    def once(self, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        path = self.directory / "dcp"
        start = time.perf_counter()
        future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
        blocking = time.perf_counter() - start
        future.result()  # type: ignore[union-attr]
        total = time.perf_counter() - start
        shutil.rmtree(path)
        if self.first_blocking_s is None:
            self.first_blocking_s = blocking
            return
        self.blocking.append(blocking)
        self.total.append(total)

    def result(self) -> dict[str, Any]:
        return {"first_blocking_s": self.first_blocking_s, "blocking_s": self.blocking, "total_s": self.total}


def bench_local(directory: Path, state: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Interleaved rounds (dd, torch.save, ours, DCP) so that a noisy disk or CPU affects all alike."""
    nbytes = state_bytes(state)
    ours = OursRun(str(directory / "elastic"), {})
    dcp_run = DcpRun(directory)
    ours.once(state)  # warm-up: staging buffers
    dcp_run.once(state)
    dd, plain, synced = [], [], []
    for _ in range(repeats):  # os.sync() between measurements: no one pays for another's dirty pages
        dd.append(dd_once(directory, nbytes))
        os.sync()
        p, s = torch_save_once(directory, state)
        os.sync()
        plain.append(p)
        synced.append(s)
        ours.once(state)
        os.sync()
        dcp_run.once(state)
        os.sync()
    return {
        "dd_bytes_per_s": dd,
        "torch_save": {"blocking_s": plain, "blocking_with_fsync_s": synced},
        "ours": ours.finish(state),
        "dcp_async_save": dcp_run.result(),
    }


def gil_loop_rate(max_seconds: float, stop: threading.Event | None = None) -> float:
    """Iterations/s of a Python + small-tensor loop (needs the GIL at every step, like a training loop)."""
    x = torch.ones(16)
    n = 0
    start = time.perf_counter()
    end = start + max_seconds
    while time.perf_counter() < end and not (stop is not None and stop.is_set()):
        x = x * 1.0000001 + 0.0
        n += 1
    return n / (time.perf_counter() - start)


def bench_overlap(url: str, trainer: Trainer, repeats: int) -> dict[str, Any]:
    """Training steps with a save before each: default copy vs ``overlap_with=optimizer``.

    Blocking = time in ``save`` + time the next ``optimizer.step()`` waited for the deferred copy.
    """
    results: dict[str, Any] = {}
    for label, overlap in (("copy_in_save", False), ("overlap_with_optimizer", True)):
        call, fence = [], []
        with create_checkpoint_manager(url + "-" + label, CheckpointOptions(keep_last=1)) as mgr:
            for step in range(repeats + 1):
                state = trainer.state(step)
                start = time.perf_counter()
                mgr.save(step, state, overlap_with=trainer.optimizer if overlap else None)
                call.append(time.perf_counter() - start)
                mgr.last_fence_wait_s = 0.0
                trainer.forward_backward()
                trainer.optimizer.step()
                fence.append(mgr.last_fence_wait_s)
                mgr.wait()
        results[label] = {
            "save_call_s": call[1:],
            "optimizer_wait_s": fence[1:],
            "blocking_s": [c + f for c, f in zip(call[1:], fence[1:], strict=True)],
        }
    compute = [timed(trainer.forward_backward) for _ in range(3)]
    results["forward_backward_s"] = compute
    return results


def bench_interference(url: str, state: dict[str, Any]) -> dict[str, float]:
    """The loop's rate alone vs while a background save runs (2 cores: CPU and GIL contention together)."""
    with create_checkpoint_manager(url, CheckpointOptions(keep_last=1)) as mgr:
        mgr.save(1, state)
        mgr.wait()
        alone = gil_loop_rate(1.0)
        mgr.save(2, state)
        done = threading.Event()

        def wait_then_signal() -> None:
            mgr.wait()
            done.set()

        waiter = threading.Thread(target=wait_then_signal)
        waiter.start()
        during = gil_loop_rate(60.0, stop=done)
        waiter.join()
    return {"loop_rate_alone": alone, "loop_rate_during_save": during, "ratio": during / alone}


def bench_s3(state: dict[str, Any], repeats: int, nbytes: int) -> dict[str, Any]:
    import s3fs

    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    with LocalS3Server() as server:
        server.create_bucket("bench")
        options = server.storage_options()
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        payload = os.urandom(MiB) * (nbytes // MiB)
        raw = []
        for _ in range(max(2, repeats - 1)):
            raw.append(timed(lambda: fs.pipe_file("bench/raw.bin", payload)))
        payload = b""
        run = OursRun("s3://bench/ckpt", options)
        for _ in range(max(2, repeats - 1)):
            run.once(state)
        ours = run.finish(state)
    return {
        "endpoint": server.endpoint_url,
        "raw_put_bytes_per_s": [nbytes / s for s in raw],
        "save_bytes_per_s": ours["write_bytes_per_s"],
        "blocking_s": ours["blocking_s"],
        "load_bytes_per_s": ours["load_bytes_per_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dir", type=Path, default=None, help="local directory to write to (default: a temp dir)"
    )
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 (moto) part")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "checkpoint.json")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    trainer = Trainer(args.size_mb)
    state = trainer.state(0)
    nbytes = state_bytes(state)
    print(f"state: {nbytes / MiB:.0f} MiB (MLP parameters + SGD momentum)")
    load_before = os.getloadavg()[0]
    print(
        f"disk: {workdir}  cpus: {os.cpu_count()}  torch {torch.__version__}  load average: {load_before:.1f}"
    )
    try:
        local = bench_local(workdir, state, args.repeats)
        overlap = bench_overlap(str(workdir / "overlap"), trainer, args.repeats)
        interference = bench_interference(str(workdir / "interference"), state)
        s3 = None if args.no_s3 else bench_s3(state, args.repeats, nbytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    load_after = os.getloadavg()[0]
    med = statistics.median
    dd, tsave, ours, dcp = (
        local["dd_bytes_per_s"],
        local["torch_save"],
        local["ours"],
        local["dcp_async_save"],
    )
    sync_s = med(tsave["blocking_s"])
    blocking_s = med(ours["blocking_s"])
    dd_bps = med(dd)
    write_bps = med(ours["write_bytes_per_s"])
    ov = overlap["overlap_with_optimizer"]
    overlap_s = med(ov["blocking_s"])
    ov_wait = med(ov["optimizer_wait_s"])
    summary = {
        "blocking_fraction_of_sync_torch_save": blocking_s / sync_s,
        "overlapped_blocking_fraction_of_sync_torch_save": overlap_s / sync_s,
        "write_fraction_of_dd": write_bps / dd_bps,
        "goal_blocking_le_5pct": blocking_s / sync_s <= 0.05,
        "goal_blocking_le_5pct_overlapped": overlap_s / sync_s <= 0.05,
        "goal_write_ge_70pct_dd": write_bps / dd_bps >= 0.70,
    }
    rows = [
        ("dd conv=fsync (write)", f"{dd_bps / MiB:8.0f} MiB/s"),
        ("torch.save sync, blocking (median)", f"{sync_s * 1e3:8.1f} ms"),
        ("torch.save sync, blocking (min)", f"{min(tsave['blocking_s']) * 1e3:8.1f} ms"),
        ("torch.save + fsync, blocking", f"{med(tsave['blocking_with_fsync_s']) * 1e3:8.1f} ms"),
        ("ours async, blocking (median)", f"{blocking_s * 1e3:8.1f} ms"),
        ("ours async, blocking (min)", f"{min(ours['blocking_s']) * 1e3:8.1f} ms"),
        ("ours async, blocking (1st save)", f"{ours['first_blocking_s'] * 1e3:8.1f} ms"),
        ("ours overlap_with=optimizer, blocking", f"{overlap_s * 1e3:8.1f} ms"),
        (
            "  (save call + optimizer.step wait)",
            f"{med(ov['save_call_s']) * 1e3:.1f} + {ov_wait * 1e3:.1f} ms",
        ),
        ("  forward+backward it overlaps", f"{med(overlap['forward_backward_s']) * 1e3:8.1f} ms"),
        ("ours background write", f"{write_bps / MiB:8.0f} MiB/s"),
        ("ours verify after write", f"{med(ours['verify_s']) * 1e3:8.1f} ms"),
        ("ours blocking=True save", f"{ours['blocking_save_s'] * 1e3:8.1f} ms"),
        ("ours load (verify + decode)", f"{ours['load_bytes_per_s'] / MiB:8.0f} MiB/s"),
        ("dcp.async_save, blocking", f"{med(dcp['blocking_s']) * 1e3:8.1f} ms"),
        ("dcp.async_save, until done", f"{med(dcp['total_s']) * 1e3:8.1f} ms"),
        ("GIL-bound loop during save", f"{interference['ratio'] * 100:8.0f} % of its rate alone"),
    ]
    if s3 is not None:
        rows += [
            ("S3 raw s3fs PUT", f"{med(s3['raw_put_bytes_per_s']) / MiB:8.0f} MiB/s"),
            ("S3 ours save", f"{med(s3['save_bytes_per_s']) / MiB:8.0f} MiB/s"),
            ("S3 ours async, blocking", f"{med(s3['blocking_s']) * 1e3:8.1f} ms"),
            ("S3 ours load (verify + decode)", f"{s3['load_bytes_per_s'] / MiB:8.0f} MiB/s"),
        ]
    for name, value in rows:
        print(f"  {name:<36} {value}")
    print(f"medians over {args.repeats} interleaved rounds; load average at the end: {load_after:.1f}")
    print(
        f"blocking = {summary['blocking_fraction_of_sync_torch_save'] * 100:.1f} % of sync torch.save "
        f"(goal <= 5 %: {'met' if summary['goal_blocking_le_5pct'] else 'MISSED'}); "
        f"overlapped {summary['overlapped_blocking_fraction_of_sync_torch_save'] * 100:.1f} % "
        f"({'met' if summary['goal_blocking_le_5pct_overlapped'] else 'MISSED'}); "
        f"write = {summary['write_fraction_of_dd'] * 100:.0f} % of dd "
        f"(goal >= 70 %: {'met' if summary['goal_write_ge_70pct_dd'] else 'MISSED'})"
    )
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
        "state_bytes": nbytes,
        **local,
        "overlap": overlap,
        "interference": interference,
        "s3": s3,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
