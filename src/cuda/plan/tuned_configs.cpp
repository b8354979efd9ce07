#include "cuda/plan/tuned_configs.hpp"

#include <string>

#include "cuda/sm80/tiles.hpp"
#include "magi/env.hpp"
#include "magi/error.hpp"

namespace magi::cuda {

namespace {

using detail::kLargeFwdDeep;
using detail::kLargeFwdPaired;

// Measured choices (flash_bench --large-d: bf16, 16 heads, one 8k-token sequence, full / causal, and long-tailed
// documents over 8k tokens for varlen causal; scripts/gpu_check.sh --large-d). Devices and tiles without an entry
// take the safe variant (large_fwd_default_variant: Q resident with a 2-stage ring where it fits, else Q streamed),
// which every entry was measured against in the same run.
constexpr TunedForwardConfig kTunedForward[] = {
    // Hopper (227 KB per block), measured on an H200 (2026-11-26), deep vs safe forward TFLOP/s:
    //   D 320: full 152 vs 98, causal 153 vs 105, varlen causal 118 vs 87
    //   D 512: full 178 vs 120, causal 178 vs 127, varlen causal 137 vs 105
    //   D 1024: full 115 vs 71, causal 118 vs 74, varlen causal 99 vs 68
    // (384, 576, 768 not measured: they keep the safe variant.)
    // D 320, paired (two blocks per SM) vs deep, H100 (2026-11-26): full 171 vs 153, causal 171 vs 153, varlen
    // causal 129 vs 119 (safe: 102 / 108 / 89).
    {90, 227 * 1024, 320, kLargeFwdPaired, "H100: paired 171/171/129 vs deep 153/153/119 TFLOP/s (full/causal/varlen)"},
    {90, 227 * 1024, 512, kLargeFwdDeep, "H200: deep 178/178/137 vs safe 120/127/105 TFLOP/s (full/causal/varlen)"},
    {90, 227 * 1024, 1024, kLargeFwdDeep, "H200: deep 115/118/99 vs safe 71/74/68 TFLOP/s (full/causal/varlen)"},
};

// The large-D backward's dk/dv kernel (LargeBwdVariant), same benchmark, bwd TFLOP/s against kLargeBwdSingle in
// the same run (two runs each, interleaved; default mode / deterministic):
//   D 320, H100 (2026-11-26): full 145.5 / 92.6 vs 120.8 / 80.4, causal 141.8 / 99.3 vs 121.8 / 88.5,
//   varlen causal 107.2 / 82.6 vs 93.3 / 74.5.
// (Pairing needs two blocks' shared memory and <= 128 registers: D 320 only.)
constexpr TunedForwardConfig kTunedBackward[] = {
    {90, 227 * 1024, 320, detail::kLargeBwdPaired,
     "H100: paired 146/142/107 vs single 121/122/93 bwd TFLOP/s (full/causal/varlen); deterministic 93/99/83 vs "
     "80/89/75"},
};

// The default backward's dq path at large head dims (variant 0: the two-kernel path, no atomics), bwd TFLOP/s
// of the two paths in one run: at D 1024 the dq atomics saturate L2 (ncu: L2 92%, tensor pipe 15%).
//   D 1024, H100 (2026-11-26): two kernels full 104.9, causal 104.5, varlen causal 93.2 vs atomics 91.6, 96.8, 77.6.
constexpr TunedForwardConfig kTunedDqPath[] = {
    {90, 227 * 1024, 1024, 0, "H100: two-kernel dq 105/105/93 vs atomics 92/97/78 bwd TFLOP/s (full/causal/varlen)"},
};

}  // namespace

bool large_backward_fuses_dq(int32_t compute_capability, int32_t smem_optin, int32_t padded_head_dim) {
  if (!detail::is_large_head_dim(padded_head_dim) || env::get_bool("MAGI_ATTENTION_CUDA_IGNORE_TUNED_CONFIGS"))
    return true;
  for (const TunedForwardConfig& c : kTunedDqPath)
    if (c.compute_capability == compute_capability && smem_optin >= c.min_smem_optin &&
        c.padded_head_dim == padded_head_dim)
      return c.variant != 0;
  return true;
}

const TunedForwardConfig* find_tuned_forward_config(int32_t compute_capability, int32_t smem_optin,
                                                    int32_t padded_head_dim) {
  for (const TunedForwardConfig& c : kTunedForward)
    if (c.compute_capability == compute_capability && smem_optin >= c.min_smem_optin &&
        c.padded_head_dim == padded_head_dim)
      return &c;
  return nullptr;
}

int32_t large_forward_variant(int32_t compute_capability, int32_t smem_optin, int32_t padded_head_dim,
                              int32_t requested) {
  auto fits = [&](int32_t v) {
    return detail::large_fwd_fits(padded_head_dim, v, smem_optin) &&
           (v != detail::kLargeFwdPaired || detail::large_fwd_paired_fits(padded_head_dim));
  };
  if (requested >= 0) {
    if (requested >= detail::kLargeFwdVariants || !fits(requested))
      throw InvalidArgument("cuda plan: forward_variant " + std::to_string(requested) + " is not available at head-dim tile " +
                            std::to_string(padded_head_dim) + " on this device (allowed: -1, 0 resident, 1 deep, 2 "
                            "streamed, 3 paired, where they fit " + std::to_string(smem_optin) + " bytes of shared memory)");
    return requested;
  }
  if (!env::get_bool("MAGI_ATTENTION_CUDA_IGNORE_TUNED_CONFIGS")) {
    const TunedForwardConfig* c = find_tuned_forward_config(compute_capability, smem_optin, padded_head_dim);
    if (c != nullptr && fits(c->variant)) return c->variant;
  }
  const int32_t safe = detail::large_fwd_default_variant(padded_head_dim, smem_optin);
  if (safe < 0)
    throw NotAvailable("cuda backend: the head-dim tile " + std::to_string(padded_head_dim) + " forward needs " +
                       std::to_string(detail::large_fwd_smem_bytes(padded_head_dim, detail::kLargeFwdStreamed)) +
                       " bytes of shared memory per block; this device allows " + std::to_string(smem_optin));
  return safe;
}

int32_t large_backward_variant(int32_t compute_capability, int32_t smem_optin, int32_t padded_head_dim,
                               int32_t requested) {
  if (!detail::is_large_head_dim(padded_head_dim)) {
    if (requested > 0)
      throw InvalidArgument("cuda plan: backward_variant " + std::to_string(requested) +
                            " applies to head-dim tiles above 256 only (allowed here: -1, 0)");
    return -1;
  }
  if (requested >= 0) {
    if (requested >= detail::kLargeBwdVariants || !detail::large_bwd_fits(padded_head_dim, requested, smem_optin))
      throw InvalidArgument("cuda plan: backward_variant " + std::to_string(requested) +
                            " is not available at head-dim tile " + std::to_string(padded_head_dim) +
                            " on this device (allowed: -1, 0 single, 1 paired: D 320 where two blocks fit " +
                            std::to_string(smem_optin) + " bytes of shared memory)");
    return requested;
  }
  if (!env::get_bool("MAGI_ATTENTION_CUDA_IGNORE_TUNED_CONFIGS")) {
    for (const TunedForwardConfig& c : kTunedBackward)
      if (c.compute_capability == compute_capability && smem_optin >= c.min_smem_optin &&
          c.padded_head_dim == padded_head_dim && detail::large_bwd_fits(padded_head_dim, c.variant, smem_optin))
        return c.variant;
  }
  return detail::kLargeBwdSingle;
}

}  // namespace magi::cuda
