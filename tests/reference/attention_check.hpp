// Runs one attention case through the public API (magi::forward / magi::backward) and judges it against
// the naive fp64 reference by SPEC section 5. Shared by the engine test programs.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <ostream>
#include <random>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "magi/attention.hpp"
#include "magi/mask.hpp"
#include "reference/naive_attention.hpp"
#include "reference/random_inputs.hpp"

namespace magi::test {

struct CaseConfig {
  int32_t heads_q = 2;
  int32_t heads_kv = 2;
  int32_t head_dim = 64;
  DType dtype = DType::F32;
  bool fp32_outputs = false;  // 16-bit inputs: out, dout and dq/dk/dv as fp32 buffers
  bool mixed_buffers = false; // 16-bit inputs: out, dq, dv fp32; dout, dk in the input dtype
  bool fp32_lse = false;      // fp64 inputs with the SPEC's default fp32 lse buffer
  std::optional<double> softmax_scale;
  double softcap = 0.0;
  SinkLayout sink_layout = SinkLayout::None;
  int32_t sink_len = 2;
  double sink_mean = 3.0;       // sinks ~ N(sink_mean, 1): a noticeable share of each row's mass
  bool sink_neg_inf = false;    // some sinks -inf (head 0 entirely; s = 0 for every head)
  bool max_logits = true;
  bool backward = true;
  Backend backend = Backend::Cpu;
  int32_t num_threads = 0;
  std::optional<bool> deterministic;

  DType out_dtype() const;
  DType dout_dtype() const;
  DType grad_dtype() const;  // dq, dk, dv when they share one dtype (no mixed_buffers)
  DType dq_dtype() const;
  DType dk_dtype() const;
  DType dv_dtype() const;
  DType lse_dtype() const;         // fp64 for fp64 inputs unless fp32_lse, else fp32
  DType lse_judged_as() const;     // the dtype whose bounds apply to lse and gradients
  AttentionOptions options() const;
  std::string describe() const;
};

// One case's inputs, as reference vectors (rounded to the dtype) and as API buffers.
struct CaseData {
  Mask mask;
  ReferenceProblem problem;
  std::vector<double> dout;  // rounded to the out dtype
  HostTensor q, k, v, sink, dout_tensor;
};
CaseData make_case(const Mask& mask, const CaseConfig& config, uint64_t seed);

struct EngineResult {
  HostTensor out, lse, max_logits;
  HostTensor dq, dk, dv, dsink;
};
// The InvalidArgument message of `call`, or a description of what happened instead (so that a check for the
// argument's name in it fails when the call was accepted or threw something else).
std::string invalid_argument_message(const std::function<void()>& call);

// Poisons every output with NaN, then calls magi::forward.
EngineResult run_forward(CaseData& data, const CaseConfig& config);
// Poisons the gradients, then calls magi::backward on `result`'s out and lse.
void run_backward(CaseData& data, const CaseConfig& config, EngineResult& result);

// Elements that are zero by structure: rows that keep no key (out, dq) and keys no row keeps (dk, dv).
struct StructuralZeros {
  std::vector<uint8_t> q_rows, k_rows;  // per element of [Tq, Hq, D] and [Tk, Hkv, D]
};
StructuralZeros structural_zeros(const Mask& mask, int32_t heads_q, int32_t heads_kv, int32_t dim);

// SPEC section 5 on a case's forward outputs (out, lse, and max_logits when the config asks for it); rows that
// keep no key must be exactly 0.
testing::AssertionResult judge_forward(const CaseData& data, const CaseConfig& config, const EngineResult& result,
                                       std::string_view context);
// ... and on its gradients, on the backward's own inputs: Delta from result.out (the out it was given; see
// naive_attention.hpp), dq / dk whose terms cancel judged against their size (check_grad_cancelling), dsink
// against its terms; rows and keys that are zero by structure exactly 0. `dq_start`: what dq held before an
// accumulating backward (accumulate_dq), taken off before judging.
testing::AssertionResult judge_backward(const CaseData& data, const CaseConfig& config, const EngineResult& result,
                                        std::string_view context, const std::vector<double>& dq_start = {});

// Forward (and backward when config.backward) against the reference; every tensor judged.
testing::AssertionResult check_case(const Mask& mask, const CaseConfig& config, uint64_t seed,
                                    std::string_view case_name);

// A named engine case for parameterised tests. Masks are built from the case's seed (random masks).
using MaskFactory = std::function<Mask(std::mt19937_64&)>;
MaskFactory fixed_mask(Mask mask);
MaskFactory random_rectangles_mask(int32_t total_q, int32_t total_k, int32_t slices);

struct EngineCase {
  std::string name;  // [A-Za-z0-9_], used as the gtest parameter name
  MaskFactory mask;
  CaseConfig config;
  friend void PrintTo(const EngineCase& c, std::ostream* os) { *os << c.name; }
};
// "<mask>_<dtype>_h<Hq>x<Hkv>_d<D>[_softcap][_sink<layout>][_fp32out][_reference]"
std::string case_name(std::string_view mask_name, const CaseConfig& config);
CaseConfig config_for(DType dtype, int32_t heads_q, int32_t heads_kv, int32_t head_dim);
// Draws a fresh seed, builds the mask and runs check_case.
testing::AssertionResult run_engine_case(const EngineCase& c);
// A random case for fuzzing: random grid (1..max_tokens), slice count, heads, head dim, dtype and
// features, drawn from `rng`.
EngineCase random_engine_case(std::mt19937_64& rng, int32_t max_tokens, bool backward);

// For INSTANTIATE_TEST_SUITE_P's name generator.
struct EngineCaseName {
  std::string operator()(const testing::TestParamInfo<EngineCase>& info) const { return info.param.name; }
};

}  // namespace magi::test
