// Tile shapes of the Hopper kernels, shared by the planner (host) and the kernels (no CUDA types in here).
#pragma once

namespace magi::cuda::sm90 {

// Above D 512, 64 x D fp32 (O of the smallest wgmma tile) needs the registers of two SMs: a cluster of two blocks
// takes each tile, each block holding half of D (its half of Q and K for S, of V and O), and the two add their S
// parts through distributed shared memory.
constexpr int forward_cluster_size(int padded_head_dim) { return padded_head_dim > 512 ? 2 : 1; }
// The part of D one block holds, whole 64-column swizzle atoms (tile 576: two blocks of 320, the last 64 columns
// zero); the shapes below follow it.
constexpr int forward_block_head_dim(int padded_head_dim) {
  return (padded_head_dim / forward_cluster_size(padded_head_dim) + 63) / 64 * 64;
}
// Head-dim tiles with a Hopper forward: every tile, those above 512 as clusters of two blocks (576: 320 each, 768:
// 384, 1024: 512).
constexpr bool sm90_forward_tile(int padded_head_dim) { return padded_head_dim <= 1024; }
// A block is a producer warpgroup and two or three consumer warpgroups. Up to a block's D 320 each consumer holds 64
// q rows with all of the block's columns of O. Above, 64 x D fp32 does not fit one warpgroup's registers: two
// consumers hold the same 64 rows, each half of the block's columns of O. In one block they take the items in turn
// (each item's S over all of D and its softmax by one, P V by both); in a cluster both compute S over the block's
// part, and each consumer adds what its peer in the other block (the same rows) computed.
constexpr bool forward_splits_columns(int padded_head_dim) { return forward_block_head_dim(padded_head_dim) > 320; }
// Rows per tile: 192 at D 64 (three consumers: a step's GEMMs are short there beside its softmax, and the tensor
// cores serve two while the third computes its softmax), 128 up to D 320, 64 above.
constexpr int forward_tile_q(int padded_head_dim) {
  return forward_splits_columns(padded_head_dim) ? 64 : padded_head_dim <= 64 ? 192 : 128;
}
// The row tiles a plan may take, largest first (choice 0 is forward_tile_q): the smaller ones where the larger
// computes clearly more cells (documents cut by the larger tiles). D 64: 192, 128, 64; D 128: 128, 64; else one.
// The 64-row tiles have one consumer a block and several blocks an SM (forward_blocks_per_sm), each walking its own
// works, so that one block's work ends (first softmax, last P V, epilogue) run under the others' items.
constexpr int forward_tile_q_choices(int padded_head_dim) {
  return padded_head_dim <= 64 ? 3 : padded_head_dim == 128 ? 2 : 1;
}
constexpr int forward_tile_q_choice(int padded_head_dim, int choice) {
  return choice == 0 ? forward_tile_q(padded_head_dim) : choice == 1 && padded_head_dim <= 64 ? 128 : 64;
}
// Blocks an SM: the 64-row tiles at D 64 three (57 KB of shared memory and 80 registers a thread each), at D 128 two
// (113 KB, 128 registers); else one.
constexpr int forward_blocks_per_sm(int padded_head_dim, int tile_q) {
  return tile_q != 64 || padded_head_dim > 128 ? 1 : padded_head_dim <= 64 ? 3 : 2;
}
// The planner takes each smaller tile where the largest would compute more than forward_small_tile_gain times its
// cells. A/Bs, bf16, 2 x 8k and 16 x 1k tokens, the cell ratio of each mask and the smaller tile's forward rate against
// the larger's:
// - D 64, 192 rows against 128 (H100): full 1.02 +7%, varlen full 1.02 +10%, causal 1.04 0%, shared question 1.08
//   +2%, varlen causal 1.09 +2%, block-causal 1.11 0%, sliding window 1.13 -2.5%, 16 x 1k full 1.13 -3%.
// - D 64, 192 rows against 64 (H200, three rounds): full 1.02 -13%, causal 1.05 -10%, shared question 1.08 -8%,
//   16 x 1k full 1.13 -1% (-3% against 128 rows), varlen full 1.21 +2%, sliding window 1.21 +9% (+5% against 128),
//   16 x 1k causal 1.30 +16% (+3%), varlen causal 1.36 +20%, block-causal 1.47 +26%.
// - D 128, 128 rows against 64 (H200, three rounds): full 1.00 -16%, shared question 1.01 -15%, causal 1.01 / 1.06
//   (16 x 1k) -16% / -10%, sliding window 1.07 -9%, varlen full 1.18 -4..0%, varlen causal 1.24 +4..+7%,
//   block-causal 1.32 +7..+10%.
constexpr double forward_small_tile_gain(int padded_head_dim, int small_tile_q) {
  return padded_head_dim == 128 ? 1.21 : small_tile_q == 64 ? 1.15 : 1.10;
}
constexpr bool prefer_small_forward_tile(int padded_head_dim, int small_tile_q, double large_tile_cells,
                                         double small_tile_cells) {
  return large_tile_cells > forward_small_tile_gain(padded_head_dim, small_tile_q) * small_tile_cells;
}
constexpr int forward_consumers(int padded_head_dim, int tile_q) {
  return forward_splits_columns(padded_head_dim) ? 2 : tile_q / 64;
}
// Keys per item: 128 up to D 128, 64 at D 256 (a 64 x 256 fp32 accumulator per warpgroup), 32 above (shared
// memory for Q and two or three stages of K and V). The tiles of several blocks an SM take 64, so that their stages
// fit beside each other.
constexpr int forward_tile_k(int padded_head_dim, int tile_q = 0) {
  if (forward_blocks_per_sm(padded_head_dim, tile_q) > 1) return 64;
  return padded_head_dim <= 128 ? 128 : padded_head_dim <= 256 ? 64 : 32;
}
// V's pipeline stages (as many as shared memory holds, up to 4; two in the tiles of several blocks an SM).
constexpr int forward_stages(int padded_head_dim, int tile_q = 0) {
  const int d = forward_block_head_dim(padded_head_dim);
  if (forward_blocks_per_sm(padded_head_dim, tile_q) > 1) return 2;
  return d <= 64 ? 4 : (d == 320 && forward_cluster_size(padded_head_dim) == 1) || d == 384 ? 3 : 2;
}
// K's: one more at D 256, where only that fits. A step waits for K first (Q K^T), V one GEMM later, and the
// producer loads K one item ahead of V (A/B, H100: D 256 +3-5% on every mask; a third K stage at D 128 lost 1-2%).
constexpr int forward_k_stages(int padded_head_dim, int tile_q = 0) {
  return padded_head_dim == 256 ? 3 : forward_stages(padded_head_dim, tile_q);
}
// Q's stages: two up to D 128, so that the next work's Q loads while this one runs; one above, where shared memory
// holds no second Q (with one stage at D 128 the consumers' loop spilled: -2..-3%).
constexpr int forward_q_stages(int padded_head_dim) { return padded_head_dim <= 128 ? 2 : 1; }
// The forward's works go in passes of about 32 blocks per q head (plan.cpp: streaming_heads_per_pass) where they
// stream at least this many keys on average, else in one pass. Tiles 128 / 256 from 1024 keys (H200, sustained load,
// 16 heads, fwd TFLOP/s, three rounds, passes of 4 heads against one): the documents' full mask (~1300 keys a work)
// 434 -> 438 at D 128, 513 -> 532 at D 256; 16 x 1k full (1024 keys) 509 -> 507, 535 -> 553; sliding window 1024
// (~1100) -0.5% at both. Below 1024 keys (16 x 1k causal: 576) passes lost up to 4%. D 64's three-consumer tile lost
// 2% on the documents' full mask in passes, so it and the large tiles (not measured there) keep 2048.
constexpr int forward_pass_min_keys(int padded_head_dim) {
  return padded_head_dim == 128 || padded_head_dim == 256 ? 1024 : 2048;
}
// At D 64 a consumer issues a work's first Q K^T beside its last P V of the work before, and that work's epilogue
// runs under the GEMM. A/B (H100, bf16, 2 x 8k / 16 x 1k, against one Q stage and the first Q K^T at the work's
// start): D 64 full +15% / +4%, causal +7% / +5%, shared question +12% / +11%, window, block-causal and varlen full
// +2..+5%, varlen causal -2%; at D 128 the same lost 1-3% (16 x 1k full -3%), where two Q stages alone gained 0..+3%.
constexpr bool forward_first_s_early(int padded_head_dim) { return padded_head_dim <= 64; }
// What the consumers exchange. In one block's column split, where they take the items in turn: four slots of P
// (64 rows x the item's keys, 16-bit), each slot's rows' maxima and factors (16 bytes a thread) and the row sums (two
// works x two consumers x 8 bytes a thread), aligned. In a cluster: the S parts (fp32, 64 rows, two consumers, two
// items in flight) that each consumer receives from its peer in the other block.
constexpr int forward_exchange_bytes(int padded_head_dim) {
  if (forward_cluster_size(padded_head_dim) > 1) return 2 * 2 * 64 * forward_tile_k(padded_head_dim) * 4;
  if (forward_splits_columns(padded_head_dim))
    return 4 * 64 * forward_tile_k(padded_head_dim) * 2 + 4 * 128 * 16 + 2 * 2 * 128 * 8 + 1024;
  return 0;
}
// The plain epilogue (out in the input dtype, no sink, no previous result to merge) has kernels of its own where each
// consumer holds all of its rows' columns (one block, no column split): the general epilogue's code, mostly not run,
// cost ~1700 cycles a work in instruction fetch (D 128). Up to D 128 its out goes through shared memory and a TMA
// store (a tile_q x D 16-bit tile beside Q, K and V); from D 256, where that does not fit, from registers.
constexpr bool forward_has_plain_out(int padded_head_dim) {
  return !forward_splits_columns(padded_head_dim) && forward_cluster_size(padded_head_dim) == 1;
}
constexpr bool forward_stages_out(int padded_head_dim) { return padded_head_dim <= 128; }
// Pairs of works that read the same K / V tiles in the same order (two q heads of one kv head, or two q tiles) run on
// a cluster of two blocks, each loading half of every K / V tile and multicasting it to both (the plain epilogue's
// kernel, 128-row tiles at D 128).
// Under the H200's power cap the K / V reads from L2 cost clock: a timing build that loaded them only for each work's
// first item ran the full mask's forward 13% faster at a 12% higher SM clock. The pairs, A/Bs on the H200 (bf16, 16
// heads, three calls of three rounds): 2 x 8k full +1.0..+2.3% (603 against 596 in the last), shared question +0.5%,
// 16 x 1k full -1.5% (works of eight items); with 16 q heads over 8 kv heads, pairs of q heads: full, causal and
// shared question +1.5..+2.5%. So the planner takes pairs where the tiles stream forward_pair_min_keys keys or more on
// average: of q heads where one kv head serves an even number, else of q tiles where at most an eighth of the pairs
// would be a tile alone (docs/cuda_notes.md, "Thirty-seventh session").
constexpr bool forward_takes_pairs(int padded_head_dim, int tile_q) { return padded_head_dim == 128 && tile_q == 128; }
// q tiles that follow the slices (tiling::by_q_tile_aligned, DeviceList::tile_unit): a document then starts its own
// tiles and key chunks instead of sharing the global grid's with its neighbours (bf16, 2 x 8k tokens of long-tailed
// documents: the varlen causal mask's 128 x 128 blocks compute 76% kept cells on the global grid, 86% aligned). The
// tiles start at multiples of 64 rows, so that each consumer's 64 rows of out are one TMA box; the key chunks too,
// which needs the key tile to be a multiple of 64 (the 128-row tiles at D 128 and 256).
constexpr int forward_tile_unit = 64;
constexpr bool forward_takes_aligned_tiles(int padded_head_dim, int tile_q) {
  return tile_q == 128 && (padded_head_dim == 128 || padded_head_dim == 256);
}
// The backward's k tiles likewise (tiling::by_k_tile_aligned), up to tile 256: 128 or 64 keys from multiples of 64
// (its q chunks are 64 rows on either grid).
constexpr int backward_tile_unit = 64;
constexpr bool backward_takes_aligned_tiles(int padded_head_dim) { return padded_head_dim <= 256; }
// Aligned tiles where the global grid computes more than this many times their cells (they cost a little more per
// tile: partial tiles, and every item of a partial tile masked).
constexpr double aligned_tile_gain = 1.02;
constexpr bool prefer_aligned_tiles(double grid_cells, double aligned_cells) {
  return grid_cells > aligned_tile_gain * aligned_cells;
}
constexpr int forward_pair_min_keys = 2048;
constexpr int forward_out_tile_bytes(int padded_head_dim, int tile_q) {
  return forward_stages_out(padded_head_dim) ? tile_q * padded_head_dim * 2 : 0;
}
constexpr int forward_smem_bytes(int padded_head_dim, int tile_q) {
  const int kv_rows = (forward_k_stages(padded_head_dim, tile_q) + forward_stages(padded_head_dim, tile_q)) *
                      forward_tile_k(padded_head_dim, tile_q);
  return (forward_q_stages(padded_head_dim) * tile_q + kv_rows) * forward_block_head_dim(padded_head_dim) * 2 +
         forward_exchange_bytes(padded_head_dim) + forward_out_tile_bytes(padded_head_dim, tile_q) + 1024;
}

// The backward (backward_kernel.cuh). Head-dim tiles up to 256 run in one block; above, a cluster of blocks of the
// D 256 layout, each holding its part of D of K, V, Q, dO and of dK, dV, dQ: every block computes S^T and dP^T over its
// part and adds the other blocks' through distributed shared memory. Two blocks up to 512 (tile 320 runs as 384: two
// 192-column parts, whole 128-byte swizzle atoms, its last 64 columns zero-filled by the TMA unit), three at 576 (192
// columns each) and 768 (256), four at 1024 (256). A block's dK and dV of 64 keys x 256 columns are all the registers
// of its two consumers, so larger D takes more blocks, not wider ones.
constexpr bool sm90_backward_tile(int padded_head_dim) {
  return padded_head_dim == 64 || padded_head_dim == 128 || padded_head_dim == 256 || padded_head_dim == 320 ||
         padded_head_dim == 384 || padded_head_dim == 512 || padded_head_dim == 576 || padded_head_dim == 768 ||
         padded_head_dim == 1024;
}
constexpr int backward_kernel_head_dim(int padded_head_dim) { return padded_head_dim == 320 ? 384 : padded_head_dim; }
constexpr int backward_cluster_size(int padded_head_dim) {
  return padded_head_dim <= 256 ? 1 : padded_head_dim <= 512 ? 2 : padded_head_dim <= 768 ? 3 : 4;
}
constexpr int backward_block_head_dim(int padded_head_dim) {
  return backward_kernel_head_dim(padded_head_dim) / backward_cluster_size(padded_head_dim);
}
// Keys per k tile (the k-major list's tiles): 128 where a block holds at most 128 columns, else 64 (a consumer's dK
// or dV of 64 keys x 256 columns is 128 fp32 registers a thread).
constexpr int backward_tile_k(int padded_head_dim) {
  return backward_block_head_dim(padded_head_dim) <= 128 ? 128 : 64;
}

// The Hopper dq kernel (dq_kernel.cuh: q-major, dQ = dS K recomputing S and dP, no reductions): at D 256, where the
// dk/dv kernel's dQ by vector reductions left the tensor cores idle (docs/cuda_notes.md, "The D 256 backward in two
// kernels"). 128-row q tiles (64 a consumer), 32-key items: Q and dO (64 KB each) and three stages of K and V fit.
constexpr bool sm90_dq_kernel(int padded_head_dim) { return padded_head_dim == 256; }
constexpr int dq_tile_q() { return 128; }
constexpr int dq_tile_k() { return 32; }
constexpr int dq_stages() { return 3; }
// Its works go in passes of heads by the forward's rule from 2048 keys on average (measured at 2048 only).
constexpr int dq_pass_min_keys() { return 2048; }

}  // namespace magi::cuda::sm90
