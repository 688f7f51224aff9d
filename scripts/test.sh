#!/usr/bin/env bash
# The project's test command: sets up (scripts/setup.sh: apt packages, the project's own .venv), lints,
# type-checks, runs the suite, then (under CI, or with COMPAT=1) the torch compatibility run
# (scripts/compat.sh: the elastic/ suites on the oldest and the newest supported torch).
# Extra arguments go to pytest.
#
# The suite runs on four pytest-xdist workers (PYTEST_WORKERS, default 4; 0 runs it serially in one process):
# tests/parallel.py hands the heavy units, real training jobs, to at most PYTEST_HEAVY_SLOTS (default 2) workers at
# a time (one more, PYTEST_HEAVY_SLOTS_MAX, once the light units are gone and the CPU has been idle), and scales
# pytest-timeout's hang guards by 3 in the workers (PYTEST_TIMEOUT_SCALE). The tests marked
# `solo` (a tight wall-clock bound) run afterwards, alone. If at most RERUN_MAX (3) tests fail in the parallel
# run, they run again serially, alone, and the run passes only if they pass there (the output names them). On this
# 2-core VM a fresh clone took 23.9-25.2 min in all (2026-11-28, eighth session, three runs: 20.8-21.9 min of
# parallel pytest, then the solo tests), serially 37.8 min (2026-11-27); as CI runs it (CI=true: the compat run
# too, its wheels fetched beside the suite) 41.1 min, 24.8 of them before the compat run (2026-11-28, ninth
# session); 20.2 and 24.3 min (tenth session, before and after warm jobs forked their torchrun: this VM's speed
# drifted by a quarter within that session, `import torch` 2.9 -> 3.5-3.9 CPU-s); eleventh session (`import torch`
# 1.5 CPU-s): 14.7 and 14.9 min before its changes, 11.0, 11.4 (CI=true, before compat; 20.3 with it) and 12.8
# after; 2026-12-02 (fifteenth session): 13.8 min (11.8 of parallel pytest); 2026-12-06 (sixteenth): 12.0 and 13.0 min
# from fresh clones (1.2 of them set-up, 10.2-11.1 of parallel pytest). See README "Development".
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase's heading says when it started (minutes:seconds since this script did): CI prints only a part of the
# output, and a run over its time limit must say where the time went.
source scripts/pytest_phases.sh
echo "== setup $(stamp)"
bash scripts/setup.sh
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"  # torchrun, etrain and the interpreter of the environment
PY="$VENV/bin/python"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# Compiled modules are cached: with PYTHONDONTWRITEBYTECODE=1 (this image sets it) each of the suite's several
# hundred Python processes compiled the project's modules again, and each pytest worker re-rewrote every test module.
unset PYTHONDONTWRITEBYTECODE
"$PY" -m compileall -q -j 0 elastic service examples >/dev/null
# ruff and mypy run beside the suite (a serial suite leaves one of two cores mostly idle; mypy's ~1 CPU-minute
# then costs no wall time); their output comes after the suite's, and either failing fails the run.
lint_log=$(mktemp)
# `ruff format --check`: the layout is ruff's (docs: README "Development"); `ruff format` fixes it.
( echo "== ruff"; $PY -m ruff check elastic service tests bench examples \
  && $PY -m ruff format --check elastic service tests bench examples && echo "== mypy" && $PY -m mypy ) \
  >"$lint_log" 2>&1 &
lint=$!
# Under CI (or COMPAT=1) the torch compatibility run follows the suite: its torch wheels (several GB of CUDA builds)
# are fetched now, beside the suite, and the fetch is stopped if the script ends first.
compat=0; case "${COMPAT:-${CI:-}}" in 1|true) compat=1 ;; esac
if [ "$compat" = 1 ]; then
  fetch_log=$(mktemp)
  bash scripts/compat.sh --download >"$fetch_log" 2>&1 &
  fetch=$!
  trap 'kill "$fetch" 2>/dev/null || true' EXIT
fi
# The `solo` tests (a tight wall-clock bound, which other tests' load on the cores would break) and a parallel run's
# reruns run alone, once ruff and mypy are done too.
lint_rc=0; lint_waited=0
before_alone() { if [ "$lint_waited" = 0 ]; then lint_waited=1; wait "$lint" || lint_rc=$?; fi; }
suite=0; pytest_parallel "$PY" "${PYTEST_WORKERS:-4}" "not slow" "$@" || suite=$?
solo=0; pytest_solo "$PY" "not slow" "$@" || solo=$?
before_alone
suite=$(( suite ? suite : solo ))
cat "$lint_log"; rm -f "$lint_log"
echo "== suite and lint done $(stamp)"
if [ "$lint_rc" != 0 ]; then echo "== ruff/mypy failed (exit $lint_rc)"; fi
if [ "$suite" != 0 ] || [ "$lint_rc" != 0 ]; then exit $(( suite ? suite : lint_rc )); fi
if [ "$compat" = 1 ]; then
  echo "== torch compatibility: waiting for its downloads $(stamp)"
  wait "$fetch" || true
  cat "$fetch_log"; rm -f "$fetch_log"
  echo "== torch compatibility $(stamp)"
  bash scripts/compat.sh
  echo "== done $(stamp)"
fi
