"""Chaos runner: one training job on the real service under random faults, then its pass conditions.

A three-member etcd cluster, the controller and three node agents run as processes
(``tests/integration/service_harness.py``); the job is ``elastic/testing/train_worker.py`` (the
ElasticTrainer) on 1..3 nodes. Faults are drawn from a seeded RNG, each kind in turn in a shuffled order,
one at a time: the next fault comes once the job has trained ``steps_between`` steps past where it was
when the last one hit. Faults:

- ``worker_kill`` / ``worker_stop``: SIGKILL, or SIGSTOP for 2-5 s, of one training worker;
- ``torchrun_kill`` / ``torchrun_stop``: the same for one node's torchrun (elastic agent) process;
- ``agent_kill``: SIGKILL of one node agent (its torchrun follows through the parent-death signal); the
  node comes back 3-6 s later; ``agent_stop``: SIGSTOP of a node agent for 3-6 s (its lease expires);
- ``controller_restart``: SIGKILL of the controller, a new one started at once;
- ``etcd_member_loss``: SIGKILL of one of the three etcd members, restarted 3-8 s later;
- ``network_partition``: one node cut off for 3-8 s (nftables drops everything in and out of its
  namespace except loopback), then healed; its leases expire, the others re-form, it rejoins;
- ``etcd_outage``: every etcd member SIGKILLed, all restarted with their data 10 s later;
- ``storage_outage``: the S3 store of the job's checkpoints gone for 10 s, from the moment a snapshot's
  data upload begins (a save in flight; ``tests/chaos/storage.py``);
- ``two_jobs``: a second, malformed job submitted beside the training job (its script fails at once on
  a bad argument); it crash-loops and must end ``failed`` with a ``last_error``.

With ``--recovery live`` the job runs in live recovery (the job spec's ``recovery: live``): its workers form
their own group and re-form it in place. The pass conditions then read the records as one set per step, by
one generation of that group (late records, written after a re-form for the step a member died in, count
as the step's), and add: the workers of a node no fault touched keep their processes through every fault
(the records' pid and node), every replica holds the same state after every step (the records' digest),
and no re-formed generation re-does a step. The impact of the quiet kinds counts re-forms apart from
restarts (new worker processes, steps done twice).

The last three wait for a steady job (nothing pending, no node disturbed, a worker group on every node),
and the runner measures what they cost the training job (``impact``: new worker groups, steps done twice,
time lost against the pace before; ``checks.training_impact``). With ``storage_outage`` among the kinds
the job's checkpoints live on a real S3-compatible server (moto) behind the runner's proxy, with
``keep_last`` 6 (each commit reads every kept manifest), and the runner verifies every snapshot a group
resumed from at once, before retention removes it; otherwise they live in a directory, all kept, and are
verified at the end. With ``two_jobs`` among the kinds each node has two worker slots.

With ``network_partition`` among the kinds (the default) each node runs in a network namespace of its
own, and etcd, the controller and this runner in a hub namespace joined to the nodes by a bridge
(``tests/chaos/isolation.py``, ``tests/integration/netns.py``; root or CAP_NET_ADMIN, ``ip`` and ``nft``
needed). Where namespaces cannot be made, or with ``--no-netns``, everything runs on loopback in the
caller's namespace and partitions are left out with a warning. At most one node is disturbed (agent
down, stopped or partitioned) at a time.

Pass: the job succeeds; training resumes after every fault (within ``settle_timeout``); every rank of
the final group holds identical parameters; in the effective
trajectory every step is committed once and every sample is seen exactly once per epoch; nothing the API
once showed of the job (record, events, counters) disappears or goes back; every snapshot a group resumed
from verifies; the newest snapshot committed before a storage outage verifies after it, and no group
resumed from an older one after it; the malformed second job ends ``failed`` with a ``last_error`` while
the training job starts no new worker group and no new generation. The run stops by itself: at
``time_limit`` at the latest, everything is torn down (processes, and namespaces with their links, also on
Ctrl-C or SIGTERM).

    python -m tests.chaos.runner --faults 50 --seed 1 [--recovery live] [--time-limit 2400] [--no-netns]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from elastic.checkpoint import CheckpointOptions, create_checkpoint_manager
from elastic.prefork import forked_worker
from elastic.proctree import descendants, process_stat
from elastic.testing.etcd_server import free_port
from elastic.testing.s3_server import LocalS3Server
from elastic.testing.wait import wait_for
from service.client import ApiClient, ApiError
from service.testing.cluster import LocalServiceCluster
from tests.chaos.checks import (
    ApiHistory,
    Record,
    RecordReader,
    check_exactly_once,
    check_partitions_dropped_and_rejoined,
    check_reforms_redo_nothing,
    check_replicas_identical,
    check_resumed_snapshots_verify,
    check_step_digests,
    check_undisturbed_workers_kept,
    durable_resume_points,
    founded_attempts,
    label_live_attempts,
    redone_steps,
    resume_points,
    training_impact,
    verify_snapshot,
    worker_processes,
)
from tests.chaos.isolation import run_in_namespaces
from tests.chaos.model import QUIET_KINDS, RECOVERY_MODES, ChaosConfig, ChaosReport, Fault, FaultKind
from tests.chaos.storage import StoreProxy
from tests.integration.netns import NetnsTopology, unavailable_reason
from tests.integration.service_harness import ROOT

__all__ = ["ChaosConfig", "ChaosReport", "ChaosRunner", "Fault", "FaultKind", "main", "run_chaos"]

logger = logging.getLogger(__name__)

#: after a deferred action (SIGCONT, a restart, a heal), how long its consequences (a lease that expired while
#: the node was stopped, a re-formation) may take to show, at most; see ``ChaosRunner._quiet``
AFTER_ACTION_S = 5.0

WORKER = ROOT / "elastic" / "testing" / "train_worker.py"
BUCKET = "ckpt-chaos"
TAIL_S = 5.0  # a quiet fault's impact is measured until this long after its end
TERMINAL = ("succeeded", "failed", "cancelled")


class _Cluster(LocalServiceCluster):
    """The harness, with the controller's checkpoint root given as a URL (the S3 bucket, or the directory)."""

    def __init__(self, workdir: Path, checkpoint_root_url: str | None = None, **kwargs: Any) -> None:
        super().__init__(workdir, **kwargs)
        self.checkpoint_root_url = checkpoint_root_url or f"file://{self.checkpoint_root}"

    def start_controller(self, ready_timeout: float = 60) -> ApiClient:
        port = free_port()
        self.controller = self._spawn(
            "controller",
            [
                "controller",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--leader-ttl",
                str(self.lease_ttl),
                "--checkpoint-root",
                self.checkpoint_root_url,
            ],
        )
        self.url = f"http://127.0.0.1:{port}"
        api = ApiClient(self.url)
        wait_for(
            lambda: self.check_alive() and api.ready(),
            ready_timeout,
            0.5,
            what="the controller to be ready",
            retry_on=(ApiError,),
        )
        return api


class _ResumeVerifier(threading.Thread):
    """Verifies each snapshot a worker group resumed from as soon as the group's first step is recorded: on
    S3 the job keeps few snapshots, and retention removes one a few saves later."""

    def __init__(
        self, records: Callable[[], list[Record]], url: str, storage_options: dict[str, Any], live: bool = False
    ) -> None:
        super().__init__(daemon=True, name="resume-verifier")
        self.records, self.live = records, live
        self.manager = create_checkpoint_manager(url, CheckpointOptions(storage_options=storage_options))
        self.checked: dict[int, list[str]] = {}
        self.stop_event = threading.Event()
        self._lock = threading.Lock()

    def check_new(self) -> None:
        with self._lock:
            for step in sorted(set(durable_resume_points(self.records(), self.live)) - set(self.checked)):
                self.checked[step] = verify_snapshot(self.manager, step, f"resumed from step {step}: its snapshot")

    def run(self) -> None:
        while not self.stop_event.wait(0.5):
            try:
                self.check_new()
            except Exception as exc:  # a record half-written, ...: the next round reads them again
                logger.debug("chaos: resume verifier: %r", exc)

    def finish(self) -> tuple[list[str], int]:
        self.stop_event.set()
        self.join(timeout=30)
        try:
            self.check_new()
        finally:
            self.manager.close()
        return [p for problems in self.checked.values() for p in problems], len(self.checked)


class _Poller(threading.Thread):
    """Reads the job and its events from the API once a second (whatever controller is up)."""

    def __init__(self, cluster: LocalServiceCluster, job_id: str, history: ApiHistory) -> None:
        super().__init__(daemon=True)
        self.cluster, self.job_id, self.history = cluster, job_id, history
        self.stop_event = threading.Event()
        self.last_job: dict[str, Any] | None = None

    def poll_once(self) -> None:
        url = self.cluster.url
        try:
            with httpx.Client(base_url=url, timeout=5) as http:
                job = http.get(f"/v1/jobs/{self.job_id}")
                events = http.get(f"/v1/jobs/{self.job_id}/events", params={"limit": 10000})
        except httpx.HTTPError:
            return  # the controller is restarting
        if job.status_code == 404 or events.status_code == 404:
            self.history.problems.append(f"the API answered 404 for job {self.job_id}: its record was lost")
            return
        if job.status_code != 200 or events.status_code != 200:
            return  # 503 while etcd elects a leader: not a loss
        self.last_job = job.json()
        self.history.observe(self.last_job, events.json()["events"])

    def run(self) -> None:
        while not self.stop_event.wait(1.0):
            self.poll_once()


@dataclass
class _Partition:
    node: str
    began: float  # unix time
    healed: float | None = None


class ChaosRunner:
    """One chaos session, in this process; with ``network`` this process must run in its hub namespace."""

    def __init__(self, config: ChaosConfig, workdir: Path, network: NetnsTopology | None = None) -> None:
        if FaultKind.NETWORK_PARTITION in config.kinds and network is None:
            raise ValueError("network partitions need the nodes in network namespaces (a NetnsTopology)")
        self.config = config
        self.workdir = workdir
        self.network = network
        self.rng = random.Random(config.seed)
        self.report = ChaosReport(config=config.to_dict())
        if network is not None:
            self.report.network = f"netns: hub {network.hub} at {network.hub_address}, nodes " + ", ".join(
                f"{n.name}={n.address}" for n in network.nodes.values()
            )
        root = f"s3://{BUCKET}" if config.on_s3 else None
        self.cluster = _Cluster(workdir, root, lease_ttl=2.0, etcd_members=3, network=network)
        self.slots = 2 if FaultKind.TWO_JOBS in config.kinds else None  # room for a second job on each node
        self.s3: LocalS3Server | None = None
        self.proxy: StoreProxy | None = None
        self.verifier: _ResumeVerifier | None = None
        self.poller: _Poller | None = None
        self.outage_began: float | None = None  # unix times of the outage in progress (etcd or storage)
        self.outage_ended: float | None = None
        self.storage_cuts: list[tuple[float, int | None]] = []  # (when, newest committed step then)
        self.storage_problems: list[str] = []
        self.second_jobs: list[tuple[Fault, str]] = []
        self.second_problems: list[str] = []
        self.rec = workdir / "records"
        self.hold = workdir / "hold"  # exists until the last fault was injected (ChaosConfig.hold_epochs)
        self._read_records = RecordReader(self.rec)
        self.history = ApiHistory()
        # (unix time, node or None, what): what may have replaced a node's workers (live: the pid check)
        self.disturbances: list[tuple[float, str | None, str]] = []
        self.pending: list[tuple[float, str, Callable[[], None]]] = []  # (due, what, action)
        self.last_action_at = 0.0  # time.time() of the last deferred action (SIGCONT, restart, heal) run
        self.down_agents: set[str] = set()
        self.partitioned: set[str] = set()
        self.stopped_agents: set[str] = set()
        self.partitions: list[_Partition] = []
        self.down_members: set[int] = set()
        self.deadline = time.monotonic() + config.time_limit.total_seconds()
        self.job_id = ""
        self._order: list[FaultKind] = []

    # -- the job -------------------------------------------------------------------------------------
    def job_spec(self) -> dict[str, Any]:
        c = self.config
        args = [
            "--record",
            str(self.rec),
            "--epochs",
            str(c.epochs),
            "--samples",
            str(c.samples),
            "--batch",
            str(c.batch),
            "--lr-rule",
            "fixed-global-batch",
            "--base-world",
            str(c.nodes),
            "--save-every",
            str(c.save_every),
            "--step-sleep",
            str(c.step_sleep),
            "--dropout",
            "0",
            "--keep-last",
            "1000000",
        ]
        if c.hold_epochs > 0:  # a slow tail until the last fault (ChaosConfig.hold_epochs)
            # --pace-file: the steps after the last fault (the hold file gone) run at full speed, not step_sleep's
            args += [
                "--hold-file",
                str(self.hold),
                "--hold-epoch",
                str(max(0, c.epochs - c.hold_epochs)),
                "--hold-max",
                str(c.hold_max_s),
                "--pace-file",
                str(self.hold),
            ]
        env = {"OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
        if self.network is None:
            env["GLOO_SOCKET_IFNAME"] = "lo"  # in namespaces the agents give their node's interface
        extra: dict[str, Any] = {}
        if self.proxy is not None:  # fsspec hands FSSPEC_S3_* to s3fs: the workers reach S3 through the proxy
            env.update(
                FSSPEC_S3_ENDPOINT_URL=self.proxy.endpoint_url,
                FSSPEC_S3_KEY="testing",
                FSSPEC_S3_SECRET="testing",
                AWS_EC2_METADATA_DISABLED="true",
            )
            args[args.index("--keep-last") + 1] = str(c.s3_keep_last)
            extra["checkpoint_url"] = f"s3://{BUCKET}/main"
        return {
            "name": "chaos",
            "entrypoint": str(WORKER),
            "args": args,
            "env": env,
            **extra,
            "min_nodes": 1,
            "max_nodes": c.nodes,
            "rendezvous": {"last_call_timeout": 1},
            "local_snapshot_every": c.local_every,
            "recovery": c.recovery,
            "restart_policy": {
                "backoff_initial": 1,
                "backoff_max": 4,
                "max_failures": 1000,
                "max_membership_changes": 100000,
                "max_worker_restarts": 100,
                "crash_loop_threshold": 1000,
                "blacklist_after": 1000,
            },
        }

    def malformed_spec(self) -> dict[str, Any]:
        """A second job whose script exits at once (argparse: ``--epochs`` is not a number), on one node,
        restarted in place once per generation; two generations failing before a step: a crash loop."""
        env = {"OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
        if self.network is None:
            env["GLOO_SOCKET_IFNAME"] = "lo"
        return {
            "name": "malformed",
            "entrypoint": str(WORKER),
            "args": ["--record", str(self.workdir / "malformed"), "--epochs", "not-a-number"],
            "env": env,
            "min_nodes": 1,
            "max_nodes": 1,
            "restart_policy": {
                "backoff_initial": 1,
                "backoff_max": 2,
                "max_failures": 3,
                "max_worker_restarts": 1,
                "crash_loop_threshold": 2,
            },
        }

    def generation_starts(self) -> list[tuple[float, int]]:
        """``(unix time, generation)`` of each generation of the job the controller started (its events)."""
        for _ in range(5):
            try:
                events = list(self.history.events.values())  # the poller's thread adds to it
                break
            except RuntimeError:
                continue
        else:
            events = []
        out = []
        for e in events:
            m = re.search(r": generation (\d+) on ", e.get("message", "")) if e.get("type") == "state" else None
            if m:
                out.append((datetime.fromisoformat(e["time"]).timestamp(), int(m.group(1))))
        return sorted(out)

    def records(self) -> list[Record]:
        """The workers' records; in live recovery with each attempt named after its job generation too
        (``checks.label_live_attempts``)."""
        records = self._read_records()
        if self.config.live:
            records = label_live_attempts(records, self.generation_starts())
        return records

    def max_step(self, after: float = 0.0) -> int:
        return max((r["step"] for r in self._read_records() if r["t"] > after), default=0)

    def _past(self, after: float, goal: int) -> bool:
        return self.max_step(after=after) >= goal

    # -- the clock: deferred actions (SIGCONT, restarts) and crashed agents -----------------------------
    def tick(self) -> None:
        now = time.monotonic()
        due = [p for p in self.pending if p[0] <= now]
        self.pending = [p for p in self.pending if p[0] > now]
        for _, what, action in due:
            logger.info("chaos: %s", what)
            action()
            self.last_action_at = time.time()
        for name, proc in self.cluster.agents.items():
            if name not in self.down_agents and proc.poll() is not None:
                logger.warning("chaos: agent %s exited (%s); starting it again", name, proc.returncode)
                self.report.notes.append(f"agent {name} exited with {proc.returncode} and was restarted")
                self.disturbances.append((time.time(), name, f"agent {name} exited"))
                self.down_agents.add(name)
                self.later(1.0, f"restart agent {name}", functools.partial(self._restart_agent, name))

    def later(self, delay: float, what: str, action: Callable[[], None]) -> None:
        self.pending.append((time.monotonic() + delay, what, action))

    def wait(self, what: str, predicate: Callable[[], bool], timeout: float) -> bool:
        end = min(time.monotonic() + timeout, self.deadline)
        while time.monotonic() < end:
            self.tick()
            if predicate():
                return True
            time.sleep(0.25)
        logger.warning("chaos: timed out waiting for %s", what)
        return False

    def pause(self, seconds: float) -> None:
        """Sleep while deferred actions keep running."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.tick()
            time.sleep(0.1)

    def _restart_agent(self, name: str) -> None:
        self.cluster.start_agent(name, self.slots)
        self.down_agents.discard(name)

    # -- targets -------------------------------------------------------------------------------------
    def _torchruns(self) -> dict[str, int]:
        try:
            reports = self.cluster.reports(self.job_id)
        except Exception as exc:  # etcd electing: no target this time
            logger.warning("chaos: cannot read reports: %s", exc)
            return {}
        # a warm job's reported pid is the prefork client of its torchrun; a fault must hit torchrun itself,
        # which its job's zygote forked (service.agent.zygotes)
        return {node: forked_worker(r.pid) or r.pid for node, r in reports.items() if r.state == "running" and r.pid}

    @staticmethod
    def _children(pid: int) -> list[int]:
        """The training workers of torchrun ``pid``: its children, or, for a warm-start client (the service's
        default), the worker the client's zygote forked for it (a fault must hit the process that trains)."""
        out = []
        for child, _ in descendants(pid):
            st = process_stat(child)
            if st is not None and st[0] == pid:
                out.append(forked_worker(child) or child)
        return out

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def _stop_for(self, pid: int, seconds: float, what: str) -> None:
        self._signal(pid, signal.SIGSTOP)
        self.later(seconds, f"SIGCONT {what}", lambda: self._signal(pid, signal.SIGCONT))

    # -- faults --------------------------------------------------------------------------------------
    def next_kind(self) -> FaultKind:
        if not self._order:
            self._order = list(self.config.kinds)
            self.rng.shuffle(self._order)
        return self._order.pop()

    def inject(self, kind: FaultKind) -> str | None:
        """Inject one fault; the target's name, or None when no target is available now."""
        rng = self.rng
        if kind in (FaultKind.WORKER_KILL, FaultKind.WORKER_STOP, FaultKind.TORCHRUN_KILL, FaultKind.TORCHRUN_STOP):
            torchruns = self._torchruns()
            if not torchruns:
                return None
            node = rng.choice(sorted(torchruns))
            pid = torchruns[node]
            if kind in (FaultKind.WORKER_KILL, FaultKind.WORKER_STOP):
                workers = self._children(pid)
                if not workers:
                    return None
                pid = rng.choice(workers)
            target = f"{'worker' if 'worker' in kind.value else 'torchrun'} {pid} on {node}"
            if kind.value.endswith("kill"):
                self._signal(pid, signal.SIGKILL)
            else:
                self._stop_for(pid, rng.uniform(2, 5), target)
            return target
        if kind in (FaultKind.AGENT_KILL, FaultKind.AGENT_STOP, FaultKind.NETWORK_PARTITION):
            disturbed = self.down_agents | self.stopped_agents | self.partitioned
            up = sorted(n for n in self.cluster.agents if n not in disturbed)
            if len(up) < self.config.nodes:  # one node disturbed at a time
                return None
            name = rng.choice(up)
            if kind == FaultKind.NETWORK_PARTITION:
                return self._partition(name, rng.uniform(3, 8))
            if kind == FaultKind.AGENT_KILL:
                self.cluster.kill_agent(name)
                self.down_agents.add(name)
                self.later(rng.uniform(3, 6), f"restart agent {name}", lambda: self._restart_agent(name))
            else:
                self._stop_agent_for(name, rng.uniform(3, 6))
            return f"agent {name}"
        if kind == FaultKind.CONTROLLER_RESTART:
            self.cluster.kill_controller()
            self.cluster.start_controller()
            return "controller"
        if kind == FaultKind.ETCD_MEMBER_LOSS:
            if self.down_members:
                return None
            index = rng.randrange(len(self.cluster.etcd.members))
            self.cluster.etcd.stop_member(index)
            self.down_members.add(index)

            def back() -> None:
                self.cluster.etcd.start_member(index)
                self.down_members.discard(index)

            self.later(rng.uniform(3, 8), f"restart etcd member {index}", back)
            return f"etcd member {index}"
        if kind == FaultKind.ETCD_OUTAGE:
            return self._etcd_outage()
        if kind == FaultKind.STORAGE_OUTAGE:
            return self._storage_outage()
        if kind == FaultKind.TWO_JOBS:
            return self._second_job()
        raise ValueError(kind)

    # -- the quiet kinds -----------------------------------------------------------------------------
    def _quiet(self) -> bool:
        """Nothing pending, no node or etcd member disturbed, and the newest worker group, on every node,
        is training now and has trained for 3 s, counted from ``AFTER_ACTION_S`` after the last deferred
        action at the earliest: what follows can be put down to the next fault.

        Why after the action: a node stopped for longer than its lease (``torchrun_stop``, ``agent_stop``) is
        dropped while stopped, but the group re-forms only after SIGCONT, seconds later, while the old group
        still trains; a fault injected in between (a second job) would be blamed for that re-formation. Why
        "now": between the old group's last step and the new group's first, the newest records are old."""
        if self.pending or self.down_agents or self.stopped_agents or self.partitioned or self.down_members:
            return False
        records = self.records()
        if not records:
            return False
        newest = max(records, key=lambda r: r["t"])
        ts = [r["t"] for r in records if r["attempt"] == newest["attempt"]]
        since = max(min(ts), self.last_action_at + AFTER_ACTION_S)
        fresh = time.time() - newest["t"] < 1.0
        return fresh and newest["world"] == self.config.nodes and max(ts) - since >= 3.0

    def _generation(self) -> int | None:
        if self.poller is None:
            return None
        self.poller.poll_once()
        job = self.poller.last_job
        return int(job["generation"]) if job and "generation" in job else None

    def _end_outage(self) -> None:
        self.outage_ended = time.time()

    def _etcd_outage(self) -> str | None:
        if self.down_members:
            return None
        members = list(range(len(self.cluster.etcd.members)))
        self.outage_began = time.time()
        for index in members:
            self.cluster.etcd.stop_member(index)
        self.down_members.update(members)

        def back() -> None:
            for index in members:
                self.cluster.etcd.start_member(index)
            self.down_members.clear()
            self._end_outage()

        self.later(self.config.outage_s, "restart every etcd member", back)
        return f"all {len(members)} etcd members (SIGKILL) for {self.config.outage_s:.0f} s"

    def _start_store(self) -> None:
        """moto on loopback, the proxy where the workers can reach it (the hub's address in namespaces)."""
        self.cluster.logs.mkdir(parents=True, exist_ok=True)
        self.s3 = LocalS3Server(log_path=self.cluster.logs / "moto.log").start()
        self.s3.create_bucket(BUCKET)
        host = self.network.hub_address if self.network is not None else "127.0.0.1"
        self.proxy = StoreProxy(host, free_port(host), (self.s3.host, self.s3.port)).start()

    def _store_manager(self) -> Any:
        assert self.s3 is not None
        options = CheckpointOptions(storage_options=self.s3.storage_options())
        return create_checkpoint_manager(f"s3://{BUCKET}/main", options)

    def _storage_outage(self) -> str | None:
        proxy = self.proxy
        assert proxy is not None, "storage_outage needs the job on S3 (ChaosConfig.on_s3)"
        proxy.arm()
        if not self.wait("a save in flight", proxy.cut_event.is_set, 10):
            proxy.cut("between saves: no snapshot upload began within 10 s")
        self.outage_began = time.time()
        manager = self._store_manager()  # straight to moto, not through the proxy
        try:
            newest = manager.latest_step()
        finally:
            manager.close()
        self.storage_cuts.append((self.outage_began, newest))

        def back() -> None:
            assert self.proxy is not None
            self.proxy.start()
            self._end_outage()
            if newest is None:
                return
            manager = self._store_manager()
            try:
                what = f"step {newest}, the newest snapshot committed before the storage outage,"
                self.storage_problems += verify_snapshot(manager, newest, what)
            finally:
                manager.close()

        self.later(self.config.outage_s, "the S3 endpoint back", back)
        return (
            f"S3 endpoint {proxy.endpoint_url} for {self.config.outage_s:.0f} s, cut {proxy.cut_reason};"
            f" newest committed snapshot then: step {newest}"
        )

    def _second_job(self) -> str | None:
        try:
            with ApiClient(self.cluster.url) as api:
                job = api.submit(self.malformed_spec())
        except ApiError as exc:
            logger.warning("chaos: cannot submit the second job: %s", exc)
            return None
        return f"job {job['id']} (malformed: --epochs not-a-number)"

    def _second_job_end(self, fault: Fault, job_id: str) -> None:
        """Wait for the malformed job to end; it must end failed, with a last_error."""
        final: dict[str, Any] = {}

        def ended() -> bool:
            try:
                with ApiClient(self.cluster.url, timeout=5) as api:
                    final.update(api.job(job_id))
            except ApiError:
                return False
            return final.get("state") in TERMINAL

        if not self.wait(f"job {job_id} to end", ended, 180):
            self.second_problems.append(f"job {job_id} did not end within 180 s: {final.get('state')}")
            return
        fault.ended = time.time()
        error = (final.get("last_error") or "").strip()
        lines = error.splitlines()
        cause = [line.strip() for line in lines if "error:" in line]  # the script's own message (argparse)
        fault.detail = f"job {job_id} ended {final.get('state')}, last_error: " + (
            " ... ".join([lines[0].strip(), *cause[-1:]]) if lines else "none"
        )
        if final.get("state") != "failed":
            self.second_problems.append(f"job {job_id} ended {final.get('state')}, not failed")
        if "not-a-number" not in error:
            self.second_problems.append(f"job {job_id}'s last_error does not show the script's error: {error!r}")

    def _settle(self, fault: Fault, kind: FaultKind, total: int) -> bool:
        """Wait until the job has trained ``steps_between`` steps past the fault (past the end of an outage;
        and a second job must have ended too)."""
        c = self.config
        timeout = c.settle_timeout.total_seconds()
        after, step = fault.at, fault.step_at
        if kind in (FaultKind.ETCD_OUTAGE, FaultKind.STORAGE_OUTAGE):
            if not self.wait("the end of the outage", lambda: self.outage_ended is not None, c.outage_s + 60):
                return False
            assert self.outage_ended is not None
            fault.ended = after = self.outage_ended
            step = self.max_step()
            if step >= total:  # the job trained on through the outage and finished before it ended
                return True
        goal = min(total, step + c.steps_between)
        if not self.wait(f"the job to get past step {goal}", functools.partial(self._past, after, goal), timeout):
            return False
        if kind == FaultKind.TWO_JOBS:
            job_id = fault.target.split()[1]
            self.second_jobs.append((fault, job_id))
            self._second_job_end(fault, job_id)
        return True

    def _stop_agent_for(self, name: str, seconds: float) -> None:
        pid = self.cluster.agents[name].pid
        self._signal(pid, signal.SIGSTOP)
        self.stopped_agents.add(name)

        def cont() -> None:
            self._signal(pid, signal.SIGCONT)
            self.stopped_agents.discard(name)

        self.later(seconds, f"SIGCONT agent {name}", cont)

    def _partition(self, name: str, seconds: float) -> str:
        assert self.network is not None
        self.network.partition(name)
        self.partitioned.add(name)
        partition = _Partition(name, time.time())
        self.partitions.append(partition)

        def heal() -> None:
            assert self.network is not None
            self.network.heal(name)
            self.partitioned.discard(name)
            partition.healed = time.time()

        self.later(seconds, f"heal the partition of {name}", heal)
        return f"node {name} ({self.network.nodes[name].address}) for {seconds:.1f} s"

    # -- the run -------------------------------------------------------------------------------------
    def run(self) -> ChaosReport:
        c, report = self.config, self.report
        started = time.monotonic()
        history = self.history
        poller: _Poller | None = None
        try:
            if c.on_s3:
                self._start_store()
            api = self.cluster.start_controller()
            for i in range(1, c.nodes + 1):
                self.cluster.start_agent(f"node-{i}", self.slots)
            if not self.wait("the nodes", lambda: len(api.nodes()) == c.nodes, 60):
                raise RuntimeError("the node agents never registered")
            self.hold.touch()
            self.job_id = report.job_id = api.submit(self.job_spec())["id"]
            poller = self.poller = _Poller(self.cluster, self.job_id, history)
            poller.start()
            if self.s3 is not None:
                self.verifier = _ResumeVerifier(self.records, f"s3://{BUCKET}/main", self.s3.storage_options(), c.live)
                self.verifier.start()
            total = c.epochs * c.steps_per_epoch
            if not self.wait("training to start", lambda: self.max_step() >= c.steps_between, 180):
                raise RuntimeError("the job never trained")
            while len(report.faults) < c.faults and self.deadline - time.monotonic() > 60:
                if self.max_step() >= total - c.steps_between:
                    report.notes.append(f"the job neared its end after {len(report.faults)} faults")
                    break
                kind = self.next_kind()
                if kind in QUIET_KINDS and not self.wait(f"a steady job before {kind.value}", self._quiet, 90):
                    report.notes.append(f"{kind.value} hit a job that was not steady after 90 s")
                if self.max_step() >= total - c.steps_between:  # it trained on while we waited
                    report.notes.append(f"the job neared its end after {len(report.faults)} faults")
                    break
                step_at, at = self.max_step(), time.time()
                generation = self._generation() if kind in QUIET_KINDS else None
                self.outage_began = self.outage_ended = None
                target = self.inject(kind)
                if target is None:
                    self._order.insert(0, kind)  # try it again later
                    self.pause(1.0)
                    continue
                at = self.outage_began or at  # a storage outage begins when the upload it waited for does
                fault = Fault(kind.value, target, at, step_at)
                report.faults.append(fault)
                self.disturbances.append((at, fault_node(kind, target), f"{kind.value} on {target}"))
                logger.info("chaos: fault %d: %s on %s at step %d", len(report.faults), kind.value, target, step_at)
                if self._settle(fault, kind, total):
                    fault.settle_s = time.time() - at
                    if kind in QUIET_KINDS and fault.ended is not None:
                        self.pause(max(0.0, fault.ended + TAIL_S + 1 - time.time()))
                        now = self._generation()
                        delta = None if now is None or generation is None else now - generation
                        fault.impact = {"generation_delta": delta}
                else:
                    report.stalls.append(
                        f"fault {len(report.faults)} ({kind.value} on {target} at step {step_at}): no progress"
                        f" {c.settle_timeout.total_seconds():.0f} s later"
                    )
                    break
                self.pause(self.rng.uniform(0, 2))
            self.hold.unlink(missing_ok=True)  # the job's tail may run at full pace
            self.wait("pending actions", lambda: not self.pending, 15)

            def finished() -> bool:
                job = poller.last_job if poller else None
                return bool(job and job["state"] in ("succeeded", "failed", "cancelled"))

            self.wait("the job to finish", finished, self.deadline - time.monotonic())
            poller.poll_once()
            report.job_state = (poller.last_job or {}).get("state", "unknown")
            if report.job_state not in ("succeeded", "failed", "cancelled"):
                report.notes.append("the time limit was reached before the job finished")
            checkpoint_url = ((poller.last_job or {}).get("checkpoint") or {}).get("url") or ""
            self._check(history, checkpoint_url, total)
        finally:
            self.hold.unlink(missing_ok=True)
            if poller is not None:
                poller.stop_event.set()
            if self.verifier is not None:
                self.verifier.stop_event.set()
            for _, _, action in self.pending:  # leave nothing stopped behind
                try:
                    action()
                except Exception:
                    pass
            self.cluster.stop()
            if self.proxy is not None:
                self.proxy.stop()
            if self.s3 is not None:
                self.s3.stop()
            report.duration_s = time.monotonic() - started
        return report

    def _check(self, history: ApiHistory, checkpoint_url: str, total: int) -> None:
        c, report = self.config, self.report
        records = self.records()
        report.steps = max((r["step"] for r in records), default=0)
        report.attempts = len({r["attempt"] for r in records})
        report.recovery = c.recovery
        report.redone_steps = len(redone_steps(records))
        if c.live:
            founded = founded_attempts(records)
            report.founded = len(founded)
            report.reforms = report.attempts - len(founded)
            report.worker_processes = sum(len(procs) for procs in worker_processes(records).values())
        report.resumed_node_local = len({r["attempt"] for r in records if r.get("resumed_from") == "node-local"})
        report.api_polls, report.events = history.polls, len(history.events)

        def guarded(name: str, check: Callable[[], list[str]]) -> None:
            try:
                report.checks[name] = check()
            except Exception as exc:  # a check that cannot run is a failed check
                report.checks[name] = [f"could not check: {exc!r}"]

        def snapshots() -> list[str]:
            if not checkpoint_url:
                return ["the job reported no checkpoint url"]
            if self.verifier is not None:  # on S3: checked as they came, before retention removed them
                problems, report.resume_points_verified = self.verifier.finish()
                return problems
            problems, report.resume_points_verified = check_resumed_snapshots_verify(
                records, checkpoint_url, live=c.live
            )
            return problems

        def storage_outages() -> list[str]:
            problems = list(self.storage_problems)
            starts = {a: min(r["t"] for r in records if r["attempt"] == a) for a in {r["attempt"] for r in records}}
            points = resume_points(records)
            if c.live:  # a re-formed generation continued from its members' state, not from storage
                points = {a: step for a, step in points.items() if a in founded_attempts(records)}
            for cut, newest in self.storage_cuts:
                for attempt, step in points.items():
                    if newest is not None and starts[attempt] > cut and step < newest:
                        problems.append(
                            f"a group resumed from step {step} after the storage outage at"
                            f" {cut:.1f}, though step {newest} was committed before it"
                        )
            return problems

        def second_jobs() -> list[str]:
            problems = list(self.second_problems)
            for fault, job_id in self.second_jobs:
                impact = fault.impact or {}
                if impact.get("new_groups"):
                    problems.append(
                        f"the training job started {impact['new_groups']} worker group(s) while job {job_id} ran"
                    )
                if impact.get("generation_delta"):
                    problems.append(
                        f"the training job's generation went up by {impact['generation_delta']} while job {job_id} ran"
                    )
            return problems

        for fault in report.faults:  # the quiet kinds' cost to the training job, from all its records
            if fault.impact is not None and fault.ended is not None:
                until = max(fault.ended + TAIL_S, fault.at + (fault.settle_s or 0.0))
                impact = {**training_impact(records, fault.at, until, live=c.live), **fault.impact}
                restarted = impact["restarted"] if c.live else impact["new_groups"]  # live: re-forms are not
                impact["restarted"] = bool(restarted or impact.get("generation_delta"))
                fault.impact = impact

        guarded("job completed", lambda: [] if report.job_state == "succeeded" else [f"job {report.job_state}"])
        guarded("training resumed after every fault", lambda: list(report.stalls))
        guarded(
            "every sample exactly once per epoch",
            lambda: check_exactly_once(records, c.samples, c.epochs, c.steps_per_epoch),
        )
        guarded("replicas identical", lambda: check_replicas_identical(self.rec, live=c.live))
        guarded("no job record or event lost", lambda: list(history.problems))
        guarded("no torn checkpoint loaded", snapshots)
        if self.storage_cuts:
            guarded("no committed snapshot lost in a storage outage", storage_outages)
        if self.second_jobs or self.second_problems:
            guarded("malformed second job failed, training job unaffected", second_jobs)
        if c.live:
            guarded(
                "live: workers of undisturbed nodes kept their processes",
                lambda: check_undisturbed_workers_kept(records, self.disturbances),
            )
            guarded("live: replicas identical after every step", lambda: check_step_digests(records))
            guarded("live: re-forms re-did no step", lambda: check_reforms_redo_nothing(records))
        if self.partitions:
            cuts = [(p.node, p.began, p.healed) for p in self.partitions]
            events = list(history.events.values())
            guarded(
                "partitioned nodes dropped and rejoined", lambda: check_partitions_dropped_and_rejoined(cuts, events)
            )
        logs = [log for log in (self.workdir / "agents").glob("**/*.log") if log.is_file()]
        report.corrupt_warnings = sum(log.read_text(errors="replace").lower().count("corrupt") for log in logs)


#: kinds that disturb one node, named in the fault's target ("worker 123 on node-2", "agent node-1", "node node-3
#: (10.0.0.3) for 4.2 s"); the others touch no node's workers (a live job must keep every worker through them)
_NODE_TARGET = {
    **dict.fromkeys(
        (FaultKind.WORKER_KILL, FaultKind.WORKER_STOP, FaultKind.TORCHRUN_KILL, FaultKind.TORCHRUN_STOP), r" on (\S+)$"
    ),
    **dict.fromkeys((FaultKind.AGENT_KILL, FaultKind.AGENT_STOP), r"^agent (\S+)$"),
    FaultKind.NETWORK_PARTITION: r"^node (\S+) ",
}


def fault_node(kind: FaultKind, target: str) -> str | None:
    """The node a fault disturbed (from its target), or None for a fault of no node."""
    pattern = _NODE_TARGET.get(kind)
    m = re.search(pattern, target) if pattern else None
    return m.group(1) if m else None


def run_chaos(
    config: ChaosConfig, workdir: Path | None = None, keep: bool = False, netns: bool | None = None
) -> ChaosReport:
    """Run one bounded chaos session (a temporary work dir unless given; removed unless ``keep``).

    With ``network_partition`` among the kinds the session runs in network namespaces (``netns`` None:
    where they work; True: they must; False: never). Where they cannot be used, partitions are left out
    with a warning, and the report says why (``partitions_left_out``).
    """
    own = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="chaos-")) if workdir is None else workdir
    try:
        wanted = FaultKind.NETWORK_PARTITION in config.kinds or netns is True
        reason = "" if not wanted else "turned off (--no-netns)" if netns is False else unavailable_reason() or ""
        if reason and netns is True:
            raise RuntimeError(f"network namespaces are unavailable: {reason}")
        if wanted and not reason:
            return run_in_namespaces(config, wd, [f"node-{i}" for i in range(1, config.nodes + 1)])
        if reason and FaultKind.NETWORK_PARTITION in config.kinds:
            logger.warning("chaos: network partitions left out: %s", reason)
            config = config.without(FaultKind.NETWORK_PARTITION)
        report = ChaosRunner(config, wd).run()
        report.partitions_left_out = reason
        return report
    finally:
        if own and not keep:
            shutil.rmtree(wd, ignore_errors=True)


def _exit_once(signum: int, frame: FrameType | None) -> None:
    """SIGTERM or SIGINT: unwind through every ``finally`` (processes, namespaces); a second signal (Ctrl-C
    reaches both this process and the session in the hub) must not cut that teardown short."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def _inside(spec_path: Path) -> int:
    """The half of a namespaced run that runs in the hub (see ``tests/chaos/isolation.py``)."""
    spec = json.loads(spec_path.read_text())
    config = ChaosConfig.from_dict(spec["config"])
    network = NetnsTopology.from_json(json.dumps(spec["topology"]))
    report = ChaosRunner(config, Path(spec["workdir"]), network).run()
    Path(spec["report"]).write_text(json.dumps(report.to_dict(), indent=2, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--time-limit", type=float, default=2400, help="seconds; the run stops by itself")
    p.add_argument("--steps-between", type=int, default=10)
    p.add_argument("--local-every", type=int, default=0, help="node-local snapshot every N steps (0: off)")
    p.add_argument(
        "--recovery",
        choices=RECOVERY_MODES,
        default="restart",
        help="the job's recovery mode (job spec recovery); live adds the live-only checks",
    )
    p.add_argument("--kinds", default=",".join(k.value for k in FaultKind))
    p.add_argument(
        "--no-netns",
        action="store_true",
        help="everything on loopback in this namespace; network partitions are left out",
    )
    p.add_argument("--workdir", type=Path, default=None, help="keep everything here (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--inside", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per API poll otherwise
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_once)
    if args.inside is not None:
        return _inside(args.inside)
    config = ChaosConfig(
        faults=args.faults,
        seed=args.seed,
        time_limit=timedelta(seconds=args.time_limit),
        steps_between=args.steps_between,
        kinds=tuple(FaultKind(k) for k in args.kinds.split(",")),
        local_every=args.local_every,
        recovery=args.recovery,
    )
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    report = run_chaos(config, args.workdir, netns=False if args.no_netns else None)
    print(report.summary())
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_dict(), indent=2, default=str))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
