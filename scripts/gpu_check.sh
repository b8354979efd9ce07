#!/usr/bin/env bash
# The GPU evidence in one call: build with every core, run the GPU tests, compute-sanitizer (memcheck +
# racecheck) on small forward/backward cases, the Python package (pip install . timed, its tests on the GPU,
# the call-overhead benchmark against the C++ API), then the benchmark with the torch peers measured in the
# same run; a short table is printed last.
#
# usage: scripts/gpu_check.sh [--arch "80;90a"] [--skip-tests] [--skip-sanitizer] [--skip-python] [--skip-bench]
#                             [--skip-peers] [--quick] [--profile] [--large-d]
#   --quick: D=128 only in the benchmark, FlexAttention only on varlen causal.
#   --large-d: the benchmark at the large head dims instead (flash_bench --large-d: D 320 / 384 / 512 / 1024, or
#              LARGE_BENCH_DIMS; full and causal over 8k tokens, varlen causal documents; the plan's choice beside
#              MAGI_ATTENTION_CUDA_IGNORE_TUNED_CONFIGS=1 and the portable family) and its peers (SDPA
#              memory-efficient, ffpa-attn 0.2.4).
#   --profile: Nsight Compute counters of the default forward kernel (D 128: full, causal, varlen causal): tensor
#              pipe and issue utilisation, the leading stall reasons (ncu_*.csv, profile.txt).
# Env: HEAD_DIMS (MAGI_ATTN_CUDA_HEAD_DIMS of the C++ build and of pip install; default: the build's default, "all"
#   with --large-d), BUILD_TARGETS
#   (default: every target the script runs), PEERS_TIMEOUT (seconds for --large-d's peers; default 900),
#   BUILD_DIR (default build-gpu), OUT (logs/CSV; default $BUILD_DIR/out), TESTS_REGEX (ctest -R) for the tests; not GTEST_FILTER,
#   which the build's test discovery would obey too (an empty or narrow one lists no tests); SANITIZE_FAMILIES
#   (e.g. "ffa_sm90") for the sanitizers' kernel families (default: every family built), SANITIZE_FILTER their
#   gtest filter. FUZZ_SECONDS (default 0): after the tests, CudaFuzz (random valid calls through the public API)
#   repeated in nproc - 2 processes for that long, the families and the concatenated-heads backward in turn.
#   PAIR_ROUNDS (default 3; 0: none): after the benchmark, full and causal timed again, ours and cuDNN in turn, for
#   that many rounds (the ratios' medians: a single measurement moves with the power cap).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build-gpu}
LOGS=${OUT:-$BUILD/out}
ARCH="80;90a"
RUN_TESTS=1 RUN_SANITIZER=1 RUN_PYTHON=1 RUN_BENCH=1 RUN_PEERS=1 QUICK=0 RUN_PROFILE=0 LARGE_D=0
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) ARCH="$2"; shift ;;
    --skip-tests) RUN_TESTS=0 ;;
    --skip-sanitizer) RUN_SANITIZER=0 ;;
    --skip-python) RUN_PYTHON=0 ;;
    --skip-bench) RUN_BENCH=0 ;;
    --skip-peers) RUN_PEERS=0 ;;
    --quick) QUICK=1 ;;
    --profile) RUN_PROFILE=1 ;;
    --large-d) LARGE_D=1 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (allowed: --arch A, --skip-tests, --skip-sanitizer, --skip-python, --skip-bench, --skip-peers, --quick, --profile, --large-d)" >&2; exit 2 ;;
  esac
  shift
done
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$LOGS"
SUMMARY=()
note() { SUMMARY+=("$1"); echo "== $1"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOGS/gpu.txt"
nvcc --version | tail -1
python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())' 2>/dev/null

# Build dependencies (GoogleTest, Google Benchmark, nlohmann_json) may travel as a prefix in build-deps/.
PREFIX_ARGS=()
[ -d "$ROOT/build-deps/usr" ] && PREFIX_ARGS=(-DCMAKE_PREFIX_PATH="$ROOT/build-deps/usr")
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
HEAD_DIMS=${HEAD_DIMS:-$([ $LARGE_D = 1 ] && echo all || echo default)}
t0=$(date +%s)
cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DMAGI_ATTN_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DMAGI_ATTN_CUDA_HEAD_DIMS="$HEAD_DIMS" "${PREFIX_ARGS[@]}" > "$LOGS/configure.log" 2>&1 \
  || { tail -30 "$LOGS/configure.log"; echo "configure FAILED"; exit 1; }
TARGETS=(flash_attention_test flash_bench api_overhead_bench magi-attn)
# Distributed attention on device tensors (cp = the visible GPUs, 1 here on a one-GPU machine) where NCCL is built.
grep -q "skipped (no NCCL engine)" "$LOGS/configure.log" || TARGETS+=(dist_attn_gpu nccl_engine_gpu)
[ -n "${BUILD_TARGETS:-}" ] && read -r -a TARGETS <<< "$BUILD_TARGETS"
cmake --build "$BUILD" -j"$(nproc)" --target "${TARGETS[@]}" > "$LOGS/build.log" 2>&1 \
  || { grep -E "error|Error" "$LOGS/build.log" | head -40; echo "build FAILED"; exit 1; }
grep -E "spill|ptxas warning" "$LOGS/build.log" | sort -u | head -20
note "build ($ARCH, head dims $HEAD_DIMS): $(( $(date +%s) - t0 )) s"

TEST_BIN="$BUILD/tests/cuda/flash_attention_test"
if [ $RUN_TESTS = 1 ]; then
  t0=$(date +%s)
  # dist_attn_gpu / nccl_engine_gpu run one rank per visible GPU (scripts/dist_gpu_check.sh: the several-GPU run).
  (cd "$BUILD" && ctest -L gpu -j"$(nproc)" --timeout 300 --output-on-failure ${TESTS_REGEX:+-R "$TESTS_REGEX"}) > "$LOGS/tests.log" 2>&1
  rc=$?
  grep -E "non-finite|must be exactly|\) > [0-9.e+-]+ |= [0-9.e+-]+ > [0-9.e+-]+|threw|differ" "$LOGS/tests.log" | cut -c1-420 | sort -u | head -30
  grep -E "\*\*\*Failed|Timeout" "$LOGS/tests.log" | head -30
  # ctest counts a skipped test as passed: the number skipped goes beside it.
  note "gpu tests: $(grep -E 'tests passed' "$LOGS/tests.log" | tail -1), $(grep -c ' (Skipped)$' "$LOGS/tests.log") skipped (rc $rc, $(( $(date +%s) - t0 )) s)"
  if [ "${FUZZ_SECONDS:-0}" -gt 0 ]; then
    fuzz_families=(ffa_sm80)
    grep -q "sm_90a kernels with CUTLASS" "$LOGS/configure.log" && fuzz_families+=(ffa_sm90 ffa_sm90:cat)
    for i in $(seq 1 $(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))); do
      spec=${fuzz_families[$(( i % ${#fuzz_families[@]} ))]}
      ( export MAGI_ATTENTION_KERNEL_BACKEND=${spec%%:*}; [ "${spec#*:}" = cat ] && export MAGI_ATTENTION_CATGQA=1
        timeout "$FUZZ_SECONDS" "$TEST_BIN" --gtest_filter='CudaFuzz.*' --gtest_repeat=-1 > "$LOGS/fuzz_$i.log" 2>&1 ) &
    done
    wait
    grep -h -A4 'Failure$' "$LOGS"/fuzz_*.log | grep -E 'Actual|mask:' | cut -c1-600 | head -20
    note "CudaFuzz for ${FUZZ_SECONDS} s: $(cat "$LOGS"/fuzz_*.log | grep -c '^\[       OK \] CudaFuzz') runs of 12 calls passed, $(cat "$LOGS"/fuzz_*.log | grep -c '^\[  FAILED  \] CudaFuzz') failed"
  fi
  # A per-rank timeline of the device runtime (MAGI_ATTENTION_PROFILE_DIR) and its merge by `magi-attn trace`.
  if [ -x "$BUILD/src/cli/magi-attn" ]; then
    rm -rf "$LOGS/trace" && MAGI_ATTENTION_PROFILE_DIR="$LOGS/trace" timeout 120 "$BUILD/src/cli/magi-attn" dist-demo \
      --tokens 8192 > "$LOGS/dist_demo.txt" 2>&1
    note "dist-demo with MAGI_ATTENTION_PROFILE_DIR: rc $? ($(grep -c . "$LOGS/dist_demo.txt") lines); trace: $("$BUILD/src/cli/magi-attn" trace "$LOGS/trace" 2>&1 | tail -1)"
  else
    note "dist-demo: skipped (magi-attn not among BUILD_TARGETS)"
  fi
fi

if [ $RUN_SANITIZER = 1 ]; then
  t0=$(date +%s)
  # Default backward (dq by atomics) in the Features cases; CudaBackend.DeterministicModeSmallCase: the
  # deterministic backward (two kernels; on Hopper at D 128 the ordered dQ adds).
  # D 256 and both forward tiles: All/Features.MatchReference/d256_fp16, CudaBackend.ForwardTileChoicesMatchReference.
  small='CudaBackend.EmptyMaskGivesZerosAndMinusInf:CudaBackend.DeterministicModeSmallCase:All/Features.MatchReference/d40_bf16:All/Features.MatchReference/sink_sh'
  small+=':All/Features.MatchReference/d256_fp16:CudaBackend.ForwardTileChoicesMatchReference'
  # On sm_90 the forward's pairs of q tiles (a cluster of two blocks multicasting K / V), D 128.
  small+=':CudaBackend.ForwardPairsMatchReferenceAndSingleTiles'
  # Large head dims where built (D 520 in the 576 tile, forward + backward; D 376 / 456 in the 384 / 512 tiles: on
  # sm_90 the Hopper forward's column split, its consumers taking the items in turn with P through shared memory;
  # the deterministic D-split backward).
  small+=':Dims/LargeHeadDim.MatchReference/d520_bf16_random_slices:Dims/LargeHeadDim.MatchReference/d376_bf16_random_slices_sink_sh'
  small+=':Dims/LargeHeadDim.MatchReference/d456_fp16_varlen_mqa_persistent'
  small+=':Dims/LargeHeadDimBackward.MatchesReference/d320_random_bf16_fp32_grads_deterministic'
  # On sm_90 the Hopper backward's clusters (S^T / dP^T parts through distributed shared memory): D 264 in the 320
  # tile (run as 384: uneven dQ columns per role), D 512 with softcap.
  small+=':Dims/LargeHeadDimBackward.MatchesReference/d264_bi_causal_empty_rows_bf16'
  small+=':Dims/LargeHeadDimBackward.MatchesReference/d512_causal_fp16_softcap'
  # Three blocks (D 520 in the 576 tile, two Q / dO stages; D 760 in the 768 tile, one) and four (D 776 in 1024).
  small+=':Dims/LargeHeadDimBackward.MatchesReference/d520_varlen_causal_bf16_ssh_sink'
  small+=':Dims/LargeHeadDimBackward.MatchesReference/d760_causal_fp16_softcap'
  small+=':Dims/LargeHeadDimBackward.MatchesReference/d776_random_fp16_mqa_sh_sink_persistent'
  # D 776 in the 1024 tile: on sm_90 the Hopper forward's clusters (S parts through distributed shared memory).
  small+=':Dims/LargeHeadDim.MatchReference/d776_fp16_random_slices_sink_sh'
  small=${SANITIZE_FILTER:-$small}
  # Once per forward kernel family (the suite's ctest runs are per family too); synccheck for the Hopper one's
  # mbarrier pipelines and named barriers.
  families=(ffa_sm80)
  grep -q "sm_90a kernels with CUTLASS" "$LOGS/configure.log" && families+=(ffa_sm90)
  [ -n "${SANITIZE_FAMILIES:-}" ] && read -r -a families <<< "$SANITIZE_FAMILIES"
  for family in "${families[@]}"; do
    tools=(memcheck racecheck)
    [ $family = ffa_sm90 ] && tools+=(synccheck)
    for tool in "${tools[@]}"; do
      MAGI_ATTENTION_KERNEL_BACKEND=$family timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 "$TEST_BIN" \
        --gtest_filter="$small" > "$LOGS/$tool.$family.log" 2>&1
      note "$tool ($family): rc $? ($(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$LOGS/$tool.$family.log" | tail -1))"
    done
  done
  # The Hopper backward with concatenated q heads (MAGI_ATTENTION_CATGQA): small GQA cases (4 q heads over 2 kv
  # heads at D 8 / 64 / 128, sink, both backward modes).
  if [[ " ${families[*]} " == *" ffa_sm90 "* ]] && [ -z "${SANITIZE_FILTER:-}" ]; then
    cat_cases='CudaBackend.DeterministicModeSmallCase:All/Features.MatchReference/sink_sh'
    cat_cases+=':All/Features.MatchReference/d8_bf16_gqa'
    for tool in memcheck racecheck synccheck; do
      MAGI_ATTENTION_CATGQA=1 MAGI_ATTENTION_KERNEL_BACKEND=ffa_sm90 timeout 300 compute-sanitizer --tool $tool \
        --error-exitcode 9 "$TEST_BIN" --gtest_filter="$cat_cases" > "$LOGS/$tool.catgqa.log" 2>&1
      note "$tool (ffa_sm90, MAGI_ATTENTION_CATGQA=1): rc $? ($(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' \
        "$LOGS/$tool.catgqa.log" | tail -1))"
    done
  fi
  note "sanitizers: $(( $(date +%s) - t0 )) s"
fi

if [ $RUN_PYTHON = 1 ]; then
  # The package as a user installs it (the machine has no network: build dependencies come from the image and
  # build-deps/), built for the visible GPU; then its tests on the GPU and the call-overhead benchmark.
  t0=$(date +%s)
  CMAKE_PREFIX_PATH="$ROOT/build-deps/usr" python3 -m pip install --no-build-isolation --no-deps -v \
    -C "cmake.define.MAGI_ATTN_CUDA_HEAD_DIMS=$HEAD_DIMS" "$ROOT" > "$LOGS/pip_install.log" 2>&1
  rc=$?
  note "pip install . (nproc $(nproc), CUDA $(python3 -c 'import magi_attn; b = magi_attn.build_info(); print(b["cuda_architectures"], "tiles", b["cuda_head_dim_tiles"])' 2>/dev/null)): rc $rc, $(( $(date +%s) - t0 )) s"
  [ $rc = 0 ] || tail -30 "$LOGS/pip_install.log"
  t0=$(date +%s)
  : > "$LOGS/pytest.log"
  for f in "$ROOT"/tests/python/test_*.py; do  # one process a file: a crash shows which file, the rest still run
    (cd /tmp && python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short "$f") >> "$LOGS/pytest.log" 2>&1
    rc=$?
    note "pytest $(basename "$f"): $(grep -E "passed|failed|error" "$LOGS/pytest.log" | tail -1) (rc $rc)"
  done
  grep -E "^(FAILED|ERROR|SKIPPED)|Fatal Python" "$LOGS/pytest.log" | cut -c1-300 | head -30
  note "pytest tests/python: $(( $(date +%s) - t0 )) s"
  python3 "$ROOT/bench/python/call_overhead.py" --cpp "$BUILD/bench/cuda/api_overhead_bench" > "$LOGS/overhead.txt" 2>&1
  note "call overhead rc $?"
  tail -8 "$LOGS/overhead.txt"
fi

if [ $RUN_BENCH = 1 ] && [ $LARGE_D = 1 ]; then
  # Large head dims: the plan's variant (tuned table) and the safe one, then the peers; one table.
  LARGE_DIMS="--dims ${LARGE_BENCH_DIMS:-320,384,512,1024}"
  t0=$(date +%s)
  "$BUILD/bench/cuda/flash_bench" --large-d $LARGE_DIMS --cases "$LOGS/cases.json" > "$LOGS/bench_magi.csv" 2> "$LOGS/bench_magi.err"
  note "flash_bench --large-d rc $? ($(( $(date +%s) - t0 )) s)"
  MAGI_ATTENTION_CUDA_IGNORE_TUNED_CONFIGS=1 "$BUILD/bench/cuda/flash_bench" --large-d $LARGE_DIMS --impl magi_safe \
    > "$LOGS/bench_magi_safe.csv" 2>> "$LOGS/bench_magi.err"
  # The portable family beside the plan's (on sm_90 the Hopper forward up to D 512).
  "$BUILD/bench/cuda/flash_bench" --large-d $LARGE_DIMS --family sm80 --impl magi_sm80 \
    > "$LOGS/bench_magi_sm80.csv" 2>> "$LOGS/bench_magi.err"
  grep -E "^# magi" "$LOGS/bench_magi.err" | sort -u | head -30
  PEER_ARGS=(--large-d)
  [ $RUN_PEERS = 1 ] || PEER_ARGS=(--skip-all)
  timeout "${PEERS_TIMEOUT:-900}" python3 "$ROOT/scripts/bench_peers.py" "$LOGS/cases.json" "${PEER_ARGS[@]}" \
    > "$LOGS/bench_peers.csv" 2> "$LOGS/bench_peers.err"
  note "peers rc $? ($(( $(date +%s) - t0 )) s); $(grep -c '^#' "$LOGS/bench_peers.err") peer errors"
  grep '^#' "$LOGS/bench_peers.err" | cut -c1-300 | head -10
  python3 - "$LOGS/bench_magi.csv" "$LOGS/bench_magi_safe.csv" "$LOGS/bench_magi_sm80.csv" "$LOGS/bench_peers.csv" \
    <<'PY' | tee "$LOGS/table.txt"
import csv, sys
rows, order = {}, []
for path in sys.argv[1:]:
    for r in csv.DictReader(l for l in open(path) if not l.startswith("#")):
        key = (r["mask"], int(r["head_dim"]))
        if key not in rows: rows[key] = {}; order.append(key)
        rows[key][r["impl"]] = (float(r["fwd_tflops"]), float(r["bwd_tflops"]))
impls = ["magi", "magi_safe", "magi_sm80", "sdpa_mem", "ffpa"]
print("\nTFLOP/s fwd/bwd (bf16, 16 heads, 1 x 8k tokens; varlen causal: long-tailed documents), same GPU, same run")
print(f"{'mask':16s} {'D':>5s} " + " ".join(f"{i:>13s}" for i in impls))
for key in order:
    cells = []
    for i in impls:
        v = rows[key].get(i)
        cells.append(f"{v[0]:6.0f}/{v[1]:<6.0f}" if v else f"{'-':>13s}")
    print(f"{key[0]:16s} {key[1]:5d} " + " ".join(cells))
PY
elif [ $RUN_BENCH = 1 ]; then
  t0=$(date +%s)
  PEER_ARGS=()
  BENCH_ARGS=(--deterministic)
  [ $QUICK = 1 ] && BENCH_ARGS+=(--quick)
  "$BUILD/bench/cuda/flash_bench" --cases "$LOGS/cases.json" "${BENCH_ARGS[@]}" > "$LOGS/bench_magi.csv" 2> "$LOGS/bench_magi.err"
  note "flash_bench rc $? ($(( $(date +%s) - t0 )) s)"
  # The API's default grids (SM margin 4 while CUDA_DEVICE_MAX_CONNECTIONS > 1): persistent kernels, D 128.
  "$BUILD/bench/cuda/flash_bench" --quick --sm-margin 4 --impl magi_m4 > "$LOGS/bench_magi_m4.csv" 2>> "$LOGS/bench_magi.err"
  # The portable forward beside the default (the Hopper one on sm_90): the A/B of the two kernel families.
  "$BUILD/bench/cuda/flash_bench" --quick --family sm80 --impl magi_sm80 > "$LOGS/bench_magi_sm80.csv" 2>> "$LOGS/bench_magi.err"
  # 16 sequences of 1k tokens (the same total): short-sequence rate against the 2 x 8k one.
  "$BUILD/bench/cuda/flash_bench" --quick --seq 1024 --batch 16 --impl magi_16x1k > "$LOGS/bench_magi_16x1k.csv" 2>> "$LOGS/bench_magi.err"
  grep -E "^# magi " "$LOGS/bench_magi.err" | sort -u | head -30
  [ $RUN_PEERS = 1 ] || PEER_ARGS=(--skip-all)
  python3 "$ROOT/scripts/bench_peers.py" "$LOGS/cases.json" "${PEER_ARGS[@]}" > "$LOGS/bench_peers.csv" 2> "$LOGS/bench_peers.err"
  note "peers rc $? ($(( $(date +%s) - t0 )) s); $(grep -c '^#' "$LOGS/bench_peers.err") peer errors"
  python3 - "$LOGS/bench_magi.csv" "$LOGS/bench_magi_m4.csv" "$LOGS/bench_magi_sm80.csv" "$LOGS/bench_magi_16x1k.csv" \
    "$LOGS/bench_peers.csv" <<'PY' | tee "$LOGS/table.txt"
import csv, sys
rows = {}
order = []
for path in sys.argv[1:]:
    for r in csv.DictReader(l for l in open(path) if not l.startswith("#")):
        key = (r["mask"], int(r["head_dim"]))
        if key not in rows: rows[key] = {}; order.append(key)
        rows[key][r["impl"]] = (float(r["fwd_tflops"]), float(r["bwd_tflops"]))
impls = ["magi", "magi_det", "magi_m4", "magi_sm80", "magi_16x1k", "sdpa_cudnn", "sdpa_flash", "flex"]
print("\nTFLOP/s fwd/bwd (bf16, 16 heads, 2x8k tokens; magi_16x1k: 16x1k), same GPU, same run")
print(f"{'mask':26s} {'D':>4s} " + " ".join(f"{i:>13s}" for i in impls))
for key in order:
    cells = []
    for i in impls:
        v = rows[key].get(i)
        cells.append(f"{v[0]:6.0f}/{v[1]:<6.0f}" if v else f"{'-':>13s}")
    print(f"{key[0]:26s} {key[1]:4d} " + " ".join(cells))
PY
  # The ratios against cuDNN on full and causal, ours and cuDNN in turn for PAIR_ROUNDS rounds: one measurement
  # moves by up to ~10% with what the power cap's controller saw before it (docs/performance.md, 2026-11-28).
  if [ $RUN_PEERS = 1 ] && [ "${PAIR_ROUNDS:-3}" -gt 0 ]; then
    t0=$(date +%s)
    python3 -c 'import json, sys; s = json.load(open(sys.argv[1])); s["cases"] = [c for c in s["cases"] if c["name"] in ("full", "causal")]; print(json.dumps(s))' \
      "$LOGS/cases.json" > "$LOGS/cases_pairs.json"
    rm -f "$LOGS/pairs.csv"
    PAIR_ARGS=(--only full,causal)
    [ $QUICK = 1 ] && PAIR_ARGS+=(--quick)
    for round in $(seq "${PAIR_ROUNDS:-3}"); do
      "$BUILD/bench/cuda/flash_bench" "${PAIR_ARGS[@]}" 2>> "$LOGS/bench_magi.err" \
        | grep -v '^impl' >> "$LOGS/pairs.csv"
      python3 "$ROOT/scripts/bench_peers.py" "$LOGS/cases_pairs.json" --no-flex 2>> "$LOGS/bench_peers.err" \
        | grep '^sdpa_cudnn' >> "$LOGS/pairs.csv"
    done
    python3 - "$LOGS/pairs.csv" <<'PY' | tee -a "$LOGS/table.txt"
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    impl, mask, _, d, fwd, bwd = line.strip().split(",")[:6]
    runs.setdefault((mask, int(d)), {}).setdefault(impl, []).append((float(fwd), float(bwd)))
print("\nours and cuDNN in turn, median [min-max] over the rounds, TFLOP/s; ratio of the medians")
print(f"{'mask':8s} {'D':>4s} {'magi fwd':>16s} {'cudnn fwd':>16s} {'ratio':>6s} {'magi bwd':>16s} {'cudnn bwd':>16s} {'ratio':>6s}")
for (mask, d), by in sorted(runs.items(), key=lambda x: (x[0][1], x[0][0])):
    if "magi" not in by or "sdpa_cudnn" not in by: continue
    cell = lambda v: f"{statistics.median(v):4.0f} [{min(v):3.0f}-{max(v):3.0f}]"
    out = f"{mask:8s} {d:4d}"
    for k in (0, 1):
        m, c = [x[k] for x in by["magi"]], [x[k] for x in by["sdpa_cudnn"]]
        out += f" {cell(m):>16s} {cell(c):>16s} {statistics.median(m) / statistics.median(c):5.2f}x"
    print(out)
PY
    note "paired rounds: ${PAIR_ROUNDS:-3} ($(( $(date +%s) - t0 )) s)"
  fi
fi
if [ $RUN_PROFILE = 1 ]; then
  # One forward launch per mask after flash_bench's warm-up (launches 1-3); clocks left alone.
  t0=$(date +%s)
  metrics=gpu__time_duration.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active
  metrics+=,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active
  metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
  metrics+=,launch__registers_per_thread,regex:smsp__warp_issue_stalled_.*_per_warp_active\.pct
  for mask in full causal varlen_causal; do
    timeout 300 ncu --clock-control none -k 'regex:^forward_kernel$' --launch-skip 3 --launch-count 1 \
      --metrics "$metrics" --csv --page raw "$BUILD/bench/cuda/flash_bench" --only $mask --dims 128 --reps 1 \
      > "$LOGS/ncu_$mask.csv" 2> "$LOGS/ncu_$mask.err"
    note "ncu $mask: rc $?"
  done
  python3 - "$LOGS"/ncu_full.csv "$LOGS"/ncu_causal.csv "$LOGS"/ncu_varlen_causal.csv <<'PY' | tee "$LOGS/profile.txt"
import csv, sys
for path in sys.argv[1:]:
    lines = [l for l in open(path) if l.startswith('"')]
    if len(lines) < 3:
        print(path, ": no profile rows"); continue
    rows = list(csv.reader(lines))
    head, vals = rows[0], rows[2]
    m = {h: v for h, v in zip(head, vals)}
    f = lambda k: float(m[k].replace(",", "")) if k in m and m[k] not in ("", "n/a") else float("nan")
    print(f"{path.split('ncu_')[-1][:-4]}: {f('gpu__time_duration.sum') / 1e3:.1f} us, regs {m.get('launch__registers_per_thread')}, "
          f"tensor pipe {f('sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active'):.1f}%, "
          f"issue active {f('smsp__issue_active.avg.pct_of_peak_sustained_active'):.1f}%, "
          f"warps active {f('sm__warps_active.avg.pct_of_peak_sustained_active'):.1f}%, "
          f"dram {f('dram__throughput.avg.pct_of_peak_sustained_elapsed'):.1f}%, "
          f"smem bank conflicts {m.get('l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum')}")
    stalls = sorted(((f(k), k[len('smsp__warp_issue_stalled_'):-len('_per_warp_active.pct')]) for k in head
                     if k.startswith('smsp__warp_issue_stalled_')), reverse=True)
    print("  stalls (% of active warp cycles): " + ", ".join(f"{n} {v:.1f}" for v, n in stalls[:8]))
PY
  note "profile: $(( $(date +%s) - t0 )) s"
fi

echo
[ -f "$LOGS/overhead.txt" ] && tail -7 "$LOGS/overhead.txt"
for s in "${SUMMARY[@]}"; do echo "$s"; done
