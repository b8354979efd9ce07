// Argument checks shared by the API edge (src/api/attention.cpp) and the engines behind it: each throws
// InvalidArgument naming the argument and what is allowed.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "magi/attention.hpp"
#include "magi/error.hpp"

namespace magi::api {

// The problem's sizes, read off q and k once they are checked.
struct Shapes {
  int64_t tq = 0, tk = 0, hq = 0, hkv = 0, d = 0;
};

std::string describe(const TensorView& t);  // "bf16 [4096, 8, 128]"
void require_defined(const TensorView& t, const char* name);
void require_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> dims, const char* expected);
void require_dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed);
void require_device(const TensorView& t, const char* name, Device device);
void require_aligned(const TensorView& t, const char* name, size_t bytes, std::string_view who);
// Whether two tensors' bytes overlap (host or device addresses alike).
bool overlaps(const TensorView& a, const TensorView& b);
// Outputs pairwise disjoint and disjoint from every input (tensors not given are skipped).
struct Named {
  const TensorView* tensor;
  const char* name;
};
void require_disjoint(std::initializer_list<Named> outputs, std::initializer_list<Named> inputs);
// softmax_scale finite; softcap 0 or within fp32's normal range (the kernels divide by it in fp32).
void require_valid_scalars(const AttentionOptions& options);

}  // namespace magi::api
