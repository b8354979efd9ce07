#!/usr/bin/env bash
# scratch: ncu of forward and backward kernels on full vs varlen causal (not committed)
set -u
export BUILD_DIR=/tmp/bn
for m in full varlen_causal; do
  for k in forward_kernel dkdv_kernel; do
    OUT=/tmp/prof/$m-$k scripts/profile_ncu.sh --skip-peer --mask $m --kernels "$k" > /dev/null 2>&1
    echo "== $m $k rc $?"; cp /tmp/prof/$m-$k/ncu_magi.txt $OUT/$m-$k.txt
  done
done
B=/tmp/bn/bench/cuda/flash_bench
for m in full varlen_causal; do
  MAGI_ATTENTION_PROFILE_MODE=1 $B --only $m --dims 128 --reps 3 2>&1 | grep -v "^\s*$" | tail -12
done
$B --only varlen_causal --dims 128 --reps 30 2>&1 | tail -3
$B --only full --dims 128 --reps 30 2>&1 | tail -3
