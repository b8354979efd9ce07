// The CUDA backend's planner, shared by the kernel families: a mask and shapes become the device work lists once
// (tiling, item flags, tile order, heads in passes), with the tile shapes of the family the plan runs. Execution
// (src/cuda/backend.cpp) reads a Plan and never changes it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/backend.hpp"
#include "cuda/params.hpp"

namespace magi::cuda {

struct Plan {
  int32_t tq = 0, tk = 0, hq = 0, hkv = 0, d = 0, padded_d = 0, device = 0;
  int32_t fwd_tile_q = 0;  // rows per forward block (the fwd list's major tile)
  int32_t fwd_tile_k = 0;
  KernelFamily fwd_family = KernelFamily::Sm80;
  // The backward's family: Sm90 runs src/cuda/sm90/backward_kernel.cuh on the dkdv list (with dQ by TMA reduce-adds
  // or vector reductions; where it runs without dQ, beside the Hopper dq kernel on dq_sm90 where the tile has one,
  // else the portable dq kernel).
  KernelFamily bwd_family = KernelFamily::Sm80;
  int32_t fwd_variant = -1;  // large head dims: the D-split forward's LargeFwdVariant (sm80/tiles.hpp); else -1
  int32_t bwd_variant = -1;  // large head dims: the D-split dk/dv kernel's LargeBwdVariant; else -1
  bool bwd_fuse_dq = true;   // the default backward may add dq by atomics in the dk/dv kernel (tuned_configs.hpp)
  int32_t fwd_itemless_tiles = 0;  // q tiles without items: the last ones of the fwd order
  int32_t smem_optin = 0;  // the device's per-block shared-memory limit (opt-in)
  detail::DeviceList fwd, dkdv, dq;
  detail::DeviceList fwd_pairs;  // the forward's pairs of works (FwdParams::pairs); num_tiles 0: none
  bool fwd_pairs_of_heads = false;
  int32_t fwd_tile_unit = 0;  // the forward's tiles aligned to the slices (DeviceList::tile_unit); 0: uniform
  int32_t dkdv_tile_unit = 0;  // the Hopper dk/dv kernel's likewise
  detail::DeviceList dkdv_grid;  // the dkdv list on the global grid (the portable kernel's; dkdv itself if uniform)  // ... as pairs of q heads (FwdParams::pairs_of_heads)
  int64_t fwd_items = 0, dkdv_items = 0, dq_items = 0;
  // Concatenated heads (PlanTuning::backward_cat_gqa): the Hopper dk/dv kernel's list over chunks of 64 / group
  // tokens, used when that kernel adds dQ itself (else the dkdv list); group 1: none.
  int32_t bwd_cat_group = 1;
  detail::DeviceList dkdv_cat;
  // The Hopper dq kernel's q-major list (sm90::sm90_dq_kernel tiles on the Hopper backward; else empty).
  detail::DeviceList dq_sm90;
  int64_t dq_sm90_items = 0;
  void* arena = nullptr;  // the lists, read-only after upload
  size_t arena_bytes = 0;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (arena != nullptr) {
      int previous = 0;
      cudaGetDevice(&previous);
      cudaSetDevice(device);
      cudaFree(arena);
      cudaSetDevice(previous);
    }
  }
};

// The compiled head-dim tile that runs head dim d (the smallest that holds it), 0 if none.
int32_t padded_head_dim(int32_t d);

inline size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace magi::cuda
