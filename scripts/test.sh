#!/usr/bin/env bash
# The project's test command: installs what is missing, lints, type-checks, runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
echo "== ruff"; $PY -m ruff check elastic service tests bench examples
echo "== mypy"; $PY -m mypy
echo "== pytest"; $PY -m pytest -q -ra --durations=15 -m "not slow" "$@"
