"""etcd outage benchmark: what a full etcd outage costs a training job (the hardening issue's goal: a 10 s
outage costs no restart, no lost step and under 1 % of the steps' time).

Two torchrun agents (one worker each, the ``etcd-v3`` rendezvous, ``elastic/testing/train_worker.py`` with a
fixed step time and durable snapshots) train; after a warm-up every etcd member is SIGKILLed, left down for
``--outage`` seconds and restarted with its data. Per trial:

- restart: whether a new worker group formed (the records' ``attempt``) or torchrun restarted workers;
- steps done twice: steps recorded more than once by rank 0;
- time lost: over the window from the outage's start until ``--after`` seconds after its end, the window's
  length minus (steps completed in it x the median step time measured before the outage); and that as a
  share of the window (the goal's "steps' time").

    python bench/etcd_outage_bench.py [--trials 3] [--outage 10] [--members 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from _stats import summarize  # noqa: E402

from elastic.testing.etcd_server import LocalEtcdCluster  # noqa: E402
from elastic.testing.torchrun import TorchrunAgent, read_jsonl, torchrun_command  # noqa: E402
from elastic.testing.wait import wait_until  # noqa: E402

WORKER = str(REPO / "elastic" / "testing" / "train_worker.py")


def _records(rec: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for f in rec.glob("rank0.*.jsonl"):
        out.extend(read_jsonl(f))
    return sorted(out, key=lambda r: r["t"])


def trial(workdir: Path, members: int, outage: float, after: float, step_sleep: float) -> dict[str, Any]:
    run_id = f"outage-{uuid.uuid4().hex[:8]}"
    rec = workdir / run_id / "rec"
    rec.mkdir(parents=True)
    etcd = LocalEtcdCluster(members, workdir=workdir / run_id / "etcd").start()
    agents: list[TorchrunAgent] = []
    try:
        args = [
            "--checkpoint-url",
            str(workdir / run_id / "ck"),
            "--record",
            str(rec),
            "--epochs",
            "100000",
            "--samples",
            "4096",
            "--batch",
            "8",
            "--lr-rule",
            "fixed-global-batch",
            "--base-world",
            "2",
            "--save-every",
            "50",
            "--step-sleep",
            str(step_sleep),
            "--dropout",
            "0",
        ]
        for name in ("a", "b"):
            cmd = torchrun_command(
                backend="etcd-v3",
                endpoint=etcd.endpoints,
                run_id=run_id,
                nnodes="2",
                nproc=1,
                max_restarts=100,
                script=WORKER,
                script_args=args,
            )
            agents.append(TorchrunAgent(cmd, workdir / run_id / f"{name}.log", env={"LOGLEVEL": "WARNING"}).start())
        if not wait_until(lambda: len(_records(rec)) >= 60, 120):
            raise RuntimeError(f"the job did not reach 60 steps: see {workdir / run_id}")
        time.sleep(5)  # a steady pace to measure
        before = _records(rec)
        pace = statistics.median(b["t"] - a["t"] for a, b in zip(before[-40:], before[-39:], strict=False))
        down = time.time()
        for i in range(members):
            etcd.stop_member(i)
        time.sleep(outage)
        for i in range(members):
            etcd.start_member(i)
        etcd.wait_healthy()
        up = time.time()
        time.sleep(after)
        end = time.time()
        records = _records(rec)
        window = [r for r in records if down < r["t"] <= end]
        steps = [r["step"] for r in records]
        attempts = {r["attempt"] for r in records}
        restarts = {r["restart"] for r in records}
        lost = (end - down) - len(window) * pace
        return {
            "outage_s": round(up - down, 2),
            "window_s": round(end - down, 2),
            "pace_ms": round(pace * 1000, 1),
            "steps_in_window": len(window),
            "restart": len(attempts) > 1 or restarts != {0},
            "steps_done_twice": len(steps) - len(set(steps)),
            "time_lost_s": round(lost, 3),
            "time_lost_pct": round(100 * lost / (end - down), 2),
        }
    finally:
        for a in agents:
            a.stop()
        etcd.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--outage", type=float, default=10.0, help="seconds every etcd member is down")
    p.add_argument("--after", type=float, default=10.0, help="seconds measured after etcd is back")
    p.add_argument("--members", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.1, help="the workers' step time (s)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="etrain-outage-") as tmp:
        for i in range(args.trials):
            r = trial(Path(tmp), args.members, args.outage, args.after, args.step_sleep)
            results.append(r)
            print(
                f"trial {i + 1}: outage {r['outage_s']} s, restart {'yes' if r['restart'] else 'no'}, "
                f"{r['steps_done_twice']} steps done twice, time lost {r['time_lost_s']:+.2f} s = "
                f"{r['time_lost_pct']:+.2f} % of the steps' time over {r['window_s']} s "
                f"(pace {r['pace_ms']} ms/step)",
                flush=True,
            )
    lost = summarize([r["time_lost_pct"] for r in results])
    print(
        f"etcd outage of {args.outage:g} s, {args.members} members, {args.trials} trials: restarts "
        f"{sum(r['restart'] for r in results)}, steps done twice {sum(r['steps_done_twice'] for r in results)}, "
        f"time lost median {lost['median']:+.2f} % max {max(lost['samples']):+.2f} % of the steps' time "
        f"(goal: no restart, no step twice, < 1 %)"
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "machine": platform.platform(),
                    "args": vars(args) | {"json": str(args.json)},
                    "trials": results,
                    "time_lost_pct": lost,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
