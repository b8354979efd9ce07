// Hopper backward, bf16, head-dim tile 1024.
#include "cuda/small_kernels.hpp"
#include "cuda/sm90/backward_kernel.cuh"
#include "cuda/sm90/launch_backward.hpp"

namespace magi::cuda::sm90 {
template <>
void launch_backward<detail::kBf16, 1024>(const detail::BwdParams& params, int sm_margin, cudaStream_t stream) {
  launch_backward_kernel<__nv_bfloat16, 1024>(params, sm_margin, stream);
}
}  // namespace magi::cuda::sm90
