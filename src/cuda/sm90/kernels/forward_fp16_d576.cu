// Hopper forward, fp16, head-dim tile 576 (clusters of two blocks, each half of D).
#include "cuda/small_kernels.hpp"
#include "cuda/sm90/forward_kernel.cuh"
#include "cuda/sm90/launch.hpp"

namespace magi::cuda::sm90 {
template <>
void launch_forward<detail::kFp16, 576>(const detail::FwdParams& params, int tile_q, int itemless_tiles, int sm_margin,
                                        cudaStream_t stream) {
  launch_forward_kernel<__half, 576>(params, tile_q, itemless_tiles, sm_margin, stream);
}
}  // namespace magi::cuda::sm90
