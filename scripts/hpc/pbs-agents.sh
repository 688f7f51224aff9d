#!/usr/bin/env bash
#PBS -N etrain-agents
# Starts one etrain agent on every node of a PBS (PBS Pro / OpenPBS / Torque) job with pbsdsh or mpiexec;
# the agents join the controller through the same etcd and prefix. Submit e.g.
#
#   qsub -l select=4:ngpus=8 -l walltime=24:00:00 \
#        -v ETRAIN_ETCD_ENDPOINTS=etcd1:2379,ETRAIN_NPROC_PER_NODE=8 scripts/hpc/pbs-agents.sh
#
# Needs the etrain environment on every node and the checkout on a shared file system. Environment: see
# etrain-node-agent.sh, plus
#   ETRAIN_CONTROLLER_URL   optional: wait for its /readyz before starting (ETRAIN_CONTROLLER_WAIT s, default 60)
#   ETRAIN_PBS_LAUNCHER     pbsdsh or mpiexec (default: pbsdsh when installed, else mpiexec)
#   ETRAIN_MPIEXEC_ARGS     mpiexec placement arguments (default: "-n <nodes> --ppn 1 --hosts <h1,h2,..>",
#                           the MPICH/Hydra, Intel MPI and Cray PALS form; Open MPI: "-n <nodes> --map-by ppr:1:node")
#   PBSDSH, MPIEXEC         the executables (default pbsdsh, mpiexec)
# pbsdsh starts tasks with an empty environment, so the launcher writes the ETRAIN_*, NCCL_*, TORCH_*,
# AWS_* and PATH-like variables to a private file (mode 600) in the job's working directory, and every
# node sources it: secrets never appear on a command line.
set -euo pipefail

self_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
for candidate in "${ETRAIN_HPC_DIR:-}" "$self_dir" "${PBS_O_WORKDIR:+$PBS_O_WORKDIR/scripts/hpc}"; do
  if [ -n "$candidate" ] && [ -r "$candidate/common.sh" ]; then
    # shellcheck source=common.sh
    . "$candidate/common.sh"
    break
  fi
done
declare -F etrain_die >/dev/null || { echo "etrain-hpc: error: common.sh not found: set ETRAIN_HPC_DIR to etrain's scripts/hpc directory" >&2; exit 2; }

if [ -z "${PBS_NODEFILE:-}" ] || [ ! -r "$PBS_NODEFILE" ]; then
  etrain_die "not inside a PBS job (PBS_NODEFILE is unset or unreadable): submit with qsub"
fi
etrain_require_etcd
hpc_dir=$(etrain_hpc_dir "$self_dir" "${PBS_O_WORKDIR:-}")
etrain_wait_controller

# PBS_NODEFILE lists a host once per slot: keep each host once, in order.
mapfile -t hosts < <(awk 'NF && !seen[$1]++ { print $1 }' "$PBS_NODEFILE")
[ "${#hosts[@]}" -gt 0 ] || etrain_die "PBS_NODEFILE $PBS_NODEFILE lists no host"
nodes=${#hosts[@]}

env_dir=${PBS_O_WORKDIR:-$PWD}
env_file=$(umask 077 && mktemp "$env_dir/.etrain-env.${PBS_JOBID:-$$}.XXXXXX")
trap 'rm -f "$env_file"' EXIT
while IFS= read -r name; do
  printf 'export %s=%q\n' "$name" "${!name}"
done < <(compgen -e | grep -E '^(ETRAIN_|NCCL_|TORCH_|AWS_|PATH$|LD_LIBRARY_PATH$|PYTHONPATH$|VIRTUAL_ENV$|PBS_JOBID$)' | grep -v '^ETRAIN_ENV_FILE$') >"$env_file"

bash_bin=$(command -v bash)
node_cmd=(/usr/bin/env "ETRAIN_ENV_FILE=$env_file" "$bash_bin" "$hpc_dir/etrain-node-agent.sh")

launcher=${ETRAIN_PBS_LAUNCHER:-}
if [ -z "$launcher" ]; then
  if command -v "${PBSDSH:-pbsdsh}" >/dev/null 2>&1; then launcher=pbsdsh; else launcher=mpiexec; fi
fi

echo "etrain-hpc: starting $nodes agent(s) with $launcher (job ${PBS_JOBID:-?})" >&2
case "$launcher" in
  pbsdsh)
    # -u: one task per distinct node.
    "${PBSDSH:-pbsdsh}" -u -- "${node_cmd[@]}"
    ;;
  mpiexec)
    if [ -n "${ETRAIN_MPIEXEC_ARGS:-}" ]; then
      read -r -a placement <<<"$ETRAIN_MPIEXEC_ARGS"
    else
      host_list=$(IFS=,; echo "${hosts[*]}")
      placement=(-n "$nodes" --ppn 1 --hosts "$host_list")
    fi
    "${MPIEXEC:-mpiexec}" "${placement[@]}" "${node_cmd[@]}"
    ;;
  *)
    etrain_die "ETRAIN_PBS_LAUNCHER must be pbsdsh or mpiexec, got '$launcher'"
    ;;
esac
