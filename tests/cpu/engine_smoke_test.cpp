// The CPU engine on problems spanning many tiles (sizes not multiples of the tile, head dims not multiples
// of the vector blocks, items cut at tile edges), against the fp64 reference; and bitwise determinism
// across thread counts when dynamic scheduling really interleaves tasks.
#include <gtest/gtest.h>

#include <string>

#include "reference/attention_check.hpp"
#include "reference/compare.hpp"

namespace magi::test {
namespace {

TEST(EngineMultiTile, RandomRectanglesGqaSoftcapSinkFp32) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  CaseConfig c = config_for(DType::F32, 4, 2, 40);
  c.softcap = 2.5;
  c.sink_layout = SinkLayout::SSH;
  c.sink_len = 3;
  EXPECT_TRUE(check_case(random_rectangles(rng, 700, 650, 40), c, seed, "random_700x650_n40"));
}

TEST(EngineMultiTile, CausalSqLessThanSkFp64OddHeadDim) {
  Mask mask;
  mask.total_q = 300;
  mask.total_k = 500;
  mask.slices.push_back(make_slice(0, 300, 0, 500, MaskType::Causal));
  CaseConfig c = config_for(DType::F64, 2, 1, 136);
  c.sink_layout = SinkLayout::SH;
  EXPECT_TRUE(check_case(mask, c, fresh_seed(), "causal_300x500_d136"));
}

TEST(EngineMultiTile, EmptyRowsAndQOverlapBf16) {
  // CAUSAL and INV_CAUSAL with Sq > Sk (empty rows at both ends) sharing q rows with a FULL slice.
  Mask mask;
  mask.total_q = 520;
  mask.total_k = 400;
  mask.slices.push_back(make_slice(0, 520, 0, 130, MaskType::Causal));
  mask.slices.push_back(make_slice(0, 520, 130, 260, MaskType::InvCausal));
  mask.slices.push_back(make_slice(100, 300, 260, 400, MaskType::Full));
  EXPECT_TRUE(
      check_case(mask, config_for(DType::BF16, 2, 2, 64), fresh_seed(), "q_overlap_sq_gt_sk_520x400"));
}

TEST(EngineDeterminism, BitwiseIdenticalForAnyThreadCount) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Mask mask = random_rectangles(rng, 900, 900, 80);
  CaseConfig c = config_for(DType::F32, 4, 2, 64);
  c.sink_layout = SinkLayout::SH;
  CaseData data = make_case(mask, c, seed);

  auto run = [&](int32_t threads) {
    c.num_threads = threads;
    EngineResult r = run_forward(data, c);
    run_backward(data, c, r);
    return r;
  };
  const EngineResult first = run(1);
  for (int32_t threads : {2, 3, 8}) {
    const EngineResult again = run(threads);
    const std::string where = "threads 1 vs " + std::to_string(threads) + ", seed " + std::to_string(seed);
    EXPECT_TRUE(check_bitwise_equal("out", first.out, again.out, where));
    EXPECT_TRUE(check_bitwise_equal("lse", first.lse, again.lse, where));
    EXPECT_TRUE(check_bitwise_equal("max_logits", first.max_logits, again.max_logits, where));
    EXPECT_TRUE(check_bitwise_equal("dq", first.dq, again.dq, where));
    EXPECT_TRUE(check_bitwise_equal("dk", first.dk, again.dk, where));
    EXPECT_TRUE(check_bitwise_equal("dv", first.dv, again.dv, where));
    EXPECT_TRUE(check_bitwise_equal("dsink", first.dsink, again.dsink, where));
  }
}

}  // namespace
}  // namespace magi::test
