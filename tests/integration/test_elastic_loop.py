"""The elastic loop under real torchrun on real etcd: resume, LR policy on resize, exactly-once data."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from elastic.contract.lr import LRRule
from elastic.etcd import EtcdClient
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.torchrun import TorchrunAgent, torchrun_command
from elastic.testing.wait import wait_until
from tests.integration.scenarios import assert_converges, assert_resizes_4_2_3
from tests.integration.scenarios import start_agent as _agent
from tests.integration.training_records import agent_logs, assert_exits_ok, max_step, read_records

WORKER = str(Path(__file__).resolve().parents[2] / "elastic" / "testing" / "train_worker.py")


@pytest.mark.timeout(300)
def test_kill_and_resume_at_same_world_gives_bit_identical_params(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    common = ["--epochs", "2", "--save-every", "5", "--samples", "384", "--batch", "8", "--lr-rule", "none"]
    ref = tmp_path / "ref"
    a = _agent(
        tmp_path,
        "ref",
        etcd_server,
        f"ref-{uuid.uuid4().hex[:6]}",
        "1",
        2,
        [*common, "--checkpoint-url", str(tmp_path / "ck-ref"), "--record", str(ref)],
    )
    agents.append(a)
    assert_exits_ok(a, agents, 200)

    run = tmp_path / "run"
    b = _agent(
        tmp_path,
        "run",
        etcd_server,
        f"run-{uuid.uuid4().hex[:6]}",
        "1",
        2,
        [*common, "--checkpoint-url", str(tmp_path / "ck-run"), "--record", str(run), "--step-sleep", "0.05"],
    )
    agents.append(b)
    assert wait_until(lambda: max_step(run) >= 13, 120), agent_logs(agents)
    b.kill_workers()  # SIGKILL every worker mid-run: torchrun restarts the group from the last snapshot
    assert_exits_ok(b, agents, 200)

    restarts = {r["restart"] for r in read_records(run)}
    assert restarts == {0, 1}, "the group was killed once and restarted once"
    ref_params = torch.load(ref / "final_params.pt")
    run_params = torch.load(run / "final_params.pt")
    assert ref_params.keys() == run_params.keys()
    for k in ref_params:
        assert torch.equal(ref_params[k], run_params[k]), k


# linear and fixed-global-batch in the default suite: the two batch plans (the global batch growing with the world, or
# kept by accumulation). none and sqrt take linear's path through the trainer with other factors, whose values
# test_lr.py checks per rule (test_lr_after_4_2_3_workers_is_the_rules_value_from_the_reference): ``-m slow``.
_SAME_PATH_AS_LINEAR = (LRRule.NONE, LRRule.SQRT)


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "rule", [pytest.param(r.value, marks=[pytest.mark.slow] if r in _SAME_PATH_AS_LINEAR else []) for r in LRRule]
)
def test_resizes_4_2_3_keep_lr_policy_exact_and_every_sample_once_per_epoch(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent], rule: str
) -> None:
    assert_resizes_4_2_3(tmp_path, etcd_server, agents, rule, samples=480, epochs=4, step_sleep=0.04)


@pytest.mark.timeout(600)
def test_resized_run_converges_within_2_percent_of_fixed_world_small_form(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    assert_converges(tmp_path, etcd_server, agents, "fixed-global-batch", seed=0)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("rule", ["fixed-global-batch", "linear"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_resized_run_converges_within_2_percent_of_fixed_world_3_seeds(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent], rule: str, seed: int
) -> None:
    assert_converges(tmp_path, etcd_server, agents, rule, seed)


@pytest.mark.timeout(300)
def test_sigterm_of_one_node_saves_synchronously_and_loses_no_step(
    tmp_path: Path, etcd_server: LocalEtcdCluster, agents: list[TorchrunAgent]
) -> None:
    """A preemption notice (SIGTERM to a node's agent, forwarded to its workers): every rank saves that step,
    the signalled node leaves, the survivor re-forms and resumes from exactly that step."""
    import signal

    rec = tmp_path / "rec"
    run_id = f"term-{uuid.uuid4().hex[:6]}"
    pace = tmp_path / "pace"  # the steps sleep until the survivor resumed; the rest run at full speed
    pace.touch()
    args = [
        "--epochs",
        "3",
        "--samples",
        "480",
        "--batch",
        "4",
        "--lr-rule",
        "linear",
        "--base-world",
        "2",
        "--save-every",
        "1000",
        "--step-sleep",
        "0.05",
        "--pace-file",
        str(pace),
        "--checkpoint-url",
        str(tmp_path / "ck"),
        "--record",
        str(rec),
    ]
    a = _agent(tmp_path, "a", etcd_server, run_id, "1:2", 1, args)
    b = _agent(tmp_path, "b", etcd_server, run_id, "1:2", 1, args)
    agents += [a, b]
    assert wait_until(lambda: max_step(rec) >= 15, 150), agent_logs(agents)
    b.kill_tree(signal.SIGTERM)
    assert wait_until(lambda: any(r["world"] == 1 for r in read_records(rec)), 120), agent_logs(agents)
    pace.unlink()
    assert_exits_ok(a, agents, 200)

    records = read_records(rec)
    before = [r for r in records if r["world"] == 2]
    after = [r for r in records if r["world"] == 1]
    last_before = max(r["step"] for r in before)
    first_after = min(r["step"] for r in after)
    assert first_after == last_before + 1, f"lost steps: resumed at {first_after - 1}, had reached {last_before}"
    snapshots = sorted(p.name for p in (tmp_path / "ck").glob("step-*"))
    assert f"step-{last_before:012d}" in snapshots, snapshots  # written on the notice (interval is 1000)


# solo: in two fresh-clone runs, under the parallel run's load on the shared etcd, the last report lacked the snapshot
# (step 16, checkpoint null) and the test passed when run again alone; the cause is not found yet (the session's note)
@pytest.mark.solo
@pytest.mark.timeout(240)
def test_the_snapshot_written_on_sigterm_is_reported_to_the_service_before_the_worker_exits(
    tmp_path: Path, etcd_server: LocalEtcdCluster, etcd_client: EtcdClient, agents: list[TorchrunAgent]
) -> None:
    """Slurm's scancel, a walltime or a preemption: the worker saves the step it is at, then exits 143. Before, the
    step's progress report (which names that snapshot) was published after the exit was raised, so never: the
    controller's status kept the snapshot before it (issue 50)."""
    import json
    import signal

    from elastic.contract.env import ETCD_ENDPOINTS, JobEnv
    from elastic.contract.lr import LRPolicy

    key = f"/etrain-{uuid.uuid4().hex[:6]}/progress/job-1"
    job = JobEnv(
        job_name="job",
        generation=1,
        node_name="n1",
        progress_key=key,
        lr_policy=LRPolicy(LRRule.LINEAR, 0.05, 1, 4),
        min_nodes=1,
        max_nodes=1,
    )
    rec = tmp_path / "rec"
    args = [
        "--epochs",
        "50",
        "--samples",
        "480",
        "--batch",
        "4",
        "--lr-rule",
        "linear",
        "--base-world",
        "1",
        "--save-every",
        "1000",
        "--step-sleep",
        "0.05",
        "--checkpoint-url",
        str(tmp_path / "ck"),
        "--record",
        str(rec),
    ]
    cmd = torchrun_command(
        backend="etcd-v3",
        endpoint=etcd_server.endpoints,
        run_id=f"term-{uuid.uuid4().hex[:6]}",
        nnodes="1",
        nproc=1,
        rdzv_conf={"last_call_timeout": 1},
        max_restarts=0,
        script=WORKER,
        script_args=args,
        prefork=True,
    )
    env = {"LOGLEVEL": "WARNING", **job.to_environ(), ETCD_ENDPOINTS: etcd_server.endpoints}
    agent = TorchrunAgent(cmd, tmp_path / "a.log", env=env, forked=True).start()
    agents.append(agent)
    assert wait_until(lambda: max_step(rec) >= 15, 150), agent_logs(agents)
    agent.kill_tree(signal.SIGTERM)
    agent.wait(120)
    snapshots = sorted(int(p.name.removeprefix("step-")) for p in (tmp_path / "ck").glob("step-*"))
    assert snapshots, agent_logs(agents)  # written on the notice (the interval is 1000 steps)
    kv, _ = etcd_client.get(key)
    assert kv is not None, agent_logs(agents)
    assert json.loads(kv.value)["checkpoint_step"] == snapshots[-1], (kv.value, snapshots)
