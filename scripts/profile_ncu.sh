#!/usr/bin/env bash
# Nsight Compute sections of our main kernels and of the torch flash (FA2) peer on one case, to compare
# where time goes (issue slots, stall reasons, shared-memory and L2 traffic). One GPU; clocks left alone.
#
# usage: scripts/profile_ncu.sh [--mask full] [--dim 128] [--kernels REGEX (default dkdv_kernel)]
#                              [--peer-kernels REGEX (default flash_bwd_dq_dk_dv)] [--skip-peer]
# Env: BUILD_DIR (default build-ncu), OUT (reports; default $BUILD_DIR/out), BENCH_ARGS (more flash_bench
#   arguments, e.g. "--seq 256 --batch 64" for short documents).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build-ncu}
LOGS=${OUT:-$BUILD/out}
MASK=full DIM=128 KERNELS="dkdv_kernel" PEER_KERNELS="flash_bwd_dq_dk_dv" PEER=1
while [ $# -gt 0 ]; do
  case "$1" in
    --mask) MASK="$2"; shift ;;
    --dim) DIM="$2"; shift ;;
    --kernels) KERNELS="$2"; shift ;;
    --peer-kernels) PEER_KERNELS="$2"; shift ;;
    --skip-peer) PEER=0 ;;
    *) echo "profile_ncu.sh: unknown argument '$1' (allowed: --mask M, --dim D, --kernels REGEX, --peer-kernels REGEX, --skip-peer)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$LOGS"
PREFIX_ARGS=()
[ -d "$ROOT/build-deps/usr" ] && PREFIX_ARGS=(-DCMAKE_PREFIX_PATH="$ROOT/build-deps/usr")
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMAGI_ATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DMAGI_ATTN_CUDA_HEAD_DIMS="$DIM" -DCMAKE_CUDA_FLAGS="-lineinfo" "${PREFIX_ARGS[@]}" > "$LOGS/configure.log" 2>&1 \
  || { tail -30 "$LOGS/configure.log"; exit 1; }
cmake --build "$BUILD" -j"$(nproc)" --target flash_bench > "$LOGS/build.log" 2>&1 || { grep -E "error" "$LOGS/build.log" | head; exit 1; }
grep -E "spill" "$LOGS/build.log" | sort -u | head

SECTIONS=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
  --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")
ncu --clock-control none --kernel-name "regex:$KERNELS" --launch-skip 1 --launch-count 1 "${SECTIONS[@]}" \
  "$BUILD/bench/cuda/flash_bench" --only "$MASK" --dims "$DIM" --reps 3 ${BENCH_ARGS:-} > "$LOGS/ncu_magi.txt" 2>&1
echo "== magi ($KERNELS): rc $?"
grep -vE "^==PROF==|^    ---|^\s*$" "$LOGS/ncu_magi.txt" | grep -E "^  [a-z_]|Duration|Throughput|Issue Slots|Stall|Warp Cycles|Eligible|Active Warps|Registers|Shared Memory|Executed Ipc|Bank|L2 Hit|Pipe|One or More|No Eligible|Achieved|Block Limit" | head -80

if [ $PEER = 1 ]; then
  cat > "$LOGS/fa2.py" <<PY
import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
q, k, v = (torch.randn(2, 16, 8192, $DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for _ in range(3):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=("$MASK" == "causal"))
        o.backward(torch.randn_like(o))
torch.cuda.synchronize()
PY
  ncu --clock-control none --kernel-name "regex:$PEER_KERNELS" --launch-skip 1 --launch-count 1 "${SECTIONS[@]}" \
    python3 "$LOGS/fa2.py" > "$LOGS/ncu_fa2.txt" 2>&1
  echo "== fa2: rc $?"
  grep -vE "^==PROF==|^    ---|^\s*$" "$LOGS/ncu_fa2.txt" | grep -E "^  [a-z_]|Duration|Throughput|Issue Slots|Stall|Warp Cycles|Eligible|Active Warps|Registers|Shared Memory|Executed Ipc|Bank|L2 Hit|Pipe|One or More|No Eligible|Achieved|Block Limit" | head -80
fi
