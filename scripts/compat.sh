#!/usr/bin/env bash
# The torch compatibility run: the compat, rendezvous, store, loop, prefork, checkpoint and live-group suites against
# other torch releases, each in a virtual environment of its own (.venv-torch<version>), next to the
# project and its [test] extra.
#
#   bash scripts/compat.sh                 # the oldest and the newest torch of the supported range
#   bash scripts/compat.sh 2.11.0 2.15.0   # chosen releases
#   bash scripts/compat.sh --download [...]  # only fetch their torch wheels (and what torch needs) into
#                                            # .compat-wheels/<version>; a later run installs from there
#
# scripts/test.sh, under CI, starts the --download beside the main suite: the CUDA wheels are several GB, and
# fetched then they cost the run no wall time (a CI run went over its 90 min in this script, 2026-11-28).
# The suites run as scripts/test.sh runs its own (scripts/pytest_phases.sh): on COMPAT_WORKERS (default
# PYTEST_WORKERS, else 4) pytest-xdist workers, a few tests that failed there again alone, then the `solo` tests
# alone. Serially they took 8.9 min per torch here, mostly waiting (a load average of 1-2 on 2 cores).
#
# Only PyPI's builds exist for most releases: CUDA builds (several GB each, with the nvidia-* wheels),
# which run on CPU. The versions asked for are what is checked, so in these environments pip's constraints
# are only the torch asked for (a machine-wide constraint file that caps torch is set aside). KEEP_VENVS=1 keeps the environments
# (default: each is removed after its run, to give back the disk). Needs scripts/setup.sh's apt packages.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pytest_phases.sh
BASE=${PYTHON:-python3}
WHEELS=${COMPAT_WHEELS:-.compat-wheels}
mode=run
if [ "${1:-}" = "--download" ]; then mode=download; shift; fi

if [ $# -eq 0 ]; then
  # elastic/compat.py holds the range; it imports torch only inside functions, so the bare interpreter can read it
  read -r -a versions <<<"$($BASE -c 'from elastic.compat import TORCH_MIN as a, TORCH_BELOW as b
print(f"~={a[0]}.{a[1]}.0 <{b[0]}.{b[1]}")')"
else
  versions=()
  for v in "$@"; do versions+=("==$v"); done
fi

SUITES=(
  tests/elastic/test_compat.py
  tests/elastic/rendezvous
  tests/elastic/checkpoint
  tests/elastic/test_prefork.py
  tests/elastic/test_prefork_owners.py
  tests/elastic/train/test_sampler.py
  tests/elastic/contract/test_lr.py
  tests/elastic/checkpoint/test_tiers.py
  tests/elastic/train/test_stop_timeout.py
  tests/elastic/train/test_preemption.py
  tests/elastic/train/test_host_sync.py
  tests/elastic/live/test_overlap.py
  tests/elastic/live/test_group_lifetime.py
  tests/integration/test_elastic_loop.py
  tests/integration/test_torchrun_etcd_v3.py
)

# pip with only the torch asked for as its constraint, without its notes about unreadable local index folders:
#   pin_pip PIN_FILE PYTHON pip-arguments...
pin_pip() {
  local pin=$1 py=$2
  shift 2
  PIP_CONSTRAINT="$pin" "$py" -m pip "$@" 2> >(grep -vE "^WARNING: Location" >&2)
}

# one name per version spec: the environment's (.venv-torch<name>) and the wheels' folder ($WHEELS/<name>)
spec_name() { printf '%s' "$1" | tr -c 'A-Za-z0-9.\n' '_'; }

if [ "$mode" = download ]; then
  # pip runs in the background and is waited for, so that a TERM (scripts/test.sh's exit) stops it at once (not
  # through pin_pip: $! must be pip itself)
  trap 'kill "${pip_pid:-}" 2>/dev/null; exit 143' TERM
  for spec in "${versions[@]}"; do
    dir="$WHEELS/$(spec_name "$spec")"
    # ~3 GB a torch, beside a suite that writes checkpoints: with under DOWNLOAD_MIN_FREE_GB (20) free, its run
    # installs from the index instead, as it did before the downloads existed
    free_gb=$(( $(df -Pk . | awk 'NR == 2 {print $4}') / 1024 / 1024 ))
    if [ "$free_gb" -lt "${DOWNLOAD_MIN_FREE_GB:-20}" ]; then
      echo "compat: not downloading torch${spec}: ${free_gb} GB free; its run will install from the index"
      continue
    fi
    started=$(date +%s)
    rm -rf "$dir"; mkdir -p "$dir"
    echo "torch${spec}" >"$dir/torch-pin.txt"
    PIP_CONSTRAINT="$dir/torch-pin.txt" $BASE -m pip download -q -d "$dir" "torch${spec}" \
      2> >(grep -vE "^WARNING: Location" >&2) & pip_pid=$!
    if wait "$pip_pid"; then
      touch "$dir/.complete"
      echo "compat: torch${spec} downloaded in $(( $(date +%s) - started ))s ($(du -sh "$dir" | cut -f1))"
    else
      rm -rf "$dir"
      echo "compat: downloading torch${spec} failed; its run will install from the index"
    fi
  done
  exit 0
fi

export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
summary=()
failed=0
for spec in "${versions[@]}"; do
  name=$(spec_name "$spec")
  venv=".venv-torch${name}"
  wheels="$WHEELS/$name"
  echo "== compat: torch${spec} in ${venv}"
  started=$(date +%s)
  if [ ! -x "$venv/bin/python" ]; then $BASE -m venv "$venv"; fi
  PY="$venv/bin/python"
  pin="$venv/torch-pin.txt"
  echo "torch${spec}" >"$pin"
  # a current pip (venv's 23.x backtracks into another torch), the torch asked for, then the project
  # with that torch held in place
  pin_pip "$pin" "$PY" install -q --upgrade pip
  if [ -f "$wheels/.complete" ] && pin_pip "$pin" "$PY" install -q --no-index --find-links "$wheels" "torch${spec}"; then
    echo "== compat: torch${spec} installed from $wheels"
  else
    pin_pip "$pin" "$PY" install -q "torch${spec}"
  fi
  rm -rf "$wheels"
  # the installed distribution's version (torch.__version__ may carry a +cu124 that PyPI's files do not)
  "$PY" -c 'from importlib.metadata import version; print("torch==" + version("torch"))' >"$pin"
  torch_version=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)
  pin_pip "$pin" "$PY" install -q -e ".[test]"
  echo "== compat: torch ${torch_version}, python $("$PY" -c 'import platform; print(platform.python_version())'), installed in $(( $(date +%s) - started ))s"
  rc=0
  workers=${COMPAT_WORKERS:-${PYTEST_WORKERS:-4}}
  PATH="$PWD/$venv/bin:$PATH" pytest_parallel "$PY" "$workers" "not slow" -p no:cacheprovider "${SUITES[@]}" || rc=$?
  solo=0
  PATH="$PWD/$venv/bin:$PATH" pytest_solo "$PY" "not slow" -p no:cacheprovider "${SUITES[@]}" || solo=$?
  rc=$(( rc ? rc : solo ))
  took=$(( $(date +%s) - started ))
  if [ $rc -eq 0 ]; then result="passed"; else result="FAILED (pytest exit $rc)"; failed=1; fi
  summary+=("torch ${torch_version}: ${result} in ${took}s")
  if [ "${KEEP_VENVS:-}" != "1" ]; then rm -rf "$venv"; fi
done
echo "== compat summary"
printf '  %s\n' "${summary[@]}"
exit $failed
