// Device building blocks shared by the kernel families: exp2, the online softmax, a row's kept keys of a work item,
// float atomics, and the stores of accumulator rows in the mma fragment layout (mma.sync and wgmma alike). The
// portable family's sm_80 instructions are in src/cuda/sm80/mma.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/params.hpp"

namespace magi::cuda::detail {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x in one MUFU instruction (flush-to-zero; 2^-inf = 0). The softmax terms never need denormals.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// Two floats as one 32-bit register of two 16-bit values (round to nearest), the first in the low half.
template <class T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack_pair<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack_pair<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The persistent grids' schedule: block b starts with work b, then claims the next unclaimed index from the launch's
// counter (zeroed before it), so the plan's order (heavy tiles first) is kept and blocks balance dynamically. Each
// work is computed the same way whichever block takes it, so results do not depend on the schedule.
__device__ __forceinline__ int first_work_index() { return static_cast<int>(blockIdx.x); }
__device__ __forceinline__ int claim_work_index(int32_t* counter) {
  return atomicAdd(counter, 1) + static_cast<int>(gridDim.x);
}
// The loop of a block whose threads all run each work (body(linear)); the next work may reuse shared memory.
template <class Body>
__device__ __forceinline__ void for_each_work(int num_work, int32_t* counter, Body&& body) {
  __shared__ int next_work;
  int linear = first_work_index();
  while (linear < num_work) {
    body(linear);
    if (threadIdx.x == 0) next_work = claim_work_index(counter);
    __syncthreads();
    linear = next_work;
    __syncthreads();
  }
}

// The second half of an online-softmax step for row half r, once its new maximum mx (>= row_max[r], logit units) is
// known: s becomes the exp2 terms, this lane's row_sum is rescaled and grows, scale_old[r] is the accumulator's
// factor. Also used where the maximum is combined across warps (forward_large_kernel.cuh).
template <int kNBlocks>
__device__ __forceinline__ void softmax_row_terms(float (&s)[kNBlocks][4], float (&row_max)[2], float (&row_sum)[2],
                                                  float (&scale_old)[2], float logit_scale, int r, float mx) {
  const float mx_finite = mx == -INFINITY ? 0.0f : mx;
  const float base = mx_finite * logit_scale;  // log2 units
  // The difference first: exactly 1 while the maximum stands (a contracted x * s - round(x * s) is not 0), so
  // an item that leaves a row unchanged changes nothing and skipping its rescale is bitwise neutral.
  scale_old[r] = fast_exp2((row_max[r] - mx_finite) * logit_scale);
  row_max[r] = mx;
  float sum = 0.0f;
#pragma unroll
  for (int nb = 0; nb < kNBlocks; ++nb) {
    s[nb][2 * r] = fast_exp2(fmaf(s[nb][2 * r], logit_scale, -base));
    s[nb][2 * r + 1] = fast_exp2(fmaf(s[nb][2 * r + 1], logit_scale, -base));
    sum += s[nb][2 * r] + s[nb][2 * r + 1];
  }
  row_sum[r] = row_sum[r] * scale_old[r] + sum;
}

// One online-softmax step for this lane's two rows (r = 0: row0, r = 1: row0 + 8) of a strip of kNBlocks 8-column
// blocks of logits s (the mma fragment layout: s[i][2 r + c], column 8 i + 2 (lane % 4) + c), raw or in log2 units
// (softcapped): new row maxima (with kLazy, a row keeps its stale maximum until a logit exceeds it by more than
// max_slack: FA4's lazy rescale, which leaves most scales at exactly 1), s becomes the exp2 terms, this lane's
// row_sum is rescaled and grows; scale_old is what the accumulator must be multiplied by. The quad holding a row
// (lanes 4 i .. 4 i + 3) agrees on its maximum.
template <int kNBlocks, bool kLazy>
__device__ __forceinline__ void online_softmax(float (&s)[kNBlocks][4], float (&row_max)[2], float (&row_sum)[2],
                                               float (&scale_old)[2], float logit_scale, float max_slack) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = row_max[r];
#pragma unroll
    for (int nb = 0; nb < kNBlocks; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * r], s[nb][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // The new maximum only when it grows past the slack (-inf + slack stays -inf: a first key always counts).
    if constexpr (kLazy) {
      if (mx <= row_max[r] + max_slack) mx = row_max[r];
    }
    softmax_row_terms(s, row_max, row_sum, scale_old, logit_scale, r, mx);
  }
}

struct KeyInterval {
  int lo, hi;
  __device__ __forceinline__ bool contains(int k) const { return k >= lo && k < hi; }
};
__device__ __forceinline__ KeyInterval item_keys(const WorkItem& w, int q) {
  int lo = w.k0, hi = w.k1;
  if (w.flags & kWorkCausal) hi = min(hi, q + w.causal_offset + 1);
  if (w.flags & kWorkInv) lo = max(lo, q + w.inv_offset);
  if (q < w.q0 || q >= w.q1) hi = lo;
  return {lo, hi};
}
// Whether this keeps none / all of keys [k0, k1).
__device__ __forceinline__ bool keeps_none(KeyInterval keys, int k0, int k1) { return max(keys.lo, k0) >= min(keys.hi, k1); }
__device__ __forceinline__ bool keeps_all(KeyInterval keys, int k0, int k1) { return keys.lo <= k0 && keys.hi >= k1; }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Hopper's vector reduction, predicated rather than branched: a branch per atomic let the compiler sink (and
// recompute) the address math into every branch.
__device__ __forceinline__ void red_add_v4(float* address, float4 v, bool enabled) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n @p red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n}\n" ::"l"(address),
      "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(static_cast<int>(enabled))
      : "memory");
}
#endif

// Float atomic max via the integer orderings of IEEE floats (init the target to -inf).
__device__ __forceinline__ void atomic_max_float(float* address, float value) {
  if (value >= 0.0f) atomicMax(reinterpret_cast<int*>(address), __float_as_int(value));
  else atomicMin(reinterpret_cast<unsigned int*>(address), __float_as_uint(value));
}

// Lanes q = 0..3 of a quad each hold one W-word element of blocks 0..3 (the element of columns [2 q, 2 q + 2) of
// an 8-column block); afterwards lane q holds all four elements of block q, in lane order. Two butterfly rounds.
template <int W>
__device__ __forceinline__ void quad_transpose(uint32_t (&e)[4][W], int lane) {
  const bool b1 = lane & 2, b0 = lane & 1;
  uint32_t a[4][W];  // after round 1: a[2 x + y] = the element of block 2 b1 + y from the lane whose bit 1 is x
#pragma unroll
  for (int y = 0; y < 2; ++y)
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const uint32_t own = b1 ? e[2 + y][w] : e[y][w];
      const uint32_t got = __shfl_xor_sync(0xffffffffu, b1 ? e[y][w] : e[2 + y][w], 2);
      a[y][w] = b1 ? got : own;
      a[2 + y][w] = b1 ? own : got;
    }
#pragma unroll
  for (int x = 0; x < 2; ++x)
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const uint32_t own = b0 ? a[2 * x + 1][w] : a[2 * x][w];
      const uint32_t got = __shfl_xor_sync(0xffffffffu, b0 ? a[2 * x][w] : a[2 * x + 1][w], 1);
      e[2 * x][w] = b0 ? got : own;
      e[2 * x + 1][w] = b0 ? own : got;
    }
}

// Row half r of an m-tile's accumulator fragments (this lane's columns 8 i + 2 (lane % 4) + {0, 1} of block i:
// acc[i][2 r], acc[i][2 r + 1]), times `scale`, to the row at element `index` of `base` (its column 0; 16-byte
// aligned). Each quad trades its fragments so that a lane writes whole 8-column blocks, 16 bytes of 16-bit
// values or 32 of fp32: a quarter of the store instructions of element pairs and no half-written sectors (the
// pair stores took a quarter of the dk/dv kernel's time with short documents, each waiting for the one before
// it to release the register it reused). Blocks from column `cols` (a multiple of 8) on and rows whose `keep` is
// false are not written; every lane of the warp must call it (the shuffles).
template <class T, int kBlocks>
__device__ __forceinline__ void store_row_blocks(void* base, int64_t index, const float (&acc)[kBlocks][4], int r,
                                                 float scale, int cols, bool fp32, bool keep, int lane) {
  static_assert(kBlocks % 4 == 0, "whole groups of four 8-column blocks");
#pragma unroll
  for (int g = 0; g < kBlocks / 4; ++g) {
    const int col = (4 * g + lane % 4) * 8;  // this lane's block of the group
    const bool write = keep && col < cols;
    if (fp32) {
      uint32_t e[4][2];
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        e[b][0] = __float_as_uint(acc[4 * g + b][2 * r] * scale);
        e[b][1] = __float_as_uint(acc[4 * g + b][2 * r + 1] * scale);
      }
      quad_transpose<2>(e, lane);
      if (write) {
        uint4* const at = reinterpret_cast<uint4*>(static_cast<float*>(base) + index + col);
        at[0] = make_uint4(e[0][0], e[0][1], e[1][0], e[1][1]);
        at[1] = make_uint4(e[2][0], e[2][1], e[3][0], e[3][1]);
      }
    } else {
      uint32_t e[4][1];
#pragma unroll
      for (int b = 0; b < 4; ++b) e[b][0] = pack_pair<T>(acc[4 * g + b][2 * r] * scale, acc[4 * g + b][2 * r + 1] * scale);
      quad_transpose<1>(e, lane);
      if (write)
        *reinterpret_cast<uint4*>(static_cast<T*>(base) + index + col) = make_uint4(e[0][0], e[1][0], e[2][0], e[3][0]);
    }
  }
}

template <class T>
__device__ __forceinline__ void store_pair(void* base, int64_t index, float a, float b, bool fp32) {
  if (fp32) {
    *reinterpret_cast<float2*>(static_cast<float*>(base) + index) = make_float2(a, b);
  } else {
    *reinterpret_cast<uint32_t*>(static_cast<T*>(base) + index) = pack_pair<T>(a, b);
  }
}

}  // namespace magi::cuda::detail
