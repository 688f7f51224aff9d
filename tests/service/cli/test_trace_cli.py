"""``etrain trace JOB [-o FILE]`` against a live controller: the file (or stdout) is a valid Chrome trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.cli.main import main
from service.client import ApiClient
from service.core.trace import validate_trace
from tests.service.conftest import ADMIN, READER


def _token_file(tmp_path: Path, token: str) -> list[str]:
    path = tmp_path / f"token-{token}"
    path.write_text(token + "\n")
    return ["--token-file", str(path)]


@pytest.mark.timeout(60)
def test_trace_command_writes_a_valid_trace_to_a_file_or_stdout_and_names_an_unknown_job(
    live_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with ApiClient(live_server, ADMIN) as api:  # no agents: the job stays pending
        job_id = api.submit({"name": "traced", "entrypoint": "train.py"})["id"]
    common = ["--server", live_server, *_token_file(tmp_path, READER)]
    out = tmp_path / "job.json"
    assert main(["trace", job_id, "-o", str(out), *common]) == 0
    assert f"written to {out}" in capsys.readouterr().err
    trace = json.loads(out.read_text())
    assert validate_trace(trace) == []
    assert trace["metadata"]["job_id"] == job_id and trace["metadata"]["state"] == "pending"
    [pending] = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert pending["name"] == "pending" and pending["args"]["ongoing"] is True

    assert main(["trace", job_id, *common]) == 0  # stdout
    assert validate_trace(json.loads(capsys.readouterr().out)) == []

    assert main(["trace", "nope-00000000", *common]) == 3
    assert "HTTP 404" in capsys.readouterr().err
    assert main(["trace", job_id, "-o", str(tmp_path / "no-such-dir" / "x.json"), *common]) == 2
    assert "cannot write" in capsys.readouterr().err
