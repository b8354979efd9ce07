#!/usr/bin/env bash
# GPU context parallelism in one call: build (every core) the NCCL engine test, the distributed attention
# test and the throughput benchmark; run the tests with one rank per GPU (mpirun when the machine has it,
# else each program forks one process per GPU); run the benchmark; print a table last.
#
# usage: scripts/dist_gpu_check.sh [--arch 90a] [--build] [--skip-tests] [--skip-bench] [--ranks "2 4"]
#                                  [--bench-args "..."]
#   --ranks: the rank counts to run (each on the first N GPUs; default: every GPU).
#   The benchmark runs once per line of BENCH_SETS (default: GQA 64:8 heads, the reference system's published
#   distributed setting, then 16:16), each with --bench-args appended.
# Env: BUILD_DIR (default build-dist-gpu), OUT (logs; default $BUILD_DIR/out), GTEST_FILTER.
# Build dependencies without a system copy travel in ignored folders: build-deps/usr (GoogleTest, Google
# Benchmark, nlohmann_json; docs/cuda_notes.md) and build-nccl-deps/mpi (OpenMPI headers + libraries,
# only to link the library's MPI engine where the machine has no MPI; not used to launch).
# Programs built elsewhere (same nvcc, sm_90a, -march x86-64-v3) may travel in build-nccl-deps/prebuilt/{bin,lib}:
# they are used unless --build is given or one of their libraries is missing; they run forked (their MPI
# is the carried one, not the machine's).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build-dist-gpu}
LOGS=${OUT:-$BUILD/out}
ARCH="90a"
RUN_TESTS=1 RUN_BENCH=1 BENCH_ARGS="" FORCE_BUILD=0 RANKS=""
BENCH_SETS=${BENCH_SETS:-"--heads 64 --kv-heads 8
--heads 16 --kv-heads 16"}
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) ARCH="$2"; shift ;;
    --build) FORCE_BUILD=1 ;;
    --skip-tests) RUN_TESTS=0 ;;
    --skip-bench) RUN_BENCH=0 ;;
    --bench-args) BENCH_ARGS="$2"; shift ;;
    --ranks) RANKS="$2"; shift ;;
    *) echo "dist_gpu_check.sh: unknown argument '$1' (allowed: --arch A, --build, --skip-tests, --skip-bench, --ranks \"N ...\", --bench-args S)" >&2; exit 2 ;;
  esac
  shift
done
# NVLink multicast (NVLS) off in every process: on shared hosts it can put the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
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

BIN_DIR=""
MPI_SHIM=""
PREBUILT="$ROOT/build-nccl-deps/prebuilt"
if [ $FORCE_BUILD = 0 ] && [ -x "$PREBUILT/bin/dist_attn_gpu" ]; then
  # NCCL from the machine (PyTorch's wheel), the rest carried.
  NCCL_LIB=$(python3 -c "import nvidia.nccl as n, os; print(os.path.join(list(n.__path__)[0], 'lib'))" 2>/dev/null)
  export LD_LIBRARY_PATH="$PREBUILT/lib:$ROOT/build-nccl-deps/mpi/lib${NCCL_LIB:+:$NCCL_LIB}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  missing=$(ldd "$PREBUILT/bin/dist_attn_gpu" | grep "not found")
  if [ -z "$missing" ]; then
    BIN_DIR="$PREBUILT/bin"
    MPI_SHIM="$ROOT/build-nccl-deps/mpi"
    note "prebuilt programs (NCCL from ${NCCL_LIB:-the system}): $(ldd "$BIN_DIR/dist_attn_gpu" | grep -E 'libnccl|libcudart' | awk '{print $3}' | tr '\n' ' ')"
  else
    echo "prebuilt programs miss: $missing; building"
  fi
fi
if [ -z "$BIN_DIR" ]; then
  CMAKE_ARGS=(-DCMAKE_BUILD_TYPE=Release -DMAGI_ATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH"
              -DMAGI_ATTN_CUDA_HEAD_DIMS=128 -DMAGI_ATTN_BUILD_CLI=OFF)
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
  cmake --build "$BUILD" -j"$(nproc)" --target nccl_engine_gpu dist_attn_gpu dist_attn_gpu_bench > "$LOGS/build.log" 2>&1 \
    || { grep -E "error|Error" "$LOGS/build.log" | head -40; echo "build FAILED"; exit 1; }
  note "build ($ARCH, D 128 kernels): $(( $(date +%s) - t0 )) s"
  BIN_DIR="$BUILD"
fi

# N ranks on the first N GPUs: mpirun when there is one (and the library has a real MPI), else the programs
# fork one process per GPU themselves.
launch() {
  local n=$1; shift
  local visible
  visible=$(seq -s, 0 $((n - 1)))
  if [ -z "$MPI_SHIM" ] && command -v mpirun >/dev/null; then
    CUDA_VISIBLE_DEVICES=$visible mpirun -np "$n" --allow-run-as-root --bind-to none -x CUDA_VISIBLE_DEVICES \
      -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS \
      ${LD_LIBRARY_PATH:+-x LD_LIBRARY_PATH} "$@"
  else
    CUDA_VISIBLE_DEVICES=$visible MAGI_LOCAL_RANKS=$n "$@"
  fi
}
launch_mode() { [ -z "$MPI_SHIM" ] && command -v mpirun >/dev/null && echo "mpirun -np $1" || echo "forked, $1 ranks"; }

if [ $RUN_TESTS = 1 ]; then
  for n in $RANKS; do
    for t in nccl_engine_gpu dist_attn_gpu; do
      t0=$(date +%s)
      bin=$(find "$BIN_DIR" -maxdepth 1 -type f -name "$t" -perm -u+x | head -1)
      timeout 300 bash -c "$(declare -f launch); MPI_SHIM='$MPI_SHIM' launch $n '$bin' ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER}" \
        > "$LOGS/${t}_cp$n.log" 2>&1
      rc=$?
      grep -E "Failure|FAILED|exception|error" "$LOGS/${t}_cp$n.log" | head -30
      note "$t ($(launch_mode $n)): $(grep -E '^\[  PASSED  \]' "$LOGS/${t}_cp$n.log" | head -1) $(grep -E '^\[  FAILED  \].*tests?, listed' "$LOGS/${t}_cp$n.log" | head -1) rc $rc, $(( $(date +%s) - t0 )) s"
    done
  done
fi

if [ $RUN_BENCH = 1 ]; then
  : > "$LOGS/bench.log"
  for n in $RANKS; do
    [ "$n" -ge 2 ] || continue
    while IFS= read -r args; do
      [ -n "$args" ] || continue
      t0=$(date +%s)
      # shellcheck disable=SC2086
      timeout 420 bash -c "$(declare -f launch); MPI_SHIM='$MPI_SHIM' launch $n '$BIN_DIR/dist_attn_gpu_bench' $args $BENCH_ARGS" \
        >> "$LOGS/bench.log" 2>&1
      rc=$?
      note "dist_attn_gpu_bench cp $n $args ($(launch_mode $n)): rc $rc, $(( $(date +%s) - t0 )) s"
    done <<< "$BENCH_SETS"
  done
  grep -vE "^\|" "$LOGS/bench.log" | grep -iE "error|exception|failed" | head -20
fi

echo
echo "==== summary"
for line in "${SUMMARY[@]}"; do echo "$line"; done
if [ $RUN_BENCH = 1 ]; then
  echo
  grep -E "^device:|^\||^TFLOP" "$LOGS/bench.log"
fi
