// NumPy .npy files (format versions 1.0 and 2.0): little-endian float32/float64, C order. Anything else
// is rejected with a message that names the file and says what is supported.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
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

// Output files that never leave a partial file behind and never clobber an existing one on failure: `write` fills
// a temporary beside `path` (same folder, so the rename is atomic), which is renamed over `path` only on success
// and removed otherwise. A `path` that exists but is not a regular file (a device, a FIFO) is refused. Errors are
// InvalidArgument naming `path`.
void replace_file(const std::string& path, const std::function<void(const std::string& temporary)>& write);
void replace_file(const std::string& path, std::span<const unsigned char> bytes);
// A temporary name beside `path`: ".NAME.tmp.PID" in its folder.
std::filesystem::path temporary_beside(const std::filesystem::path& path);
// Whether `a` and `b` are the same file: equivalent when both exist, else equal weakly canonical paths.
bool same_file(const std::filesystem::path& a, const std::filesystem::path& b);

}  // namespace magi::cli
