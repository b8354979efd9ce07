// The exact GPU reference engine (backend `reference` on device tensors; MAGI_ATTENTION_SDPA_BACKEND=1 or
// MAGI_ATTENTION_KERNEL_BACKEND=sdpa): every dtype is accumulated in fp64, one thread block per (row, head)
// or (key, kv head), slices read through magi::kept_keys / kept_queries. Exact and deterministic (fixed
// reduction orders, no atomics) rather than fast; it checks the fast kernels and serves high-precision runs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "magi/attention.hpp"
#include "magi/mask.hpp"

namespace magi::cuda::reference {

// Resolved options (the API layer applies the D^-0.5 default and env overrides).
struct Options {
  double softmax_scale = 0.0;
  double softcap = 0.0;  // > 0 enables softcapping
  SinkLayout sink_layout = SinkLayout::None;
};

// The mask on the device (slices plus per-row and per-key slice lists) and fp64 row workspaces. Built and
// uploaded once per (mask, shapes, device); execution then allocates nothing. A plan's workspace serves
// one stream at a time.
struct Plan;

// Synchronous (uploads the mask). head_dim up to 1024.
std::shared_ptr<Plan> make_plan(const Mask& mask, int32_t heads_q, int32_t heads_kv, int32_t head_dim,
                                int32_t device);

// Device pointers in args, validated by the API layer: q/k/v any of fp64, fp32, bf16, fp16; outputs and
// gradients in the input dtype or fp32; lse fp32 or fp64. Asynchronous on `stream`, capturable.
// The backward uses the given out and lse (Delta = dout . out), as SPEC section 3 states.
void forward(const Plan& plan, const ForwardArgs& args, const Options& options, cudaStream_t stream);
void backward(const Plan& plan, const BackwardArgs& args, const Options& options, cudaStream_t stream);

}  // namespace magi::cuda::reference
