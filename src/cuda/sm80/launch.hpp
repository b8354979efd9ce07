// Launchers of the portable kernels, one explicit instantiation per (dtype, head-dim tile) in
// src/cuda/sm80/kernels/*.cu.
// Host-only header.
#pragma once

#include <cuda_runtime.h>

#include "cuda/params.hpp"
#include "cuda/small_kernels.hpp"

namespace magi::cuda::detail {

// Persistent grids sized (SMs - sm_margin) x resident blocks per SM. tile_q: kFwdTileQ or
// kFwdSmallTileQ (the rows per block of the plan's forward list; large_fwd_tile_q for the large tiles, whose
// `variant` is a LargeFwdVariant; ignored up to D 256). The last `itemless_tiles` tiles of the
// list's order (tiles without work items; only without a sink) go to a copy kernel of their own.
template <int kDtype, int kD>
void launch_forward(const FwdParams& params, int tile_q, int variant, int itemless_tiles, int sm_margin,
                    cudaStream_t stream);
// `variant`: a LargeBwdVariant (tiles.hpp) above D 256, ignored below.
template <int kDtype, int kD>
void launch_backward(const BwdParams& dkdv, int dkdv_blocks, const BwdParams& dq, int dq_blocks, int variant,
                     int sm_margin, cudaStream_t stream);

}  // namespace magi::cuda::detail
