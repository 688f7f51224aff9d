#!/usr/bin/env bash
# Installs everything the project needs on a fresh Debian machine (run as root, or with sudo available):
# Debian's etcd, network tools and Chromium (for the dashboard's browser tests) with apt, then a virtual
# environment of the project's own (.venv) with torch==2.13.0 (the CPU build) and the project with its
# [dev] extras.
#
# The environment is the guard against a dependency that only this machine has: it does not see the
# system's site-packages, so whatever the tests import must come from pyproject.toml. Under CI (CI=true),
# or with FRESH_VENV=1, it is made anew on every run.
#
# Settings (environment): PYTHON, the interpreter to build the environment from (python3); VENV, where
# (.venv); FRESH_VENV=1, start from an empty one.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

need_apt=()
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need_apt+=(etcd-client)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v nft >/dev/null 2>&1 || need_apt+=(nftables)  # network partitions in the chaos suite
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)  # the dashboard's browser tests (tests/service/ui)
# a real Slurm for the HPC scripts' tests (tests/deploy/slurm.py: munged, slurmctld and slurmd on this machine)
{ command -v slurmctld || [ -x /usr/sbin/slurmctld ]; } >/dev/null 2>&1 || need_apt+=(slurm-wlm)
{ command -v munged || [ -x /usr/sbin/munged ]; } >/dev/null 2>&1 || need_apt+=(munge)
BASE=${PYTHON:-python3}
if ! $BASE -c 'import venv, ensurepip' >/dev/null 2>&1; then need_apt+=(python3-venv); fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

VENV=${VENV:-.venv}
if [ "${FRESH_VENV:-}" = "1" ] || [ "${CI:-}" = "true" ]; then
  rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: $BASE -m venv $VENV"
  $BASE -m venv "$VENV"
fi
PY="$VENV/bin/python"

quiet_pip() {
  # pip's notes about unreadable local index folders are noise; its errors still show, and fail the script.
  # --no-compile: the modules are compiled once at the end, on every core (pip compiles on one)
  "$PY" -m pip install -q --no-compile "$@" 2> >(grep -vE "^WARNING: (Location|Running pip)" >&2)
}

# The pip that venv bundles (23.x) resolves the [dev] extras by backtracking into another torch: a current one.
quiet_pip --upgrade pip

# torch first, pinned: an unpinned torch would pull several GB of CUDA wheels. A torch already in the
# environment is kept when the project supports it (elastic/compat.py states the range), and held there
# while the rest is installed: pip never swaps it for another build.
if ! "$PY" -c 'from elastic.compat import check_torch_version; check_torch_version()' 2>/dev/null; then
  echo "setup: pip install torch==2.13.0"
  quiet_pip torch==2.13.0
fi
"$PY" -c 'from importlib.metadata import version; print("torch==" + version("torch"))' >"$VENV/torch-pin.txt"
echo "setup: pip install -e .[dev] into $VENV ($(cat "$VENV/torch-pin.txt"))"
quiet_pip -c "$VENV/torch-pin.txt" -e ".[dev]"
# Compiled modules for everything installed (this image sets PYTHONDONTWRITEBYTECODE=1: a module without its .pyc
# would be compiled again by every process that imports it). A file that does not compile (some packages ship
# templates or Python 2 examples) is skipped, as pip skips it.
"$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
"$PY" -c 'import elastic, service, etcd3, torch, sklearn; print("setup: ok, torch", torch.__version__)'
