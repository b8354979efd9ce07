// Tile shapes of the Hopper forward, shared by the planner (host) and the kernels (no CUDA types in here).
#pragma once

namespace magi::cuda::sm90 {

// A block holds one 128-row q tile: two consumer warpgroups of 64 rows each, plus a producer warpgroup.
constexpr int kForwardTileQ = 128;
// Keys per item: 128 up to D 128; 80 at D 256 (the registers of a 64 x 256 fp32 accumulator per warpgroup, and
// two stages of K and V in shared memory beside Q).
constexpr int forward_tile_k(int padded_head_dim) { return padded_head_dim <= 128 ? 128 : 64; }
// K and V pipelines of this many stages each (D 64 has room for more).
constexpr int forward_stages(int padded_head_dim) { return padded_head_dim <= 64 ? 4 : 2; }
constexpr int forward_smem_bytes(int padded_head_dim) {
  const int kv_rows = 2 * forward_stages(padded_head_dim) * forward_tile_k(padded_head_dim);
  return (kForwardTileQ + kv_rows) * padded_head_dim * 2 + 1024;
}

}  // namespace magi::cuda::sm90
