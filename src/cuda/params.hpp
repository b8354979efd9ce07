// Plain structs shared by the host-side planner/dispatcher and the kernels (no CUDA types in here).
#pragma once

#include <cstdint>

namespace magi::cuda::detail {

// One rectangle of work: rows [q0, q1) of one slice against keys [k0, k1), both inside one tile of
// each axis. The slice's diagonal offsets let the kernel apply kept_keys per element when `flags`
// says the rectangle is not entirely kept.
struct WorkItem {
  int32_t q0, q1, k0, k1;
  int32_t causal_offset;  // slice: k <= q + causal_offset   (ke - qe)
  int32_t inv_offset;     // slice: k >= q + inv_offset      (ks - qs)
  int32_t flags;  // WorkFlags, and the test groups from bit kWorkTestGroupShift on
  int32_t pad;
};
enum WorkFlags : int32_t {
  kWorkCausal = 1,  // apply the causal bound
  kWorkInv = 2,     // apply the inverse-causal bound
  kWorkMasked = 4,  // some cell of the full tile x tile block is not kept: test every element
  // Masked items of k-major lists: bit kWorkTestGroupShift + g = the 16-key group g of the tile does not keep
  // every cell of the item's q chunk, so it needs the per-cell test (the dk/dv kernel's warps read it; kept in
  // `flags`, which stays live anyway, for the registers).
  kWorkTestGroupShift = 8,
};

// One tile of a list, in the plan's order (heavy first, tiles sharing data together): what a block needs to
// start it, in one 16-byte load (not a chain of dependent ones through an order and an offsets array).
struct TileInfo {
  int32_t tile;          // index along the major axis
  int32_t first;         // its first item in `items`
  int32_t count;         // its items
  int32_t first_minor0;  // the first item's minor start (q0 of a k-major list, k0 of a q-major one); 0 if none
};

// A work list on the device: blocks take (tile, head) pairs in the order of work_coords, each walks items
// [first, first + count) of its tile.
struct DeviceList {
  const TileInfo* tiles = nullptr;  // [num_tiles], heavy first (backend.cpp: group_tiles_sharing_data)
  const WorkItem* items = nullptr;
  int32_t num_tiles = 0;
  int32_t heavy_tiles = 0;     // the first tiles, taken with all their heads before the passes
  int32_t heads_per_pass = 0;  // a divisor of the kernel's heads (q heads, or kv heads for dk/dv); set by the plan
};

// Work index -> (position in `tiles`, head): first the heavy tiles, every head of one tile before the next (so
// that the long ones start early); then the other tiles with the heads in passes of `heads_per_pass`, each pass
// in the list's order, so that the blocks running together share the pass's data in L2 (the dk/dv kernel's Q/dO:
// taking every head of every tile in turn made short documents re-read them from DRAM). One pass of all heads
// is the list's order.
struct WorkCoords {
  int32_t tile_index, head;
};
constexpr WorkCoords work_coords(int32_t linear, int32_t heads, const DeviceList& list) {
  const int32_t heavy = list.heavy_tiles * heads;
  if (linear < heavy) return {linear / heads, linear % heads};
  linear -= heavy;
  const int32_t per_pass = list.heads_per_pass;
  const int32_t pass_size = per_pass * (list.num_tiles - list.heavy_tiles);
  const int32_t pass = linear / pass_size, in_pass = linear - pass * pass_size;
  const int32_t tile_index = in_pass / per_pass;
  return {list.heavy_tiles + tile_index, pass * per_pass + in_pass - tile_index * per_pass};
}

// Tile shapes shared by the planner and the kernels.
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
// the cells (src/cuda/backend.cpp; the distributed cost model mirrors it). On the H100 (D 128, bf16) a
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
// Backward: dk/dv blocks of 128 keys x 64-row q chunks up to D 128 (4 warp pairs; each chunk's dQ atomics
// cover 128 keys: half the atomic traffic of 64-key tiles, measured 271 vs 203 bwd TFLOP/s on the H100), 64 keys
// at D 256 (register budget); dq blocks of 4 warps.
constexpr int kDkdvTileQ = 64;
constexpr int dkdv_tile_k(int padded_head_dim) { return padded_head_dim <= 128 ? 128 : 64; }
// Shared memory of the dk/dv kernel: K, V; Q, dO (double-buffered up to D 128); lse2, Delta; P^T and dS^T
// (with dq atomics up to D 128, two dS^T buffers); up to D 128 the stages' work items (32 bytes each). The
// host checks it against the device's limit (the dq-atomics kernel needs ~177 KB at D 128; smaller parts
// take the two-kernel path).
constexpr int dkdv_smem_bytes(int padded_head_dim, bool dq_atomics) {
  const int d = padded_head_dim, n = dkdv_tile_k(d), m = kDkdvTileQ;
  const bool register_resident = d <= 128;
  const int stages = register_resident ? 2 : 1;
  const int pds_tiles = dq_atomics && register_resident ? 3 : 2;
  return (2 * n * d + stages * 2 * m * d + pds_tiles * n * m) * 2 + stages * 2 * m * 4 +
         (register_resident ? stages * 32 : 0);
}
// dq: 128 rows (two m-tiles per warp) x 32 keys up to D 128 beat 64 x 64 (165 vs 159 bwd TFLOP/s, H200).
constexpr int dq_tile_q(int padded_head_dim) { return padded_head_dim <= 128 ? 128 : 64; }
constexpr int dq_tile_k(int /*padded_head_dim*/) { return 32; }

enum SinkKind : int32_t { kSinkNone = 0, kSinkSH = 1, kSinkSSH = 2 };

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  float* max_logits;  // may be null
  const float* sink;  // may be null
  int32_t tq, tk, hq, hkv, d;
  int32_t sink_len, sink_kind;
  float scale_log2;       // softmax_scale * log2(e)
  float softcap;          // 0 = off
  float softcap_pre;      // softmax_scale / softcap
  float softcap_post;     // softcap * log2(e)
  int32_t out_fp32;
  // Optional partial result of the same rows over other keys (fp32 [Tq, Hq, D], natural-log lse [Tq, Hq]),
  // lse-merged into this call's result before it is written; may alias out (when fp32) and lse.
  const float* prev_out;
  const float* prev_lse;
  int32_t* work_counter;  // persistent grid: next work index (zeroed before each launch)
  DeviceList list;
};

struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;   // 16-bit, input dtype (converted by the preprocess kernel when the caller's is fp32)
  const float* lse2;   // [Hq][tq_pad]: lse (with the sink) in log2 units, 0 for empty rows
  const float* delta;  // [Hq][tq_pad]: dout . out
  int32_t tq_pad;      // >= Tq + 64, a multiple of 64 (whole 64-row chunks can be read)
  void* dq;
  void* dk;
  void* dv;
  int32_t tq, tk, hq, hkv, d;
  float scale_log2, softmax_scale;
  float softcap, softcap_pre, softcap_post;
  int32_t grad_fp32;  // dq (dq kernel) or dk (dk/dv kernel) is fp32
  int32_t dv_fp32;
  int32_t vector_stores;  // dk/dv kernel: dk and dv are 16-byte aligned (whole 8-column blocks per store)
  int32_t accumulate_dq;  // dq kernel: dq (fp32) += dQ instead of dq = dQ
  int32_t* work_counter;  // persistent grid: next work index (zeroed before each launch)
  DeviceList list;  // by_q_tile for dq, by_k_tile for dk/dv
  // Non-deterministic mode: the dk/dv kernel also adds dQ = dS K into this zeroed fp32 [Tq, Hq, D] buffer
  // with atomics (5 GEMMs instead of 7) and the dq kernel is skipped. Null: deterministic two-kernel path.
  float* dq_accum;
};

}  // namespace magi::cuda::detail
