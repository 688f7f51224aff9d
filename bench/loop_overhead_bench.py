"""Steady-state overhead of the elastic loop: step throughput of the char transformer under the
ElasticTrainer (etcd-v3 rendezvous, async verified snapshots) vs the same model in plain DDP under stock
torchrun (--standalone) with the tutorial's synchronous torch.save from rank 0, at the same checkpoint
interval, 2 workers, interleaved rounds. Goal: ratio >= 0.98. Reports wall-clock steps/s and steps per
CPU-second of rank 0 (the latter is robust to other load on the machine). ``--with-local`` adds a third
system per round: the elastic loop with a node-local snapshot every step (elastic/checkpoint/tiers.py), to price it.

    python bench/loop_overhead_bench.py [--rounds 3] [--steps 400] [--with-local]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from elastic import compat
from elastic.env import LOCAL_SNAPSHOT_DIR, LOCAL_SNAPSHOT_EVERY
from elastic.testing.etcd_server import LocalEtcdCluster

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_overhead_worker.py"


def _run(mode: str, etcd: LocalEtcdCluster, steps: int, work: Path, save_every: int) -> tuple[float, float]:
    out = work / f"{mode}-{uuid.uuid4().hex[:6]}.json"
    rdzv = (
        ["--standalone"]
        if mode == "plain"
        else ["--rdzv-backend=etcd-v3", f"--rdzv-endpoint={etcd.endpoints}", f"--rdzv-id=ovh-{uuid.uuid4().hex[:6]}"]
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", *rdzv, str(WORKER),
           "--mode", "plain" if mode == "plain" else "elastic", "--steps", str(steps), "--out", str(out)]  # fmt: skip
    # Same checkpoint interval for both: plain DDP saves synchronously from rank 0 with torch.save.
    cmd += ["--checkpoint-url", str(work / f"ck-{uuid.uuid4().hex[:6]}"), "--save-every", str(save_every)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    compat.disable_shared_rdzv_store(env, override=True)  # the --standalone run too: both alike
    env.pop(LOCAL_SNAPSHOT_EVERY, None)
    if mode == "elastic-local":  # in memory where there is a /dev/shm, as in production
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
        env.update({LOCAL_SNAPSHOT_EVERY: "1", LOCAL_SNAPSHOT_DIR: str(shm / f"etrain-ovh-{out.stem}")})
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    finally:
        if LOCAL_SNAPSHOT_DIR in env:
            shutil.rmtree(env[LOCAL_SNAPSHOT_DIR], ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    got = json.loads(out.read_text())
    return float(got["steps_per_s"]), float(got["steps_per_cpu_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--save-every", type=int, default=100, help="checkpoint interval (steps), both systems")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "loop_overhead.json")
    parser.add_argument("--with-local", action="store_true", help="also the elastic loop + node-local snapshots")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="overhead-"))
    plain: list[float] = []
    elastic: list[float] = []
    plain_cpu: list[float] = []
    elastic_cpu: list[float] = []
    local: list[float] = []
    local_cpu: list[float] = []
    modes = ("plain", "elastic", "elastic-local") if args.with_local else ("plain", "elastic")
    with LocalEtcdCluster(1, workdir=work / "etcd") as etcd:
        for i in range(args.rounds):
            order = modes if i % 2 == 0 else tuple(reversed(modes))
            for mode in order:
                rate, cpu_rate = _run(mode, etcd, args.steps, work, args.save_every)
                {"plain": plain, "elastic": elastic, "elastic-local": local}[mode].append(rate)
                {"plain": plain_cpu, "elastic": elastic_cpu, "elastic-local": local_cpu}[mode].append(cpu_rate)
                print(f"round {i + 1} {mode:13s} {rate:7.2f} steps/s wall, {cpu_rate:7.2f} steps/CPU-s", flush=True)
    ratio = statistics.median(elastic) / statistics.median(plain)
    cpu_ratio = statistics.median(elastic_cpu) / statistics.median(plain_cpu)
    result = {
        "model": "TinyTransformer (char, 2 layers, width 64), batch 16/worker, 2 workers, gloo, CPU",
        "checkpoint_every_steps": args.save_every,
        "plain_ddp_steps_per_s": plain,
        "elastic_steps_per_s": elastic,
        "ratio_median": ratio,
        "plain_ddp_steps_per_cpu_s": plain_cpu,
        "elastic_steps_per_cpu_s": elastic_cpu,
        "cpu_ratio_median": cpu_ratio,
        "elastic_local_steps_per_s": local,
        "elastic_local_steps_per_cpu_s": local_cpu,
        "load_average": os.getloadavg(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(f"plain DDP median {statistics.median(plain):.2f} steps/s, elastic median "
          f"{statistics.median(elastic):.2f} steps/s, ratio {ratio:.3f} (goal >= 0.98); "
          f"per CPU-second of rank 0: ratio {cpu_ratio:.3f} (robust to other load on the machine)")  # fmt: skip
    if local:
        lr = statistics.median(local) / statistics.median(elastic)
        lc = statistics.median(local_cpu) / statistics.median(elastic_cpu)
        result.update(local_vs_elastic_ratio=lr, local_vs_elastic_cpu_ratio=lc)
        print(f"elastic + node-local snapshot every step median {statistics.median(local):.2f} steps/s: "
              f"{lr:.3f} of the elastic loop without it ({lc:.3f} per CPU-second of rank 0)")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
