#!/usr/bin/env bash
# Starts the etrain agent of this node; slurm-agents.sh and pbs-agents.sh run it once on every node.
# It can also be run by hand on a node. Configuration comes from the environment:
#
#   ETRAIN_ETCD_ENDPOINTS   required: the etcd endpoints the controller uses ("h1:2379,h2:2379,h3:2379")
#   ETRAIN_PREFIX           etcd key prefix, the same as the controller's (default /etrain)
#   ETRAIN_NODE_NAME        agent name (default: Slurm's node name, SLURMD_NODENAME, else the short host name)
#   ETRAIN_NPROC_PER_NODE   worker processes (default: SLURM_GPUS_ON_NODE, else the number of devices in
#                           CUDA_VISIBLE_DEVICES, else ETRAIN_DEFAULT_NPROC, else 1)
#   ETRAIN_RDZV_HOST        address the other nodes reach this one at (default: hostname -f)
#   ETRAIN_WORK_DIR         node-local scratch (default: ${TMPDIR:-/tmp}/etrain-<job id>-<node name>)
#   ETRAIN_HEALTH_PORT      port of the agent's /healthz (default 8081; 0, off, inside a Slurm or PBS job: the batch
#                           system watches its nodes, and two allocations sharing a node would both want 8081)
#   ETRAIN_LOGS_PORT        port the agent serves its jobs' logs on, for `etrain logs` and the dashboard (unset: off)
#   ETRAIN_AGENT_ARGS       extra `etrain agent` arguments, split on blanks
#   ETRAIN_BIN              the etrain executable (default: etrain on PATH)
#   ETRAIN_ENV_FILE         a file to source first (pbs-agents.sh uses it: pbsdsh passes no environment)
# etcd TLS/auth (ETRAIN_ETCD_CA_CERT, ETRAIN_ETCD_CERT, ETRAIN_ETCD_KEY, ETRAIN_ETCD_USER,
# ETRAIN_ETCD_PASSWORD_FILE) and S3 credentials (AWS_*) are read by the agent from the environment.
set -euo pipefail

if [ -n "${ETRAIN_ENV_FILE:-}" ]; then
  # shellcheck source=/dev/null
  . "$ETRAIN_ENV_FILE"
fi

die() {
  echo "etrain-node-agent: error: $*" >&2
  exit 2
}

[ -n "${ETRAIN_ETCD_ENDPOINTS:-}" ] || die "ETRAIN_ETCD_ENDPOINTS is not set"

is_count() {
  case "$1" in '' | *[!0-9]*) return 1 ;; *) [ "$1" -gt 0 ] ;; esac
}

nproc_per_node() {
  if [ -n "${ETRAIN_NPROC_PER_NODE:-}" ]; then
    is_count "$ETRAIN_NPROC_PER_NODE" || die "ETRAIN_NPROC_PER_NODE must be a positive whole number, got '$ETRAIN_NPROC_PER_NODE'"
    echo "$ETRAIN_NPROC_PER_NODE"
  elif is_count "${SLURM_GPUS_ON_NODE:-}"; then
    echo "$SLURM_GPUS_ON_NODE"
  elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ "$CUDA_VISIBLE_DEVICES" != "NoDevFiles" ]; then
    local devices
    IFS=, read -r -a devices <<<"$CUDA_VISIBLE_DEVICES"
    echo "${#devices[@]}"
  else
    echo "${ETRAIN_DEFAULT_NPROC:-1}"
  fi
}

host_short=$(hostname -s 2>/dev/null || hostname)
# Slurm's name of the node (a node may run several slurmd, or be named otherwise than its host)
node_name=${ETRAIN_NODE_NAME:-${SLURMD_NODENAME:-$host_short}}
nproc=$(nproc_per_node)
rdzv_host=${ETRAIN_RDZV_HOST:-$(hostname -f 2>/dev/null || hostname)}
job_id=${SLURM_JOB_ID:-${PBS_JOBID:-local}}
work_dir=${ETRAIN_WORK_DIR:-${TMPDIR:-/tmp}/etrain-${job_id}-${node_name}}
if [ -n "${SLURM_JOB_ID:-}${PBS_JOBID:-}" ]; then
  health_port=${ETRAIN_HEALTH_PORT:-0}
else
  health_port=${ETRAIN_HEALTH_PORT:-8081}
fi
mkdir -p "$work_dir"

extra=()
if [ -n "${ETRAIN_AGENT_ARGS:-}" ]; then
  read -r -a extra <<<"$ETRAIN_AGENT_ARGS"
fi

echo "etrain-node-agent: $node_name: $nproc process(es), rendezvous host $rdzv_host, etcd $ETRAIN_ETCD_ENDPOINTS" >&2
# exec: the agent receives the batch system's signals (scancel, qdel, preemption) directly.
exec "${ETRAIN_BIN:-etrain}" agent \
  --etcd "$ETRAIN_ETCD_ENDPOINTS" \
  --prefix "${ETRAIN_PREFIX:-/etrain}" \
  --node-name "$node_name" \
  --nproc-per-node "$nproc" \
  --rdzv-host "$rdzv_host" \
  --work-dir "$work_dir" \
  --health-port "$health_port" \
  "${extra[@]}"
