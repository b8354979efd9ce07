// Plain structs shared by the host-side planner/dispatcher and the kernels of every family (no CUDA types in here).
// Each family's tile shapes: src/cuda/sm80/tiles.hpp, src/cuda/sm90/tiles.hpp.
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
  // k-major lists: how many items before this one, in the Hopper dk/dv kernel's order (tiles in the list's order,
  // each tile's items last first), have its 64-row q chunk: the order in which its deterministic mode adds their
  // dQ (plan/plan.cpp: rank_dq_adds).
  int32_t rank;
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
  int32_t tile;          // index along the major axis (a list with tile_unit: start / tile_unit * 2 + short, tile_rows)
  int32_t first;         // its first item in `items`
  int32_t count;         // its items
  int32_t first_minor0;  // the first item's minor start (q0 of a k-major list, k0 of a q-major one); 0 if none
};

// A work list on the device: blocks take (tile, head) pairs in the order of work_coords, each walks items
// [first, first + count) of its tile.
struct DeviceList {
  const TileInfo* tiles = nullptr;  // [num_tiles], heavy first (plan/plan.cpp: group_tiles_sharing_data)
  const WorkItem* items = nullptr;
  int32_t num_tiles = 0;
  int32_t heavy_tiles = 0;     // the first tiles, taken with all their heads before the passes
  int32_t heads_per_pass = 0;  // a divisor of the kernel's heads (q heads, or kv heads for dk/dv); set by the plan
  // Tiles aligned to the slices (tiling::by_q_tile_aligned; the Hopper forward's 128-row tiles only): tiles start at
  // multiples of tile_unit (a power of two) and are tile_unit or the tile's rows long; the items' key chunks start at
  // multiples of it. 0: the uniform grid.
  int32_t tile_unit = 0;
};

// A q tile's rows [start, end) (end may pass the tensor's rows) and an item's first key, on either grid.
struct TileRows {
  int32_t start, end;
};
constexpr TileRows tile_rows(const DeviceList& list, int32_t tile, int32_t tile_q) {
  if (list.tile_unit == 0) return {tile * tile_q, tile * tile_q + tile_q};
  const int32_t start = (tile >> 1) * list.tile_unit;
  return {start, start + ((tile & 1) ? list.tile_unit : tile_q)};
}
constexpr int32_t chunk_start(const DeviceList& list, int32_t k0, int32_t tile_k) {
  return list.tile_unit == 0 ? k0 / tile_k * tile_k : k0 & -list.tile_unit;
}

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

// The list the attention kernel walks where the copy kernel takes the last `itemless` tiles (every head): its
// passes then span only the tiles before those, so that each (tile, head) runs exactly once in one of the two.
constexpr DeviceList without_last_tiles(DeviceList list, int32_t itemless) {
  list.num_tiles -= itemless;
  return list;
}

// Dtype tags, so that plain C++ translation units can dispatch to the kernels' instantiations.
enum DtypeTag : int { kBf16 = 0, kFp16 = 1 };

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
  // Pairs of works for the Hopper forward's clusters (sm90::forward_takes_pairs), num_tiles 0: none. Either the tiles
  // with items as pairs (tiles 2i and 2i + 1 read the same K / V tiles in the same order, a tile without a partner is
  // its own; passes count pairs), or, with pairs_of_heads, the list itself, whose q heads 2j and 2j + 1 of a tile pair
  // up (one kv head serves both).
  DeviceList pairs;
  int32_t pairs_of_heads;
};

struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;   // 16-bit, input dtype (converted by the preprocess kernel when the caller's is fp32)
  const float* lse2;   // [Hq][tq_pad] (stats_index): lse (with the sink) in log2 units, 0 for empty rows
  const float* delta;  // [Hq][tq_pad] (stats_index): dout . out
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
  // The Hopper dk/dv kernel at tiles 64 / 128 without concatenated heads adds in fragment order instead
  // (dq_fragment_index; sm90::backward_dq_in_fragments).
  float* dq_accum;
  // Deterministic mode on the Hopper dk/dv kernel up to D 128: its dQ adds into dq_accum in item rank order,
  // each (consumer, q head, 64-row chunk) counting its finished adds here ([2][Hq][tq_pad / 64], zeroed).
  int32_t* dq_semaphores;
  // MAGI_ATTENTION_CATGQA on the Hopper dk/dv kernel (D <= 128): > 1, the q heads of a kv head (cat_group of them,
  // a divisor of 64) concatenated as rows r = token * cat_group + head-in-group; the list's q chunks are
  // 64 / cat_group tokens, and lse2 / Delta are in that row order (stats_index). 1: one head at a time.
  int32_t cat_group;
};

// Where the backward's row statistics (lse2, Delta) of q head `head`, row `row` live: [Hq][tq_pad], or with
// concatenated heads (cat_group > 1) [Hkv][tq_pad][cat_group], so that a kv head's concatenated rows are contiguous.
constexpr int64_t stats_index(int32_t head, int32_t row, int32_t tq_pad, int32_t cat_group) {
  return cat_group > 1 ? (int64_t{head / cat_group} * tq_pad + row) * cat_group + head % cat_group
                       : int64_t{head} * tq_pad + row;
}

// dq_accum in fragment order (the Hopper dk/dv kernel at tiles 64 / 128, one head at a time): per (64-row chunk, q
// head) a block of 64 x tile_d floats, per consumer c (columns [c tile_d / 2, (c + 1) tile_d / 2)) a half of it in the
// order the consumer's dQ accumulator holds them: [8-column block nb][thread t][4], thread t = 32 w + 4 i + k holding
// rows 16 w + i + {0, 8} and columns 8 nb + 2 k + {0, 1} ([row half][column] in its 4). Each thread then stores its
// fragment as 16-byte pieces (conflict-free), the tile leaves by one bulk reduce-add, and the dq conversion puts the
// rows back (launch_convert_fragments): storing the swizzled [row][column] tile took 16 8-byte stores a thread and
// cost the D 128 backward ~4% (H200, 2026-11-28).
constexpr int64_t dq_fragment_floats(int32_t tq, int32_t hq, int32_t tile_d) {
  return int64_t{(tq + 63) / 64} * hq * 64 * tile_d;
}
// The first float of consumer `consumer`'s half of chunk `chunk` of q head `head`.
constexpr int64_t dq_fragment_base(int32_t chunk, int32_t head, int32_t consumer, int32_t hq, int32_t tile_d) {
  return (int64_t{chunk} * hq + head) * 64 * tile_d + int64_t{consumer} * 32 * tile_d;
}

}  // namespace magi::cuda::detail
