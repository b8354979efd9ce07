// The engines behind the API edge: the CPU engine (src/cpu), the CUDA kernels (src/cuda) and the exact GPU
// reference engine (src/cuda/reference). The edge (src/api/attention.cpp) validates what every engine needs,
// resolves the options and picks the engine; an engine checks what only it needs (the dtypes its kernels take,
// alignment, a caller's workspace), keeps its plans in its own cache and computes.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "api/checks.hpp"
#include "common/lru_cache.hpp"
#include "magi/attention.hpp"
#include "magi/mask.hpp"

namespace magi::api {

// One call's options, defaults and environment applied.
struct Call {
  Shapes shapes;
  double softmax_scale = 0.0;  // D^-0.5 unless given
  double softcap = 0.0;
  SinkLayout sink_layout = SinkLayout::None;
  bool deterministic = false;    // options.deterministic or MAGI_ATTENTION_DETERMINISTIC_MODE
  bool exact = false;            // backend reference or fp64 inputs: accumulate in fp64
  int32_t num_threads = 0;       // CPU engine: 0 = all cores
  StreamHandle stream = nullptr;
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual void forward(const Mask& mask, const ForwardArgs& args, const Call& call) const = 0;
  virtual void backward(const Mask& mask, const BackwardArgs& args, const Call& call) const = 0;
  // Scratch a call needs from a caller that brings its own (ForwardArgs/BackwardArgs::workspace).
  virtual int64_t workspace_bytes(const ForwardArgs&, const Call&) const { return 0; }
  virtual int64_t workspace_bytes(const BackwardArgs&, const Call&) const { return 0; }
};

// The engine of a resolved backend (not Auto) for tensors on `device`; NotAvailable where this build lacks it.
const Engine& engine(Backend backend, Device device);

// Each engine's folder defines its own.
const Engine& cpu_engine();
const Engine& cuda_engine();
const Engine& cuda_reference_engine();

// Plans are keyed by the full mask, the shapes and the place (compared exactly, never hashed).
struct PlanKey {
  std::vector<Slice> slices;
  int32_t total_q = 0, total_k = 0, hq = 0, hkv = 0, d = 0;
  int32_t device = -1;  // -1 for host plans
  int32_t variant = 0;  // an engine's own plan choice (the CUDA engine: the forced kernel family)
  bool operator==(const PlanKey&) const = default;
};
inline constexpr size_t kPlanCacheCapacity = 16;

// The bounds check of every call (cheap: it protects memory even where the overlap check is cached), the full
// check under MAGI_ATTENTION_SANITY_CHECK, then the key.
PlanKey plan_key(const Mask& mask, const Shapes& s, int32_t device, int32_t variant = 0);

// The plan for (mask, shapes, device) from `cache`, made by make() after the full check (incl. overlap) once per
// distinct mask.
template <class PlanT, class Make>
std::shared_ptr<PlanT> cached_plan(LruCache<PlanKey, PlanT>& cache, const Mask& mask, const Shapes& s,
                                   int32_t device, Make make, int32_t variant = 0) {
  return cache.get(plan_key(mask, s, device, variant), [&] {
    validate(mask);
    return make();
  });
}

}  // namespace magi::api
