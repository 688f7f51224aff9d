"""Controller API load: throughput and latency of ``GET /v1/jobs/{id}`` (job status) on loopback.

Starts a real etcd and a real controller process (``python -m service.cli controller``, as an operator
would, with an admin token so that authentication is on), submits one job, then keeps ``--connections``
HTTP/1.1 keep-alive connections busy for ``--duration`` seconds from one asyncio client (a minimal
hand-written HTTP client, so that the client costs little CPU next to the server on a small machine).
Reports requests/s and latency percentiles; every answer must be a 200.

    python bench/api_load_bench.py [--duration 10] [--connections 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from _stats import p95  # noqa: E402

from elastic.contract.env import PREFIX  # noqa: E402
from elastic.testing.etcd_server import LocalEtcdCluster, free_port  # noqa: E402

TOKEN = "bench-admin-token-0123456789abcdef"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


async def http_get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> int:
    """Send one HTTP/1.1 request on a kept-alive connection, read the whole answer, return its status."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return int(head.split(b" ", 2)[1])


async def _connection(host: str, port: int, request: bytes, until: float, lat: list[float], bad: list[int]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < until:
            start = time.perf_counter()
            status = await http_get(reader, writer, request)
            lat.append(time.perf_counter() - start)
            if status != 200:
                bad.append(status)
    finally:
        writer.close()


async def _load(host: str, port: int, path: str, connections: int, duration: float) -> dict[str, Any]:
    request = (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Accept: application/json\r\n\r\n"
    ).encode()
    # Warm-up (connections, caches), not measured.
    await asyncio.gather(*[_connection(host, port, request, time.perf_counter() + 1.0, [], []) for _ in range(2)])
    lat: list[float] = []
    bad: list[int] = []
    start = time.perf_counter()
    until = start + duration
    await asyncio.gather(*[_connection(host, port, request, until, lat, bad) for _ in range(connections)])
    elapsed = time.perf_counter() - start
    return {
        "requests": len(lat),
        "non_200": len(bad),
        "req_per_s": len(lat) / elapsed,
        "p50_ms": statistics.median(lat) * 1e3,
        "p95_ms": p95(lat) * 1e3,
        "p99_ms": _percentile(lat, 0.99) * 1e3,
        "max_ms": max(lat) * 1e3,
    }


class Controller:
    """A controller process on a free loopback port, authentication on (one admin token)."""

    def __init__(self, etcd: LocalEtcdCluster, workdir: Path, log_level: str = "warning") -> None:
        self.port = free_port()
        tokens = workdir / "tokens.json"
        tokens.write_text(json.dumps({"tokens": [{"token": TOKEN, "role": "admin", "name": "bench"}]}))
        env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}  # no settings of the caller's
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        self.log = workdir / "controller.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "service.cli",
                    "controller",
                    "--etcd",
                    etcd.endpoints,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--tokens-file",
                    str(tokens),
                    "--prefix",
                    "/bench-api",
                    "--log-level",
                    log_level,
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"controller not ready: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def submit(self) -> str:
        spec = {"name": "load", "entrypoint": "train.py", "min_nodes": 1, "max_nodes": 2}
        r = httpx.post(f"{self.url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        r.raise_for_status()
        return str(r.json()["id"])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def bench_api(rounds: int, duration: float, connections: int, workdir: Path) -> dict[str, Any]:
    with LocalEtcdCluster(1, workdir=workdir / "etcd") as etcd:
        controller = Controller(etcd, workdir)
        try:
            job_id = controller.submit()
            out = []
            for i in range(rounds):
                r = asyncio.run(_load("127.0.0.1", controller.port, f"/v1/jobs/{job_id}", connections, duration))
                out.append(r)
                print(
                    f"api round {i + 1}: GET /v1/jobs/{{id}} {r['req_per_s']:.0f} req/s, p50 {r['p50_ms']:.1f} ms,"
                    f" p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms, non-200 {r['non_200']}"
                    f" ({r['requests']} requests, {connections} connections)",
                    flush=True,
                )
        finally:
            controller.stop()
    return {"endpoint": "GET /v1/jobs/{id}", "connections": connections, "duration_s": duration, "rounds": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "api_load.json")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="api-bench-"))
    try:
        result = bench_api(args.rounds, args.duration, args.connections, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
