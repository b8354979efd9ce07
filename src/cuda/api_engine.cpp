// The portable CUDA kernels behind the API edge: their own checks (16-bit inputs, aligned addresses, a caller's
// workspace), options from the environment (SM margins, profile mode), plans cached per (mask, shapes, device).
#include "api/engine.hpp"
#include "cuda/backend.hpp"
#include "magi/env.hpp"

namespace magi::api {
namespace {

constexpr std::string_view kWho = "the cuda backend";

// The kernels read [T, H, D] rows in 16-byte pieces (D is a multiple of 8) and write outputs by element pairs:
// inputs (and out, which the backward reads) need 16-byte aligned addresses, as every CUDA allocation has;
// gradients need two elements' alignment.
void check_inputs(const TensorView& q) {
  require_dtype(q, "q", {DType::BF16, DType::F16});  // the GPU kernels take 16-bit inputs
}

// A caller's workspace: enough bytes, aligned (the kernels store 16-byte vectors into it).
void check_workspace(const Workspace& w, int64_t needed) {
  if (w.data == nullptr) {
    if (w.bytes != 0) throw InvalidArgument("workspace: bytes given without data (allowed: both, or neither)");
    return;
  }
  if (w.bytes < needed)
    throw InvalidArgument("workspace: " + std::to_string(w.bytes) + " bytes given, the call needs " +
                          std::to_string(needed) + " (magi::workspace_bytes)");
  require_aligned(TensorView(w.data, DType::F32, {1}), "workspace", 16, kWho);
}

cuda::Options options(const Call& call, bool forward_pass) {
  cuda::Options o;
  o.deterministic = call.deterministic;
  o.softmax_scale = call.softmax_scale;
  o.softcap = call.softcap;
  o.sink_layout = call.sink_layout;
  o.sm_margin = static_cast<int32_t>(env::get_int(forward_pass ? "MAGI_ATTENTION_FFA_FORWARD_SM_MARGIN"
                                                               : "MAGI_ATTENTION_FFA_BACKWARD_SM_MARGIN"));
  o.profile = env::get_bool("MAGI_ATTENTION_PROFILE_MODE");
  return o;
}

class CudaEngine final : public Engine {
 public:
  void forward(const Mask& mask, const ForwardArgs& a, const Call& call) const override {
    check_inputs(a.q);
    for (auto [t, name] : {std::pair{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.out, "out"}})
      require_aligned(*t, name, 16, kWho);
    if (a.prev_out.ndim != 0) require_aligned(a.prev_out, "prev_out", 16, kWho);
    const cuda::Options o = options(call, true);
    check_workspace(a.workspace, cuda::workspace_bytes(a, o));
    cuda::forward(*plan_for(mask, call, a.q.device.index), a, o, static_cast<cudaStream_t>(call.stream));
  }

  void backward(const Mask& mask, const BackwardArgs& a, const Call& call) const override {
    check_inputs(a.q);
    for (auto [t, name] : {std::pair{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.out, "out"}, {&a.dout, "dout"}})
      require_aligned(*t, name, 16, kWho);
    for (auto [t, name] : {std::pair{&a.dq, "dq"}, {&a.dk, "dk"}, {&a.dv, "dv"}})
      require_aligned(*t, name, static_cast<size_t>(2 * dtype_size(t->dtype)), kWho);
    const cuda::Options o = options(call, false);
    check_workspace(a.workspace, cuda::workspace_bytes(a, o));
    cuda::backward(*plan_for(mask, call, a.q.device.index), a, o, static_cast<cudaStream_t>(call.stream));
  }

  int64_t workspace_bytes(const ForwardArgs& a, const Call& call) const override {
    return cuda::workspace_bytes(a, options(call, true));
  }
  int64_t workspace_bytes(const BackwardArgs& a, const Call& call) const override {
    return cuda::workspace_bytes(a, options(call, false));
  }
  int32_t exact_merge_multiple() const override { return cuda::kTileMultiple; }

 private:
  std::shared_ptr<cuda::Plan> plan_for(const Mask& mask, const Call& call, int32_t device) const {
    const Shapes& s = call.shapes;
    cuda::PlanTuning tuning;
    switch (env::kernel_family()) {
      case env::KernelFamily::Sm80: tuning.forward_family = tuning.backward_family = cuda::KernelFamily::Sm80; break;
      case env::KernelFamily::Sm90: tuning.forward_family = tuning.backward_family = cuda::KernelFamily::Sm90; break;
      case env::KernelFamily::Auto: break;
    }
    tuning.backward_cat_gqa = env::get_bool("MAGI_ATTENTION_CATGQA");
    // The deterministic mode keeps its bits whether MAGI_ATTENTION_AUTO_RANGE_MERGE merges the slices or not: the
    // merges at kTileMultiple leave the work items alone on the global grid only (its tiles divide that length; tiles
    // aligned to the slices follow the merged slices' starts).
    if (call.deterministic) tuning.forward_aligned_tiles = tuning.backward_aligned_tiles = 0;
    return cached_plan(
        plans_, mask, call, device,
        [&](const Mask& planned) { return cuda::make_plan(planned, s.hq, s.hkv, s.d, device, tuning); },
        (static_cast<int32_t>(tuning.forward_family) * 2 + (tuning.backward_cat_gqa ? 1 : 0)) * 2 +
            (call.deterministic ? 1 : 0));
  }

  mutable LruCache<PlanKey, cuda::Plan> plans_{kPlanCacheCapacity};
};

}  // namespace

const Engine& cuda_engine() {
  static const CudaEngine engine;
  return engine;
}

}  // namespace magi::api
