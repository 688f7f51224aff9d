"""Resume of a sharded (FSDP2) job after a world-size change: the elastic loop vs torchrun + ``dcp.load``.

A 4-worker FSDP2 job of ``elastic/testing/train_worker.py`` (an MLP of ``--hidden`` x ``--depth``; SGD with
momentum) trains to step ``--steps`` and commits a sharded snapshot. Then, for each new world (2, then 3
workers: the 4 -> 2 -> 3 of issue 27), interleaved ``--trials`` times, both systems start from that same
snapshot under stock torchrun on the same etcd-v3 rendezvous:

- **elastic**: train_worker.py (``ElasticTrainer``) resumes by itself: verifies the newest snapshot's manifest
  (sizes and digests of every shard file), DCP-loads and reshards model + optimizer, restores cursor, RNG,
  scheduler, then trains;
- **dcp.load**: a bare script (below) that builds the same sharded model and optimizer, ``dcp.load``s the same
  DCP directory (model + optimizer only, no verification, no loop state) and runs one step.

Figure: seconds from launching torchrun to the end of the first training step of the new world (the worker's
own clock; both include interpreter and torch start, rendezvous and the load). Prints a table and writes JSON
(default bench/results/fsdp_resume.json).

    python bench/fsdp_resume_bench.py [--trials 3] [--hidden 1024 --depth 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from _stats import summarize  # noqa: E402

from elastic.testing.etcd_server import LocalEtcdCluster  # noqa: E402
from elastic.testing.torchrun import read_jsonl, torchrun_command  # noqa: E402

WORKER = str(REPO / "elastic" / "testing" / "train_worker.py")

#: the baseline: torchrun + dcp.load of the same DCP files into the same sharded model and optimizer, one step
BARE = r"""
import json, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
sys.path.insert(0, sys.argv[1])
from elastic.testing.train_worker import make_dataset, make_model
dcp_dir, out, hidden, depth = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(1)
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model = make_model(0, 0.0, hidden, depth)
for layer in model.modules():
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
opt.zero_grad(set_to_none=True)
for p in model.parameters():  # the optimizer's state exists before the load (DCP loads into it)
    p.grad = torch.zeros_like(p)
lr = opt.param_groups[0]["lr"]; opt.param_groups[0]["lr"] = 0.0; opt.step(); opt.param_groups[0]["lr"] = lr
msd, osd = get_state_dict(model, opt)
state = {"model": msd, "optim": osd}
dcp.load(state, checkpoint_id=dcp_dir)
set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
data = make_dataset(240)
x = torch.stack([data[i][0] for i in range(4)]); y = torch.stack([data[i][1] for i in range(4)])
opt.zero_grad(set_to_none=True)
F.cross_entropy(model(x), y).backward()
opt.step()
if dist.get_rank() == 0:
    open(out, "w").write(json.dumps({"t": time.time()}))
dist.destroy_process_group()
"""


def _torchrun(etcd: LocalEtcdCluster, nproc: int, script: str, args: list[str], log: Path) -> float:
    """Run one torchrun to its end; returns the launch time (time.time())."""
    cmd = torchrun_command(
        backend="etcd-v3",
        endpoint=etcd.endpoints,
        run_id=f"b-{uuid.uuid4().hex[:8]}",
        nnodes="1",
        nproc=nproc,
        rdzv_conf={"last_call_timeout": 1},
        max_restarts=0,
        script=script,
        script_args=args,
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", LOGLEVEL="WARNING")
    launched = time.time()
    with open(log, "ab") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=600).returncode
    if code != 0:
        raise SystemExit(f"torchrun failed ({code}): {log.read_text()[-3000:]}")
    return launched


def _model_args(args: argparse.Namespace) -> list[str]:
    return [
        "--fsdp",
        "--hidden",
        str(args.hidden),
        "--depth",
        str(args.depth),
        "--dropout",
        "0",
        "--samples",
        "240",
        "--batch",
        "4",
        "--lr",
        "0.05",
        "--lr-rule",
        "none",
        "--base-world",
        "4",
    ]


def _first_step_time(records: Path) -> float:
    times = [r["t"] for path in records.glob("*.jsonl") for r in read_jsonl(path)]
    if not times:
        raise SystemExit(f"no step recorded under {records}")
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="steps of the 4-worker job before the snapshot")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--worlds", default="2,3", help="the new worlds, in order")
    p.add_argument("--out", type=Path, default=HERE / "results" / "fsdp_resume.json")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fsdp-resume-"))
    etcd = LocalEtcdCluster(workdir=work / "etcd").start()
    try:
        saved = work / "ck-saved"
        _torchrun(
            etcd,
            4,
            WORKER,
            [
                *_model_args(args),
                "--checkpoint-url",
                str(saved),
                "--save-every",
                str(args.steps),
                "--max-steps",
                str(args.steps),
                "--record",
                str(work / "rec-saved"),
            ],
            work / "saved.log",
        )
        snapshot = sorted(saved.glob("step-*"))[-1]
        dcp_dir = next(d for d in snapshot.iterdir() if d.is_dir())
        state_mib = sum(f.stat().st_size for f in dcp_dir.iterdir()) / 2**20
        bare = work / "bare.py"
        bare.write_text(BARE)
        results: dict[str, dict[str, list[float]]] = {}
        for world in [int(w) for w in args.worlds.split(",")]:
            got = results.setdefault(str(world), {"elastic": [], "dcp_load": []})
            for trial in range(args.trials):
                ck = work / f"ck-{world}-{trial}"
                shutil.copytree(saved, ck)  # the same snapshot for every run
                rec = work / f"rec-{world}-{trial}"
                launched = _torchrun(
                    etcd,
                    world,
                    WORKER,
                    [
                        *_model_args(args),
                        "--checkpoint-url",
                        str(ck),
                        "--max-steps",
                        str(args.steps + 1),
                        "--record",
                        str(rec),
                    ],
                    work / "elastic.log",
                )
                got["elastic"].append(_first_step_time(rec) - launched)
                out = work / f"bare-{world}-{trial}.json"
                launched = _torchrun(
                    etcd,
                    world,
                    str(bare),
                    [str(REPO), str(dcp_dir), str(out), str(args.hidden), str(args.depth)],
                    work / "bare.log",
                )
                got["dcp_load"].append(json.loads(out.read_text())["t"] - launched)
    finally:
        etcd.stop()
    summary = {w: {k: summarize(v) for k, v in r.items()} for w, r in results.items()}
    print(
        f"FSDP2 resume after 4 workers, DCP state {state_mib:.1f} MiB (model + SGD momentum), "
        f"{args.trials} trials, {platform.node()}"
    )
    print(f"{'new world':>10} {'elastic loop (s)':>18} {'torchrun + dcp.load (s)':>25} {'ratio':>7}")
    for w, s in summary.items():
        e, b = s["elastic"]["median"], s["dcp_load"]["median"]
        print(f"{w:>10} {e:>18.2f} {b:>25.2f} {e / b:>7.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "state_mib": state_mib,
                "hidden": args.hidden,
                "depth": args.depth,
                "trials": args.trials,
                "worlds": summary,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
