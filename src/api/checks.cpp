#include "api/checks.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace magi::api {

std::string describe(const TensorView& t) { return std::string(to_string(t.dtype)) + " " + shape_string(t); }

void require_defined(const TensorView& t, const char* name) {
  if (t.ndim == 0) throw InvalidArgument(std::string(name) + " is required but was not given");
  // shape holds kMaxDims entries: a larger ndim would read past it.
  if (t.ndim < 0 || t.ndim > TensorView::kMaxDims)
    throw InvalidArgument(std::string(name) + ": ndim " + std::to_string(t.ndim) + " (allowed: 1 .. " +
                          std::to_string(TensorView::kMaxDims) + ")");
  if (t.device.type != DeviceType::CPU && t.device.type != DeviceType::CUDA)
    throw InvalidArgument(std::string(name) + ": unknown device type " + std::to_string(static_cast<int>(t.device.type)) +
                          " (allowed: CPU, CUDA)");
  int64_t bytes = static_cast<int64_t>(dtype_size(t.dtype));
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) throw InvalidArgument(std::string(name) + ": negative dimension in " + shape_string(t));
    if (__builtin_mul_overflow(bytes, t.shape[i], &bytes))
      throw InvalidArgument(std::string(name) + ": " + shape_string(t) + " holds more bytes than fit in int64");
  }
  if (t.data == nullptr && t.numel() > 0) throw InvalidArgument(std::string(name) + ": null data pointer");
}

void require_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> dims, const char* expected) {
  require_defined(t, name);
  bool ok = t.ndim == static_cast<int>(dims.size());
  int i = 0;
  for (int64_t d : dims) ok = ok && t.shape[i++] == d;
  if (!ok)
    throw InvalidArgument(std::string(name) + ": expected shape " + expected + " = " +
                          shape_string(TensorView(nullptr, t.dtype, dims)) + ", got " + shape_string(t));
}

void require_dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype == d) return;
  std::string list;  // {q's dtype, F32} names F32 once where q is fp32
  for (auto d = allowed.begin(); d != allowed.end(); ++d)
    if (std::find(allowed.begin(), d, *d) == d) list += (list.empty() ? "" : ", ") + std::string(to_string(*d));
  throw InvalidArgument(std::string(name) + ": dtype " + std::string(to_string(t.dtype)) +
                        " is not allowed here (allowed: " + list + ")");
}

void require_device(const TensorView& t, const char* name, Device device) {
  if (!(t.device == device))
    throw InvalidArgument(std::string(name) + ": all tensors must be on the same device as q");
}

void require_aligned(const TensorView& t, const char* name, size_t bytes, std::string_view who) {
  const auto address = reinterpret_cast<uintptr_t>(t.data);
  if (address % bytes != 0)
    throw InvalidArgument(std::string(name) + ": " + std::string(who) + " needs an address aligned to " +
                          std::to_string(bytes) + " bytes, got one " + std::to_string(address % bytes) +
                          " bytes past a multiple of " + std::to_string(bytes));
}

bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.data == nullptr || b.data == nullptr || a.nbytes() == 0 || b.nbytes() == 0) return false;
  const auto a0 = reinterpret_cast<uintptr_t>(a.data), b0 = reinterpret_cast<uintptr_t>(b.data);
  return a0 < b0 + static_cast<uintptr_t>(b.nbytes()) && b0 < a0 + static_cast<uintptr_t>(a.nbytes());
}

void require_disjoint(std::initializer_list<Named> outputs, std::initializer_list<Named> inputs) {
  for (auto a = outputs.begin(); a != outputs.end(); ++a) {
    for (auto b = a + 1; b != outputs.end(); ++b)
      if (overlaps(*a->tensor, *b->tensor))
        throw InvalidArgument(std::string(a->name) + ": overlaps " + b->name +
                              " (outputs may not share memory with each other or with an input)");
    for (const Named& in : inputs)
      if (overlaps(*a->tensor, *in.tensor))
        throw InvalidArgument(std::string(a->name) + ": overlaps the input " + in.name +
                              " (outputs may not share memory with each other or with an input)");
  }
}

namespace {
// "1e+39", not std::to_string's 40 digits (or "0.000000" for a tiny value).
std::string shortest(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", x);
  return text;
}
}  // namespace

void require_valid_scalars(const AttentionOptions& o) {
  // The kernels apply the scale in fp32: past fp32's largest it would be inf, and out NaN.
  if (o.softmax_scale &&
      (!std::isfinite(*o.softmax_scale) || std::abs(*o.softmax_scale) > std::numeric_limits<float>::max()))
    throw InvalidArgument("softmax_scale must be finite and at most 3.4e38 in magnitude (fp32's largest), got " +
                          shortest(*o.softmax_scale));
  if (!std::isfinite(o.softcap) || o.softcap < 0 || o.softcap > std::numeric_limits<float>::max())
    throw InvalidArgument("softcap must be finite and >= 0 (0 = off, at most 3.4e38: fp32's largest), got " +
                          shortest(o.softcap));
  // The kernels test and divide by softcap in fp32: below fp32's smallest normal it rounds (or flushes) to 0, and
  // the softcap was silently off.
  if (o.softcap > 0 && o.softcap < std::numeric_limits<float>::min())
    throw InvalidArgument("softcap must be 0 (off) or at least 1.2e-38 (fp32's smallest normal), got " +
                          shortest(o.softcap));
}

}  // namespace magi::api
