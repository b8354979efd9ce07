// The CLI's GPU path: where a command runs (host or GPU 0) and device copies of its host tensors.
// Without the CUDA backend (MAGI_ATTN_CUDA_BACKEND) no GPU is ever chosen: --backend cuda is refused with one
// clear line, and DeviceMirror cannot be constructed.
#pragma once

#include <memory>
#include <string>

#include "cli/host_tensor.hpp"
#include "magi/attention.hpp"

namespace magi::cli {

// True when this build has the CUDA backend and cudaGetDeviceCount finds a GPU.
bool gpu_available();
// The name of GPU 0 ("NVIDIA H200"), or "" without a GPU.
std::string gpu_name();

// Whether --backend `requested` runs on the GPU: cuda always (InvalidArgument naming --backend when no GPU
// can run it), reference and auto when a GPU is available, cpu never.
bool runs_on_gpu(Backend requested);
// The backend to pass with device tensors: bf16/fp16 keep the request; fp32/fp64 go to the exact GPU
// reference engine under auto (the fast kernels take 16-bit inputs) and are refused under cuda.
Backend gpu_backend(Backend requested, DType dtype);

// Device copies (GPU 0) of host tensors, made on first use and freed with the mirror, plus one stream.
class DeviceMirror {
 public:
  DeviceMirror();  // throws NotAvailable without the CUDA backend
  ~DeviceMirror();
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;

  // The device view of `host`, uploaded on first use (an undefined host tensor gives an undefined view).
  TensorView operator()(HostTensor& host);
  // Copies the device copy of `host` back into it, after the stream's work (synchronous).
  void download(HostTensor& host);
  StreamHandle stream() const;
  void synchronize() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace magi::cli
