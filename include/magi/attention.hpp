// The attention API: forward and backward over a slice mask, dispatched by device and backend.
//
// Layout is packed "thd" (SPEC section 1): q [Tq, Hq, D], k/v [Tk, Hkv, D], out [Tq, Hq, D], lse [Tq, Hq].
// Callers own every output buffer; the library never allocates them, so the same call can later run
// asynchronously on a GPU stream.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>

#include "magi/mask.hpp"
#include "magi/tensor.hpp"

namespace magi {

enum class SinkLayout : int32_t {
  None,
  SH,   // sink [S, Hq], shared by every row
  SSH,  // sink [Tq, S, Hq], one set per row
};
std::string_view to_string(SinkLayout layout);
SinkLayout parse_sink_layout(std::string_view text, std::string_view what = "sink layout");

enum class Backend : int32_t {
  Auto,       // CUDA for device tensors, CPU engine for host tensors; env MAGI_ATTENTION_KERNEL_BACKEND
  Cpu,        // blocked flash engine on the CPU
  Cuda,       // GPU kernels
  Reference,  // exact engine: fp64 accumulation (CPU for host tensors)
};
std::string_view to_string(Backend backend);
Backend parse_backend(std::string_view text, std::string_view what = "backend");

// The CPU engine's thread limit: OpenMP's runtime crashed at 100000 threads.
inline constexpr int32_t kMaxThreads = 1024;

struct AttentionOptions {
  std::optional<double> softmax_scale;  // default D^-0.5
  double softcap = 0.0;                 // > 0 enables s = softcap * tanh(s / softcap)
  SinkLayout sink_layout = SinkLayout::None;
  Backend backend = Backend::Auto;
  // default: MAGI_ATTENTION_DETERMINISTIC_MODE. Bitwise-equal results for equal calls; asking for max_logits (or
  // not) is part of the call: the GPU forward then tracks exact row maxima, which moves out's last bits.
  std::optional<bool> deterministic;
  int32_t num_threads = 0;              // CPU engine: 0 = all cores (at most kMaxThreads)
};

// Opaque stream handle (cudaStream_t for the CUDA backend; ignored on the CPU).
using StreamHandle = void*;

// Scratch memory for one call on a GPU, from the caller's allocator (e.g. a framework's caching allocator):
// at least workspace_bytes(args, options) bytes on the tensors' device, 16-byte aligned, used by nothing else
// until the call's work on its stream is done. Optional: without it the cuda backend keeps its own buffer per
// (device, stream), allocated on that stream's first call, so a CUDA graph captured on a stream that never
// ran the call needs one. Host backends ignore it.
struct Workspace {
  void* data = nullptr;
  int64_t bytes = 0;
};

struct ForwardArgs {
  TensorView q, k, v;    // bf16 | fp16 | fp32 | fp64, all the same dtype
  TensorView sink;       // optional, fp32: [S, Hq] (sh) or [Tq, S, Hq] (ssh)
  TensorView out;        // [Tq, Hq, D], dtype of q or fp32
  TensorView lse;        // [Tq, Hq], fp32 (fp64 allowed for fp64 inputs)
  TensorView max_logits; // optional [Hq] fp32: max of s over each head's kept cells (-inf if none)
  // Optional, both or neither: a partial result of the same rows over other keys (fp32 [Tq, Hq, D] and its
  // lse [Tq, Hq]; fp64 also allowed for fp64 inputs), merged into this call's out / lse by the lse merge
  // (SPEC section 3), as when the keys arrive in parts (context parallelism). They may be out / lse
  // themselves (of the same dtype). max_logits covers this call's keys only. Backends cpu and cuda.
  TensorView prev_out, prev_lse;
  Workspace workspace;
};

struct BackwardArgs {
  TensorView q, k, v;
  TensorView out, lse;   // as returned by forward (lse includes the sink)
  TensorView dout;       // like out
  TensorView sink;       // optional, as in forward
  TensorView dq, dk, dv; // like q, k, v (fp32 also accepted)
  TensorView dsink;      // required iff sink is given: like sink, fp32
  // true: dq += this call's gradient (dq must be fp32 and hold the sum so far, as when the keys arrive in
  // parts); dk, dv, dsink are still overwritten. Backends cpu and cuda.
  bool accumulate_dq = false;
  Workspace workspace;
};

// Validates arguments (throws InvalidArgument naming the argument), then computes. Outputs (out, lse, max_logits;
// dq, dk, dv, dsink) may not share memory with each other or with an input; only prev_out / prev_lse may be out /
// lse themselves.
void forward(const Mask& mask, const ForwardArgs& args, const AttentionOptions& options = {},
             StreamHandle stream = nullptr);
void backward(const Mask& mask, const BackwardArgs& args, const AttentionOptions& options = {},
              StreamHandle stream = nullptr);

// The backend `forward` would use for these tensors and options (after env overrides).
Backend resolve_backend(const AttentionOptions& options, Device device);

// The slices that backend plans for `mask` (validated): with MAGI_ATTENTION_AUTO_RANGE_MERGE=1 merge_slices' fewer
// (in deterministic mode only merges that leave that backend's results bitwise unchanged: list neighbours meeting
// at multiples of 128 on cuda, 96 on the CPU engine, none on the GPU reference engine), else `mask` itself.
// forward / backward do this themselves, once per cached plan; this is for reports.
Mask planned_mask(const Mask& mask, const AttentionOptions& options, Device device);

// Bytes of args.workspace the call needs (0 where the backend needs none, e.g. on the CPU). Reads shapes,
// dtypes, the device and the dq address (an fp32, 16-byte aligned dq needs no accumulator), not the data.
int64_t workspace_bytes(const ForwardArgs& args, const AttentionOptions& options = {});
int64_t workspace_bytes(const BackwardArgs& args, const AttentionOptions& options = {});

}  // namespace magi
