// backward kernels, bf16, head dims up to 384 (the D-split kernels).
#include "cuda/sm80/kernels/launch_impl.cuh"

namespace magi::cuda::detail {
template void launch_backward<kBf16, 384>(const BwdParams&, int, const BwdParams&, int, int, int, cudaStream_t);
}  // namespace magi::cuda::detail
