"""An elastic torchrun job with torchrun's default ``--max-restarts=0`` is warned, once, at its start, that its first
failure ends it (elastic/rendezvous/plugin.py); with restarts, or a job of a fixed size, nothing is said. Real
torchrun agents on the etcd-v3 rendezvous of a real etcd, each running a script that exits at once."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from elastic.rendezvous.plugin import torchrun_max_restarts
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.torchrun import TorchrunAgent, torchrun_command

WARNING = "--max-restarts=0 (torchrun's default) with --nnodes="


def _agent(tmp_path: Path, etcd: LocalEtcdCluster, name: str, nnodes: str, max_restarts: int) -> TorchrunAgent:
    script = tmp_path / "done.py"
    script.write_text("print('trained', flush=True)\n")
    cmd = torchrun_command(
        backend="etcd-v3",
        endpoint=etcd.endpoints,
        run_id=f"{name}-{uuid.uuid4().hex[:8]}",
        nnodes=nnodes,
        max_restarts=max_restarts,
        rdzv_conf={"last_call_timeout": 1},
        script=str(script),
    )
    return TorchrunAgent(cmd, tmp_path / f"{name}.log").start()


@pytest.mark.timeout(240)
def test_an_elastic_job_with_no_restarts_is_warned_once_and_one_with_restarts_or_a_fixed_size_is_not(
    tmp_path: Path, etcd_server: LocalEtcdCluster
) -> None:
    agents = {
        "none": _agent(tmp_path, etcd_server, "none", "1:2", 0),
        "three": _agent(tmp_path, etcd_server, "three", "1:2", 3),
        "fixed": _agent(tmp_path, etcd_server, "fixed", "1", 0),  # not elastic: nothing to lose a node to
    }
    try:
        for agent in agents.values():
            assert agent.wait(timeout=180) == 0, agent.log()
    finally:
        for agent in agents.values():
            agent.stop()
    logs = {name: agent.log() for name, agent in agents.items()}
    assert all("trained" in log for log in logs.values()), logs
    assert logs["none"].count(WARNING) == 1, logs["none"]
    assert f"{WARNING}1:2" in logs["none"] and "pass --max-restarts=N" in logs["none"]
    assert WARNING not in logs["three"], logs["three"]
    assert WARNING not in logs["fixed"], logs["fixed"]


@pytest.mark.timeout(30)
def test_max_restarts_is_read_from_torchruns_command_line_with_torchruns_parser() -> None:
    head = ["torchrun", "--nnodes=1:2", "--rdzv-backend=etcd-v3", "--rdzv-endpoint=h1:2379"]
    assert torchrun_max_restarts([*head, "train.py", "--max-restarts=5"]) == 0  # the script's own argument
    assert torchrun_max_restarts([*head, "--max_restarts", "2", "train.py"]) == 2
    assert torchrun_max_restarts([*head, "-m", "pkg.train"]) == 0
    assert torchrun_max_restarts() is None  # this process is pytest, not a torchrun agent
