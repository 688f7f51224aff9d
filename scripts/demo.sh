#!/usr/bin/env bash
# README command one: the local-cluster demo (etcd, controller, 3 agents, a job, an agent SIGKILLed mid-run).
# Usage: bash scripts/demo.sh [--workdir DIR] [--keep]
# Sets up first (scripts/setup.sh: apt packages, the project's own .venv), then runs in that environment.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"  # torchrun, etrain and the interpreter of the environment
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$VENV/bin/python" -m service.cli demo "$@"
