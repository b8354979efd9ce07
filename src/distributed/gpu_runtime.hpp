// The device half of distributed attention (SPEC section 4) on the NCCL engine: dispatch/undispatch of
// device tensors and overlapped forward/backward. Built when the library has NCCL and the CUDA backend
// (MAGI_ATTN_WITH_NCCL); runtime.cpp routes CUDA tensors here.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "distributed/runtime.hpp"

namespace magi::dist::gpu {

// Per-runtime device state (streams, events, routes on the device, staging buffers for one dtype).
// Created on the first device call of a runtime and reused by later calls.
struct State;
std::shared_ptr<State> make_state(const DistAttnRuntime& runtime);

// `stream`: the caller's; the work runs after what it holds and its later work after the call.
void forward(const DistAttnRuntime& runtime, State& state, const ForwardArgs& local, cudaStream_t stream);
void backward(const DistAttnRuntime& runtime, State& state, const BackwardArgs& local, cudaStream_t stream);

// Device-tensor dispatch (local copies) and undispatch (allgather through NCCL).
void dispatch(const DistAttnRuntime& runtime, const Partition& partition, const TensorView& global,
              const TensorView& local, cudaStream_t stream);
void undispatch(const DistAttnRuntime& runtime, const Partition& partition, const TensorView& local,
                const TensorView& global, cudaStream_t stream);

// Device-tensor roll along the global sequence (roll_routes in dispatch.hpp): one all-to-all-v through NCCL of
// contiguous runs of rows; `out` may be `local`. Like dispatch, it returns once the rows have moved.
void roll(const DistAttnRuntime& runtime, const Partition& partition, const TensorView& local, const TensorView& out,
          int64_t shift, cudaStream_t stream);

}  // namespace magi::dist::gpu
