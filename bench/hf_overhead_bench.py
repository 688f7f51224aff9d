"""The Hugging Face adapter's overhead (issue 51): the step rate of a ``transformers.Trainer`` made elastic by
``make_elastic`` (elastic/integrations/hf.py) against the same ``Trainer`` without it, side by side in one run,
interleaved rounds, no snapshots (no checkpoint storage at all). Goal: >= 0.98 of the plain Trainer's rate.

Each run is stock torchrun (``--standalone``, ``--nproc-per-node`` ranks, gloo on CPU) of bench/_hf_overhead_worker.py:
a GPT-2 built from a config (4 layers, ``n_embd`` 128, 64 tokens; nothing downloaded), a per-device batch of 8 with 2
accumulation steps, AdamW; the first 20 steps are not timed. What the adapter adds per step: its own ``DataLoader``
over the elastic batch sampler (in place of accelerate's prepared one), a micro-batch's weight, the LR factor around
``optimizer.step()``, the cursor's commit and the boundary's flags (one small all-reduce, started at one boundary
and waited for at the next). The rate is reported per wall second and per CPU second of rank 0 (the latter is less
sensitive to other load on the machine); the ratio is the median over rounds of elastic / plain. Beside it, the CPU
time spent in the adapter's own per-step work (its batch sampler's iteration, each micro-batch's bookkeeping, the
commit at the boundary; wrapped and added up in the elastic run) as a share of the step: what a busy machine does
not blur, and a bound on the overhead (1 - share) for the parts it covers.

    python bench/hf_overhead_bench.py [--rounds 3] [--steps 120] [--nproc 2] [--out bench/results/hf_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(Path(__file__).with_name("_hf_overhead_worker.py"))


def run(system: str, nproc: int, steps: int, work: Path) -> dict[str, float]:
    out = work / f"{system}-{time.monotonic_ns()}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        WORKER,
        "--system",
        system,
        "--out",
        str(out),
        "--steps",
        str(steps),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("ETRAIN_CHECKPOINT_URL", None)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{system} run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hf_overhead.json")
    args = p.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ["plain", "elastic"] if r % 2 == 0 else ["elastic", "plain"]
            res = {system: run(system, args.nproc, args.steps, Path(tmp)) for system in order}
            ratio = res["elastic"]["steps_per_s"] / res["plain"]["steps_per_s"]
            ratio_cpu = res["elastic"]["steps_per_cpu_s"] / res["plain"]["steps_per_cpu_s"]
            own = res["elastic"]["adapter_cpu_ms_per_step"]
            share = own / 1000 * res["elastic"]["steps_per_cpu_s"]
            rounds.append(
                {
                    "plain": res["plain"],
                    "elastic": res["elastic"],
                    "ratio": ratio,
                    "ratio_cpu": ratio_cpu,
                    "adapter_share": share,
                }
            )
            print(
                f"round {r + 1}: plain {res['plain']['steps_per_s']:.2f} steps/s "
                f"({res['plain']['steps_per_cpu_s']:.2f} per CPU-s), elastic {res['elastic']['steps_per_s']:.2f} "
                f"({res['elastic']['steps_per_cpu_s']:.2f}); elastic / plain {ratio:.3f} wall, {ratio_cpu:.3f} CPU; "
                f"the adapter's own work {own:.3f} ms of CPU per step ({100 * share:.2f} % of the step)",
                flush=True,
            )
    ratio = statistics.median(x["ratio"] for x in rounds)
    ratio_cpu = statistics.median(x["ratio_cpu"] for x in rounds)
    share = statistics.median(x["adapter_share"] for x in rounds)
    import torch
    import transformers

    summary = {
        "bench": "hf_overhead",
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "nproc": args.nproc,
        "steps_timed": rounds[0]["plain"]["steps"],
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rounds": rounds,
        "median_ratio_wall": ratio,
        "median_ratio_cpu": ratio_cpu,
        "median_adapter_share": share,
        "load_average_1m_at_end": os.getloadavg()[0],
        "goal": 0.98,
        "met": ratio >= 0.98,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(
        f"median elastic / plain: {ratio:.3f} of the step rate (wall), {ratio_cpu:.3f} (CPU); goal 0.98: "
        f"{'met' if ratio >= 0.98 else 'missed'}; the adapter's own work: {100 * share:.2f} % of the step's CPU "
        f"(bound: >= {1 - share:.3f}); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {args.out}"
    )


if __name__ == "__main__":
    main()
