#include "mask/tiling.hpp"

#include <algorithm>

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

template <class Axis>
TileLists build(const Mask& mask, int32_t total_major, int32_t tile_major, int32_t tile_minor) {
  TileLists lists;
  lists.tile_major = tile_major;
  lists.tile_minor = tile_minor;
  const int64_t num_tiles = (int64_t{total_major} + tile_major - 1) / tile_major;

  std::vector<Placed> placed;
  for (int32_t index = 0; index < static_cast<int32_t>(mask.slices.size()); ++index) {
    const Slice& s = mask.slices[index];
    const Range rows = Axis::non_empty(s);
    if (rows.empty()) continue;
    for (int64_t t = rows.start / tile_major; t * tile_major < rows.end; ++t) {
      const int32_t x0 = std::max<int32_t>(rows.start, static_cast<int32_t>(t * tile_major));
      const int32_t x1 = static_cast<int32_t>(std::min<int64_t>(rows.end, (t + 1) * tile_major));
      // Union of the kept minor intervals of positions [x0, x1).
      const int32_t lo = Axis::kept_minor(s, x0).start;
      const int32_t hi = Axis::kept_minor(s, x1 - 1).end;
      // Chunks aligned to the global minor grid, so each lies inside one minor tile.
      for (int64_t c = lo / tile_minor * int64_t{tile_minor}; c < hi; c += tile_minor) {
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

TileLists by_q_tile(const Mask& mask, int32_t tile_q, int32_t tile_k) {
  return build<QMajor>(mask, mask.total_q, tile_q, tile_k);
}

TileLists by_k_tile(const Mask& mask, int32_t tile_k, int32_t tile_q) {
  return build<KMajor>(mask, mask.total_k, tile_k, tile_q);
}

}  // namespace magi::tiling
