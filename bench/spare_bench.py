"""Hot spares vs a replacement node: a job on two nodes of the service loses one (its agent SIGKILLed).

Real etcd, the controller and the agents as ``etrain`` processes (``service.testing.LocalServiceCluster``), a job
of ``elastic/testing/train_worker.py`` on 2 nodes (``max_nodes`` 2), in live and in restart recovery. Per trial
and mode, two runs:

- ``spare``: a third agent was started with ``--spare`` before the job (held back: the job does not grow onto
  it; its zygote has torch imported). At the kill the controller places the spare at once.
- ``new node``: no spare; a new agent starts at the moment of the kill (a replacement node coming up), the
  path without spares.

Figures, from the SIGKILL: the survivor's next step (training going on), and the replacement's first recorded
step (the job back at 2 nodes). Both worlds are printed and written as JSON (``--json``).

    python bench/spare_bench.py [--trials 2] [--modes live,restart] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from _stats import summarize  # noqa: E402

from elastic.testing.torchrun import read_jsonl  # noqa: E402
from elastic.testing.wait import wait_for  # noqa: E402
from service.testing.cluster import LocalServiceCluster  # noqa: E402

WORKER = str(REPO / "elastic" / "testing" / "train_worker.py")


def _records(rec: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for f in rec.glob("rank*.jsonl"):
        out.extend(read_jsonl(f))
    return out


def _spec(rec: Path, mode: str) -> dict[str, Any]:
    return {
        "name": "spare-bench",
        "entrypoint": WORKER,
        "args": [
            "--epochs",
            "50",
            "--samples",
            "400",
            "--batch",
            "4",
            "--save-every",
            "10",
            "--step-sleep",
            "0.05",
            "--record",
            str(rec),
        ],
        "env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
        "min_nodes": 1,
        "max_nodes": 2,
        "recovery": mode,
        "rendezvous": {"last_call_timeout": 1},
    }


def run_once(workdir: Path, mode: str, spare: bool) -> dict[str, Any]:
    cluster = LocalServiceCluster(workdir)
    try:
        api = cluster.start_controller()
        cluster.start_agent("node-1")
        cluster.start_agent("node-2")
        if spare:
            cluster.start_agent("spare", spare=True)
        wait_for(lambda: len(api.nodes()) == (3 if spare else 2), 60, 0.2, what="the agents")
        if spare:
            time.sleep(8)  # let the spare's zygote finish importing torch (it is held warm before any failure)
        rec = workdir / "rec"
        job = api.submit(_spec(rec, mode))["id"]
        wait_for(
            lambda: max((r["step"] for r in _records(rec) if r["world"] == 2), default=0) >= 20,
            180,
            0.2,
            what="20 steps at world 2",
        )
        victim = "node-2"
        t0 = time.time()
        cluster.kill_agent(victim)
        replacement = "spare" if spare else "node-3"
        if not spare:
            cluster.start_agent("node-3")

        def first(agent: str | None, after: float) -> float | None:
            ts = [r["t"] for r in _records(rec) if r["t"] > after and (agent is None or r["agent"] == agent)]
            return min(ts) if ts else None

        joined = wait_for(lambda: first(replacement, t0), 120, 0.1, what="the replacement's first step")
        assert joined is not None  # wait_for returns the first truthy value
        survivor = first("node-1", t0)
        status = api.job(job)
        api.cancel(job)
        return {
            "mode": mode,
            "spare": spare,
            "survivor_next_step_s": None if survivor is None else survivor - t0,
            "replacement_first_step_s": joined - t0,
            "failures": status["restarts"]["failure"],
        }
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--modes", default="live,restart")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    runs: list[dict[str, Any]] = []
    for trial in range(args.trials):
        for mode in args.modes.split(","):
            for spare in (True, False):
                with tempfile.TemporaryDirectory(prefix="spare-bench-") as tmp:
                    r = run_once(Path(tmp), mode, spare)
                runs.append(r)
                nxt = r["survivor_next_step_s"]
                print(
                    f"trial {trial + 1} {mode:7s} {'spare   ' if spare else 'new node'}: replacement's first step "
                    f"{r['replacement_first_step_s']:.2f} s after the kill, survivor's next step "
                    f"{'-' if nxt is None else f'{nxt:.2f}'} s",
                    flush=True,
                )
    summary: dict[str, Any] = {}
    print("\nmode     replacement  first step after the kill (median, s)")
    for mode in args.modes.split(","):
        for spare in (True, False):
            key = f"{mode}/{'spare' if spare else 'new node'}"
            rs = [r for r in runs if r["mode"] == mode and r["spare"] == spare]
            summary[key] = {
                "replacement_first_step_s": summarize([r["replacement_first_step_s"] for r in rs]),
                "survivor_next_step_s": summarize(
                    [r["survivor_next_step_s"] for r in rs if r["survivor_next_step_s"] is not None]
                ),
            }
            median = summary[key]["replacement_first_step_s"]["median"]
            print(f"{mode:8s} {'spare' if spare else 'new node':12s} {median:.2f}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "machine": platform.platform(),
                    "args": vars(args) | {"json": str(args.json)},
                    "runs": runs,
                    "summary": summary,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
