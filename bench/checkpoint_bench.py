"""Checkpoint benchmark: what a snapshot costs the training loop, and how fast it is written and read back.

For a state of ``--state-gib`` GiB (model + optimizer; default 3 GiB with AdamW on ``--device cuda``, 192 MiB
with SGD + momentum on CPU) in one local directory (``--dir``, default a temp dir), interleaved rounds of:

- ``dd`` writing the same number of bytes with ``conv=fsync`` (the disk's sequential write speed);
- synchronous ``torch.save`` (what a plain training loop blocks for) and ``dcp.async_save`` (until it returns);
- our background save: how long ``save`` holds the loop (on CUDA: until the training stream may go on; and until
  the whole device is idle, which with device-side staging includes its drain to the host), and the background
  write throughput (data + fsync + manifest commit, then verification: hash, write, fsync, verify);
- on CUDA, a device-to-host copy of the same bytes into pinned buffers (the floor for any staging), and a
  device-to-device copy of them (the floor for device-side staging);
- the next-step stall: a training step right after ``save(..., overlap_with=optimizer)`` (as the elastic loop
  does it) against a step without a save, with staging straight to the host (``device_staging=False``: the
  rows without a suffix, as before issue 29) and with device-side staging (the default since; its own rows);
- the first save's blocking time without and with ``prepare`` (the warm-up) done before it;
- loading the newest snapshot (read + verify) into the device, against ``dd`` reading the same files;
- a GIL-bound loop during a background save, and (unless ``--no-s3``) S3 through a local moto server.

Goals (issue 13): stall <= 5 % of a step; write + verify >= 80 % of ``dd``; load + verify >= 80 % of the read.
Issue 29's, at 3 GiB and the benchmark's own step (36 ms on an H200): the device-side stall <= 5 % of a step, and the
warmed first save blocking no longer than later ones. ``--parts stall`` measures only those two (the warmed first
save, then the stall rows), a quarter of the full run's bytes written: what ``scripts/gpu_check.sh`` runs at 3 GiB.
Prints a table and writes JSON (default bench/results/checkpoint.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
#: steps timed after a save for its stall (a 3 GiB drain to the host takes ~1.6 of the 36 ms steps on an H200)
STALL_STEPS = 4
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _checkpoint_report import print_report, print_stall  # noqa: E402
from _disk import dd_read_seconds, dd_write_bytes_per_s  # noqa: E402
from _workload import GiB, MiB, Workload, copy_seconds, pick_device, pinned_copy_seconds, state_bytes  # noqa: E402

from elastic.checkpoint import CheckpointOptions, create_checkpoint_manager  # noqa: E402
from elastic.testing.s3_server import LocalS3Server  # noqa: E402


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


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
    """Background saves through one manager; each ``once`` saves, records blocking and phase times.

    Blocking is timed with ``workload.timed``: on CUDA it lasts until the GPU may go on (the copy of state that
    the next kernels would change is done), not just until ``save`` returns."""

    def __init__(self, url: str, storage_options: dict[str, Any], workload: Workload | None = None) -> None:
        options = CheckpointOptions(storage_options=storage_options, keep_last=2, device_staging=False)
        self.mgr = create_checkpoint_manager(url, options)
        self.mgr.check_storage()
        self.workload = workload
        self.step = 0
        self.first_blocking_s: float | None = None
        self.rows: list[dict[str, float]] = []
        self.verify_mode = ""  # what verify_after_write="auto" applied (issue 29: "size" on a local disk)

    def _timed(self, fn: Any) -> float:
        return self.workload.timed(fn) if self.workload is not None else timed(fn)

    def _timed_both(self, fn: Any) -> tuple[float, float]:
        if self.workload is not None:
            return self.workload.timed_both(fn)
        seconds = timed(fn)
        return seconds, seconds

    def once(self, state: dict[str, Any]) -> None:
        self.step += 1
        state["step"] = self.step
        start = time.perf_counter()
        # the loop's wait (the training stream), and the device's (device-side staging: its drain to the host too)
        blocking, device_s = self._timed_both(lambda: self.mgr.save(self.step, state))
        self.mgr.wait()
        total = time.perf_counter() - start
        if self.first_blocking_s is None:  # allocates the staging buffers; reported apart
            self.first_blocking_s = blocking
            return
        t = self.mgr.last_timings
        self.verify_mode = t.verify_mode
        write_s = t.data_s + t.commit_s
        self.rows.append(
            {
                "blocking_s": blocking,
                "blocking_device_s": device_s,
                "write_s": write_s,
                "write_bytes_per_s": t.bytes_written / write_s,
                "verify_s": t.verify_s,
                "write_verify_bytes_per_s": t.bytes_written / (write_s + t.verify_s),
                "background_total_s": total,
                "bytes": t.bytes_written,
            }
        )

    def finish(self, state: dict[str, Any]) -> dict[str, Any]:
        self.step += 1
        sync_s = self._timed(lambda: self.mgr.save(self.step, state, blocking=True))
        load_s = self._timed(self.mgr.load_latest)
        self.mgr.close()
        nbytes = self.rows[-1]["bytes"]
        return {
            "first_blocking_s": self.first_blocking_s,
            "verify_mode": self.verify_mode,
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


def device_copy_seconds(workload: Workload, repeats: int) -> list[float]:
    """A device-to-device copy of the whole state into buffers allocated beforehand (the floor for device-side
    staging): seconds per copy, or [] on CPU."""
    return copy_seconds(workload, repeats, torch.empty_like)


def warm_first_save(url: str, workload: Workload) -> dict[str, Any]:
    """A fresh manager (default options: device-side staging on), ``prepare`` done before its first save: the
    seconds the warm-up took, and how long that first save, then a second one, held the loop (the training
    stream; ``*_device_s``: until the device was idle, their drains to the host included)."""
    state = workload.state(0)
    with create_checkpoint_manager(url, CheckpointOptions(keep_last=1)) as mgr:
        start = time.perf_counter()
        mgr.prepare(state)
        mgr.wait_prepared()
        warm_s = time.perf_counter() - start
        first, first_device = workload.timed_both(lambda: mgr.save(1, state))
        mgr.wait()
        second, second_device = workload.timed_both(lambda: mgr.save(2, state))
        mgr.wait()
        staged = mgr.last_device_staged_bytes
    return {
        "warm_up_s": warm_s,
        "first_blocking_s": first,
        "second_blocking_s": second,
        "first_device_s": first_device,
        "second_device_s": second_device,
        "device_staged_bytes": staged,
    }


def bench_local(directory: Path, workload: Workload, repeats: int) -> dict[str, Any]:
    """Interleaved rounds (dd, torch.save, ours, DCP, pinned copy) so that a noisy disk or CPU affects all alike."""
    state = workload.state(0)
    nbytes = state_bytes(state)
    ours = OursRun(str(directory / "elastic"), {}, workload)
    dcp_run = DcpRun(directory)
    ours.once(state)  # warm-up: staging buffers (its first save, reported apart: pinned memory allocated then)
    dcp_run.once(state)
    # after that first save, so that its pinned memory was not in torch's pinned cache yet (freed by this one)
    warmed = warm_first_save(str(directory / "warmed"), workload)
    dd, plain, synced, pinned = [], [], [], []
    for _ in range(repeats):  # os.sync() between measurements: no one pays for another's dirty pages
        dd.append(dd_write_bytes_per_s(directory, nbytes))
        os.sync()
        p, s = torch_save_once(directory, state)
        os.sync()
        plain.append(p)
        synced.append(s)
        ours.once(state)
        os.sync()
        dcp_run.once(state)
        os.sync()
        pinned += pinned_copy_seconds(workload, 1)
    return {
        "dd_bytes_per_s": dd,
        "torch_save": {"blocking_s": plain, "blocking_with_fsync_s": synced},
        "ours": ours.finish(state),
        "dcp_async_save": dcp_run.result(),
        "pinned_copy_s": pinned,
        "device_copy_s": device_copy_seconds(workload, max(2, repeats)),
        "warmed_first_save": warmed,
    }


def _load_once(url: str, workload: Workload) -> tuple[float, float]:
    """Seconds to load + verify the newest snapshot into the device, and to apply it to the model."""
    box: dict[str, Any] = {}
    with create_checkpoint_manager(url, CheckpointOptions(keep_last=1)) as mgr:
        seconds = workload.timed(lambda: box.update(snapshot=mgr.load_latest(device=workload.device)))
    state = box["snapshot"].state

    def apply() -> None:
        workload.model.load_state_dict(state["model"])
        workload.optimizer.load_state_dict(state["optimizer"])

    return seconds, workload.timed(apply)


def bench_load(directory: Path, workload: Workload, repeats: int) -> dict[str, Any]:
    """Load the newest snapshot (read + verify) into the workload's device and apply it, against ``dd`` reading
    the same files right before (the same page-cache state for both)."""
    url = str(directory / "load")
    with create_checkpoint_manager(url, CheckpointOptions(keep_last=1)) as mgr:
        mgr.save(1, workload.state(1), blocking=True)
    files = sorted(p for p in Path(url).rglob("*") if p.is_file() and p.name != "manifest.json")
    nbytes = sum(p.stat().st_size for p in files)
    read_s, load_s, apply_s = [], [], []
    for _ in range(repeats):
        read_s.append(dd_read_seconds(files))
        loaded, apply = _load_once(url, workload)
        load_s.append(loaded)
        apply_s.append(apply)
    return {
        "bytes": nbytes,
        "dd_read_s": read_s,
        "load_verify_s": load_s,
        "apply_s": apply_s,
        "load_fraction_of_read": [r / s for r, s in zip(read_s, load_s, strict=True)],
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


def bench_overlap(url: str, workload: Workload, repeats: int) -> dict[str, Any]:
    """Training steps with a save before each: the copy in ``save`` vs ``overlap_with=optimizer`` (the loop's).

    Blocking = time in ``save`` + time the next ``optimizer.step()`` waited (on the host) for the copy.  The
    stall = (capture the state + save + the next :data:`STALL_STEPS` steps) - as many steps without a save,
    each timed until the training stream's work is done: a device-side snapshot's drain to the host runs on a
    copy stream across those steps, and what it costs them (copy-engine and memory contention) is counted,
    but not the drain itself (a device-wide synchronize would wait for it, which training never does).
    ``copy_in_save`` and ``overlap_with_optimizer`` stage straight to the host (``device_staging=False``);
    ``overlap_device_side`` is ``overlap_with_optimizer`` with device-side staging (the default options).
    """
    results: dict[str, Any] = {}

    def steps_alone() -> None:
        for _ in range(STALL_STEPS):
            workload.step()

    steps = [workload.timed(workload.step, training_stream_only=True) for _ in range(max(3, repeats))]
    runs_alone = [workload.timed(steps_alone, training_stream_only=True) for _ in range(max(3, repeats))]
    runs = [("copy_in_save", False, False), ("overlap_with_optimizer", True, False)]
    runs.append(("overlap_device_side", True, True))
    for label, overlap, device_side in runs:
        call, fence, with_save = [], [], []
        optimizer = workload.optimizer if overlap else None
        options = CheckpointOptions(keep_last=1, device_staging=device_side)
        with create_checkpoint_manager(url + "-" + label, options) as mgr:
            for step in range(repeats + 1):
                box: dict[str, float] = {}

                def save_then_step(
                    step: int = step, m: Any = mgr, b: dict[str, float] = box, optimizer: Any = optimizer
                ) -> None:
                    state = workload.state(step)
                    start = time.perf_counter()
                    m.save(step, state, overlap_with=optimizer)
                    b["call"] = time.perf_counter() - start
                    m.last_fence_wait_s = 0.0
                    workload.step()
                    for _ in range(STALL_STEPS - 1):
                        workload.step()

                with_save.append(workload.timed(save_then_step, training_stream_only=True))
                call.append(box["call"])
                fence.append(mgr.last_fence_wait_s)
                mgr.wait()
            staged = mgr.last_device_staged_bytes
        alone_s = statistics.median(runs_alone)
        results[label] = {
            "save_call_s": call[1:],
            "optimizer_wait_s": fence[1:],
            "blocking_s": [c + f for c, f in zip(call[1:], fence[1:], strict=True)],
            "step_with_save_s": with_save[1:],
            "stall_s": [max(0.0, w - alone_s) for w in with_save[1:]],
            "device_staged_bytes": staged,
        }
    results["step_s"] = steps
    results["stall_steps"] = STALL_STEPS
    results["steps_alone_s"] = runs_alone
    results["forward_backward_s"] = [workload.timed(workload.forward_backward) for _ in range(3)]
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--state-gib", type=float, default=None, help="state size (default: 3 on cuda, 0.1875 on cpu)")
    parser.add_argument("--size-mb", type=int, default=None, help="state size in MiB (older spelling of --state-gib)")
    parser.add_argument(
        "--optimizer", choices=["sgd", "adamw"], default=None, help="default: adamw on cuda, sgd on cpu"
    )
    parser.add_argument("--batch", type=int, default=None, help="default: 1024 on cuda, 16 on cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="local directory to write to (default: a temp dir)")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 (moto) part")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "checkpoint.json")
    parser.add_argument(
        "--parts",
        choices=["all", "stall"],
        default="all",
        help="stall: only the steps' stall after a save and the warmed first save (issue 29's goals; at 3 GiB "
        "a quarter of the full run's bytes written)",
    )
    args = parser.parse_args()

    device = pick_device(args.device)
    cuda = device.type == "cuda"
    if args.size_mb is not None:
        target = args.size_mb * MiB
    else:
        target = int((args.state_gib if args.state_gib is not None else (3.0 if cuda else 0.1875)) * GiB)
    workload = Workload(target, device, args.optimizer or ("adamw" if cuda else "sgd"), batch=args.batch)
    workdir = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    state = workload.state(0)
    nbytes = state_bytes(state)
    gpu = f"  gpu: {torch.cuda.get_device_name(device)}" if cuda else ""
    print(f"state: {nbytes / MiB:.0f} MiB ({workload.describe()})")
    load_before = os.getloadavg()[0]
    print(f"disk: {workdir}  cpus: {os.cpu_count()}  torch {torch.__version__}{gpu}  load average: {load_before:.1f}")
    machine = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "load_average_before": load_before,
    }
    report: dict[str, Any] = {"machine": machine, "workload": workload.describe(), "state_bytes": nbytes}
    try:
        if args.parts == "stall":
            report["warmed_first_save"] = warm_first_save(str(workdir / "warmed"), workload)
            report["overlap"] = bench_overlap(str(workdir / "overlap"), workload, args.repeats)
        else:
            report.update(bench_local(workdir, workload, args.repeats))
            report["overlap"] = bench_overlap(str(workdir / "overlap"), workload, args.repeats)
            report["load"] = bench_load(workdir, workload, max(2, args.repeats // 2))
            report["interference"] = bench_interference(str(workdir / "interference"), state)
            report["s3"] = None if args.no_s3 else bench_s3(state, args.repeats, nbytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    machine["load_average_after"] = os.getloadavg()[0]
    report["summary"] = print_report(report, args.repeats) if args.parts == "all" else print_stall(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
