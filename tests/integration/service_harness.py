"""What the service's integration and chaos tests share beside the cluster itself
(:class:`service.testing.cluster.LocalServiceCluster`): the test job and API polling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastic.testing.wait import wait_for
from service.testing.cluster import REPO

__all__ = ["DEMO_JOB", "ROOT", "job_spec", "wait_api"]

ROOT = REPO
DEMO_JOB = ROOT / "examples" / "demo_job.py"


def job_spec(steps: int, *, step_time: float = 0.1, min_nodes: int = 2, max_nodes: int = 3) -> dict[str, Any]:
    return {
        "name": "itest",
        "entrypoint": str(DEMO_JOB),
        "args": ["--steps", str(steps), "--checkpoint-every", "10", "--step-time", str(step_time)],
        "env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
        "min_nodes": min_nodes,
        "max_nodes": max_nodes,
        "rendezvous": {"last_call_timeout": 1},
        "restart_policy": {"backoff_initial": 1},
    }


def wait_api(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    """:func:`wait_for` through the API, where errors mean "not yet" (the controller may be restarting)."""
    return wait_for(check, timeout, interval, what=what, retry_on=(Exception,))
