// Warp-level building blocks of the portable kernels: sm_80 tensor-core instructions (mma.sync
// m16n8k16, ldmatrix, cp.async) and the swizzled shared-memory tile layout they read.
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

// 16-byte asynchronous copy; `valid` false writes zeros (src-size 0, nothing is read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <class T>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

// A tile of kRows x kCols 16-bit values, row-major, 16-byte chunks XOR-swizzled by (row % 8) so that the
// 8 row addresses of one ldmatrix phase hit 8 different bank groups. kCols is a multiple of 64.
template <int kCols>
struct Swizzled {
  static_assert(kCols % 64 == 0, "swizzle needs at least 8 chunks of 16 bytes per row");
  static __device__ __forceinline__ uint32_t offset(int row, int col) {  // bytes; col multiple of 8
    const int chunk = (col >> 3) ^ (row & 7);
    return static_cast<uint32_t>(row * kCols * 2 + chunk * 16);
  }
  // Element offset (bytes) for any column.
  static __device__ __forceinline__ uint32_t element(int row, int col) {
    return offset(row, col & ~7) + (col & 7) * 2;
  }
};

// Per-thread ldmatrix addresses into a Swizzled<kCols> tile, with the XOR folded into 4 registers so that
// every fragment address is base + compile-time immediate + sw[k % 4] (no per-fragment index math, few
// registers). The thread supplies the tile row it addresses (row % 8 == lane % 8 in every ldmatrix
// pattern used here) and its first 16-byte chunk (even chunk + the pattern's chunk bit).
template <int kCols>
struct FragAddr {
  uint32_t base;
  uint32_t sw[4];
  __device__ __forceinline__ FragAddr(uint32_t tile, int thread_row, int chunk0) {
    base = tile + static_cast<uint32_t>(thread_row * kCols * 2);
    const int r = thread_row & 7;
#pragma unroll
    for (int j = 0; j < 4; ++j) sw[j] = static_cast<uint32_t>(((chunk0 + 2 * j) ^ r) * 16);
  }
  // Fragment for tile rows + row_offset (a multiple of 8, compile-time) and columns [16k, 16k + 16).
  __device__ __forceinline__ uint32_t at(int row_offset, int k) const {
    return base + row_offset * kCols * 2 + (k / 4) * 128 + sw[k % 4];
  }
};

// Copies rows [0, kRows) x cols [0, kCols) of a strided global tile into a swizzled shared tile.
// Rows >= rows_valid and columns >= cols_valid become zeros. `fallback` is any valid global address.
// When each pass of the threads covers a multiple of 8 whole rows, a thread keeps its column chunk and its
// row's swizzle in every pass: its addresses are one base + a pass immediate (few live registers).
template <int kRows, int kCols, int kThreads, class T>
__device__ __forceinline__ void load_tile_async(uint32_t smem, const T* global, int64_t row_stride, int rows_valid,
                                                int cols_valid, const T* fallback) {
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kTotal = kRows * kChunksPerRow;
  static_assert(kTotal % kThreads == 0, "tile must divide evenly among threads");
  if constexpr (kThreads % kChunksPerRow == 0 && (kThreads / kChunksPerRow) % 8 == 0) {
    constexpr int kRowsPerPass = kThreads / kChunksPerRow;
    const int row0 = static_cast<int>(threadIdx.x) / kChunksPerRow;
    const int col = (static_cast<int>(threadIdx.x) % kChunksPerRow) * 8;
    const uint32_t dst = smem + Swizzled<kCols>::offset(row0, col);
    const T* src = global + row0 * row_stride + col;
    const bool col_valid = col < cols_valid;
#pragma unroll
    for (int i = 0; i < kTotal / kThreads; ++i) {
      const bool valid = col_valid && row0 + i * kRowsPerPass < rows_valid;
      cp_async16(dst + i * kRowsPerPass * kCols * 2, valid ? src + i * kRowsPerPass * row_stride : fallback, valid);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kTotal / kThreads; ++i) {
      const int index = i * kThreads + static_cast<int>(threadIdx.x);
      const int row = index / kChunksPerRow;
      const int col = (index % kChunksPerRow) * 8;
      const bool valid = row < rows_valid && col < cols_valid;
      const T* src = valid ? global + row * row_stride + col : fallback;
      cp_async16(smem + Swizzled<kCols>::offset(row, col), src, valid);
    }
  }
}

// load_tile_async for a loop that loads many tiles of one tensor with one row stride: the thread's offsets
// are computed once, so each tile costs one pointer add plus a compare and a 64-bit add per pass (the
// backward's Q/dO loads were ~150 instructions per thread and chunk).
template <int kRows, int kCols, int kThreads>
struct TileLoader {
  static constexpr int kChunksPerRow = kCols / 8;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static constexpr int kPasses = kRows / kRowsPerPass;
  static_assert(kThreads % kChunksPerRow == 0 && kRowsPerPass % 8 == 0 && kRows % kRowsPerPass == 0,
                "each pass must cover whole groups of 8 rows");
  int64_t thread_offset;  // elements: this thread's row and column within any tile
  uint32_t dst_offset;    // bytes into the swizzled shared tile
  int row0;               // this thread's row in pass 0; rows beyond cols_valid are marked by row0 = kRows
  __device__ __forceinline__ TileLoader(int64_t row_stride, int cols_valid) {
    const int tid = static_cast<int>(threadIdx.x);
    const int col = (tid % kChunksPerRow) * 8;
    row0 = col < cols_valid ? tid / kChunksPerRow : kRows;
    thread_offset = (tid / kChunksPerRow) * row_stride + col;
    dst_offset = Swizzled<kCols>::offset(tid / kChunksPerRow, col);
  }
  // Rows >= rows_valid become zeros; `fallback` is any valid global address.
  template <class T>
  __device__ __forceinline__ void issue(uint32_t smem, const T* tile, int64_t row_stride, int rows_valid,
                                        const T* fallback) const {
    const T* src = tile + thread_offset;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const bool valid = row0 + i * kRowsPerPass < rows_valid;
      cp_async16(smem + dst_offset + i * kRowsPerPass * kCols * 2, valid ? src : fallback, valid);
      src += kRowsPerPass * row_stride;
    }
  }
};

// Calls f(std::integral_constant<unsigned, set>) for the run-time set `active` (bit i: m-tile i) of a warp's
// kCount m-tiles, so that f's loops know at compile time which m-tiles run; the empty set calls nothing.
template <int kCount, class F>
__device__ __forceinline__ void for_active_set(unsigned active, F&& f) {
  static_assert(kCount == 1 || kCount == 2, "one or two m-tiles per warp");
  if constexpr (kCount == 1) {
    if (active == 1u) f(std::integral_constant<unsigned, 1u>{});
  } else {
    if (active == 3u) f(std::integral_constant<unsigned, 3u>{});
    else if (active == 1u) f(std::integral_constant<unsigned, 1u>{});
    else if (active == 2u) f(std::integral_constant<unsigned, 2u>{});
  }
}

// Keys [lo, hi) that a work item keeps for row q (kept_keys restricted to the item's rectangle); an empty
// interval for rows outside it. Computed once per row so that the per-element test is two compares.
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
      for (int b = 0; b < 4; ++b) e[b][0] = Mma<T>::pack(acc[4 * g + b][2 * r] * scale, acc[4 * g + b][2 * r + 1] * scale);
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
    *reinterpret_cast<uint32_t*>(static_cast<T*>(base) + index) = Mma<T>::pack(a, b);
  }
}

}  // namespace magi::cuda::detail
