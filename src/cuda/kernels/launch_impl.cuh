// Launcher definitions, included by the per-(dtype, head dim) instantiation files only.
#pragma once

#include <type_traits>

#include "cuda/backward_kernel.cuh"
#include "cuda/forward_kernel.cuh"
#include "cuda/launch.hpp"

namespace magi::cuda::detail {

template <int kDtype>
using DtypeOf = std::conditional_t<kDtype == kBf16, __nv_bfloat16, __half>;

template <int kDtype, int kD>
void launch_forward(const FwdParams& params, int num_blocks, cudaStream_t stream) {
  using T = DtypeOf<kDtype>;
  using Cfg = FwdConfig<kD>;
  if (num_blocks == 0) return;
  auto kernel = forward_kernel<T, kD>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  kernel<<<num_blocks, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params);
  check_launch("forward_kernel");
}

template <int kDtype, int kD>
void launch_backward(const BwdParams& dkdv, int dkdv_blocks, const BwdParams& dq, int dq_blocks,
                     cudaStream_t stream) {
  using T = DtypeOf<kDtype>;
  if (dkdv_blocks > 0) {
    using Cfg = DkdvConfig<kD>;
    auto kernel = dkdv_kernel<T, kD>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    kernel<<<dkdv_blocks, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(dkdv);
    check_launch("dkdv_kernel");
  }
  if (dq_blocks > 0) {
    using Cfg = DqConfig<kD>;
    auto kernel = dq_kernel<T, kD>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    kernel<<<dq_blocks, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(dq);
    check_launch("dq_kernel");
  }
}

}  // namespace magi::cuda::detail
