"""The loop's documented forms run as they are: each Python block of docs/open-loop.md, as ``python`` (a world of
one, no torchrun), in a fresh directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "open-loop.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_doc_has_the_three_forms() -> None:
    blocks = _blocks()
    assert len(blocks) == 3
    assert "trainer.batches(" in blocks[0] and "trainer.steps(" in blocks[1] and "sampler.advance()" in blocks[2]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("index", [0, 1, 2], ids=["short", "own-step", "sampler-alone"])
def test_each_documented_form_runs_as_a_plain_python_script(index: int, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_blocks()[index])
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
    }
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stderr[-3000:]
