// How the demos judge and report results: the SPEC section 5 bounds against a reference, and number
// formatting for summaries.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "magi/tensor.hpp"

namespace magi::cli {

struct Tolerance {
  bool max_relative;  // fp64: max abs error / max |ref|; otherwise relative L2 error
  double out, grad, lse;
};
Tolerance tolerance_for(DType dtype);

// max |got - ref| / max |ref| (max_relative) or ||got - ref|| / ||ref||; NaN when got holds a NaN.
double relative_error(const std::vector<double>& got, const std::vector<double>& ref, bool max_relative);
// lse: max abs error where the reference is finite; -inf must match exactly (else +inf); NaN never passes.
double lse_error(const std::vector<double>& got, const std::vector<double>& ref);

std::string with_commas(int64_t n);                  // 1234567 -> "1,234,567"
std::string rate_text(double flops, double seconds);  // "1.23 TFLOP/s" or "45.6 GFLOP/s"

}  // namespace magi::cli
