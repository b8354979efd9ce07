// Building blocks of the Hopper kernels (sm_90a) on CuTe: the element types, one warpgroup GEMM over all k-steps,
// an accumulator viewed as the A operand of the next GEMM, and the persistent schedule (its launch and its two-slot
// work ring).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "cuda/kernel_common.cuh"
#include "cuda/small_kernels.hpp"  // check_launch

namespace magi::cuda::sm90 {

using namespace cute;

template <class T>
struct CuteElement;
template <>
struct CuteElement<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CuteElement<__half> {
  using type = cutlass::half_t;
};

// The A-operand view of a 16-bit copy of an accumulator: ((2, 2, N / 8), M, N) -> ((2, 2, 2), M, N / 16), the
// k-steps of P V along the accumulator's columns (the register order of the two layouts is the same).
template <class Layout>
__device__ __forceinline__ constexpr auto accumulator_as_a_operand(Layout acc) {
  auto split = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(split), get<1>(split), get<2, 0>(split)), get<1>(acc),
                     coalesce(make_layout(get<2, 1>(split), get<2>(acc))));
}

// Issues one warpgroup GEMM C (+)= A B over all k-steps (kZero: C = A B) and commits it; the caller waits.
template <bool kZero, bool kRegistersA, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void issue_gemm(Mma& mma, TA& a, const TB& b, TC& c) {
  if constexpr (kRegistersA) warpgroup_fence_operand(a);
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZero) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kRegistersA) warpgroup_fence_operand(a);
}

// A TMA pipeline of one CTA: `producer` says which side this thread is on; thread 0 leads.
template <class Pipeline>
__device__ __forceinline__ Pipeline make_tma_pipeline(typename Pipeline::SharedStorage& storage, int stage_bytes,
                                                      int consumer_threads, bool producer) {
  typename Pipeline::Params params;
  params.transaction_bytes = stage_bytes;
  params.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = consumer_threads;
  return Pipeline(storage, params, Shape<_1, _1, _1>{});
}

// Launches a persistent Hopper kernel: one block per SM that the margin leaves (at least one), at most one per work,
// after zeroing the launch's work counter (claim_work_index).
template <class Kernel, class KernelFunction>
void launch_persistent(KernelFunction kernel, const typename Kernel::Params& params, int num_work, int sm_margin,
                       int32_t* work_counter, cudaStream_t stream, const char* name) {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int usable = sms - sm_margin > 1 ? sms - sm_margin : 1;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
  cudaMemsetAsync(work_counter, 0, sizeof(int32_t), stream);
  kernel<<<usable < num_work ? usable : num_work, Kernel::kThreads, Kernel::kSmemBytes, stream>>>(params);
  detail::check_launch(name);
}

// The persistent schedule of both families (first_work_index, claim_work_index), fed by the producer: it claims
// the work indices and hands each to the consumers through a two-slot ring in shared memory. An index past the
// last work ends the block.
struct WorkRing {
  int slot[2];
  cutlass::arch::ClusterBarrier full[2], empty[2];

  __device__ void init(int consumer_threads) {
    for (int s = 0; s < 2; ++s) {
      full[s].init(1);
      empty[s].init(consumer_threads);
    }
  }
  // Producer: the n-th work of this block (n = 0, 1, ...), published for the consumers.
  __device__ int publish(int n, int32_t* counter) {
    const int s = n & 1;
    if (n >= 2) empty[s].wait(((n >> 1) - 1) & 1);
    const int linear = n == 0 ? detail::first_work_index() : detail::claim_work_index(counter);
    slot[s] = linear;
    full[s].arrive();
    return linear;
  }
  // Consumers: the n-th work of this block.
  __device__ int take(int n) {
    const int s = n & 1;
    full[s].wait((n >> 1) & 1);
    const int linear = slot[s];
    empty[s].arrive();
    return linear;
  }
};

}  // namespace magi::cuda::sm90
