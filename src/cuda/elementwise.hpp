// Elementwise device helpers for other capabilities (the distributed runtime's accumulators): a fill and the
// fp32 -> 16-bit conversion, enqueued on the caller's stream (src/cuda/small_kernels.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace magi::cuda {

// (CUDA sources here are C++17, so not magi::DType, whose header is C++20.)
enum class HalfType { BF16, FP16 };

void fill(float* data, int64_t n, float value, cudaStream_t stream);
// dst (16-bit) = src (fp32), n elements, rounded to nearest even.
void convert(const float* src, void* dst, HalfType type, int64_t n, cudaStream_t stream);

}  // namespace magi::cuda
