#!/usr/bin/env bash
# GPU context parallelism in one call: build (every core) the NCCL engine test, the distributed attention
# test and the throughput benchmark; run the tests with one rank per GPU (mpirun when the machine has it,
# else each program forks one process per GPU); run the benchmark; print a table last.
#
# usage: scripts/dist_gpu_check.sh [--arch 90a] [--skip-tests] [--skip-bench] [--ranks "2 4"]
#                                  [--bench-args "..."]
#   --ranks: the rank counts to run (each on the first N GPUs; default: every GPU).
#   The benchmark runs once per line of BENCH_SETS (default: GQA 64:8 heads, the reference system's published
#   distributed setting, then 16:16), each with --bench-args appended; a line's leading NAME=value words set
#   the environment of that run (e.g. "MAGI_ATTENTION_QO_COMM=1 --heads 16 --kv-heads 16").
# Env: BUILD_DIR (default build-dist-gpu), OUT (logs; default $BUILD_DIR/out), GTEST_FILTER.
# Build dependencies without a system copy travel in ignored folders: build-deps/usr (GoogleTest, Google
# Benchmark, nlohmann_json; docs/cuda_notes.md) and build-nccl-deps/mpi (OpenMPI headers + libraries,
# only to link the library's MPI engine where the machine has no MPI; not used to launch).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build-dist-gpu}
LOGS=${OUT:-$BUILD/out}
ARCH="90a"
RUN_TESTS=1 RUN_BENCH=1 BENCH_ARGS="" RANKS=""
BENCH_SETS=${BENCH_SETS:-"--heads 64 --kv-heads 8
--heads 16 --kv-heads 16"}
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) ARCH="$2"; shift ;;
    --skip-tests) RUN_TESTS=0 ;;
    --skip-bench) RUN_BENCH=0 ;;
    --bench-args) BENCH_ARGS="$2"; shift ;;
    --ranks) RANKS="$2"; shift ;;
    *) echo "dist_gpu_check.sh: unknown argument '$1' (allowed: --arch A, --skip-tests, --skip-bench, --ranks \"N ...\", --bench-args S)" >&2; exit 2 ;;
  esac
  shift
done
# NVLink multicast (NVLS) off in every process: on shared hosts it can put the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 GTEST_COLOR=no
mkdir -p "$LOGS"
SUMMARY=()
note() { SUMMARY+=("$1"); echo "== $1"; }

NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$NGPU" -ge 1 ] || { echo "no GPU visible"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -8
echo "GPUs: $NGPU, nvcc: $(nvcc --version | tail -1)"
RANKS=${RANKS:-$NGPU}
for n in $RANKS; do
  [ "$n" -ge 1 ] && [ "$n" -le "$NGPU" ] || { echo "dist_gpu_check.sh: --ranks $n: this machine has $NGPU GPUs" >&2; exit 2; }
done

MPI_SHIM=""
{
  CMAKE_ARGS=(-DCMAKE_BUILD_TYPE=Release -DMAGI_ATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH"
              "-DMAGI_ATTN_CUDA_HEAD_DIMS=64;128")
  [ -d "$ROOT/build-deps/usr" ] && CMAKE_ARGS+=(-DCMAKE_PREFIX_PATH="$ROOT/build-deps/usr")
  MPI_SHIM=""
  if ! command -v mpicxx >/dev/null && [ -d "$ROOT/build-nccl-deps/mpi" ]; then
    MPI_SHIM="$ROOT/build-nccl-deps/mpi"
    CMAKE_ARGS+=(-DMPI_SKIP_COMPILER_WRAPPER=ON -DMPI_CXX_SKIP_MPICXX=ON -DMPI_CXX_LIB_NAMES=mpi
                 -DMPI_mpi_LIBRARY="$MPI_SHIM/lib/libmpi.so" -DMPI_CXX_HEADER_DIR="$MPI_SHIM/include")
    export LD_LIBRARY_PATH="$MPI_SHIM/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "no system MPI: linking against the carried OpenMPI libraries; ranks are forked, not mpirun'd"
  fi
  GEN=()
  command -v ninja >/dev/null && GEN=(-G Ninja)
  t0=$(date +%s)
  cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" "${CMAKE_ARGS[@]}" > "$LOGS/configure.log" 2>&1 \
    || { tail -30 "$LOGS/configure.log"; echo "configure FAILED"; exit 1; }
  grep -E "NCCL|MPI|GPU context" "$LOGS/configure.log"
  cmake --build "$BUILD" -j"$(nproc)" --target nccl_engine_gpu dist_attn_gpu dist_attn_gpu_bench flash_attention_test \
    magi-attn > "$LOGS/build.log" 2>&1 \
    || { grep -E "error|Error" "$LOGS/build.log" | head -40; echo "build FAILED"; exit 1; }
  note "build ($ARCH, D 64 and 128 kernels): $(( $(date +%s) - t0 )) s"
}
program() { find "$BUILD" -type f -name "$1" -perm -u+x | head -1; }

# N ranks on the first N GPUs: mpirun when there is one (and the library has a real MPI), else the programs
# fork one process per GPU themselves.
launch() {
  local n=$1; shift
  local visible
  visible=$(seq -s, 0 $((n - 1)))
  if [ -z "$MPI_SHIM" ] && command -v mpirun >/dev/null; then
    CUDA_VISIBLE_DEVICES=$visible mpirun -np "$n" --allow-run-as-root --bind-to none -x CUDA_VISIBLE_DEVICES \
      -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x GTEST_COLOR \
      ${LD_LIBRARY_PATH:+-x LD_LIBRARY_PATH} "$@"
  else
    CUDA_VISIBLE_DEVICES=$visible MAGI_LOCAL_RANKS=$n "$@"
  fi
}
launch_mode() { [ -z "$MPI_SHIM" ] && command -v mpirun >/dev/null && echo "mpirun -np $1" || echo "forked, $1 ranks"; }

if [ $RUN_TESTS = 1 ]; then
  # The single-GPU pieces the distributed runtime leans on (merging partial results, accumulating dq).
  bin=$(program flash_attention_test)
  if [ -n "$bin" ]; then
    t0=$(date +%s)
    CUDA_VISIBLE_DEVICES=0 timeout 300 "$bin" --gtest_filter='CudaBackend.PartialResult*:CudaBackend.AccumulatedDq*:CudaBackend.ForwardTile*' \
      > "$LOGS/flash_attention_test.log" 2>&1
    rc=$?
    grep -E "Failure|FAILED" "$LOGS/flash_attention_test.log" | head -10
    note "flash_attention_test (merge, tiles; 1 GPU): $(grep -E '^\[  PASSED  \]' "$LOGS/flash_attention_test.log") rc $rc, $(( $(date +%s) - t0 )) s"
  fi
  for n in $RANKS; do
    for t in nccl_engine_gpu dist_attn_gpu; do
      t0=$(date +%s)
      bin=$(program "$t")
      timeout 300 bash -c "$(declare -f launch); MPI_SHIM='$MPI_SHIM' launch $n '$bin' ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER}" \
        > "$LOGS/${t}_cp$n.log" 2>&1
      rc=$?
      grep -E "Failure|FAILED|exception|error" "$LOGS/${t}_cp$n.log" | head -30
      note "$t ($(launch_mode $n)): $(grep -E '^\[  PASSED  \]' "$LOGS/${t}_cp$n.log" | head -1) $(grep -E '^\[  FAILED  \].*tests?, listed' "$LOGS/${t}_cp$n.log" | head -1) rc $rc, $(( $(date +%s) - t0 )) s"
    done
  done
fi

if [ $RUN_TESTS = 1 ]; then
  cli=$(program magi-attn)
  for n in $RANKS; do
    [ -n "$cli" ] || break
    t0=$(date +%s)
    timeout 300 bash -c "$(declare -f launch); MPI_SHIM='$MPI_SHIM' launch $n '$cli' dist-demo --tokens 32768 --heads-q 32 --heads-kv 8" \
      > "$LOGS/dist_demo_cp$n.log" 2>&1
    rc=$?
    grep -vE "^\s*$" "$LOGS/dist_demo_cp$n.log" | tail -25
    note "magi-attn dist-demo ($(launch_mode $n)): rc $rc, $(( $(date +%s) - t0 )) s"
  done
fi

if [ $RUN_BENCH = 1 ]; then
  : > "$LOGS/bench.log"
  for n in $RANKS; do
    [ "$n" -ge 2 ] || continue
    while IFS= read -r args; do
      [ -n "$args" ] || continue
      t0=$(date +%s)
      envs=""
      while [[ $args =~ ^([A-Z_][A-Z0-9_]*=[^ ]*)\ *(.*)$ ]]; do envs+="${BASH_REMATCH[1]} "; args=${BASH_REMATCH[2]}; done
      echo "## cp $n ${envs}$args" >> "$LOGS/bench.log"
      # shellcheck disable=SC2086
      # stdin from /dev/null: mpirun would otherwise swallow the rest of BENCH_SETS.
      timeout 420 bash -c "$(declare -f launch); MPI_SHIM='$MPI_SHIM' launch $n ${envs:+env $envs}'$(program dist_attn_gpu_bench)' $args $BENCH_ARGS" \
        >> "$LOGS/bench.log" 2>&1 < /dev/null
      rc=$?
      note "dist_attn_gpu_bench cp $n ${envs}$args ($(launch_mode $n)): rc $rc, $(( $(date +%s) - t0 )) s"
    done <<< "$BENCH_SETS"
  done
  grep -vE "^\|" "$LOGS/bench.log" | grep -iE "error|exception|failed" | head -20
fi

echo
echo "==== summary"
for line in "${SUMMARY[@]}"; do echo "$line"; done
if [ $RUN_BENCH = 1 ]; then
  echo
  grep -E "^## |^device:|^\||^TFLOP" "$LOGS/bench.log"
fi
