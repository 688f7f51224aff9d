"""elastic.interpreter: the collector paused while loading, what was loaded frozen, the exit's pass skipped."""

from __future__ import annotations

import gc
import importlib
import subprocess
import sys
import textwrap

import pytest

from elastic.interpreter import freeze_at_exit, loading

pytestmark = pytest.mark.timeout(60)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=50)


def test_loading_pauses_the_collector_freezes_what_it_loaded_and_restores_the_collector() -> None:
    out = _run(
        """
        import gc
        from elastic.interpreter import loading
        before = gc.get_freeze_count()
        with loading():
            paused = not gc.isenabled()
            import json, decimal  # anything not loaded yet
            kept = [[i] for i in range(1000)]
        print(paused, gc.isenabled(), gc.get_freeze_count() - before >= 1000)
        gc.disable()
        with loading():
            pass
        print(gc.isenabled())  # a paused collector stays paused
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True", "False"]


def test_a_failing_import_under_loading_propagates_and_the_collector_runs_again() -> None:
    was = gc.isenabled()
    with pytest.raises(ModuleNotFoundError), loading():
        importlib.import_module("elastic_no_such_module")
    assert gc.isenabled() == was


def test_freeze_at_exit_runs_atexit_handlers_and_flushes_but_skips_collecting_cycles_at_exit() -> None:
    # the trade documented in elastic.interpreter: handlers and buffered output survive, a cycle's finaliser
    # does not run at exit (without freeze_at_exit it does: the control run)
    script = """
        import atexit, sys
        from elastic.interpreter import freeze_at_exit
        class Cycle:
            def __del__(self):
                print("cycle finalised", flush=True)
        a = Cycle(); a.self = a; del a
        atexit.register(print, "atexit ran")
        sys.stdout.write("buffered, not flushed")
        {freeze}
        """
    frozen = _run(script.format(freeze="freeze_at_exit(); freeze_at_exit()"))  # idempotent
    control = _run(script.format(freeze=""))
    assert frozen.returncode == 0 and control.returncode == 0, (frozen.stderr, control.stderr)
    assert "atexit ran" in frozen.stdout and "buffered, not flushed" in frozen.stdout, frozen.stdout
    assert "cycle finalised" not in frozen.stdout, frozen.stdout
    assert "cycle finalised" in control.stdout, control.stdout


def test_the_torchrun_entry_point_makes_the_agents_exit_skip_the_collectors_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from elastic import interpreter
    from elastic.rendezvous import entry

    monkeypatch.setattr(interpreter, "_registered", False)
    with pytest.raises(AttributeError):  # not a RendezvousParameters: refused, after the registration
        entry.create_handler(None)
    assert interpreter._registered
    freeze_at_exit()  # registered already: nothing more (pytest's own exit then skips its last collection)
    assert interpreter._registered
