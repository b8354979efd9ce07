#include "api/engine.hpp"

#include "magi/env.hpp"
#include "magi/error.hpp"

namespace magi::api {

const Engine& engine(Backend backend, Device device) {
  if (device.type == DeviceType::CPU) return cpu_engine();  // backend cpu or reference: the CPU engine
#if MAGI_ATTN_CUDA_BACKEND
  return backend == Backend::Reference ? cuda_reference_engine() : cuda_engine();
#else
  (void)backend;
  throw NotAvailable("CUDA tensors given, but this build has no CUDA backend (allowed: CPU tensors)");
#endif
}

std::optional<MergeRule> range_merge_for(bool enabled, bool deterministic, const Engine& engine) {
  if (!enabled) return std::nullopt;
  if (!deterministic) return MergeRule{};
  const int32_t multiple = engine.exact_merge_multiple();
  if (multiple <= 0) return std::nullopt;
  return MergeRule{multiple};
}

PlanKey plan_key(const Mask& mask, const Shapes& s, int32_t device, int32_t variant,
                 const std::optional<MergeRule>& merge) {
  validate_bounds(mask);
  if (env::get_bool("MAGI_ATTENTION_SANITY_CHECK")) validate(mask);
  return {mask.slices, mask.total_q, mask.total_k, static_cast<int32_t>(s.hq), static_cast<int32_t>(s.hkv),
          static_cast<int32_t>(s.d), device, variant, merge ? merge->boundary_multiple : -1};
}

}  // namespace magi::api
