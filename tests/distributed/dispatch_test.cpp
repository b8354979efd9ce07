// Band algebra (clip / shift / back to slices), chunk areas, the balance solver and partitions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <set>

#include "distributed/band.hpp"
#include "distributed/dispatch.hpp"
#include "reference/random_inputs.hpp"

namespace magi::dist {
namespace {

using test::fresh_seed;
using test::make_slice;

int32_t uniform(std::mt19937_64& rng, int32_t lo, int32_t hi) {  // inclusive
  return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
}

Slice random_slice(std::mt19937_64& rng, int32_t total) {
  int32_t qs = uniform(rng, 0, total), qe = uniform(rng, 0, total), ks = uniform(rng, 0, total),
          ke = uniform(rng, 0, total);
  if (qs > qe) std::swap(qs, qe);
  if (ks > ke) std::swap(ks, ke);
  return make_slice(qs, qe, ks, ke, static_cast<MaskType>(uniform(rng, 0, 3)));
}

// Cells of `slices` (which must not overlap) as a set, checking no cell is produced twice.
std::set<std::pair<int32_t, int32_t>> cells_of(const std::vector<Slice>& slices, bool* overlap) {
  std::set<std::pair<int32_t, int32_t>> cells;
  for (const Slice& s : slices)
    for (int32_t q = s.q.start; q < s.q.end; ++q) {
      const Range keys = kept_keys(s, q);
      for (int32_t k = keys.start; k < keys.end; ++k)
        if (!cells.insert({q, k}).second) *overlap = true;
    }
  return cells;
}

TEST(Band, ClipShiftAndBackToSlicesKeepExactlyTheCells) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 3000; ++trial) {
    const int32_t total = uniform(rng, 1, 40);
    const Slice slice = random_slice(rng, total);
    Range rows{uniform(rng, 0, total), uniform(rng, 0, total)}, cols{uniform(rng, 0, total), uniform(rng, 0, total)};
    if (rows.start > rows.end) std::swap(rows.start, rows.end);
    if (cols.start > cols.end) std::swap(cols.start, cols.end);
    const int32_t dq = uniform(rng, 0, 7), dk = uniform(rng, 0, 7);

    std::set<std::pair<int32_t, int32_t>> expected;
    int32_t min_k = INT32_MAX, max_k = INT32_MIN;
    for (int32_t q = rows.start; q < rows.end; ++q) {
      const Range keys = kept_keys(slice, q);
      for (int32_t k = std::max(keys.start, cols.start); k < std::min(keys.end, cols.end); ++k) {
        expected.insert({q + dq, k + dk});
        min_k = std::min(min_k, k + dk);
        max_k = std::max(max_k, k + dk + 1);
      }
    }
    const Band band = shift(clip(band_of(slice), rows, cols), dq, dk);
    std::vector<Slice> slices;
    append_slices(band, slices);
    bool overlap = false;
    const auto got = cells_of(slices, &overlap);
    ASSERT_FALSE(overlap) << "seed " << seed << " trial " << trial;
    ASSERT_EQ(got, expected) << "seed " << seed << " trial " << trial << " slice type "
                             << to_string(slice.type);
    ASSERT_LE(slices.size(), 3u);
    for (const Slice& s : slices) ASSERT_GT(magi::area(s), 0) << "empty slice emitted, seed " << seed;
    ASSERT_EQ(area(band), static_cast<int64_t>(expected.size())) << "seed " << seed;
    const Range union_cols = kept_cols(band);
    if (expected.empty()) ASSERT_TRUE(union_cols.empty()) << "seed " << seed;
    else ASSERT_EQ(union_cols, (Range{min_k, max_k})) << "seed " << seed << " trial " << trial;

    // A whole slice comes back as one slice of its type (an extra one-row slice would cost the kernels
    // a second visit of the corner tiles).
    std::vector<Slice> whole;
    append_slices(band_of(slice), whole);
    if (magi::area(slice) > 0) {
      ASSERT_EQ(whole.size(), 1u) << "seed " << seed << " trial " << trial << " type " << to_string(slice.type);
      ASSERT_EQ(whole[0].type, slice.type) << "seed " << seed << " trial " << trial;
    }
  }
}

TEST(Dispatch, ChunkAreasSumToTheMaskAreaAndMatchRowCounts) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 20; ++trial) {
    const int32_t total = uniform(rng, 50, 400), chunk = uniform(rng, 1, 63);
    const Mask mask = test::random_rectangles(rng, total, total, uniform(rng, 1, 30));
    const int32_t chunks = (total + chunk - 1) / chunk + uniform(rng, 0, 3);
    const auto areas = chunk_areas(mask, chunk, chunks);
    for (int32_t c = 0; c < chunks; ++c) {
      int64_t count = 0;
      for (const Slice& s : mask.slices)
        for (int32_t q = std::max(s.q.start, c * chunk); q < std::min(s.q.end, (c + 1) * chunk); ++q)
          count += kept_keys(s, q).size();
      ASSERT_EQ(areas[c], count) << "seed " << seed << " chunk " << c;
    }
    ASSERT_EQ(std::accumulate(areas.begin(), areas.end(), int64_t{0}), mask.area()) << "seed " << seed;
  }
}

int64_t max_load(const std::vector<int64_t>& costs, const std::vector<int32_t>& owner, int32_t cp) {
  std::vector<int64_t> load(static_cast<size_t>(cp), 0);
  for (size_t i = 0; i < costs.size(); ++i) load[owner[i]] += costs[i];
  return *std::max_element(load.begin(), load.end());
}

TEST(Dispatch, BalanceGivesEqualCountsAndSwapNeverLosesToGreedy) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 200; ++trial) {
    const int32_t cp = uniform(rng, 1, 8), per_rank = uniform(rng, 1, 12);
    std::vector<int64_t> costs(static_cast<size_t>(cp * per_rank));
    // Long-tailed costs: a few large chunks among many small ones.
    std::lognormal_distribution<double> tail(3.0, 1.5);
    for (auto& c : costs) c = static_cast<int64_t>(tail(rng));
    const auto greedy_owner = balance(costs, cp, DispatchAlgorithm::Greedy);
    const auto swap_owner = balance(costs, cp, DispatchAlgorithm::GreedySwap);
    for (const auto* owner : {&greedy_owner, &swap_owner}) {
      std::vector<int32_t> count(static_cast<size_t>(cp), 0);
      for (int32_t r : *owner) ++count[r];
      for (int32_t c : count) ASSERT_EQ(c, per_rank) << "seed " << seed;
    }
    const int64_t total = std::accumulate(costs.begin(), costs.end(), int64_t{0});
    const int64_t bound = std::max((total + cp - 1) / cp, *std::max_element(costs.begin(), costs.end()));
    ASSERT_GE(max_load(costs, greedy_owner, cp), bound) << "seed " << seed;
    ASSERT_GE(max_load(costs, swap_owner, cp), bound) << "seed " << seed;
    ASSERT_LE(max_load(costs, swap_owner, cp), max_load(costs, greedy_owner, cp)) << "seed " << seed;
  }
}

TEST(Dispatch, LocalSearchIsExactForTwoRanksWithFewChunks) {
  // Two ranks x 4 chunks: the exact pair re-split must reach the exhaustive optimum.
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int64_t> costs(8);
    for (auto& c : costs) c = uniform(rng, 0, 100);
    int64_t best = INT64_MAX;
    for (int subset = 0; subset < 256; ++subset) {
      if (__builtin_popcount(subset) != 4) continue;
      int64_t a = 0, b = 0;
      for (int i = 0; i < 8; ++i) (subset >> i & 1 ? a : b) += costs[i];
      best = std::min(best, std::max(a, b));
    }
    ASSERT_EQ(max_load(costs, balance(costs, 2, DispatchAlgorithm::GreedySwap), 2), best) << "seed " << seed;
  }
}

// Varlen causal documents with long-tailed lengths: the case where balancing matters.
Mask long_tailed_documents(std::mt19937_64& rng, int32_t total) {
  std::vector<int32_t> lengths;
  std::lognormal_distribution<double> tail(5.0, 1.2);
  for (int32_t used = 0; used < total;) {
    const int32_t len = std::min(total - used, std::max(1, static_cast<int32_t>(tail(rng))));
    lengths.push_back(len);
    used += len;
  }
  return masks::varlen_causal(test::cu_seqlens_of(lengths));
}

TEST(Dispatch, LongTailedDocumentsReportBalanceAgainstTheLowerBound) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int32_t cp : {2, 4, 8}) {
    for (int32_t chunk : {64, 256, 1024}) {
      double greedy_ratio = 0, swap_ratio = 0, tight_ratio = 0;
      const int trials = 10;
      for (int t = 0; t < trials; ++t) {
        const Mask mask = long_tailed_documents(rng, 32768);
        const Dispatch g = make_dispatch(mask, cp, chunk, DispatchAlgorithm::Greedy);
        const Dispatch s = make_dispatch(mask, cp, chunk, DispatchAlgorithm::GreedySwap);
        ASSERT_EQ(g.lower_bound(), s.lower_bound());
        ASSERT_LE(s.max_rank_area(), g.max_rank_area()) << "seed " << seed;
        ASSERT_GE(s.count_aware_lower_bound(), s.lower_bound());
        ASSERT_GE(s.max_rank_area(), s.count_aware_lower_bound()) << "seed " << seed;
        tight_ratio += static_cast<double>(s.max_rank_area()) / s.count_aware_lower_bound() / trials;
        greedy_ratio += static_cast<double>(g.max_rank_area()) / g.lower_bound() / trials;
        swap_ratio += static_cast<double>(s.max_rank_area()) / s.lower_bound() / trials;
      }
      std::printf("long-tailed varlen causal 32k, cp %d, chunk %d: max area / lower bound: greedy %.5f, "
                  "greedy+swap %.5f (vs the count-aware bound %.5f)\n", cp, chunk, greedy_ratio, swap_ratio, tight_ratio);
      // With many chunks per rank the simple bound is nearly reached; with few, the count-aware one.
      if (32768 / chunk / cp >= 32) EXPECT_LT(swap_ratio, 1.001) << "seed " << seed;
      EXPECT_LT(tight_ratio, 1.03) << "seed " << seed;
    }
  }
}

// Locality: equal counts, within its 2% of greedy_swap's largest load, and runs of consecutive chunks
// when they balance: documents of two chunks each, cp dividing their count, stay whole on one rank.
TEST(Dispatch, LocalityStaysNearGreedySwapAndKeepsRunsTogether) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 200; ++trial) {
    const int32_t cp = uniform(rng, 1, 8), per_rank = uniform(rng, 1, 12);
    std::vector<int64_t> costs(static_cast<size_t>(cp * per_rank));
    std::lognormal_distribution<double> tail(3.0, 1.5);
    for (auto& c : costs) c = static_cast<int64_t>(tail(rng));
    const auto local = balance(costs, cp, DispatchAlgorithm::Locality);
    std::vector<int32_t> count(static_cast<size_t>(cp), 0);
    for (int32_t r : local) ++count[r];
    for (int32_t c : count) ASSERT_EQ(c, per_rank) << "seed " << seed;
    const int64_t swap_max = max_load(costs, balance(costs, cp, DispatchAlgorithm::GreedySwap), cp);
    ASSERT_LE(max_load(costs, local, cp), static_cast<int64_t>(static_cast<double>(swap_max) * 1.02))
        << "seed " << seed;
  }
  for (int32_t cp : {2, 4}) {
    const int32_t chunk = 64, docs = 4 * cp;
    std::vector<int32_t> cu{0};
    for (int32_t i = 0; i < docs; ++i) cu.push_back(cu.back() + 2 * chunk);
    const Dispatch d = make_dispatch(masks::varlen_causal(cu), cp, chunk, DispatchAlgorithm::Locality);
    for (int32_t doc = 0; doc < docs; ++doc)
      EXPECT_EQ(d.q.owner[2 * doc], d.q.owner[2 * doc + 1]) << "cp " << cp << ": document " << doc << " split";
    EXPECT_EQ(d.max_rank_area(), d.lower_bound()) << "cp " << cp;
  }
}

TEST(Dispatch, PartitionsCoverEveryPaddedTokenOnceWithEqualShares) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 30; ++trial) {
    const int32_t cp = uniform(rng, 1, 4), chunk = uniform(rng, 1, 70);
    const int32_t tq = uniform(rng, 1, 600);
    const int32_t tk = uniform(rng, 0, 1) ? tq : uniform(rng, 1, 600);
    const Mask mask = test::random_rectangles(rng, tq, tk, 10);
    const Dispatch d = make_dispatch(mask, cp, chunk, DispatchAlgorithm::GreedySwap);
    EXPECT_EQ(d.self_attention, tq == tk);
    for (const Partition* p : {&d.q, &d.k}) {
      ASSERT_EQ(p->num_chunks % cp, 0);
      ASSERT_GE(p->padded_total(), p->total);
      ASSERT_LT(p->padded_total() - p->total, chunk * cp) << "too much padding";
      std::vector<int> seen(static_cast<size_t>(p->padded_total()), 0);
      for (int32_t r = 0; r < cp; ++r) {
        const auto rows = p->global_rows(r);
        ASSERT_EQ(static_cast<int32_t>(rows.size()), p->local_tokens());
        for (int32_t i = 0; i < static_cast<int32_t>(rows.size()); ++i) {
          ++seen[rows[i]];
          ASSERT_EQ(p->owner_of(rows[i]), r);
          ASSERT_EQ(p->local_row(rows[i]), i);
        }
      }
      for (int v : seen) ASSERT_EQ(v, 1) << "seed " << seed;
    }
    int64_t total = 0;
    for (int64_t a : d.rank_area) total += a;
    ASSERT_EQ(total, mask.area()) << "seed " << seed;
  }
}

TEST(Dispatch, RejectsBadArguments) {
  const Mask mask = masks::full(10, 10);
  EXPECT_THROW(make_dispatch(mask, 0, 4, DispatchAlgorithm::Greedy), InvalidArgument);
  EXPECT_THROW(make_dispatch(mask, 2, 0, DispatchAlgorithm::Greedy), InvalidArgument);
  EXPECT_THROW(balance({1, 2, 3}, 2, DispatchAlgorithm::Greedy), InvalidArgument);
}

}  // namespace
}  // namespace magi::dist
