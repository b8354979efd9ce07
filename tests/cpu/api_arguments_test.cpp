// Bad arguments to magi::forward / magi::backward: InvalidArgument whose message names the argument, and
// nothing written to the outputs (validation happens before any compute).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "magi/attention.hpp"
#include "magi/error.hpp"
#include "reference/attention_check.hpp"

namespace magi::test {
namespace {

bool all_nan(const HostTensor& t) {
  for (double x : t.values())
    if (!std::isnan(x)) return false;
  return true;
}

// A valid small problem whose pieces each test breaks one at a time.
class ApiArguments : public testing::Test {
 protected:
  void SetUp() override {
    config_ = config_for(DType::BF16, 4, 2, 32);
    config_.sink_layout = SinkLayout::SH;
    mask_ = Mask{{make_slice(0, 24, 0, 20, MaskType::Causal)}, 24, 20};
    data_ = make_case(mask_, config_, fresh_seed());
    out_ = HostTensor::poisoned(DType::BF16, {24, 4, 32});
    lse_ = HostTensor::poisoned(DType::F32, {24, 4});
    options_ = config_.options();
  }
  ForwardArgs forward_args() {
    ForwardArgs a;
    a.q = data_.q.view();
    a.k = data_.k.view();
    a.v = data_.v.view();
    a.sink = data_.sink.view();
    a.out = out_.view();
    a.lse = lse_.view();
    return a;
  }
  // Expects forward(args) to throw naming `argument`, with out and lse left untouched.
  void expect_forward_rejects(const ForwardArgs& args, const std::string& argument, const Mask* mask = nullptr) {
    const std::string message =
        invalid_argument_message([&] { magi::forward(mask ? *mask : mask_, args, options_); });
    EXPECT_NE(message.find(argument), std::string::npos) << "expected a message naming '" << argument << "', got: " << message;
    EXPECT_NE(message.rfind("<", 0), 0u) << message;
    EXPECT_TRUE(all_nan(out_)) << "out was written although the call was rejected (" << argument << ")";
    EXPECT_TRUE(all_nan(lse_)) << "lse was written although the call was rejected (" << argument << ")";
  }

  CaseConfig config_;
  Mask mask_;
  CaseData data_;
  HostTensor out_, lse_;
  AttentionOptions options_;
};

TEST_F(ApiArguments, ValidCallSucceeds) {
  ForwardArgs a = forward_args();
  EXPECT_NO_THROW(magi::forward(mask_, a, options_));
  EXPECT_FALSE(all_nan(lse_));
}

TEST_F(ApiArguments, ShapesAndDtypesOfInputs) {
  HostTensor q3 = HostTensor::from_values({}, DType::BF16, {24, 4 * 32});
  ForwardArgs a = forward_args();
  a.q = q3.view();
  expect_forward_rejects(a, "q:");

  HostTensor k_f16 = HostTensor::from_values(data_.problem.k, DType::F16, {20, 2, 32});
  a = forward_args();
  a.k = k_f16.view();
  expect_forward_rejects(a, "k, v");

  HostTensor v_short = HostTensor::from_values({}, DType::BF16, {19, 2, 32});
  a = forward_args();
  a.v = v_short.view();
  expect_forward_rejects(a, "v:");

  HostTensor k3 = HostTensor::from_values({}, DType::BF16, {20, 3, 32}), v3 = HostTensor::from_values({}, DType::BF16, {20, 3, 32});
  a = forward_args();
  a.k = k3.view();
  a.v = v3.view();
  expect_forward_rejects(a, "Hkv");  // 4 query heads are not a multiple of 3

  HostTensor q12 = HostTensor::from_values({}, DType::BF16, {24, 4, 12});
  HostTensor k12 = HostTensor::from_values({}, DType::BF16, {20, 2, 12}), v12 = HostTensor::from_values({}, DType::BF16, {20, 2, 12});
  a = forward_args();
  a.q = q12.view();
  a.k = k12.view();
  a.v = v12.view();
  expect_forward_rejects(a, "head dim");  // head dim 12 is not a multiple of 8
}

TEST_F(ApiArguments, OutputsAndMask) {
  HostTensor out_f16 = HostTensor::poisoned(DType::F16, {24, 4, 32});
  ForwardArgs a = forward_args();
  a.out = out_f16.view();
  expect_forward_rejects(a, "out:");

  HostTensor lse_wrong = HostTensor::poisoned(DType::F32, {24, 2});
  a = forward_args();
  a.lse = lse_wrong.view();
  expect_forward_rejects(a, "lse:");

  HostTensor lse_f64 = HostTensor::poisoned(DType::F64, {24, 4});  // fp64 lse only for fp64 inputs
  a = forward_args();
  a.lse = lse_f64.view();
  expect_forward_rejects(a, "lse:");

  HostTensor max_logits = HostTensor::poisoned(DType::F32, {2});
  a = forward_args();
  a.max_logits = max_logits.view();
  expect_forward_rejects(a, "max_logits:");

  const Mask wrong_totals{{make_slice(0, 24, 0, 20, MaskType::Causal)}, 24, 21};
  expect_forward_rejects(forward_args(), "mask", &wrong_totals);
  // A mask whose ranges end before the last rows (totals inferred from the ranges) is told how to cover them.
  const Mask short_totals{{make_slice(0, 20, 0, 20, MaskType::Causal)}, 20, 20};
  expect_forward_rejects(forward_args(), "give total_q / total_k", &short_totals);
  const Mask out_of_range{{make_slice(0, 25, 0, 20, MaskType::Full)}, 24, 20};
  expect_forward_rejects(forward_args(), "slice 0", &out_of_range);
  const Mask overlapping{{make_slice(0, 12, 0, 20, MaskType::Full), make_slice(10, 24, 5, 10, MaskType::Full)}, 24, 20};
  expect_forward_rejects(forward_args(), "overlap", &overlapping);
}

TEST_F(ApiArguments, SinkAndOptions) {
  ForwardArgs a = forward_args();
  a.sink = {};
  expect_forward_rejects(a, "sink");  // layout sh but no sink

  HostTensor sink_bf16 = HostTensor::from_values(data_.problem.sink, DType::BF16, {2, 4});
  a = forward_args();
  a.sink = sink_bf16.view();
  expect_forward_rejects(a, "sink");

  options_.sink_layout = SinkLayout::SSH;  // an [S, Hq] sink is not [Tq, S, Hq]
  expect_forward_rejects(forward_args(), "sink");

  options_ = config_.options();
  options_.sink_layout = SinkLayout::None;  // a sink given without a layout
  expect_forward_rejects(forward_args(), "sink");

  options_ = config_.options();
  options_.softcap = -1.0;
  expect_forward_rejects(forward_args(), "softcap");
  options_.softcap = 4e38;  // past fp32's largest: the kernels' s / softcap would be 0 and out NaN
  expect_forward_rejects(forward_args(), "softcap must be finite and >= 0 (0 = off, at most 3.4e38");
  options_ = config_.options();
  options_.softmax_scale = std::numeric_limits<double>::quiet_NaN();
  expect_forward_rejects(forward_args(), "softmax_scale");
  options_.softmax_scale = -1e39;  // past fp32's largest: the kernels' scale would be inf and out NaN
  expect_forward_rejects(forward_args(), "softmax_scale must be finite and at most 3.4e38 in magnitude");
  options_ = config_.options();
  options_.num_threads = -2;
  expect_forward_rejects(forward_args(), "num_threads");
  options_.num_threads = 100000;  // OpenMP's runtime crashed there
  expect_forward_rejects(forward_args(), "num_threads: 100000 (allowed: 0 = all cores, 1 .. 1024)");
  // Enum values outside the enums (a cast from an integer): named, not taken for a neighbour.
  options_ = config_.options();
  options_.sink_layout = static_cast<SinkLayout>(7);
  expect_forward_rejects(forward_args(), "options.sink_layout: unknown value 7 (allowed: none, sh, ssh)");
  options_ = config_.options();
  options_.backend = static_cast<Backend>(9);
  expect_forward_rejects(forward_args(), "options.backend: unknown value 9");
  options_ = config_.options();
}

// Outputs that share memory with each other or with an input would be read while written: refused, naming both.
TEST_F(ApiArguments, OverlappingOutputs) {
  ForwardArgs a = forward_args();
  HostTensor big = HostTensor::poisoned(DType::F32, {24, 4, 32});
  a.out = big.view();
  a.lse = TensorView(big.view().data, DType::F32, {24, 4});  // lse inside out's memory
  expect_forward_rejects(a, "out: overlaps lse");
  a = forward_args();
  a.out = TensorView(data_.k.view().data, DType::BF16, {24, 4, 32});  // out over k's bytes (and past them)
  const std::string message = invalid_argument_message([&] { magi::forward(mask_, a, options_); });
  EXPECT_NE(message.find("out: overlaps the input "), std::string::npos) << message;
  a = forward_args();
  a.max_logits = TensorView(lse_.view().data, DType::F32, {4});
  expect_forward_rejects(a, "lse: overlaps max_logits");
}

// Sizes whose element count does not fit int64 (numel would wrap) are refused before any pointer is read.
TEST_F(ApiArguments, ShapesBeyondInt64) {
  ForwardArgs a = forward_args();
  a.q = TensorView(data_.q.view().data, DType::BF16, {int64_t{1} << 20, int64_t{1} << 20, int64_t{1} << 24});
  expect_forward_rejects(a, "q: [1048576, 1048576, 16777216] holds more bytes than fit in int64");
}

// A hand-set ndim outside [1, kMaxDims] was read past TensorView::shape (a crash at 100000); a 5-dim TensorView wrote
// its fifth extent over `device`; an unknown device type was called a CUDA device.
TEST_F(ApiArguments, NdimAndDeviceOutsideTheirRanges) {
  for (const int32_t ndim : {5, -1, 100000}) {
    ForwardArgs a = forward_args();
    a.q.ndim = ndim;
    expect_forward_rejects(a, "q: ndim " + std::to_string(ndim) + " (allowed: 1 .. 4)");
    a = forward_args();
    a.lse.ndim = ndim;
    expect_forward_rejects(a, "lse: ndim " + std::to_string(ndim));
    a = forward_args();
    a.sink.ndim = ndim;
    expect_forward_rejects(a, "sink: ndim");
  }
  TensorView odd = out_.view();
  odd.ndim = 9;
  EXPECT_EQ(shape_string(odd), "[24, 4, 32, 0, ... (ndim 9)]");
  const std::string message = invalid_argument_message([] { TensorView t(nullptr, DType::F32, {1, 2, 3, 4, 5}); });
  EXPECT_NE(message.find("TensorView: 5 dimensions (allowed: at most 4)"), std::string::npos) << message;

  ForwardArgs a = forward_args();
  for (TensorView* t : {&a.q, &a.k, &a.v, &a.sink, &a.out, &a.lse}) t->device.type = static_cast<DeviceType>(5);
  expect_forward_rejects(a, "q: unknown device type 5 (allowed: CPU, CUDA)");
}

// The kernels hold softcap in fp32: below fp32's smallest normal it was 0 there, and the softcap silently off.
TEST_F(ApiArguments, SoftcapBelowFp32sSmallestNormal) {
  options_.softcap = 1e-39;
  expect_forward_rejects(forward_args(), "softcap must be 0 (off) or at least 1.2e-38 (fp32's smallest normal), got 1e-39");
  options_.softcap = 1e-320;
  expect_forward_rejects(forward_args(), "softcap must be 0 (off)");
  options_.softcap = 4e38;  // numbers in messages are short
  expect_forward_rejects(forward_args(), "got 4e+38");
  options_.softcap = std::numeric_limits<float>::min();
  EXPECT_NO_THROW(magi::forward(mask_, forward_args(), options_));
}

TEST_F(ApiArguments, BackwardGradientsAndDsink) {
  ForwardArgs fa = forward_args();
  magi::forward(mask_, fa, options_);
  HostTensor dq = HostTensor::poisoned(DType::BF16, {24, 4, 32}), dk = HostTensor::poisoned(DType::BF16, {20, 2, 32}),
             dv = HostTensor::poisoned(DType::BF16, {20, 2, 32}), dsink = HostTensor::poisoned(DType::F32, {2, 4});
  auto backward_args = [&] {
    BackwardArgs b;
    b.q = data_.q.view();
    b.k = data_.k.view();
    b.v = data_.v.view();
    b.out = out_.view();
    b.lse = lse_.view();
    b.dout = data_.dout_tensor.view();
    b.sink = data_.sink.view();
    b.dq = dq.view();
    b.dk = dk.view();
    b.dv = dv.view();
    b.dsink = dsink.view();
    return b;
  };
  auto expect_rejects = [&](const BackwardArgs& b, const std::string& argument) {
    const std::string message = invalid_argument_message([&] { magi::backward(mask_, b, options_); });
    EXPECT_NE(message.find(argument), std::string::npos) << "expected a message naming '" << argument << "', got: " << message;
    EXPECT_TRUE(all_nan(dq) && all_nan(dk) && all_nan(dv) && all_nan(dsink)) << "gradients written although rejected";
  };
  BackwardArgs b = backward_args();
  b.dsink = {};
  expect_rejects(b, "dsink");
  HostTensor dq_wrong = HostTensor::poisoned(DType::BF16, {24, 2, 32});
  b = backward_args();
  b.dq = dq_wrong.view();
  expect_rejects(b, "dq:");
  HostTensor dk_f16 = HostTensor::poisoned(DType::F16, {20, 2, 32});
  b = backward_args();
  b.dk = dk_f16.view();
  expect_rejects(b, "dk:");
  HostTensor dout_f64 = HostTensor::poisoned(DType::F64, {24, 4, 32});
  b = backward_args();
  b.dout = dout_f64.view();
  expect_rejects(b, "dout:");

  // Gradients sharing memory: with each other or with an input.
  HostTensor dkv = HostTensor::poisoned(DType::BF16, {20, 2, 32});
  b = backward_args();
  b.dk = b.dv = dkv.view();
  expect_rejects(b, "dk: overlaps dv");
  b = backward_args();
  b.dq = TensorView(data_.dout_tensor.view().data, DType::BF16, {24, 4, 32});
  const std::string message = invalid_argument_message([&] { magi::backward(mask_, b, options_); });
  EXPECT_NE(message.find("dq: overlaps the input dout"), std::string::npos) << message;
  // A dsink whose unused shape entries past its rank hold garbage is still the sink's shape.
  BackwardArgs odd = backward_args();
  odd.dsink.shape[2] = 99;
  EXPECT_NO_THROW(magi::backward(mask_, odd, options_));

  EXPECT_NO_THROW(magi::backward(mask_, backward_args(), options_));
  EXPECT_FALSE(all_nan(dsink));
}

}  // namespace
}  // namespace magi::test
