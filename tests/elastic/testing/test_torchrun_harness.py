"""The test harness's torchrun agents (elastic.testing.torchrun) forked from the shared zygote: real torchrun, real
etcd, real signals. They must behave as the cold agents they replace in the integration tests: the agent's own
environment (``LOGLEVEL``), torchrun's exit status, and the fault injections (a worker crash, a node death, a
SIGTERM) reaching the same processes."""

from __future__ import annotations

import json
import re
import signal
import textwrap
import uuid
from pathlib import Path

import pytest

from elastic.proctree import process_stat
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.torchrun import TorchrunAgent, forked_command, torchrun_command
from elastic.testing.wait import wait_until

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from elastic.prefork.common import launcher_pid
    with open(os.environ["OUT"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "launcher": launcher_pid(),
                            "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}) + "\\n")
    if os.environ.get("MODE") == "sleep":
        time.sleep(60)
    sys.exit(int(os.environ.get("CODE", "0")))
    """
)


def _agent(tmp: Path, etcd: LocalEtcdCluster, env: dict[str, str], max_restarts: int = 0) -> TorchrunAgent:
    script = tmp / "job.py"
    script.write_text(SCRIPT)
    cmd = torchrun_command(
        backend="etcd-v3",
        endpoint=etcd.endpoints,
        run_id=f"h-{uuid.uuid4().hex[:8]}",
        nnodes="1",
        max_restarts=max_restarts,
        script=str(script),
        prefork=True,
    )
    return TorchrunAgent(cmd, tmp / "agent.log", env={"OUT": str(tmp / "out.jsonl"), **env}, forked=True).start()


def _records(tmp: Path) -> list[dict[str, int]]:
    path = tmp / "out.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_the_forked_command_runs_torchrun_through_the_prefork_client_and_refuses_anything_else() -> None:
    cmd = torchrun_command(backend="etcd-v3", endpoint="127.0.0.1:2379", run_id="r", nnodes="1")
    forked = forked_command(cmd)
    assert forked[:5] == [cmd[0], "-m", "elastic.prefork", "-m", "elastic.prefork.torchrun"]
    assert forked[5:] == cmd[3:]
    with pytest.raises(ValueError, match=r"torch\.distributed\.run"):
        forked_command(["torchrun", *cmd[3:]])


@pytest.mark.parametrize(("level", "shown"), [("INFO", True), ("WARNING", False)])
def test_a_forked_agent_is_the_zygotes_child_logs_at_its_own_loglevel_and_exits_like_torchrun(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent], level: str, shown: bool
) -> None:
    agent = _agent(tmp_path, etcd_server, {"LOGLEVEL": level, "CODE": "3"})
    agents.append(agent)
    assert wait_until(lambda: agent.agent_pid is not None, 60), agent.log()
    pid = agent.agent_pid
    assert pid is not None and pid != agent.pid
    stat = process_stat(pid)
    assert stat is not None and "elastic.prefork --serve" in _cmdline(stat[0]), "forked by the zygote"
    assert agent.wait(timeout=90) == 1, agent.log()  # torchrun's status for a failed worker, as a cold agent's
    assert [r["launcher"] for r in _records(tmp_path)] == [pid], "the worker's launcher is the forked torchrun"
    log = agent.log()
    assert "ChildFailedError" in log, log[-3000:]
    # an INFO line of a torch logger the zygote had imported (with its own environment) before the fork
    assert ("Starting worker group" in log or "starting workers for entrypoint" in log) is shown, log[-3000:]


def test_kill_workers_of_a_forked_agent_crashes_only_its_worker_and_torchrun_restarts_it(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    agent = _agent(tmp_path, etcd_server, {"MODE": "sleep"}, max_restarts=1)
    agents.append(agent)
    assert wait_until(lambda: len(_records(tmp_path)) == 1, 60), agent.log()
    first = _records(tmp_path)[0]["pid"]
    agent.kill_workers()
    assert wait_until(lambda: len(_records(tmp_path)) == 2, 60), agent.log()
    assert process_stat(first) is None and agent.process is not None and agent.process.poll() is None
    assert _records(tmp_path)[1]["restart"] == 1 and _records(tmp_path)[1]["launcher"] == agent.agent_pid


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_kill_tree_of_a_forked_agent_ends_the_client_torchrun_and_the_worker(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent], sig: signal.Signals
) -> None:
    agent = _agent(tmp_path, etcd_server, {"MODE": "sleep"}, max_restarts=3)
    agents.append(agent)
    assert wait_until(lambda: len(_records(tmp_path)) == 1, 60), agent.log()
    torchrun, worker = agent.agent_pid, _records(tmp_path)[0]["pid"]
    assert torchrun is not None
    agent.kill_tree(sig)
    code = agent.wait(timeout=30)
    assert wait_until(lambda: process_stat(torchrun) is None and process_stat(worker) is None, 20)
    assert len(_records(tmp_path)) == 1, "torchrun restarted nothing: it was told to stop"
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
    else:  # torchrun handled the signal itself, once (the client, frozen meanwhile, did not forward a second)
        assert code != 0 and agent.log().count("death signal") == 1, agent.log()[-3000:]
        assert re.search(r"Received (Signals\.SIGTERM|15) death signal", agent.log()), agent.log()[-3000:]
