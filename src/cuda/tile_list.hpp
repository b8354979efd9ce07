// The head-dim tiles this build compiled (MAGI_ATTN_CUDA_HEAD_DIMS, src/cuda/CMakeLists.txt), as one compile-time
// list: the planner (padded_head_dim) and every dispatch over the kernels' instantiations read it.
// Host-only header.
#pragma once

#include <type_traits>

#include "cuda/compiled_tiles.hpp"  // generated: MAGI_CUDA_HEAD_DIM_TILES

namespace magi::cuda::detail {

template <int... kTiles>
struct TileList {
  static constexpr int kValues[] = {kTiles..., 0};  // ascending, 0-terminated
};

using CompiledTiles = TileList<MAGI_CUDA_HEAD_DIM_TILES>;

// Calls f(std::integral_constant<int, tile>{}) for the compiled tile equal to `tile`; false when none is.
template <class F, int... kTiles>
bool dispatch_tile(TileList<kTiles...>, int tile, F&& f) {
  return ((tile == kTiles ? (f(std::integral_constant<int, kTiles>{}), true) : false) || ...);
}
template <class F>
bool dispatch_compiled_tile(int tile, F&& f) {
  return dispatch_tile(CompiledTiles{}, tile, f);
}

}  // namespace magi::cuda::detail
