// Warp-level building blocks of the portable kernels: sm_80 tensor-core instructions (mma.sync m16n8k16, ldmatrix,
// cp.async) and the swizzled shared-memory tile layout they read.
#pragma once

#include "cuda/kernel_common.cuh"

namespace magi::cuda::detail {

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
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return pack_pair<__nv_bfloat16>(lo, hi); }
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
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return pack_pair<__half>(lo, hi); }
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
  if constexpr (kTotal % kThreads == 0 && kThreads % kChunksPerRow == 0 && (kThreads / kChunksPerRow) % 8 == 0) {
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
    // Tiles that do not divide among the threads (large-D V chunks: 16 x 320 columns) leave the last pass partial.
#pragma unroll
    for (int i = 0; i < (kTotal + kThreads - 1) / kThreads; ++i) {
      const int index = i * kThreads + static_cast<int>(threadIdx.x);
      if (kTotal % kThreads != 0 && index >= kTotal) break;
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
}  // namespace magi::cuda::detail
