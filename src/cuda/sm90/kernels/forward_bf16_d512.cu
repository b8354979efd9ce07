// Hopper forward, bf16, head dims up to 512.
#include "cuda/small_kernels.hpp"
#include "cuda/sm90/forward_kernel.cuh"
#include "cuda/sm90/launch.hpp"

namespace magi::cuda::sm90 {
template <>
void launch_forward<detail::kBf16, 512>(const detail::FwdParams& params, int tile_q, int itemless_tiles, int sm_margin,
                                        cudaStream_t stream) {
  launch_forward_kernel<__nv_bfloat16, 512>(params, tile_q, itemless_tiles, sm_margin, stream);
}
}  // namespace magi::cuda::sm90
