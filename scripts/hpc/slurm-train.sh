#!/usr/bin/env bash
#SBATCH --job-name=etrain-train
#SBATCH --ntasks-per-node=1
# A node that fails must not end the allocation (Slurm's default kills or requeues the whole job): --no-kill here
# and on srun below keeps the other nodes' torchruns, which re-form without the lost node and go on.
#SBATCH --no-kill
# Slurm starts the job again (same job id) after a node failure of the batch host or a preemption, and this script
# requeues itself on the warning signal below: the job resumes from its newest snapshot.
#SBATCH --requeue
# A requeued job appends to its output instead of overwriting what the earlier run said.
#SBATCH --open-mode=append
# USR1 to this batch shell 120 s before the time limit: the workers save, the job requeues itself (see below).
#SBATCH --signal=B:USR1@120
#
# Elastic training on Slurm without the job service: an etcd inside the allocation (on the batch host), then
# `srun torchrun --rdzv-backend=etcd-v3` on every node. Submit with a node range and your script:
#
#   ETRAIN_CHECKPOINT_URL=/lustre/$USER/ckpt/run1 \
#     sbatch --nodes=2-4 --gpus-per-node=8 --time=24:00:00 scripts/hpc/slurm-train.sh train.py --epochs 90
#
# The training script uses ElasticTrainer (it saves to $ETRAIN_CHECKPOINT_URL and resumes from its newest snapshot).
# What happens:
#   - a node lost: its task ends, the others re-form without it (torchrun restarts their workers from the newest
#     snapshot; --rdzv-conf recovery=live keeps them) and the job goes on at the smaller size;
#   - the time limit near (USR1): every worker saves at the next step boundary and exits; the job requeues itself
#     (ETRAIN_REQUEUE_ON_WARNING=0: it ends instead) and resumes from that snapshot in its next allocation;
#   - scancel, a preemption (SIGTERM): the workers save and exit; the job ends;
#   - the end state reads as Slurm accounting expects: COMPLETED (exit 0) when training finished, even if a node
#     was lost on the way; exit 0 after a save on a signal; the torchruns' exit code otherwise.
# Environment:
#   ETRAIN_CHECKPOINT_URL   where snapshots go (default: <submit dir>/etrain-checkpoints/<job id>, the same
#                           after a requeue); use a shared file system or an object store
#   ETRAIN_MIN_NODES        the fewest nodes training goes on with (default 1); the most is the allocation's
#   ETRAIN_NPROC_PER_NODE   workers per node (default: SLURM_GPUS_ON_NODE, else 1)
#   ETRAIN_MAX_RESTARTS     torchrun --max-restarts (default 10: every node loss or join restarts the group once)
#   ETRAIN_RDZV_CONF        more --rdzv-conf (e.g. recovery=live)
#   ETRAIN_ETCD_ENDPOINTS   an etcd of your own instead of the one started here
#   ETRAIN_ETCD_HOST        the address other nodes reach the batch host's etcd at (default: hostname -f)
#   ETRAIN_ETCD_LISTEN      the address etcd listens on (default 0.0.0.0)
#   ETRAIN_ETCD_BIN, ETRAIN_ETCDCTL_BIN   (default: etcd, etcdctl on PATH)
#   ETRAIN_TORCHRUN         the torchrun command (default: torchrun), split on blanks
#   ETRAIN_SRUN_ARGS        extra srun arguments, split on blanks; SRUN: the srun executable
#   ETRAIN_REQUEUE_ON_WARNING  1 (default): requeue after the save on USR1; 0: end the job
set -uo pipefail

self_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
for candidate in "${ETRAIN_HPC_DIR:-}" "$self_dir" "${SLURM_SUBMIT_DIR:+$SLURM_SUBMIT_DIR/scripts/hpc}"; do
  if [ -n "$candidate" ] && [ -r "$candidate/common.sh" ]; then
    # shellcheck source=common.sh
    . "$candidate/common.sh"
    break
  fi
done
declare -F etrain_die >/dev/null || { echo "etrain-hpc: error: common.sh not found: set ETRAIN_HPC_DIR to etrain's scripts/hpc directory" >&2; exit 2; }

# -- one node's task (srun runs this script again with --task) ----------------------------------------------
if [ "${1:-}" = "--task" ]; then
  shift
  read -r -a torchrun <<<"${ETRAIN_TORCHRUN:-torchrun}"
  conf=()
  [ -z "${ETRAIN_RDZV_CONF:-}" ] || conf=(--rdzv-conf "$ETRAIN_RDZV_CONF")
  "${torchrun[@]}" --nnodes="$ETRAIN_TRAIN_NNODES" --nproc-per-node="$ETRAIN_TRAIN_NPROC" \
    --rdzv-backend=etcd-v3 --rdzv-endpoint="$ETRAIN_TRAIN_ETCD" --rdzv-id="slurm-$SLURM_JOB_ID" \
    --max-restarts="$ETRAIN_TRAIN_RESTARTS" "${conf[@]}" "$@"
  rc=$?
  # the batch shell reads how each node's torchrun ended (a lost node's task never writes one)
  echo "$rc" >"$ETRAIN_TRAIN_STATE/exit.${SLURMD_NODENAME:-$(hostname -s)}"
  exit "$rc"
fi

# -- the batch shell ----------------------------------------------------------------------------------------
[ -n "${SLURM_JOB_ID:-}" ] || etrain_die "not inside a Slurm allocation (SLURM_JOB_ID is unset): submit with sbatch"
[ $# -ge 1 ] || etrain_die "usage: sbatch [--nodes=MIN-MAX] slurm-train.sh train.py [ARGS...]"
nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}
[ -n "$nodes" ] || etrain_die "SLURM_JOB_NUM_NODES is unset: cannot tell how many nodes to train on"
min_nodes=${ETRAIN_MIN_NODES:-1}
case "$min_nodes" in '' | *[!0-9]* | 0) etrain_die "ETRAIN_MIN_NODES must be a positive whole number, got '$min_nodes'" ;; esac
[ "$min_nodes" -le "$nodes" ] || etrain_die "ETRAIN_MIN_NODES=$min_nodes is more than the $nodes node(s) allocated"
hpc_dir=$(cd "$self_dir" && pwd)
[ -r "$hpc_dir/slurm-train.sh" ] || hpc_dir=$(cd "${ETRAIN_HPC_DIR:-${SLURM_SUBMIT_DIR:-.}/scripts/hpc}" && pwd)
submit_dir=${SLURM_SUBMIT_DIR:-$(pwd)}
export ETRAIN_CHECKPOINT_URL=${ETRAIN_CHECKPOINT_URL:-$submit_dir/etrain-checkpoints/$SLURM_JOB_ID}
export ETRAIN_TRAIN_STATE="$submit_dir/.etrain-slurm/$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"
export ETRAIN_TRAIN_NNODES="$min_nodes:$nodes"
export ETRAIN_TRAIN_NPROC=${ETRAIN_NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
export ETRAIN_TRAIN_RESTARTS=${ETRAIN_MAX_RESTARTS:-10}
mkdir -p "$ETRAIN_TRAIN_STATE" || etrain_die "cannot create $ETRAIN_TRAIN_STATE (the submit directory must be writable and shared)"
scratch=$(mktemp -d "${TMPDIR:-/tmp}/etrain-train-$SLURM_JOB_ID.XXXXXX")
etcd_pid=""
# shellcheck disable=SC2329  # run by the EXIT trap
cleanup() {
  [ -z "$etcd_pid" ] || kill "$etcd_pid" 2>/dev/null
  [ -z "$etcd_pid" ] || wait "$etcd_pid" 2>/dev/null
  rm -rf "$scratch" "$ETRAIN_TRAIN_STATE"
}
trap cleanup EXIT

free_port() {
  "${ETRAIN_PYTHON:-python3}" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

# An etcd of this job's own on the batch host, on a free port. Its member name carries the job id and a random
# token, and the health check asks for that name: another job's etcd that happens to answer on the port (a port
# taken between the check and the bind) is never mistaken for this one.
start_etcd() {
  local host=${ETRAIN_ETCD_HOST:-$(hostname -f)} listen=${ETRAIN_ETCD_LISTEN:-0.0.0.0} name port peer ctl
  name="etrain-$SLURM_JOB_ID-$RANDOM$RANDOM"
  ctl=${ETRAIN_ETCDCTL_BIN:-etcdctl}
  for _ in 1 2 3 4 5; do
    if ! port=$(free_port) || ! peer=$(free_port); then
      etrain_die "cannot pick a free port for etcd"
    fi
    "${ETRAIN_ETCD_BIN:-etcd}" --name "$name" --data-dir "$scratch/etcd" \
      --listen-client-urls "http://$listen:$port" --advertise-client-urls "http://$host:$port" \
      --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
      --initial-cluster "$name=http://127.0.0.1:$peer" >"$scratch/etcd.log" 2>&1 &
    etcd_pid=$!
    for _ in $(seq 1 100); do
      if ! kill -0 "$etcd_pid" 2>/dev/null; then
        break  # it exited: the port was taken after all; another one
      fi
      if "$ctl" --endpoints="http://$host:$port" --dial-timeout=1s member list 2>/dev/null | grep -q ", $name, "; then
        export ETRAIN_TRAIN_ETCD="$host:$port"
        echo "etrain-hpc: etcd of job $SLURM_JOB_ID at $host:$port" >&2
        return 0
      fi
      sleep 0.1
    done
    kill "$etcd_pid" 2>/dev/null
    wait "$etcd_pid" 2>/dev/null
    etcd_pid=""
    rm -rf "$scratch/etcd"
  done
  tail -n 20 "$scratch/etcd.log" >&2
  etrain_die "the job's etcd did not start (see its log above)"
}

if [ -n "${ETRAIN_ETCD_ENDPOINTS:-}" ]; then
  export ETRAIN_TRAIN_ETCD=${ETRAIN_ETCD_ENDPOINTS%%,*}
else
  start_etcd
fi

signalled=""
# shellcheck disable=SC2329  # run by the USR1 and TERM traps
on_signal() {
  [ -z "$signalled" ] || return 0  # stopping already (scontrol requeue signals this shell too)
  signalled=$1
  echo "etrain-hpc: $1 received: the workers save at their next step boundary and stop" >&2
  # to every process of the job's steps (srun itself would abort the step on SIGTERM, killing the workers unsaved)
  "${SCANCEL:-scancel}" --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || true
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

extra=()
[ -z "${ETRAIN_SRUN_ARGS:-}" ] || read -r -a extra <<<"$ETRAIN_SRUN_ARGS"
echo "etrain-hpc: training on $nodes node(s) (at least $min_nodes), job $SLURM_JOB_ID run ${SLURM_RESTART_COUNT:-0}," \
  "snapshots at $ETRAIN_CHECKPOINT_URL" >&2
"${SRUN:-srun}" --nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1 --kill-on-bad-exit=0 --no-kill \
  --export=ALL "${extra[@]}" bash "$hpc_dir/slurm-train.sh" --task "$@" &
srun_pid=$!
rc=0
while true; do
  wait "$srun_pid"
  rc=$?
  kill -0 "$srun_pid" 2>/dev/null || break  # else a trapped signal interrupted the wait: wait on
done

finished=""
for f in "$ETRAIN_TRAIN_STATE"/exit.*; do
  [ -e "$f" ] && [ "$(cat "$f")" = 0 ] && finished=1
done
if [ -n "$signalled" ]; then
  if [ "$signalled" = USR1 ] && [ "${ETRAIN_REQUEUE_ON_WARNING:-1}" = 1 ] && [ -z "$finished" ]; then
    echo "etrain-hpc: saved on the time limit's warning; requeueing job $SLURM_JOB_ID" >&2
    trap '' TERM  # the requeue ends this shell's allocation: leave quietly
    "${SCONTROL:-scontrol}" requeue "$SLURM_JOB_ID" || etrain_die "scontrol requeue $SLURM_JOB_ID failed"
  fi
  exit 0
fi
if [ -n "$finished" ]; then
  [ "$rc" = 0 ] || echo "etrain-hpc: training finished (a node's torchrun exited 0); srun's exit $rc was a lost node" >&2
  exit 0
fi
echo "etrain-hpc: training did not finish: srun exited $rc" >&2
exit "$rc"
