"""Rendezvous at scale: a burst of N simulated participants, etcd-v3 (this project) vs torch's c10d.

Participants are lightweight: real rendezvous handlers (torchrun's ``RendezvousHandler``, each with its own
lease and node id) without workers, several per process (``--procs`` processes, one etcd connection per
process, one thread per participant). All register (lease + liveness key) first; then, on one signal, all
call ``next_rendezvous()`` at once (a whole job starting, or re-forming after a restart of every agent).

Reports per N: the time from the last participant's join to the last one knowing its rank (and the
round's master address: ``next_rendezvous`` returned), and the etcd requests per participant for that
round, counted on the client side (our counting ``EtcdClient``) and on the server side (etcd's own
``grpc_server_started_total`` metric), split into the rendezvous protocol's requests and the round's store
traffic (torch's ``RendezvousStoreInfo``: rank 0 publishes its address, every rank reads it). Lease
keep-alives are reported per second. Against a three-member etcd on loopback.

c10d runs the same burst on a TCPStore where it finishes within ``--c10d-timeout``.

    python bench/rendezvous_scale_bench.py [--sizes 64,256,1024] [--procs 8] [--c10d-sizes 64,256]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import re
import shutil
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

PROTOCOL = ("txn", "watch_revisions", "grant_lease", "put")  # what the handler itself sends
STORE = ("get", "wait_for_event", "compare_and_put", "commit", "get_prefix", "count_prefix")


def _worker(
    backend: str,
    endpoint: str,
    run_id: str,
    n: int,
    indices: list[int],
    node_ttl: float,
    timeout: float,
    ready: Any,
    go: Any,
    results: Any,
) -> None:
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    logging.basicConfig(level=logging.WARNING)
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    handlers: list[RendezvousHandler] = []
    counting = None
    if backend == "etcd-v3":
        from elastic.etcd import create_client
        from elastic.etcd.config import EtcdOptions
        from elastic.rendezvous.etcd_v3_handler import EtcdV3RendezvousHandler, HandlerSettings
        from elastic.rendezvous.protocol import RendezvousKeys, RoundRules
        from elastic.testing.counting_etcd import CountingEtcdClient

        counting = CountingEtcdClient(create_client(EtcdOptions(endpoints=endpoint).config()))
        settings = HandlerSettings(
            rules=RoundRules(n, n, timedelta(seconds=30)),
            node_ttl=timedelta(seconds=node_ttl),
            join_timeout=timedelta(seconds=timeout),
        )
        keys = RendezvousKeys.of("/bench", run_id)
        for i in indices:
            h = EtcdV3RendezvousHandler(
                counting, run_id, keys, settings, local_addr="127.0.0.1", node_id=f"sim-{i:05d}"
            )
            h.register()
            handlers.append(h)
    else:
        from torch.distributed import TCPStore
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

        host, port = endpoint.split(":")
        for _ in indices:
            store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
            rdzv_timeout = RendezvousTimeout(join=timedelta(seconds=timeout), last_call=timedelta(seconds=30))
            handlers.append(
                DynamicRendezvousHandler.from_backend(
                    run_id, store, C10dRendezvousBackend(store, run_id), n, n, "127.0.0.1", rdzv_timeout
                )
            )
    if counting is not None:
        counting.reset()
    starts = [0.0] * len(handlers)
    ends = [0.0] * len(handlers)
    errors: list[str] = []

    def run(k: int) -> None:
        starts[k] = time.time()
        try:
            handlers[k].next_rendezvous()
            ends[k] = time.time()
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(len(handlers))]
    ready.put(len(handlers))
    go.wait()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    out: dict[str, Any] = {"starts": starts, "ends": ends, "errors": errors[:3], "n_errors": len(errors)}
    out["unfinished"] = sum(1 for t in threads if t.is_alive())
    if counting is not None:
        out["counts"] = counting.snapshot()
        out["read_bytes"], out["written_bytes"] = counting.read_bytes, counting.written_bytes
    results.put(out)
    results.close()
    results.join_thread()  # flushed before the hard exit below
    os._exit(0)  # the handlers' threads and leases go with the process, as with a killed job


def _server_counts(metrics_urls: list[str]) -> Counter[str]:
    """etcd's own count of gRPC calls started, per method, summed over the members."""
    total: Counter[str] = Counter()
    pattern = re.compile(r'^grpc_server_started_total\{.*grpc_method="(\w+)".*\} ([0-9.e+]+)$')
    for url in metrics_urls:
        with urllib.request.urlopen(url, timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                m = pattern.match(line)
                if m:
                    total[m.group(1)] += int(float(m.group(2)))
    return total


def burst(
    backend: str, endpoint: str, n: int, procs: int, node_ttl: float, timeout: float, metrics: list[str]
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    run_id = f"scale-{uuid.uuid4().hex[:8]}"
    procs = min(procs, n)
    shares = [list(range(n))[p::procs] for p in range(procs)]
    workers = [
        ctx.Process(target=_worker, args=(backend, endpoint, run_id, n, share, node_ttl, timeout, ready, go, results))
        for share in shares
    ]
    for w in workers:
        w.start()
    for _ in workers:
        ready.get(timeout=600)
    time.sleep(1.0)  # let the registrations' first keep-alives settle
    before = _server_counts(metrics) if metrics else Counter()
    t0 = time.time()
    go.set()
    outs = [results.get(timeout=timeout + 120) for _ in workers]
    wall = time.time() - t0
    after = _server_counts(metrics) if metrics else Counter()
    for w in workers:
        w.join(30)
    starts = [s for o in outs for s in o["starts"] if s]
    ends = [e for o in outs for e in o["ends"] if e]
    failed = sum(o["n_errors"] + o["unfinished"] for o in outs)
    row: dict[str, Any] = {"backend": backend, "n": n, "procs": procs, "finished": failed == 0 and len(ends) == n}
    row["errors"] = [e for o in outs for e in o["errors"]][:3]
    if row["finished"]:
        row["from_last_join_s"] = max(ends) - max(starts)
        row["from_first_join_s"] = max(ends) - min(starts)
    else:
        row["finished_participants"] = len(ends)
        row["wall_s"] = wall
    if backend == "etcd-v3":
        counts: Counter[str] = Counter()
        for o in outs:
            counts.update(o.get("counts", {}))
        row["client_requests"] = dict(counts)
        row["protocol_requests_per_participant"] = sum(counts[k] for k in PROTOCOL) / n
        row["store_requests_per_participant"] = sum(counts[k] for k in STORE) / n
        row["bytes_read_per_participant"] = sum(o.get("read_bytes", 0) for o in outs) / n
        server = after - before
        row["server_calls"] = dict(server)
        row["server_calls_per_participant_excl_keepalive"] = (sum(server.values()) - server["LeaseKeepAlive"]) / n
        row["server_keepalives_per_s"] = server["LeaseKeepAlive"] / max(wall, 1e-9)
    return row


def _print(row: dict[str, Any]) -> None:
    if not row["finished"]:
        done, wall = row.get("finished_participants", 0), row.get("wall_s", 0)
        what = f"did not finish ({done} of {row['n']} returned in {wall:.0f}s)"
        print(f"burst {row['backend']:7s} N={row['n']:5d}: {what} {row['errors'][:1]}", flush=True)
        return
    line = f"burst {row['backend']:7s} N={row['n']:5d}: from last join {row['from_last_join_s']:.3f}s"
    if row["backend"] == "etcd-v3":
        line += (
            f", requests/participant: protocol {row['protocol_requests_per_participant']:.2f}"
            f" + store {row['store_requests_per_participant']:.2f}"
            f" (etcd saw {row['server_calls_per_participant_excl_keepalive']:.2f} excl. keep-alives),"
            f" read {row['bytes_read_per_participant'] / 1024:.1f} KiB/participant,"
            f" keep-alives {row['server_keepalives_per_s']:.0f}/s"
        )
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--c10d-sizes", default="64,256")
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--node-ttl", type=float, default=10.0, help="participants' lease TTL (s)")
    parser.add_argument("--timeout", type=float, default=120.0, help="give up on a burst after this long")
    parser.add_argument("--etcd-members", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "rendezvous_scale.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import torch
    from torch.distributed import TCPStore

    from elastic.testing.etcd_server import LocalEtcdCluster, free_port

    workdir = Path(tempfile.mkdtemp(prefix="rdzv-scale-"))
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": {"procs": args.procs, "node_ttl_s": args.node_ttl, "etcd_members": args.etcd_members},
        "bursts": [],
    }
    try:
        with LocalEtcdCluster(args.etcd_members, workdir=workdir / "etcd") as etcd:
            metrics = [f"http://{m.endpoint}/metrics" for m in etcd.members]
            for n in [int(x) for x in args.sizes.split(",") if x]:
                for _ in range(args.trials):
                    row = burst("etcd-v3", etcd.endpoints, n, args.procs, args.node_ttl, args.timeout, metrics)
                    _print(row)
                    result["bursts"].append(row)
        for n in [int(x) for x in args.c10d_sizes.split(",") if x]:
            port = free_port()
            host = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)
            row = burst("c10d", f"127.0.0.1:{port}", n, args.procs, args.node_ttl, args.timeout, [])
            _print(row)
            result["bursts"].append(row)
            del host
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
