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

PlanKey plan_key(const Mask& mask, const Shapes& s, int32_t device, int32_t variant) {
  validate_bounds(mask);
  if (env::get_bool("MAGI_ATTENTION_SANITY_CHECK")) validate(mask);
  return {mask.slices, mask.total_q, mask.total_k, static_cast<int32_t>(s.hq), static_cast<int32_t>(s.hkv),
          static_cast<int32_t>(s.d), device, variant};
}

}  // namespace magi::api
