#!/usr/bin/env bash
# The project's test command: sets up (scripts/setup.sh: apt packages, the project's own .venv), lints,
# type-checks, runs the suite, then (under CI, or with COMPAT=1) the torch compatibility run
# (scripts/compat.sh: the elastic/ suites on the oldest and the newest supported torch).
# Extra arguments go to pytest.
#
# The suite runs on four pytest-xdist workers (PYTEST_WORKERS, default 4; 0 runs it serially in one process):
# tests/parallel.py hands the heavy units, real training jobs, to at most PYTEST_HEAVY_SLOTS (default 2) workers at
# a time, and scales pytest-timeout's hang guards by 3 in the workers (PYTEST_TIMEOUT_SCALE). The tests marked
# `solo` (a tight wall-clock bound) run afterwards, alone. If at most RERUN_MAX (3) tests fail in the parallel
# run, they run again serially, alone, and the run passes only if they pass there (the output names them). On this
# 2-core VM a fresh clone took 23.9-25.2 min in all (2026-11-28, eighth session, three runs: 20.8-21.9 min of
# parallel pytest, then the solo tests), serially 37.8 min (2026-11-27). See README "Development".
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase's heading says when it started (minutes:seconds since this script did): CI prints only a part of the
# output, and a run over its time limit must say where the time went.
stamp() { printf '[%d:%02d]' $((SECONDS / 60)) $((SECONDS % 60)); }
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
( echo "== ruff"; $PY -m ruff check elastic service tests bench examples && echo "== mypy" && $PY -m mypy ) \
  >"$lint_log" 2>&1 &
lint=$!
workers=${PYTEST_WORKERS:-4}
parallel=$([ "$workers" != 0 ] && echo 1 || echo 0)
for arg in "$@"; do case "$arg" in -n|-n?*|--numprocesses*) parallel=1 ;; esac; done
# In a parallel run the tests marked `solo` (a tight wall-clock bound, which other tests' load on the cores would
# break) run afterwards, alone, once ruff and mypy are done too.
marks="not slow"; [ "$parallel" = 1 ] && marks="not slow and not solo"
failed_ids=$(mktemp)
echo "== pytest ($workers workers) $(stamp)"
suite=0; PYTEST_FAILED_OUT="$failed_ids" $PY -m pytest -q -ra --durations=15 -m "$marks" -n "$workers" "$@" || suite=$?
lint_rc=0; wait "$lint" || lint_rc=$?
# A parallel run's few failures (at most RERUN_MAX, default 3) run again, serially and alone: the run passes only if
# each passes there, and the output names them. More failures than that fail the run as they are.
if [ "$parallel" = 1 ] && [ "$suite" = 1 ]; then
  mapfile -t failed < "$failed_ids"
  if [ "${#failed[@]}" -ge 1 ] && [ "${#failed[@]}" -le "${RERUN_MAX:-3}" ]; then
    echo "== pytest: ${#failed[@]} test(s) failed beside the other workers' load; running them again, alone: $(stamp)"
    printf '   %s\n' "${failed[@]}"
    rerun=0; $PY -m pytest -q -ra -n 0 "${failed[@]}" || rerun=$?
    if [ "$rerun" = 0 ]; then
      suite=0
      echo "== they passed alone (failed under the parallel run's load: see their first failure above) $(stamp)"
    fi
  fi
fi
rm -f "$failed_ids"
if [ "$parallel" = 1 ]; then
  echo "== pytest: the solo tests, alone $(stamp)"
  solo=0; $PY -m pytest -q -ra -m "solo and not slow" "$@" -n 0 || solo=$?
  if [ "$solo" != 0 ] && [ "$solo" != 5 ]; then suite=$(( suite ? suite : solo )); fi  # 5: none selected
fi
cat "$lint_log"; rm -f "$lint_log"
echo "== suite and lint done $(stamp)"
if [ "$lint_rc" != 0 ]; then echo "== ruff/mypy failed (exit $lint_rc)"; fi
if [ "$suite" != 0 ] || [ "$lint_rc" != 0 ]; then exit $(( suite ? suite : lint_rc )); fi
case "${COMPAT:-${CI:-}}" in
  1|true) echo "== torch compatibility $(stamp)"; bash scripts/compat.sh; echo "== done $(stamp)" ;;
esac
