// Engine forward + backward (dq, dk, dv, dsink) through magi::forward / magi::backward against the naive
// fp64 reference, by the accuracy rules of SPEC section 5. The backward consumes the engine's own out/lse.
#include <gtest/gtest.h>

#include <vector>

#include "reference/attention_check.hpp"

namespace magi::test {
namespace {

using T = DType;

std::vector<EngineCase> spec_cases() {
  // Two dtypes per case, alternating, so that every case and every dtype is covered.
  const CaseConfig configs[] = {config_for(T::F64, 2, 1, 64), config_for(T::BF16, 2, 2, 128),
                                config_for(T::F32, 4, 2, 64), config_for(T::F16, 1, 1, 64)};
  std::vector<EngineCase> out;
  int index = 0;
  for (const cases::Named& m : cases::all()) {
    for (int k = 0; k < 2; ++k) {
      const CaseConfig& c = configs[(2 * index + k) % 4];
      out.push_back({case_name(m.name, c), fixed_mask(m.mask), c});
    }
    ++index;
  }
  return out;
}

std::vector<EngineCase> random_cases() {
  struct Grid {
    int32_t tq, tk;
  };
  const CaseConfig configs[] = {config_for(T::F32, 2, 1, 64), config_for(T::F64, 2, 2, 32),
                                config_for(T::BF16, 4, 2, 64), config_for(T::F16, 2, 2, 64)};
  std::vector<EngineCase> out;
  int index = 0;
  for (Grid g : {Grid{128, 128}, Grid{256, 256}, Grid{128, 256}, Grid{256, 128}})
    for (int32_t n : {10, 100}) {
      const CaseConfig& c = configs[index++ % 4];
      const std::string name = "random_" + std::to_string(g.tq) + "x" + std::to_string(g.tk) + "_n" + std::to_string(n);
      out.push_back({case_name(name, c), random_rectangles_mask(g.tq, g.tk, n), c});
    }
  return out;
}

std::vector<EngineCase> shape_and_feature_cases() {
  std::vector<EngineCase> out;
  auto add = [&](const std::string& mask_name, MaskFactory mask, const CaseConfig& c) {
    out.push_back({case_name(mask_name, c), std::move(mask), c});
  };
  // Heads from SPEC section 7 (small T for the wide ones).
  add("block_causal_256_b64", fixed_mask(cases::block_causal(256, 64)), config_for(T::F32, 8, 8, 128));
  add("random_64x96_n20", random_rectangles_mask(64, 96, 20), config_for(T::BF16, 32, 4, 128));
  add("full_256", fixed_mask(cases::full(256)), config_for(T::F64, 1, 1, 64));
  add("varlen_block_causal", fixed_mask(cases::varlen_block_causal()), config_for(T::F16, 4, 2, 64));
  for (int32_t dim : {8, 24, 72}) {
    add("random_128x128_n30", random_rectangles_mask(128, 128, 30), config_for(T::F64, 2, 1, dim));
    add("sparse_14_repeated_q", fixed_mask(cases::sparse_repeated_q()), config_for(T::F32, 2, 2, dim));
  }
  add("random_64x64_n10", random_rectangles_mask(64, 64, 10), config_for(T::F32, 2, 1, 256));

  for (DType d : {T::F64, T::F32, T::BF16, T::F16}) {
    CaseConfig c = config_for(d, 4, 2, 64);
    c.softcap = 1.5;
    add("mixed_types_q_overlap", fixed_mask(cases::mixed_types_q_overlap()), c);

    c = config_for(d, 2, 1, 64);
    c.sink_layout = SinkLayout::SH;
    c.sink_len = 4;
    add("disjoint_uncovered_rows", fixed_mask(cases::disjoint_uncovered()), c);

    c = config_for(d, 2, 2, 64);
    c.sink_layout = SinkLayout::SSH;
    c.sink_len = 2;
    add("full_384", fixed_mask(cases::full(384)), c);
  }
  for (DType d : {T::BF16, T::F16}) {
    CaseConfig c = config_for(d, 4, 2, 64);
    c.fp32_outputs = true;
    add("shared_k_range", fixed_mask(cases::shared_k_range()), c);
    c.softcap = 2.0;
    c.sink_layout = SinkLayout::SH;
    c.sink_len = 2;
    add("random_128x256_n100", random_rectangles_mask(128, 256, 100), c);
  }
  CaseConfig scaled = config_for(T::F64, 2, 1, 32);
  scaled.softmax_scale = 0.4;
  scaled.softcap = 3.0;
  scaled.sink_layout = SinkLayout::SSH;
  scaled.sink_len = 1;
  add("causal_sq_gt_sk", fixed_mask(cases::causal_sq_gt_sk(MaskType::Causal)), scaled);

  // Large head dims (issue 24's set: 264 and 520 fall between tiles on the GPU; any D here), small T: full, causal
  // blocks, uneven documents, random slices and q-overlap, with GQA, softcap and both sink layouts.
  const DType large_dtypes[] = {T::BF16, T::F16, T::F32, T::F64};
  int large = 0;
  for (int32_t dim : {264, 320, 512, 520, 1024}) {
    CaseConfig c = config_for(large_dtypes[large++ % 4], 2, 1, dim);
    add("full_160", fixed_mask(cases::full(160)), c);
    add("block_causal_192_b48", fixed_mask(cases::block_causal(192, 48)), c);
    add("random_96x128_n20", random_rectangles_mask(96, 128, 20), c);
    c = config_for(large_dtypes[large++ % 4], 4, 2, dim);
    c.softcap = 2.5;
    c.sink_layout = large % 2 ? SinkLayout::SSH : SinkLayout::SH;
    c.sink_len = 2;
    add("mixed_types_q_overlap", fixed_mask(cases::mixed_types_q_overlap()), c);
    add("varlen_full_10_uneven_docs", fixed_mask(cases::varlen_full_uneven_docs()), c);
  }

  for (DType d : {T::F32, T::BF16}) {
    CaseConfig c = config_for(d, 2, 1, 64);
    c.backend = Backend::Reference;
    c.sink_layout = SinkLayout::SSH;
    add("varlen_full_10_uneven_docs", fixed_mask(cases::varlen_full_uneven_docs()), c);
  }
  return out;
}

class SpecCases : public testing::TestWithParam<EngineCase> {};
TEST_P(SpecCases, BackwardMatchesReference) { EXPECT_TRUE(run_engine_case(GetParam())); }
INSTANTIATE_TEST_SUITE_P(Backward, SpecCases, testing::ValuesIn(spec_cases()), EngineCaseName());

class RandomRectangles : public testing::TestWithParam<EngineCase> {};
TEST_P(RandomRectangles, BackwardMatchesReference) { EXPECT_TRUE(run_engine_case(GetParam())); }
INSTANTIATE_TEST_SUITE_P(Backward, RandomRectangles, testing::ValuesIn(random_cases()), EngineCaseName());

class ShapesAndFeatures : public testing::TestWithParam<EngineCase> {};
TEST_P(ShapesAndFeatures, BackwardMatchesReference) { EXPECT_TRUE(run_engine_case(GetParam())); }
INSTANTIATE_TEST_SUITE_P(Backward, ShapesAndFeatures, testing::ValuesIn(shape_and_feature_cases()), EngineCaseName());

// Rows and keys nobody attends to: gradients exactly 0, with and without a sink.
TEST(EmptyRows, GradientsAreExactlyZero) {
  for (SinkLayout layout : {SinkLayout::None, SinkLayout::SH}) {
    for (DType d : {T::F32, T::BF16}) {
      CaseConfig c = config_for(d, 2, 1, 16);
      c.sink_layout = layout;
      EXPECT_TRUE(run_engine_case({case_name("no_slices", c), fixed_mask(Mask{{}, 24, 20}), c}));
      EXPECT_TRUE(run_engine_case(
          {case_name("bi_causal_sq_gt_sk", c), fixed_mask(cases::causal_sq_gt_sk(MaskType::BiCausal)), c}));
    }
  }
}

// Sinks at the extremes: some -inf (a head with none at all), dominating (+20), negligible (-30).
TEST(Sinks, ExtremeValuesGradients) {
  for (DType d : {T::F64, T::F32, T::BF16}) {
    for (SinkLayout layout : {SinkLayout::SH, SinkLayout::SSH}) {
      CaseConfig c = config_for(d, 2, 1, 32);
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

// Output buffers of different dtypes in one call (out/dq/dv fp32, dout/dk 16-bit), and fp64 inputs with
// the default fp32 lse (whose rounding then bounds the gradients at fp32 accuracy).
TEST(Buffers, MixedDtypesAndFp32Lse) {
  for (DType d : {T::BF16, T::F16}) {
    CaseConfig c = config_for(d, 4, 2, 64);
    c.mixed_buffers = true;
    c.sink_layout = SinkLayout::SSH;
    EXPECT_TRUE(run_engine_case({case_name("sparse_14_repeated_q", c), fixed_mask(cases::sparse_repeated_q()), c}));
  }
  CaseConfig c = config_for(T::F64, 2, 1, 64);
  c.fp32_lse = true;
  c.sink_layout = SinkLayout::SH;
  EXPECT_TRUE(run_engine_case({case_name("varlen_block_causal", c), fixed_mask(cases::varlen_block_causal()), c}));
}

// Random grids, slice counts, heads, head dims, dtypes and features.
TEST(Fuzz, RandomCasesMatchReference) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 16; ++i) {
    const EngineCase c = random_engine_case(rng, 160, /*backward=*/true);
    EXPECT_TRUE(run_engine_case(c)) << "fuzz seed " << seed << ", case " << i;
  }
}

// Large logits (scale 2: |s| up to ~40) make the softmax nearly one-hot and the online rescaling factors
// underflow; with and without a sink.
TEST(LargeLogits, SharpSoftmax) {
  for (DType d : {T::F64, T::BF16}) {
    CaseConfig c = config_for(d, 2, 1, 32);
    c.softmax_scale = 2.0;
    EXPECT_TRUE(run_engine_case({case_name("block_causal_384_b64", c), fixed_mask(cases::block_causal(384, 64)), c}));
    c.sink_layout = SinkLayout::SSH;
    c.sink_mean = 25.0;
    EXPECT_TRUE(run_engine_case({case_name("random_256x256_n40", c), random_rectangles_mask(256, 256, 40), c}));
  }
}

// Larger problems (about 1k tokens): more tiles per row and per key for the backward's accumulation.
TEST(Larger, Backward1kTokens) {
  CaseConfig c = config_for(T::F32, 2, 1, 64);
  c.sink_layout = SinkLayout::SH;
  EXPECT_TRUE(run_engine_case({case_name("random_1024x1024_n100", c), random_rectangles_mask(1024, 1024, 100), c}));
  c = config_for(T::BF16, 4, 2, 64);
  c.softcap = 5.0;
  EXPECT_TRUE(run_engine_case({case_name("block_causal_1000_b96", c), fixed_mask(cases::block_causal(1000, 96)), c}));
}

}  // namespace
}  // namespace magi::test
