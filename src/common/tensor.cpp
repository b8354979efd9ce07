#include "magi/tensor.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "magi/error.hpp"

namespace magi {

std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::F64: return "fp64";
    case DType::F32: return "fp32";
    case DType::BF16: return "bf16";
    case DType::F16: return "fp16";
  }
  return "?";
}

DType parse_dtype(std::string_view text, std::string_view what) {
  if (text == "fp64" || text == "float64") return DType::F64;
  if (text == "fp32" || text == "float32") return DType::F32;
  if (text == "bf16" || text == "bfloat16") return DType::BF16;
  if (text == "fp16" || text == "float16") return DType::F16;
  throw InvalidArgument(std::string(what) + ": unknown dtype '" + std::string(text) +
                        "' (allowed: bf16, fp16, fp32, fp64)");
}

std::string shape_string(const TensorView& t) {
  std::ostringstream os;
  os << '[';
  // A hand-set ndim outside [0, kMaxDims] must not read past `shape`.
  const int shown = std::clamp(t.ndim, 0, TensorView::kMaxDims);
  for (int i = 0; i < shown; ++i) os << (i ? ", " : "") << t.shape[i];
  if (t.ndim != shown) os << (shown ? ", " : "") << "... (ndim " << t.ndim << ")";
  os << ']';
  return os.str();
}

uint16_t float_to_fp16_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow (>= 65520) -> inf
  if (abs < 0x38800000u) {  // result is subnormal or zero: scale into units of 2^-24, round half even
    const float a = std::fabs(f) * 16777216.0f;  // exact: power-of-two scaling of a small value
    const float r = std::nearbyint(a);             // default rounding mode: to nearest even
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(r));
  }
  // normal: re-bias exponent, round mantissa from 23 to 10 bits, half to even
  uint32_t m = abs + 0xc8000000u;  // exponent - 112 (127 - 15) in the high bits
  m += 0xfffu + ((m >> 13) & 1u);
  return static_cast<uint16_t>(sign | (m >> 13));
}

float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  uint32_t bits;
  if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
  else bits = sign | ((exp + 112) << 23) | (man << 13);
  std::memcpy(&f, &bits, 4);
  return f;
}

double round_to(DType dtype, double x) {
  switch (dtype) {
    case DType::F64: return x;
    case DType::F32: return static_cast<float>(x);
    case DType::BF16: return bf16_bits_to_float(float_to_bf16_bits(static_cast<float>(x)));
    case DType::F16: return fp16_bits_to_float(float_to_fp16_bits(static_cast<float>(x)));
  }
  return x;
}

}  // namespace magi
