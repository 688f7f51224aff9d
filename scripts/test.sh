#!/usr/bin/env bash
# The project's test command: sets up (scripts/setup.sh: apt packages, the project's own .venv), lints,
# type-checks, runs the suite, then (under CI, or with COMPAT=1) the torch compatibility run
# (scripts/compat.sh: the elastic/ suites on the oldest and the newest supported torch).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"  # torchrun, etrain and the interpreter of the environment
PY="$VENV/bin/python"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
echo "== ruff"; $PY -m ruff check elastic service tests bench examples
echo "== mypy"; $PY -m mypy
echo "== pytest"; $PY -m pytest -q -ra --durations=15 -m "not slow" "$@"
case "${COMPAT:-${CI:-}}" in
  1|true) echo "== torch compatibility"; bash scripts/compat.sh ;;
esac
