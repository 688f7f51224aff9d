# shellcheck shell=bash
# Helpers shared by slurm-agents.sh and pbs-agents.sh (sourced, not run).

etrain_die() {
  echo "etrain-hpc: error: $*" >&2
  exit 2
}

# The directory holding etrain-node-agent.sh, which every node must be able to read (a shared file
# system). Batch systems run a copy of the job script from a spool directory, so look in order at
# ETRAIN_HPC_DIR, the launcher's own directory, then scripts/hpc under the submit directory.
etrain_hpc_dir() {
  local self_dir=$1 submit_dir=${2:-} dir
  for dir in "${ETRAIN_HPC_DIR:-}" "$self_dir" "${submit_dir:+$submit_dir/scripts/hpc}"; do
    if [ -n "$dir" ] && [ -r "$dir/etrain-node-agent.sh" ]; then
      (cd "$dir" && pwd)
      return 0
    fi
  done
  etrain_die "etrain-node-agent.sh not found: set ETRAIN_HPC_DIR to the scripts/hpc directory of the etrain checkout (on a file system every node mounts)"
}

etrain_require_etcd() {
  if [ -z "${ETRAIN_ETCD_ENDPOINTS:-}" ]; then
    etrain_die "ETRAIN_ETCD_ENDPOINTS is not set: export the etcd endpoints the controller uses, e.g. ETRAIN_ETCD_ENDPOINTS=etcd1:2379,etcd2:2379,etcd3:2379"
  fi
}

# When ETRAIN_CONTROLLER_URL is set, wait up to ETRAIN_CONTROLLER_WAIT seconds (default 60) for its
# /readyz to answer 200, so that a wrong URL or an unreachable etcd stops the launch before any node starts.
etrain_wait_controller() {
  local url=${ETRAIN_CONTROLLER_URL:-}
  [ -n "$url" ] || return 0
  local wait_s=${ETRAIN_CONTROLLER_WAIT:-60}
  case "$wait_s" in '' | *[!0-9]*) etrain_die "ETRAIN_CONTROLLER_WAIT must be a whole number of seconds, got '$wait_s'" ;; esac
  if ! "${ETRAIN_PYTHON:-python3}" - "${url%/}/readyz" "$wait_s" <<'PY'
import sys, time, urllib.request
url, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
while True:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            if resp.status == 200:
                sys.exit(0)
            last = f"HTTP {resp.status}"
    except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
        last = str(exc)
    if time.monotonic() >= deadline:
        print(f"{url}: {last}", file=sys.stderr)
        sys.exit(1)
    time.sleep(1)
PY
  then
    etrain_die "controller at $url is not ready after ${wait_s}s (is it running, and does it reach etcd?)"
  fi
  echo "etrain-hpc: controller $url is ready" >&2
}
