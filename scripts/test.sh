#!/usr/bin/env bash
# The project's test command: sets up (scripts/setup.sh: apt packages, the project's own .venv), lints,
# type-checks, runs the suite, then (under CI, or with COMPAT=1) the torch compatibility run
# (scripts/compat.sh: the elastic/ suites on the oldest and the newest supported torch).
# Extra arguments go to pytest.
#
# The suite runs in parallel (pytest-xdist): PYTEST_WORKERS worker processes, default 4 (on 2 cores most
# tests wait on subprocesses, etcd and timers; tests/parallel.py hands the heavy ones, real training jobs, to
# at most PYTEST_HEAVY_SLOTS=1 worker at a time). When an argument names a path
# (`bash scripts/test.sh tests/elastic/test_lr.py`), the default is 0: serially, in this process.
# PYTEST_WORKERS=N, or `-n N` among the arguments, decides either way; 0 is the serial run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"  # torchrun, etrain and the interpreter of the environment
PY="$VENV/bin/python"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
echo "== ruff"; $PY -m ruff check elastic service tests bench examples
echo "== mypy"; $PY -m mypy
workers=4
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then workers=0; break; fi  # a path or a test id: a quick look at a part
done
workers=${PYTEST_WORKERS:-$workers}
echo "== pytest ($workers workers)"; $PY -m pytest -q -ra --durations=15 -m "not slow" -n "$workers" "$@"
case "${COMPAT:-${CI:-}}" in
  1|true) echo "== torch compatibility"; bash scripts/compat.sh ;;
esac
