// Hopper backward, fp16, head dims up to 128.
#include "cuda/small_kernels.hpp"
#include "cuda/sm90/backward_kernel.cuh"
#include "cuda/sm90/launch_backward.hpp"

namespace magi::cuda::sm90 {
template <>
void launch_backward<detail::kFp16, 128>(const detail::BwdParams& params, int sm_margin, cudaStream_t stream) {
  launch_backward_kernel<__half, 128>(params, sm_margin, stream);
}
}  // namespace magi::cuda::sm90
