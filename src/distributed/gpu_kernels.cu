#include "distributed/gpu_kernels.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/lse_merge.hpp"
#include "cuda/check.hpp"
#include "cuda/elementwise.hpp"
#include "magi/error.hpp"

namespace magi::dist::gpu {
namespace {

constexpr int kThreads = 256;

void check_launch(const char* what) { cuda::check(cudaGetLastError(), (std::string("launch of ") + what).c_str()); }

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{1} << 20));
}
unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(rows, int64_t{1} << 20)); }

// Row kernels: blocks stride over rows, threads over a row's elements (no 64-bit division per element).
template <class Word>
__global__ void gather_rows_kernel(const Word* src, const int32_t* index, int64_t rows, int64_t words_per_row,
                                   Word* dst) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const Word* from = src + int64_t{index[row]} * words_per_row;
    Word* to = dst + row * words_per_row;
    for (int64_t w = threadIdx.x; w < words_per_row; w += blockDim.x) to[w] = from[w];
  }
}

// One warp per (row, head): every lane reads both lse values before lane 0 replaces the running one.
__global__ void lse_merge_kernel(float* acc_out, float* acc_lse, const float* part_out, const float* part_lse,
                                 int64_t row_heads, int32_t head_dim) {
  const int64_t warp = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= row_heads) return;
  const auto w = merge_weights<float>(acc_lse[warp], part_lse[warp]);
  float* out = acc_out + warp * head_dim;
  const float* part = part_out + warp * head_dim;
  for (int32_t d = lane; d < head_dim; d += 32)
    // Zero weights must not touch the values: an empty part may hold anything finite.
    out[d] = (w.w1 == 0.f ? 0.f : w.w1 * out[d]) + (w.w2 == 0.f ? 0.f : w.w2 * part[d]);
  __syncwarp();
  if (lane == 0) acc_lse[warp] = w.lse;
}

__global__ void max_kernel(float* acc, const float* part, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    acc[i] = fmaxf(acc[i], part[i]);
}

__global__ void add_kernel(float* acc, const float* part, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    acc[i] += part[i];
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

// Rows that received nothing (most of them, where few peers needed this rank's kv) cost one offsets read.
template <class T>
__global__ void sum_rows_kernel(float* acc, int64_t rows, int64_t elems, const int32_t* offsets,
                                const int32_t* index, const T* received) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int32_t first = offsets[row], last = offsets[row + 1];
    if (first == last) continue;
    float* out = acc + row * elems;
    for (int64_t e = threadIdx.x; e < elems; e += blockDim.x) {
      float sum = out[e];
      for (int32_t j = first; j < last; ++j) sum += to_float(received[int64_t{index[j]} * elems + e]);
      out[e] = sum;
    }
  }
}

// One warp per (row, head); rows that received nothing cost one offsets read.
template <class T>
__global__ void merge_rows_kernel(float* acc_out, float* acc_lse, int64_t rows, int32_t heads, int32_t head_dim,
                                  const int32_t* offsets, const int32_t* index, const T* received_out,
                                  const float* received_lse) {
  const int64_t warp = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= rows * heads) return;
  const int64_t row = warp / heads;
  const int32_t head = static_cast<int32_t>(warp - row * heads);
  const int32_t first = offsets[row], last = offsets[row + 1];
  if (first == last) return;
  float* out = acc_out + warp * head_dim;
  float lse = acc_lse[warp];
  for (int32_t j = first; j < last; ++j) {
    const int64_t part = int64_t{index[j]} * heads + head;
    const auto w = merge_weights<float>(lse, received_lse[part]);
    const T* values = received_out + part * head_dim;
    for (int32_t d = lane; d < head_dim; d += 32)
      out[d] = (w.w1 == 0.f ? 0.f : w.w1 * out[d]) + (w.w2 == 0.f ? 0.f : w.w2 * to_float(values[d]));
    lse = w.lse;
  }
  __syncwarp();
  if (lane == 0) acc_lse[warp] = lse;
}

}  // namespace

void gather_rows(const void* src, const int32_t* index, int64_t rows, int64_t row_bytes, void* dst,
                 cudaStream_t stream) {
  if (rows == 0) return;
  if (row_bytes % 16 == 0) {
    const int64_t words = row_bytes / 16;
    gather_rows_kernel<<<row_blocks(rows), kThreads, 0, stream>>>(static_cast<const uint4*>(src), index, rows, words,
                                                                  static_cast<uint4*>(dst));
  } else {
    const int64_t words = row_bytes / 4;
    gather_rows_kernel<<<row_blocks(rows), kThreads, 0, stream>>>(static_cast<const uint32_t*>(src), index, rows, words,
                                                                  static_cast<uint32_t*>(dst));
  }
  check_launch("gather_rows");
}

void lse_merge(float* acc_out, float* acc_lse, const float* part_out, const float* part_lse, int64_t row_heads,
               int32_t head_dim, cudaStream_t stream) {
  if (row_heads == 0) return;
  lse_merge_kernel<<<blocks_for(row_heads * 32), kThreads, 0, stream>>>(acc_out, acc_lse, part_out, part_lse,
                                                                        row_heads, head_dim);
  check_launch("lse_merge");
}

void max_into(float* acc, const float* part, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  max_kernel<<<blocks_for(n), kThreads, 0, stream>>>(acc, part, n);
  check_launch("max_into");
}

void add_into(float* acc, const float* part, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  add_kernel<<<blocks_for(n), kThreads, 0, stream>>>(acc, part, n);
  check_launch("add_into");
}

void sum_rows(float* acc, int64_t rows, int64_t elems, const int32_t* offsets, const int32_t* index,
              const void* received, Element type, cudaStream_t stream) {
  if (rows == 0) return;
  const unsigned blocks = row_blocks(rows);
  switch (type) {
    case Element::F32:
      sum_rows_kernel<<<blocks, kThreads, 0, stream>>>(acc, rows, elems, offsets, index, static_cast<const float*>(received));
      break;
    case Element::BF16:
      sum_rows_kernel<<<blocks, kThreads, 0, stream>>>(acc, rows, elems, offsets, index,
                                                       static_cast<const __nv_bfloat16*>(received));
      break;
    case Element::F16:
      sum_rows_kernel<<<blocks, kThreads, 0, stream>>>(acc, rows, elems, offsets, index, static_cast<const __half*>(received));
      break;
  }
  check_launch("sum_rows");
}

void merge_rows(float* acc_out, float* acc_lse, int64_t rows, int32_t heads, int32_t head_dim, const int32_t* offsets,
                const int32_t* index, const void* received_out, Element type, const float* received_lse,
                cudaStream_t stream) {
  if (rows == 0 || heads == 0) return;
  const unsigned blocks = blocks_for(rows * heads * 32);
  switch (type) {
    case Element::F32:
      merge_rows_kernel<<<blocks, kThreads, 0, stream>>>(acc_out, acc_lse, rows, heads, head_dim, offsets, index,
                                                         static_cast<const float*>(received_out), received_lse);
      break;
    case Element::BF16:
      merge_rows_kernel<<<blocks, kThreads, 0, stream>>>(acc_out, acc_lse, rows, heads, head_dim, offsets, index,
                                                         static_cast<const __nv_bfloat16*>(received_out), received_lse);
      break;
    case Element::F16:
      merge_rows_kernel<<<blocks, kThreads, 0, stream>>>(acc_out, acc_lse, rows, heads, head_dim, offsets, index,
                                                         static_cast<const __half*>(received_out), received_lse);
      break;
  }
  check_launch("merge_rows");
}

void convert(const float* src, void* dst, Element type, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (type == Element::F32) {
    if (static_cast<const void*>(src) == dst) return;
    cuda::check(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToDevice, stream),
                "cudaMemcpyAsync (fp32 convert)");
    return;
  }
  cuda::convert(src, dst, type == Element::BF16 ? cuda::HalfType::BF16 : cuda::HalfType::FP16, n, stream);
}

}  // namespace magi::dist::gpu
