"""Simulated node agents and the API load client of ``controller_scale_bench`` (each run as its own process).

``agents``: N node agents in one process, writing to etcd exactly what real agents write
(``service.agent.node``): each node claims its name (a read), grants its own lease, puts its ``NodeInfo`` on
it and keeps the lease alive every ``ttl / 3``; for each new assignment it reports ``running`` (a fake pid),
for each assignment taken away it reports ``stopped``. Instead of torchrun, the rank 0 of each running job
writes the job's progress (``elastic.train.progress.Progress``, the real reporter's value) every ``--progress-interval``
seconds; when a job reaches its step budget every node of the generation reports ``exited`` with
code 0, and (with ``--api``) a new job is submitted through the API in its place, so the number of active jobs
stays about the same while the history grows. With ``--churn-every`` S, a random node dies every S seconds
(its lease revoked: the controller sees the node lost) and comes back 3 s later as a new incarnation. One
process reads every node's assignments with one watch instead of one per node (that is etcd's load, not the
controller's). Commands on stdin: ``steady`` (progress and churn on), ``quiet`` (both off), ``stop``.

``api``: ``--connections`` keep-alive HTTP/1.1 connections asking ``GET /v1/jobs/{id}`` for random job ids,
plus one scraping ``/metrics`` every second, for ``--duration`` seconds; writes latencies as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
from api_load_bench import http_get

from elastic.contract.progress import Progress
from elastic.etcd import EtcdClient, EtcdError, create_client
from elastic.etcd.config import EtcdConfig
from service.core.models import Assignment, NodeInfo, WorkerReport
from service.core.store import ServiceStore


def _now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass
class _Job:
    generation: int = 0
    nodes: set[str] = field(default_factory=set)
    step: int = 0
    budget: int = 0  # steps until the job succeeds
    done_generation: int = -1  # the generation whose workers exited 0


class Agents:
    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        nodes: int,
        ttl: float,
        progress_interval: float,
        churn_every: float,
        mean_steps: int,
        api: str = "",
        token: str = "",
    ) -> None:
        self.client = client
        self.store = ServiceStore(client, prefix)
        self.names = [f"node-{i:04d}" for i in range(nodes)]
        self.ttl = ttl
        self.progress_interval = progress_interval
        self.churn_every = churn_every
        self.mean_steps = mean_steps
        self.leases: dict[str, int] = {}
        self.lock = threading.Lock()
        self.jobs: dict[str, _Job] = {}
        self.held: dict[tuple[str, str], int] = {}  # (node, job) -> generation, as last seen assigned
        self.exited: set[tuple[str, str, int]] = set()  # (node, job, generation) whose workers exited
        self.steady = threading.Event()
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(8)
        self.rng = random.Random(7)
        self.writes = 0
        self.api, self.token = api, token
        self.submitter = ThreadPoolExecutor(1)
        self.replaced = 0

    # -- nodes ---------------------------------------------------------------------------------------
    def register(self, name: str) -> None:
        self.client.get(self.store.keys.node(name))  # a real agent first checks the name is free
        lease = self.client.grant_lease(timedelta(seconds=self.ttl))
        info = NodeInfo(
            name=name,
            capacity=1,
            rdzv_host="127.0.0.1",
            hostname="sim",
            pid=os.getpid(),
            incarnation=uuid.uuid4().hex[:12],
            registered_at=_now(),
            lease_ttl=self.ttl,
        )
        self.store.register_node(info, lease)
        with self.lock:
            self.leases[name] = lease

    def register_all(self) -> None:
        list(self.pool.map(self.register, self.names))

    def keepalive(self) -> None:
        period = self.ttl / 3
        while not self.stop.is_set():
            began = time.monotonic()
            with self.lock:
                leases = list(self.leases.values())
            for lease in leases:
                try:
                    self.client.keep_alive_once(lease)
                except EtcdError:
                    pass
            self.stop.wait(max(0.0, period - (time.monotonic() - began)))

    def churn(self) -> None:
        while not self.stop.wait(self.churn_every):
            if not self.steady.is_set():
                continue
            name = self.rng.choice(self.names)
            with self.lock:
                lease = self.leases.pop(name, None)
            if lease is None:
                continue
            self.client.revoke_lease(lease)  # the agent died: its node key goes, its workers with it
            with self.lock:
                for key in [k for k in self.held if k[0] == name]:
                    del self.held[key]
            threading.Timer(3.0, self._revive, args=(name,)).start()

    def _revive(self, name: str) -> None:
        if not self.stop.is_set():
            self.register(name)

    # -- assignments and reports ---------------------------------------------------------------------
    def report(self, node: str, job: str, generation: int, state: str, code: int | None = None) -> None:
        now = _now()
        report = WorkerReport(
            job_id=job,
            node=node,
            generation=generation,
            state=state,  # type: ignore[arg-type]
            pid=10_000 + generation,
            exit_code=code,
            started_at=now if state == "running" else None,
            finished_at=None if state == "running" else now,
        )
        self.store.put_report(report)
        self.writes += 1

    def follow(self) -> None:
        prefix = self.store.keys.assign
        while not self.stop.is_set():
            kvs, revision = self.client.get_prefix(prefix)
            seen: dict[tuple[str, str], int] = {}
            for kv in kvs:
                node, _, job = kv.key[len(prefix) :].partition("/")
                seen[(node, job)] = Assignment.model_validate_json(kv.value).generation
            with self.lock:
                live = set(self.leases)
                new = [(k, g) for k, g in seen.items() if k[0] in live and self.held.get(k) != g]
                gone = [(k, g) for k, g in self.held.items() if k not in seen or seen[k] != g]
                for k, _ in gone:
                    self.held.pop(k, None)
                for k, g in new:
                    self.held[k] = g
                jobs: dict[str, _Job] = {}
                for (node, job), g in self.held.items():
                    j = jobs.setdefault(job, self.jobs.get(job) or _Job(budget=self._budget()))
                    if j.generation != g:
                        j.generation, j.nodes = g, set()
                    j.nodes.add(node)
                self.jobs = jobs
            for (node, job), g in gone:
                if (node, job, g) not in self.exited and node in live:
                    self.report(node, job, g, "stopped", -15)
            for (node, job), g in new:
                self.report(node, job, g, "running")
            self.exited = {e for e in self.exited if (e[0], e[1]) in self.held}
            self.client.wait_for_event(prefix, revision + 1, timedelta(seconds=1), prefix=True)

    def _replace(self) -> None:
        self.replaced += 1
        spec = {"name": f"more-{self.replaced}", "entrypoint": "train.py", "min_nodes": 2, "max_nodes": 4}
        try:
            httpx.post(
                f"{self.api}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {self.token}"}, timeout=30
            ).raise_for_status()
        except httpx.HTTPError as exc:
            print(f"cannot submit a replacement job: {exc}", file=sys.stderr, flush=True)

    def _budget(self) -> int:
        return max(5, int(self.rng.expovariate(1.0 / self.mean_steps)))

    def progress(self) -> None:
        while not self.stop.is_set():
            began = time.monotonic()
            with self.lock:
                jobs = [(job, j.generation, sorted(j.nodes), j) for job, j in self.jobs.items() if j.nodes]
            gap = self.progress_interval / max(1, len(jobs))
            for job, generation, nodes, j in jobs:
                if self.stop.is_set() or not self.steady.is_set():
                    break
                j.step += 1
                if j.step >= j.budget and j.done_generation != generation:
                    j.done_generation = generation
                    for node in nodes:
                        self.exited.add((node, job, generation))
                        self.report(node, job, generation, "exited", 0)
                    if self.api:
                        self.submitter.submit(self._replace)
                    continue
                p = Progress(
                    step=j.step,
                    world_size=len(nodes),
                    time=time.time(),
                    total_steps=j.budget,
                    loss=1.0 / j.step,
                    generation=generation,
                    nodes=nodes,
                )
                self.client.put(self.store.keys.progress_of(job), p.to_json())
                self.writes += 1
                time.sleep(gap)
            if not jobs or not self.steady.is_set():
                self.stop.wait(0.2)
            else:
                self.stop.wait(max(0.0, self.progress_interval - (time.monotonic() - began)))


def run_agents(args: argparse.Namespace) -> None:
    client = create_client(EtcdConfig.from_options(args.etcd, {}))
    agents = Agents(
        client,
        args.prefix,
        args.nodes,
        args.lease_ttl,
        args.progress_interval,
        args.churn_every,
        args.mean_steps,
        args.api,
        args.token,
    )
    began = time.monotonic()
    agents.register_all()
    print(f"ready {time.monotonic() - began:.1f}", flush=True)
    targets = [agents.keepalive, agents.follow, agents.progress]
    if args.churn_every > 0:
        targets.append(agents.churn)
    for target in targets:
        threading.Thread(target=target, daemon=True).start()
    for line in sys.stdin:
        command = line.strip()
        if command == "steady":
            agents.steady.set()
        elif command == "quiet":
            agents.steady.clear()
        elif command.startswith("api "):
            agents.api = command.split(" ", 1)[1]
        elif command == "stop":
            break
    agents.stop.set()
    print(f"replaced {agents.replaced} writes {agents.writes}", flush=True)


# -- API load --------------------------------------------------------------------------------------------
async def _api_load(args: argparse.Namespace) -> dict[str, object]:
    ids = json.loads(Path(args.job_ids).read_text())
    host, port = "127.0.0.1", args.port
    rng = random.Random(11)

    def request(path: str) -> bytes:
        return (
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {args.token}\r\n"
            "Accept: application/json\r\n\r\n"
        ).encode()

    until = time.perf_counter() + args.duration
    status_lat: list[float] = []
    metrics_lat: list[float] = []
    bad: list[int] = []

    async def status_conn() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while time.perf_counter() < until:
                started = time.perf_counter()
                code = await http_get(reader, writer, request(f"/v1/jobs/{rng.choice(ids)}"))
                status_lat.append(time.perf_counter() - started)
                if code != 200:
                    bad.append(code)
        finally:
            writer.close()

    async def metrics_conn() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while time.perf_counter() < until:
                started = time.perf_counter()
                code = await http_get(reader, writer, request("/metrics"))
                metrics_lat.append(time.perf_counter() - started)
                if code != 200:
                    bad.append(code)
                await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - started)))
        finally:
            writer.close()

    await asyncio.gather(metrics_conn(), *[status_conn() for _ in range(args.connections)])
    return {"status_s": status_lat, "metrics_s": metrics_lat, "non_200": bad}


def run_api(args: argparse.Namespace) -> None:
    result = asyncio.run(_api_load(args))
    Path(args.out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["agents", "api"])
    parser.add_argument("--etcd", default="")
    parser.add_argument("--prefix", default="/bench-scale")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--lease-ttl", type=float, default=10.0)
    parser.add_argument("--progress-interval", type=float, default=1.0)
    parser.add_argument("--churn-every", type=float, default=5.0)
    parser.add_argument("--mean-steps", type=int, default=120)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", default="")
    parser.add_argument("--api", default="", help="URL of the API: replace finished jobs by new ones")
    parser.add_argument("--job-ids", default="")
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    (run_agents if args.role == "agents" else run_api)(args)


if __name__ == "__main__":
    main()
