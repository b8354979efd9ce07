// Small device kernels of the GPU distributed runtime: row gathers for group-cast, the SPEC lse merge of
// partial outputs, fixed-order sums for group-reduce, conversions. Host-callable launchers; everything
// is enqueued on the given stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>


namespace magi::dist::gpu {

// Element types the kernels read and write (the .cu files are C++17: no magi/tensor.hpp here).
enum class Element : int32_t { F32, BF16, F16 };

// dst row i = src row index[i]; rows of row_bytes bytes (a multiple of 4).
void gather_rows(const void* src, const int32_t* index, int64_t rows, int64_t row_bytes, void* dst,
                 cudaStream_t stream);

// Merges (part_out, part_lse) into (acc_out, acc_lse), fp32, [row_heads, head_dim] / [row_heads].
void lse_merge(float* acc_out, float* acc_lse, const float* part_out, const float* part_lse, int64_t row_heads,
               int32_t head_dim, cudaStream_t stream);

// acc[i] = max(acc[i], part[i]), fp32. (Fills: cuda::fill.)
void max_into(float* acc, const float* part, int64_t n, cudaStream_t stream);
// acc[i] += part[i], fp32.
void add_into(float* acc, const float* part, int64_t n, cudaStream_t stream);

// Group-reduce sum: for each row r of acc ([rows, elems] fp32), adds received rows
// index[offsets[r] .. offsets[r + 1]) of `received` ([*, elems] in `type`) in that order.
void sum_rows(float* acc, int64_t rows, int64_t elems, const int32_t* offsets, const int32_t* index,
              const void* received, Element type, cudaStream_t stream);

// Group-reduce lse merge (the q/out route's partial results coming back): for each row r of acc_out ([rows,
// heads, head_dim] fp32) / acc_lse ([rows, heads] fp32), merges received rows index[offsets[r] .. offsets[r + 1])
// of (received_out [*, heads, head_dim] in `type`, received_lse [*, heads] fp32) in that order.
void merge_rows(float* acc_out, float* acc_lse, int64_t rows, int32_t heads, int32_t head_dim, const int32_t* offsets,
                const int32_t* index, const void* received_out, Element type, const float* received_lse,
                cudaStream_t stream);

// dst (type) = src (fp32), n elements (16-bit types: cuda::convert).
void convert(const float* src, void* dst, Element type, int64_t n, cudaStream_t stream);

}  // namespace magi::dist::gpu
