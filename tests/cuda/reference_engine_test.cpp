// The exact GPU reference engine (src/cuda/reference) against the naive CPU fp64 reference by SPEC section 5
// (fp64: max error 1e-10 relative to max |ref|; fp32: rel L2 1e-5; bf16/fp16 inputs: their bounds) on every
// SPEC section 7 case and random rectangles, with GQA, softcap, sh/ssh sinks (incl. -inf sinks), empty rows;
// forward and backward. Also: bitwise determinism, CUDA-graph replay, and the public API's routing of
// backend `reference` on device tensors.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/cuda_test_support.hpp"
#include "cuda/reference/reference_engine.hpp"
#include "reference/naive_attention.hpp"
#include "reference/random_inputs.hpp"

namespace magi::test {
namespace {

namespace ref_engine = magi::cuda::reference;

ref_engine::Options engine_options(const CaseConfig& c) {
  return {c.softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(c.head_dim))), c.softcap, c.sink_layout};
}

std::string context_of(std::string_view name, const CaseConfig& c, uint64_t seed) {
  std::ostringstream os;
  os << "case " << name << ", " << c.describe() << " (GPU reference engine), seed " << seed;
  return os.str();
}

testing::AssertionResult check_engine_case(const Mask& mask, const CaseConfig& c, uint64_t seed, std::string_view name) {
  const std::string context = context_of(name, c, seed);
  try {
    CaseData d = make_case(mask, c, seed);
    DeviceCase dev(d, c);
    auto plan = ref_engine::make_plan(mask, c.heads_q, c.heads_kv, c.head_dim, 0);
    const ref_engine::Options o = engine_options(c);
    ref_engine::forward(*plan, dev.forward_args(), o, nullptr);
    MAGI_CUDA_CHECK(cudaDeviceSynchronize());
    if (auto ok = judge_forward(d, c, dev.download(), context); !ok) return ok;
    if (!c.backward) return testing::AssertionSuccess();
    ref_engine::backward(*plan, dev.backward_args(), o, nullptr);
    MAGI_CUDA_CHECK(cudaDeviceSynchronize());
    if (auto ok = judge_backward(d, c, dev.download(), context); !ok) return ok;
    return testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "threw: " << e.what() << " [" << context << "]";
  }
}

// ---- every SPEC section 7 case (CPU-sized) under several feature mixes ----

std::vector<EngineCase> spec_cases() {
  std::vector<CaseConfig> configs;
  configs.push_back(config_for(DType::F64, 2, 1, 64));  // GQA
  {
    CaseConfig c = config_for(DType::F64, 4, 2, 40);  // softcap + per-row sinks, D not a tile size
    c.softcap = 5.0;
    c.sink_layout = SinkLayout::SSH;
    c.sink_len = 3;
    configs.push_back(c);
  }
  {
    CaseConfig c = config_for(DType::F64, 2, 2, 64);  // shared sinks, some -inf
    c.sink_layout = SinkLayout::SH;
    c.sink_neg_inf = true;
    configs.push_back(c);
  }
  {
    CaseConfig c = config_for(DType::F32, 4, 2, 128);
    c.softcap = 3.0;
    c.sink_layout = SinkLayout::SH;
    c.sink_len = 2;
    configs.push_back(c);
  }
  {
    CaseConfig c = config_for(DType::F32, 1, 1, 256);
    c.sink_layout = SinkLayout::SSH;
    c.sink_len = 1;
    c.softmax_scale = 0.07;
    configs.push_back(c);
  }
  {
    CaseConfig c = config_for(DType::BF16, 4, 2, 64);
    c.fp32_outputs = true;
    configs.push_back(c);
  }
  {
    CaseConfig c = config_for(DType::F16, 2, 1, 128);
    c.sink_layout = SinkLayout::SSH;
    configs.push_back(c);
  }
  std::vector<EngineCase> out;
  for (const cases::Named& named : cases::all())
    for (const CaseConfig& c : configs) out.push_back({case_name(named.name, c), fixed_mask(named.mask), c});
  {
    CaseConfig c = config_for(DType::F32, 8, 8, 128);
    c.sink_layout = SinkLayout::SSH;
    out.push_back({case_name("rect_1k_1k_100", c), random_rectangles_mask(1024, 1024, 100), c});
  }
  {
    CaseConfig c = config_for(DType::F64, 4, 2, 64);
    c.softcap = 4.0;
    c.sink_layout = SinkLayout::SH;
    out.push_back({case_name("rect_1k_2k_1000", c), random_rectangles_mask(1024, 2048, 1000), c});
  }
  {
    CaseConfig c = config_for(DType::F64, 4, 4, 32);
    c.fp32_lse = true;  // fp64 inputs with the default fp32 lse buffer: fp32 bounds for lse and grads
    out.push_back({case_name("rect_2k_1k_300", c), random_rectangles_mask(2048, 1024, 300), c});
  }
  return out;
}

class ReferenceEngine : public testing::TestWithParam<EngineCase> {};

TEST_P(ReferenceEngine, MatchesNaiveFp64Reference) {
  const EngineCase& c = GetParam();
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  const Mask mask = c.mask(rng);
  auto result = check_engine_case(mask, c.config, seed, c.name);
  if (!result && mask.slices.size() <= 200) result << "\nmask: " << mask_to_json(mask);
  EXPECT_TRUE(result);
}

INSTANTIATE_TEST_SUITE_P(All, ReferenceEngine, testing::ValuesIn(spec_cases()), EngineCaseName{});

// ---- determinism, graph replay, API routing ----

struct Prepared {
  Mask mask;
  CaseConfig config;
  uint64_t seed;
  CaseData data;
};

Prepared prepared_case(DType dtype) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  CaseConfig c = config_for(dtype, 4, 2, 64);
  c.softcap = 2.0;
  c.sink_layout = SinkLayout::SH;
  Mask mask = cases::mixed_types_q_overlap();
  CaseData d = make_case(mask, c, seed);
  return {mask, c, seed, std::move(d)};
}

TEST(ReferenceEngineRuns, BitwiseDeterministic) {
  Prepared p = prepared_case(DType::F32);
  const std::string context = context_of("mixed_types_q_overlap", p.config, p.seed);
  DeviceCase dev(p.data, p.config);
  auto plan = ref_engine::make_plan(p.mask, p.config.heads_q, p.config.heads_kv, p.config.head_dim, 0);
  auto run = [&] {
    dev.poison();
    ref_engine::forward(*plan, dev.forward_args(), engine_options(p.config), nullptr);
    ref_engine::backward(*plan, dev.backward_args(), engine_options(p.config), nullptr);
    MAGI_CUDA_CHECK(cudaDeviceSynchronize());
    return dev.results();
  };
  const auto first = run(), second = run();
  ASSERT_EQ(first.size(), 7u) << context;
  for (size_t i = 0; i < first.size(); ++i)
    EXPECT_TRUE(check_bitwise_equal(first[i].first, first[i].second, second[i].second, context));
}

TEST(ReferenceEngineRuns, GraphReplayEqualsEagerRun) {
  Prepared p = prepared_case(DType::F64);
  const std::string context = context_of("mixed_types_q_overlap", p.config, p.seed);
  DeviceCase dev(p.data, p.config);
  auto plan = ref_engine::make_plan(p.mask, p.config.heads_q, p.config.heads_kv, p.config.head_dim, 0);
  cudaStream_t stream = nullptr;
  MAGI_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ref_engine::forward(*plan, dev.forward_args(), engine_options(p.config), stream);
  ref_engine::backward(*plan, dev.backward_args(), engine_options(p.config), stream);
  MAGI_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto eager = dev.results();
  dev.poison();

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MAGI_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  ref_engine::forward(*plan, dev.forward_args(), engine_options(p.config), stream);
  ref_engine::backward(*plan, dev.backward_args(), engine_options(p.config), stream);
  MAGI_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MAGI_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  MAGI_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  MAGI_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto replayed = dev.results();
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  ASSERT_EQ(eager.size(), replayed.size());
  for (size_t i = 0; i < eager.size(); ++i)
    EXPECT_TRUE(check_bitwise_equal(eager[i].first, eager[i].second, replayed[i].second, context));
}

// magi::forward / backward with Backend::Reference on device tensors run this engine: bitwise equal to
// calling it directly.
TEST(ReferenceEngineRuns, PublicApiRoutesReferenceOnDeviceTensors) {
  Prepared p = prepared_case(DType::F64);
  const std::string context = context_of("mixed_types_q_overlap", p.config, p.seed);
  DeviceCase direct(p.data, p.config), api(p.data, p.config);
  auto plan = ref_engine::make_plan(p.mask, p.config.heads_q, p.config.heads_kv, p.config.head_dim, 0);
  ref_engine::forward(*plan, direct.forward_args(), engine_options(p.config), nullptr);
  ref_engine::backward(*plan, direct.backward_args(), engine_options(p.config), nullptr);
  AttentionOptions options = p.config.options();
  options.backend = Backend::Reference;
  try {
    magi::forward(p.mask, api.forward_args(), options, nullptr);
    magi::backward(p.mask, api.backward_args(), options, nullptr);
  } catch (const std::exception& e) {
    FAIL() << "the API threw: " << e.what() << " [" << context << "]";
  }
  MAGI_CUDA_CHECK(cudaDeviceSynchronize());
  const auto a = direct.results(), b = api.results();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(check_bitwise_equal(a[i].first, a[i].second, b[i].second, context));
}

TEST(ReferenceEngineRuns, EmptyMaskGivesZerosAndMinusInf) {
  Mask mask;
  mask.total_q = 70;
  mask.total_k = 33;
  CaseConfig c = config_for(DType::F32, 2, 1, 24);
  const uint64_t seed = fresh_seed();
  EXPECT_TRUE(check_engine_case(mask, c, seed, "empty_mask"));
}

}  // namespace
}  // namespace magi::test
