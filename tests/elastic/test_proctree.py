"""elastic.proctree's exec wrapper: the command it runs gets the parent-death signal, in the same process, with
no Python code run between fork and exec. Real processes: a Python parent that starts ``sleep`` through the wrapper
and is then SIGKILLed, as a node agent can be."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.proctree import alive, exec_with_parent_death_signal, process_stat
from elastic.testing.wait import wait_until

pytestmark = pytest.mark.timeout(60)

#: a parent that starts ``sleep 300`` through the wrapper (argv[1]: the signal), prints its pid, then waits
PARENT = """
import subprocess, sys
from elastic.proctree import exec_with_parent_death_signal
p = subprocess.Popen(exec_with_parent_death_signal(["sleep", "300"], int(sys.argv[1])))
print(p.pid, flush=True)
p.wait()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_command_becomes_the_started_process_and_gets_its_signal_when_the_parent_is_killed(sig: int) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(int(sig))],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        # the wrapper exec'd the command: the same pid runs sleep, a child of the parent
        assert wait_until(lambda: Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x00300\x00", 10)
        stat = process_stat(pid)
        assert stat is not None and stat[0] == parent.pid
        parent.kill()
        parent.wait()
        assert wait_until(lambda: not alive(pid, stat[1]), 10), "sleep outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait()


def test_a_command_whose_parent_is_already_gone_is_not_run(tmp_path: Path) -> None:
    # the parent named to the wrapper is not the process that starts it: as if the agent died before the signal
    # was armed (the command would then outlive it); the wrapper stops itself instead of running the command
    marker = tmp_path / "ran"
    argv = exec_with_parent_death_signal(["touch", str(marker)], signal.SIGTERM)
    pid_at = argv.index(str(os.getpid()))
    argv[pid_at] = "1"
    done = subprocess.run(argv, timeout=30)
    assert done.returncode == -signal.SIGTERM and not marker.exists()


def test_a_missing_executable_is_refused_before_anything_starts_and_an_exec_failure_exits_127(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-program"):
        exec_with_parent_death_signal(["no-such-program"], signal.SIGTERM)
    with pytest.raises(ValueError):
        exec_with_parent_death_signal([], signal.SIGTERM)
    script = tmp_path / "script"
    script.write_text("#!/no/such/interpreter\n")
    script.chmod(0o755)
    done = subprocess.run(
        exec_with_parent_death_signal([str(script)], signal.SIGTERM), capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 127 and f"cannot run {script}" in done.stderr, done.stderr


def test_the_command_gets_its_arguments_and_environment_as_given() -> None:
    argv = exec_with_parent_death_signal(
        [sys.executable, "-c", "import os, sys; print(sys.argv[1:], os.environ['X'])", "a b", "--c"], signal.SIGTERM
    )
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "X": "y"}, timeout=30)
    assert done.returncode == 0 and done.stdout == "['a b', '--c'] y\n", done.stderr
