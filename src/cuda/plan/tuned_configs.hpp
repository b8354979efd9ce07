// Persisted tuned launch configurations: launch choices that depend on the device, measured and shipped with the
// library as a small table (tuned_configs.cpp), read by the planner. MAGI_ATTENTION_CUDA_IGNORE_TUNED_CONFIGS=1
// ignores the table (A/B runs); a choice that no longer fits the device is never taken.
#pragma once

#include <cstdint>

namespace magi::cuda {

// One measured choice: devices of this compute capability (major * 10 + minor) with at least `min_smem_optin`
// bytes of shared memory per block run head-dim tile `padded_head_dim`'s large-D forward as `variant`
// (LargeFwdVariant, src/cuda/sm80/tiles.hpp; the backward's table: LargeBwdVariant). `evidence` says what was
// measured.
struct TunedForwardConfig {
  int32_t compute_capability;
  int32_t min_smem_optin;
  int32_t padded_head_dim;
  int32_t variant;
  const char* evidence;
};

// The table's entry for this device and tile, or nullptr.
const TunedForwardConfig* find_tuned_forward_config(int32_t compute_capability, int32_t smem_optin,
                                                    int32_t padded_head_dim);

// The large-D forward variant a plan runs: `requested` (>= 0, PlanTuning::forward_variant; it must fit), else the
// table's entry (unless MAGI_ATTENTION_CUDA_IGNORE_TUNED_CONFIGS), else large_fwd_default_variant. Throws
// NotAvailable when no variant fits the device's shared memory, InvalidArgument for an unknown or unfitting request.
int32_t large_forward_variant(int32_t compute_capability, int32_t smem_optin, int32_t padded_head_dim,
                              int32_t requested);

// The same for the large-D backward's dk/dv kernel (LargeBwdVariant, src/cuda/sm80/tiles.hpp; `requested` is
// PlanTuning::backward_variant): the table's kTunedBackward entry, else kLargeBwdSingle. -1 below the large tiles.
int32_t large_backward_variant(int32_t compute_capability, int32_t smem_optin, int32_t padded_head_dim,
                               int32_t requested);

// Whether the default (non-deterministic) backward at a large head-dim tile adds dq by fp32 atomics inside the dk/dv
// kernel (true) or takes the two-kernel path of the deterministic mode (false): the table's measured entry, else
// true. Ignored with MAGI_ATTENTION_CUDA_IGNORE_TUNED_CONFIGS; tiles up to 256 always fuse where it fits.
bool large_backward_fuses_dq(int32_t compute_capability, int32_t smem_optin, int32_t padded_head_dim);

}  // namespace magi::cuda
