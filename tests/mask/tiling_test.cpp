// Tile work lists against brute force: every kept cell covered exactly once, no empty items, exact
// needs_mask, items inside their tiles.
#include "mask/tiling.hpp"

#include "cuda/params.hpp"
#include "magi/error.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

namespace magi::tiling {
namespace {

bool kept(const Slice& s, int32_t q, int32_t k) {
  const Range r = kept_keys(s, q);
  return k >= r.start && k < r.end;
}

// Random slices over a small grid; areas may overlap (the tiling treats slices independently).
Mask random_mask(std::mt19937_64& rng, int32_t total_q, int32_t total_k, int num_slices) {
  Mask mask;
  mask.total_q = total_q;
  mask.total_k = total_k;
  auto range = [&](int32_t total) {
    std::uniform_int_distribution<int32_t> d(0, total);
    int32_t a = d(rng), b = d(rng);
    if (a > b) std::swap(a, b);
    return Range{a, b};
  };
  std::uniform_int_distribution<int> type(0, 3);
  for (int i = 0; i < num_slices; ++i)
    mask.slices.push_back({range(total_q), range(total_k), static_cast<MaskType>(type(rng))});
  return mask;
}

// Checks one list; `q_major` says whether the major axis is q.
void check_lists(const Mask& mask, const TileLists& lists, bool q_major, const std::string& where) {
  const int32_t total_major = q_major ? mask.total_q : mask.total_k;
  const bool aligned = !lists.starts.empty();
  if (aligned) {
    // Tiles partition the rows, start at multiples of the unit, at most tile_major long, whole units but the last;
    // every slice's first kept row (rounded down to the unit) starts one.
    ASSERT_EQ(lists.starts.size(), static_cast<size_t>(lists.num_tiles()) + 1) << where;
    ASSERT_EQ(lists.starts.front(), 0) << where;
    ASSERT_EQ(lists.starts.back(), total_major) << where;
    for (int64_t t = 0; t < lists.num_tiles(); ++t) {
      const Range r = lists.tile(t);
      ASSERT_TRUE(!r.empty() || total_major == 0) << where << " tile " << t;
      EXPECT_LE(r.size(), lists.tile_major) << where << " tile " << t;
      EXPECT_EQ(r.start % lists.unit, 0) << where << " tile " << t;
      if (t + 1 < lists.num_tiles()) EXPECT_EQ(r.size() % lists.unit, 0) << where << " tile " << t;
    }
    for (const Slice& s : mask.slices) {
      const Range along = q_major ? s.q : s.k;
      int32_t first = along.start;
      while (first < along.end && (q_major ? kept_keys(s, first) : kept_queries(s, first)).empty()) ++first;
      if (first == along.end) continue;
      EXPECT_TRUE(std::binary_search(lists.starts.begin(), lists.starts.end(), first / lists.unit * lists.unit))
          << where << ": no tile starts at slice rows " << first;
    }
  } else {
    ASSERT_EQ(lists.num_tiles(), (total_major + lists.tile_major - 1) / lists.tile_major) << where;
  }
  ASSERT_EQ(lists.offsets.front(), 0) << where;
  ASSERT_EQ(lists.offsets.back(), static_cast<int64_t>(lists.items.size())) << where;

  // cover[slice][q * total_k + k] counts how many items of that slice cover the cell.
  std::vector<std::vector<int>> cover(mask.slices.size(),
                                      std::vector<int>(size_t(mask.total_q) * mask.total_k, 0));
  for (int64_t t = 0; t < lists.num_tiles(); ++t) {
    ASSERT_LE(lists.offsets[t], lists.offsets[t + 1]) << where;
    int32_t previous_slice = -1;
    for (int64_t i = lists.offsets[t]; i < lists.offsets[t + 1]; ++i) {
      const TileWork& w = lists.items[i];
      const std::string item = where + " tile " + std::to_string(t) + " item " + std::to_string(i);
      ASSERT_GE(w.slice, previous_slice) << item << ": items not in slice order";
      previous_slice = w.slice;
      ASSERT_FALSE(w.q.empty()) << item;
      ASSERT_FALSE(w.k.empty()) << item;
      const Range major = q_major ? w.q : w.k;
      const Range minor = q_major ? w.k : w.q;
      EXPECT_GE(major.start, lists.tile(t).start) << item;
      EXPECT_LE(major.end, lists.tile(t).end) << item;
      if (aligned) {  // inside the chunk from its first key rounded down to the unit
        EXPECT_LE(minor.end, minor.start / lists.unit * lists.unit + lists.tile_minor) << item << ": chunk too long";
      } else {
        EXPECT_EQ(minor.start / lists.tile_minor, (minor.end - 1) / lists.tile_minor)
            << item << ": crosses a minor tile boundary";
      }
      const Slice& s = mask.slices[w.slice];
      int64_t kept_cells = 0;
      for (int32_t q = w.q.start; q < w.q.end; ++q)
        for (int32_t k = w.k.start; k < w.k.end; ++k)
          if (kept(s, q, k)) {
            ++kept_cells;
            ++cover[w.slice][size_t(q) * mask.total_k + k];
          }
      EXPECT_GT(kept_cells, 0) << item << ": item without kept cells";
      const int64_t cells = int64_t{w.q.size()} * w.k.size();
      EXPECT_EQ(w.needs_mask, kept_cells != cells) << item << ": needs_mask wrong";
    }
  }
  for (size_t si = 0; si < mask.slices.size(); ++si)
    for (int32_t q = 0; q < mask.total_q; ++q)
      for (int32_t k = 0; k < mask.total_k; ++k) {
        const int expected = kept(mask.slices[si], q, k) ? 1 : 0;
        ASSERT_EQ(cover[si][size_t(q) * mask.total_k + k], expected)
            << where << " slice " << si << " cell (" << q << ", " << k << ")";
      }
}

TEST(Tiling, RandomMasksMatchBruteForce) {
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> total(1, 48), tile(1, 17), count(1, 12);
  for (int trial = 0; trial < 1000; ++trial) {
    const Mask mask = random_mask(rng, total(rng), total(rng), count(rng));
    const int32_t tq = tile(rng), tk = tile(rng);
    const std::string where = "seed " + std::to_string(seed) + " trial " + std::to_string(trial) + " tiles " +
                              std::to_string(tq) + "x" + std::to_string(tk);
    check_lists(mask, by_q_tile(mask, tq, tk), true, where + " by_q");
    check_lists(mask, by_k_tile(mask, tk, tq), false, where + " by_k");
    const int32_t unit = std::uniform_int_distribution<int32_t>(1, 6)(rng);
    check_lists(mask, by_q_tile_aligned(mask, unit * (1 + trial % 3), unit * (1 + trial / 3 % 3), unit), true,
                where + " by_q aligned, unit " + std::to_string(unit));
    check_lists(mask, by_k_tile_aligned(mask, unit * (1 + trial % 3), unit * (1 + trial / 3 % 3), unit), false,
                where + " by_k aligned, unit " + std::to_string(unit));
    if (HasFatalFailure()) return;
  }
}

// Documents of any length: the aligned tiles start at every document (rounded down to 64 rows), its key chunks at its
// first key, and the cells they compute are those of whole 128-row tiles per document.
TEST(Tiling, AlignedTilesFollowDocuments) {
  const std::vector<int32_t> lengths = {256, 64, 384, 200, 130, 1000};
  std::vector<int32_t> cu{0};
  for (int32_t n : lengths) cu.push_back(cu.back() + n);
  const Mask mask = masks::varlen_causal(cu);
  const TileLists grid = by_q_tile(mask, 128, 128), aligned = by_q_tile_aligned(mask, 128, 128, 64);
  check_lists(mask, aligned, true, "varlen causal aligned");
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    EXPECT_TRUE(std::binary_search(aligned.starts.begin(), aligned.starts.end(), cu[d] / 64 * 64)) << "document " << d;
  // Documents 0, 1, 2 start on the global grid's tiles too; 200 and 130 rows then share tiles with their neighbours.
  EXPECT_LT(aligned.computed_cells(), grid.computed_cells());
  // Causal documents of multiples of 128 rows starting at multiples of 64: each a triangle of whole tiles.
  const Mask even = masks::varlen_causal({0, 64, 320, 576});
  const TileLists e = by_q_tile_aligned(even, 128, 128, 64);
  EXPECT_EQ(e.items.size(), 1u + 3u + 3u);
  EXPECT_EQ(e.starts, (std::vector<int32_t>{0, 64, 192, 320, 448, 576}));
  EXPECT_THROW(by_q_tile_aligned(even, 100, 128, 64), InvalidArgument);
  EXPECT_THROW(by_q_tile_aligned(even, 128, 96, 64), InvalidArgument);
}

TEST(Tiling, EverySliceShapeWithSqNotEqualSk) {
  // Exhaustive small shapes, all types, including Sq > Sk (empty rows) and Sq < Sk.
  for (int type = 0; type < 4; ++type)
    for (int32_t sq = 0; sq <= 9; ++sq)
      for (int32_t sk = 0; sk <= 9; ++sk) {
        Mask mask;
        mask.total_q = sq + 3;
        mask.total_k = sk + 2;
        mask.slices.push_back({{2, 2 + sq}, {1, 1 + sk}, static_cast<MaskType>(type)});
        const std::string where =
            "type " + std::to_string(type) + " sq " + std::to_string(sq) + " sk " + std::to_string(sk);
        for (int32_t tq : {1, 2, 4})
          for (int32_t tk : {1, 3, 8}) {
            check_lists(mask, by_q_tile(mask, tq, tk), true, where + " by_q");
            check_lists(mask, by_k_tile(mask, tk, tq), false, where + " by_k");
            if (HasFatalFailure()) return;
          }
      }
}

TEST(Tiling, FullAndEmptyTilesOfCausal) {
  // 256 x 256 causal with 64-tiles: 10 q-tile blocks, 4 of them on the diagonal need masking.
  Mask mask;
  mask.total_q = mask.total_k = 256;
  mask.slices.push_back({{0, 256}, {0, 256}, MaskType::Causal});
  const TileLists lists = by_q_tile(mask, 64, 64);
  ASSERT_EQ(lists.items.size(), 10u);
  int masked = 0;
  for (const TileWork& w : lists.items) masked += w.needs_mask ? 1 : 0;
  EXPECT_EQ(masked, 4);
  for (int64_t t = 0; t < 4; ++t) EXPECT_EQ(lists.offsets[t + 1] - lists.offsets[t], t + 1);
}

TEST(Tiling, ManySlicesScaleWithItems) {
  // 100k one-token-apart documents: lists stay proportional to the slices, not to the grid.
  Mask mask;
  const int32_t docs = 100000, len = 8;
  mask.total_q = mask.total_k = docs * len;
  for (int32_t d = 0; d < docs; ++d)
    mask.slices.push_back({{d * len, (d + 1) * len}, {d * len, (d + 1) * len}, MaskType::Causal});
  const TileLists by_q = by_q_tile(mask, 64, 64);
  const TileLists by_k = by_k_tile(mask, 64, 64);
  EXPECT_EQ(by_q.items.size(), size_t(docs));  // each document lies inside one 64-tile
  EXPECT_EQ(by_k.items.size(), size_t(docs));
  for (const TileWork& w : by_q.items) {
    EXPECT_EQ(w.q.size(), len);
    EXPECT_TRUE(w.needs_mask);
  }
}

// The CUDA kernels' block order over a list's (tile, head) pairs: heavy tiles first with all their heads, then
// passes of heads over the other tiles; every pair exactly once, in that order.
TEST(WorkOrder, EveryTileAndHeadOnceHeavyFirstThenPasses) {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 50; ++trial) {
    const int32_t heads = std::vector<int32_t>{1, 2, 4, 6, 8, 16}[rng() % 6];
    std::vector<int32_t> divisors;
    for (int32_t h = 1; h <= heads; ++h)
      if (heads % h == 0) divisors.push_back(h);
    cuda::detail::DeviceList list;
    list.num_tiles = 1 + static_cast<int32_t>(rng() % 40);
    list.heavy_tiles = static_cast<int32_t>(rng() % (list.num_tiles + 1));
    list.heads_per_pass = divisors[rng() % divisors.size()];
    std::vector<int> seen(static_cast<size_t>(list.num_tiles) * heads, 0);
    int32_t prev_pass = 0, prev_tile = -1;
    for (int32_t linear = 0; linear < list.num_tiles * heads; ++linear) {
      const cuda::detail::WorkCoords at = cuda::detail::work_coords(linear, heads, list);
      ASSERT_GE(at.tile_index, 0);
      ASSERT_LT(at.tile_index, list.num_tiles);
      ASSERT_GE(at.head, 0);
      ASSERT_LT(at.head, heads);
      ++seen[static_cast<size_t>(at.tile_index) * heads + at.head];
      if (linear < list.heavy_tiles * heads) {
        EXPECT_EQ(at.tile_index, linear / heads);  // heavy tiles: all heads of one tile, then the next
        continue;
      }
      EXPECT_GE(at.tile_index, list.heavy_tiles);
      const int32_t pass = at.head / list.heads_per_pass;
      EXPECT_GE(pass, prev_pass);                             // passes in order
      if (pass == prev_pass) EXPECT_GE(at.tile_index, prev_tile);  // each pass heaviest (first) tile first
      if (pass != prev_pass) prev_tile = -1;
      prev_pass = pass;
      prev_tile = std::max(prev_tile, at.tile_index);
    }
    for (int count : seen) EXPECT_EQ(count, 1);
  }
}

// A forward launch: the attention kernel walks the list without its last (item-less) tiles, the copy kernel takes
// those with every head; together every (tile, head) once, also in passes of heads.
TEST(WorkOrder, AttentionAndCopyKernelsTakeEveryTileAndHeadOnce) {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 50; ++trial) {
    const int32_t heads = std::vector<int32_t>{2, 4, 8, 16}[rng() % 4];
    cuda::detail::DeviceList list;
    list.num_tiles = 2 + static_cast<int32_t>(rng() % 40);
    const auto itemless = 1 + static_cast<int32_t>(rng() % (list.num_tiles - 1));
    list.heavy_tiles = static_cast<int32_t>(rng() % (list.num_tiles - itemless + 1));
    list.heads_per_pass = heads / 2;
    const cuda::detail::DeviceList walked = cuda::detail::without_last_tiles(list, itemless);
    std::vector<int> seen(static_cast<size_t>(list.num_tiles) * heads, 0);
    for (int32_t linear = 0; linear < walked.num_tiles * heads; ++linear) {
      const cuda::detail::WorkCoords at = cuda::detail::work_coords(linear, heads, walked);
      ASSERT_LT(at.tile_index, list.num_tiles - itemless) << "an item-less tile on the attention kernel";
      ++seen[static_cast<size_t>(at.tile_index) * heads + at.head];
    }
    for (int32_t t = list.num_tiles - itemless; t < list.num_tiles; ++t)
      for (int32_t h = 0; h < heads; ++h) ++seen[static_cast<size_t>(t) * heads + h];
    for (int count : seen) EXPECT_EQ(count, 1);
  }
}

}  // namespace
}  // namespace magi::tiling
