"""Live recovery on one GPU: a torchrun job on NCCL at world size 1, its worker SIGKILLed mid-run.

Starts a real etcd on a free loopback port (in a temporary directory), then stock torchrun::

    torchrun --nnodes=1 --nproc-per-node=1 --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:<port> \\
        --rdzv-conf recovery=live --max-restarts=3 bench/_live_check_worker.py --device cuda ...

The worker (``ElasticTrainer(..., ElasticConfig(..., recovery="live"))``, an MLP with AdamW) records every
committed step. Once it has committed ``--kill-at`` steps its process is SIGKILLed; torchrun starts a new one,
which re-founds the live group from the newest snapshot. Checked: the job exits 0; every step from 1 to the
last (epochs x samples / batch) was committed; the steps ran on the device asked for (``cuda:0`` over NCCL,
or ``cpu`` over gloo); the worker after the kill is a new process. Figures: the time from the kill to the next
committed step (the recovery time), the steps lost (committed before the kill, done again after it), the
run's step rate before the kill. Printed, and written as JSON (``--json``). Exit status 0 when every check
passed, 1 when one failed, 2 when ``--device cuda`` is asked for without a CUDA device.

    python bench/gpu_live_check.py                       # on a GPU machine
    python bench/gpu_live_check.py --device cpu          # the same over gloo (anywhere)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from elastic.testing.etcd_server import LocalEtcdCluster  # noqa: E402
from elastic.testing.torchrun import TorchrunAgent, read_jsonl, torchrun_command  # noqa: E402
from elastic.testing.wait import wait_until  # noqa: E402

WORKER = str(HERE / "_live_check_worker.py")


def records(rec: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for f in sorted(rec.glob("rank*.jsonl")):
        out.extend(read_jsonl(f))
    return sorted(out, key=lambda r: r["t"])


def committed(rec: Path) -> int:
    return max((r["step"] for r in records(rec)), default=0)


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One job with one kill; the figures and the failed checks (``errors``)."""
    rec = workdir / "rec"
    errors: list[str] = []
    total = args.epochs * (args.samples // args.batch)
    result: dict[str, Any] = {"device": args.device, "expected_steps": total, "errors": errors}
    etcd = LocalEtcdCluster(1, workdir=workdir / "etcd").start()
    worker_args = [
        "--device",
        args.device,
        "--checkpoint-url",
        str(workdir / "ck"),
        "--record",
        str(rec),
        "--samples",
        str(args.samples),
        "--batch",
        str(args.batch),
        "--epochs",
        str(args.epochs),
        "--save-every",
        str(args.save_every),
        "--step-sleep",
        str(args.step_sleep),
    ]
    cmd = torchrun_command(
        backend="etcd-v3",
        endpoint=etcd.endpoints,
        run_id=f"gpu-live-{uuid.uuid4().hex[:6]}",
        nnodes="1",
        nproc=1,
        rdzv_conf={"recovery": "live"},
        max_restarts=3,
        script=WORKER,
        script_args=worker_args,
    )
    result["command"] = cmd
    # the workers import this working tree's elastic, whatever else is on the path
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {"LOGLEVEL": "WARNING", "PYTHONPATH": path}
    agent = TorchrunAgent(cmd, workdir / "agent.log", env=env)
    started = time.time()
    try:
        drive(agent.start(), rec, result, args)
    except Exception as e:  # every failure is reported in the JSON, with the agent's log
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        agent.stop()
        etcd.stop()
        result["elapsed_s"] = round(time.time() - started, 2)
    check(rec, result, total, args.device)
    if errors:
        result["agent_log_tail"] = agent.log()[-3000:]
    return result


def drive(agent: TorchrunAgent, rec: Path, result: dict[str, Any], args: argparse.Namespace) -> None:
    """Wait for ``--kill-at``, SIGKILL the worker, time the next step, wait for the job's end."""
    errors: list[str] = result["errors"]
    deadline = time.monotonic() + args.timeout

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    if not wait_until(lambda: committed(rec) >= args.kill_at, left(), interval=0.05):
        errors.append(f"step {args.kill_at} not reached within {args.timeout} s")
        return
    before = records(rec)
    killed_pids = {r["pid"] for r in before}
    steady = [r for r in before if r["step"] > 5]  # after the start-up steps
    if len(steady) >= 2 and steady[-1]["t"] > steady[0]["t"]:
        result["steps_per_s_before_kill"] = round((len(steady) - 1) / (steady[-1]["t"] - steady[0]["t"]), 2)
    killed_at = agent.kill_workers()
    last_before = max(r["step"] for r in records(rec) if r["t"] <= killed_at)
    result["killed_at_step"] = last_before

    def after() -> list[dict[str, Any]]:
        return [r for r in records(rec) if r["t"] > killed_at and r["pid"] not in killed_pids]

    if not wait_until(lambda: bool(after()), left(), interval=0.02):
        errors.append(f"no step completed after the kill (within the {args.timeout} s of the run)")
        return
    first = after()[0]
    result["recovery_s"] = round(first["t"] - killed_at, 3)
    result["lost_steps"] = max(0, last_before - (first["step"] - 1))
    rc = agent.wait(timeout=left())
    result["exit_code"] = rc
    if rc != 0:
        errors.append(f"torchrun exited {rc}")


def check(rec: Path, result: dict[str, Any], total: int, device: str) -> None:
    """The run's records: every step once at least, on the device asked for, the restart in a new process."""
    errors: list[str] = result["errors"]
    recs = [r for r in records(rec) if not r.get("late")]
    steps = sorted({r["step"] for r in recs})
    result["committed_steps"] = len(steps)
    result["worker_pids"] = len({r["pid"] for r in recs})
    if steps != list(range(1, total + 1)):
        missing = sorted(set(range(1, total + 1)) - set(steps))[:10]
        errors.append(f"steps committed {len(steps)} of {total} (missing e.g. {missing})")
    finals = [json.loads(p.read_text()) for p in rec.glob("final.rank*.json")]
    if not any(f["step"] == total for f in finals):
        errors.append(f"no worker finished at step {total}: {finals}")
    want = ("cuda:0", "nccl") if device == "cuda" else ("cpu", "gloo")
    seen = sorted({(r["device"], r["backend"]) for r in recs})
    result["device_backend"] = seen
    if seen != [want]:
        errors.append(f"steps ran on {seen}, not {list(want)}")
    if result.get("recovery_s") is not None and result["worker_pids"] < 2:
        errors.append("no new worker process after the kill")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--samples", type=int, default=1600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.02, help="seconds of simulated work per step")
    p.add_argument("--kill-at", type=int, default=40, help="SIGKILL the worker once it committed this step")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds for the whole job, kill and restart included")
    p.add_argument("--json", type=Path, default=HERE / "results" / "gpu_live_check.json")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, records, snapshots)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_live_check: no CUDA device (torch.cuda.is_available() is False); --device cpu runs on gloo",
            file=sys.stderr,
        )
        return 2
    if args.kill_at >= args.epochs * (args.samples // args.batch):
        p.error("--kill-at must be below the run's steps (epochs x samples / batch)")
    workdir = Path(tempfile.mkdtemp(prefix="gpu-live-check-"))
    result = run(args, workdir)
    result.update(
        torch=torch.__version__,
        python=platform.python_version(),
        host=platform.node(),
        gpu=torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        passed=not result["errors"],
        workdir=str(workdir) if args.keep else None,
    )
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"live recovery on {args.device} ({result['device_backend']}), world size 1, worker SIGKILL at step "
        f"{result.get('killed_at_step')}: next step after {result.get('recovery_s')} s, lost steps "
        f"{result.get('lost_steps')}, {result.get('committed_steps')}/{result['expected_steps']} steps, "
        f"exit {result.get('exit_code')}, {result['elapsed_s']} s in all"
    )
    for e in result["errors"]:
        print(f"FAIL: {e}", file=sys.stderr)
    if result["errors"] and "agent_log_tail" in result:
        print(result["agent_log_tail"], file=sys.stderr)
    print(f"wrote {args.json}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
