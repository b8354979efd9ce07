// Tile shapes of the Hopper forward, shared by the planner (host) and the kernels (no CUDA types in here).
#pragma once

namespace magi::cuda::sm90 {

// Head-dim tiles with a Hopper forward: up to 512 (at 576 and above one warpgroup's share of O does not fit its
// registers; the portable D-split forward runs those).
constexpr bool sm90_forward_tile(int padded_head_dim) { return padded_head_dim <= 512; }
// A block is a producer warpgroup and two consumer warpgroups. Up to D 320 each consumer holds 64 q rows with all
// of O's columns (a 128-row tile). Above, 64 x D fp32 does not fit one warpgroup's registers: both consumers hold
// the same 64 rows, each half of O's columns; each computes S over its half of D and adds the other's half.
constexpr bool forward_splits_columns(int padded_head_dim) { return padded_head_dim > 320; }
constexpr int forward_tile_q(int padded_head_dim) { return forward_splits_columns(padded_head_dim) ? 64 : 128; }
// Keys per item: 128 up to D 128, 64 at D 256 (a 64 x 256 fp32 accumulator per warpgroup), 32 above (shared
// memory for Q and two or three stages of K and V).
constexpr int forward_tile_k(int padded_head_dim) {
  return padded_head_dim <= 128 ? 128 : padded_head_dim <= 256 ? 64 : 32;
}
// V's pipeline stages (as many as shared memory holds, up to 4).
constexpr int forward_stages(int padded_head_dim) {
  return padded_head_dim <= 64 ? 4 : padded_head_dim == 320 || padded_head_dim == 384 ? 3 : 2;
}
// K's: one more at D 256, where only that fits. A step waits for K first (Q K^T), V one GEMM later, and the
// producer loads K one item ahead of V (A/B, H100: D 256 +3-5% on every mask; a third K stage at D 128 lost 1-2%).
constexpr int forward_k_stages(int padded_head_dim) {
  return padded_head_dim == 256 ? 3 : forward_stages(padded_head_dim);
}
// The column split's S halves (fp32, two consumers, two items in flight).
constexpr int forward_exchange_bytes(int padded_head_dim) {
  return forward_splits_columns(padded_head_dim) ? 2 * 2 * forward_tile_q(padded_head_dim) * forward_tile_k(padded_head_dim) * 4
                                                 : 0;
}
constexpr int forward_smem_bytes(int padded_head_dim) {
  const int kv_rows = (forward_k_stages(padded_head_dim) + forward_stages(padded_head_dim)) * forward_tile_k(padded_head_dim);
  return (forward_tile_q(padded_head_dim) + kv_rows) * padded_head_dim * 2 + forward_exchange_bytes(padded_head_dim) +
         1024;
}

}  // namespace magi::cuda::sm90
