#!/usr/bin/env bash
# scratch A/B (not committed): base (HEAD) vs all-only vs new (working tree)
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/abo}
PFX=-DCMAKE_PREFIX_PATH=$ROOT/build-deps/usr
build_one() {  # tree build_dir
  cmake -S $1 -B $2 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMAGI_ATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DMAGI_ATTN_CUDA_HEAD_DIMS=128 $PFX > $2.cfg.log 2>&1 && cmake --build $2 -j8 --target flash_bench > $2.build.log 2>&1
  echo "built $1 rc $?"
}
build_one $ROOT/ab_base /tmp/b_base &

OUT=$OUT/check BUILD_DIR=/tmp/bg scripts/gpu_check.sh --arch 90a --skip-bench 2>&1 | grep -v "ptxas warning" | tail -12
wait
for r in 1 2; do
  for t in base new; do
    B=/tmp/b_$t/bench/cuda/flash_bench; [ $t = new ] && B=/tmp/bg/bench/cuda/flash_bench
    $B --quick --reps 30 --impl $t 2>/dev/null | grep -v "^impl"
  done
done | sort -t, -k2,2 -s | tee $OUT/ab.csv
for t in base new; do
  B=/tmp/b_$t/bench/cuda/flash_bench; [ $t = new ] && B=/tmp/bg/bench/cuda/flash_bench
  $B --quick --reps 30 --sm-margin 4 --impl ${t}_m4 2>/dev/null | grep -v "^impl"
done | sort -t, -k2,2 -s
if command -v nsys >/dev/null; then
  for t in base new; do
    B=/tmp/b_$t/bench/cuda/flash_bench; [ $t = new ] && B=/tmp/bg/bench/cuda/flash_bench
    nsys profile -o /tmp/ns_$t --force-overwrite true $B --only varlen_causal --dims 128 --reps 10 > /dev/null 2>&1
    nsys stats -r cuda_gpu_kern_sum,cuda_gpu_mem_time_sum -f csv /tmp/ns_$t.nsys-rep 2>/dev/null | cut -d, -f1-4,9 | cut -c1-150 | head -24
  done
fi
