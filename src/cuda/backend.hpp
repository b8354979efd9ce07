// The portable CUDA backend (sm_80 instructions; runs on Ampere and Hopper): plans and execution.
//
// A plan turns a mask into the kernels' device work lists once; it is read-only afterwards and serves any
// stream. Each call also needs scratch (persistent-grid counters; the backward's row statistics, dout
// conversion and dq accumulator): the caller's (args.workspace, workspace_bytes) or, without one, the backend's
// own buffer for that (device, stream), allocated on the stream's first call. Execution enqueues kernels on the
// caller's stream only: no host synchronisation, no allocation after that first call, so forward + backward
// can be captured in a CUDA graph (on any stream when the caller brings the workspace). With Options::deterministic
// every result is bitwise reproducible (no atomics on values; max_logits uses an order-independent atomic
// max); by default dq is accumulated with fp32 atomics (faster, not bitwise reproducible), everything else
// stays reproducible.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "magi/attention.hpp"
#include "magi/mask.hpp"

namespace magi::cuda {

// Resolved options (defaults and env overrides applied by the API layer).
struct Options {
  double softmax_scale = 0.0;  // required: the API resolves the D^-0.5 default
  double softcap = 0.0;        // > 0 enables softcapping
  SinkLayout sink_layout = SinkLayout::None;
  int32_t sm_margin = 0;  // SMs the persistent grids leave free (MAGI_ATTENTION_FFA_{FORWARD,BACKWARD}_SM_MARGIN)
  bool profile = false;   // MAGI_ATTENTION_PROFILE_MODE: time each kernel with CUDA events and print (syncs)
  // MAGI_ATTENTION_DETERMINISTIC_MODE / AttentionOptions::deterministic: bitwise-reproducible backward
  // (a separate dq kernel recomputes S and dP) instead of dq accumulated with fp32 atomics.
  bool deterministic = false;
};

struct Plan;

// Head dims this build can run: multiples of 8 up to the largest compiled tile (64 / 128 / 256).
bool head_dim_supported(int32_t head_dim);

// The kernel families: the portable one (sm_80 instructions, every GPU from Ampere on) and the Hopper one (sm_90a:
// TMA, wgmma, warp specialisation; the forward so far), built when the architectures include 90a.
enum class KernelFamily { Auto, Sm80, Sm90 };
// Whether this build and `device` can run the Hopper forward at this head dim.
bool sm90_forward_available(int32_t head_dim, int32_t device);
// Whether this build and `device` can run the Hopper backward's dk/dv kernel at this head dim.
bool sm90_backward_available(int32_t head_dim, int32_t device);

// Plan-time choices the planner otherwise makes itself (0 / Auto = choose); benchmarks and tests pin them.
struct PlanTuning {
  int32_t forward_tile_q = 0;  // rows per forward block: 0, 64 or (D <= 128) 128; the Hopper forward: 0 or its tile
  KernelFamily forward_family = KernelFamily::Auto;  // Auto: Sm90 where available; a forced one must be
  // The backward's: Auto / Sm90 take the Hopper dk/dv kernel where available (head-dim tiles 64 to 512; dq added in
  // it, or by the portable dq kernel in the deterministic mode except at 128), else the portable one; Sm80 the
  // portable one. A backward_variant (the portable family's) makes Auto the portable family.
  KernelFamily backward_family = KernelFamily::Auto;
  // Head-dim tiles above 256: the D-split forward's variant (LargeFwdVariant in src/cuda/sm80/tiles.hpp); -1 = the
  // tuned table's choice for the device (plan/tuned_configs.cpp), else the one that fits.
  int32_t forward_variant = -1;
  // Head-dim tiles above 256: the D-split dk/dv kernel's variant (LargeBwdVariant, tiles.hpp); -1 = the tuned
  // table's choice, else kLargeBwdSingle.
  int32_t backward_variant = -1;
  // q heads per pass of the forward's work order (work_coords; a divisor of the q heads, which is one pass); 0 = the
  // planner's choice.
  int32_t forward_heads_per_pass = 0;
  // MAGI_ATTENTION_CATGQA: the Hopper backward at head-dim tiles 64 and 128 takes the q heads of a kv head together
  // (BwdParams::cat_group) where their number divides 64; elsewhere no effect.
  bool backward_cat_gqa = false;
  // The Hopper forward's pairs of works on clusters (sm90::forward_takes_pairs: q heads of one kv head, else q tiles
  // reading the same K / V tiles): -1 = where works are long (and most tiles pair up), 0 = never, 1 = wherever the
  // tile takes them. Pairs are taken on the global grid only (not with forward_aligned_tiles).
  int32_t forward_pairs = -1;
  // The Hopper forward's q tiles aligned to the slices (tiling::by_q_tile_aligned; sm90::forward_takes_aligned_tiles):
  // -1 = where they compute clearly fewer cells than the global grid, 0 = never, 1 = wherever the tile takes them.
  int32_t forward_aligned_tiles = -1;
  // The Hopper backward's k tiles aligned to the slices (tiling::by_k_tile_aligned; up to head-dim tile 256): -1 = where
  // they compute clearly fewer cells, 0 = never, 1 = always.
  int32_t backward_aligned_tiles = -1;
};

// A length that every tile of the global grid divides (both families, every head dim and tile choice; plan.cpp checks
// it against the tile shapes): slices merged only at its multiples leave the work lists, and so the results,
// bitwise unchanged (deterministic-mode MAGI_ATTENTION_AUTO_RANGE_MERGE; MergeRule in magi/mask.hpp). Tiles aligned to
// the slices follow the merged slices' starts instead: the API plans the deterministic mode without them
// (api_engine.cpp).
inline constexpr int32_t kTileMultiple = 384;  // 128-row tiles and the Hopper forward's 192-row ones (D 64)

// Builds the work lists on the host and uploads them to `device` (synchronous; done once per mask and
// shapes). Throws NotAvailable when the head dim has no compiled kernel.
std::shared_ptr<Plan> make_plan(const Mask& mask, int32_t heads_q, int32_t heads_kv, int32_t head_dim,
                                int32_t device, const PlanTuning& tuning = {});

// Device pointers in args; dtypes bf16 / fp16 (out and grads may be fp32). Arguments were validated by
// the API layer (shapes match the plan; a given workspace holds workspace_bytes and is 16-byte aligned).
void forward(const Plan& plan, const ForwardArgs& args, const Options& options, cudaStream_t stream);
void backward(const Plan& plan, const BackwardArgs& args, const Options& options, cudaStream_t stream);

// Scratch bytes one call with these arguments needs (args.workspace may stay empty: the backend then uses its own).
int64_t workspace_bytes(const ForwardArgs& args, const Options& options);
int64_t workspace_bytes(const BackwardArgs& args, const Options& options);

// What a plan holds, for tests and benchmarks.
struct PlanStats {
  int32_t padded_head_dim = 0;
  int32_t forward_tile_q = 0, forward_tile_k = 0;
  KernelFamily forward_family = KernelFamily::Sm80;
  KernelFamily backward_family = KernelFamily::Sm80;  // the dk/dv kernel
  int32_t forward_variant = -1;  // large head dims: the D-split forward's variant
  int32_t backward_variant = -1;  // large head dims: the D-split dk/dv kernel's variant
  int32_t forward_heads_per_pass = 0;
  int32_t backward_cat_group = 1;  // q heads per concatenated row group of the Hopper backward (1: none)
  int64_t forward_pairs = 0;       // pairs of works (tile, q head) of the Hopper forward's cluster kernel (0: none)
  bool forward_pairs_of_heads = false;  // ... pairing the q heads of a kv head (else q tiles)
  bool forward_aligned_tiles = false;   // the forward's q tiles follow the slices (PlanTuning::forward_aligned_tiles)
  bool backward_aligned_tiles = false;  // the Hopper dk/dv kernel's k tiles likewise
  int64_t forward_items = 0, dkdv_items = 0, dq_items = 0;
  int64_t forward_tiles = 0, dkdv_tiles = 0, dq_tiles = 0;
  int64_t device_bytes = 0;
};
PlanStats stats(const Plan& plan);

}  // namespace magi::cuda
