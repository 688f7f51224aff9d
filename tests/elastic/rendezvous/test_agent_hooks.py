"""Agent start hooks are found through their entry-point group; a failing hook never stops the agent."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from elastic.rendezvous.agent_hooks import GROUP, run_agent_start_hooks


def _install(site: Path, module: str, source: str, hooks: dict[str, str]) -> None:
    """A real installed distribution (dist-info with entry points) in ``site``."""
    (site / f"{module}.py").write_text(source)
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n" + "".join(f"{k} = {v}\n" for k, v in hooks.items()))


def test_hooks_run_with_the_agent_command_line_and_a_failing_one_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    seen = tmp_path / "seen.txt"
    source = f"def record(argv):\n    open({str(seen)!r}, 'w').write(' '.join(argv))\n\ndef broken(argv):\n    1 / 0\n"
    _install(
        tmp_path,
        "etrain_test_hooks",
        source,
        {"a-record": "etrain_test_hooks:record", "b-broken": "etrain_test_hooks:broken"},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        ran = run_agent_start_hooks(["torchrun", "--nnodes=2", "train.py"])
    assert "a-record" in ran and "b-broken" not in ran
    assert "prefork" in ran  # the project's own hook (pyproject.toml), a no-op for this command line
    assert seen.read_text() == "torchrun --nnodes=2 train.py"
    assert any("b-broken" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)
