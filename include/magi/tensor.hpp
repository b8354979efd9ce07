// A small non-owning tensor view: data pointer, dtype, shape, device. Row-major and contiguous only.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "magi/error.hpp"

namespace magi {

enum class DType : int32_t { F64, F32, BF16, F16 };
std::string_view to_string(DType dtype);  // "fp64" | "fp32" | "bf16" | "fp16"
DType parse_dtype(std::string_view text, std::string_view what = "dtype");
constexpr int64_t dtype_size(DType d) { return d == DType::F64 ? 8 : d == DType::F32 ? 4 : 2; }

enum class DeviceType : int32_t { CPU, CUDA };
struct Device {
  DeviceType type = DeviceType::CPU;
  int32_t index = 0;
  friend constexpr bool operator==(const Device&, const Device&) = default;
};

struct TensorView {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::F32;
  int32_t ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  Device device{};

  TensorView() = default;
  TensorView(void* ptr, DType dt, std::initializer_list<int64_t> dims, Device dev = {})
      : data(ptr), dtype(dt), ndim(static_cast<int32_t>(dims.size())), device(dev) {
    // More dims would be written past `shape` (over `device`).
    if (dims.size() > kMaxDims)
      throw InvalidArgument("TensorView: " + std::to_string(dims.size()) + " dimensions (allowed: at most " +
                            std::to_string(kMaxDims) + ")");
    int i = 0;
    for (int64_t d : dims) shape[i++] = d;
  }

  bool defined() const { return data != nullptr || (ndim > 0 && numel() == 0); }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return ndim == 0 ? 0 : n;
  }
  int64_t nbytes() const { return numel() * dtype_size(dtype); }
  template <class T>
  T* as() const { return static_cast<T*>(data); }
};

std::string shape_string(const TensorView& t);  // e.g. "[4096, 8, 128]"

// ---- 16-bit float conversion (round to nearest even), used to emulate bf16/fp16 on the CPU ----
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t float_to_fp16_bits(float f);
float fp16_bits_to_float(uint16_t h);
// Round a value to the precision of `dtype` (identity for F64; F32 rounds a double to float).
double round_to(DType dtype, double x);

}  // namespace magi
