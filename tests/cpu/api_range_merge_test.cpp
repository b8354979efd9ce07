// MAGI_ATTENTION_AUTO_RANGE_MERGE through the public API on the CPU engine: plans made from merged slices meet the
// SPEC section 5 bounds against the fp64 reference; in deterministic mode out, lse, max_logits, dq, dk, dv and dsink
// are bitwise those of the unmerged mask; toggling the variable never returns the other setting's cached plan.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "api/engine.hpp"
#include "cpu/plan.hpp"
#include "env/env_fixture.hpp"
#include "magi/attention.hpp"
#include "reference/attention_check.hpp"

namespace magi::test {
namespace {

class RangeMerge : public env::testing_support::CleanEnvironment {
 protected:
  void merge(bool on) { set("MAGI_ATTENTION_AUTO_RANGE_MERGE", on ? "1" : "0"); }
};

// Forward and backward of one case's data under the current environment.
EngineResult run(CaseData& data, const CaseConfig& c) {
  EngineResult r = run_forward(data, c);
  run_backward(data, c, r);
  return r;
}

testing::AssertionResult same_bits(const EngineResult& a, const EngineResult& b) {
  const std::pair<const HostTensor*, const HostTensor*> pairs[] = {
      {&a.out, &b.out}, {&a.lse, &b.lse}, {&a.max_logits, &b.max_logits}, {&a.dq, &b.dq},
      {&a.dk, &b.dk},   {&a.dv, &b.dv},   {&a.dsink, &b.dsink}};
  const char* names[] = {"out", "lse", "max_logits", "dq", "dk", "dv", "dsink"};
  for (size_t i = 0; i < std::size(pairs); ++i)
    if (pairs[i].first->bytes() != pairs[i].second->bytes())
      return testing::AssertionFailure() << names[i] << " differs bitwise";
  return testing::AssertionSuccess();
}

struct Named {
  std::string name;
  Mask mask;
  bool always_merges = false;  // under the deterministic rule too
};

// Masks whose slices merge: random rectangles cut at multiples of the CPU tiles or anywhere, causal documents in
// row bands of 96 (merged back in any mode) and SPEC section 7's checkerboard (full beside causal, 48-cell seams:
// merged outside deterministic mode only).
std::vector<Named> mergeable_masks(std::mt19937_64& rng) {
  std::vector<Named> masks;
  masks.push_back({"cut_rectangles_aligned", random_cut_rectangles(rng, 400, 500, 10, 4, cpu::kTileMultiple)});
  masks.push_back({"cut_rectangles_anywhere", random_cut_rectangles(rng, 300, 260, 12, 4, 1)});
  Mask docs = masks::varlen_causal(cu_seqlens_of({384, 100, 300}));
  Mask banded{{}, docs.total_q, docs.total_k};
  for (const Slice& s : docs.slices) row_bands(s, 96, banded.slices);
  masks.push_back({"varlen_causal_in_bands", banded, true});
  masks.push_back({"grid_alternating", cases::grid_alternating(6, 48)});
  return masks;
}

TEST_F(RangeMerge, DeterministicModeGivesTheUnmergedBits) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  int index = 0;
  for (const Named& m : mergeable_masks(rng)) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      CaseConfig c = config_for(dtype, 4, 2, 64);
      c.deterministic = true;
      if (index % 2 == 0) c.softcap = 20.0;
      if (index % 3 == 0) c.sink_layout = index % 2 ? SinkLayout::SSH : SinkLayout::SH;
      CaseData data = make_case(m.mask, c, seed + index++);
      merge(false);
      const EngineResult plain = run(data, c);
      merge(true);
      const EngineResult merged = run(data, c);
      EXPECT_TRUE(same_bits(plain, merged)) << m.name << ", " << c.describe() << ", seed " << seed;
      if (m.always_merges)
        EXPECT_LT(planned_mask(m.mask, c.options(), Device{}).slices.size(), m.mask.slices.size()) << m.name;
    }
  }
}

TEST_F(RangeMerge, MergedPlansMeetTheAccuracyBounds) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  merge(true);
  int index = 0;
  for (const Named& m : mergeable_masks(rng)) {
    for (DType dtype : {DType::F64, DType::F32, DType::BF16}) {
      CaseConfig c = config_for(dtype, 2, 1, 32);
      if (index % 2 == 1) c.sink_layout = SinkLayout::SH;
      if (m.name != "cut_rectangles_aligned")  // random: rarely nothing to merge
        EXPECT_LT(planned_mask(m.mask, c.options(), Device{}).slices.size(), m.mask.slices.size()) << m.name;
      EXPECT_TRUE(check_case(m.mask, c, seed + index++, m.name));
    }
  }
}

TEST_F(RangeMerge, TogglingTheVariableNeverReusesTheOtherPlan) {
  // Side by side inside one 96-key tile: merged, the rows take one online-softmax step instead of two, so the
  // low bits differ outside deterministic mode.
  Mask mask{{}, 200, 200};
  for (int32_t k = 0; k < 200; k += 25) mask.slices.push_back(make_slice(0, 200, k, k + 25, MaskType::Full));
  CaseConfig c = config_for(DType::F32, 2, 2, 64);
  c.deterministic = false;
  CaseData data = make_case(mask, c, fresh_seed());
  merge(false);
  EXPECT_EQ(planned_mask(mask, c.options(), Device{}).slices, mask.slices);
  const EngineResult plain = run(data, c);
  merge(true);
  EXPECT_EQ(planned_mask(mask, c.options(), Device{}).slices.size(), 1u);
  const EngineResult merged = run(data, c);
  ASSERT_FALSE(same_bits(plain, merged)) << "one online-softmax step per row should round differently";
  merge(false);
  EXPECT_TRUE(same_bits(run(data, c), plain)) << "flag off again: the unmerged plan";
  merge(true);
  EXPECT_TRUE(same_bits(run(data, c), merged)) << "flag on again: the merged plan";
}

TEST(RangeMergeRule, FollowsTheVariableAndDeterministicMode) {
  const api::Engine& cpu = api::cpu_engine();
  EXPECT_FALSE(api::range_merge_for(false, false, cpu));
  EXPECT_FALSE(api::range_merge_for(false, true, cpu));
  ASSERT_TRUE(api::range_merge_for(true, false, cpu));
  EXPECT_EQ(api::range_merge_for(true, false, cpu)->boundary_multiple, 0);
  ASSERT_TRUE(api::range_merge_for(true, true, cpu));
  EXPECT_EQ(api::range_merge_for(true, true, cpu)->boundary_multiple, cpu::kTileMultiple);
  const Mask mask = masks::causal(64, 64);
  const api::Shapes s{64, 64, 2, 2, 64};
  EXPECT_NE(api::plan_key(mask, s, -1), api::plan_key(mask, s, -1, 0, MergeRule{}));
  EXPECT_NE(api::plan_key(mask, s, -1, 0, MergeRule{}), api::plan_key(mask, s, -1, 0, MergeRule{96}));
}

}  // namespace
}  // namespace magi::test
