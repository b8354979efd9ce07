#include "cli/device_buffers.hpp"

#include <map>
#include <utility>

#include "magi/error.hpp"

#if MAGI_ATTN_CUDA_BACKEND
#include "cuda/check.hpp"
#endif

namespace magi::cli {

bool runs_on_gpu(Backend requested) {
  switch (requested) {
    case Backend::Cpu: return false;
    case Backend::Auto:
    case Backend::Reference: return gpu_available();
    case Backend::Cuda: break;
  }
#if MAGI_ATTN_CUDA_BACKEND
  if (!gpu_available())
    throw InvalidArgument("--backend cuda: no CUDA GPU is available on this machine (allowed here: auto, cpu, reference)");
#else
  throw InvalidArgument("--backend cuda: this build has no CUDA backend (allowed: auto, cpu, reference)");
#endif
  return true;
}

Backend gpu_backend(Backend requested, DType dtype) {
  const bool wide = dtype == DType::F32 || dtype == DType::F64;
  if (requested == Backend::Cuda && wide)
    throw InvalidArgument("--backend cuda: the GPU kernels take bf16 or fp16, not " + std::string(to_string(dtype)) +
                          " (use --dtype bf16|fp16, or --backend reference for the exact fp32/fp64 GPU engine)");
  if (requested == Backend::Auto && wide) return Backend::Reference;
  return requested;
}

#if MAGI_ATTN_CUDA_BACKEND
namespace {

using cuda::check;

// One owning device allocation with a CUDA view of the host tensor's shape.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(HostTensor& host) : view_(host.view()) {
    view_.device = Device{DeviceType::CUDA, 0};
    const size_t bytes = static_cast<size_t>(view_.nbytes());
    check(cudaMalloc(&data_, bytes == 0 ? 1 : bytes), "cudaMalloc");
    if (bytes) check(cudaMemcpy(data_, view_.data, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to the GPU");
    view_.data = data_;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(data_); }
  const TensorView& view() const { return view_; }

 private:
  TensorView view_;
  void* data_ = nullptr;
};

}  // namespace

bool gpu_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

std::string gpu_name() {
  cudaDeviceProp prop{};
  if (!gpu_available() || cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "";
  return prop.name;
}

struct DeviceMirror::Impl {
  std::map<const HostTensor*, std::unique_ptr<DeviceBuffer>> buffers;
  cudaStream_t stream = nullptr;
};

DeviceMirror::DeviceMirror() : impl_(std::make_unique<Impl>()) {
  check(cudaSetDevice(0), "cudaSetDevice");
  check(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking), "cudaStreamCreate");
}

DeviceMirror::~DeviceMirror() {
  cudaStreamSynchronize(impl_->stream);
  impl_->buffers.clear();
  cudaStreamDestroy(impl_->stream);
}

TensorView DeviceMirror::operator()(HostTensor& host) {
  if (host.shape().empty()) return {};
  auto& slot = impl_->buffers[&host];
  if (!slot) slot = std::make_unique<DeviceBuffer>(host);
  return slot->view();
}

void DeviceMirror::download(HostTensor& host) {
  const auto it = impl_->buffers.find(&host);
  if (it == impl_->buffers.end()) throw Error("DeviceMirror::download: the tensor has no device copy");
  synchronize();
  const TensorView h = host.view();
  if (h.nbytes())
    check(cudaMemcpy(h.data, it->second->view().data, static_cast<size_t>(h.nbytes()), cudaMemcpyDeviceToHost),
          "cudaMemcpy from the GPU");
}

StreamHandle DeviceMirror::stream() const { return impl_->stream; }

void DeviceMirror::synchronize() const { check(cudaStreamSynchronize(impl_->stream), "cudaStreamSynchronize"); }

#else

bool gpu_available() { return false; }
std::string gpu_name() { return ""; }

struct DeviceMirror::Impl {};
DeviceMirror::DeviceMirror() { throw NotAvailable("this build has no CUDA backend: no GPU copies"); }
DeviceMirror::~DeviceMirror() = default;
TensorView DeviceMirror::operator()(HostTensor&) { return {}; }
void DeviceMirror::download(HostTensor&) {}
StreamHandle DeviceMirror::stream() const { return nullptr; }
void DeviceMirror::synchronize() const {}

#endif

}  // namespace magi::cli
