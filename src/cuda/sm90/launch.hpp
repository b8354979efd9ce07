// Launchers of the Hopper kernel family (src/cuda/sm90/kernels/*.cu, built for sm_90a only). Host-only header.
#pragma once

#include <cuda_runtime.h>

#include "cuda/params.hpp"

namespace magi::cuda::sm90 {

// The plan's forward list (tiles of tile_q x forward_tile_k(kD, tile_q); tile_q one of tiles.hpp's for kD): the
// tiles with items on a persistent grid of (SMs - sm_margin) x forward_blocks_per_sm blocks, the last
// `itemless_tiles` (no items) on the copy kernel.
// kDtype: detail::kBf16 / kFp16.
template <int kDtype, int kD>
void launch_forward(const detail::FwdParams& params, int tile_q, int itemless_tiles, int sm_margin,
                    cudaStream_t stream);

}  // namespace magi::cuda::sm90
