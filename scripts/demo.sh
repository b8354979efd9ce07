#!/usr/bin/env bash
# The main job on a fresh machine: build, then the distributed packed-documents demo (context parallelism),
# checked against one device. GPUs: one rank per GPU on device tensors (NCCL engine), under mpirun when the
# machine has it, else magi-attn forks the ranks itself. No GPU: 4 ranks on the CPU under mpirun (MPI engine).
# Without a distributed magi-attn (built without MPI) or, on the CPU, without mpirun, it falls back to the
# single-device demo. Extra arguments go to the demo (e.g. --tokens 16384); RANKS overrides the number of ranks.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/build.sh"
cli="${BUILD_DIR:-$root/build}/src/cli/magi-attn"
args=("$@")

single_device() {
  echo "demo.sh: $1: running the single-device demo" >&2
  exec "$cli" demo "${args[@]}"
}
help=$("$cli" dist-demo --help 2>/dev/null) || single_device "magi-attn was built without MPI (no dist-demo)"

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
have_mpirun=0
command -v mpirun >/dev/null 2>&1 && have_mpirun=1
mpi_flags=(--oversubscribe)
[[ $(id -u) -eq 0 ]] && mpi_flags+=(--allow-run-as-root)

if ((gpus > 0)) && grep -q -- "--device cuda available" <<<"$help"; then
  ranks=${RANKS:-$gpus}
  # NVLink multicast (NVLS) off unless asked for: on shared hosts it can take GPUs out of service.
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  if ((have_mpirun)); then
    exec mpirun -np "$ranks" "${mpi_flags[@]}" --bind-to none -x NCCL_NVLS_ENABLE "$cli" dist-demo "$@"
  fi
  echo "demo.sh: no mpirun: magi-attn forks $ranks ranks, one per GPU" >&2
  MAGI_LOCAL_RANKS=$ranks exec "$cli" dist-demo "$@"
fi

((gpus > 0)) && echo "demo.sh: $gpus GPU(s), but this magi-attn has no GPU distributed runtime (CUDA backend" \
                      "and NCCL): the ranks compute on the CPU" >&2
((have_mpirun)) || single_device "no mpirun for the CPU ranks"
ranks=${RANKS:-4}
# Share the cores between the ranks (at least one thread each); the user's OMP_NUM_THREADS wins.
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / ranks > 0 ? cores / ranks : 1 ))}
exec mpirun -np "$ranks" "${mpi_flags[@]}" -x OMP_NUM_THREADS "$cli" dist-demo "$@"
