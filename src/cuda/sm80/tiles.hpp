// Tile shapes of the portable kernels, shared by the planner (host) and the kernels (no CUDA types in here).
#pragma once

namespace magi::cuda::detail {

// Forward: up to D 128, 4 warps and 128 x 64 tiles (two 16-row m-tiles per warp); above, 8 warps and 128 x 64
// tiles (one m-tile per warp, one block per SM: FA2's shape), and 4 warps x 64 x 32 as the small tile. Measured
// on the H200 at D 128: 128 x 64 beat 128 x 32 (277 vs 255 TFLOP/s) and 8 warps x one m-tile (225); on the H100
// at D 256, the 8-warp 128 x 64 tile beat 4 warps x 64 x 32 (full 294 vs 261, varlen causal 218 vs 212).
constexpr int kFwdTileQ = 128;
constexpr int fwd_warps(int padded_head_dim, int tile_q) { return padded_head_dim > 128 && tile_q == 128 ? 8 : 4; }
// Fragmented masks (short documents, many slice edges) waste part of every kFwdTileQ-row tile they cut: the plan
// may pick 64-row q tiles (4 warps x one m-tile) instead when they compute clearly fewer cells.
constexpr int kFwdSmallTileQ = 64;
// The planner takes kFwdSmallTileQ rows when 128-row tiles compute more than kSmallForwardTileGain times
// the cells (src/cuda/plan/plan.cpp; the distributed cost model mirrors it). On the H100 (D 128, bf16) a
// 64-row block ran dense tiles at kSmallForwardTileRate of the 128-row rate, and the switch broke even near
// a cell ratio of 1.14 (varlen causal: 213 vs 218 TFLOP/s), won at 1.18 (block-causal: 261 vs 244) and lost
// at 1.08 (varlen full: 262 vs 281). Since 128-row tiles drop m-tiles that keep no key (forward_kernel.cuh),
// block-causal (1.18) runs faster in 128-row tiles in the plain grid (281 vs 271) and slower in the persistent
// one (258 vs 270): the rule stays.
constexpr double kSmallForwardTileGain = 1.15;
constexpr double kSmallForwardTileRate = 0.85;
// The rule itself, on the cells each tile shape would compute.
constexpr bool prefer_small_forward_tile(double large_tile_cells, double small_tile_cells) {
  return large_tile_cells > kSmallForwardTileGain * small_tile_cells;
}
#ifndef MAGI_CUDA_FWD_TILE_K  // build-time override of the D <= 128 forward key tile, for experiments
#define MAGI_CUDA_FWD_TILE_K 64
#endif
constexpr int fwd_tile_k(int padded_head_dim, int tile_q) {
  return padded_head_dim <= 128 ? MAGI_CUDA_FWD_TILE_K : tile_q == 128 ? 64 : 32;
}
// Shared memory of a forward block: Q, K, V tiles. The 128-row D 256 tile needs 128 KB: parts with less per
// block (sm_86 / sm_89: 99 KB) plan 64-row tiles.
constexpr int fwd_smem_bytes(int padded_head_dim, int tile_q) {
  return (tile_q + 2 * fwd_tile_k(padded_head_dim, tile_q)) * padded_head_dim * 2;
}
// Large head dims (tiles above kMaxRegisterHeadDim: 320, 384, 512, 576, 768, 1024) run the D-split forward
// (forward_large_kernel.cuh): 8 warps; S = Q K^T tiled over the warps by (16 rows x keys) with the full-D
// reduction, K streamed in 64-column chunks; the fp32 O accumulator split over the warps by columns (and rows
// where a warp's share would exceed kLargeFwdAccRegisters); P through shared memory as every O warp's A operand.
constexpr int kMaxRegisterHeadDim = 256;
constexpr bool is_large_head_dim(int padded_head_dim) { return padded_head_dim > kMaxRegisterHeadDim; }
constexpr int kLargeFwdWarps = 8;
constexpr int kLargeFwdTileK = 64;
constexpr int kLargeFwdChunk = 64;          // columns of a K (and streamed Q) chunk: one swizzled 128-byte row
constexpr int kLargeFwdAccRegisters = 128;  // fp32 O registers per thread, at most
// q rows per block: 64 up to D 512 (a warp holds 64 rows x D / 8 columns), 32 above.
constexpr int large_fwd_tile_q(int padded_head_dim) { return padded_head_dim <= 512 ? 64 : 32; }
// Warps sharing the O columns: the most of 8, 4, 2, 1 whose column share is whole 16-column ldmatrix blocks and
// whose row share (whole 16-row m-tiles) fits kLargeFwdAccRegisters. D 320: 4 (32 x 80), 384: 8 (64 x 48),
// 512: 8 (64 x 64), 576: 4 (16 x 144), 768: 8 (32 x 96), 1024: 8 (32 x 128).
constexpr int large_fwd_col_warps(int padded_head_dim) {
  const int m = large_fwd_tile_q(padded_head_dim);
  for (int c = kLargeFwdWarps; c >= 1; c /= 2) {
    const int cols = padded_head_dim / c, rows = m * c / kLargeFwdWarps;
    if (padded_head_dim % c == 0 && cols % 16 == 0 && rows % 16 == 0 && (rows / 16) * (cols / 8) * 4 <= kLargeFwdAccRegisters)
      return c;
  }
  return 0;
}
// Compiled variants of the large-D forward (the planner picks one per device: plan/tuned_configs.cpp).
// kLargeFwdResident: Q resident, a 2-stage ring of K chunks and 16-key V chunks (fits 163 KB, A100, at every D);
// kLargeFwdDeep: Q resident, 3 stages, 32-key V chunks up to D 512 (needs up to 192 KB: H100 / H200);
// kLargeFwdStreamed: Q streamed in chunks beside K (re-read from L2 per item), 2 stages (fits 99 KB: sm_86 / 89);
// kLargeFwdPaired: Q resident, 2 stages, two blocks per SM (<= 128 registers a thread: one block's barriers and
// load waits overlap the other's mma); only where two blocks fit (large_fwd_paired_fits).
enum LargeFwdVariant : int {
  kLargeFwdResident = 0, kLargeFwdDeep = 1, kLargeFwdStreamed = 2, kLargeFwdPaired = 3, kLargeFwdVariants = 4
};
constexpr bool large_fwd_q_resident(int variant) { return variant != kLargeFwdStreamed; }
constexpr int large_fwd_stages(int variant) { return variant == kLargeFwdDeep ? 3 : 2; }
constexpr int large_fwd_blocks_per_sm(int variant) { return variant == kLargeFwdPaired ? 2 : 1; }
constexpr int large_fwd_v_keys(int padded_head_dim, int variant) {
  return (variant == kLargeFwdDeep && padded_head_dim <= 512) || variant == kLargeFwdPaired ? 32 : 16;
}
// Small per-block arrays: partial row maxima and sums per key warp, row scales, final row maxima.
constexpr int large_fwd_row_bytes(int padded_head_dim) {
  const int m = large_fwd_tile_q(padded_head_dim), key_warps = kLargeFwdWarps / (m / 16);
  return (2 * key_warps + 2) * m * 4;
}
constexpr int large_fwd_smem_bytes(int padded_head_dim, int variant) {
  const int d = padded_head_dim, m = large_fwd_tile_q(d), stages = large_fwd_stages(variant);
  const int q = large_fwd_q_resident(variant) ? m * d : stages * m * kLargeFwdChunk;
  const int k = stages * kLargeFwdTileK * kLargeFwdChunk;
  const int v = stages * large_fwd_v_keys(d, variant) * d;
  const int p = m * kLargeFwdTileK;
  return (q + k + v + p) * 2 + large_fwd_row_bytes(d);
}
// Whether the variant's blocks per SM fit `smem_optin` bytes a block (an SM holds smem_optin + 1 KB, and each
// block reserves 1 KB).
constexpr bool large_fwd_fits(int padded_head_dim, int variant, int smem_optin) {
  return large_fwd_blocks_per_sm(variant) * (large_fwd_smem_bytes(padded_head_dim, variant) + 1024) <= smem_optin + 1024;
}
// The paired variant is compiled for the D 320 tile only (106 KB: two blocks fit Hopper); at 384 (97 KB) its O share
// (64 x 48: 96 registers) would leave too few of the 128, and 512 and above do not fit twice.
constexpr bool large_fwd_paired_fits(int padded_head_dim) {
  return padded_head_dim == 320 && large_fwd_fits(padded_head_dim, kLargeFwdPaired, 227 * 1024);
}
// The safe variant: the resident one where it fits, else the streamed one; -1 if none fits.
constexpr int large_fwd_default_variant(int padded_head_dim, int smem_optin) {
  if (large_fwd_smem_bytes(padded_head_dim, kLargeFwdResident) <= smem_optin) return kLargeFwdResident;
  if (large_fwd_smem_bytes(padded_head_dim, kLargeFwdStreamed) <= smem_optin) return kLargeFwdStreamed;
  return -1;
}

// Warps of a forward block of either kernel (the item-less copy kernel runs with as many).
constexpr int fwd_block_warps(int padded_head_dim, int tile_q) {
  return is_large_head_dim(padded_head_dim) ? kLargeFwdWarps : fwd_warps(padded_head_dim, tile_q);
}

// Backward: dk/dv blocks of 128 keys x 64-row q chunks up to D 128 (4 warp pairs; each chunk's dQ atomics
// cover 128 keys: half the atomic traffic of 64-key tiles, measured 271 vs 203 bwd TFLOP/s on the H100), 64 keys
// at D 256 (register budget); dq blocks of 4 warps.
constexpr int kDkdvTileQ = 64;
// Above D 256 (backward_split_d.cuh): 32 keys up to D 512, 16 above, so that a block's dK and dV accumulators
// (keys x D fp32, split over 8 warps by columns) stay at <= 128 registers a thread.
constexpr int dkdv_tile_k(int padded_head_dim) {
  return padded_head_dim <= 128 ? 128 : padded_head_dim <= 256 ? 64 : padded_head_dim <= 512 ? 32 : 16;
}
// The D-split backward (tiles above 256): both kernels hold dkdv_tile_k(d) keys of K and V and kSplitBwdRows rows of Q
// and dO in shared memory (the dk/dv kernel walks each 64-row item chunk in steps of this many rows; the dq kernel's
// q tile), the fp32 partial S^T / dP^T of 8 warps (16 keys x 32 rows each, one matrix at a time; P^T and dS^T,
// [keys][64 rows] 16-bit, reuse that space) and the rows' lse2 and Delta. D 1024: 208 KB (H100 / H200: 227 KB);
// the A100 (163 KB) runs up to D 768, sm_86 / sm_89 (99 KB) D 320.
constexpr int kSplitBwdRows = 32;
constexpr bool split_d_backward(int padded_head_dim) { return padded_head_dim > 256; }
// One buffer of Q / dO: double-buffering them (the next step's loads during this one) measured no gain at D 320
// and 512 on the H200 (120 vs 118, 147 vs 148 bwd TFLOP/s; the kernel is bound by shared-memory reads).
constexpr int split_bwd_smem_bytes(int padded_head_dim) {
  const int d = padded_head_dim, n = dkdv_tile_k(d), m = kSplitBwdRows;
  return 2 * n * d * 2 + 2 * m * d * 2 + 2 * m * 4 + 8 * 16 * 32 * 4;
}
// Compiled variants of the D-split dk/dv kernel (the planner picks one per device: plan/tuned_configs.cpp).
// kLargeBwdSingle: one block per SM; kLargeBwdPaired: two blocks per SM (<= 128 registers a thread, phase 1 one
// matrix at a time), where two blocks fit (bwd_split_paired_fits). Both give the same bits.
enum LargeBwdVariant : int { kLargeBwdSingle = 0, kLargeBwdPaired = 1, kLargeBwdVariants = 2 };
constexpr int large_bwd_blocks_per_sm(int variant) { return variant == kLargeBwdPaired ? 2 : 1; }
// Compiled for the D 320 tile only (96 KB: two blocks fit Hopper's 228 KB); its dK, dV accumulators take 80 of
// the 128 registers. 384 holds 96 (too few left) and 512 and above do not fit twice. H100: +15-21% bwd TFLOP/s
// at D 320 (plan/tuned_configs.cpp).
constexpr bool bwd_split_paired_fits(int padded_head_dim) {
  return padded_head_dim == 320 && 2 * (split_bwd_smem_bytes(padded_head_dim) + 1024) <= 228 * 1024;
}
constexpr bool large_bwd_fits(int padded_head_dim, int variant, int smem_optin) {
  return (variant != kLargeBwdPaired || bwd_split_paired_fits(padded_head_dim)) &&
         large_bwd_blocks_per_sm(variant) * (split_bwd_smem_bytes(padded_head_dim) + 1024) <= smem_optin + 1024;
}
// Shared memory of the dk/dv kernel: K, V; Q, dO (double-buffered up to D 128); lse2, Delta; P^T and dS^T
// (with dq atomics up to D 128, two dS^T buffers); up to D 128 the stages' work items (32 bytes each). The
// host checks it against the device's limit (the dq-atomics kernel needs ~177 KB at D 128; smaller parts
// take the two-kernel path).
constexpr int dkdv_smem_bytes(int padded_head_dim, bool dq_atomics) {
  if (split_d_backward(padded_head_dim)) return split_bwd_smem_bytes(padded_head_dim);
  const int d = padded_head_dim, n = dkdv_tile_k(d), m = kDkdvTileQ;
  const bool register_resident = d <= 128;
  const int stages = register_resident ? 2 : 1;
  const int pds_tiles = dq_atomics && register_resident ? 3 : 2;
  return (2 * n * d + stages * 2 * m * d + pds_tiles * n * m) * 2 + stages * 2 * m * 4 +
         (register_resident ? stages * 32 : 0);
}
// dq: 128 rows (two m-tiles per warp) x 32 keys up to D 128 beat 64 x 64 (165 vs 159 bwd TFLOP/s, H200).
// Above D 256 the dq kernel has the dk/dv kernel's shapes (kSplitBwdRows rows, dkdv_tile_k keys a step).
constexpr int dq_tile_q(int padded_head_dim) {
  return padded_head_dim <= 128 ? 128 : padded_head_dim <= 256 ? 64 : kSplitBwdRows;
}
constexpr int dq_tile_k(int padded_head_dim) {
  return split_d_backward(padded_head_dim) ? dkdv_tile_k(padded_head_dim) : 32;
}

}  // namespace magi::cuda::detail
