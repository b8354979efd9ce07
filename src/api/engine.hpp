// The engines behind the API edge: the CPU engine (src/cpu), the CUDA kernels (src/cuda) and the exact GPU
// reference engine (src/cuda/reference). The edge (src/api/attention.cpp) validates what every engine needs,
// resolves the options and picks the engine; an engine checks what only it needs (the dtypes its kernels take,
// alignment, a caller's workspace), keeps its plans in its own cache and computes.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
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
  // MAGI_ATTENTION_AUTO_RANGE_MERGE for this call's engine (range_merge_for): how the plan merges the mask's
  // slices (merge_slices), or not at all.
  std::optional<MergeRule> range_merge;
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual void forward(const Mask& mask, const ForwardArgs& args, const Call& call) const = 0;
  virtual void backward(const Mask& mask, const BackwardArgs& args, const Call& call) const = 0;
  // Scratch a call needs from a caller that brings its own (ForwardArgs/BackwardArgs::workspace).
  virtual int64_t workspace_bytes(const ForwardArgs&, const Call&) const { return 0; }
  virtual int64_t workspace_bytes(const BackwardArgs&, const Call&) const { return 0; }
  // A length that every tile of this engine's plans divides (any head dim): slices merged only at its multiples,
  // list neighbours in order (MergeRule::boundary_multiple), leave the plans' work items and so the results
  // bitwise unchanged. 0 where no merge is known to be harmless.
  virtual int32_t exact_merge_multiple() const = 0;
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
  int32_t merge = -1;   // the plan's slices: -1 as given, else merge_slices' with this boundary_multiple
  bool operator==(const PlanKey&) const = default;
};
inline constexpr size_t kPlanCacheCapacity = 16;

// The merge a plan of `engine` makes: none with MAGI_ATTENTION_AUTO_RANGE_MERGE off (`enabled`); in deterministic
// mode only merges at the engine's exact_merge_multiple (none where it is 0); else every exact merge.
std::optional<MergeRule> range_merge_for(bool enabled, bool deterministic, const Engine& engine);

// The bounds check of every call (cheap: it protects memory even where the overlap check is cached), the full
// check under MAGI_ATTENTION_SANITY_CHECK, then the key.
PlanKey plan_key(const Mask& mask, const Shapes& s, int32_t device, int32_t variant = 0,
                 const std::optional<MergeRule>& merge = std::nullopt);

// The plan for (mask, the call's shapes and range merge, device) from `cache`: on a miss, the full check (incl.
// overlap) of the mask, then make(planned), `planned` being the mask as the call's range merge leaves it.
template <class PlanT, class Make>
std::shared_ptr<PlanT> cached_plan(LruCache<PlanKey, PlanT>& cache, const Mask& mask, const Call& call,
                                   int32_t device, Make make, int32_t variant = 0) {
  return cache.get(plan_key(mask, call.shapes, device, variant, call.range_merge), [&] {
    validate(mask);
    return call.range_merge ? make(merge_slices(mask, *call.range_merge)) : make(mask);
  });
}

}  // namespace magi::api
