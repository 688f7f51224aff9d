"""The worker environment contract (elastic/contract/env.py): what the agent writes is what the workers read."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from elastic.contract import env as contract
from elastic.contract.env import JobEnv, TorchrunEnv, WorkerEnv, WorkerEnvError, parse_lr_policy
from elastic.contract.lr import LRPolicy, LRRule
from elastic.etcd.config import EtcdOptions

_JOB = JobEnv(
    job_name="demo",
    generation=3,
    node_name="n1",
    progress_key="/etrain/progress/j-1",
    lr_policy=LRPolicy(LRRule.FIXED_GLOBAL_BATCH, 0.05, 2, 16, warmup_steps=4),
    min_nodes=2,
    max_nodes=4,
)


def _full(tmp_path: Path) -> WorkerEnv:
    etcd = EtcdOptions(
        "h1:2379,h2:2379",
        ca_cert=str(tmp_path / "ca.pem"),
        cert=str(tmp_path / "c.pem"),
        cert_key=str(tmp_path / "k.pem"),
        user="train",
        password_file=str(tmp_path / "pw"),
    )
    return WorkerEnv(
        job=_JOB,
        job_id="j-1",
        checkpoint_url="file:///ck/j-1",
        local_snapshot_every=2,
        etcd=etcd,
        checkpoint_key=bytes(range(32)),
    )


def test_what_the_writer_writes_the_parser_reads_back(tmp_path: Path) -> None:
    written = _full(tmp_path)
    environ = written.to_environ()
    # every variable of the contract, each once (the key itself, or the file that holds it: one of the two)
    assert set(environ) == contract.AGENT_WRITTEN - {contract.CHECKPOINT_KEY_FILE}
    assert WorkerEnv.from_environ(environ) == written
    assert WorkerEnv.from_environ({**environ, "PATH": "/bin", contract.PREFORK: "0"}) == written


def test_a_checkpoint_key_in_a_file_is_read_from_it_and_never_written_to_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "checkpoint-key"
    key_file.write_text(bytes(range(32)).hex() + "\n")
    written = replace(_full(tmp_path), checkpoint_key_file=str(key_file))
    environ = written.to_environ()
    assert set(environ) == contract.AGENT_WRITTEN - {contract.CHECKPOINT_KEY}
    assert bytes(range(32)).hex() not in " ".join(environ.values())
    assert WorkerEnv.from_environ(environ) == written  # the key read back from the file
    key_file.unlink()
    with pytest.raises(WorkerEnvError, match="ETRAIN_CHECKPOINT_KEY_FILE: cannot read"):
        WorkerEnv.from_environ(environ)


def test_the_policy_travels_in_its_one_shape() -> None:
    raw = _JOB.to_environ()[contract.LR_POLICY]
    assert json.loads(raw) == _JOB.lr_policy.reference()  # the shape checkpoints store
    assert parse_lr_policy(raw) == _JOB.lr_policy


def test_outside_the_service_nothing_is_required() -> None:
    assert WorkerEnv.from_environ({}) == WorkerEnv()
    alone = WorkerEnv.from_environ(
        {contract.JOB_ID: "mine", contract.CHECKPOINT_URL: "/ck", contract.LOCAL_SNAPSHOT_EVERY: "0"}
    )
    assert alone == WorkerEnv(job=None, job_id="mine", checkpoint_url="/ck", local_snapshot_every=0, etcd=None)


def test_apply_replaces_inherited_values_and_keeps_others() -> None:
    env = {"PATH": "/bin", contract.JOB_ID: "stale", contract.CHECKPOINT_URL: "stale", contract.ETCD_USER: "x"}
    WorkerEnv(job=_JOB, job_id="j-1").apply(env)
    assert env[contract.JOB_ID] == "j-1" and env["PATH"] == "/bin"
    assert env[contract.NODE_NAME] == "n1" and contract.CHECKPOINT_URL not in env and contract.ETCD_USER not in env


def test_the_etcd_connection_builds_through_the_one_builder(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cret\n")
    etcd = WorkerEnv.from_environ(_full(tmp_path).to_environ()).etcd
    assert etcd is not None
    config = replace(etcd, op_timeout=timedelta(seconds=5)).config()
    assert (config.endpoints, config.user, config.password) == ((("h1", 2379), ("h2", 2379)), "train", "s3cret")
    assert config.op_timeout == timedelta(seconds=5)


def test_the_password_is_never_in_the_environment(tmp_path: Path) -> None:
    written = replace(_full(tmp_path), etcd=EtcdOptions("h:1", user="u", password="s3cret"))
    assert "s3cret" not in json.dumps(written.to_environ())


def _without(name: str) -> dict[str, str]:
    environ = WorkerEnv(job=_JOB).to_environ()
    del environ[name]
    return environ


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (_without(contract.GENERATION), "ETRAIN_GENERATION"),
        ({contract.NODE_NAME: "n1"}, "incomplete job service environment: ETRAIN_NODE_NAME set but not ETRAIN_JOB_N"),
        ({**_JOB.to_environ(), contract.GENERATION: "four"}, "ETRAIN_GENERATION must be a whole number, got 'four'"),
        ({**_JOB.to_environ(), contract.MAX_NODES: "2.5"}, "ETRAIN_MAX_NODES must be a whole number"),
        ({**_JOB.to_environ(), contract.LR_POLICY: "{"}, "ETRAIN_LR_POLICY is not an LR policy"),
        ({**_JOB.to_environ(), contract.LR_POLICY: '{"scaling": "sqrt"}'}, "ETRAIN_LR_POLICY has no 'rule'"),
        (
            {
                **_JOB.to_environ(),
                contract.LR_POLICY: '{"rule": "cubic", "base_lr": 1, "base_world_size": 1, "base_batch_per_worker": 1}',
            },
            "ETRAIN_LR_POLICY is not an LR",
        ),
        ({contract.LOCAL_SNAPSHOT_EVERY: "often"}, "ETRAIN_LOCAL_SNAPSHOT_EVERY must be a number of steps"),
        # a digit str.isdigit() accepts and int() refuses: it raised a plain ValueError (issue 48, L1's kin)
        ({contract.LOCAL_SNAPSHOT_EVERY: "\u00b2"}, "ETRAIN_LOCAL_SNAPSHOT_EVERY must be a number of steps"),
        ({contract.ETCD_USER: "u"}, "ETRAIN_ETCD_USER set without ETRAIN_ETCD_ENDPOINTS"),
    ],
)
def test_a_missing_or_invalid_value_is_one_error_naming_the_variable(environ: dict[str, str], message: str) -> None:
    with pytest.raises(WorkerEnvError, match=message) as info:
        WorkerEnv.from_environ(environ)
    assert "\n" not in str(info.value)


def test_a_checkpoint_key_that_is_not_hex_or_too_short_is_named() -> None:
    with pytest.raises(WorkerEnvError, match="ETRAIN_CHECKPOINT_KEY must be hex"):
        WorkerEnv.from_environ({contract.CHECKPOINT_KEY: "zz"})
    with pytest.raises(WorkerEnvError, match="at least 16 bytes"):
        WorkerEnv.from_environ({contract.CHECKPOINT_KEY: "abcd"})


# -- torchrun's own variables ------------------------------------------------------------------------------
def test_torchruns_variables_are_read_through_one_place() -> None:
    environ = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "2",
        "TORCHELASTIC_RESTART_COUNT": "3",
        "TORCHELASTIC_RUN_ID": "j-1-g4",
    }
    assert TorchrunEnv.from_environ(environ) == TorchrunEnv(
        rank=5, world_size=8, local_rank=1, local_world_size=2, group_rank=2, restart_count=3, run_id="j-1-g4"
    )


def test_outside_torchrun_the_world_is_one_worker() -> None:
    assert TorchrunEnv.from_environ({}) == TorchrunEnv(0, 1, 0, 1, 0, 0, None)
    assert TorchrunEnv.from_environ({"RANK": "", "TORCHELASTIC_RUN_ID": ""}) == TorchrunEnv()


def test_the_process_environment_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "7")
    torchrun = TorchrunEnv.from_environ()
    assert (torchrun.local_rank, torchrun.restart_count) == (3, 7)


@pytest.mark.parametrize(
    "name", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT"]
)
def test_a_malformed_integer_is_an_error_naming_the_variable(name: str) -> None:
    with pytest.raises(WorkerEnvError, match=f"{name} must be a whole number, got '1.5'"):
        TorchrunEnv.from_environ({name: "1.5"})
    assert issubclass(WorkerEnvError, ValueError)  # what int() raised before
