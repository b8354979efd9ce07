// The CPU engine's plan: tile work lists for (mask, shapes), built once by make_plan and cached by the
// API layer; forward and backward only read it.
#pragma once

#include <cstdint>
#include <vector>

#include "magi/mask.hpp"
#include "mask/tiling.hpp"

namespace magi::cpu {

// Tile sizes, the one place they are chosen. 96 is a multiple of every vector width (8 or 16 floats) and
// of the register-block rows (6 on AVX2, 12 on AVX-512); measured faster than 64 for D 64 and 128.
struct TileConfig {
  int32_t tile_q;  // rows per q tile (forward and dq tasks; q chunk of dk/dv items)
  int32_t tile_k;  // keys per k tile (dk/dv tasks; k chunk of forward and dq items)
};
constexpr TileConfig tile_config(int32_t /*head_dim*/) { return {96, 96}; }

// A length every tile of every head dim divides: slices merged only at its multiples leave the work lists (and so
// the bits) unchanged (deterministic-mode MAGI_ATTENTION_AUTO_RANGE_MERGE; MergeRule in magi/mask.hpp).
constexpr int32_t kTileMultiple = 96;
constexpr bool every_tile_divides(int32_t length) {
  for (int32_t d = 8; d <= 1024; d += 8)
    if (length % tile_config(d).tile_q != 0 || length % tile_config(d).tile_k != 0) return false;
  return true;
}
static_assert(every_tile_divides(kTileMultiple));

struct Plan {
  Mask mask;  // slices are needed for element masking of partial items
  int32_t heads_q = 0;
  int32_t heads_kv = 0;
  int32_t head_dim = 0;
  TileConfig tiles{};
  tiling::TileLists by_q;  // forward and dq: items of each q tile
  tiling::TileLists by_k;  // dk/dv: items of each k tile
  // Tiles in decreasing order of work (cells of their items), so dynamic scheduling balances load.
  std::vector<int32_t> q_tile_order;
  std::vector<int32_t> k_tile_order;
};

}  // namespace magi::cpu
