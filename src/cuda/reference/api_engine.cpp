// The exact GPU reference engine behind the API edge (backend reference on device tensors). Its plans hold
// per-call scratch, so they are kept per stream.
#include <utility>

#include "api/engine.hpp"
#include "cuda/reference/reference_engine.hpp"

namespace magi::api {
namespace {

class ReferenceEngine final : public Engine {
 public:
  void forward(const Mask& mask, const ForwardArgs& a, const Call& call) const override {
    if (a.prev_out.ndim != 0)
      throw NotAvailable("prev_out / prev_lse: the GPU reference engine does not merge partial results "
                         "(backends cpu and cuda do)");
    cuda::reference::forward(*plan_for(mask, call, a.q.device.index), a, options(call),
                             static_cast<cudaStream_t>(call.stream));
  }

  void backward(const Mask& mask, const BackwardArgs& a, const Call& call) const override {
    if (a.accumulate_dq)
      throw NotAvailable("accumulate_dq: the GPU reference engine does not accumulate (backends cpu and cuda do)");
    cuda::reference::backward(*plan_for(mask, call, a.q.device.index), a, options(call),
                              static_cast<cudaStream_t>(call.stream));
  }

  // A forward block sums its row's terms per thread in chunks that start where each slice's kept keys start: slices
  // merged side by side move those edges (and the bits), so deterministic mode merges nothing here.
  int32_t exact_merge_multiple() const override { return 0; }

 private:
  static cuda::reference::Options options(const Call& call) {
    return {call.softmax_scale, call.softcap, call.sink_layout};
  }

  std::shared_ptr<cuda::reference::Plan> plan_for(const Mask& mask, const Call& call, int32_t device) const {
    const Shapes& s = call.shapes;
    return plans_.get(Keyed{plan_key(mask, s, device, 0, call.range_merge), call.stream}, [&] {
      validate(mask);
      return cuda::reference::make_plan(call.range_merge ? merge_slices(mask, *call.range_merge) : mask, s.hq,
                                        s.hkv, s.d, device);
    });
  }

  using Keyed = std::pair<PlanKey, StreamHandle>;
  mutable LruCache<Keyed, cuda::reference::Plan> plans_{kPlanCacheCapacity};
};

}  // namespace

const Engine& cuda_reference_engine() {
  static const ReferenceEngine engine;
  return engine;
}

}  // namespace magi::api
