// forward kernels, bf16, head dims up to 128.
#include "cuda/sm80/kernels/launch_impl.cuh"

namespace magi::cuda::detail {
template void launch_forward<kBf16, 128>(const FwdParams&, int, int, int, cudaStream_t);
template void launch_forward_itemless<kBf16, 128>(const FwdParams&, int, int, cudaStream_t);
}  // namespace magi::cuda::detail
