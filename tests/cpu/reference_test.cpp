// Self-tests of the naive fp64 reference and the test helpers: if these fail, no engine verdict counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "magi/mask.hpp"
#include "reference/compare.hpp"
#include "reference/naive_attention.hpp"
#include "reference/random_inputs.hpp"

namespace magi::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The keep matrix as text: one line per q row, '#' kept, '.' not.
std::string keep_picture(const Mask& mask) {
  const std::vector<uint8_t> keep = dense_keep(mask);
  std::string s;
  for (int32_t q = 0; q < mask.total_q; ++q) {
    for (int32_t k = 0; k < mask.total_k; ++k) s += keep[static_cast<std::size_t>(q) * mask.total_k + k] ? '#' : '.';
    s += '\n';
  }
  return s;
}

Mask one_slice(int32_t sq, int32_t sk, MaskType type) {
  return Mask{{make_slice(0, sq, 0, sk, type)}, sq, sk};
}

TEST(DenseKeep, MatchesTheSpecTableSqLessThanSk) {
  EXPECT_EQ(keep_picture(one_slice(3, 5, MaskType::Full)), "#####\n#####\n#####\n");
  EXPECT_EQ(keep_picture(one_slice(3, 5, MaskType::Causal)), "###..\n####.\n#####\n");
  EXPECT_EQ(keep_picture(one_slice(3, 5, MaskType::InvCausal)), "#####\n.####\n..###\n");
  EXPECT_EQ(keep_picture(one_slice(3, 5, MaskType::BiCausal)), "###..\n.###.\n..###\n");
}

TEST(DenseKeep, MatchesTheSpecTableSqGreaterThanSk) {
  EXPECT_EQ(keep_picture(one_slice(5, 3, MaskType::Causal)), "...\n...\n#..\n##.\n###\n");
  EXPECT_EQ(keep_picture(one_slice(5, 3, MaskType::InvCausal)), "###\n.##\n..#\n...\n...\n");
  EXPECT_EQ(keep_picture(one_slice(5, 3, MaskType::BiCausal)), "...\n...\n...\n...\n...\n");
}

TEST(DenseKeep, UsesGlobalOffsetsOfTheSlice) {
  // CAUSAL q [2,4) x k [1,4) in a 5x5 grid: local j <= i + 1.
  const Mask m{{make_slice(2, 4, 1, 4, MaskType::Causal)}, 5, 5};
  EXPECT_EQ(keep_picture(m), ".....\n.....\n.##..\n.###.\n.....\n");
}

// Cross-check of two independent encodings of SPEC section 2: the reference's table and kept_keys.
TEST(DenseKeep, AgreesWithKeptKeysOnRandomSlices) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> coord(0, 12), type(0, 3);
  for (int trial = 0; trial < 500; ++trial) {
    int32_t qs = coord(rng), qe = coord(rng), ks = coord(rng), ke = coord(rng);
    if (qs > qe) std::swap(qs, qe);
    if (ks > ke) std::swap(ks, ke);
    const Slice s = make_slice(qs, qe, ks, ke, static_cast<MaskType>(type(rng)));
    for (int32_t q = 0; q < 13; ++q) {
      const Range kept = kept_keys(s, q);
      for (int32_t k = 0; k < 13; ++k) {
        const bool in_range = k >= kept.start && k < kept.end;
        ASSERT_EQ(slice_keeps(s, q, k), in_range)
            << "slice q[" << qs << "," << qe << ") k[" << ks << "," << ke << ") type " << to_string(s.type)
            << " cell (" << q << "," << k << ") seed " << seed;
      }
    }
  }
}

// ---------------- forward identities ----------------

ReferenceProblem tiny_problem(std::mt19937_64& rng, Mask mask, int32_t hq, int32_t hkv, int32_t dim) {
  ReferenceProblem p;
  p.mask = std::move(mask);
  p.heads_q = hq;
  p.heads_kv = hkv;
  p.head_dim = dim;
  p.q = random_normal(rng, static_cast<std::size_t>(p.total_q()) * hq * dim, DType::F64);
  p.k = random_normal(rng, static_cast<std::size_t>(p.total_k()) * hkv * dim, DType::F64);
  p.v = random_normal(rng, static_cast<std::size_t>(p.total_k()) * hkv * dim, DType::F64);
  return p;
}

void add_sink(std::mt19937_64& rng, ReferenceProblem& p, SinkLayout layout, int32_t len) {
  p.sink_layout = layout;
  p.sink_len = len;
  const std::size_t rows = layout == SinkLayout::SSH ? static_cast<std::size_t>(p.total_q()) : 1;
  p.sink = random_normal(rng, rows * len * p.heads_q, DType::F64);
}

// Mixed types, q-overlap, an uncovered row (row 6) and CAUSAL with Sq > Sk (empty rows 0 and 1).
Mask tricky_tiny_mask() {
  return Mask{{make_slice(0, 4, 0, 2, MaskType::Causal), make_slice(2, 4, 2, 5, MaskType::InvCausal),
               make_slice(2, 6, 5, 7, MaskType::Full), make_slice(4, 6, 0, 4, MaskType::BiCausal),
               make_slice(7, 8, 1, 7, MaskType::Full)},
              8, 7};
}

TEST(ReferenceForward, SoftmaxRowsSumToOne) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  ReferenceProblem p = tiny_problem(rng, tricky_tiny_mask(), 4, 2, 8);
  std::fill(p.v.begin(), p.v.end(), 1.0);  // out = sum of the row's probabilities
  const ReferenceForward f = reference_forward(p);
  const std::vector<uint8_t> keep = dense_keep(p.mask);
  for (int32_t t = 0; t < p.total_q(); ++t) {
    const bool empty = std::none_of(keep.begin() + t * p.total_k(), keep.begin() + (t + 1) * p.total_k(),
                                    [](uint8_t x) { return x != 0; });
    for (int32_t h = 0; h < p.heads_q; ++h) {
      const double lse = f.lse[static_cast<std::size_t>(t) * p.heads_q + h];
      EXPECT_EQ(std::isinf(lse) && lse < 0, empty) << "row " << t << " seed " << seed;
      for (int32_t d = 0; d < p.head_dim; ++d)
        EXPECT_NEAR(f.out[(static_cast<std::size_t>(t) * p.heads_q + h) * p.head_dim + d], empty ? 0.0 : 1.0, 1e-14)
            << "row " << t << " seed " << seed;
    }
  }
}

TEST(ReferenceForward, EmptyRowsGiveZeroOutMinusInfLseZeroGrads) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  ReferenceProblem p = tiny_problem(rng, tricky_tiny_mask(), 2, 1, 8);
  const ReferenceForward f = reference_forward(p);
  const std::vector<double> dout = random_normal(rng, f.out.size(), DType::F64);
  const ReferenceGrads g = reference_backward(p, dout);
  for (int32_t t : {0, 1, 6}) {  // rows with no kept key
    for (int32_t h = 0; h < p.heads_q; ++h) {
      EXPECT_EQ(f.lse[static_cast<std::size_t>(t) * p.heads_q + h], -kInf) << "row " << t;
      for (int32_t d = 0; d < p.head_dim; ++d) {
        const std::size_t i = (static_cast<std::size_t>(t) * p.heads_q + h) * p.head_dim + d;
        EXPECT_EQ(f.out[i], 0.0);
        EXPECT_EQ(g.dq[i], 0.0);
      }
    }
  }
  // Keys 2 and 3 are read by no row: their dk and dv are exactly 0.
  ReferenceProblem unread = tiny_problem(rng, Mask{{make_slice(0, 3, 0, 2, MaskType::Full)}, 3, 4}, 1, 1, 8);
  const ReferenceGrads gu = reference_backward(unread, random_normal(rng, 3 * 8, DType::F64));
  for (std::size_t i = 2 * 8; i < gu.dk.size(); ++i) {
    EXPECT_EQ(gu.dk[i], 0.0);
    EXPECT_EQ(gu.dv[i], 0.0);
  }
}

// A row with one key: dS = P (dP - Delta) = 0, so dq cancels to 0 while its terms' size does not. Given out (the
// backward's input) feeds Delta: the exact out gives the same gradients, a perturbed one moves that row's dq.
TEST(ReferenceBackward, OneKeyRowsCancelAndTheGivenOutFeedsDelta) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  ReferenceProblem p = tiny_problem(rng, Mask{{make_slice(0, 5, 0, 1, MaskType::Full)}, 5, 1}, 2, 1, 16);
  const ReferenceForward f = reference_forward(p);
  const std::vector<double> dout = random_normal(rng, f.out.size(), DType::F64);
  const ReferenceGrads g = reference_backward(p, dout);
  double dq2 = 0.0, size2 = 0.0;
  for (std::size_t i = 0; i < g.dq.size(); ++i) {
    dq2 += g.dq[i] * g.dq[i];
    size2 += g.dq_magnitude[i] * g.dq_magnitude[i];
  }
  EXPECT_LT(std::sqrt(dq2), 1e-12 * std::sqrt(size2)) << "seed " << seed;
  EXPECT_GT(size2, 0.0) << "seed " << seed;

  const ReferenceGrads same = reference_backward(p, dout, &f.out);
  for (std::size_t i = 0; i < g.dq.size(); ++i) EXPECT_EQ(same.dq[i], g.dq[i]);
  std::vector<double> rounded_out = rounded(f.out, DType::BF16);
  const ReferenceGrads moved = reference_backward(p, dout, &rounded_out);
  double moved2 = 0.0;
  for (double x : moved.dq) moved2 += x * x;
  EXPECT_GT(moved2, 0.0) << "seed " << seed;  // out's rounding alone (v is not bf16 here)
}

TEST(ReferenceForward, QOverlapSplitEqualsSingleSlice) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  ReferenceProblem whole = tiny_problem(rng, Mask{{make_slice(0, 6, 0, 9, MaskType::Causal)}, 6, 9}, 2, 2, 16);
  ReferenceProblem split = whole;
  // The same cells as CAUSAL [0,6)x[0,9): FULL on k [0,3) plus CAUSAL on k [3,9).
  split.mask = Mask{{make_slice(0, 6, 3, 9, MaskType::Causal), make_slice(0, 6, 0, 3, MaskType::Full)}, 6, 9};
  const ReferenceForward a = reference_forward(whole), b = reference_forward(split);
  for (std::size_t i = 0; i < a.out.size(); ++i) EXPECT_NEAR(a.out[i], b.out[i], 1e-14) << "seed " << seed;
  for (std::size_t i = 0; i < a.lse.size(); ++i) EXPECT_NEAR(a.lse[i], b.lse[i], 1e-14) << "seed " << seed;
}

TEST(ReferenceForward, MaxLogitsIsTheLargestKeptLogit) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  ReferenceProblem p = tiny_problem(rng, Mask{{make_slice(1, 3, 1, 3, MaskType::Full)}, 4, 4}, 2, 1, 8);
  p.softcap = 0.5;
  const ReferenceForward f = reference_forward(p);
  const double scale = 1.0 / std::sqrt(8.0);
  for (int32_t h = 0; h < 2; ++h) {
    double best = -kInf, terms = 0.0;
    for (int32_t t = 1; t < 3; ++t)
      for (int32_t k = 1; k < 3; ++k) {
        double dot = 0.0, abs_dot = 0.0;
        for (int32_t d = 0; d < 8; ++d) {
          dot += p.q[(t * 2 + h) * 8 + d] * p.k[k * 8 + d];
          abs_dot += std::fabs(p.q[(t * 2 + h) * 8 + d] * p.k[k * 8 + d]);
        }
        best = std::max(best, 0.5 * std::tanh(scale * dot / 0.5));
        terms = std::max(terms, scale * abs_dot);
      }
    EXPECT_NEAR(f.max_logits[h], best, 1e-15) << "seed " << seed;
    EXPECT_LE(f.max_logits[h], 0.5);  // softcap bounds the logits
    EXPECT_NEAR(f.max_logits_magnitude[h], terms, 1e-14) << "seed " << seed;
  }
  ReferenceProblem none = p;
  none.mask.slices.clear();
  EXPECT_EQ(reference_forward(none).max_logits[0], -kInf);
}

TEST(ReferenceForward, SinkIdentities) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const ReferenceProblem plain = tiny_problem(rng, tricky_tiny_mask(), 2, 2, 8);
  ReferenceProblem sh = plain;
  add_sink(rng, sh, SinkLayout::SH, 3);
  const ReferenceForward f0 = reference_forward(plain), f1 = reference_forward(sh);
  for (int32_t t = 0; t < plain.total_q(); ++t) {
    for (int32_t h = 0; h < 2; ++h) {
      const std::size_t row = static_cast<std::size_t>(t) * 2 + h;
      double sink_mass = 0.0;
      for (int32_t s = 0; s < 3; ++s) sink_mass += std::exp(sh.sink[s * 2 + h]);
      // lse~ = log(exp(lse) + sum exp(sink)); empty rows get lse~ = log(sum exp(sink)) and out 0.
      EXPECT_NEAR(f1.lse[row], std::log(std::exp(f0.lse[row]) + sink_mass), 1e-13) << "seed " << seed;
      for (int32_t d = 0; d < 8; ++d) {
        const std::size_t i = row * 8 + d;
        const double expect = f0.lse[row] == -kInf ? 0.0 : f0.out[i] * std::exp(f0.lse[row] - f1.lse[row]);
        EXPECT_NEAR(f1.out[i], expect, 1e-13) << "seed " << seed;
      }
    }
  }

  // ssh with every row holding the sh values equals sh; dsink(sh) is the row sum of dsink(ssh).
  ReferenceProblem ssh = sh;
  ssh.sink_layout = SinkLayout::SSH;
  ssh.sink.clear();
  for (int32_t t = 0; t < sh.total_q(); ++t) ssh.sink.insert(ssh.sink.end(), sh.sink.begin(), sh.sink.end());
  const ReferenceForward f2 = reference_forward(ssh);
  for (std::size_t i = 0; i < f1.out.size(); ++i) EXPECT_EQ(f1.out[i], f2.out[i]);
  const std::vector<double> dout = random_normal(rng, f1.out.size(), DType::F64);
  const ReferenceGrads g1 = reference_backward(sh, dout), g2 = reference_backward(ssh, dout);
  for (int32_t s = 0; s < 3; ++s)
    for (int32_t h = 0; h < 2; ++h) {
      double sum = 0.0;
      for (int32_t t = 0; t < sh.total_q(); ++t) sum += g2.dsink[(t * 3 + s) * 2 + h];
      EXPECT_NEAR(g1.dsink[s * 2 + h], sum, 1e-13) << "seed " << seed;
    }

  for (std::size_t i = 0; i < g1.dsink.size(); ++i) EXPECT_GE(g1.dsink_magnitude[i], std::fabs(g1.dsink[i]));
  for (std::size_t i = 0; i < g1.dq.size(); ++i) EXPECT_GE(g1.dq_magnitude[i], std::fabs(g1.dq[i]) * (1 - 1e-12));
  for (std::size_t i = 0; i < g1.dk.size(); ++i) EXPECT_GE(g1.dk_magnitude[i], std::fabs(g1.dk[i]) * (1 - 1e-12));

  // A sink at -1e4 carries no mass: the result equals no sink, and its gradient vanishes.
  ReferenceProblem dead = sh;
  std::fill(dead.sink.begin(), dead.sink.end(), -1e4);
  const ReferenceForward f3 = reference_forward(dead);
  const ReferenceGrads g3 = reference_backward(dead, dout);
  for (std::size_t i = 0; i < f0.out.size(); ++i) EXPECT_EQ(f3.out[i], f0.out[i]);
  for (double ds : g3.dsink) EXPECT_EQ(ds, 0.0);
}

// ---------------- gradients against central finite differences ----------------

double loss(const ReferenceProblem& p, const std::vector<double>& dout) {
  const ReferenceForward f = reference_forward(p);
  return std::inner_product(f.out.begin(), f.out.end(), dout.begin(), 0.0);
}

// Checks every element of `analytic` (d loss / d field) by central differences on `field`.
void expect_matches_finite_differences(ReferenceProblem p, std::vector<double> ReferenceProblem::*field,
                                       const std::vector<double>& analytic, const std::vector<double>& dout,
                                       const std::string& what) {
  constexpr double kStep = 1e-5;
  ASSERT_EQ((p.*field).size(), analytic.size()) << what;
  double largest = 1.0;
  for (double g : analytic) largest = std::max(largest, std::fabs(g));
  for (std::size_t i = 0; i < analytic.size(); ++i) {
    const double x = (p.*field)[i];
    (p.*field)[i] = x + kStep;
    const double up = loss(p, dout);
    (p.*field)[i] = x - kStep;
    const double down = loss(p, dout);
    (p.*field)[i] = x;
    const double numeric = (up - down) / (2 * kStep);
    ASSERT_NEAR(analytic[i], numeric, 1e-7 * largest) << what << " element " << i;
  }
}

struct GradCase {
  std::string name;
  int32_t hq, hkv, dim;
  double softcap;
  SinkLayout sink;
  friend void PrintTo(const GradCase& c, std::ostream* os) { *os << c.name; }
};

class ReferenceGradient : public testing::TestWithParam<GradCase> {};

TEST_P(ReferenceGradient, MatchesFiniteDifferences) {
  const GradCase& c = GetParam();
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  ReferenceProblem p = tiny_problem(rng, tricky_tiny_mask(), c.hq, c.hkv, c.dim);
  p.softcap = c.softcap;
  if (c.sink != SinkLayout::None) add_sink(rng, p, c.sink, 2);
  const std::vector<double> dout = random_normal(rng, static_cast<std::size_t>(p.total_q()) * c.hq * c.dim, DType::F64);
  const ReferenceGrads g = reference_backward(p, dout);
  const std::string tag = c.name + " seed " + std::to_string(seed);
  expect_matches_finite_differences(p, &ReferenceProblem::q, g.dq, dout, "dq " + tag);
  expect_matches_finite_differences(p, &ReferenceProblem::k, g.dk, dout, "dk " + tag);
  expect_matches_finite_differences(p, &ReferenceProblem::v, g.dv, dout, "dv " + tag);
  if (c.sink != SinkLayout::None) expect_matches_finite_differences(p, &ReferenceProblem::sink, g.dsink, dout, "dsink " + tag);
}

INSTANTIATE_TEST_SUITE_P(
    TinyCases, ReferenceGradient,
    testing::Values(GradCase{"plain", 2, 2, 8, 0.0, SinkLayout::None}, GradCase{"gqa", 4, 2, 8, 0.0, SinkLayout::None},
                    GradCase{"mqa_d16", 3, 1, 16, 0.0, SinkLayout::None},
                    GradCase{"softcap", 2, 1, 8, 0.7, SinkLayout::None},
                    GradCase{"sink_sh", 2, 2, 8, 0.0, SinkLayout::SH},
                    GradCase{"sink_ssh_gqa", 4, 2, 8, 0.0, SinkLayout::SSH},
                    GradCase{"softcap_sink_ssh", 2, 1, 8, 1.5, SinkLayout::SSH}),
    [](const testing::TestParamInfo<GradCase>& param) { return param.param.name; });

// ---------------- helpers ----------------

// Sum of the slices' kept cells equals the number of kept cells in the union: no two areas overlap.
int64_t overlap_cells(const Mask& m) {
  int64_t per_slice = 0;
  for (const Slice& s : m.slices)
    for (int32_t q = s.q.start; q < s.q.end; ++q)
      for (int32_t k = s.k.start; k < s.k.end; ++k) per_slice += slice_keeps(s, q, k);
  const std::vector<uint8_t> keep = dense_keep(m);
  return per_slice - std::accumulate(keep.begin(), keep.end(), int64_t{0});
}

bool in_bounds(const Mask& m) {
  return std::all_of(m.slices.begin(), m.slices.end(), [&](const Slice& s) {
    return 0 <= s.q.start && s.q.start <= s.q.end && s.q.end <= m.total_q && 0 <= s.k.start &&
           s.k.start <= s.k.end && s.k.end <= m.total_k;
  });
}

TEST(RandomRectangles, AreInBoundsDisjointAndUseAllTypes) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  int type_count[4] = {0, 0, 0, 0};
  const std::tuple<int32_t, int32_t, int32_t> shapes[] = {{128, 128, 10}, {128, 256, 100}, {256, 128, 100}, {64, 64, 300}};
  for (auto [tq, tk, n] : shapes) {
    const Mask m = random_rectangles(rng, tq, tk, n);
    EXPECT_EQ(m.total_q, tq);
    EXPECT_EQ(m.total_k, tk);
    EXPECT_TRUE(in_bounds(m)) << "seed " << seed;
    EXPECT_EQ(overlap_cells(m), 0) << "seed " << seed;
    EXPECT_GE(static_cast<int32_t>(m.slices.size()), n / 2) << "seed " << seed;
    for (const Slice& s : m.slices) ++type_count[static_cast<int>(s.type)];
  }
  for (int t = 0; t < 4; ++t) EXPECT_GT(type_count[t], 0) << "type " << t << " seed " << seed;
}

TEST(NamedCases, AreInBoundsAndDisjoint) {
  for (const cases::Named& c : cases::all()) {
    EXPECT_TRUE(in_bounds(c.mask)) << c.name;
    EXPECT_EQ(overlap_cells(c.mask), 0) << c.name;
    EXPECT_FALSE(c.mask.slices.empty()) << c.name;
  }
  // The uncovered-rows and Sq > Sk cases really contain empty rows.
  for (const Mask& m : {cases::disjoint_uncovered(), cases::causal_sq_gt_sk(MaskType::Causal)}) {
    const std::vector<uint8_t> keep = dense_keep(m);
    EXPECT_EQ(std::accumulate(keep.begin(), keep.begin() + m.total_k, 0), 0);  // row 0 keeps nothing
  }
}

TEST(HostTensor, RoundTripsEveryDtypeAndPoisonsWithNaN) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (DType d : {DType::F64, DType::F32, DType::BF16, DType::F16}) {
    const std::vector<double> x = random_normal(rng, 257, d);
    const HostTensor t = HostTensor::from_values(x, d, {257});
    EXPECT_EQ(t.values(), x) << to_string(d) << " seed " << seed;
    for (double y : HostTensor::poisoned(d, {3, 5}).values()) EXPECT_TRUE(std::isnan(y)) << to_string(d);
  }
  // bf16 keeps 8 significant bits, fp16 11.
  EXPECT_EQ(round_to(DType::BF16, 1.0 + 1.0 / 512), 1.0);
  EXPECT_EQ(round_to(DType::F16, 1.0 + 1.0 / 512), 1.0 + 1.0 / 512);
}

TEST(Compare, RejectsNaNInfMismatchNonZeroEmptyRowsAndLargeErrors) {
  const std::vector<double> ref{1.0, -2.0, 0.0, 3.0};
  EXPECT_TRUE(check_close("x", ref, ref, Quantity::Out, DType::F64, "self"));
  EXPECT_FALSE(check_close("x", {1.0, std::nan(""), 0.0, 3.0}, ref, Quantity::Out, DType::BF16, "nan"));
  const std::vector<uint8_t> empty_row{0, 0, 1, 0};
  EXPECT_FALSE(check_close("x", {1.0, -2.0, 1e-30, 3.0}, ref, Quantity::Out, DType::BF16, "zero", empty_row));
  EXPECT_TRUE(check_close("x", {1.0, -2.0, 1e-30, 3.0}, ref, Quantity::Out, DType::BF16, "cancellation"));
  EXPECT_FALSE(check_close("x", {1.0, -2.0, 0.0, 3.0 + 1e-8}, ref, Quantity::Out, DType::F64, "fp64"));
  EXPECT_TRUE(check_close("x", {1.0, -2.0, 0.0, 3.0 + 1e-11}, ref, Quantity::Out, DType::F64, "fp64"));
  EXPECT_TRUE(check_close("x", {1.0, -2.0, 0.0, 3.01}, ref, Quantity::Out, DType::BF16, "bf16"));
  EXPECT_FALSE(check_close("x", {1.0, -2.0, 0.0, 3.2}, ref, Quantity::Out, DType::BF16, "bf16"));

  // dq / dk: relative L2 unless the reference cancelled to below 1% of its terms' size.
  const std::vector<double> healthy{1.0, -2.0}, terms{3.0, 3.0};
  EXPECT_TRUE(check_grad_cancelling("dq", {1.01, -2.01}, healthy, terms, DType::BF16, "healthy"));
  EXPECT_FALSE(check_grad_cancelling("dq", {1.1, -2.1}, healthy, terms, DType::BF16, "healthy, 7% off"));
  const std::vector<double> cancelled{1e-9, -1e-9};
  EXPECT_TRUE(check_grad_cancelling("dq", {2e-6, -1e-6}, cancelled, terms, DType::BF16, "rounding of the terms"));
  EXPECT_FALSE(check_grad_cancelling("dq", {1e-2, 0.0}, cancelled, terms, DType::BF16, "off by 1e-2"));
  EXPECT_FALSE(check_grad_cancelling("dq", {std::nan(""), 0.0}, cancelled, terms, DType::BF16, "nan"));
  EXPECT_FALSE(check_grad_cancelling("dq", {1e-9, 1e-12}, cancelled, terms, DType::BF16, "structural zero", {0, 1}));

  // dsink is judged against the size of its terms, not of the (possibly cancelled) sum.
  EXPECT_TRUE(check_dsink({1e-3 + 1e-7}, {1e-3}, {1.0}, DType::F32, "cancelled"));
  EXPECT_FALSE(check_dsink({1e-3 + 1e-4}, {1e-3}, {1.0}, DType::F32, "too far"));
  EXPECT_FALSE(check_dsink({std::nan("")}, {1e-3}, {1.0}, DType::BF16, "nan"));

  const std::vector<double> lse{-kInf, 1.5};
  EXPECT_TRUE(check_close("lse", {-kInf, 1.5 + 5e-4}, lse, Quantity::Lse, DType::F16, "ok"));
  EXPECT_FALSE(check_close("lse", {-1e30, 1.5}, lse, Quantity::Lse, DType::F16, "finite for -inf"));
  EXPECT_FALSE(check_close("lse", {-kInf, -kInf}, lse, Quantity::Lse, DType::F16, "-inf for finite"));
  EXPECT_FALSE(check_close("lse", {-kInf, 1.5 + 2e-3}, lse, Quantity::Lse, DType::F16, "too far"));
  const testing::AssertionResult r = check_close("lse", {-kInf, 9.0}, lse, Quantity::Lse, DType::F32, "seed 42");
  EXPECT_NE(std::string(r.message()).find("seed 42"), std::string::npos) << r.message();
  EXPECT_NE(std::string(r.message()).find("lse"), std::string::npos) << r.message();
}

// A logit that cancels near 0 carries the rounding of its terms: judged against their size, not its own.
TEST(Compare, MaxLogitsJudgedAgainstTheirTerms) {
  const std::vector<double> ref = {-9e-4, 2.0}, terms = {3.0, 2.5};
  EXPECT_TRUE(check_max_logits({-9e-4 + 2e-8, 2.0}, ref, terms, DType::F16, "rounding of the terms"));
  EXPECT_FALSE(check_max_logits({-9e-4 + 1e-3, 2.0}, ref, terms, DType::F16, "off by 1e-3"));
  EXPECT_FALSE(check_max_logits({-9e-4, 2.0 + 1e-4}, ref, terms, DType::F16, "the large one off by 1e-4"));
  EXPECT_FALSE(check_max_logits({-kInf, 2.0}, ref, terms, DType::F16, "-inf for finite"));
  EXPECT_FALSE(check_max_logits({std::nan(""), 2.0}, ref, terms, DType::F16, "nan"));
  EXPECT_TRUE(check_max_logits({-kInf}, {-kInf}, {0.0}, DType::F32, "a head that keeps no cell"));
}

TEST(Compare, BitwiseEqualitySeesOneUlpAndSignOfZero) {
  const HostTensor a = HostTensor::from_values({1.0, 0.0, -3.5}, DType::F32, {3});
  const HostTensor b = HostTensor::from_values({1.0, 0.0, std::nextafter(-3.5f, 0.0f)}, DType::F32, {3});
  const HostTensor c = HostTensor::from_values({1.0, -0.0, -3.5}, DType::F32, {3});
  EXPECT_TRUE(check_bitwise_equal("a", a, a, "self"));
  EXPECT_FALSE(check_bitwise_equal("a", a, b, "one ulp"));
  EXPECT_FALSE(check_bitwise_equal("a", a, c, "signed zero"));
  EXPECT_FALSE(check_bitwise_equal("a", a, HostTensor::from_values({1.0, 0.0, -3.5}, DType::F64, {3}), "dtype"));
}

}  // namespace
}  // namespace magi::test
