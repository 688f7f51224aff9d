#!/usr/bin/env bash
# Installs everything the project needs on a fresh Debian machine (run as root, or with sudo available).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

need_apt=()
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need_apt+=(etcd-client)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v nft >/dev/null 2>&1 || need_apt+=(nftables)  # network partitions in the chaos suite
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
# torch first, pinned: an unpinned torch would pull several GB of CUDA wheels.
if ! $PY -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  echo "setup: pip install torch==2.13.0"
  $PY -m pip install -q torch==2.13.0
fi
echo "setup: pip install -e .[dev]"
$PY -m pip install -q -e ".[dev]" 2>&1 | grep -vE "^WARNING: (Location|Running pip)" || true
$PY -c 'import elastic, service, etcd3, torch; print("setup: ok, torch", torch.__version__)'
