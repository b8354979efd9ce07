// ForwardArgs::prev_out / prev_lse: attention over keys that arrive in two parts, the second call merging
// the first part's partial result, must match the whole mask (SPEC section 5 bounds against the fp64
// reference), in place and into a 16-bit out; bad partial-result arguments are refused by name.
// BackwardArgs::accumulate_dq: the backward of the two key parts, the second adding into the first's dq,
// must give the whole mask's dq; a non-fp32 or overlapping dq is refused.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "magi/attention.hpp"
#include "magi/error.hpp"
#include "reference/attention_check.hpp"
#include "reference/key_parts.hpp"
#include "reference/compare.hpp"

namespace magi::test {
namespace {

struct Split {
  Mask first, second;
};

Split split_keys(const Mask& mask, std::mt19937_64& rng) {
  const auto at = static_cast<int32_t>(rng() % static_cast<uint64_t>(mask.total_k + 1));
  return {keys_between(mask, 0, at), keys_between(mask, at, mask.total_k)};
}

TEST(PartialMerge, TwoKeyPartsMatchTheWholeMask) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  int index = 0;
  for (DType dtype : {DType::F32, DType::BF16, DType::F64}) {
    for (bool in_place : {true, false}) {
      CaseConfig c = config_for(dtype, 4, 2, 64);
      c.backward = false;
      c.max_logits = false;
      if (index % 2 == 0) c.sink_layout = SinkLayout::SH;
      const Mask mask = random_rectangles(rng, 150 + static_cast<int32_t>(rng() % 100), 200, 12);
      const Split parts = split_keys(mask, rng);
      CaseData data = make_case(mask, c, seed + index);
      const ReferenceForward expected = reference_forward(data.problem);
      const std::string context = "seed " + std::to_string(seed) + ", " + c.describe() +
                                  (in_place ? ", in place" : ", into out");
      const int64_t tq = mask.total_q, hq = c.heads_q, d = c.head_dim;

      const DType part = dtype == DType::F64 ? DType::F64 : DType::F32;  // fp64 partials keep fp64 exact
      HostTensor part_out = HostTensor::poisoned(part, {tq, hq, d});
      HostTensor part_lse = HostTensor::poisoned(part, {tq, hq});
      ForwardArgs first;
      first.q = data.q.view();
      first.k = data.k.view();
      first.v = data.v.view();
      first.sink = data.sink.view();  // the sink belongs to exactly one part
      first.out = part_out.view();
      first.lse = part_lse.view();
      forward(parts.first, first, c.options());

      AttentionOptions second_options = c.options();
      second_options.sink_layout = SinkLayout::None;
      HostTensor out = in_place ? HostTensor() : HostTensor::poisoned(c.out_dtype(), {tq, hq, d});
      HostTensor lse = in_place ? HostTensor() : HostTensor::poisoned(part, {tq, hq});
      ForwardArgs second;
      second.q = first.q;
      second.k = first.k;
      second.v = first.v;
      second.out = in_place ? part_out.view() : out.view();
      second.lse = in_place ? part_lse.view() : lse.view();
      second.prev_out = part_out.view();
      second.prev_lse = part_lse.view();
      forward(parts.second, second, second_options);

      const HostTensor& got_out = in_place ? part_out : out;
      const HostTensor& got_lse = in_place ? part_lse : lse;
      EXPECT_TRUE(check_close("out", got_out.values(), expected.out, Quantity::Out, dtype, context));
      EXPECT_TRUE(check_close("lse", got_lse.values(), expected.lse, Quantity::Lse, dtype, context));
      ++index;
    }
  }
}

TEST(PartialMerge, BadPartialResultsAreRefusedByName) {
  const Mask mask = masks::causal(64, 64);
  CaseConfig c = config_for(DType::BF16, 2, 2, 64);
  CaseData data = make_case(mask, c, 7);
  HostTensor out(DType::BF16, {64, 2, 64}), lse(DType::F32, {64, 2});
  HostTensor prev_out(DType::F32, {64, 2, 64}), prev_lse(DType::F32, {64, 2});
  HostTensor bf16_prev(DType::BF16, {64, 2, 64}), short_lse(DType::F32, {63, 2});
  auto args = [&] {
    ForwardArgs a;
    a.q = data.q.view();
    a.k = data.k.view();
    a.v = data.v.view();
    a.out = out.view();
    a.lse = lse.view();
    return a;
  };
  auto expect_refused = [&](const ForwardArgs& a, const std::string& needle) {
    const std::string message = invalid_argument_message([&] { forward(mask, a, c.options()); });
    EXPECT_NE(message.find(needle), std::string::npos) << message;
  };
  ForwardArgs only_out = args();
  only_out.prev_out = prev_out.view();
  expect_refused(only_out, "prev_lse");
  ForwardArgs wrong_dtype = args();
  wrong_dtype.prev_out = bf16_prev.view();
  wrong_dtype.prev_lse = prev_lse.view();
  expect_refused(wrong_dtype, "prev_out");
  ForwardArgs wrong_shape = args();
  wrong_shape.prev_out = prev_out.view();
  wrong_shape.prev_lse = short_lse.view();
  expect_refused(wrong_shape, "prev_lse");
  ForwardArgs aliased_16bit = args();  // a bf16 out cannot be its own fp32 partial result
  aliased_16bit.prev_out = TensorView(out.view().data, DType::F32, {64, 2, 64}, out.view().device);
  aliased_16bit.prev_lse = prev_lse.view();
  expect_refused(aliased_16bit, "prev_out");
  HostTensor f64_prev(DType::F64, {64, 2, 64}), f64_lse(DType::F64, {64, 2});
  ForwardArgs fp64_partial = args();  // fp64 partials only for fp64 inputs
  fp64_partial.prev_out = f64_prev.view();
  fp64_partial.prev_lse = f64_lse.view();
  expect_refused(fp64_partial, "prev_out");
}

TEST(AccumulateDq, TwoKeyPartsSumToTheWholeMasksDq) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  int index = 0;
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (bool deterministic : {false, true}) {
      CaseConfig c = config_for(dtype, 4, 2, 64);
      c.fp32_outputs = dtype != DType::F32;
      c.max_logits = false;
      c.deterministic = deterministic;
      const Mask mask = random_rectangles(rng, 150 + static_cast<int32_t>(rng() % 100), 200, 12);
      const Split parts = split_keys(mask, rng);
      CaseData data = make_case(mask, c, seed + index);
      const ReferenceGrads expected = reference_backward(data.problem, data.dout);
      EngineResult whole = run_forward(data, c);  // the parts' backward needs the whole out and lse
      const std::string context = "seed " + std::to_string(seed) + ", " + c.describe();

      HostTensor dq = HostTensor::poisoned(DType::F32, data.q.shape());
      HostTensor dk = HostTensor::poisoned(c.dk_dtype(), data.k.shape());
      HostTensor dv = HostTensor::poisoned(c.dv_dtype(), data.v.shape());
      BackwardArgs b;
      b.q = data.q.view();
      b.k = data.k.view();
      b.v = data.v.view();
      b.out = whole.out.view();
      b.lse = whole.lse.view();
      b.dout = data.dout_tensor.view();
      b.dq = dq.view();
      b.dk = dk.view();
      b.dv = dv.view();
      backward(parts.first, b, c.options());
      b.accumulate_dq = true;
      backward(parts.second, b, c.options());
      EXPECT_TRUE(check_close("dq", dq.values(), expected.dq, Quantity::Grad, dtype, context));
      ++index;
    }
  }
}

TEST(AccumulateDq, NonFp32OrOverlappingDqIsRefused) {
  const Mask mask = masks::causal(64, 64);
  CaseConfig c = config_for(DType::BF16, 2, 2, 64);
  CaseData data = make_case(mask, c, 7);
  HostTensor out(DType::BF16, {64, 2, 64}), lse(DType::F32, {64, 2});
  HostTensor dq16(DType::BF16, {64, 2, 64});
  HostTensor dk(DType::BF16, {64, 2, 64}), dv(DType::BF16, {64, 2, 64});
  BackwardArgs b;
  b.q = data.q.view();
  b.k = data.k.view();
  b.v = data.v.view();
  b.out = out.view();
  b.lse = lse.view();
  b.dout = out.view();
  b.dk = dk.view();
  b.dv = dv.view();
  b.accumulate_dq = true;
  auto expect_refused = [&](const BackwardArgs& a, const std::string& needle) {
    const std::string message = invalid_argument_message([&] { backward(mask, a, c.options()); });
    EXPECT_NE(message.find(needle), std::string::npos) << message;
  };
  BackwardArgs bf16_dq = b;
  bf16_dq.dq = dq16.view();
  expect_refused(bf16_dq, "accumulate_dq needs an fp32 dq");
  HostTensor dv32(DType::F32, {64, 2, 64});
  BackwardArgs dq_is_dv = b;  // dq and dv the same fp32 buffer
  dq_is_dv.dv = dv32.view();
  dq_is_dv.dq = dv32.view();
  expect_refused(dq_is_dv, "dq: overlaps dv");
}

}  // namespace
}  // namespace magi::test
