#include "arrays.hpp"

#include <algorithm>
#include <cstdlib>
#include <new>

#include "magi/error.hpp"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#if MAGI_ATTN_CUDA_BACKEND
#include "cuda/check.hpp"
#endif

namespace magi::python {
namespace {

constexpr const char* kAllowedDtypes = "bfloat16, float16, float32, float64";
constexpr const char* kNotContiguous =
    "must be row-major contiguous (make a contiguous copy first, e.g. .contiguous() or numpy.ascontiguousarray)";

std::string dtype_text(nb::dlpack::dtype t) {
  const std::string kind = t.code == uint8_t(nb::dlpack::dtype_code::Int)      ? "int"
                           : t.code == uint8_t(nb::dlpack::dtype_code::UInt)   ? "uint"
                           : t.code == uint8_t(nb::dlpack::dtype_code::Float)  ? "float"
                           : t.code == uint8_t(nb::dlpack::dtype_code::Bfloat) ? "bfloat"
                           : t.code == uint8_t(nb::dlpack::dtype_code::Bool)   ? "bool"
                                                                                : "dtype code " + std::to_string(t.code) + " ";
  return kind + std::to_string(t.bits) + (t.lanes != 1 ? "x" + std::to_string(t.lanes) : "");
}

DType dtype_of(nb::dlpack::dtype t, const char* name) {
  if (t.lanes == 1) {
    if (t.code == uint8_t(nb::dlpack::dtype_code::Float)) {
      if (t.bits == 64) return DType::F64;
      if (t.bits == 32) return DType::F32;
      if (t.bits == 16) return DType::F16;
    }
    if (t.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return DType::BF16;
  }
  throw InvalidArgument(std::string(name) + ": dtype " + dtype_text(t) + " is not supported (allowed: " +
                        kAllowedDtypes + ")");
}

template <class Array>
TensorView dlpack_view(const Array& a, const char* name) {
  if (a.ndim() > static_cast<size_t>(TensorView::kMaxDims))
    throw InvalidArgument(std::string(name) + ": " + std::to_string(a.ndim()) + " dimensions (allowed: at most " +
                          std::to_string(TensorView::kMaxDims) + ")");
  TensorView v;
  v.dtype = dtype_of(a.dtype(), name);
  v.ndim = static_cast<int32_t>(a.ndim());
  // Row-major contiguous: each stride (in elements) is the product of the later dims; size-1 dims are free, and so
  // is every stride of an array without elements (producers give those arbitrary strides).
  int64_t expected = 1;
  bool contiguous = true;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.shape[i] = static_cast<int64_t>(a.shape(static_cast<size_t>(i)));
    if (a.stride_ptr() != nullptr && v.shape[i] != 1 && a.stride(static_cast<size_t>(i)) != expected) contiguous = false;
    expected *= v.shape[i];
  }
  if (!contiguous && expected != 0) throw InvalidArgument(std::string(name) + ": " + kNotContiguous);
  switch (a.device_type()) {
    case nb::device::cpu::value: v.device = {DeviceType::CPU, 0}; break;
    case nb::device::cuda::value: v.device = {DeviceType::CUDA, a.device_id()}; break;
    default:
      throw InvalidArgument(std::string(name) + ": arrays on DLPack device type " + std::to_string(a.device_type()) +
                            " are not supported (allowed: CPU, CUDA)");
  }
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  return v;
}

// torch.Tensor and its dtypes, looked up once torch is imported (never imported from here).
struct Torch {
  PyTypeObject* tensor = nullptr;
  nb::object bf16, fp16, fp32, fp64;
};

const Torch* torch_if_loaded() {
  static Torch torch;
  static bool ready = false;
  if (ready) return &torch;
  PyObject* module = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed
  if (module == nullptr) return nullptr;
  nb::handle m(module);
  torch.tensor = reinterpret_cast<PyTypeObject*>(m.attr("Tensor").ptr());
  torch.bf16 = m.attr("bfloat16");
  torch.fp16 = m.attr("float16");
  torch.fp32 = m.attr("float32");
  torch.fp64 = m.attr("float64");
  ready = true;
  return &torch;
}

TensorView torch_view(nb::handle t, const Torch& torch, const char* name) {
  TensorView v;
  nb::object dtype = t.attr("dtype");
  if (dtype.is(torch.bf16)) v.dtype = DType::BF16;
  else if (dtype.is(torch.fp16)) v.dtype = DType::F16;
  else if (dtype.is(torch.fp32)) v.dtype = DType::F32;
  else if (dtype.is(torch.fp64)) v.dtype = DType::F64;
  else
    throw InvalidArgument(std::string(name) + ": dtype " + nb::cast<std::string>(nb::str(dtype)) +
                          " is not supported (allowed: " + kAllowedDtypes + ")");
  nb::object shape = t.attr("shape");
  const size_t ndim = nb::len(shape);
  if (ndim > static_cast<size_t>(TensorView::kMaxDims))
    throw InvalidArgument(std::string(name) + ": " + std::to_string(ndim) + " dimensions (allowed: at most " +
                          std::to_string(TensorView::kMaxDims) + ")");
  v.ndim = static_cast<int32_t>(ndim);
  for (size_t i = 0; i < ndim; ++i) v.shape[i] = nb::cast<int64_t>(shape[i]);
  if (!nb::cast<bool>(t.attr("is_contiguous")())) throw InvalidArgument(std::string(name) + ": " + kNotContiguous);
  if (nb::cast<bool>(t.attr("is_cuda"))) v.device = {DeviceType::CUDA, nb::cast<int32_t>(t.attr("get_device")())};
  else if (nb::cast<bool>(t.attr("is_cpu"))) v.device = {DeviceType::CPU, 0};
  else {
    // Through an object: nb::str(accessor) would cast the torch.device itself to str (std::bad_cast).
    const nb::object device = t.attr("device");
    throw InvalidArgument(std::string(name) + ": tensors on " + nb::cast<std::string>(nb::str(device)) +
                          " are not supported (allowed: CPU, CUDA)");
  }
  v.data = reinterpret_cast<void*>(nb::cast<uintptr_t>(t.attr("data_ptr")()));
  return v;
}

}  // namespace

TensorView view_of(nb::handle obj, const char* name, bool writable) {
  if (const Torch* torch = torch_if_loaded(); torch != nullptr && PyObject_TypeCheck(obj.ptr(), torch->tensor))
    return torch_view(obj, *torch, name);
  if (!nb::hasattr(obj, "__dlpack__"))
    throw nb::type_error((std::string(name) + ": expected an array (numpy, torch, JAX, CuPy or any DLPack producer), "
                          "got " + nb::cast<std::string>(nb::str(obj.type().attr("__name__")))).c_str());
  try {
    return writable ? dlpack_view(nb::cast<OutArray>(obj), name) : dlpack_view(nb::cast<InArray>(obj), name);
  } catch (const nb::cast_error&) {
    throw InvalidArgument(std::string(name) + (writable ? ": cannot write into this array (read-only, or not importable "
                                                          "through DLPack; allowed: writable arrays)"
                                                        : ": not importable through DLPack"));
  }
}

TensorView optional_view(nb::handle obj, const char* name, bool writable) {
  return obj.is_none() ? TensorView() : view_of(obj, name, writable);
}

ForwardArgs forward_args(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
                         nb::handle max_logits, nb::handle sink) {
  ForwardArgs a;
  a.q = view_of(q, "q", false);
  a.k = view_of(k, "k", false);
  a.v = view_of(v, "v", false);
  a.out = view_of(out, "out", true);
  a.lse = view_of(lse, "lse", true);
  a.max_logits = optional_view(max_logits, "max_logits", true);
  a.sink = optional_view(sink, "sink", false);
  return a;
}

BackwardArgs backward_args(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
                           nb::handle dout, nb::handle dq, nb::handle dk, nb::handle dv, nb::handle sink,
                           nb::handle dsink) {
  BackwardArgs a;
  a.q = view_of(q, "q", false);
  a.k = view_of(k, "k", false);
  a.v = view_of(v, "v", false);
  a.out = view_of(out, "out", false);
  a.lse = view_of(lse, "lse", false);
  a.dout = view_of(dout, "do", false);
  a.dq = view_of(dq, "dq", true);
  a.dk = view_of(dk, "dk", true);
  a.dv = view_of(dv, "dv", true);
  a.sink = optional_view(sink, "sink", false);
  a.dsink = optional_view(dsink, "dsink", true);
  return a;
}

LibraryArray::LibraryArray(const std::vector<int64_t>& shape, DType dtype, Device device)
    : dtype_(dtype), device_(device) {
  size_t elements = 1;
  for (int64_t d : shape) {
    if (d < 0) throw InvalidArgument("empty: negative dimension");
    shape_.push_back(static_cast<size_t>(d));
    elements *= static_cast<size_t>(d);
  }
  const size_t bytes = std::max<size_t>(elements * static_cast<size_t>(dtype_size(dtype)), 1);
  if (device.type == DeviceType::CPU) {
    data_ = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (data_ == nullptr) throw std::bad_alloc();
    return;
  }
#if MAGI_ATTN_CUDA_BACKEND
  cuda::DeviceGuard guard(device.index);
  cuda::check(cudaMalloc(&data_, bytes), "cudaMalloc (an output array)");
#else
  throw NotAvailable("CUDA arrays: this build of magi_attn has no CUDA backend (allowed: CPU arrays)");
#endif
}

LibraryArray::~LibraryArray() {
  if (device_.type == DeviceType::CPU) {
    std::free(data_);
    return;
  }
#if MAGI_ATTN_CUDA_BACKEND
  cudaFree(data_);
#endif
}

size_t LibraryArray::nbytes() const {
  size_t n = static_cast<size_t>(dtype_size(dtype_));
  for (size_t d : shape_) n *= d;
  return n;
}

nb::object LibraryArray::dlpack(nb::handle self, nb::kwargs kwargs) const {
  const nb::dlpack::dtype dt = dtype_ == DType::F64   ? nb::dtype<double>()
                               : dtype_ == DType::F32 ? nb::dtype<float>()
                               : dtype_ == DType::F16 ? nb::dlpack::dtype{uint8_t(nb::dlpack::dtype_code::Float), 16, 1}
                                                      : nb::dlpack::dtype{uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
  // nanobind's array-API object speaks the whole protocol (versioned capsules when the consumer asks).
  nb::ndarray<nb::array_api> array(data_, shape_.size(), shape_.data(), self, nullptr, dt,
                                   device_.type == DeviceType::CPU ? nb::device::cpu::value : nb::device::cuda::value,
                                   device_.index);
  return nb::cast(array).attr("__dlpack__")(**kwargs);
}

void bind_arrays(nb::module_& m) {
  nb::class_<LibraryArray>(m, "LibraryArray")
      .def("__dlpack__", [](nb::handle self, nb::kwargs kwargs) {
        return nb::cast<const LibraryArray&>(self).dlpack(self, std::move(kwargs));
      })
      .def_prop_ro("address", &LibraryArray::address)
      .def_prop_ro("nbytes", &LibraryArray::nbytes)
      .def("__dlpack_device__", [](const LibraryArray& a) {
        return nb::make_tuple(a.device().type == DeviceType::CPU ? 1 : 2, a.device().index);
      });
  m.def(
      "empty",
      [](const std::vector<int64_t>& shape, const std::string& dtype, const std::string& device, int32_t index) {
        return new LibraryArray(shape, parse_dtype(dtype, "dtype"),
                                Device{device == "cuda" ? DeviceType::CUDA : DeviceType::CPU, index});
      },
      nb::arg("shape"), nb::arg("dtype"), nb::arg("device"), nb::arg("index"), nb::rv_policy::take_ownership,
      "An uninitialised array owned by the library, importable through DLPack.");
}

}  // namespace magi::python
