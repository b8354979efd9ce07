// backward kernels, bf16, head dims up to 128.
#include "cuda/sm80/kernels/launch_impl.cuh"

namespace magi::cuda::detail {
template void launch_backward<kBf16, 128>(const BwdParams&, int, const BwdParams&, int, int, int, cudaStream_t);
}  // namespace magi::cuda::detail
