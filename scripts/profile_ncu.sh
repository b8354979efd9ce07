#!/usr/bin/env bash
# Nsight Compute sections of our kernel and of a torch SDPA peer (cuDNN or FA2) on one case, to compare where time
# goes (issue slots, stall reasons, tensor pipe, shared-memory and L2 traffic), plus our kernel's hottest SASS
# instructions by warp-stall samples. One GPU; clocks left alone.
#
# usage: scripts/profile_ncu.sh [--pass fwd|bwd] [--mask full|causal|...] [--dim 128] [--seq 8192] [--batch 2]
#                              [--kernels REGEX] [--peer cudnn|flash|none] [--hotspots N]
#   --pass      the forward or the backward (default bwd); --kernels defaults to that pass's kernels of both families
#   --mask      a flash_bench mask (the peer runs full or causal: other masks profile ours only)
#   --seq/--batch  documents of one length (flash_bench --seq / --batch; the peer runs the same shape)
#   --peer      torch SDPA backend to profile beside ours (default flash; forward: its kernels inside an NVTX range
#               around the last call; backward: its kernels named *bprop* (cuDNN 9.19's is
#               cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x<D>_1x4x1_...) or flash_bwd* (FA2))
#   --hotspots  how many of our kernel's SASS instructions to list by stall samples (default 25; 0: none)
# Env: BUILD_DIR (default build-ncu), OUT (reports; default $BUILD_DIR/out), HEAD_DIMS (built tiles; default the
#   --dim), BENCH_ARGS (more flash_bench arguments).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build-ncu}
LOGS=${OUT:-$BUILD/out}
PASS=bwd MASK=full DIM=128 SEQ=8192 BATCH=2 KERNELS="" PEER=flash HOTSPOTS=25
usage_error() {
  echo "profile_ncu.sh: $1 (allowed: --pass fwd|bwd, --mask M, --dim D, --seq S, --batch B, --kernels REGEX, --peer cudnn|flash|none, --hotspots N)" >&2
  exit 2
}
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || usage_error "'$1' needs a value"
  case "$1" in
    --pass) PASS="$2" ;;
    --mask) MASK="$2" ;;
    --dim) DIM="$2" ;;
    --seq) SEQ="$2" ;;
    --batch) BATCH="$2" ;;
    --kernels) KERNELS="$2" ;;
    --peer) PEER="$2" ;;
    --hotspots) HOTSPOTS="$2" ;;
    *) usage_error "unknown argument '$1'" ;;
  esac
  shift 2
done
case "$PASS" in fwd|bwd) ;; *) usage_error "--pass '$PASS'" ;; esac
case "$PEER" in cudnn|flash|none) ;; *) usage_error "--peer '$PEER'" ;; esac
[ -n "$KERNELS" ] || { [ "$PASS" = fwd ] && KERNELS="forward_kernel" || KERNELS="backward_kernel|dkdv_kernel"; }
TAG="${PASS}_${MASK}_d${DIM}_${BATCH}x${SEQ}"
mkdir -p "$LOGS"

PREFIX_ARGS=()
[ -d "$ROOT/build-deps/usr" ] && PREFIX_ARGS=(-DCMAKE_PREFIX_PATH="$ROOT/build-deps/usr")
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMAGI_ATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DMAGI_ATTN_CUDA_HEAD_DIMS="${HEAD_DIMS:-$DIM}" -DCMAKE_CUDA_FLAGS="-lineinfo" "${PREFIX_ARGS[@]}" \
  > "$LOGS/configure.log" 2>&1 || { tail -30 "$LOGS/configure.log"; exit 1; }
cmake --build "$BUILD" -j"$(nproc)" --target flash_bench > "$LOGS/build.log" 2>&1 \
  || { grep -E "error" "$LOGS/build.log" | head; exit 1; }

SECTIONS=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
  --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active")
summarize() {
  grep -vE "^==PROF==|^    ---|^\s*$" "$1" | grep -E "^  [A-Za-z_]|Duration|Throughput|Issue Slots|Stall|Warp Cycles|Eligible|Active Warps|Registers|Shared Memory|Executed Ipc|Bank|L2 Hit|Pipe|pipe_tensor|One or More|No Eligible|Achieved|Block Limit|Executed Instructions  " | head -90
}
FLASH_ARGS=(--only "$MASK" --dims "$DIM" --seq "$SEQ" --batch "$BATCH" --reps 3 ${BENCH_ARGS:-})
[ "$PASS" = fwd ] && FLASH_ARGS+=(--forward-only)
ncu --clock-control none --kernel-name "regex:$KERNELS" --launch-skip 1 --launch-count 1 "${SECTIONS[@]}" \
  "$BUILD/bench/cuda/flash_bench" "${FLASH_ARGS[@]}" > "$LOGS/ncu_magi_$TAG.txt" 2>&1
echo "== magi $TAG ($KERNELS): rc $?"
summarize "$LOGS/ncu_magi_$TAG.txt"

if [ "$HOTSPOTS" -gt 0 ]; then
  # A second pass with PC sampling only: the SASS listing with each instruction's warp-stall samples.
  ncu --clock-control none --kernel-name "regex:$KERNELS" --launch-skip 1 --launch-count 1 --section SourceCounters \
    -f -o "$LOGS/magi_$TAG" "$BUILD/bench/cuda/flash_bench" "${FLASH_ARGS[@]}" > "$LOGS/ncu_source_$TAG.log" 2>&1
  ncu --import "$LOGS/magi_$TAG.ncu-rep" --page source --csv --print-source sass > "$LOGS/sass_$TAG.csv" 2>&1
  python3 "$ROOT/scripts/ncu_hotspots.py" "$LOGS/sass_$TAG.csv" "$HOTSPOTS" || tail -5 "$LOGS/sass_$TAG.csv"
fi

if [ "$PEER" != none ]; then
  case "$MASK" in full|causal) ;; *) echo "== peer: skipped (SDPA has no '$MASK' mask)"; exit 0 ;; esac
  BACKEND=$([ "$PEER" = cudnn ] && echo CUDNN_ATTENTION || echo FLASH_ATTENTION)
  cat > "$LOGS/peer.py" <<PY
import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
q, k, v = (torch.randn($BATCH, 16, $SEQ, $DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
causal = "$MASK" == "causal"
with sdpa_kernel(SDPBackend.$BACKEND):
    for i in range(3):
        last = i == 2
        if "$PASS" == "fwd":
            with torch.no_grad():
                if last: torch.cuda.nvtx.range_push("peer")
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            g = torch.randn_like(o)
            torch.cuda.synchronize()
            if last: torch.cuda.nvtx.range_push("peer")
            o.backward(g)
        if last: torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
PY
  # The forward's kernels are the ones inside the NVTX range. The backward's run on autograd's own thread, outside
  # the range (an H100 run profiled none): those are picked by name, the first iteration's included.
  if [ "$PASS" = fwd ]; then
    PEER_FILTER=(--nvtx --nvtx-include "peer/" --launch-count 4)
  else
    PEER_FILTER=(--kernel-name "regex:bprop|flash_bwd" --launch-count 6)
  fi
  ncu --clock-control none "${PEER_FILTER[@]}" "${SECTIONS[@]}" \
    python3 "$LOGS/peer.py" > "$LOGS/ncu_${PEER}_$TAG.txt" 2>&1
  echo "== $PEER $TAG: rc $?"
  summarize "$LOGS/ncu_${PEER}_$TAG.txt"
fi
