// An owning host tensor in any magi dtype, for the CLI: values go in and out as double and are rounded
// to the tensor's dtype (round to nearest even for bf16/fp16) on the way in.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "magi/tensor.hpp"

namespace magi::cli {

class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape);  // zero-filled
  static HostTensor from_values(DType dtype, std::vector<int64_t> shape, std::span<const double> values);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const { return numel_; }

  double get(int64_t i) const;
  void set(int64_t i, double value);  // rounds to dtype
  void fill(double value);
  std::vector<double> to_doubles() const;
  std::vector<float> to_floats() const;

  TensorView view();  // undefined view for a default-constructed tensor

 private:
  DType dtype_ = DType::F32;
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
  std::vector<double> storage_;  // raw bytes, 8-byte aligned for every dtype
};

}  // namespace magi::cli
