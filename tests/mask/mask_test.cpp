// Mask semantics (kept_keys / kept_queries), exact areas and validation against brute-force readings of
// SPEC section 2.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <random>
#include <string>

#include "magi/error.hpp"
#include "magi/mask.hpp"
#include "mask/mask_oracle.hpp"
#include "reference/random_inputs.hpp"

namespace magi {
namespace {

using test::spec_keeps;

constexpr int32_t kInt32Max = std::numeric_limits<int32_t>::max();

std::string seed_note(uint64_t seed) { return "seed " + std::to_string(seed); }

// The message of the InvalidArgument that `fn` throws ("" when it does not throw).
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

// ---- type names ----

TEST(MaskType, NamesAndIdsRoundTrip) {
  const std::pair<MaskType, std::string> expected[] = {
      {MaskType::Full, "full"}, {MaskType::Causal, "causal"}, {MaskType::InvCausal, "inv_causal"},
      {MaskType::BiCausal, "bi_causal"}};
  for (const auto& [type, name] : expected) {
    EXPECT_EQ(to_string(type), name);
    EXPECT_EQ(parse_mask_type(name), type);
    EXPECT_EQ(parse_mask_type(std::to_string(static_cast<int>(type))), type);
  }
  EXPECT_EQ(parse_mask_type("INV_CAUSAL"), MaskType::InvCausal);
  EXPECT_EQ(parse_mask_type("Causal"), MaskType::Causal);
}

TEST(MaskType, UnknownNamesAndIdsAreRejected) {
  for (const char* bad : {"", "4", "-1", "diag", "causal ", "00", "full_"}) {
    const std::string message = error_of([&] { parse_mask_type(bad, "--mask-type"); });
    EXPECT_NE(message.find("--mask-type \"" + std::string(bad) + "\" is unknown"), std::string::npos) << message;
    EXPECT_NE(message.find("inv_causal"), std::string::npos) << message;
  }
  const std::string message = error_of([] { to_string(static_cast<MaskType>(7)); });
  EXPECT_NE(message.find("mask type id 7 is unknown"), std::string::npos) << message;
}

// ---- kept_keys / kept_queries ----

TEST(KeptCells, MatchTheSpecTableForEveryType) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> size(0, 12), offset(0, 20);
  for (int trial = 0; trial < 4000; ++trial) {
    const int32_t qs = offset(rng), ks = offset(rng);
    const Slice s{{qs, qs + size(rng)}, {ks, ks + size(rng)}, test::random_type(rng)};
    for (int32_t q = qs - 2; q < s.q.end + 2; ++q) {
      const Range kept = kept_keys(s, q);
      if (kept.empty()) {
        EXPECT_EQ(kept, (Range{0, 0}));
      }
      for (int32_t k = ks - 2; k < s.k.end + 2; ++k) {
        const bool in_kept_keys = k >= kept.start && k < kept.end;
        const Range rows = kept_queries(s, k);
        const bool in_kept_queries = q >= rows.start && q < rows.end;
        ASSERT_EQ(in_kept_keys, spec_keeps(s, q, k))
            << seed_note(seed) << " slice q [" << s.q.start << "," << s.q.end << ") k [" << s.k.start << ","
            << s.k.end << ") type " << to_string(s.type) << " cell (" << q << "," << k << ")";
        ASSERT_EQ(in_kept_queries, in_kept_keys) << seed_note(seed) << " q " << q << " k " << k;
      }
    }
  }
}

TEST(KeptCells, CausalWithMoreQueriesThanKeysHasEmptyTopRows) {
  const Slice causal{{10, 16}, {0, 3}, MaskType::Causal};  // Sk - Sq = -3: local row i keeps j <= i - 3
  for (int32_t q = 10; q < 13; ++q) EXPECT_TRUE(kept_keys(causal, q).empty()) << q;
  EXPECT_EQ(kept_keys(causal, 13), (Range{0, 1}));
  EXPECT_EQ(kept_keys(causal, 15), (Range{0, 3}));
  EXPECT_EQ(kept_queries(causal, 0), (Range{13, 16}));
  EXPECT_EQ(kept_queries(causal, 2), (Range{15, 16}));
  EXPECT_EQ(area(causal), 6);

  const Slice bi{{0, 6}, {0, 3}, MaskType::BiCausal};  // no row satisfies i <= j <= i - 3
  for (int32_t q = 0; q < 6; ++q) EXPECT_TRUE(kept_keys(bi, q).empty()) << q;
  for (int32_t k = 0; k < 3; ++k) EXPECT_TRUE(kept_queries(bi, k).empty()) << k;
  EXPECT_EQ(area(bi), 0);

  const Slice inv{{0, 6}, {4, 7}, MaskType::InvCausal};  // rows i >= Sk keep nothing
  EXPECT_EQ(kept_keys(inv, 0), (Range{4, 7}));
  EXPECT_EQ(kept_keys(inv, 2), (Range{6, 7}));
  EXPECT_TRUE(kept_keys(inv, 3).empty());
  EXPECT_EQ(area(inv), 6);
}

TEST(KeptCells, BiCausalKeepsABandOfConstantWidth) {
  const Slice bi{{2, 6}, {10, 17}, MaskType::BiCausal};  // Sk - Sq = 3: width 4
  EXPECT_EQ(kept_keys(bi, 2), (Range{10, 14}));
  EXPECT_EQ(kept_keys(bi, 5), (Range{13, 17}));
  EXPECT_EQ(kept_queries(bi, 10), (Range{2, 3}));
  EXPECT_EQ(kept_queries(bi, 13), (Range{2, 6}));
  EXPECT_EQ(area(bi), 16);
}

// ---- area ----

TEST(Area, ClosedFormMatchesBruteForceOnSmallSlices) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 20000; ++trial) {
    const Slice s = test::random_slice(rng, 40, 40);
    ASSERT_EQ(area(s), test::brute_area(s)) << seed_note(seed) << " q [" << s.q.start << "," << s.q.end << ") k ["
                                            << s.k.start << "," << s.k.end << ") " << to_string(s.type);
  }
}

TEST(Area, InvertedRangesHaveZeroArea) {
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(area({{5, 2}, {0, 4}, static_cast<MaskType>(t)}), 0);
    EXPECT_EQ(area({{0, 4}, {9, 3}, static_cast<MaskType>(t)}), 0);
  }
}

// Independent O(rows) sum of the local row lengths from the SPEC table.
int64_t row_sum_area(const Slice& s) {
  const int64_t sq = s.q.size(), sk = s.k.size();
  int64_t total = 0;
  for (int64_t i = 0; i < sq; ++i) {
    int64_t lo = 0, hi = sk - 1;  // kept local j in [lo, hi]
    if (s.type == MaskType::Causal || s.type == MaskType::BiCausal) hi = std::min(hi, i + sk - sq);
    if (s.type == MaskType::InvCausal || s.type == MaskType::BiCausal) lo = std::max(lo, i);
    total += hi >= lo ? hi - lo + 1 : 0;
  }
  return total;
}

TEST(Area, ClosedFormMatchesRowSumsOnLargeSlices) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> rows(0, 1 << 21);
  for (int trial = 0; trial < 60; ++trial) {
    const int32_t sq = rows(rng);
    // Key counts from tiny to near 2^31, around sq so that every clamp regime is exercised.
    const int64_t sk_choice[] = {std::uniform_int_distribution<int64_t>(0, kInt32Max)(rng),
                                 std::max<int64_t>(0, sq - std::uniform_int_distribution<int64_t>(0, 1000)(rng)),
                                 sq + std::uniform_int_distribution<int64_t>(0, 1000)(rng)};
    const auto sk = static_cast<int32_t>(sk_choice[trial % 3]);
    const int32_t qs = std::uniform_int_distribution<int32_t>(0, kInt32Max - sq)(rng);
    const int32_t ks = std::uniform_int_distribution<int32_t>(0, kInt32Max - sk)(rng);
    const Slice s{{qs, qs + sq}, {ks, ks + sk}, test::random_type(rng)};
    ASSERT_EQ(area(s), row_sum_area(s)) << seed_note(seed) << " sq " << sq << " sk " << sk << " "
                                        << to_string(s.type);
  }
}

TEST(Area, ExactAtTheInt32Limit) {
  const int64_t n = kInt32Max;
  const Range all{0, kInt32Max};
  EXPECT_EQ(area({all, all, MaskType::Full}), n * n);
  EXPECT_EQ(area({all, all, MaskType::Causal}), n * (n + 1) / 2);
  EXPECT_EQ(area({all, all, MaskType::InvCausal}), n * (n + 1) / 2);
  EXPECT_EQ(area({all, all, MaskType::BiCausal}), n);
  EXPECT_EQ(area({{0, 1}, all, MaskType::Causal}), n);     // one row sees every key
  EXPECT_EQ(area({all, {0, 1}, MaskType::Causal}), 1);     // one key, only the last row sees it
  EXPECT_EQ(area({all, {0, 1}, MaskType::InvCausal}), 1);  // only the first row sees it
  EXPECT_EQ(area({{0, 1}, all, MaskType::BiCausal}), n);
  // Sq = 2^30, Sk = 2^31 - 1: every row keeps Sk - Sq + 1 keys under BI_CAUSAL; causal sums a ramp.
  const int64_t sq = int64_t{1} << 30, sk = n;
  EXPECT_EQ(area({{0, static_cast<int32_t>(sq)}, all, MaskType::BiCausal}), sq * (sk - sq + 1));
  EXPECT_EQ(area({{0, static_cast<int32_t>(sq)}, all, MaskType::Causal}), sq * (sk - sq) + sq * (sq + 1) / 2);
  // Sq = 2^31 - 1, Sk = 2^30: the first Sq - Sk rows keep nothing.
  EXPECT_EQ(area({all, {0, static_cast<int32_t>(sq)}, MaskType::Causal}), sq * (sq + 1) / 2);
}

TEST(Mask, AreaAndDensity) {
  const Mask causal{{{{0, 4}, {0, 4}, MaskType::Causal}}, 4, 4};
  EXPECT_EQ(causal.area(), 10);
  EXPECT_DOUBLE_EQ(causal.density(), 10.0 / 16.0);
  const Mask two{{{{0, 2}, {0, 3}, MaskType::Full}, {{2, 5}, {3, 6}, MaskType::InvCausal}}, 5, 6};
  EXPECT_EQ(two.area(), 6 + 6);
  EXPECT_DOUBLE_EQ(two.density(), 12.0 / 30.0);
  EXPECT_EQ(Mask{}.area(), 0);
  EXPECT_EQ(Mask{}.density(), 0.0);
  EXPECT_EQ((Mask{{}, 0, 7}.density()), 0.0);
}

// ---- validation: bounds ----

Mask four_slices_with_last(Slice last, int32_t total_q = 8, int32_t total_k = 8) {
  return {{{{0, 1}, {0, 1}, MaskType::Full}, {{1, 2}, {1, 2}, MaskType::Full}, {{2, 3}, {2, 3}, MaskType::Full}, last},
          total_q, total_k};
}

TEST(Validate, RangeBeyondTotalNamesSliceAndTotal) {
  const Mask mask = four_slices_with_last({{0, 10}, {0, 5}, MaskType::Causal});
  EXPECT_EQ(error_of([&] { validate(mask); }),
            "slice 3 (q [0, 10), k [0, 5), causal): q_range end 10 exceeds total_q 8");
  EXPECT_EQ(error_of([&] { validate_bounds(mask); }),
            "slice 3 (q [0, 10), k [0, 5), causal): q_range end 10 exceeds total_q 8");
  const std::string k_message = error_of([] { validate(four_slices_with_last({{3, 4}, {6, 9}, MaskType::Full})); });
  EXPECT_EQ(k_message, "slice 3 (q [3, 4), k [6, 9), full): k_range end 9 exceeds total_k 8");
}

TEST(Validate, StartAfterEndAndNegativeStart) {
  std::string message = error_of([] { validate(four_slices_with_last({{5, 3}, {0, 1}, MaskType::InvCausal})); });
  EXPECT_NE(message.find("slice 3 (q [5, 3), k [0, 1), inv_causal): q_range start 5 > end 3"), std::string::npos)
      << message;
  message = error_of([] { validate(four_slices_with_last({{4, 5}, {7, 6}, MaskType::BiCausal})); });
  EXPECT_NE(message.find("slice 3 (q [4, 5), k [7, 6), bi_causal): k_range start 7 > end 6"), std::string::npos)
      << message;
  message = error_of([] { validate(four_slices_with_last({{-2, 1}, {0, 1}, MaskType::Full})); });
  EXPECT_NE(message.find("slice 3 (q [-2, 1), k [0, 1), full): q_range start -2 is negative"), std::string::npos)
      << message;
  message = error_of([] { validate(four_slices_with_last({{4, 5}, {-1, -1}, MaskType::Full})); });
  EXPECT_NE(message.find("k_range start -1 is negative"), std::string::npos) << message;
}

TEST(Validate, UnknownTypeId) {
  const std::string message = error_of([] { validate(four_slices_with_last({{4, 5}, {4, 5}, static_cast<MaskType>(9)})); });
  EXPECT_NE(message.find("slice 3 (q [4, 5), k [4, 5), type 9): mask type id 9 is unknown"), std::string::npos)
      << message;
  EXPECT_NE(message.find("3 (bi_causal)"), std::string::npos) << message;
}

TEST(Validate, NegativeTotals) {
  EXPECT_NE(error_of([] { validate(Mask{{}, -1, 4}); }).find("total_q -1 is negative"), std::string::npos);
  EXPECT_NE(error_of([] { validate(Mask{{}, 4, -3}); }).find("total_k -3 is negative"), std::string::npos);
}

TEST(Validate, EmptySlicesAreLegalAnywhereInside) {
  const Mask mask{{{{0, 8}, {0, 8}, MaskType::Full},
                   {{3, 3}, {0, 8}, MaskType::Full},       // no rows
                   {{0, 8}, {8, 8}, MaskType::Causal},     // no keys, at the end of the grid
                   {{0, 8}, {0, 3}, MaskType::BiCausal},   // Sq > Sk: nothing kept, though inside the full one
                   {{8, 8}, {8, 8}, MaskType::InvCausal}},
                  8, 8};
  EXPECT_NO_THROW(validate(mask));
  EXPECT_EQ(mask.area(), 64);
}

// ---- validation: overlap ----

TEST(Validate, OverlapMessageNamesBothSlicesAndACommonCell) {
  Mask mask{{}, 16, 16};
  for (int32_t i = 0; i < 8; ++i) mask.slices.push_back({{2 * i, 2 * i + 2}, {2 * i, 2 * i + 2}, MaskType::Full});
  mask.slices[2] = {{4, 8}, {0, 4}, MaskType::Full};
  mask.slices[7] = {{5, 6}, {3, 4}, MaskType::Full};  // inside slice 2 only
  EXPECT_EQ(error_of([&] { validate(mask); }).substr(0, 36), "slices 2 and 7 overlap at (q=5, k=3)");
  EXPECT_NO_THROW(validate_bounds(mask));  // bounds only
}

TEST(Validate, DiagonalSplitIsValidButSharingTheDiagonalIsNot) {
  // CAUSAL keeps j <= i; INV_CAUSAL over keys shifted by one keeps k >= q + 1: together the full square.
  const Mask split{{{{0, 9}, {0, 9}, MaskType::Causal}, {{0, 9}, {1, 9}, MaskType::InvCausal}}, 9, 9};
  EXPECT_NO_THROW(validate(split));
  EXPECT_EQ(split.area(), 81);
  // Both on the same square share the diagonal.
  const Mask shared{{{{0, 9}, {0, 9}, MaskType::Causal}, {{0, 9}, {0, 9}, MaskType::InvCausal}}, 9, 9};
  EXPECT_EQ(error_of([&] { validate(shared); }).substr(0, 36), "slices 0 and 1 overlap at (q=0, k=0)");
  // Two BI_CAUSAL bands side by side, and a band inside a causal slice's empty upper triangle.
  const Mask bands{{{{0, 6}, {0, 8}, MaskType::BiCausal},   // k - q in [0, 2]
                    {{0, 6}, {3, 11}, MaskType::BiCausal},  // k - q in [3, 5]
                    {{0, 6}, {0, 6}, MaskType::Causal}},    // k - q <= 0: shares k = q with the first band
                   11, 11};
  EXPECT_EQ(error_of([&] { validate(bands); }).substr(0, 36), "slices 0 and 2 overlap at (q=0, k=0)");
  Mask disjoint_bands = bands;
  disjoint_bands.slices[2] = {{0, 6}, {0, 5}, MaskType::Causal};  // k - q <= -1
  EXPECT_NO_THROW(validate(disjoint_bands));
}

struct ReportedOverlap {
  int a = -1, b = -1;
  long long q = -1, k = -1;
};

ReportedOverlap parse_overlap(const std::string& message) {
  ReportedOverlap r;
  std::sscanf(message.c_str(), "slices %d and %d overlap at (q=%lld, k=%lld)", &r.a, &r.b, &r.q, &r.k);
  return r;
}

bool has_overlap(const Mask& mask) {
  for (int32_t count : test::cell_counts(mask)) {
    if (count > 1) return true;
  }
  return false;
}

void expect_validate_matches_brute_force(const Mask& mask, uint64_t seed, int* invalid_count) {
  const bool overlap = has_overlap(mask);
  const std::string message = error_of([&] { validate(mask); });
  ASSERT_EQ(!message.empty(), overlap) << seed_note(seed) << " message: " << message
                                       << "\nmask: " << mask_to_json(mask);
  if (!overlap) return;
  ++*invalid_count;
  const ReportedOverlap r = parse_overlap(message);
  ASSERT_TRUE(r.a >= 0 && r.a < r.b && r.b < static_cast<int>(mask.slices.size())) << message;
  EXPECT_TRUE(spec_keeps(mask.slices[static_cast<size_t>(r.a)], r.q, r.k)) << seed_note(seed) << " " << message;
  EXPECT_TRUE(spec_keeps(mask.slices[static_cast<size_t>(r.b)], r.q, r.k)) << seed_note(seed) << " " << message;
}

TEST(Validate, PairOverlapMatchesBruteForce) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  int invalid = 0;
  const int trials = 30000;
  for (int trial = 0; trial < trials; ++trial) {
    const int32_t t = std::uniform_int_distribution<int32_t>(1, 14)(rng);
    const Mask pair{{test::random_slice(rng, t, t), test::random_slice(rng, t, t)}, t, t};
    expect_validate_matches_brute_force(pair, seed, &invalid);
    if (HasFatalFailure()) return;
  }
  // Both outcomes must be well represented for the comparison to mean anything.
  EXPECT_GT(invalid, trials / 10) << seed_note(seed);
  EXPECT_LT(invalid, trials * 9 / 10) << seed_note(seed);
}

// Slices added one at a time, kept only while the set stays disjoint, give valid masks whose bounding
// boxes overlap a lot; one final random slice makes about half of them invalid.
TEST(Validate, SliceSetsMatchBruteForce) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  int invalid = 0;
  const int trials = 1500;
  for (int trial = 0; trial < trials; ++trial) {
    const int32_t tq = std::uniform_int_distribution<int32_t>(1, 40)(rng);
    const int32_t tk = std::uniform_int_distribution<int32_t>(1, 40)(rng);
    Mask mask{{}, tq, tk};
    std::vector<int32_t> counts(static_cast<size_t>(tq) * static_cast<size_t>(tk), 0);
    const int attempts = std::uniform_int_distribution<int>(2, 40)(rng);
    for (int a = 0; a < attempts; ++a) {
      const Slice s = test::random_slice(rng, tq, tk);
      bool clash = false;
      for (int32_t q = s.q.start; q < s.q.end && !clash; ++q) {
        for (int32_t k = s.k.start; k < s.k.end && !clash; ++k) {
          clash = spec_keeps(s, q, k) && counts[static_cast<size_t>(q * tk + k)] > 0;
        }
      }
      if (clash) continue;
      for (int32_t q = s.q.start; q < s.q.end; ++q) {
        for (int32_t k = s.k.start; k < s.k.end; ++k) counts[static_cast<size_t>(q * tk + k)] += spec_keeps(s, q, k);
      }
      mask.slices.push_back(s);
    }
    if (trial % 2 == 1) {
      const auto at = std::uniform_int_distribution<size_t>(0, mask.slices.size())(rng);
      mask.slices.insert(mask.slices.begin() + static_cast<std::ptrdiff_t>(at), test::random_slice(rng, tq, tk));
    }
    expect_validate_matches_brute_force(mask, seed, &invalid);
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(invalid, trials / 10) << seed_note(seed);
  EXPECT_LT(invalid, trials * 6 / 10) << seed_note(seed);
}

TEST(Validate, RandomRectangleMasksAreValid) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 50; ++trial) {
    const Mask mask = test::random_rectangles(rng, 64, 96, 30);
    ASSERT_FALSE(has_overlap(mask)) << seed_note(seed);
    EXPECT_NO_THROW(validate(mask)) << seed_note(seed);
  }
}

TEST(Validate, SpecSectionSevenCasesAreValidAndTheirAreasExact) {
  for (const auto& [name, mask] : test::cases::all()) {
    EXPECT_NO_THROW(validate(mask)) << name;
    int64_t kept = 0;
    for (int32_t count : test::cell_counts(mask)) {
      EXPECT_LE(count, 1) << name;
      kept += count;
    }
    EXPECT_EQ(mask.area(), kept) << name;
  }
}

// ---- validation: speed on 100k slices ----

double seconds_to_validate(const Mask& mask, std::string* message) {
  const auto start = std::chrono::steady_clock::now();
  *message = error_of([&] { validate(mask); });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

TEST(ValidateSpeed, HundredThousandSlices) {
  constexpr int32_t kSlices = 100000;
  std::string message;

  Mask grid{{}, 250 * 8, 400 * 8};  // 250 x 400 tiles of 8 x 8, types cycling
  for (int32_t r = 0; r < 250; ++r) {
    for (int32_t c = 0; c < 400; ++c) {
      grid.slices.push_back({{8 * r, 8 * r + 8}, {8 * c, 8 * c + 8}, static_cast<MaskType>((r + c) % 4)});
    }
  }
  ASSERT_EQ(grid.slices.size(), static_cast<size_t>(kSlices));
  EXPECT_LT(seconds_to_validate(grid, &message), 2.0);
  EXPECT_EQ(message, "");

  // Every slice shares the same q rows (q-overlap): a sweep over q alone would compare all pairs.
  Mask shared_rows{{}, 1024, kSlices * 8};
  for (int32_t i = 0; i < kSlices; ++i) shared_rows.slices.push_back({{0, 1024}, {8 * i, 8 * i + 8}, MaskType::Full});
  EXPECT_LT(seconds_to_validate(shared_rows, &message), 2.0);
  EXPECT_EQ(message, "");

  // Every slice reads the same keys with its own rows (many slices sharing one k_range).
  Mask shared_keys{{}, kSlices * 4, 1024};
  for (int32_t i = 0; i < kSlices; ++i) {
    shared_keys.slices.push_back({{4 * i, 4 * i + 4}, {0, 1024}, static_cast<MaskType>(i % 4)});
  }
  EXPECT_LT(seconds_to_validate(shared_keys, &message), 2.0);
  EXPECT_EQ(message, "");

  // 50k squares split along the diagonal: every pair of halves has intersecting bounding boxes.
  Mask halves{{}, kSlices / 2 * 16, kSlices / 2 * 16};
  for (int32_t i = 0; i < kSlices / 2; ++i) {
    const int32_t o = 16 * i;
    halves.slices.push_back({{o, o + 16}, {o, o + 16}, MaskType::Causal});
    halves.slices.push_back({{o, o + 16}, {o + 1, o + 16}, MaskType::InvCausal});
  }
  EXPECT_LT(seconds_to_validate(halves, &message), 2.0);
  EXPECT_EQ(message, "");

  // One bad slice at the end, overlapping slice 0 of the shared-rows mask.
  shared_rows.slices.back() = {{1000, 1001}, {7, 9}, MaskType::Full};
  EXPECT_LT(seconds_to_validate(shared_rows, &message), 2.0);
  EXPECT_EQ(message.substr(0, 43), "slices 0 and 99999 overlap at (q=1000, k=7)");
}

}  // namespace
}  // namespace magi
