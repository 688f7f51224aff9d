"""Stock torchrun with ``--rdzv-conf recovery=live``: each agent runs only its own node's workers.

Two real agents on real etcd. A lost node must not restart the other node's worker (the workers re-form
their live group themselves); a crashed worker is still restarted by its own agent.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from elastic.rendezvous.plugin import DEFAULT_KEY_PREFIX
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.torchrun import TorchrunAgent, read_jsonl, torchrun_command
from elastic.testing.wait import wait_until

WORKER = str(Path(__file__).with_name("_live_env_worker.py"))


def _agent(tmp_path: Path, name: str, endpoint: str, run_id: str) -> TorchrunAgent:
    cmd = torchrun_command(
        backend="etcd-v3",
        endpoint=endpoint,
        run_id=run_id,
        nnodes="1:2",
        nproc=1,
        rdzv_conf={"recovery": "live", "node_ttl": 1},
        max_restarts=3,
        script=WORKER,
        script_args=["--out", str(tmp_path / f"{name}.jsonl"), "--stop", str(tmp_path / "stop")],
    )
    return TorchrunAgent(cmd, tmp_path / f"{name}.log").start()


def _starts(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    return read_jsonl(tmp_path / f"{name}.jsonl")


def _alive(pid: int) -> bool:
    """``pid`` runs (a killed orphan that no one reaped yet, a zombie, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _logs(agents: list[TorchrunAgent]) -> str:
    return "\n".join(f"--- {a.log_path.name}\n{a.log()[-3000:]}" for a in agents)


@pytest.mark.timeout(180)
def test_a_lost_node_leaves_the_other_worker_running_and_a_crashed_worker_is_restarted_by_its_agent(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    run_id = f"live-{uuid.uuid4().hex[:6]}"
    a = _agent(tmp_path, "a", etcd_server.endpoints, run_id)
    b = _agent(tmp_path, "b", etcd_server.endpoints, run_id)
    agents += [a, b]
    assert wait_until(lambda: bool(_starts(tmp_path, "a")) and bool(_starts(tmp_path, "b")), 90), _logs(agents)

    first, lost = _starts(tmp_path, "a")[0], _starts(tmp_path, "b")[0]
    for started in (first, lost):
        # torchrun's world is node-local; the live group's place and the etcd connection are exported
        assert (started["world_size"], started["rank"], started["restart"]) == ("1", "0", "0")
        assert started["live_prefix"] == f"{DEFAULT_KEY_PREFIX}/{run_id}/live/"
        assert started["live_nodes"] == "1:2"
        assert started["etcd_endpoints"] == etcd_server.endpoints

    b.kill_tree(signal.SIGKILL)  # a whole node is lost
    b.wait(timeout=10)
    assert wait_until(lambda: not _alive(lost["pid"]), 10), "b's worker survived the kill"
    time.sleep(5)  # node_ttl (1 s) and many monitor intervals (0.1 s): a's agent would have re-formed by now
    assert _starts(tmp_path, "a") == [first], "a's agent restarted its worker for the lost node\n" + _logs(agents)
    assert _alive(first["pid"]), "a's worker died"
    assert a.process is not None and a.process.poll() is None, "a's agent must keep running"

    os.kill(first["pid"], signal.SIGKILL)  # a's worker crashes: its agent restarts it
    assert wait_until(lambda: len(_starts(tmp_path, "a")) >= 2, 60), _logs(agents)
    second = _starts(tmp_path, "a")[1]
    assert second["pid"] != first["pid"]
    assert (second["world_size"], second["rank"], second["restart"]) == ("1", "0", "1")
    assert second["live_prefix"] == first["live_prefix"]

    (tmp_path / "stop").touch()  # the worker finishes: its agent exits with its result
    assert a.wait(timeout=60) == 0, _logs(agents)
