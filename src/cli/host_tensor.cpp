#include "cli/host_tensor.hpp"

#include <cstring>

#include "magi/error.hpp"

namespace magi::cli {

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
  if (shape_.size() > static_cast<size_t>(TensorView::kMaxDims))
    throw InvalidArgument("tensor rank " + std::to_string(shape_.size()) + " exceeds " +
                          std::to_string(TensorView::kMaxDims));
  numel_ = 1;
  for (int64_t d : shape_) numel_ *= d;
  storage_.assign(static_cast<size_t>((numel_ * dtype_size(dtype_) + 7) / 8), 0.0);
}

HostTensor HostTensor::from_values(DType dtype, std::vector<int64_t> shape, std::span<const double> values) {
  HostTensor t(dtype, std::move(shape));
  if (static_cast<int64_t>(values.size()) != t.numel_)
    throw InvalidArgument("HostTensor: " + std::to_string(values.size()) + " values for " +
                          std::to_string(t.numel_) + " elements");
  for (int64_t i = 0; i < t.numel_; ++i) t.set(i, values[static_cast<size_t>(i)]);
  return t;
}

double HostTensor::get(int64_t i) const {
  const auto* bytes = reinterpret_cast<const unsigned char*>(storage_.data());
  switch (dtype_) {
    case DType::F64: return reinterpret_cast<const double*>(bytes)[i];
    case DType::F32: return reinterpret_cast<const float*>(bytes)[i];
    case DType::BF16: return bf16_bits_to_float(reinterpret_cast<const uint16_t*>(bytes)[i]);
    case DType::F16: return fp16_bits_to_float(reinterpret_cast<const uint16_t*>(bytes)[i]);
  }
  return 0.0;
}

void HostTensor::set(int64_t i, double value) {
  auto* bytes = reinterpret_cast<unsigned char*>(storage_.data());
  switch (dtype_) {
    case DType::F64: reinterpret_cast<double*>(bytes)[i] = value; break;
    case DType::F32: reinterpret_cast<float*>(bytes)[i] = static_cast<float>(value); break;
    case DType::BF16: reinterpret_cast<uint16_t*>(bytes)[i] = float_to_bf16_bits(static_cast<float>(value)); break;
    case DType::F16: reinterpret_cast<uint16_t*>(bytes)[i] = float_to_fp16_bits(static_cast<float>(value)); break;
  }
}

void HostTensor::fill(double value) {
  for (int64_t i = 0; i < numel_; ++i) set(i, value);
}

std::vector<double> HostTensor::to_doubles() const {
  std::vector<double> values(static_cast<size_t>(numel_));
  for (int64_t i = 0; i < numel_; ++i) values[static_cast<size_t>(i)] = get(i);
  return values;
}

std::vector<float> HostTensor::to_floats() const {
  std::vector<float> values(static_cast<size_t>(numel_));
  for (int64_t i = 0; i < numel_; ++i) values[static_cast<size_t>(i)] = static_cast<float>(get(i));
  return values;
}

TensorView HostTensor::view() {
  TensorView v;
  if (shape_.empty()) return v;
  v.data = storage_.data();
  v.dtype = dtype_;
  v.ndim = static_cast<int32_t>(shape_.size());
  for (size_t i = 0; i < shape_.size(); ++i) v.shape[i] = shape_[i];
  return v;
}

}  // namespace magi::cli
