// Arrays from Python (any DLPack producer: numpy, torch, JAX, CuPy, ...) as the library's TensorViews, and
// arrays the extension allocates itself for frameworks without a mutable allocator (JAX, other producers).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "magi/attention.hpp"
#include "magi/tensor.hpp"

namespace magi::python {

namespace nb = nanobind;

// Inputs may be read-only; outputs must be writable.
using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

// A view of array `obj`, checked: dtype bf16 / fp16 / fp32 / fp64, row-major contiguous, on the CPU or a CUDA
// device; outputs (`writable`) must not be read-only. torch tensors are read from their attributes (data_ptr,
// shape, dtype, device: a fraction of a DLPack export's cost, and tensors that need grad pass), every other
// array through DLPack (numpy, JAX, CuPy, ...). No copy. Errors name `name` and the allowed values. `obj` must
// stay alive while the view is used.
TensorView view_of(nb::handle obj, const char* name, bool writable);
// None -> an empty view (an absent optional tensor).
TensorView optional_view(nb::handle obj, const char* name, bool writable);

// The C++ API's argument structs from Python arrays (max_logits, sink, dsink may be None).
ForwardArgs forward_args(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
                         nb::handle max_logits, nb::handle sink);
BackwardArgs backward_args(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
                           nb::handle dout, nb::handle dq, nb::handle dk, nb::handle dv, nb::handle sink,
                           nb::handle dsink);

// An array the extension allocates (the CPU, or a CUDA device: cudaMalloc), for frameworks without mutable
// arrays of their own (JAX, other DLPack producers): frameworks import it through DLPack (__dlpack__,
// __dlpack_device__), each import a fresh capsule that keeps this object, and so the memory, alive. Needs
// nanobind >= 3 (its array-API ndarray).
class LibraryArray {
 public:
  LibraryArray(const std::vector<int64_t>& shape, DType dtype, Device device);
  ~LibraryArray();
  LibraryArray(const LibraryArray&) = delete;
  LibraryArray& operator=(const LibraryArray&) = delete;

  // __dlpack__(**kwargs): a DLPack capsule whose owner is `self` (the protocol's keywords honoured).
  nb::object dlpack(nb::handle self, nb::kwargs kwargs) const;
  Device device() const { return device_; }
  uintptr_t address() const { return reinterpret_cast<uintptr_t>(data_); }
  size_t nbytes() const;

 private:
  void* data_ = nullptr;
  std::vector<size_t> shape_;
  DType dtype_;
  Device device_;
};

void bind_arrays(nb::module_& m);

}  // namespace magi::python
