// backward kernels, fp16, head dims up to 1024 (the D-split kernels).
#include "cuda/sm80/kernels/launch_impl.cuh"

namespace magi::cuda::detail {
template void launch_backward<kFp16, 1024>(const BwdParams&, int, const BwdParams&, int, int, int, cudaStream_t);
}  // namespace magi::cuda::detail
