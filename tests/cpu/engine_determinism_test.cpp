// The CPU engine is deterministic by construction: out, lse, max_logits, dq, dk, dv and dsink are
// bitwise identical across thread counts and repeated runs.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "reference/attention_check.hpp"
#include "reference/compare.hpp"

namespace magi::test {
namespace {

using T = DType;

std::vector<EngineCase> determinism_cases() {
  std::vector<EngineCase> out;
  auto add = [&](const std::string& mask_name, MaskFactory mask, const CaseConfig& c) {
    out.push_back({case_name(mask_name, c), std::move(mask), c});
  };
  CaseConfig c = config_for(T::F32, 4, 2, 64);
  c.softcap = 2.0;
  c.sink_layout = SinkLayout::SSH;
  add("random_256x256_n100", random_rectangles_mask(256, 256, 100), c);

  c = config_for(T::BF16, 2, 1, 128);
  c.sink_layout = SinkLayout::SH;
  add("varlen_block_causal", fixed_mask(cases::varlen_block_causal()), c);

  add("grid_20x20_full_causal", fixed_mask(cases::grid_alternating(20, 16)), config_for(T::F16, 2, 2, 64));
  add("full_384", fixed_mask(cases::full(384)), config_for(T::F64, 2, 1, 64));

  c = config_for(T::BF16, 4, 1, 72);
  c.fp32_outputs = true;
  add("mixed_types_q_overlap", fixed_mask(cases::mixed_types_q_overlap()), c);
  c = config_for(T::F32, 2, 2, 64);
  c.backend = Backend::Reference;
  c.sink_layout = SinkLayout::SH;
  add("random_192x320_n60", random_rectangles_mask(192, 320, 60), c);
  return out;
}

struct EngineRun {
  EngineResult result;
  std::string label;
};

EngineRun run_with(CaseData& data, CaseConfig c, int32_t threads, std::optional<bool> deterministic, const std::string& tag) {
  c.num_threads = threads;
  c.deterministic = deterministic;
  EngineRun r{run_forward(data, c), tag + " threads " + std::to_string(threads)};
  run_backward(data, c, r.result);
  return r;
}

testing::AssertionResult same_bits(const EngineRun& a, const EngineRun& b, const std::string& context) {
  const std::string where = a.label + " vs " + b.label + "; " + context;
  const std::pair<const HostTensor*, const HostTensor*> pairs[] = {
      {&a.result.out, &b.result.out}, {&a.result.lse, &b.result.lse}, {&a.result.max_logits, &b.result.max_logits},
      {&a.result.dq, &b.result.dq},   {&a.result.dk, &b.result.dk},   {&a.result.dv, &b.result.dv},
      {&a.result.dsink, &b.result.dsink}};
  const char* names[] = {"out", "lse", "max_logits", "dq", "dk", "dv", "dsink"};
  for (std::size_t i = 0; i < std::size(pairs); ++i)
    if (auto ok = check_bitwise_equal(names[i], *pairs[i].first, *pairs[i].second, where); !ok) return ok;
  return testing::AssertionSuccess();
}

class Determinism : public testing::TestWithParam<EngineCase> {};

TEST_P(Determinism, BitwiseIdenticalAcrossThreadCountsAndRuns) {
  const EngineCase& ec = GetParam();
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Mask mask = ec.mask(rng);
  CaseData data = make_case(mask, ec.config, seed);
  const std::string context = ec.name + ", seed " + std::to_string(seed);

  const EngineRun first = run_with(data, ec.config, 1, std::nullopt, "run 1");
  // The results are correct too (one judge is enough: the others must be identical to it).
  EXPECT_TRUE(run_engine_case(ec));
  struct Repeat {
    int32_t threads;
    std::optional<bool> deterministic;
    const char* tag;
  };
  const Repeat repeats[] = {{2, std::nullopt, "run 2"},
                            {3, std::nullopt, "run 3"},
                            {2, true, "run 4 (deterministic)"},
                            {1, std::nullopt, "run 5"},
                            {0, std::nullopt, "run 6 (all cores)"}};
  for (const Repeat& rep : repeats) {
    const EngineRun again = run_with(data, ec.config, rep.threads, rep.deterministic, rep.tag);
    EXPECT_TRUE(same_bits(first, again, context));
  }
}

INSTANTIATE_TEST_SUITE_P(Engine, Determinism, testing::ValuesIn(determinism_cases()), EngineCaseName());

}  // namespace
}  // namespace magi::test
