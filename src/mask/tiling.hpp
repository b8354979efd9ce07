// Block classification shared by every backend (CPU engine now, GPU planners later): which rectangles
// of which slices a tile of rows (or of keys) must visit, and whether a rectangle needs element masking.
// Tiles that no slice touches get no work, so cost follows the mask area.
#pragma once

#include <cstdint>
#include <vector>

#include "magi/mask.hpp"

namespace magi::tiling {

// Rows `q` of slice `slice` against keys `k`. Every kept cell of the slice inside q x k is covered;
// needs_mask is false only when every cell of q x k is kept (no per-element test needed).
struct TileWork {
  int32_t slice = 0;
  Range q;
  Range k;
  bool needs_mask = true;
};

// CSR lists: the work of major tile t is items[offsets[t] .. offsets[t + 1]).
struct TileLists {
  int32_t tile_major = 0;  // rows per tile along the major axis (q for by_q_tile, k for by_k_tile)
  int32_t tile_minor = 0;  // max extent of one item along the other axis
  std::vector<int64_t> offsets;
  std::vector<TileWork> items;

  // Tiles aligned to the slices (by_q_tile_aligned, by_k_tile_aligned): tile t covers major positions
  // [starts[t], starts[t + 1]) and
  // each item's minor chunk starts at a multiple of `unit`; empty: the uniform grid above.
  std::vector<int32_t> starts;
  int32_t unit = 0;

  int64_t num_tiles() const { return offsets.empty() ? 0 : static_cast<int64_t>(offsets.size()) - 1; }
  // Major tile t's first position and its extent.
  Range tile(int64_t t) const;
  // Cells a kernel computes for these lists: every item as a whole tile_major x tile_minor block.
  int64_t computed_cells() const { return static_cast<int64_t>(items.size()) * tile_major * tile_minor; }
};

// Major axis q: tile t covers rows [t * tile_q, min((t+1) * tile_q, total_q)). For each slice touching the
// tile (in slice-index order), the tile's rows in the slice and the union of their kept keys, cut into
// chunks of at most tile_k keys (ascending) at multiples of tile_k, so each item lies inside one k tile;
// each item's rows are trimmed to those keeping a key of its chunk. Items with no kept cell are omitted.
// Deterministic.
TileLists by_q_tile(const Mask& mask, int32_t tile_q, int32_t tile_k);

// The same with tiles that follow the slices: the q axis cut at the first kept row of every slice (rounded down to a
// multiple of `unit`) and between those cuts into tiles of tile_q rows (the last of a stretch shorter, a multiple of
// `unit` except at total_q); each slice's key chunks start at its tile rows' first kept key rounded down to `unit`, in
// steps of tile_k. Documents then take whole tiles from their first row and key instead of sharing the global grid's
// tiles with their neighbours. tile_q and tile_k must be multiples of `unit`.
TileLists by_q_tile_aligned(const Mask& mask, int32_t tile_q, int32_t tile_k, int32_t unit);

// Major axis k: the transpose (tile over keys, chunks of at most tile_q rows cut at multiples of tile_q,
// keys trimmed likewise), for dk/dv accumulation.
TileLists by_k_tile(const Mask& mask, int32_t tile_k, int32_t tile_q);

// Its aligned form (as by_q_tile_aligned, the axes swapped): the k axis cut at every slice's first key.
TileLists by_k_tile_aligned(const Mask& mask, int32_t tile_k, int32_t tile_q, int32_t unit);

}  // namespace magi::tiling
