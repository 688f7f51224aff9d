#!/usr/bin/env bash
# README command one: the local-cluster demo (etcd, controller, 3 agents, a job, an agent SIGKILLed mid-run).
# Usage: bash scripts/demo.sh [--workdir DIR] [--keep]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec $PY -m service.cli demo "$@"
