"""A chaos session with every node in a network namespace of its own, so that one can be cut off.

The topology (``tests/integration/netns.py``) is built here, in the calling process, which stays outside
it; the session itself runs as ``ip netns exec <hub> python -m tests.chaos.runner --inside SPEC``: that
process, and so etcd, the controller and the runner's own API polling and etcd reads, live in the hub
namespace, and it starts each node agent in its node's namespace. The whole session is re-executed rather
than entered in-process because a network namespace belongs to a thread (``setns``) and is inherited by
what that thread starts: a process that is in the hub from its first instruction has no thread, gRPC
worker or child left in the caller's namespace, and the caller is left untouched (pytest runs other tests
beside it).

Teardown does not depend on the session ending well: whatever way this function is left (the session's
time limit plus a margin, an exception, Ctrl-C, SIGTERM turned into ``SystemExit`` by the CLI), the
session gets SIGTERM (then SIGKILL), every process still in one of the namespaces is killed and the
namespaces are deleted, their veths and the bridge with them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from tests.chaos.model import ChaosConfig, ChaosReport
from tests.integration.netns import create_topology
from tests.integration.service_harness import ROOT

logger = logging.getLogger(__name__)

__all__ = ["run_in_namespaces"]

#: what the session may take beyond its own time limit (tearing the cluster down) before it is killed
MARGIN = timedelta(seconds=120)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_in_namespaces(config: ChaosConfig, workdir: Path, node_names: Sequence[str]) -> ChaosReport:
    """Build a hub and one namespace per node, run the session in the hub, tear everything down."""
    workdir.mkdir(parents=True, exist_ok=True)
    report_path = workdir / "netns-report.json"
    report_path.unlink(missing_ok=True)
    topology = create_topology(node_names)
    try:
        spec = workdir / "netns-session.json"
        spec.write_text(
            json.dumps(
                {
                    "config": config.to_dict(),
                    "topology": json.loads(topology.to_json()),
                    "workdir": str(workdir),
                    "report": str(report_path),
                }
            )
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        cmd = [*topology.exec_prefix(topology.hub), sys.executable, "-m", "tests.chaos.runner", "--inside", str(spec)]
        proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT))
        try:
            proc.wait(timeout=(config.time_limit + MARGIN).total_seconds())
        except subprocess.TimeoutExpired:
            logger.error("chaos: the session in %s ran past its time limit; stopping it", topology.hub)
        finally:
            _stop(proc)
        if report_path.exists():
            return ChaosReport.from_dict(json.loads(report_path.read_text()))
        report = ChaosReport(config=config.to_dict(), job_state="unknown", network=f"netns: hub {topology.hub}")
        report.notes.append(f"the session in the namespaces exited with {proc.returncode} and left no report")
        return report
    finally:
        topology.teardown()
