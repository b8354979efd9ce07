// Reading and writing single elements of host buffers in any dtype (bf16/fp16 stored as bits), in double.
// Used where partial results change precision: on the wire, in merges and accumulations.
#pragma once

#include <cstdint>

#include "magi/tensor.hpp"

namespace magi::comm {

inline double load_element(DType dtype, const void* data, int64_t i) {
  switch (dtype) {
    case DType::F64: return static_cast<const double*>(data)[i];
    case DType::F32: return static_cast<const float*>(data)[i];
    case DType::BF16: return bf16_bits_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::F16: return fp16_bits_to_float(static_cast<const uint16_t*>(data)[i]);
  }
  return 0.0;
}

inline void store_element(DType dtype, void* data, int64_t i, double value) {
  switch (dtype) {
    case DType::F64: static_cast<double*>(data)[i] = value; return;
    case DType::F32: static_cast<float*>(data)[i] = static_cast<float>(value); return;
    case DType::BF16: static_cast<uint16_t*>(data)[i] = float_to_bf16_bits(static_cast<float>(value)); return;
    case DType::F16: static_cast<uint16_t*>(data)[i] = float_to_fp16_bits(static_cast<float>(value)); return;
  }
}

}  // namespace magi::comm
