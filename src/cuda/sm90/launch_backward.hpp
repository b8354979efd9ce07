// Launcher of the Hopper backward (src/cuda/sm90/kernels/backward_*.cu, built for sm_90a only). Host-only header.
#pragma once

#include <cuda_runtime.h>

#include "cuda/params.hpp"
#include "cuda/sm90/tiles.hpp"  // sm90_backward_tile

namespace magi::cuda::sm90 {

// dK, dV (stored) and dQ (added to params.dq_accum: fp32, 16-byte aligned for the reductions, zeroed by the
// caller; params.dq_accum null: no dQ, beside a dq kernel) over the plan's k-major list (tiles
// of backward_tile_k(kD) keys; 64-row chunks) on a persistent grid of (SMs - sm_margin) blocks.
// kDtype: detail::kBf16 / kFp16; kD: a tile with sm90_backward_tile(kD).
template <int kDtype, int kD>
void launch_backward(const detail::BwdParams& params, int sm_margin, cudaStream_t stream);

// dq (written, or added to an fp32 dq with params.accumulate_dq) of the backward that runs the dk/dv kernel without
// dQ, at the tiles with sm90_dq_kernel(kD) (dq_kernel.cuh): over params.list, the plan's dq_sm90 list.
template <int kDtype, int kD>
void launch_dq(const detail::BwdParams& params, int sm_margin, cudaStream_t stream);

// Whether its deterministic mode adds dQ itself, in a fixed order (BwdParams::dq_semaphores): at D 64 and 128 (the
// writer warps take the turns off the consumers' path). From D 256 on it runs without dQ, beside a dq kernel (the
// Hopper one at tile 256, the portable one above): dQ goes out by vector reductions there, which cannot take turns.
constexpr bool sm90_ordered_dq(int padded_head_dim) { return padded_head_dim <= 128; }

// Whether its dQ goes into dq_accum in fragment order (detail::dq_fragment_base: the writer warps' bulk reduce-adds
// of the consumers' unswizzled tiles): at D 64 and 128 one head at a time. With concatenated heads (cat_group > 1,
// a 4-D tensor map over the rows) and from D 256 on (vector reductions), dq_accum is [Tq, Hq, D].
constexpr bool backward_dq_in_fragments(int padded_head_dim, int cat_group) {
  return padded_head_dim <= 128 && cat_group == 1;
}

}  // namespace magi::cuda::sm90
