// Device-side helpers for the CUDA backend tests and benchmarks: owning device buffers and one call of
// the portable backend on a test case, judged against the fp64 reference.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cuda/backend.hpp"
#include "magi/env.hpp"
#include "reference/attention_check.hpp"
#include "reference/compare.hpp"

namespace magi::test {

#define MAGI_CUDA_CHECK(expr)                                                                       \
  do {                                                                                              \
    const cudaError_t err_ = (expr);                                                                \
    if (err_ != cudaSuccess) throw std::runtime_error(std::string(#expr) + ": " + cudaGetErrorString(err_)); \
  } while (0)

// A device copy of a HostTensor (same dtype and shape).
class DeviceTensor {
 public:
  DeviceTensor() = default;
  explicit DeviceTensor(const HostTensor& host) : dtype_(host.dtype()), shape_(host.shape()) {
    if (!host.defined()) return;
    bytes_ = host.bytes().size();
    MAGI_CUDA_CHECK(cudaMalloc(&data_, bytes_ + 16));
    MAGI_CUDA_CHECK(cudaMemcpy(data_, host.bytes().data(), bytes_, cudaMemcpyHostToDevice));
    landed();
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  DeviceTensor(DeviceTensor&& other) noexcept { *this = std::move(other); }
  DeviceTensor& operator=(DeviceTensor&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    dtype_ = other.dtype_;
    shape_ = other.shape_;
    return *this;
  }
  ~DeviceTensor() { cudaFree(data_); }

  // Overwrites the device copy with `host` (same size), e.g. NaN poison before a run.
  void upload(const HostTensor& host) {
    MAGI_CUDA_CHECK(cudaMemcpy(data_, host.bytes().data(), bytes_, cudaMemcpyHostToDevice));
    landed();
  }
  HostTensor download() const {
    HostTensor host(dtype_, shape_);
    if (bytes_) MAGI_CUDA_CHECK(cudaMemcpy(host.view().data, data_, bytes_, cudaMemcpyDeviceToHost));
    return host;
  }
  TensorView view() const {
    if (shape_.empty()) return {};
    TensorView v;
    v.data = data_;
    v.dtype = dtype_;
    v.ndim = static_cast<int32_t>(shape_.size());
    for (size_t i = 0; i < shape_.size(); ++i) v.shape[i] = shape_[i];
    v.device = Device{DeviceType::CUDA, 0};
    return v;
  }
  bool defined() const { return !shape_.empty(); }

 private:
  // A copy from pageable memory may return before its bytes reach the device; a call on a non-blocking stream
  // would not wait for them.
  static void landed() { MAGI_CUDA_CHECK(cudaDeviceSynchronize()); }

  void* data_ = nullptr;
  size_t bytes_ = 0;
  DType dtype_ = DType::F32;
  std::vector<int64_t> shape_;
};

// deterministic: the two-kernel backward (bitwise reproducible); otherwise dq by fp32 atomics (default).
// The forward kernel family under test: ctest runs the CUDA suites once per family (MAGI_ATTENTION_KERNEL_BACKEND
// = ffa_sm80 / ffa_sm90); unset, the device's default.
inline cuda::KernelFamily family_under_test() {
  switch (env::kernel_family()) {
    case env::KernelFamily::Sm80: return cuda::KernelFamily::Sm80;
    case env::KernelFamily::Sm90: return cuda::KernelFamily::Sm90;
    default: return cuda::KernelFamily::Auto;
  }
}
// Unset, the Hopper forward runs where the device and some built tile allow it (a build may lack tile 128).
inline bool testing_sm90() {
  if (family_under_test() != cuda::KernelFamily::Auto) return family_under_test() == cuda::KernelFamily::Sm90;
  for (int32_t d : {64, 128, 256})
    if (cuda::head_dim_supported(d) && cuda::sm90_forward_available(d, 0)) return true;
  return false;
}
// A plan of the family under test (tuning's other choices kept), with concatenated heads where
// MAGI_ATTENTION_CATGQA asks for them (ctest runs the Hopper backward's suites once more so).
inline std::shared_ptr<cuda::Plan> test_plan(const Mask& mask, int32_t hq, int32_t hkv, int32_t d,
                                             cuda::PlanTuning tuning = {}) {
  if (tuning.forward_family == cuda::KernelFamily::Auto) tuning.forward_family = family_under_test();
  if (tuning.backward_family == cuda::KernelFamily::Auto) tuning.backward_family = family_under_test();
  if (env::get_bool("MAGI_ATTENTION_CATGQA")) tuning.backward_cat_gqa = true;
  return cuda::make_plan(mask, hq, hkv, d, 0, tuning);
}

inline cuda::Options cuda_options(const CaseConfig& c, bool deterministic = false) {
  cuda::Options o;
  o.softmax_scale = c.softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  o.softcap = c.softcap;
  o.sink_layout = c.sink_layout;
  o.deterministic = deterministic;
  return o;
}

// All device buffers of one case; outputs NaN-poisoned at construction and by poison().
struct DeviceCase {
  DeviceTensor q, k, v, sink, dout;
  DeviceTensor out, lse, max_logits, dq, dk, dv, dsink;

  DeviceCase(const CaseData& d, const CaseConfig& c)
      : q(d.q), k(d.k), v(d.v), sink(d.sink), dout(d.dout_tensor),
        out(HostTensor::poisoned(c.out_dtype(), {d.mask.total_q, c.heads_q, c.head_dim})),
        lse(HostTensor::poisoned(c.lse_dtype(), {d.mask.total_q, c.heads_q})),
        max_logits(c.max_logits ? HostTensor::poisoned(DType::F32, {c.heads_q}) : HostTensor()),
        dq(HostTensor::poisoned(c.dq_dtype(), d.q.shape())),
        dk(HostTensor::poisoned(c.dk_dtype(), d.k.shape())),
        dv(HostTensor::poisoned(c.dv_dtype(), d.v.shape())),
        dsink(d.sink.defined() ? HostTensor::poisoned(DType::F32, d.sink.shape()) : HostTensor()) {}

  void poison() {
    for (DeviceTensor* t : {&out, &lse, &max_logits, &dq, &dk, &dv, &dsink}) {
      if (!t->defined()) continue;
      HostTensor nan = t->download();
      nan = HostTensor::poisoned(nan.dtype(), nan.shape());
      t->upload(nan);
    }
  }
  ForwardArgs forward_args() const {
    ForwardArgs a;
    a.q = q.view();
    a.k = k.view();
    a.v = v.view();
    a.sink = sink.view();
    a.out = out.view();
    a.lse = lse.view();
    a.max_logits = max_logits.view();
    return a;
  }
  BackwardArgs backward_args() const {
    BackwardArgs a;
    a.q = q.view();
    a.k = k.view();
    a.v = v.view();
    a.out = out.view();
    a.lse = lse.view();
    a.dout = dout.view();
    a.sink = sink.view();
    a.dq = dq.view();
    a.dk = dk.view();
    a.dv = dv.view();
    a.dsink = dsink.view();
    return a;
  }
  // The outputs, downloaded for judge_forward / judge_backward (those the case has no buffer for stay empty).
  EngineResult download() const {
    EngineResult r;
    const std::pair<const DeviceTensor*, HostTensor*> all[] = {{&out, &r.out}, {&lse, &r.lse}, {&max_logits, &r.max_logits},
                                                               {&dq, &r.dq},   {&dk, &r.dk},   {&dv, &r.dv},
                                                               {&dsink, &r.dsink}};
    for (const auto& [from, to] : all)
      if (from->defined()) *to = from->download();
    return r;
  }
  // Every output, downloaded (for bitwise comparisons).
  std::vector<std::pair<std::string, HostTensor>> results() const {
    std::vector<std::pair<std::string, HostTensor>> r;
    const std::pair<const char*, const DeviceTensor*> all[] = {{"out", &out}, {"lse", &lse}, {"max_logits", &max_logits},
                                                              {"dq", &dq},   {"dk", &dk},   {"dv", &dv},
                                                              {"dsink", &dsink}};
    for (const auto& [name, t] : all)
      if (t->defined()) r.emplace_back(name, t->download());
    return r;
  }
};

// Forward (and backward when config.backward) through the CUDA backend, judged by SPEC section 5.
inline testing::AssertionResult check_cuda_case(const Mask& mask, const CaseConfig& c, uint64_t seed,
                                                std::string_view name, bool deterministic = false,
                                                const cuda::PlanTuning& tuning = {}) {
  std::ostringstream context_stream;
  context_stream << "case " << name << ", " << c.describe() << (deterministic ? ", deterministic" : "")
                 << (tuning.forward_tile_q != 0 ? ", forward tile " + std::to_string(tuning.forward_tile_q) : "")
                 << ", seed " << seed;
  const std::string context = context_stream.str();
  try {
    CaseData d = make_case(mask, c, seed);
    DeviceCase dev(d, c);
    auto plan = test_plan(mask, c.heads_q, c.heads_kv, c.head_dim, tuning);
    const cuda::Options o = cuda_options(c, deterministic);
    cudaStream_t stream = nullptr;
    cuda::forward(*plan, dev.forward_args(), o, stream);
    MAGI_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (auto ok = judge_forward(d, c, dev.download(), context); !ok) return ok;
    if (!c.backward) return testing::AssertionSuccess();
    cuda::backward(*plan, dev.backward_args(), o, stream);
    MAGI_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (auto ok = judge_backward(d, c, dev.download(), context); !ok) return ok;
    return testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "threw: " << e.what() << " [" << context << "]";
  }
}

// The backward alone through the CUDA backend (out and lse from the fp64 reference, rounded to their buffers'
// dtypes), judged by SPEC section 5: for head dims whose forward this build does not have. With `runs` > 1 the
// backward runs again on the same inputs (poisoned gradients) and every gradient must be bitwise the same.
inline testing::AssertionResult check_cuda_backward_case(const Mask& mask, const CaseConfig& c, uint64_t seed,
                                                         std::string_view name, bool deterministic, int runs = 1,
                                                         int sm_margin = 0) {
  std::ostringstream context_stream;
  context_stream << "case " << name << " (backward), " << c.describe() << (deterministic ? ", deterministic" : "")
                 << (sm_margin > 0 ? ", sm margin " + std::to_string(sm_margin) : "") << ", seed " << seed;
  const std::string context = context_stream.str();
  try {
    CaseData d = make_case(mask, c, seed);
    DeviceCase dev(d, c);
    const ReferenceForward ref = reference_forward(d.problem);
    const std::vector<int64_t> rows = {d.mask.total_q, c.heads_q};
    dev.out.upload(HostTensor::from_values(ref.out, c.out_dtype(), {d.mask.total_q, c.heads_q, c.head_dim}));
    dev.lse.upload(HostTensor::from_values(ref.lse, c.lse_dtype(), rows));
    auto plan = test_plan(mask, c.heads_q, c.heads_kv, c.head_dim);
    cuda::Options o = cuda_options(c, deterministic);
    o.sm_margin = sm_margin;  // > 0: the persistent grids
    std::vector<std::pair<std::string, HostTensor>> first;
    for (int run = 0; run < runs; ++run) {
      for (DeviceTensor* t : {&dev.dq, &dev.dk, &dev.dv, &dev.dsink})
        if (t->defined()) t->upload(HostTensor::poisoned(t->download().dtype(), t->download().shape()));
      cuda::backward(*plan, dev.backward_args(), o, nullptr);
      MAGI_CUDA_CHECK(cudaStreamSynchronize(nullptr));
      std::vector<std::pair<std::string, HostTensor>> now = {
          {"dq", dev.dq.download()}, {"dk", dev.dk.download()}, {"dv", dev.dv.download()}};
      if (d.sink.defined()) now.emplace_back("dsink", dev.dsink.download());
      if (run == 0) {
        if (auto ok = judge_backward(d, c, dev.download(), context); !ok) return ok;
        first = std::move(now);
        continue;
      }
      for (size_t i = 0; i < now.size(); ++i)
        if (auto ok = check_bitwise_equal(now[i].first, first[i].second, now[i].second, context); !ok) return ok;
    }
    return testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "threw: " << e.what() << " [" << context << "]";
  }
}

}  // namespace magi::test
