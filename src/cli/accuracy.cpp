#include "cli/accuracy.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace magi::cli {

Tolerance tolerance_for(DType dtype) {
  switch (dtype) {
    case DType::F64: return {true, 1e-10, 1e-10, 1e-9};
    case DType::F32: return {false, 1e-5, 1e-5, 1e-5};
    case DType::F16: return {false, 2e-3, 5e-3, 1e-3};
    case DType::BF16: return {false, 1e-2, 2e-2, 1e-3};
  }
  return {false, 0, 0, 0};
}

double relative_error(const std::vector<double>& got, const std::vector<double>& ref, bool max_relative) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double diff = std::fabs(got[i] - ref[i]);
    if (std::isnan(diff)) return std::numeric_limits<double>::quiet_NaN();
    if (max_relative) {
      num = std::max(num, diff);
      den = std::max(den, std::fabs(ref[i]));
    } else {
      num += diff * diff;
      den += ref[i] * ref[i];
    }
  }
  if (!max_relative) num = std::sqrt(num), den = std::sqrt(den);
  return den > 0.0 ? num / den : num;
}

double lse_error(const std::vector<double>& got, const std::vector<double>& ref) {
  double worst = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) {
      if (got[i] != ref[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    const double diff = std::fabs(got[i] - ref[i]);
    if (std::isnan(diff)) return std::numeric_limits<double>::quiet_NaN();
    worst = std::max(worst, diff);
  }
  return worst;
}

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string rate_text(double flops, double seconds) {
  char text[64];
  const double per_second = seconds > 0.0 ? flops / seconds : 0.0;
  if (per_second >= 1e12) std::snprintf(text, sizeof text, "%.2f TFLOP/s", per_second / 1e12);
  else std::snprintf(text, sizeof text, "%.1f GFLOP/s", per_second / 1e9);
  return text;
}

}  // namespace magi::cli
