"""Running the suite in parallel with pytest-xdist (``scripts/test.sh`` passes ``-n``; see its header).

What runs where (with ``-n N``, which :func:`use_loadgroup` makes ``--dist loadgroup``; this module's scheduler
replaces xdist's):

- Units: as xdist's ``loadgroup`` defines them. Tests marked ``@pytest.mark.xdist_group(name)`` form one unit
  that runs on one worker in collection order (modules with module-scoped fixtures, or whose tests build on
  each other, carry such a mark); every other test is a unit of its own.
- Order: the longest units first (longest processing time first), from the serial wall times recorded in
  ``tests/durations.json``; a test missing there counts as :data:`DEFAULT_WALL` seconds (as a heavy one of
  30 s under :data:`HEAVY_PATHS`).
- Heavy units, :data:`HEAVY_CPU_S` CPU seconds or more (real torchrun jobs, service clusters, the chaos
  session: processes that each import torch and train), run on at most ``PYTEST_HEAVY_SLOTS`` workers at a
  time (default :data:`HEAVY_SLOTS`): on two cores, more training jobs at once starve each other and their
  progress deadlines fail. A worker running one is given only cheap units to go with it; the other workers
  run the light units (most of them wait on etcd, sockets or timers). Once those are gone, one more worker
  (up to ``PYTEST_HEAVY_SLOTS_MAX``, default one more than the slots) takes a heavy unit whenever the machine
  has been idle for :data:`EXTRA_SLOT_IDLE` of its CPU over the last :data:`IDLE_WINDOW_S` seconds (a fast
  machine left a quarter of it idle behind the two slots for the run's last four minutes); the rest wait for
  that (holding their last test), and stop when no heavy unit is left to take.

Each worker is a process of its own with its own session fixtures (etcd, the moto server, the browser) on
ports of its own (``ETRAIN_PORT_RANGE``, ``tests/conftest.py``) and under its own ``popen-gw<N>`` temporary
directory.

``--durations-out PATH`` writes a run's durations in ``tests/durations.json``'s format (per test: wall
seconds of setup + call + teardown, and the machine's busy CPU seconds meanwhile, :func:`_cpu_seconds`; tests
under 0.5 s of both are left out, but for those under :data:`HEAVY_PATHS`, which would count as heavy otherwise).
Refresh that file from a serial run after adding or changing slow tests::

    .venv/bin/python -m pytest -m "not slow" --durations-out tests/durations.json
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
DEFAULT_WALL = 0.1  # seconds: most tests take less
HEAVY_CPU_S = 5.0
#: two: on 2 cores (2026-11-26) two heavy units at once first slowed each other's scenarios past their timing (a
#: joiner arriving after the job's last step, a chaos job ending before its last fault: 7 failures in 20 min).
#: Those scenarios now wait for their joiner (``--hold-file``) and share one zygote per worker; with two slots
#: a fresh clone's suite took 20.4 min (2026-11-27, pytest), one slot leaves a core idle behind the chaos session
HEAVY_SLOTS = 2
RECORD_MIN_S = 0.5


def _strip_group(nodeid: str) -> str:
    """The test's own id: loadgroup appends ``@<group>`` to the ids of marked tests."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.rsplit("@", 1)[0]
    return nodeid


def load_durations(path: Path = DURATIONS) -> dict[str, tuple[float, float]]:
    """``{nodeid: (wall seconds, CPU seconds)}`` from ``path`` (empty when it is missing or unreadable)."""
    try:
        data = json.loads(path.read_text())
        return {str(k): (float(v[0]), float(v[1])) for k, v in data.items()}
    except (OSError, ValueError, TypeError, IndexError):
        return {}


#: where a test not in ``durations.json`` yet is taken for a heavy one (real torchrun jobs, service clusters, a real
#: Slurm running them: unrecorded, the Slurm tests once ran as light units beside two heavy ones, at twice their time)
HEAVY_PATHS = (
    "tests/integration/",
    "tests/chaos/",
    "tests/test_examples.py",
    "tests/examples/",
    "tests/deploy/test_slurm",
    "tests/integrations/",
)


def _unrecorded(nodeid: str) -> tuple[float, float]:
    """A test missing from ``durations.json``: light (:data:`DEFAULT_WALL`), unless it lives where real jobs
    run (:data:`HEAVY_PATHS`): then heavy and long, so that it never runs beside another heavy unit."""
    if nodeid.startswith(HEAVY_PATHS):
        return (30.0, HEAVY_CPU_S)
    return (DEFAULT_WALL, 0.0)


def heavy_slots() -> int:
    raw = os.environ.get("PYTEST_HEAVY_SLOTS", "")
    return max(1, int(raw)) if raw.isdigit() else HEAVY_SLOTS


def max_heavy_slots(slots: int) -> int:
    """``PYTEST_HEAVY_SLOTS_MAX`` (never below ``slots``), by default ``slots + 1``: how many workers may run heavy
    units at once when the machine has idle CPU and no light unit is left."""
    raw = os.environ.get("PYTEST_HEAVY_SLOTS_MAX", "")
    return max(slots, int(raw)) if raw.isdigit() else slots + 1


#: the share of the machine's CPU that must have been idle over :data:`IDLE_WINDOW_S` seconds before a heavy unit
#: beyond the slots starts (one heavy unit keeps about one core busy; on two cores this is 0.7 of one idle)
EXTRA_SLOT_IDLE = 0.35
IDLE_WINDOW_S = 15.0


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_times() -> tuple[float, float] | None:
    """``(busy, all)`` CPU seconds of the machine since boot (``/proc/stat``: user, nice, system, idle, iowait, irq,
    softirq, steal; idle and iowait are not busy), None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / _CLOCK_TICKS, sum(fields) / _CLOCK_TICKS


class IdleMeter:
    """The machine's idle share of CPU over the last ``window`` seconds, from samples taken when asked."""

    def __init__(
        self,
        window: float = IDLE_WINDOW_S,
        read: Callable[[], tuple[float, float] | None] = _cpu_times,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window, self._read, self._clock = window, read, clock
        self._samples: deque[tuple[float, float, float]] = deque()

    def idle(self) -> float | None:
        """Idle share (0..1) since the newest sample at least ``window`` old; None until one is (or unreadable)."""
        now, times = self._clock(), self._read()
        if times is None:
            return None
        self._samples.append((now, *times))
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.window:
            self._samples.popleft()
        then, busy0, all0 = self._samples[0]
        busy, total = times
        if now - then < self.window or total <= all0:
            return None
        return max(0.0, 1.0 - (busy - busy0) / (total - all0))

    def reset(self) -> None:
        """Forget the samples: the next answer covers only what comes after (e.g. a unit just started)."""
        self._samples.clear()


try:
    from xdist.scheduler import LoadGroupScheduling
except ImportError:  # pytest-xdist is in the [test] extra; without it the suite runs serially
    LoadGroupScheduling = None


if LoadGroupScheduling is not None:

    class PlannedScheduling(LoadGroupScheduling):
        """``loadgroup``'s units, the longest first; heavy ones on at most ``slots`` workers at a time."""

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            self.durations = load_durations()
            self.slots = heavy_slots()
            self.max_slots = max_heavy_slots(self.slots)
            self.meter = IdleMeter()
            self.wall: dict[str, float] = {}
            self.heavy: set[str] = set()

        def _pending_scopes(self, node: Any) -> list[str]:
            return [scope for scope, unit in self.assigned_work[node].items() if not all(unit.values())]

        def _pending_tests(self, node: Any) -> int:
            return sum(1 for unit in self.assigned_work[node].values() for done in unit.values() if not done)

        def _holds_slot(self, node: Any) -> bool:
            return any(scope in self.heavy for scope in self._pending_scopes(node))

        def _pick(self, node: Any) -> str | None:
            """The scope to give ``node`` next, or None when nothing in the queue may go to it now."""
            holds = self._holds_slot(node)
            light = next((s for s in self.workqueue if s not in self.heavy), None)
            if not holds:
                busy = sum(1 for n in self.assigned_work if n is not node and self._holds_slot(n))
                heavy = next((s for s in self.workqueue if s in self.heavy), None)
                if heavy is not None and busy < self.slots:
                    return heavy
                if heavy is not None and light is None and busy < self.max_slots and self._idle():
                    self.meter.reset()  # the next extra one waits until the machine is idle with this one running
                    return heavy
                return light
            # behind a heavy unit: the cheapest light one, it only has to keep the worker going
            cheapest = next((s for s in reversed(self.workqueue) if s not in self.heavy), None)
            if cheapest is not None:
                return cheapest
            return next(iter(self.workqueue), None)  # only heavy ones are left: the next, on the same slot

        def _idle(self) -> bool:
            idle = self.meter.idle()
            return idle is not None and idle >= EXTRA_SLOT_IDLE

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down:
                return
            # a worker starts a test only once it has the next one (or is told to stop): keep two queued
            while self._pending_tests(node) < 2:
                scope = self._pick(node) if self.workqueue else None
                if scope is None:
                    if self.workqueue and self.max_slots > self.slots and not self._holds_slot(node):
                        return  # only heavy units left: wait for idle CPU to run one (mark_test_complete asks again)
                    # nothing left, or only heavy units the slots' workers will run: this one is done
                    node.shutdown()
                    return
                work_unit = self.workqueue.pop(scope)
                self.assigned_work[node][scope] = work_unit
                collection = self.registered_collections[node]
                node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

        def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            for other in self.nodes:  # the workers waiting for a heavy unit (or for the end) are asked again
                if other is not node and not self._holds_slot(other):
                    self._reschedule(other)

        def schedule(self) -> None:
            assert self.collection_is_completed
            if self.collection is not None:
                for node in self.nodes:
                    self._reschedule(node)
                return
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            if not self.collection:
                return
            units: dict[str, dict[str, bool]] = {}
            for nodeid in self.collection:
                units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
            for scope, unit in units.items():
                known = [self.durations.get(_strip_group(nodeid)) or _unrecorded(nodeid) for nodeid in unit]
                self.wall[scope] = sum(w for w, _ in known)
                if sum(c for _, c in known) >= HEAVY_CPU_S:
                    self.heavy.add(scope)
            self._sort_queue(units)
            for node in self.nodes:
                self._reschedule(node)

        def _sort_queue(self, units: dict[str, dict[str, bool]]) -> None:
            order = sorted(units, key=lambda s: -self.wall.get(s, DEFAULT_WALL))  # stable among equals
            self.workqueue = OrderedDict((scope, units[scope]) for scope in order)

        def remove_node(self, node: Any) -> str | None:
            crashed = super().remove_node(node)  # a crashed worker's units go back into the queue
            self._sort_queue(dict(self.workqueue))
            return crashed


# -- hooks (tests/conftest.py imports them) --------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--durations-out",
        metavar="PATH",
        default=None,
        help="write each test's wall and CPU seconds as JSON (the format of tests/durations.json)",
    )


def use_loadgroup(config: pytest.Config) -> None:
    """``-n N`` alone means ``--dist load``: make it ``loadgroup``, so that ``xdist_group`` marks hold. Not an ini
    option: a machine without pytest-xdist (scripts/gpu_check.sh's) must still parse the command line.

    The controller switches its own option; its workers parse the command line again (where ``-n`` alone means
    no grouping), so it tells them through their ``workerinput`` (:func:`pytest_configure_node`)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # a worker
        if workerinput.get(_LOADGROUP):
            config.option.loadgroup = True
    elif getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"


_LOADGROUP = "etrain_loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """In the controller, for each worker it starts: pass on ``loadgroup`` (:func:`use_loadgroup`)."""
    node.workerinput[_LOADGROUP] = node.config.getvalue("dist") == "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if LoadGroupScheduling is not None and config.getvalue("dist") == "loadgroup":
        return PlannedScheduling(config, log)
    return None


#: how much longer a test may run in a parallel run's worker before pytest-timeout stops it (its ``timeout`` mark,
#: or the ini's): those limits are hang guards, and a worker shares two cores with three others and their jobs
#: (a cold trainer's 7 CPU-s took over 50 s there once). ``PYTEST_TIMEOUT_SCALE`` overrides. Assertions on speed
#: are the tests' own (``solo`` marks the tight ones) and are not scaled.
TIMEOUT_SCALE = 3.0


def timeout_scale() -> float:
    """The factor for hang guards here: 1 outside an xdist worker, else ``PYTEST_TIMEOUT_SCALE`` (default
    :data:`TIMEOUT_SCALE`)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return 1.0
    try:
        return max(1.0, float(os.environ.get("PYTEST_TIMEOUT_SCALE", TIMEOUT_SCALE)))
    except ValueError:
        return TIMEOUT_SCALE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a parallel run's worker, each test's pytest-timeout limit times :func:`timeout_scale`."""
    scale = timeout_scale()
    if scale == 1.0:
        return
    default = _ini_timeout(config)
    for item in items:
        mark = item.get_closest_marker("timeout")
        if mark is not None and (mark.args or "timeout" in mark.kwargs):
            limit = mark.args[0] if mark.args else mark.kwargs["timeout"]
            kwargs = {k: v for k, v in mark.kwargs.items() if k != "timeout"}
        elif default:
            limit, kwargs = default, {}
        else:
            continue
        item.add_marker(pytest.mark.timeout(float(limit) * scale, **kwargs), append=False)


def _ini_timeout(config: pytest.Config) -> float | None:
    """The ini's ``timeout`` (pytest-timeout's option; None without the plugin or the setting)."""
    try:
        raw = config.getini("timeout")
        return float(raw) if raw else None
    except (ValueError, TypeError):
        return None


def _cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine (``/proc/stat``): a test's processes include some it never waits
    for (agents, zygotes and the workers they fork), which ``getrusage`` misses. So a serial run's figures are the
    tests' own; a parallel run's include their neighbours'. Where ``/proc/stat`` cannot be read: this process
    and the children it waited for."""
    times = _cpu_times()
    if times is not None:
        return times[0]
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_cpu_start: dict[str, float] = {}
_measured: dict[str, list[float]] = {}
_failed: dict[str, None] = {}  # ordered set: the ids of failed or errored tests, in the order they failed
#: where the run writes the ids of the tests that failed or errored, one per line (scripts/test.sh runs them again)
FAILED_OUT_ENV = "PYTEST_FAILED_OUT"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.config.getoption("durations_out", None):
        _cpu_start[item.nodeid] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.when == "teardown" and item.nodeid in _cpu_start:  # to the controller with the report
        report.user_properties.append(("cpu_s", _cpu_seconds() - _cpu_start.pop(item.nodeid)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Every phase's report, in the controller too (xdist replays the workers' reports there)."""
    entry = _measured.setdefault(_strip_group(report.nodeid), [0.0, 0.0])
    entry[0] += report.duration
    entry[1] += sum(float(v) for k, v in report.user_properties if k == "cpu_s")
    if report.failed:
        _failed.setdefault(_strip_group(report.nodeid), None)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # written once, by the controller or the only process
        return
    # an environment variable, not an option: scripts/test.sh runs pytest with no path, and then the options of
    # tests/conftest.py are unknown when the command line is parsed
    failed_out = os.environ.get(FAILED_OUT_ENV)
    if failed_out:
        Path(failed_out).write_text("".join(f"{nodeid}\n" for nodeid in _failed))
    out = session.config.getoption("durations_out", None)
    if not out:
        return
    # under HEAVY_PATHS a test missing from the file counts as heavy and long (_unrecorded): fast ones are kept there
    kept = {k: v for k, v in sorted(_measured.items()) if max(v) >= RECORD_MIN_S or k.startswith(HEAVY_PATHS)}
    lines = [f"{json.dumps(k)}: [{v[0]:.1f}, {v[1]:.1f}]" for k, v in kept.items()]
    Path(out).write_text("{\n" + ",\n".join(lines) + "\n}\n")
