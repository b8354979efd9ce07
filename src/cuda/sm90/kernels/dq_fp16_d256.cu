// Hopper dq kernel, fp16, head-dim tile 256.
#include "cuda/small_kernels.hpp"
#include "cuda/sm90/dq_kernel.cuh"
#include "cuda/sm90/launch_backward.hpp"

namespace magi::cuda::sm90 {
template <>
void launch_dq<detail::kFp16, 256>(const detail::BwdParams& params, int sm_margin, cudaStream_t stream) {
  launch_dq_kernel<__half, 256>(params, sm_margin, stream);
}
}  // namespace magi::cuda::sm90
