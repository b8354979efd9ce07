#include "mask/tiling.hpp"

#include <algorithm>
#include <climits>
#include <string>

#include "magi/error.hpp"

namespace magi::tiling {
namespace {

// The mask seen along one axis ("major", the tiled one) against the other ("minor"). For every slice
// type both ends of kept_minor(s, x) are non-decreasing in x, and likewise for kept_major(s, y); that
// makes every union below one contiguous interval given by its first and last members.
struct QMajor {
  static Range kept_minor(const Slice& s, int32_t q) { return kept_keys(s, q); }
  static Range kept_major(const Slice& s, int32_t k) { return kept_queries(s, k); }
  static TileWork item(int32_t slice, Range major, Range minor, bool needs_mask) {
    return {slice, major, minor, needs_mask};
  }
  // Rows of `s` that keep at least one key (closed form per type).
  static Range non_empty(const Slice& s) {
    const int32_t sq = s.q.size(), sk = s.k.size();
    if (sq == 0 || sk == 0) return {0, 0};
    switch (s.type) {
      case MaskType::Full:
        return s.q;
      case MaskType::Causal:
        return {std::max(s.q.start, s.q.end - sk), s.q.end};  // q >= qe - Sk
      case MaskType::InvCausal:
        return {s.q.start, std::min(s.q.end, s.q.start + sk)};  // q < qs + Sk
      case MaskType::BiCausal:
        return sq <= sk ? s.q : Range{0, 0};
    }
    return {0, 0};
  }
};

struct KMajor {
  static Range kept_minor(const Slice& s, int32_t k) { return kept_queries(s, k); }
  static Range kept_major(const Slice& s, int32_t q) { return kept_keys(s, q); }
  static TileWork item(int32_t slice, Range major, Range minor, bool needs_mask) {
    return {slice, minor, major, needs_mask};
  }
  // Keys of `s` kept by at least one row: all of them, except BI_CAUSAL with Sq > Sk keeps nothing.
  static Range non_empty(const Slice& s) {
    const int32_t sq = s.q.size(), sk = s.k.size();
    if (sq == 0 || sk == 0) return {0, 0};
    if (s.type == MaskType::BiCausal && sq > sk) return {0, 0};
    return s.k;
  }
};

struct Placed {
  int64_t tile;
  TileWork work;
};

// `starts`: the tiles' first positions and total_major after them (aligned tiles), or empty for the uniform grid.
template <class Axis>
TileLists build(const Mask& mask, int32_t total_major, int32_t tile_major, int32_t tile_minor,
                std::vector<int32_t> starts = {}, int32_t unit = 0) {
  TileLists lists;
  lists.tile_major = tile_major;
  lists.tile_minor = tile_minor;
  lists.unit = unit;
  lists.starts = std::move(starts);
  const bool aligned = !lists.starts.empty();
  const int64_t num_tiles = aligned ? static_cast<int64_t>(lists.starts.size()) - 1
                                    : (int64_t{total_major} + tile_major - 1) / tile_major;
  // The chunks' grid: each chunk inside one minor tile of the global grid, or from the slice's first kept minor
  // position of the tile rounded down to `unit`.
  const int32_t chunk_unit = aligned ? unit : tile_minor;

  std::vector<Placed> placed;
  for (int32_t index = 0; index < static_cast<int32_t>(mask.slices.size()); ++index) {
    const Slice& s = mask.slices[index];
    const Range rows = Axis::non_empty(s);
    if (rows.empty()) continue;
    const int64_t first_tile =
        aligned ? std::upper_bound(lists.starts.begin(), lists.starts.end(), rows.start) - lists.starts.begin() - 1
                : rows.start / tile_major;
    for (int64_t t = first_tile; t < num_tiles && lists.tile(t).start < rows.end; ++t) {
      const Range tile = lists.tile(t);
      const int32_t x0 = std::max(rows.start, tile.start);
      const int32_t x1 = std::min(rows.end, tile.end);
      // Union of the kept minor intervals of positions [x0, x1).
      const int32_t lo = Axis::kept_minor(s, x0).start;
      const int32_t hi = Axis::kept_minor(s, x1 - 1).end;
      for (int64_t c = lo / chunk_unit * int64_t{chunk_unit}; c < hi; c += tile_minor) {
        const int32_t c0 = std::max<int32_t>(lo, static_cast<int32_t>(c));
        const int32_t c1 = static_cast<int32_t>(std::min<int64_t>(hi, c + tile_minor));
        // Positions of this tile keeping something in [c0, c1): again one interval.
        const int32_t a = std::max(x0, Axis::kept_major(s, c0).start);
        const int32_t b = std::min(x1, Axis::kept_major(s, c1 - 1).end);
        if (a >= b) continue;
        // Every cell kept iff the first position's interval reaches c1 (its end is the smallest) and the
        // last position's interval starts by c0 (its start is the largest).
        const Range first = Axis::kept_minor(s, a), last = Axis::kept_minor(s, b - 1);
        const bool all_kept = !first.empty() && !last.empty() && first.end >= c1 && last.start <= c0;
        placed.push_back({t, Axis::item(index, {a, b}, {c0, c1}, !all_kept)});
      }
    }
  }

  // Stable counting sort by tile: within a tile, slice-index order then ascending chunks.
  lists.offsets.assign(static_cast<size_t>(num_tiles) + 1, 0);
  for (const Placed& p : placed) ++lists.offsets[static_cast<size_t>(p.tile) + 1];
  for (int64_t t = 0; t < num_tiles; ++t) lists.offsets[t + 1] += lists.offsets[t];
  lists.items.resize(placed.size());
  std::vector<int64_t> cursor(lists.offsets.begin(), lists.offsets.end() - 1);
  for (const Placed& p : placed) lists.items[static_cast<size_t>(cursor[p.tile]++)] = p.work;
  return lists;
}

}  // namespace

Range TileLists::tile(int64_t t) const {
  if (!starts.empty()) return {starts[static_cast<size_t>(t)], starts[static_cast<size_t>(t) + 1]};
  return {static_cast<int32_t>(t * tile_major), static_cast<int32_t>(std::min<int64_t>((t + 1) * tile_major, INT32_MAX))};
}

TileLists by_q_tile(const Mask& mask, int32_t tile_q, int32_t tile_k) {
  return build<QMajor>(mask, mask.total_q, tile_q, tile_k);
}

namespace {

template <class Axis>
TileLists build_aligned(const Mask& mask, int32_t total_major, int32_t tile_major, int32_t tile_minor, int32_t unit) {
  if (unit <= 0 || tile_major % unit != 0 || tile_minor % unit != 0)
    throw InvalidArgument("tiling: tiles " + std::to_string(tile_major) + " x " + std::to_string(tile_minor) +
                          " are not multiples of the unit " + std::to_string(unit));
  std::vector<int32_t> cuts{0};
  for (const Slice& s : mask.slices) {
    const Range rows = Axis::non_empty(s);
    if (!rows.empty()) cuts.push_back(rows.start / unit * unit);
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<int32_t> starts;
  for (size_t i = 0; i < cuts.size(); ++i) {
    const int32_t end = i + 1 < cuts.size() ? cuts[i + 1] : total_major;
    for (int64_t at = cuts[i]; at < end; at += tile_major) starts.push_back(static_cast<int32_t>(at));
  }
  starts.push_back(total_major);
  if (total_major == 0) starts = {0};
  return build<Axis>(mask, total_major, tile_major, tile_minor, std::move(starts), unit);
}

}  // namespace

TileLists by_q_tile_aligned(const Mask& mask, int32_t tile_q, int32_t tile_k, int32_t unit) {
  return build_aligned<QMajor>(mask, mask.total_q, tile_q, tile_k, unit);
}

TileLists by_k_tile_aligned(const Mask& mask, int32_t tile_k, int32_t tile_q, int32_t unit) {
  return build_aligned<KMajor>(mask, mask.total_k, tile_k, tile_q, unit);
}

TileLists by_k_tile(const Mask& mask, int32_t tile_k, int32_t tile_q) {
  return build<KMajor>(mask, mask.total_k, tile_k, tile_q);
}

}  // namespace magi::tiling
