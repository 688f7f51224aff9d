"""Rendezvous benchmark: etcd-v3 (this project) vs torch's c10d, side by side in the same run.

1. Rendezvous time for N participants (threads, each with its own handler, backend and connection):
   time from the last participant's ``next_rendezvous()`` call until every participant has returned.
2. Node loss: two torchrun agents (min 1, max 2) train an all-reduce job; one agent's whole process tree
   is SIGKILLed; time until the survivor completes its next step. c10d is run with torch's defaults and
   with ``last_call_timeout`` tuned to our value.

Prints a table and writes JSON (default ``bench/results/rendezvous.json``).

    python bench/rendezvous_bench.py [--sizes 2,8,32,64] [--trials 3] [--kill-trials 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import platform
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as torch_create_handler

from elastic import compat
from elastic.rendezvous.etcd_v3_handler import EtcdV3RendezvousHandler
from elastic.rendezvous.plugin import create_handler as etcd_create_handler
from elastic.testing.etcd_server import LocalEtcdCluster, free_port
from elastic.testing.torchrun import TorchrunAgent, read_jsonl, torchrun_command
from elastic.testing.wait import wait_until

compat.disable_shared_rdzv_store()  # the c10d handlers built here too: both backends alike


def _params(backend: str, endpoint: str, run_id: str, n: int, **conf: Any) -> RendezvousParameters:
    return RendezvousParameters(
        backend=backend, endpoint=endpoint, run_id=run_id, min_nodes=n, max_nodes=n, local_addr="127.0.0.1", **conf
    )


_KEEP: list[object] = []


_C10D_BACKENDS: dict[int, C10dRendezvousBackend] = {}


def _participants(handler: RendezvousHandler) -> int:
    """How many participants have joined the first round so far."""
    if isinstance(handler, EtcdV3RendezvousHandler):
        return handler.joined(0)
    got = _C10D_BACKENDS[id(handler)].get_state()
    return 0 if got is None else len(pickle.loads(got[0]).participants)


def _rendezvous_once(make: Callable[[int], RendezvousHandler], n: int, staggered: bool) -> dict[str, float]:
    """``staggered``: N-1 participants join and wait (2 s), then the last one joins; otherwise all N
    join at once (a burst, as when a whole job starts)."""
    handlers = [make(i) for i in range(n)]
    starts = [0.0] * n
    ends = [0.0] * n
    errors: list[BaseException] = []
    barrier = threading.Barrier(n if not staggered else n - 1)

    def run(i: int) -> None:
        try:
            if not (staggered and i == n - 1):
                barrier.wait()
            starts[i] = time.monotonic()
            handlers[i].next_rendezvous()
            ends[i] = time.monotonic()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads[: n - 1] if staggered else threads:
        t.start()
    if staggered:
        # The last participant joins only once the other N-1 are recorded in the shared state.
        if not wait_until(lambda: _participants(handlers[0]) >= n - 1, 120, interval=0.2):
            raise RuntimeError(f"{n - 1} participants never joined")
        time.sleep(0.5)
        threads[-1].start()
    for t in threads:
        t.join()
    for h in handlers:
        if isinstance(h, EtcdV3RendezvousHandler):
            h.release()
        else:
            h._stop_heartbeats()  # type: ignore[attr-defined]  # the bench is done with torch's handler
    _KEEP.extend(handlers)  # torch's handler finalizer must not run in its own timer thread
    if errors:
        raise RuntimeError(f"rendezvous of {n} failed: {errors[0]!r}")
    return {"from_last_join_s": max(ends) - max(starts), "total_s": max(ends) - min(starts)}


def bench_rendezvous(sizes: list[int], trials: int, etcd: LocalEtcdCluster) -> list[dict[str, Any]]:
    rows = []
    for backend, staggered in (("etcd-v3", True), ("c10d", True), ("etcd-v3", False), ("c10d", False)):
        for n in sizes:
            samples = []
            for _ in range(trials):
                run_id = f"bench-{uuid.uuid4().hex[:8]}"
                if backend == "etcd-v3":

                    def make(i: int, run_id: str = run_id, n: int = n) -> RendezvousHandler:
                        return etcd_create_handler(_params("etcd-v3", etcd.endpoints, run_id, n))

                    samples.append(_rendezvous_once(make, n, staggered))
                else:
                    port = free_port()
                    host = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)

                    def make(i: int, run_id: str = run_id, n: int = n, port: int = port) -> RendezvousHandler:
                        store = TCPStore("127.0.0.1", port, is_master=False)
                        backend_ = C10dRendezvousBackend(store, run_id)
                        h = torch_create_handler(store, backend_, _params("c10d", f"127.0.0.1:{port}", run_id, n))
                        _C10D_BACKENDS[id(h)] = backend_
                        return h

                    samples.append(_rendezvous_once(make, n, staggered))
                    _KEEP.append(host)  # type: ignore[arg-type]
            last = [s["from_last_join_s"] for s in samples]
            rows.append(
                {
                    "backend": backend,
                    "arrival": "last joins after N-1 wait" if staggered else "burst: all N at once",
                    "n": n,
                    "trials": trials,
                    "from_last_join_median_s": statistics.median(last),
                    "from_last_join_max_s": max(last),
                    "total_median_s": statistics.median(s["total_s"] for s in samples),
                    "from_last_join_samples_s": last,
                }
            )
            arrival = "staggered" if staggered else "burst"
            print(
                f"rendezvous {backend:8s} {arrival:9s} N={n:3d}: "
                f"from last join median {rows[-1]['from_last_join_median_s']:.3f}s"
                f" max {rows[-1]['from_last_join_max_s']:.3f}s, total median {rows[-1]['total_median_s']:.3f}s",
                flush=True,
            )
    return rows


def _kill_trial(label: str, backend: str, endpoint: str, conf: dict[str, object], workdir: Path) -> float:
    run_id = f"kill-{uuid.uuid4().hex[:8]}"
    out = workdir / run_id
    out.mkdir(parents=True)
    args = ["--out", str(out), "--steps", "1000000", "--step-time", "0.05"]

    def agent(name: str) -> TorchrunAgent:
        cmd = torchrun_command(
            backend=backend, endpoint=endpoint, run_id=run_id, nnodes="1:2", rdzv_conf=conf, script_args=args
        )
        return TorchrunAgent(cmd, out / f"{name}.log").start()

    first = agent("a")
    time.sleep(1.0)  # with c10d, the first agent hosts the store: we kill the other one
    second = agent("b")
    try:
        if not wait_until(lambda: [r["world"] for r in read_jsonl(out / "steps.jsonl")].count(2) >= 20, 180):
            raise RuntimeError(f"{label}: world of 2 never formed; see {out}")
        killed_at = second.kill_tree()

        def survivor_step() -> bool:
            return any(r["world"] == 1 and r["t"] > killed_at for r in read_jsonl(out / "steps.jsonl"))

        if not wait_until(survivor_step, 240):
            raise RuntimeError(f"{label}: survivor never stepped again; see {out}")
        first_step = min(r["t"] for r in read_jsonl(out / "steps.jsonl") if r["world"] == 1 and r["t"] > killed_at)
        return first_step - killed_at
    finally:
        first.stop()
        second.stop()


def bench_node_loss(
    trials: int, etcd: LocalEtcdCluster, workdir: Path, systems: tuple[str, ...] = ("etcd-v3", "c10d")
) -> list[dict[str, Any]]:
    configs: list[tuple[str, str, Callable[[], str], dict[str, object]]] = [
        ("etcd-v3", "etcd-v3", lambda: etcd.endpoints, {"last_call_timeout": 1}),
        ("c10d (torch defaults)", "c10d", lambda: f"127.0.0.1:{free_port()}", {}),
        ("c10d (last_call_timeout=1)", "c10d", lambda: f"127.0.0.1:{free_port()}", {"last_call_timeout": 1}),
    ]
    configs = [c for c in configs if c[1] in systems]
    rows = []
    for label, backend, endpoint, conf in configs:
        samples = [_kill_trial(label, backend, endpoint(), conf, workdir) for _ in range(trials)]
        rows.append(
            {
                "system": label,
                "trials": trials,
                "kill_to_next_step_median_s": statistics.median(samples),
                "kill_to_next_step_max_s": max(samples),
                "samples_s": samples,
            }
        )
        print(
            f"node loss {label:28s}: SIGKILL -> survivor's next step median {statistics.median(samples):.2f}s"
            f" max {max(samples):.2f}s  ({', '.join(f'{s:.2f}' for s in samples)})",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,8,32,64")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--kill-trials", type=int, default=3)
    parser.add_argument("--skip-kill", action="store_true")
    parser.add_argument(
        "--kill-systems", default="etcd-v3,c10d", help="rendezvous backends of the node-loss part (etcd-v3, c10d)"
    )
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "rendezvous.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    workdir = Path(tempfile.mkdtemp(prefix="rdzv-bench-"))
    result: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with LocalEtcdCluster(1, workdir=workdir / "etcd") as etcd:
        result["rendezvous"] = bench_rendezvous([int(x) for x in args.sizes.split(",")], args.trials, etcd)
        if not args.skip_kill:
            systems = tuple(args.kill_systems.split(","))
            result["node_loss"] = bench_node_loss(args.kill_trials, etcd, workdir, systems)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
