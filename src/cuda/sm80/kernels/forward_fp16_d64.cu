// forward kernels, fp16, head dims up to 64.
#include "cuda/sm80/kernels/launch_impl.cuh"

namespace magi::cuda::detail {
template void launch_forward<kFp16, 64>(const FwdParams&, int, int, int, cudaStream_t);
template void launch_forward_itemless<kFp16, 64>(const FwdParams&, int, int, cudaStream_t);
}  // namespace magi::cuda::detail
