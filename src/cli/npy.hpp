// NumPy .npy files (format versions 1.0 and 2.0): little-endian float32/float64, C order. Anything else
// is rejected with a message that names the file and says what is supported.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "magi/tensor.hpp"

namespace magi::cli {

struct NpyArray {
  DType dtype = DType::F32;     // F32 ('<f4') or F64 ('<f8'), as stored in the file
  std::vector<int64_t> shape;   // () for a scalar
  std::vector<double> values;   // widened to double (exact for both dtypes), C order

  int64_t numel() const;
  std::string shape_string() const;  // "[4, 8, 64]"
};

// Throws magi::InvalidArgument "<path>: <problem>" for a missing file, bad magic or version, a header
// that is not a valid dict, unsupported dtype or byte order, fortran_order True, or truncated/extra data.
NpyArray read_npy(const std::string& path);
NpyArray parse_npy(std::span<const unsigned char> bytes, const std::string& path);

// Serialises `values` (C order, length = product of shape) as '<f4' or '<f8'. dtype must be F32 or F64.
std::vector<unsigned char> encode_npy(DType dtype, std::span<const int64_t> shape, std::span<const double> values);
std::vector<unsigned char> encode_npy(std::span<const int64_t> shape, std::span<const float> values);  // '<f4'
// Writes `bytes` to `path` (throws InvalidArgument naming the path on failure).
void write_file(const std::string& path, std::span<const unsigned char> bytes);

}  // namespace magi::cli
