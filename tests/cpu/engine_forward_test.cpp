// Engine forward (out, lse, max_logits) through magi::forward against the naive fp64 reference, by the
// accuracy rules of SPEC section 5, on the SPEC section 7 cases scaled to CPU size.
#include <gtest/gtest.h>

#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "reference/attention_check.hpp"

namespace magi::test {
namespace {

using T = DType;

CaseConfig forward_only(CaseConfig c) {
  c.backward = false;
  return c;
}

// Heads and head dim rotate with the dtype so that each case meets several shapes.
CaseConfig rotating_config(DType dtype) {
  switch (dtype) {
    case T::F64: return config_for(T::F64, 2, 1, 64);
    case T::F32: return config_for(T::F32, 4, 2, 64);
    case T::BF16: return config_for(T::BF16, 2, 2, 128);
    case T::F16: return config_for(T::F16, 1, 1, 64);
  }
  return {};
}

std::vector<EngineCase> spec_cases() {
  std::vector<EngineCase> out;
  for (const cases::Named& m : cases::all())
    for (DType d : {T::F64, T::F32, T::BF16, T::F16}) {
      const CaseConfig c = forward_only(rotating_config(d));
      out.push_back({case_name(m.name, c), fixed_mask(m.mask), c});
    }
  return out;
}

std::vector<EngineCase> random_cases() {
  struct Grid {
    int32_t tq, tk;
  };
  std::vector<EngineCase> out;
  const DType dtypes[] = {T::F64, T::F32, T::BF16, T::F16};
  int index = 0;
  for (Grid g : {Grid{128, 128}, Grid{256, 256}, Grid{128, 256}, Grid{256, 128}})
    for (int32_t n : {10, 100}) {
      const CaseConfig c = forward_only(rotating_config(dtypes[index++ % 4]));
      const std::string name = "random_" + std::to_string(g.tq) + "x" + std::to_string(g.tk) + "_n" + std::to_string(n);
      out.push_back({case_name(name, c), random_rectangles_mask(g.tq, g.tk, n), c});
    }
  return out;
}

std::vector<EngineCase> head_shape_cases() {
  std::vector<EngineCase> out;
  auto add = [&](const std::string& mask_name, MaskFactory mask, CaseConfig c) {
    c = forward_only(c);
    out.push_back({case_name(mask_name, c), std::move(mask), c});
  };
  add("block_causal_256_b64", fixed_mask(cases::block_causal(256, 64)), config_for(T::BF16, 8, 8, 128));
  add("block_causal_256_b64", fixed_mask(cases::block_causal(256, 64)), config_for(T::F32, 8, 8, 128));
  add("random_64x96_n20", random_rectangles_mask(64, 96, 20), config_for(T::F32, 32, 4, 128));
  add("random_64x64_n20", random_rectangles_mask(64, 64, 20), config_for(T::F16, 32, 4, 128));
  add("full_256", fixed_mask(cases::full(256)), config_for(T::F64, 1, 1, 64));
  add("varlen_block_causal", fixed_mask(cases::varlen_block_causal()), config_for(T::BF16, 4, 2, 64));
  add("mixed_types_q_overlap", fixed_mask(cases::mixed_types_q_overlap()), config_for(T::F16, 4, 2, 64));
  // Head dims that are multiples of 8 but not of the fast sizes.
  for (int32_t dim : {8, 24, 72, 256}) {
    add("sparse_14_repeated_q", fixed_mask(cases::sparse_repeated_q()), config_for(T::F32, 2, 1, dim));
    add("random_128x128_n30", random_rectangles_mask(128, 128, 30), config_for(T::F64, 2, 2, dim));
  }
  add("random_96x160_n40", random_rectangles_mask(96, 160, 40), config_for(T::BF16, 3, 1, 24));
  return out;
}

std::vector<EngineCase> feature_cases() {
  std::vector<EngineCase> out;
  auto add = [&](const std::string& mask_name, MaskFactory mask, CaseConfig c) {
    c = forward_only(c);
    out.push_back({case_name(mask_name, c), std::move(mask), c});
  };
  const MaskFactory mixed = fixed_mask(cases::mixed_types_q_overlap());
  const MaskFactory uncovered = fixed_mask(cases::disjoint_uncovered());
  for (DType d : {T::F64, T::F32, T::BF16, T::F16}) {
    CaseConfig c = config_for(d, 4, 2, 64);
    c.softcap = 1.5;  // small enough to bend most logits
    add("mixed_types_q_overlap", mixed, c);

    c = config_for(d, 2, 1, 64);
    c.sink_layout = SinkLayout::SH;
    c.sink_len = d == T::F32 ? 1 : 4;
    add("disjoint_uncovered_rows", uncovered, c);

    c = config_for(d, 4, 2, 64);
    c.sink_layout = SinkLayout::SSH;
    c.sink_len = 3;
    add("full_512", fixed_mask(cases::full(512)), c);
  }
  for (DType d : {T::BF16, T::F16}) {
    CaseConfig c = config_for(d, 2, 2, 64);
    c.fp32_outputs = true;
    add("varlen_block_causal", fixed_mask(cases::varlen_block_causal()), c);
    c.softcap = 2.0;
    c.sink_layout = SinkLayout::SSH;
    add("random_256x128_n100", random_rectangles_mask(256, 128, 100), c);
  }
  CaseConfig scaled = config_for(T::F32, 2, 2, 64);
  scaled.softmax_scale = 0.3;
  add("grid_20x20_full_causal", fixed_mask(cases::grid_alternating(20, 16)), scaled);
  scaled.dtype = T::F64;
  scaled.softmax_scale = 0.05;
  add("sparse_14_repeated_q", fixed_mask(cases::sparse_repeated_q()), scaled);

  CaseConfig no_max = config_for(T::BF16, 2, 1, 64);
  no_max.max_logits = false;
  add("shared_k_range", fixed_mask(cases::shared_k_range()), no_max);

  // The Reference backend: fp64 accumulation whatever the dtype.
  for (DType d : {T::F32, T::BF16, T::F16}) {
    CaseConfig c = config_for(d, 2, 1, 64);
    c.backend = Backend::Reference;
    c.sink_layout = SinkLayout::SH;
    add("mixed_types_q_overlap", mixed, c);
  }
  return out;
}

class SpecCases : public testing::TestWithParam<EngineCase> {};
TEST_P(SpecCases, ForwardMatchesReference) { EXPECT_TRUE(run_engine_case(GetParam())); }
INSTANTIATE_TEST_SUITE_P(Forward, SpecCases, testing::ValuesIn(spec_cases()), EngineCaseName());

class RandomRectangles : public testing::TestWithParam<EngineCase> {};
TEST_P(RandomRectangles, ForwardMatchesReference) { EXPECT_TRUE(run_engine_case(GetParam())); }
INSTANTIATE_TEST_SUITE_P(Forward, RandomRectangles, testing::ValuesIn(random_cases()), EngineCaseName());

class HeadShapes : public testing::TestWithParam<EngineCase> {};
TEST_P(HeadShapes, ForwardMatchesReference) { EXPECT_TRUE(run_engine_case(GetParam())); }
INSTANTIATE_TEST_SUITE_P(Forward, HeadShapes, testing::ValuesIn(head_shape_cases()), EngineCaseName());

class Features : public testing::TestWithParam<EngineCase> {};
TEST_P(Features, ForwardMatchesReference) { EXPECT_TRUE(run_engine_case(GetParam())); }
INSTANTIATE_TEST_SUITE_P(Forward, Features, testing::ValuesIn(feature_cases()), EngineCaseName());

// A mask with no slices: every row is empty.
TEST(EmptyRows, MaskWithoutSlicesGivesZeroOutAndMinusInfLse) {
  for (DType d : {T::F64, T::F32, T::BF16, T::F16}) {
    const CaseConfig c = forward_only(config_for(d, 2, 1, 32));
    EXPECT_TRUE(run_engine_case({case_name("no_slices", c), fixed_mask(Mask{{}, 40, 30}), c}));
  }
}

// Empty rows with a sink: lse is the sink's logsumexp, out stays exactly 0.
TEST(EmptyRows, SinkOnlyRowsGiveZeroOutAndSinkLse) {
  for (SinkLayout layout : {SinkLayout::SH, SinkLayout::SSH}) {
    CaseConfig c = forward_only(config_for(T::F32, 2, 2, 16));
    c.sink_layout = layout;
    EXPECT_TRUE(run_engine_case({case_name("bi_causal_sq_gt_sk", c), fixed_mask(cases::causal_sq_gt_sk(MaskType::BiCausal)), c}));
  }
}

// Degenerate grids: no keys at all (every row empty) and no queries at all.
TEST(EmptyRows, NoKeysOrNoQueries) {
  for (DType d : {T::F32, T::BF16}) {
    const CaseConfig c = config_for(d, 2, 1, 16);
    EXPECT_TRUE(run_engine_case({case_name("tk0", c), fixed_mask(Mask{{}, 12, 0}), c}));
    EXPECT_TRUE(run_engine_case({case_name("tq0", c), fixed_mask(Mask{{}, 0, 12}), c}));
  }
}

// Plans are cached by the API: masks with the same shapes but different slices must never share one.
TEST(PlanCache, SameShapesDifferentMasksStayDistinct) {
  const Mask variants[] = {cases::causal_sq_gt_sk(MaskType::Causal), cases::causal_sq_gt_sk(MaskType::BiCausal),
                           Mask{{make_slice(0, 300, 0, 200, MaskType::InvCausal)}, 300, 200},
                           Mask{{make_slice(0, 300, 0, 200, MaskType::Causal)}, 300, 200}};
  const CaseConfig c = forward_only(config_for(T::F32, 2, 1, 32));
  for (int round = 0; round < 2; ++round)
    for (std::size_t i = 0; i < std::size(variants); ++i)
      EXPECT_TRUE(run_engine_case({"variant_" + std::to_string(i), fixed_mask(variants[i]), c})) << "round " << round;
}

// The default backend (Auto) on host tensors is the CPU engine.
TEST(Backends, AutoOnHostTensorsMatchesReference) {
  CaseConfig c = forward_only(config_for(T::F32, 2, 2, 64));
  c.backend = Backend::Auto;
  EXPECT_TRUE(run_engine_case({case_name("varlen_block_causal", c), fixed_mask(cases::varlen_block_causal()), c}));
}

// Sinks at the extremes: some -inf (a head with none at all), dominating (+20), negligible (-30).
TEST(Sinks, ExtremeValues) {
  for (DType d : {T::F64, T::F32, T::BF16}) {
    for (SinkLayout layout : {SinkLayout::SH, SinkLayout::SSH}) {
      CaseConfig c = forward_only(config_for(d, 2, 1, 32));
      c.sink_layout = layout;
      c.sink_len = 3;
      c.sink_neg_inf = true;
      EXPECT_TRUE(run_engine_case({case_name("disjoint_uncovered_rows", c), fixed_mask(cases::disjoint_uncovered()), c}));
      c.sink_neg_inf = false;
      for (double mean : {20.0, -30.0}) {
        c.sink_mean = mean;
        EXPECT_TRUE(run_engine_case({case_name("mixed_types_q_overlap", c), fixed_mask(cases::mixed_types_q_overlap()), c}));
      }
    }
  }
}

// fp64 inputs with the default fp32 lse buffer: out keeps fp64 accuracy, lse gets fp32 accuracy.
TEST(Buffers, Fp64InputsWithFp32Lse) {
  CaseConfig c = forward_only(config_for(T::F64, 2, 1, 64));
  c.fp32_lse = true;
  c.sink_layout = SinkLayout::SH;
  EXPECT_TRUE(run_engine_case({case_name("varlen_block_causal", c), fixed_mask(cases::varlen_block_causal()), c}));
}

// Random grids, slice counts, heads, head dims, dtypes and features.
TEST(Fuzz, RandomCasesMatchReference) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 24; ++i) {
    const EngineCase c = random_engine_case(rng, 200, /*backward=*/false);
    EXPECT_TRUE(run_engine_case(c)) << "fuzz seed " << seed << ", case " << i;
  }
}

// Independent callers on several threads at once (each call uses its own buffers; the plan cache is shared).
TEST(Concurrency, SimultaneousCallsFromSeveralThreads) {
  const EngineCase cases_by_thread[] = {
      {"a", fixed_mask(cases::varlen_block_causal()), forward_only(config_for(T::F32, 2, 1, 64))},
      {"b", fixed_mask(cases::causal_sq_gt_sk(MaskType::Causal)), forward_only(config_for(T::BF16, 2, 2, 32))},
      {"c", fixed_mask(cases::causal_sq_gt_sk(MaskType::BiCausal)), forward_only(config_for(T::BF16, 2, 2, 32))}};
  std::vector<testing::AssertionResult> results(std::size(cases_by_thread), testing::AssertionSuccess());
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < std::size(cases_by_thread); ++t)
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3 && results[t]; ++round) {
        CaseConfig c = cases_by_thread[t].config;
        c.num_threads = 1 + static_cast<int32_t>(t % 2);
        results[t] = run_engine_case({cases_by_thread[t].name, cases_by_thread[t].mask, c});
      }
    });
  for (std::thread& th : threads) th.join();
  for (const testing::AssertionResult& r : results) EXPECT_TRUE(r);
}

// A few larger problems (about 1k tokens), where blocking and threading have more tiles to get wrong.
TEST(Larger, Forward1kTokens) {
  CaseConfig c = forward_only(config_for(T::BF16, 4, 2, 64));
  c.sink_layout = SinkLayout::SSH;
  EXPECT_TRUE(run_engine_case({case_name("full_1024", c), fixed_mask(cases::full(1024)), c}));
  c = forward_only(config_for(T::F32, 2, 1, 128));
  EXPECT_TRUE(run_engine_case({case_name("random_1024x768_n300", c), random_rectangles_mask(1024, 768, 300), c}));
  c = forward_only(config_for(T::F64, 2, 2, 64));
  EXPECT_TRUE(run_engine_case({case_name("block_causal_1000_b96", c), fixed_mask(cases::block_causal(1000, 96)), c}));
}

}  // namespace
}  // namespace magi::test
