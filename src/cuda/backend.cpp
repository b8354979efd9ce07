#include "cuda/backend.hpp"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/check.hpp"
#include "cuda/params.hpp"
#include "cuda/plan/plan.hpp"
#include "cuda/sm80/launch.hpp"
#include "cuda/sm80/tiles.hpp"
#include "cuda/sm90/launch.hpp"
#include "cuda/sm90/launch_backward.hpp"
#include "cuda/sm90/tiles.hpp"
#include "cuda/small_kernels.hpp"
#include "cuda/tile_list.hpp"
#include "magi/error.hpp"

namespace magi::cuda {

namespace {


// MAGI_ATTENTION_PROFILE_MODE: CUDA events around a stage of one call, printed after a sync of the stream.
class StageTimer {
 public:
  StageTimer(bool enabled, cudaStream_t stream) : enabled_(enabled), stream_(stream) {}
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;
  ~StageTimer() {
    for (auto& s : stages_) {
      cudaEventDestroy(s.start);
      cudaEventDestroy(s.stop);
    }
  }
  void begin(const char* name) {
    if (!enabled_) return;
    Stage s{name, nullptr, nullptr};
    check(cudaEventCreate(&s.start), "cudaEventCreate");
    check(cudaEventCreate(&s.stop), "cudaEventCreate");
    check(cudaEventRecord(s.start, stream_), "cudaEventRecord");
    stages_.push_back(s);
  }
  void end() {
    if (enabled_) check(cudaEventRecord(stages_.back().stop, stream_), "cudaEventRecord");
  }
  void report(const std::string& what) {
    if (!enabled_) return;
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (profile mode)");
    std::string line = "magi-attn profile: " + what;
    for (const Stage& s : stages_) {
      float ms = 0.0f;
      check(cudaEventElapsedTime(&ms, s.start, s.stop), "cudaEventElapsedTime");
      line += std::string(", ") + s.name + " " + std::to_string(ms) + " ms";
    }
    std::fprintf(stderr, "%s\n", line.c_str());
  }

 private:
  struct Stage {
    const char* name;
    cudaEvent_t start, stop;
  };
  bool enabled_;
  cudaStream_t stream_;
  std::vector<Stage> stages_;
};

}  // namespace

namespace {

// ---- per-call scratch: one layout function for both the size query and the carving ----

constexpr size_t kCounterBytes = 256;  // persistent-grid work counters: forward, dk/dv, dq

// The backward's row statistics hold whole 64-row chunks past the last row.
int32_t stats_rows(int32_t tq) { return (tq + 63) / 64 * 64 + 64; }

struct BackwardLayout {
  int32_t tq_pad = 0;
  bool fused_dq = false;  // dq by fp32 atomics inside the dk/dv kernel (default mode)
  bool dq_in_place = false;  // ... straight into the caller's fp32, 16-byte aligned dq
  bool dq_fragments = false;  // ... into the scratch accumulator in fragment order (BwdParams::dq_accum)
  // byte offsets; 0 = unused
  size_t delta = 0, lse2 = 0, counters = 0, dout16 = 0, dq_accum = 0, dq_semaphores = 0, dq_semaphore_bytes = 0,
         total = 0;
};

// fuse_allowed: the plan's choice of dq path (Plan::bwd_fuse_dq); ordered_dq: deterministic mode on the Hopper
// dk/dv kernel, which then adds dQ itself in a fixed order (BwdParams::dq_semaphores); dq_fragments: that kernel
// adds in fragment order (sm90::backward_dq_in_fragments). workspace_bytes, without a plan, passes true for all
// three: the larger layout.
BackwardLayout backward_layout(const BackwardArgs& a, int32_t padded_d, int32_t smem_optin, bool deterministic,
                               bool fuse_allowed, bool ordered_dq, bool dq_fragments) {
  const auto tq = static_cast<int32_t>(a.q.shape[0]), hq = static_cast<int32_t>(a.q.shape[1]);
  const auto rows_x_d = static_cast<size_t>(a.q.numel());
  BackwardLayout l;
  l.tq_pad = stats_rows(tq);
  l.fused_dq = (!deterministic || ordered_dq) && fuse_allowed && detail::dkdv_smem_bytes(padded_d, true) <= smem_optin;
  l.dq_fragments = l.fused_dq && dq_fragments;
  l.dq_in_place = !l.dq_fragments && a.dq.dtype == DType::F32 && reinterpret_cast<uintptr_t>(a.dq.data) % 16 == 0;
  const size_t stats_bytes = align_up(static_cast<size_t>(l.tq_pad) * hq * sizeof(float));
  l.delta = 0;
  l.lse2 = stats_bytes;
  l.counters = 2 * stats_bytes;
  size_t at = l.counters + kCounterBytes;
  if (a.dout.dtype == DType::F32) {
    l.dout16 = at;
    at += align_up(rows_x_d * 2);
  }
  if (l.fused_dq && !l.dq_in_place) {
    l.dq_accum = at;
    at += align_up(l.dq_fragments ? static_cast<size_t>(detail::dq_fragment_floats(tq, hq, padded_d)) * 4
                                  : rows_x_d * 4);
  }
  if (l.fused_dq && deterministic) {
    l.dq_semaphores = at;
    l.dq_semaphore_bytes = size_t{2} * hq * (l.tq_pad / detail::kDkdvTileQ) * sizeof(int32_t);
    at += align_up(l.dq_semaphore_bytes);
  }
  l.total = at;
  return l;
}

int32_t device_smem_optin(int32_t device) {
  int value = 0;
  check(cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute");
  return value;
}

// The backend's own scratch for callers without a workspace: one buffer per (device, stream), grown as needed.
// Growing frees the old buffer; cudaFree waits for the device, so no call still in flight can read it.
class ScratchBuffers {
 public:
  unsigned char* get(int32_t device, cudaStream_t stream, size_t bytes) {
    std::lock_guard lock(mutex_);
    Entry& e = entries_[{device, stream}];
    if (e.bytes < bytes) {
      if (e.data != nullptr) check(cudaFree(e.data), "cudaFree (scratch)");
      e.data = nullptr;
      e.bytes = 0;
      check(cudaMalloc(&e.data, bytes), "cudaMalloc (scratch)");
      e.bytes = bytes;
    }
    return static_cast<unsigned char*>(e.data);
  }

 private:
  struct Entry {
    void* data = nullptr;
    size_t bytes = 0;
  };
  std::mutex mutex_;
  std::map<std::pair<int32_t, cudaStream_t>, Entry> entries_;
};

unsigned char* scratch_for(const Workspace& given, int32_t device, cudaStream_t stream, size_t bytes) {
  if (given.data != nullptr) return static_cast<unsigned char*>(given.data);
  static ScratchBuffers buffers;  // process-wide, like the device's primary context it belongs to
  return buffers.get(device, stream, bytes);
}

}  // namespace

int64_t workspace_bytes(const ForwardArgs&, const Options&) { return static_cast<int64_t>(kCounterBytes); }

int64_t workspace_bytes(const BackwardArgs& a, const Options& o) {
  const int32_t padded = padded_head_dim(static_cast<int32_t>(a.q.shape[2]));
  return static_cast<int64_t>(
      backward_layout(a, padded, device_smem_optin(a.q.device.index), o.deterministic, true, true, true).total);
}

namespace {

int dtype_tag(DType dtype) {
  if (dtype == DType::BF16) return detail::kBf16;
  if (dtype == DType::F16) return detail::kFp16;
  throw NotAvailable("cuda backend: dtype " + std::string(to_string(dtype)) +
                     " is not supported by the portable kernels (allowed: bf16, fp16)");
}

// One dispatch over the compiled tiles (cuda/tile_list.hpp) per launcher.
template <class F>
void with_compiled_tile(int padded, const char* what, F&& f) {
  if (!detail::dispatch_compiled_tile(padded, f))
    throw NotAvailable(std::string("cuda backend: no ") + what + " kernel for head-dim tile " + std::to_string(padded));
}

template <int kDtype>
void run_forward(int padded, const detail::FwdParams& p, int tile_q, int variant, int itemless, int margin,
                 cudaStream_t stream) {
  with_compiled_tile(padded, "forward", [&](auto d) {
    detail::launch_forward<kDtype, decltype(d)::value>(p, tile_q, variant, itemless, margin, stream);
  });
}

template <int kDtype>
void run_forward_sm90(int padded, const detail::FwdParams& p, int tile_q, int itemless, int margin,
                      cudaStream_t stream) {
  with_compiled_tile(padded, "sm_90a forward", [&](auto d) {
    constexpr int kD = decltype(d)::value;
#if MAGI_CUDA_SM90
    if constexpr (sm90::sm90_forward_tile(kD))
      return sm90::launch_forward<kDtype, kD>(p, tile_q, itemless, margin, stream);
#endif
    (void)p, (void)tile_q, (void)itemless, (void)margin, (void)stream;
    throw NotAvailable("cuda backend: no sm_90a forward kernel for head-dim tile " + std::to_string(kD));
  });
}

template <int kDtype>
void run_backward(int padded, const detail::BwdParams& dkdv, int dkdv_blocks, const detail::BwdParams& dq,
                  int dq_blocks, int variant, int margin, cudaStream_t stream) {
  with_compiled_tile(padded, "backward", [&](auto d) {
    detail::launch_backward<kDtype, decltype(d)::value>(dkdv, dkdv_blocks, dq, dq_blocks, variant, margin, stream);
  });
}

// The Hopper backward (dk/dv; dq added into p.dq_accum) at the tiles sm90::sm90_backward_tile names.
template <int kDtype>
void run_backward_sm90(int padded, const detail::BwdParams& p, int margin, cudaStream_t stream) {
  with_compiled_tile(padded, "sm_90a backward", [&](auto d) {
    constexpr int kD = decltype(d)::value;
#if MAGI_CUDA_SM90
    if constexpr (sm90::sm90_backward_tile(kD)) return sm90::launch_backward<kDtype, kD>(p, margin, stream);
#endif
    (void)p, (void)margin, (void)stream;
    throw NotAvailable("cuda backend: no sm_90a backward kernel for head-dim tile " + std::to_string(kD));
  });
}

template <int kDtype>
void run_dq_sm90(int padded, const detail::BwdParams& p, int margin, cudaStream_t stream) {
  with_compiled_tile(padded, "sm_90a dq", [&](auto d) {
    constexpr int kD = decltype(d)::value;
#if MAGI_CUDA_SM90
    if constexpr (sm90::sm90_dq_kernel(kD)) return sm90::launch_dq<kDtype, kD>(p, margin, stream);
#endif
    (void)p, (void)margin, (void)stream;
    throw NotAvailable("cuda backend: no sm_90a dq kernel for head-dim tile " + std::to_string(kD));
  });
}

int32_t sink_kind(SinkLayout layout) {
  switch (layout) {
    case SinkLayout::SH: return detail::kSinkSH;
    case SinkLayout::SSH: return detail::kSinkSSH;
    default: return detail::kSinkNone;
  }
}

int32_t sink_len(const TensorView& sink, SinkLayout layout) {
  if (layout == SinkLayout::SH) return static_cast<int32_t>(sink.shape[0]);
  if (layout == SinkLayout::SSH) return static_cast<int32_t>(sink.shape[1]);
  return 0;
}

struct ScaleTerms {
  float scale_log2, softmax_scale, softcap, softcap_pre, softcap_post;
};
ScaleTerms scale_terms(const Options& o) {
  constexpr double kLog2e = 1.4426950408889634;
  ScaleTerms t{};
  t.softmax_scale = static_cast<float>(o.softmax_scale);
  t.scale_log2 = static_cast<float>(o.softmax_scale * kLog2e);
  if (o.softcap > 0.0) {
    t.softcap = static_cast<float>(o.softcap);
    t.softcap_pre = static_cast<float>(o.softmax_scale / o.softcap);
    t.softcap_post = static_cast<float>(o.softcap * kLog2e);
  }
  return t;
}

}  // namespace

void forward(const Plan& plan, const ForwardArgs& a, const Options& o, cudaStream_t stream) {
  DeviceGuard guard(plan.device);
  const int tag = dtype_tag(a.q.dtype);
  const ScaleTerms t = scale_terms(o);
  detail::FwdParams p{};
  p.q = a.q.data;
  p.k = a.k.data;
  p.v = a.v.data;
  p.out = a.out.data;
  p.lse = static_cast<float*>(a.lse.data);
  p.max_logits = a.max_logits.ndim != 0 ? static_cast<float*>(a.max_logits.data) : nullptr;
  p.sink = o.sink_layout != SinkLayout::None ? static_cast<const float*>(a.sink.data) : nullptr;
  p.tq = plan.tq;
  p.tk = plan.tk;
  p.hq = plan.hq;
  p.hkv = plan.hkv;
  p.d = plan.d;
  p.sink_kind = sink_kind(o.sink_layout);
  p.sink_len = sink_len(a.sink, o.sink_layout);
  p.scale_log2 = t.scale_log2;
  p.softcap = t.softcap;
  p.softcap_pre = t.softcap_pre;
  p.softcap_post = t.softcap_post;
  p.out_fp32 = a.out.dtype == DType::F32;
  p.prev_out = a.prev_out.ndim != 0 ? static_cast<const float*>(a.prev_out.data) : nullptr;
  p.prev_lse = a.prev_out.ndim != 0 ? static_cast<const float*>(a.prev_lse.data) : nullptr;
  p.list = plan.fwd;
  p.pairs = plan.fwd_pairs;
  p.pairs_of_heads = plan.fwd_pairs_of_heads;
  p.work_counter = reinterpret_cast<int32_t*>(
      scratch_for(a.workspace, plan.device, stream, static_cast<size_t>(workspace_bytes(a, o))));
  StageTimer timer(o.profile, stream);
  timer.begin("forward_kernel");
  if (p.max_logits != nullptr) detail::launch_fill(p.max_logits, plan.hq, -INFINITY, stream);
  // Item-less tiles take their own copy kernel unless a sink joins their (otherwise empty) rows.
  const int itemless = p.sink_kind == detail::kSinkNone ? plan.fwd_itemless_tiles : 0;
  // A plan without any work item (no keys at all; its rows only take a sink or a previous result) needs no Hopper
  // kernel: the portable one writes those rows without reading K or V, which may then be empty (the planner gives
  // such a plan a tile that the portable family has).
  if (plan.fwd_family == KernelFamily::Sm90 && plan.fwd_items > 0) {
    if (tag == detail::kBf16)
      run_forward_sm90<detail::kBf16>(plan.padded_d, p, plan.fwd_tile_q, itemless, o.sm_margin, stream);
    else
      run_forward_sm90<detail::kFp16>(plan.padded_d, p, plan.fwd_tile_q, itemless, o.sm_margin, stream);
  } else if (tag == detail::kBf16) {
    run_forward<detail::kBf16>(plan.padded_d, p, plan.fwd_tile_q, plan.fwd_variant, itemless, o.sm_margin, stream);
  } else {
    run_forward<detail::kFp16>(plan.padded_d, p, plan.fwd_tile_q, plan.fwd_variant, itemless, o.sm_margin, stream);
  }
  timer.end();
  timer.report(std::string(plan.fwd_family == KernelFamily::Sm90 ? "cuda forward (sm90)" : "cuda forward (sm80)") +
               ", " + std::to_string(plan.fwd_items) + " work items, " + std::to_string(plan.fwd_tile_q) + " x " +
               std::to_string(plan.fwd_tile_k) + " tiles, head-dim tile " + std::to_string(plan.padded_d) +
               (plan.fwd_variant >= 0 ? ", large-D variant " + std::to_string(plan.fwd_variant) : std::string()));
}

void backward(const Plan& plan, const BackwardArgs& a, const Options& o, cudaStream_t stream) {
  DeviceGuard guard(plan.device);
  // Checked before anything is launched: parts with ~100 KB per block (sm_86, sm_89) have no D 128 backward.
  const int dkdv_smem = detail::dkdv_smem_bytes(plan.padded_d, false);
  if (dkdv_smem > plan.smem_optin)
    throw Error("cuda backward: head dim " + std::to_string(plan.d) + " needs " + std::to_string(dkdv_smem) +
                " bytes of shared memory per block; this device allows " + std::to_string(plan.smem_optin) +
                " (use the CPU backend or a GPU with more shared memory, e.g. A100 / H100)");
  const int tag = dtype_tag(a.q.dtype);
  const ScaleTerms t = scale_terms(o);
  const bool dout_fp32 = a.dout.dtype == DType::F32;
  // The Hopper kernel's TMA loads need 16-byte aligned bases (rows are: d is a multiple of 8).
  const bool tma_aligned = ((reinterpret_cast<uintptr_t>(a.q.data) | reinterpret_cast<uintptr_t>(a.k.data) |
                             reinterpret_cast<uintptr_t>(a.v.data) | reinterpret_cast<uintptr_t>(a.dout.data)) %
                            16) == 0;
  const bool sm90_dkdv = plan.bwd_family == KernelFamily::Sm90 && tma_aligned;
  // Above tile 256 the families' k-major lists differ: the portable kernel cannot take the Hopper plan's. (The API
  // edge rejects such addresses before this.)
  if (plan.bwd_family == KernelFamily::Sm90 && !tma_aligned &&
      sm90::backward_tile_k(plan.padded_d) != detail::dkdv_tile_k(plan.padded_d))
    throw InvalidArgument("cuda backward: q, k, v and dout need 16-byte aligned addresses for the Hopper backward at "
                          "head dim " + std::to_string(plan.d) + " (or plan the portable family)");
  // Where the Hopper dq kernel runs (tiles.hpp: sm90_dq_kernel; its list holds an item: a plan without keys leaves dq
  // to the portable kernel, which needs no K / V to load), dQ leaves the dk/dv kernel in both modes: the two kernels
  // beat the fused vector reductions on every mask (D 256, H200: +21..+34%), and dq is the same bits every run.
  const bool sm90_dq = sm90_dkdv && plan.dq_sm90_items > 0;
  const BackwardLayout layout =
      backward_layout(a, plan.padded_d, plan.smem_optin, o.deterministic, plan.bwd_fuse_dq && !sm90_dq,
                      sm90_dkdv && sm90::sm90_ordered_dq(plan.padded_d),
                      sm90_dkdv && sm90::backward_dq_in_fragments(plan.padded_d, plan.bwd_cat_group));
  unsigned char* scratch = scratch_for(a.workspace, plan.device, stream, layout.total);
  auto* const delta = reinterpret_cast<float*>(scratch + layout.delta);
  auto* const lse2 = reinterpret_cast<float*>(scratch + layout.lse2);
  auto* const counters = reinterpret_cast<int32_t*>(scratch + layout.counters);

  detail::PreprocessArgs pre{};
  pre.out = a.out.data;
  pre.out_fp32 = a.out.dtype == DType::F32;
  pre.dout = a.dout.data;
  pre.dout_fp32 = dout_fp32;
  pre.dout16 = dout_fp32 ? scratch + layout.dout16 : nullptr;
  pre.lse = static_cast<const float*>(a.lse.data);
  pre.delta = delta;
  pre.lse2 = lse2;
  pre.tq_pad = layout.tq_pad;
  pre.sink = o.sink_layout != SinkLayout::None ? static_cast<const float*>(a.sink.data) : nullptr;
  pre.dsink = o.sink_layout != SinkLayout::None ? static_cast<float*>(a.dsink.data) : nullptr;
  pre.sink_kind = sink_kind(o.sink_layout);
  pre.sink_len = sink_len(a.sink, o.sink_layout);
  pre.tq = plan.tq;
  pre.hq = plan.hq;
  pre.d = plan.d;
  detail::BwdParams p{};
  p.q = a.q.data;
  p.k = a.k.data;
  p.v = a.v.data;
  p.dout = dout_fp32 ? pre.dout16 : a.dout.data;
  p.lse2 = lse2;
  p.delta = delta;
  p.tq_pad = layout.tq_pad;
  p.dq = a.dq.data;
  p.dk = a.dk.data;
  p.dv = a.dv.data;
  p.cat_group = 1;
  p.tq = plan.tq;
  p.tk = plan.tk;
  p.hq = plan.hq;
  p.hkv = plan.hkv;
  p.d = plan.d;
  p.scale_log2 = t.scale_log2;
  p.softmax_scale = t.softmax_scale;
  p.softcap = t.softcap;
  p.softcap_pre = t.softcap_pre;
  p.softcap_post = t.softcap_post;
  p.grad_fp32 = a.dq.dtype == DType::F32;
  detail::BwdParams dkdv = p;
  dkdv.work_counter = counters + 1;
  dkdv.grad_fp32 = a.dk.dtype == DType::F32;
  dkdv.dv_fp32 = a.dv.dtype == DType::F32;
  dkdv.vector_stores = (reinterpret_cast<uintptr_t>(a.dk.data) | reinterpret_cast<uintptr_t>(a.dv.data)) % 16 == 0;
  detail::BwdParams dq = p;
  dq.list = plan.dq;
  dq.work_counter = counters + 2;
  const int dq_blocks = plan.dq.num_tiles * plan.hq;
  // Default: dq by fp32 atomics inside the dk/dv kernel, straight into an fp32 dq (the atomics add 4
  // floats: 16-byte alignment), else into the scratch accumulator and converted after. Deterministic, and both
  // modes where the Hopper dq kernel runs: a separate dq kernel.
  const bool fused_dq = layout.fused_dq;
  // Concatenated heads where the Hopper kernel adds dQ itself: it is then the only reader of lse2 / Delta.
  const int32_t cat_group = sm90_dkdv && fused_dq ? plan.bwd_cat_group : 1;
  pre.cat_group = cat_group;
  dkdv.cat_group = cat_group;
  const size_t dq_elements = static_cast<size_t>(plan.tq) * plan.hq * plan.d;
  const bool dq_in_place = layout.dq_in_place;
  dkdv.list = cat_group > 1 ? plan.dkdv_cat : sm90_dkdv ? plan.dkdv : plan.dkdv_grid;
  const int dkdv_blocks = dkdv.list.num_tiles * plan.hkv;
  dq.accumulate_dq = a.accumulate_dq;
  if (fused_dq) {
    dkdv.dq_accum = dq_in_place ? static_cast<float*>(a.dq.data) : reinterpret_cast<float*>(scratch + layout.dq_accum);
    // The preprocess zeroes the atomics' target, unless they add to the caller's sum in place.
    if (!(a.accumulate_dq && dq_in_place)) {
      pre.dq_zero = dkdv.dq_accum;
      pre.dq_zero_floats = layout.dq_fragments ? detail::dq_fragment_floats(plan.tq, plan.hq, plan.padded_d)
                                               : static_cast<int64_t>(dq_elements);
    }
  }
  // The Hopper dk/dv kernel adds dQ itself when fused (in a fixed order in deterministic mode); else the portable
  // dq kernel follows it.
  StageTimer timer(o.profile, stream);
  timer.begin("preprocess");
  if (layout.dq_semaphores != 0) {
    // Ordered dQ adds: one pass over every head, a tile's heads in turn, so that few tiles of one head (whose adds
    // to a chunk wait on each other) run at once. A head's works keep the list's order, which the ranks follow.
    dkdv.list.heads_per_pass = plan.hkv;
    dkdv.list.heavy_tiles = 0;
    dkdv.dq_semaphores = reinterpret_cast<int32_t*>(scratch + layout.dq_semaphores);
    check(cudaMemsetAsync(dkdv.dq_semaphores, 0, layout.dq_semaphore_bytes, stream), "cudaMemsetAsync (dq order)");
  }
  detail::launch_preprocess(tag, pre, stream);
  if (o.sink_layout == SinkLayout::SH)
    detail::launch_dsink_sh(pre.sink, pre.lse, delta, layout.tq_pad, cat_group, pre.dsink, pre.sink_len, plan.tq,
                            plan.hq, stream);
  timer.end();
  timer.begin(sm90_dkdv ? (fused_dq ? (o.deterministic ? "sm90 dkdv_kernel (dq by ordered TMA reduce-adds)"
                                                       : "sm90 dkdv_kernel (dq by TMA reduce-add)")
                                    : "sm90 dkdv_kernel")
              : fused_dq ? "dkdv_kernel (dq by atomics)"
                         : "dkdv_kernel + dq_kernel");
  if (sm90_dkdv) {
    if (tag == detail::kBf16) run_backward_sm90<detail::kBf16>(plan.padded_d, dkdv, o.sm_margin, stream);
    else run_backward_sm90<detail::kFp16>(plan.padded_d, dkdv, o.sm_margin, stream);
    if (!fused_dq) {  // a dq kernel follows: timed on its own
      timer.end();
      timer.begin(sm90_dq ? "sm90 dq_kernel" : "dq_kernel");
    }
  }
  if (sm90_dq) {
    detail::BwdParams dq90 = dq;
    dq90.list = plan.dq_sm90;
    if (tag == detail::kBf16) run_dq_sm90<detail::kBf16>(plan.padded_d, dq90, o.sm_margin, stream);
    else run_dq_sm90<detail::kFp16>(plan.padded_d, dq90, o.sm_margin, stream);
  }
  const int portable_dkdv_blocks = sm90_dkdv ? 0 : dkdv_blocks;  // the portable launcher then runs the dq kernel only
  if (!sm90_dkdv || (!fused_dq && !sm90_dq)) {
    if (tag == detail::kBf16)
      run_backward<detail::kBf16>(plan.padded_d, dkdv, portable_dkdv_blocks, dq, dq_blocks, plan.bwd_variant,
                                  o.sm_margin, stream);
    else
      run_backward<detail::kFp16>(plan.padded_d, dkdv, portable_dkdv_blocks, dq, dq_blocks, plan.bwd_variant,
                                  o.sm_margin, stream);
  }
  timer.end();
  if (fused_dq && !dq_in_place) {
    timer.begin("dq conversion");
    if (layout.dq_fragments)
      detail::launch_convert_fragments(tag, dq.grad_fp32, a.accumulate_dq, dkdv.dq_accum, a.dq.data, plan.tq, plan.hq,
                                       plan.d, plan.padded_d, stream);
    else if (a.accumulate_dq)
      detail::launch_add(static_cast<float*>(a.dq.data), dkdv.dq_accum, static_cast<int64_t>(dq_elements), stream);
    else if (dq.grad_fp32)
      check(cudaMemcpyAsync(a.dq.data, dkdv.dq_accum, dq_elements * 4, cudaMemcpyDeviceToDevice, stream),
            "cudaMemcpyAsync (dq)");
    else detail::launch_convert(tag, dkdv.dq_accum, a.dq.data, static_cast<int64_t>(dq_elements), stream);
    timer.end();
  }
  timer.report("cuda backward, " + std::to_string(plan.dkdv_items) + " dk/dv items" +
               (fused_dq ? " (dq by atomics)"
                         : ", " + std::to_string(sm90_dq ? plan.dq_sm90_items : plan.dq_items) + " dq items") +
               (cat_group > 1 ? ", q heads concatenated in groups of " + std::to_string(cat_group) : ""));
}

}  // namespace magi::cuda
