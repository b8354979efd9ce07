#!/usr/bin/env bash
# The main job on a fresh machine: build, then the distributed packed-documents demo (context parallelism)
# under mpirun, checked against one device: one rank per GPU when there are GPUs, else 4 ranks on the CPU.
# Without MPI it falls back to the single-device demo. Extra arguments go to the demo
# (e.g. --tokens 16384); RANKS overrides the number of ranks.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/build.sh"
cli="${BUILD_DIR:-$root/build}/src/cli/magi-attn"

if ! command -v mpirun >/dev/null 2>&1 || ! "$cli" dist-demo --help >/dev/null 2>&1; then
  echo "demo.sh: no MPI (mpirun, or magi-attn built with MPI): running the single-device demo" >&2
  exec "$cli" demo "$@"
fi

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
cores=$(nproc)
if ((gpus > 0)); then
  ranks=${RANKS:-$gpus}
  # The distributed runtime has only the MPI (host memory) engine wired so far: the ranks compute on the CPU.
  echo "demo.sh: $gpus GPU(s) found: $ranks ranks, one per GPU; the GPU engine (NCCL) is not wired into" \
       "dist-demo yet, so the ranks compute on the CPU" >&2
else
  ranks=${RANKS:-4}
fi
# Share the cores between the ranks (at least one thread each); the user's OMP_NUM_THREADS wins.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / ranks > 0 ? cores / ranks : 1 ))}
mpi_flags=(--oversubscribe -x OMP_NUM_THREADS)
[[ $(id -u) -eq 0 ]] && mpi_flags+=(--allow-run-as-root)
exec mpirun -np "$ranks" "${mpi_flags[@]}" "$cli" dist-demo "$@"
