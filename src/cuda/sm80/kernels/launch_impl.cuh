// Launcher definitions, included by the per-(dtype, head dim) instantiation files only.
#pragma once

#include <string>
#include <type_traits>

#include "magi/error.hpp"

#include "cuda/sm80/backward_kernel.cuh"
#include "cuda/sm80/forward_kernel.cuh"
#include "cuda/sm80/forward_large_kernel.cuh"
#include "cuda/sm80/launch.hpp"

namespace magi::cuda::detail {

// Grid of a persistent kernel: at most (SMs - sm_margin) x resident blocks per SM, never more than the work.
template <class Kernel>
int persistent_grid(Kernel kernel, int threads, int smem_bytes, int num_work, int sm_margin) {
  int device = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes);
  const int usable = sms - sm_margin > 1 ? sms - sm_margin : 1;
  const long long capacity = static_cast<long long>(usable) * (per_sm > 0 ? per_sm : 1);
  return static_cast<int>(capacity < num_work ? capacity : num_work);
}

template <int kDtype>
using DtypeOf = std::conditional_t<kDtype == kBf16, __nv_bfloat16, __half>;

template <class T, int kD, int kTileQ>
void launch_forward_tiles(const FwdParams& params, int num_blocks, int sm_margin, cudaStream_t stream) {
  using Cfg = FwdConfig<kD, kTileQ>;
  if (sm_margin <= 0) {
    auto kernel = forward_kernel<T, kD, kTileQ>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    kernel<<<num_blocks, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params);
  } else {
    auto kernel = forward_kernel_persistent<T, kD, kTileQ>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    const int grid = persistent_grid(kernel, Cfg::kThreads, Cfg::kSmemBytes, num_blocks, sm_margin);
    cudaMemsetAsync(params.work_counter, 0, sizeof(int32_t), stream);
    kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params, num_blocks);
  }
  check_launch("forward_kernel");
}

// The large-D forward (forward_large_kernel.cuh), one variant.
template <class T, int kD, int kVariant>
void launch_large_tiles(const FwdParams& params, int num_blocks, int sm_margin, cudaStream_t stream) {
  using Cfg = LargeFwdConfig<kD, kVariant>;
  if (sm_margin <= 0) {
    auto kernel = forward_large_kernel<T, kD, kVariant>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    kernel<<<num_blocks, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params);
  } else {
    auto kernel = forward_large_kernel_persistent<T, kD, kVariant>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    const int grid = persistent_grid(kernel, Cfg::kThreads, Cfg::kSmemBytes, num_blocks, sm_margin);
    cudaMemsetAsync(params.work_counter, 0, sizeof(int32_t), stream);
    kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params, num_blocks);
  }
  check_launch("forward_large_kernel");
}
template <class T, int kD>
void launch_large_variant(const FwdParams& params, int variant, int num_blocks, int sm_margin, cudaStream_t stream) {
  switch (variant) {
    case kLargeFwdResident: return launch_large_tiles<T, kD, kLargeFwdResident>(params, num_blocks, sm_margin, stream);
    case kLargeFwdDeep: return launch_large_tiles<T, kD, kLargeFwdDeep>(params, num_blocks, sm_margin, stream);
    case kLargeFwdStreamed: return launch_large_tiles<T, kD, kLargeFwdStreamed>(params, num_blocks, sm_margin, stream);
    case kLargeFwdPaired:
      if constexpr (large_fwd_paired_fits(kD))
        return launch_large_tiles<T, kD, kLargeFwdPaired>(params, num_blocks, sm_margin, stream);
      [[fallthrough]];
    default: throw Error("cuda forward: unknown large-D variant " + std::to_string(variant));
  }
}

// The list's tiles with items on the attention kernel, the item-less ones (the last of its order) on the copy kernel.
template <class T, int kD, int kTileQ>
void launch_forward_list(const FwdParams& params, int variant, int itemless_tiles, int sm_margin, cudaStream_t stream) {
  FwdParams with_items = params;
  with_items.list = without_last_tiles(params.list, itemless_tiles);
  const int num_blocks = with_items.list.num_tiles * params.hq;
  if (num_blocks > 0) {
    if constexpr (is_large_head_dim(kD)) launch_large_variant<T, kD>(with_items, variant, num_blocks, sm_margin, stream);
    else launch_forward_tiles<T, kD, kTileQ>(with_items, num_blocks, sm_margin, stream);
  }
  launch_itemless_tiles<T, kD, kTileQ>(params, itemless_tiles, stream);
}

// Calls f(std::integral_constant<int, q>{}) for the compiled q tile `tile_q` of head-dim tile kD.
template <int kD, class F>
void with_forward_tile_q(int tile_q, F&& f) {
  if constexpr (is_large_head_dim(kD)) {
    constexpr int kTileQ = large_fwd_tile_q(kD);
    if (tile_q != kTileQ)
      throw Error("cuda forward: head-dim tile " + std::to_string(kD) + " runs " + std::to_string(kTileQ) +
                  "-row q tiles, not " + std::to_string(tile_q));
    f(std::integral_constant<int, kTileQ>{});
  } else {
    if (tile_q == kFwdSmallTileQ) f(std::integral_constant<int, kFwdSmallTileQ>{});
    else f(std::integral_constant<int, kFwdTileQ>{});
  }
}

template <int kDtype, int kD>
void launch_forward(const FwdParams& params, int tile_q, int variant, int itemless_tiles, int sm_margin,
                    cudaStream_t stream) {
  with_forward_tile_q<kD>(tile_q, [&](auto q) {
    launch_forward_list<DtypeOf<kDtype>, kD, decltype(q)::value>(params, variant, itemless_tiles, sm_margin, stream);
  });
}

template <class T, int kD, bool kDq, bool kPaired>
void launch_dkdv_kernel(const BwdParams& dkdv, int dkdv_blocks, int sm_margin, cudaStream_t stream) {
  constexpr int smem = DkdvConfig<kD, kDq>::kSmemBytes;
  constexpr int kThreads = DkdvConfig<kD, kDq>::kThreads;
  if (sm_margin <= 0) {
    auto kernel = dkdv_kernel<T, kD, kDq, kPaired>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    kernel<<<dkdv_blocks, kThreads, smem, stream>>>(dkdv);
  } else {
    auto kernel = dkdv_kernel_persistent<T, kD, kDq, kPaired>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const int grid = persistent_grid(kernel, kThreads, smem, dkdv_blocks, sm_margin);
    cudaMemsetAsync(dkdv.work_counter, 0, sizeof(int32_t), stream);
    kernel<<<grid, kThreads, smem, stream>>>(dkdv, dkdv_blocks);
  }
  check_launch("dkdv_kernel");
}

// `variant`: a LargeBwdVariant (tiles.hpp) above D 256, ignored below.
template <class T, int kD, bool kDq>
void launch_dkdv(const BwdParams& dkdv, int dkdv_blocks, int variant, int sm_margin, cudaStream_t stream) {
  if constexpr (bwd_split_paired_fits(kD)) {
    if (variant == kLargeBwdPaired) return launch_dkdv_kernel<T, kD, kDq, true>(dkdv, dkdv_blocks, sm_margin, stream);
  }
  launch_dkdv_kernel<T, kD, kDq, false>(dkdv, dkdv_blocks, sm_margin, stream);
}

// dkdv.dq_accum set: one fused kernel (dq by atomics), the dq kernel is not launched.
template <int kDtype, int kD>
void launch_backward(const BwdParams& dkdv, int dkdv_blocks, const BwdParams& dq, int dq_blocks, int variant,
                     int sm_margin, cudaStream_t stream) {
  using T = DtypeOf<kDtype>;
  const bool fused = dkdv.dq_accum != nullptr;
  if (dkdv_blocks > 0) {
    if (fused) launch_dkdv<T, kD, true>(dkdv, dkdv_blocks, variant, sm_margin, stream);
    else launch_dkdv<T, kD, false>(dkdv, dkdv_blocks, variant, sm_margin, stream);
  }
  if (dq_blocks > 0 && !fused) {
    using Cfg = DqConfig<kD>;
    if (sm_margin <= 0) {
      auto kernel = dq_kernel<T, kD>;
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
      kernel<<<dq_blocks, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(dq);
    } else {
      auto kernel = dq_kernel_persistent<T, kD>;
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
      const int grid = persistent_grid(kernel, Cfg::kThreads, Cfg::kSmemBytes, dq_blocks, sm_margin);
      cudaMemsetAsync(dq.work_counter, 0, sizeof(int32_t), stream);
      kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(dq, dq_blocks);
    }
    check_launch("dq_kernel");
  }
}

}  // namespace magi::cuda::detail
