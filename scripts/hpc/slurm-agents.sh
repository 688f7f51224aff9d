#!/usr/bin/env bash
#SBATCH --job-name=etrain-agents
#SBATCH --ntasks-per-node=1
# A node that fails must not end the allocation: by default Slurm kills (or requeues) the whole job then, and every
# other node's agent with it. --no-kill here keeps the allocation, and on srun below keeps the other nodes' tasks.
#SBATCH --no-kill
# A requeued job appends to its output instead of overwriting what the earlier run said (the node failure, say).
#SBATCH --open-mode=append
# Starts one etrain agent on every node of a Slurm allocation with srun; the agents join the controller
# through the same etcd and prefix. Submit with the node count and GPUs you want, e.g.
#
#   ETRAIN_ETCD_ENDPOINTS=etcd1:2379,etcd2:2379,etcd3:2379 \
#   ETRAIN_CONTROLLER_URL=http://controller-host:8080 \
#     sbatch --nodes=4 --gpus-per-node=8 --time=24:00:00 scripts/hpc/slurm-agents.sh
#
# or run it inside `salloc`. Needs the etrain environment (python with `pip install .[service,s3]`) on
# every node, and the checkout on a shared file system. Environment: see etrain-node-agent.sh, plus
#   ETRAIN_CONTROLLER_URL   optional: wait for its /readyz before starting (ETRAIN_CONTROLLER_WAIT s, default 60)
#   ETRAIN_SRUN_ARGS        extra srun arguments, split on blanks
#   SRUN                    the srun executable (default srun)
# One agent failing does not stop the others (--kill-on-bad-exit=0), nor does a node that fails (--no-kill, on
# sbatch and srun): the service's jobs shrink and go on.
set -euo pipefail

self_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
for candidate in "${ETRAIN_HPC_DIR:-}" "$self_dir" "${SLURM_SUBMIT_DIR:+$SLURM_SUBMIT_DIR/scripts/hpc}"; do
  if [ -n "$candidate" ] && [ -r "$candidate/common.sh" ]; then
    # shellcheck source=common.sh
    . "$candidate/common.sh"
    break
  fi
done
declare -F etrain_die >/dev/null || { echo "etrain-hpc: error: common.sh not found: set ETRAIN_HPC_DIR to etrain's scripts/hpc directory" >&2; exit 2; }

[ -n "${SLURM_JOB_ID:-}" ] || etrain_die "not inside a Slurm allocation (SLURM_JOB_ID is unset): submit with sbatch or run inside salloc"
nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}
[ -n "$nodes" ] || etrain_die "SLURM_JOB_NUM_NODES is unset: cannot tell how many nodes to start agents on"
etrain_require_etcd
hpc_dir=$(etrain_hpc_dir "$self_dir" "${SLURM_SUBMIT_DIR:-}")
etrain_wait_controller

extra=()
if [ -n "${ETRAIN_SRUN_ARGS:-}" ]; then
  read -r -a extra <<<"$ETRAIN_SRUN_ARGS"
fi

echo "etrain-hpc: starting $nodes agent(s) with srun (job $SLURM_JOB_ID)" >&2
exec "${SRUN:-srun}" \
  --nodes="$nodes" \
  --ntasks="$nodes" \
  --ntasks-per-node=1 \
  --kill-on-bad-exit=0 \
  --no-kill \
  --export=ALL \
  "${extra[@]}" \
  bash "$hpc_dir/etrain-node-agent.sh"
