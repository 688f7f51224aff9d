"""The parallel run's hooks (``tests/parallel.py``), in a pytest of their own: hang guards scale in xdist workers,
and the controller lists the tests that failed (``scripts/test.sh`` runs them again, alone)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel import FAILED_OUT_ENV, TIMEOUT_SCALE, IdleMeter, timeout_scale

REPO = Path(__file__).resolve().parents[1]

INNER = """
import pytest

@pytest.mark.timeout(10)
def test_marked(request):
    mark = request.node.get_closest_marker("timeout")
    assert float(mark.args[0]) == {marked}, mark

def test_unmarked(request):
    mark = request.node.get_closest_marker("timeout")
    limit = None if mark is None else float(mark.args[0])
    assert limit == {unmarked}, mark
"""


def _pytest(tmp_path: Path, *args: str, **env_extra: str) -> subprocess.CompletedProcess[str]:
    """A pytest in ``tmp_path`` with this suite's hooks (and none of this run's xdist or hook settings)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_XDIST", "PYTEST_TIMEOUT_SCALE", FAILED_OUT_ENV))
    }
    env.update(PYTHONPATH=str(REPO), **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.parallel", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _inner(tmp_path: Path, workers: int, marked: float, unmarked: float | None, scale: str) -> None:
    (tmp_path / "test_inner.py").write_text(INNER.format(marked=marked, unmarked=unmarked))
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 40\n")
    proc = _pytest(tmp_path, "-n", str(workers), "test_inner.py", PYTEST_TIMEOUT_SCALE=scale)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.timeout(150)
def test_in_an_xdist_worker_marked_and_ini_timeouts_are_scaled_and_serially_they_are_not(tmp_path: Path) -> None:
    _inner(tmp_path, 0, marked=10.0, unmarked=None, scale="5")  # serial: the limits as written (ini: the plugin's)
    _inner(tmp_path, 1, marked=50.0, unmarked=200.0, scale="5")


def test_the_factor_is_the_default_in_a_worker_unless_set_and_never_below_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_TIMEOUT_SCALE", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert timeout_scale() == 1.0
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    assert timeout_scale() == TIMEOUT_SCALE == 3.0
    for raw, factor in (("2.5", 2.5), ("0.5", 1.0), ("many", TIMEOUT_SCALE)):
        monkeypatch.setenv("PYTEST_TIMEOUT_SCALE", raw)
        assert timeout_scale() == factor, raw


@pytest.mark.timeout(150)
def test_a_parallel_run_writes_the_ids_of_its_failed_and_errored_tests_without_their_group(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(
        "import pytest\n\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('setup')\n\n"
        "@pytest.mark.xdist_group('g')\ndef test_fails():\n    assert 1 == 2\n\n"
        "def test_errors(broken):\n    pass\n\n"
        "@pytest.mark.parametrize('x', [1, 2])\ndef test_passes(x):\n    assert x\n"
    )
    out = tmp_path / "failed.txt"
    proc = _pytest(tmp_path, "-n", "2", "--dist", "loadgroup", "test_inner.py", **{FAILED_OUT_ENV: str(out)})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(out.read_text().splitlines()) == ["test_inner.py::test_errors", "test_inner.py::test_fails"]


def test_the_idle_meter_answers_once_its_window_is_covered_and_starts_over_when_reset() -> None:
    now = [0.0]
    times = [(0.0, 0.0)]  # (busy, all) CPU seconds, two cores: all grows by 2 per second
    meter = IdleMeter(window=10.0, read=lambda: times[0], clock=lambda: now[0])

    def at(t: float, busy: float) -> float | None:
        now[0], times[0] = t, (busy, 2 * t)
        return meter.idle()

    assert at(0, 0) is None and at(5, 5) is None  # not 10 s of samples yet
    assert at(10, 10) == pytest.approx(0.5)  # 10 busy of 20 CPU seconds
    assert at(20, 30) == pytest.approx(0.0)  # the last 10 s: both cores busy (older samples dropped)
    assert at(25, 32) == pytest.approx(1 - 22 / 30)  # since t=10, the newest sample at least 10 s old
    meter.reset()
    assert at(26, 32) is None and at(36, 32) == pytest.approx(1.0)
    unreadable = IdleMeter(read=lambda: None)
    assert unreadable.idle() is None
