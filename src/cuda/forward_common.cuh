// Pieces of the forward shared by the kernel families. They work on one warp's 16-row strip in the mma fragment
// layout, which mma.sync and wgmma accumulators share: this lane holds rows row0 and row0 + 8 (r = 0, 1) and
// columns 8 i + 2 (lane % 4) + c of each 8-column block i, as x[i][2 r + c].
#pragma once

#include <cfloat>
#include <climits>

#include "common/lse_merge.hpp"
#include "cuda/kernel_common.cuh"

namespace magi::cuda::detail {

// Softcapped logits of one m-tile, in log2 units. Without softcap the logits stay raw: the scale is folded
// into the exp2 argument (one FFMA per element) and into the row maxima.
template <int kNBlocks>
__device__ __forceinline__ void softcap_logits(float (&s)[kNBlocks][4], const FwdParams& p) {
#pragma unroll
  for (int nb = 0; nb < kNBlocks; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nb][e] = p.softcap_post * tanhf(s[nb][e] * p.softcap_pre);
}

// Logits of cells outside the rows' kept keys (keys[r]: row r's interval; k0: the strip's first key) to -inf.
template <int kNBlocks>
__device__ __forceinline__ void mask_cells(float (&s)[kNBlocks][4], const KeyInterval (&keys)[2], int k0, int lane) {
#pragma unroll
  for (int nb = 0; nb < kNBlocks; ++nb) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = k0 + nb * 8 + (lane % 4) * 2 + (e % 2);
      if (!keys[e / 2].contains(col)) s[nb][e] = -INFINITY;
    }
  }
}

// The epilogue of a strip: rows normalised, the sink folded in, the previous partial result merged, out / lse
// written.
// row_max in logit units (times logit_scale: log2 units); row_sum is this lane's partial sum (the quad adds them).
// block_max collects the rows' maxima in log2 units for max_logits.
// Column-split accumulators (forward_large_kernel.cuh) pass their first column col0 and their width `cols`, and
// take the rows' lse in lse_rows instead of having it stored (several warps share a row and must all read
// prev_lse before one of them overwrites it); prev_lse_rows, where given, are the rows' prev_lse read earlier.
template <class T, int kDBlocks>
__device__ __forceinline__ void finish_forward_rows(const FwdParams& p, float (&acc)[kDBlocks][4],
                                                    const float (&row_max)[2], const float (&row_sum)[2],
                                                    float logit_scale, int row0, int head, int lane,
                                                    float& block_max, int col0 = 0, int cols = kDBlocks * 8,
                                                    float* lse_rows = nullptr, const float* prev_lse_rows = nullptr,
                                                    int row_end = INT_MAX) {
  const int64_t q_stride = int64_t{p.hq} * p.d;
  row_end = min(row_end, p.tq);  // rows from it on are another tile's (aligned tiles) or past the tensor
  const int col_end = min(p.d - col0, cols);  // this accumulator's columns that exist
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = row0 + r * 8;
    const bool has_keys = sum > 0.0f;
    const float row_max2 = row_max[r] * logit_scale;  // log2 units
    block_max = fmaxf(block_max, row_max2);
    float lse2 = has_keys ? row_max2 + log2f(sum) : -INFINITY;
    float factor = has_keys ? 1.0f / sum : 0.0f;
    if (p.sink_kind != kSinkNone && row < row_end) {
      // lse~ = log(exp(lse) + sum_s exp(sink_s)), in log2 units here.
      auto sink_at = [&](int si) {
        const int64_t index = p.sink_kind == kSinkSH ? int64_t{si} * p.hq + head
                                                      : (int64_t{row} * p.sink_len + si) * p.hq + head;
        return p.sink[index] * kLog2e;
      };
      float hi = lse2;
      for (int si = 0; si < p.sink_len; ++si) hi = fmaxf(hi, sink_at(si));
      if (hi == -INFINITY) hi = 0.0f;  // no keys and every sink -inf: the row stays empty
      float total = has_keys ? exp2f(lse2 - hi) : 0.0f;
      for (int si = 0; si < p.sink_len; ++si) total += exp2f(sink_at(si) - hi);
      const float merged = total > 0.0f ? hi + log2f(total) : -INFINITY;
      if (has_keys) factor *= exp2f(lse2 - merged);
      lse2 = merged;
    }
    float lse = lse2 * kLn2, w_prev = 0.0f;
    if (p.prev_out != nullptr && row < row_end) {
      const MergeWeights<float> w =
          merge_weights(lse, prev_lse_rows != nullptr ? prev_lse_rows[r] : p.prev_lse[int64_t{row} * p.hq + head]);
      lse = w.lse;
      factor *= w.w1;
      w_prev = w.w2;
    }
    __syncwarp();  // the row's four lanes have read prev_lse before lane 0 overwrites it (it may be lse)
    const bool row_valid = row < row_end;
    if (row_valid) {
      const int64_t base = int64_t{row} * q_stride + int64_t{head} * p.d + col0;
      if (lse_rows != nullptr) lse_rows[r] = lse;
      else if (lane % 4 == 0) p.lse[int64_t{row} * p.hq + head] = lse;
      // The row's whole partial result is loaded before the first store: out may alias prev_out, so the
      // compiler may not move a load above an earlier store, and interleaving them costs one memory
      // latency per element pair (measured: ~0.75 ms per merge stage at 16k rows x 64 heads).
      if (w_prev != 0.0f) {
        float2 prev[kDBlocks];
#pragma unroll
        for (int i = 0; i < kDBlocks; ++i) {
          const int col = i * 8 + (lane % 4) * 2;
          prev[i] = col < col_end ? *reinterpret_cast<const float2*>(p.prev_out + base + col) : make_float2(0.f, 0.f);
        }
#pragma unroll
        for (int i = 0; i < kDBlocks; ++i) {
          acc[i][2 * r] = fmaf(w_prev, prev[i].x, acc[i][2 * r] * factor);
          acc[i][2 * r + 1] = fmaf(w_prev, prev[i].y, acc[i][2 * r + 1] * factor);
        }
        factor = 1.0f;
      }
    }
    store_row_blocks<T, kDBlocks>(p.out, int64_t{row} * q_stride + int64_t{head} * p.d + col0, acc, r, factor, col_end,
                                  p.out_fp32, row_valid, lane);
  }
}

// The plain epilogue (out in the input dtype, no sink, no previous result): row r's lse stored, its 1 / sum returned
// (0 for a row without keys). Kernels that specialise on it skip the general epilogue's code, which costs instruction
// fetch even where its branches are not taken (Hopper forward, D 128: ~1700 cycles a work).
// kApprox: the hardware's approximate log2 and reciprocal (sum >= 1 where the row has keys: its largest term is at
// least 1) instead of the library's, whose range handling is ~80 instructions a row, run once a work from a cold
// instruction cache. A/B (H200, Hopper forward): D 64 +1..+4%, D 256 +1..+3%; D 128, whose factors run under its last
// P V, -3% causal (code placement), so it keeps the library's.
template <bool kApprox = false>
__device__ __forceinline__ float plain_row_factor(const FwdParams& p, float row_sum, float row_max, float logit_scale,
                                                  int row, int head, int lane, float& block_max, int row_end) {
  float sum = row_sum;
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  const bool has_keys = sum > 0.0f;
  const float row_max2 = row_max * logit_scale;  // log2 units
  block_max = fmaxf(block_max, row_max2);
  if (row < row_end && lane % 4 == 0)
    p.lse[int64_t{row} * p.hq + head] =
        has_keys ? (row_max2 + (kApprox ? __log2f(sum) : log2f(sum))) * kLn2 : -INFINITY;
  return has_keys ? (kApprox ? __fdividef(1.0f, sum) : 1.0f / sum) : 0.0f;
}

// plain_row_factor of this thread's two rows (row0, row0 + 8).
template <bool kApprox>
__device__ __forceinline__ void plain_row_factors(const FwdParams& p, const float (&row_max)[2],
                                                  const float (&row_sum)[2], float logit_scale, int row0, int head,
                                                  int lane, float& block_max, float (&factor)[2],
                                                  int row_end = INT_MAX) {
  row_end = min(row_end, p.tq);
#pragma unroll
  for (int r = 0; r < 2; ++r)
    factor[r] = plain_row_factor<kApprox>(p, row_sum[r], row_max[r], logit_scale, row0 + 8 * r, head, lane, block_max,
                                          row_end);
}

// The plain epilogue's out from registers (factor: plain_row_factors).
template <class T, int kDBlocks>
__device__ __forceinline__ void store_plain_rows(const FwdParams& p, const float (&acc)[kDBlocks][4],
                                                 const float (&factor)[2], int row0, int head, int lane,
                                                 int row_end = INT_MAX) {
  const int64_t q_stride = int64_t{p.hq} * p.d;
  row_end = min(row_end, p.tq);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + r * 8;
    store_row_blocks<T, kDBlocks>(p.out, int64_t{row} * q_stride + int64_t{head} * p.d, acc, r, factor[r],
                                  min(p.d, kDBlocks * 8), false, row < row_end, lane);
  }
}

// The warp's largest row maximum (log2 units) into max_logits[head] (natural log), order-independent.
__device__ __forceinline__ void publish_max_logits(const FwdParams& p, float block_max, int head, int lane) {
  if (p.max_logits == nullptr) return;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, offset));
  if (lane == 0 && block_max > -INFINITY) atomic_max_float(p.max_logits + head, block_max * kLn2);
}

}  // namespace magi::cuda::detail
