// merge_slices against brute force: the same cells with the same counts (mask_oracle), never more slices, a fixed
// point; each merge rule and its limits by hand; with a boundary multiple, tile lists that do not change.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cuda/params.hpp"
#include "magi/mask.hpp"
#include "mask/mask_oracle.hpp"
#include "mask/tiling.hpp"
#include "reference/random_inputs.hpp"

namespace magi {
namespace {

using test::make_slice;
using F = MaskType;

Mask mask_of(std::vector<Slice> slices, int32_t total_q, int32_t total_k) {
  Mask m;
  m.slices = std::move(slices);
  m.total_q = total_q;
  m.total_k = total_k;
  return m;
}

// The properties every result must have, whatever the rule.
testing::AssertionResult equivalent_fixed_point(const Mask& in, const Mask& out, MergeRule rule) {
  if (out.total_q != in.total_q || out.total_k != in.total_k) return testing::AssertionFailure() << "totals changed";
  if (out.slices.size() > in.slices.size()) return testing::AssertionFailure() << "more slices";
  if (test::cell_counts(out) != test::cell_counts(in)) return testing::AssertionFailure() << "cells changed";
  for (const Slice& s : out.slices)
    if (area(s) == 0) return testing::AssertionFailure() << "zero-area slice kept";
  const Mask again = merge_slices(out, rule);
  if (again.slices != out.slices) return testing::AssertionFailure() << "not a fixed point";
  return testing::AssertionSuccess();
}

Mask merged(std::vector<Slice> slices, int32_t tq, int32_t tk, MergeRule rule = {}) {
  const Mask in = mask_of(std::move(slices), tq, tk);
  Mask out = merge_slices(in, rule);
  EXPECT_TRUE(equivalent_fixed_point(in, out, rule));
  return out;
}

// ---- each rule by hand ----

TEST(MergeSlices, FullSideBySideAndStacked) {
  EXPECT_EQ(merged({make_slice(0, 8, 0, 5, F::Full), make_slice(0, 8, 5, 12, F::Full)}, 8, 12).slices,
            std::vector<Slice>{make_slice(0, 8, 0, 12, F::Full)});
  EXPECT_EQ(merged({make_slice(3, 8, 2, 9, F::Full), make_slice(0, 3, 2, 9, F::Full)}, 8, 12).slices,
            std::vector<Slice>{make_slice(0, 8, 2, 9, F::Full)});
  // A 2 x 2 grid needs a side-by-side round and a stacked one.
  EXPECT_EQ(merged({make_slice(0, 4, 0, 6, F::Full), make_slice(4, 8, 6, 12, F::Full), make_slice(4, 8, 0, 6, F::Full),
                    make_slice(0, 4, 6, 12, F::Full)},
                   8, 12)
                .slices,
            std::vector<Slice>{make_slice(0, 8, 0, 12, F::Full)});
}

TEST(MergeSlices, FullThenCausalIsCausalWhenEveryCausalRowReachesTheSeam) {
  // Rows 0..7; the causal part [10, 10 + w) keeps k <= q + (10 + w - 8): its first row ends at 10 + w - 8.
  for (int32_t w = 1; w <= 12; ++w) {
    const Mask out = merged({make_slice(0, 8, 4, 10, F::Full), make_slice(0, 8, 10, 10 + w, F::Causal)}, 8, 24);
    if (w >= 7) {  // Sk >= Sq - 1
      EXPECT_EQ(out.slices, std::vector<Slice>{make_slice(0, 8, 4, 10 + w, F::Causal)}) << w;
    } else {
      EXPECT_EQ(out.slices.size(), 2u) << w << ": the causal rows would change";
    }
  }
  // Causal left of full never is one slice (its rows end on the diagonal).
  EXPECT_EQ(merged({make_slice(0, 8, 0, 8, F::Causal), make_slice(0, 8, 8, 12, F::Full)}, 8, 12).slices.size(), 2u);
}

TEST(MergeSlices, InverseCausalThenFullOrCausal) {
  for (int32_t w = 1; w <= 10; ++w) {
    // Inverse causal [0, w) over rows 2..7: its last row starts at w - 1 + ... = 5 + 0, i.e. k >= q - 2.
    const Mask inv_full = merged({make_slice(2, 8, 0, w, F::InvCausal), make_slice(2, 8, w, 14, F::Full)}, 8, 14);
    const Mask inv_causal =
        merged({make_slice(2, 8, 0, w, F::InvCausal), make_slice(2, 8, w, w + 6, F::Causal)}, 8, 20);
    if (w >= 5) {
      EXPECT_EQ(inv_full.slices, std::vector<Slice>{make_slice(2, 8, 0, 14, F::InvCausal)}) << w;
      EXPECT_EQ(inv_causal.slices, std::vector<Slice>{make_slice(2, 8, 0, w + 6, F::BiCausal)}) << w;
    } else {
      EXPECT_EQ(inv_full.slices.size(), 2u) << w;
      EXPECT_EQ(inv_causal.slices.size(), 2u) << w;
    }
  }
  // Full left of inverse causal: the inverse rows start on the diagonal.
  EXPECT_EQ(merged({make_slice(0, 4, 0, 3, F::Full), make_slice(0, 4, 3, 9, F::InvCausal)}, 4, 9).slices.size(), 2u);
}

TEST(MergeSlices, StackedOnTheSameDiagonals) {
  // Causal 0..8 x 0..8 cut at row 3: the top keeps k <= q + 0 with k < 3.
  EXPECT_EQ(merged({make_slice(0, 3, 0, 3, F::Causal), make_slice(3, 8, 0, 8, F::Causal)}, 8, 8).slices,
            std::vector<Slice>{make_slice(0, 8, 0, 8, F::Causal)});
  // Inverse causal 0..8 x 0..10 cut at row 5: the bottom keeps k >= q with k >= 5.
  EXPECT_EQ(merged({make_slice(5, 8, 5, 10, F::InvCausal), make_slice(0, 5, 0, 10, F::InvCausal)}, 8, 10).slices,
            std::vector<Slice>{make_slice(0, 8, 0, 10, F::InvCausal)});
  // Bi-causal band 0..6 x 0..9 cut at row 2.
  EXPECT_EQ(merged({make_slice(0, 2, 0, 5, F::BiCausal), make_slice(2, 6, 2, 9, F::BiCausal)}, 6, 9).slices,
            std::vector<Slice>{make_slice(0, 6, 0, 9, F::BiCausal)});
  // Another diagonal, another end, another type: no merge.
  EXPECT_EQ(merged({make_slice(0, 3, 0, 4, F::Causal), make_slice(3, 8, 0, 8, F::Causal)}, 8, 8).slices.size(), 2u);
  EXPECT_EQ(merged({make_slice(0, 3, 0, 8, F::Full), make_slice(3, 8, 0, 7, F::Full)}, 8, 8).slices.size(), 2u);
  EXPECT_EQ(merged({make_slice(0, 3, 0, 3, F::Full), make_slice(3, 8, 0, 8, F::Causal)}, 8, 8).slices.size(), 2u);
}

TEST(MergeSlices, GapsOverlapsAndOtherRowsStaySeparate) {
  // A one-key gap, a one-row gap.
  EXPECT_EQ(merged({make_slice(0, 4, 0, 3, F::Full), make_slice(0, 4, 4, 8, F::Full)}, 4, 8).slices.size(), 2u);
  EXPECT_EQ(merged({make_slice(0, 2, 0, 8, F::Full), make_slice(3, 4, 0, 8, F::Full)}, 4, 8).slices.size(), 2u);
  // Side by side on different rows; stacked on different keys.
  EXPECT_EQ(merged({make_slice(0, 4, 0, 3, F::Full), make_slice(0, 5, 3, 8, F::Full)}, 5, 8).slices.size(), 2u);
  // Overlapping boxes whose areas do not overlap (q-overlap of two triangles): both stay.
  EXPECT_EQ(merged({make_slice(0, 6, 0, 6, F::Causal), make_slice(0, 6, 1, 7, F::InvCausal)}, 6, 7).slices.size(), 2u);
  // Overlapping areas (invalid, but the counts are still kept): nothing merges.
  const Mask twice = merged({make_slice(0, 4, 0, 4, F::Full), make_slice(0, 4, 0, 4, F::Full)}, 4, 4);
  EXPECT_EQ(twice.slices.size(), 2u);
  // Rows shared by slices with keys apart (q-overlap): kept as they are.
  EXPECT_EQ(merged({make_slice(0, 4, 0, 2, F::Full), make_slice(0, 4, 6, 8, F::Causal)}, 4, 8).slices.size(), 2u);
}

TEST(MergeSlices, ZeroAreaSlicesAreDroppedAndOneRowSlicesKeepWholeRows) {
  EXPECT_EQ(merged({make_slice(0, 0, 0, 4, F::Full), make_slice(0, 4, 2, 2, F::Causal),
                    make_slice(0, 5, 0, 3, F::BiCausal)},  // Sq > Sk: keeps nothing
                   5, 4)
                .slices,
            std::vector<Slice>{});
  // One row of any type keeps the whole row: causal | inverse causal on one row is one full row.
  EXPECT_EQ(merged({make_slice(3, 4, 0, 2, F::Causal), make_slice(3, 4, 2, 5, F::InvCausal)}, 4, 5).slices,
            std::vector<Slice>{make_slice(3, 4, 0, 5, F::Full)});
}

TEST(MergeSlices, FreeOrderIsSortedAndIndependentOfTheInputOrder) {
  std::vector<Slice> slices = {make_slice(4, 8, 0, 4, F::Full), make_slice(0, 4, 4, 8, F::Causal),
                               make_slice(0, 4, 0, 4, F::Full), make_slice(4, 8, 4, 8, F::BiCausal)};
  const Mask first = merged(slices, 8, 8);
  EXPECT_EQ(first.slices, (std::vector<Slice>{make_slice(0, 4, 0, 8, F::Causal), make_slice(4, 8, 0, 4, F::Full),
                                              make_slice(4, 8, 4, 8, F::BiCausal)}));
  std::reverse(slices.begin(), slices.end());
  EXPECT_EQ(merged(slices, 8, 8).slices, first.slices);
}

TEST(MergeSlices, BoundaryMultipleMergesOnlyAlignedNeighboursInOrder) {
  const MergeRule at8{8};
  // Aligned neighbours, earlier on the left: merged in the earlier one's place; the list order stays.
  EXPECT_EQ(merged({make_slice(20, 24, 0, 4, F::Full), make_slice(0, 8, 0, 8, F::Full),
                    make_slice(0, 8, 8, 13, F::Full), make_slice(9, 10, 0, 1, F::Full)},
                   24, 16, at8)
                .slices,
            (std::vector<Slice>{make_slice(20, 24, 0, 4, F::Full), make_slice(0, 8, 0, 13, F::Full),
                                make_slice(9, 10, 0, 1, F::Full)}));
  // Not at a multiple of 8.
  EXPECT_EQ(merged({make_slice(0, 8, 0, 6, F::Full), make_slice(0, 8, 6, 13, F::Full)}, 8, 16, at8).slices.size(), 2u);
  EXPECT_EQ(merged({make_slice(0, 6, 0, 8, F::Full), make_slice(6, 9, 0, 8, F::Full)}, 9, 8, at8).slices.size(), 2u);
  // The later one on the left / on top.
  EXPECT_EQ(merged({make_slice(0, 8, 8, 13, F::Full), make_slice(0, 8, 0, 8, F::Full)}, 8, 16, at8).slices.size(), 2u);
  EXPECT_EQ(merged({make_slice(8, 9, 0, 8, F::Full), make_slice(0, 8, 0, 8, F::Full)}, 9, 8, at8).slices.size(), 2u);
  // Another slice between them (a zero-area one does not count).
  EXPECT_EQ(merged({make_slice(0, 8, 0, 8, F::Full), make_slice(9, 10, 0, 1, F::Full),
                    make_slice(0, 8, 8, 13, F::Full)},
                   10, 16, at8)
                .slices.size(),
            3u);
  EXPECT_EQ(merged({make_slice(0, 8, 0, 8, F::Full), make_slice(9, 9, 0, 1, F::Full), make_slice(0, 8, 8, 13, F::Full)},
                   10, 16, at8)
                .slices,
            std::vector<Slice>{make_slice(0, 8, 0, 13, F::Full)});
}

// ---- random masks ----

TEST(MergeSlices, RandomMasksKeepTheirCellsAndReachAFixedPoint) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 300; ++trial) {
    const int32_t tq = std::uniform_int_distribution<int32_t>(1, 80)(rng);
    const int32_t tk = std::uniform_int_distribution<int32_t>(1, 80)(rng);
    const Mask original = test::random_rectangles(rng, tq, tk, std::uniform_int_distribution<int32_t>(1, 30)(rng));
    Mask pieces = mask_of({}, tq, tk);
    for (const Slice& s : original.slices) test::cut_slice(rng, s, 4, 1, pieces.slices);
    std::shuffle(pieces.slices.begin(), pieces.slices.end(), rng);
    for (const Mask* in : std::initializer_list<const Mask*>{&original, &pieces}) {
      for (const MergeRule rule : {MergeRule{0}, MergeRule{1}, MergeRule{4}}) {
        const Mask out = merge_slices(*in, rule);
        ASSERT_TRUE(equivalent_fixed_point(*in, out, rule))
            << "seed " << seed << " trial " << trial << " rule " << rule.boundary_multiple << "\n"
            << mask_to_json(*in);
        ASSERT_NO_THROW(validate(out)) << "seed " << seed << " trial " << trial;
      }
    }
  }
}

TEST(MergeSlices, CutSlicesOfEveryTypeBecomeOneAgain) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  int trials = 0, whole_again = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int32_t tq = std::uniform_int_distribution<int32_t>(1, 60)(rng);
    const int32_t tk = std::uniform_int_distribution<int32_t>(1, 60)(rng);
    Slice s = test::random_slice(rng, tq, tk);
    if (area(s) == 0) continue;
    std::vector<Slice> in_order;
    test::cut_slice(rng, s, 6, 1, in_order);
    // In cut order (siblings next to each other) neighbour merges retrace the cuts.
    EXPECT_EQ(merge_slices(mask_of(in_order, tq, tk), MergeRule{1}).slices, std::vector<Slice>{s})
        << "seed " << seed << " trial " << trial << ": " << mask_to_json(mask_of(in_order, tq, tk));
    // Shuffled, the greedy free merge may close a pinwheel of pieces that no pair merges out of: equivalent, but
    // rarely the single slice.
    std::vector<Slice> shuffled = in_order;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    const Mask out = merge_slices(mask_of(shuffled, tq, tk));
    ASSERT_TRUE(equivalent_fixed_point(mask_of(shuffled, tq, tk), out, {})) << "seed " << seed << " trial " << trial;
    ++trials;
    whole_again += out.slices == std::vector<Slice>{s};
  }
  EXPECT_GE(whole_again, trials * 9 / 10) << "seed " << seed;
}

// ---- boundary multiples keep tilings ----

// The bounds the CUDA kernels apply to an item of slice s, per row and per key inside its box: the work item as
// the planner fills it (src/cuda/plan/plan.cpp) read as kernel_common.cuh's item_keys and the backward's
// item_queries do.
std::vector<Range> kernel_rows_view(const tiling::TileWork& w, const Slice& s) {
  cuda::detail::WorkItem item{};
  item.causal_offset = s.k.end - s.q.end;
  item.inv_offset = s.k.start - s.q.start;
  if (s.type == F::Causal || s.type == F::BiCausal) item.flags |= cuda::detail::kWorkCausal;
  if (s.type == F::InvCausal || s.type == F::BiCausal) item.flags |= cuda::detail::kWorkInv;
  std::vector<Range> view;
  for (int32_t q = w.q.start; q < w.q.end; ++q) {
    int32_t lo = w.k.start, hi = w.k.end;
    if (item.flags & cuda::detail::kWorkCausal) hi = std::min(hi, q + item.causal_offset + 1);
    if (item.flags & cuda::detail::kWorkInv) lo = std::max(lo, q + item.inv_offset);
    view.push_back(lo < hi ? Range{lo, hi} : Range{0, 0});
  }
  for (int32_t k = w.k.start; k < w.k.end; ++k) {
    int32_t lo = w.q.start, hi = w.q.end;
    if (item.flags & cuda::detail::kWorkCausal) lo = std::max(lo, k - item.causal_offset);
    if (item.flags & cuda::detail::kWorkInv) hi = std::min(hi, k - item.inv_offset + 1);
    view.push_back(lo < hi ? Range{lo, hi} : Range{0, 0});
  }
  return view;
}

testing::AssertionResult same_lists(const Mask& a, const Mask& b, const tiling::TileLists& la,
                                    const tiling::TileLists& lb) {
  if (la.offsets != lb.offsets) return testing::AssertionFailure() << "tile offsets differ";
  for (size_t i = 0; i < la.items.size(); ++i) {
    const tiling::TileWork &x = la.items[i], &y = lb.items[i];
    if (x.q != y.q || x.k != y.k || x.needs_mask != y.needs_mask)
      return testing::AssertionFailure() << "item " << i << " differs";
    if (kernel_rows_view(x, a.slices[x.slice]) != kernel_rows_view(y, b.slices[y.slice]))
      return testing::AssertionFailure() << "item " << i << ": the kernel's bounds differ";
  }
  return testing::AssertionSuccess();
}

TEST(MergeSlices, BoundaryMultipleLeavesEveryDividingTilingUnchanged) {
  struct Tiles {
    int32_t major, minor;
  };
  // The CPU engine's 96 x 96; the CUDA families' tiles (all divide 128).
  const std::vector<std::pair<int32_t, std::vector<Tiles>>> configs = {
      {96, {{96, 96}, {32, 48}}},
      {128, {{128, 64}, {64, 32}, {64, 64}, {128, 128}, {128, 32}, {64, 128}}},
  };
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  size_t merges = 0;
  for (int trial = 0; trial < 24; ++trial) {
    for (const auto& [g, tiles] : configs) {
      const int32_t tq = std::uniform_int_distribution<int32_t>(g, 6 * g)(rng);
      const int32_t tk = std::uniform_int_distribution<int32_t>(g, 6 * g)(rng);
      const Mask original = test::random_rectangles(rng, tq, tk, std::uniform_int_distribution<int32_t>(1, 12)(rng));
      Mask pieces = mask_of({}, tq, tk);
      for (const Slice& s : original.slices) test::cut_slice(rng, s, 4, trial % 3 != 0 ? g : 1, pieces.slices);
      const Mask out = merge_slices(pieces, MergeRule{g});
      ASSERT_TRUE(equivalent_fixed_point(pieces, out, MergeRule{g})) << "seed " << seed;
      for (const Slice& s : pieces.slices) merges += area(s) > 0;
      merges -= out.slices.size();
      for (const Tiles& t : tiles) {
        EXPECT_TRUE(same_lists(pieces, out, tiling::by_q_tile(pieces, t.major, t.minor),
                               tiling::by_q_tile(out, t.major, t.minor)))
            << "by_q " << t.major << "x" << t.minor << " seed " << seed << " trial " << trial;
        EXPECT_TRUE(same_lists(pieces, out, tiling::by_k_tile(pieces, t.major, t.minor),
                               tiling::by_k_tile(out, t.major, t.minor)))
            << "by_k " << t.major << "x" << t.minor << " seed " << seed << " trial " << trial;
      }
    }
  }
  EXPECT_GT(merges, 24u) << "seed " << seed << ": the aligned cuts should mostly merge back";
}

}  // namespace
}  // namespace magi
