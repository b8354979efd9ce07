// CUDA runtime calls outside the kernels: a failed call throws (library code never exits) an error that names the
// call, and DeviceGuard makes a device current for a scope and restores the caller's. The one copy of both, for
// the backend, the distributed runtime, the NCCL engine, the CLI and the Python extension.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "magi/error.hpp"

namespace magi::cuda {

// Throws E (magi::Error unless told otherwise, e.g. comm::CommError) "CUDA <what> failed: <reason>".
template <class E = Error>
void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw E(std::string("CUDA ") + what + " failed: " + cudaGetErrorString(err));
}

// Makes `device` current for the scope and restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace magi::cuda
