"""The ``etrain`` CLI: start-up errors are one line with exit code 2; client commands against a live API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from elastic import compat
from elastic.testing.etcd_server import free_port
from elastic.testing.wait import wait_for
from service.cli.main import _parser, main
from service.core.view import Quotas
from tests.service.conftest import ADMIN, READER

pytestmark = pytest.mark.timeout(60)
_ROOT = Path(__file__).resolve().parents[3]


def _etrain(*args: str, timeout: float = 30) -> tuple[int, str, str, float]:
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    for name in list(env):
        if name.startswith("ETRAIN_"):
            del env[name]
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started


@pytest.mark.parametrize("command", [["controller", "--host", "127.0.0.1"], ["agent", "--node-name", "n1"]])
def test_unreachable_etcd_is_one_line_and_exit_2_within_the_connect_timeout(command: list[str]) -> None:
    port = free_port()  # nobody listens there
    code, _out, err, took = _etrain(*command, "--etcd", f"127.0.0.1:{port}", "--etcd-connect-timeout", "1", timeout=90)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and lines[0].startswith("etrain: ")
    # 1 s connect timeout plus interpreter start-up (2 s here idle, 15 s seen with the suite in parallel on two
    # cores); a client that kept retrying would never return
    assert took < 40


def test_bad_tokens_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(yaml.safe_dump({"tokens": [{"token": "x" * 20, "role": "root"}]}))
    code, _, err, _ = _etrain("controller", "--etcd", "127.0.0.1:1", "--tokens-file", str(tokens))
    assert code == 2 and err.strip().count("\n") == 0 and "tokens[0].role must be 'admin', 'user' or 'read'" in err


def test_missing_endpoints_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err, _ = _etrain("controller")
    assert code == 2 and "--etcd" in err


def test_bad_etcd_auth_settings_are_one_line_naming_them(tmp_path: Path) -> None:
    code, _, err, _ = _etrain("controller", "--etcd", "127.0.0.1:1", "--etcd-user", "u")
    assert code == 2 and err.strip() == "etrain: --etcd-user needs --etcd-password-file"
    missing = tmp_path / "missing"
    code, _, err, _ = _etrain(
        "controller",
        "--host",
        "127.0.0.1",
        "--etcd",
        "127.0.0.1:1",
        "--etcd-user",
        "u",
        "--etcd-password-file",
        str(missing),
    )
    assert code == 2 and err.strip().count("\n") == 0
    assert f"etcd settings: cannot read the etcd password file {missing}" in err
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    code, _, err, _ = _etrain(
        "controller",
        "--host",
        "127.0.0.1",
        "--etcd",
        "127.0.0.1:1",
        "--etcd-user",
        "u",
        "--etcd-password-file",
        str(pw),
    )
    assert code == 2 and "need TLS" in err and "s3cret" not in err


def _token_file(tmp_path: Path, token: str) -> list[str]:
    path = tmp_path / f"token-{token}"
    path.write_text(token + "\n")
    return ["--token-file", str(path)]


def test_a_token_on_the_command_line_is_refused_and_the_environment_serves(
    live_server: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["list", "--server", live_server, "--token", ADMIN])
    assert exit_.value.code == 2 and "process list" in capsys.readouterr().err
    monkeypatch.setenv("ETRAIN_TOKEN", READER)
    assert main(["list", "--server", live_server]) == 0


def test_controller_refuses_an_open_api_on_a_non_loopback_address_unless_told_insecure() -> None:
    port = str(free_port())
    code, _, err, _ = _etrain("controller", "--etcd", f"127.0.0.1:{port}", "--host", "0.0.0.0")
    assert code == 2 and "refusing to serve the API on 0.0.0.0 without --tokens-file" in err
    code, _, err, _ = _etrain(
        "controller", "--etcd", f"127.0.0.1:{port}", "--host", "0.0.0.0", "--insecure", "--etcd-connect-timeout", "0.5"
    )
    assert code == 2 and "refusing" not in err and "etcd" in err  # past the check: etcd is what is missing


def test_client_commands_against_a_live_controller(
    live_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--server", live_server, *_token_file(tmp_path, ADMIN)]
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump({"name": "cli-job", "entrypoint": "train.py", "min_nodes": 1}))
    assert main(["submit", str(job_file), *common]) == 0
    job_id = capsys.readouterr().out.strip()
    assert job_id.startswith("cli-job-")

    assert main(["list", *common]) == 0
    listing = capsys.readouterr().out
    assert listing.splitlines()[0].split()[:3] == ["ID", "STATE", "NODES"] and job_id in listing

    assert main(["status", job_id, "--server", live_server, *_token_file(tmp_path, READER)]) == 0
    status = capsys.readouterr().out
    assert f"job        {job_id}  (cli-job)" in status and "world size now -" in status

    assert main(["cancel", job_id, *common]) == 0
    assert "cancel requested" in capsys.readouterr().out
    assert main(["follow", job_id, *common]) == 1  # cancelled: not a success
    followed = capsys.readouterr().out
    assert "pending -> cancelled" in followed and "state      cancelled" in followed

    assert main(["events", job_id, *common]) == 0
    events = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in events] == ["submitted", "cancel_requested", "state"]

    assert main(["nodes", *common]) == 0
    assert capsys.readouterr().out.split() == ["NODE", "MODE", "CAPACITY", "FREE", "JOBS", "HOST", "REGISTERED"]


def test_client_errors_name_the_http_status(
    live_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["list", "--server", live_server, *_token_file(tmp_path, "wrong")]) == 3
    assert "HTTP 401" in capsys.readouterr().err
    assert main(["status", "nope-1", "--server", live_server, *_token_file(tmp_path, READER)]) == 3
    assert "HTTP 404" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmin_nodes: 0\n")
    assert main(["submit", str(bad), "--server", live_server, *_token_file(tmp_path, ADMIN)]) == 3
    err = capsys.readouterr().err
    assert "HTTP 422" in err and "min_nodes" in err and "entrypoint" in err
    assert main(["list", "--server", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "cannot reach the controller" in capsys.readouterr().err


def test_submit_reads_json_too_and_env_supplies_server_and_token(
    live_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ETRAIN_SERVER", live_server)
    monkeypatch.setenv("ETRAIN_TOKEN", ADMIN)
    job_file = tmp_path / "job.json"
    job_file.write_text('{"name": "json-job", "entrypoint": "t.py"}')
    assert main(["submit", str(job_file)]) == 0
    job_id = capsys.readouterr().out.strip()
    wait_for(lambda: main(["status", job_id]) == 0)
    assert "json-job" in capsys.readouterr().out


def test_agent_socket_ifname_comes_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ETRAIN_SOCKET_IFNAME", raising=False)
    assert _parser().parse_args(["agent", "--socket-ifname", "ib0"]).socket_ifname == "ib0"
    assert _parser().parse_args(["agent"]).socket_ifname is None
    monkeypatch.setenv("ETRAIN_SOCKET_IFNAME", "eth1")
    assert _parser().parse_args(["agent"]).socket_ifname == "eth1"


def test_the_node_agent_on_an_unsupported_torch_refuses_to_start_with_one_line() -> None:
    prelude = "import torch\ntorch.__version__ = '2.16.0'\n"  # what this interpreter's torch reports
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            prelude
            + (
                "from service.cli.main import main\n"
                "raise SystemExit(main(['agent', '--node-name', 'n1', '--etcd', '127.0.0.1:9']))\n"
            ),
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"etrain: agent: elastic-train supports {compat.TORCH_REQUIREMENT}; the installed torch is 2.16.0: "
        f"install a torch in that range (pip install '{compat.TORCH_REQUIREMENT}')"
    ], proc.stderr


def test_node_cordon_drain_uncordon_and_the_mode_column_of_nodes(
    live_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--server", live_server, *_token_file(tmp_path, ADMIN)]
    assert main(["node", "cordon", "gpu-9", "--reason", "bad fan", *common]) == 0
    out = capsys.readouterr().out
    assert out.startswith("node gpu-9 cordoned (no agent of this name is registered now")
    assert main(["nodes", *common]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split()[:3] == ["NODE", "MODE", "CAPACITY"]
    assert rows[1].split()[:5] == ["gpu-9", "cordoned", "(not", "live)", "-"]
    assert main(["node", "drain", "gpu-9", *common]) == 0
    assert "node gpu-9 draining (no active job on it: drained)" in capsys.readouterr().out
    assert main(["node", "drain", "gpu-9", "--json", *common]) == 0
    node = json.loads(capsys.readouterr().out)
    assert (node["mode"], node["changed"], node["live"]) == ("drained", False, False)
    assert main(["node", "uncordon", "gpu-9", *common]) == 0
    assert capsys.readouterr().out.startswith("node gpu-9 uncordoned (was draining)")
    assert main(["node", "uncordon", "gpu-9", *common]) == 0
    assert "had no cordon or drain request" in capsys.readouterr().out
    assert main(["node", "drain", "gpu-9", "--server", live_server, *_token_file(tmp_path, READER)]) == 3
    assert "HTTP 403" in capsys.readouterr().err
    assert main(["node", "cordon", "bad_", *common]) == 3
    assert "HTTP 422" in capsys.readouterr().err


def test_resize_changes_a_jobs_bounds_and_refuses_bad_ones(
    live_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--server", live_server, *_token_file(tmp_path, ADMIN)]
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump({"name": "grow", "entrypoint": "train.py", "min_nodes": 1, "max_nodes": 2}))
    assert main(["submit", str(job_file), *common]) == 0
    job_id = capsys.readouterr().out.strip()
    assert main(["resize", job_id, "--max", "4", *common]) == 0
    assert capsys.readouterr().out.startswith(f"{job_id}: min_nodes 1, max_nodes 4 (state ")
    assert main(["resize", job_id, "--min", "2", "--max", "3", *common]) == 0
    assert f"{job_id}: min_nodes 2, max_nodes 3" in capsys.readouterr().out
    assert main(["events", job_id, *common]) == 0
    assert "min_nodes 1 -> 2, max_nodes 4 -> 3 (by alice)" in capsys.readouterr().out
    assert main(["resize", job_id, *common]) == 2
    assert "give --min, --max or both" in capsys.readouterr().err
    assert main(["resize", job_id, "--min", "5", *common]) == 3
    err = capsys.readouterr().err
    assert "HTTP 422" in err and "max_nodes" in err
    assert main(["resize", "nope-1", "--max", "2", *common]) == 3
    assert "HTTP 404" in capsys.readouterr().err


def test_controller_quotas_come_from_the_flag_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uvicorn

    import service.cli.servers as cli

    started: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **_kw: started.append(app))
    monkeypatch.setattr(cli, "_check_etcd", lambda _options: None)
    quotas = tmp_path / "quotas.yaml"
    quotas.write_text(yaml.safe_dump({"users": {"alice": 4}, "queues": {"team-a": 6}, "default_user": 8}))
    base = ["controller", "--etcd", "127.0.0.1:1", "--host", "127.0.0.1"]
    assert main([*base, "--quotas", str(quotas)]) == 0
    expected = Quotas(users={"alice": 4}, queues={"team-a": 6}, default_user=8)
    assert started[-1].state.settings.reconcile.quotas == expected  # type: ignore[attr-defined]
    monkeypatch.setenv("ETRAIN_QUOTAS_FILE", str(quotas))
    assert main(base) == 0
    assert started[-1].state.settings.reconcile.quotas == expected  # type: ignore[attr-defined]
    monkeypatch.delenv("ETRAIN_QUOTAS_FILE")
    assert main(base) == 0
    assert started[-1].state.settings.reconcile.quotas == Quotas()  # type: ignore[attr-defined]


def test_bad_quotas_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    quotas = tmp_path / "quotas.yaml"
    quotas.write_text(yaml.safe_dump({"users": {"alice": -1}}))
    code, _, err, _ = _etrain("controller", "--etcd", "127.0.0.1:1", "--host", "127.0.0.1", "--quotas", str(quotas))
    assert code == 2 and err.strip().count("\n") == 0
    assert "users.alice must be a whole number of nodes >= 0" in err


def test_a_reader_that_leaves_the_pipe_gets_no_traceback_and_exit_141(live_server: str) -> None:
    """``etrain list | head -1`` with more lines than head reads: before, a ``BrokenPipeError`` traceback followed
    (issue 50). The pipe here is closed before etrain writes anything, so its first write meets it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETRAIN_")}
    env.update(PYTHONPATH=str(_ROOT), ETRAIN_TOKEN=ADMIN)
    read, write = os.pipe()
    os.close(read)  # the reader is gone
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "service.cli", "list", "--server", live_server],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=60,
        )
    finally:
        os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 141
