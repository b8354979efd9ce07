// The CPU engine behind the API edge: plans cached per (mask, shapes), partial results merged and dq
// accumulated around the engine's own forward / backward.
#include <vector>

#include "api/engine.hpp"
#include "common/lse_merge.hpp"
#include "cpu/engine.hpp"
#include "cpu/pack.hpp"
#include "cpu/plan.hpp"

namespace magi::api {
namespace {

class CpuEngine final : public Engine {
 public:
  void forward(const Mask& mask, const ForwardArgs& a, const Call& call) const override {
    const auto plan = plan_for(mask, call);
    if (a.prev_out.ndim != 0) forward_merged(*plan, a, options(call), call.shapes);
    else cpu::forward(*plan, a, options(call));
  }

  void backward(const Mask& mask, const BackwardArgs& a, const Call& call) const override {
    const auto plan = plan_for(mask, call);
    if (a.accumulate_dq) backward_accumulating(*plan, a, options(call), call.shapes);
    else cpu::backward(*plan, a, options(call));
  }

  int32_t exact_merge_multiple() const override { return cpu::kTileMultiple; }

 private:
  static cpu::EngineOptions options(const Call& call) {
    cpu::EngineOptions e;
    e.softmax_scale = call.softmax_scale;
    e.softcap = call.softcap;
    e.sink_layout = call.sink_layout;
    e.accumulate_fp64 = call.exact;
    e.num_threads = call.num_threads;
    return e;
  }

  std::shared_ptr<const cpu::Plan> plan_for(const Mask& mask, const Call& call) const {
    const Shapes& s = call.shapes;
    return cached_plan(plans_, mask, call, -1,
                       [&](const Mask& planned) { return cpu::make_plan(planned, s.hq, s.hkv, s.d); });
  }

  // With a partial result to merge: compute into scratch, then merge row by row (SPEC lse merge). The scratch
  // is fp32 (fp64 for fp64 inputs) whatever out / lse are, so the merge sees this call's result unrounded.
  static void forward_merged(const cpu::Plan& plan, const ForwardArgs& a, const cpu::EngineOptions& eo,
                             const Shapes& s) {
    const int64_t rows = s.tq * s.hq;
    const DType part = a.q.dtype == DType::F64 ? DType::F64 : DType::F32;
    std::vector<unsigned char> out_bytes(static_cast<size_t>(rows * s.d * dtype_size(part))),
        lse_bytes(static_cast<size_t>(rows * dtype_size(part)));
    ForwardArgs scratch = a;
    scratch.out = TensorView(out_bytes.data(), part, {s.tq, s.hq, s.d}, a.out.device);
    scratch.lse = TensorView(lse_bytes.data(), part, {s.tq, s.hq}, a.lse.device);
    scratch.prev_out = scratch.prev_lse = TensorView();
    cpu::forward(plan, scratch, eo);
    const int d = static_cast<int>(s.d);
#pragma omp parallel for schedule(static) num_threads(cpu::resolve_threads(eo.num_threads))
    for (int64_t rh = 0; rh < rows; ++rh) {
      std::vector<double> mine(static_cast<size_t>(d)), prev(static_cast<size_t>(d));
      double lse_mine = 0, lse_prev = 0;
      cpu::load_row<double>(scratch.lse, rh, 1, 1.0, &lse_mine);
      cpu::load_row<double>(a.prev_lse, rh, 1, 1.0, &lse_prev);
      const MergeWeights<double> w = merge_weights(lse_mine, lse_prev);
      cpu::load_row<double>(scratch.out, rh * d, d, 1.0, mine.data());
      cpu::load_row<double>(a.prev_out, rh * d, d, 1.0, prev.data());
      for (int i = 0; i < d; ++i)
        mine[i] = (w.w1 == 0 ? 0.0 : w.w1 * mine[i]) + (w.w2 == 0 ? 0.0 : w.w2 * prev[i]);
      cpu::store_row<double>(mine.data(), 1.0, a.out, rh * d, d);
      cpu::store_row<double>(&w.lse, 1.0, a.lse, rh, 1);
    }
  }

  // Adding into dq: compute dq into scratch, then add (fp32 in, fp32 out; sums in double).
  static void backward_accumulating(const cpu::Plan& plan, const BackwardArgs& a, const cpu::EngineOptions& eo,
                                    const Shapes& s) {
    const int64_t n = s.tq * s.hq * s.d;
    std::vector<float> part(static_cast<size_t>(n));
    BackwardArgs scratch = a;
    scratch.dq = TensorView(part.data(), DType::F32, {s.tq, s.hq, s.d}, a.dq.device);
    scratch.accumulate_dq = false;
    cpu::backward(plan, scratch, eo);
    float* dq = static_cast<float*>(a.dq.data);
#pragma omp parallel for schedule(static) num_threads(cpu::resolve_threads(eo.num_threads))
    for (int64_t i = 0; i < n; ++i) dq[i] = static_cast<float>(double{dq[i]} + part[static_cast<size_t>(i)]);
  }

  mutable LruCache<PlanKey, const cpu::Plan> plans_{kPlanCacheCapacity};
};

}  // namespace

const Engine& cpu_engine() {
  static const CpuEngine engine;
  return engine;
}

}  // namespace magi::api
