#include "reference/compare.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

namespace magi::test {

std::string_view to_string(Quantity quantity) {
  switch (quantity) {
    case Quantity::Out: return "out";
    case Quantity::Grad: return "grad";
    case Quantity::Lse: return "lse";
    case Quantity::MaxLogits: return "max_logits";
    case Quantity::DSink: return "dsink";
  }
  return "?";
}

namespace {

std::string_view to_string(Metric metric) {
  switch (metric) {
    case Metric::MaxAbsRelative: return "max abs error / max|ref|";
    case Metric::RelL2: return "rel L2 error";
    case Metric::MaxAbs: return "max abs error";
  }
  return "?";
}

double measured(const ErrorStats& e, Metric metric) {
  switch (metric) {
    case Metric::MaxAbsRelative: return e.max_abs_relative;
    case Metric::RelL2: return e.rel_l2;
    case Metric::MaxAbs: return e.max_abs;
  }
  return 0.0;
}

}  // namespace

Tolerance tolerance_for(Quantity quantity, DType dtype) {
  switch (quantity) {
    case Quantity::Out:
      switch (dtype) {
        case DType::F64: return {Metric::MaxAbsRelative, 1e-10};
        case DType::F32: return {Metric::RelL2, 1e-5};
        case DType::F16: return {Metric::RelL2, 2e-3};
        case DType::BF16: return {Metric::RelL2, 1e-2};
      }
      break;
    case Quantity::Grad:
      switch (dtype) {
        case DType::F64: return {Metric::MaxAbsRelative, 1e-10};
        case DType::F32: return {Metric::RelL2, 1e-5};
        case DType::F16: return {Metric::RelL2, 5e-3};
        case DType::BF16: return {Metric::RelL2, 2e-2};
      }
      break;
    case Quantity::Lse:
      switch (dtype) {
        case DType::F64: return {Metric::MaxAbs, 1e-9};
        case DType::F32: return {Metric::MaxAbs, 1e-5};
        case DType::F16:
        case DType::BF16: return {Metric::MaxAbs, 1e-3};
      }
      break;
    case Quantity::MaxLogits:
      // Always an fp32 buffer: fp32 rounding of the terms a logit sums, whatever the inputs (check_max_logits).
      return {Metric::MaxAbsRelative, 1e-5};
    case Quantity::DSink:
      // Always an fp32 buffer: never tighter than the fp32 gradient rule. Measured by check_dsink.
      return {Metric::RelL2, dtype == DType::F64 ? tolerance_for(Quantity::Grad, DType::F32).bound
                                                 : tolerance_for(Quantity::Grad, dtype).bound};
  }
  return {Metric::MaxAbs, 0.0};
}

ErrorStats error_stats(const std::vector<double>& got, const std::vector<double>& ref,
                       const std::vector<uint8_t>& exact_zero) {
  ErrorStats e;
  double diff2 = 0.0, ref2 = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double g = got[i], r = ref[i];
    const bool same_class = std::isfinite(r) ? std::isfinite(g) : (g == r);  // -inf must match exactly
    if (e.non_finite_mismatch < 0 && (std::isnan(g) || !same_class)) e.non_finite_mismatch = static_cast<int64_t>(i);
    if (e.zero_mismatch < 0 && i < exact_zero.size() && exact_zero[i] && g != 0.0) e.zero_mismatch = static_cast<int64_t>(i);
    if (!std::isfinite(r) || !std::isfinite(g)) continue;
    const double d = std::fabs(g - r);
    diff2 += d * d;
    ref2 += r * r;
    e.max_ref = std::max(e.max_ref, std::fabs(r));
    if (d > e.max_abs || e.worst_index < 0) {
      e.max_abs = std::max(e.max_abs, d);
      e.worst_index = static_cast<int64_t>(i);
    }
  }
  e.rel_l2 = ref2 > 0.0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  e.max_abs_relative = e.max_ref > 0.0 ? e.max_abs / e.max_ref : e.max_abs;
  return e;
}

testing::AssertionResult check_close(std::string_view name, const std::vector<double>& got,
                                     const std::vector<double>& ref, Quantity quantity, DType dtype,
                                     std::string_view context, const std::vector<uint8_t>& exact_zero) {
  std::ostringstream where;
  where << " [" << name << ", " << to_string(quantity) << ", inputs " << magi::to_string(dtype) << "; " << context << "]";
  if (got.size() != ref.size())
    return testing::AssertionFailure() << "size " << got.size() << " != reference size " << ref.size() << where.str();

  const ErrorStats e = error_stats(got, ref, exact_zero);
  if (e.non_finite_mismatch >= 0) {
    const auto i = static_cast<std::size_t>(e.non_finite_mismatch);
    return testing::AssertionFailure() << "non-finite mismatch at index " << i << ": got " << got[i] << ", ref "
                                       << ref[i] << where.str();
  }
  if (e.zero_mismatch >= 0) {
    const auto i = static_cast<std::size_t>(e.zero_mismatch);
    return testing::AssertionFailure() << "index " << i << " must be exactly 0 (empty row or unread key), got "
                                       << got[i] << where.str();
  }
  const Tolerance tol = tolerance_for(quantity, dtype);
  const double error = measured(e, tol.metric);
  if (!(error <= tol.bound)) {
    std::ostringstream msg;
    msg.precision(6);
    msg << to_string(tol.metric) << " = " << error << " > " << tol.bound << " (rel L2 " << e.rel_l2 << ", max abs "
        << e.max_abs << ", max|ref| " << e.max_ref;
    if (e.worst_index >= 0) {
      const auto i = static_cast<std::size_t>(e.worst_index);
      msg.precision(17);
      msg << "; worst at index " << i << ": got " << got[i] << ", ref " << ref[i];
    }
    msg << ")";
    return testing::AssertionFailure() << msg.str() << where.str();
  }
  return testing::AssertionSuccess();
}

testing::AssertionResult check_dsink(const std::vector<double>& got, const std::vector<double>& ref,
                                     const std::vector<double>& magnitude, DType dtype, std::string_view context) {
  std::ostringstream where;
  where << " [dsink, inputs " << magi::to_string(dtype) << "; " << context << "]";
  if (got.size() != ref.size() || magnitude.size() != ref.size())
    return testing::AssertionFailure() << "size " << got.size() << " != reference size " << ref.size() << where.str();
  double diff2 = 0.0, magnitude2 = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i]))
      return testing::AssertionFailure() << "non-finite value " << got[i] << " at index " << i << where.str();
    diff2 += (got[i] - ref[i]) * (got[i] - ref[i]);
    magnitude2 += magnitude[i] * magnitude[i];
  }
  const double error = magnitude2 > 0.0 ? std::sqrt(diff2 / magnitude2) : std::sqrt(diff2);
  const double bound = tolerance_for(Quantity::DSink, dtype).bound;
  if (!(error <= bound)) {
    std::ostringstream msg;
    msg << "||got - ref|| / ||sum of |terms|||  = " << error << " > " << bound << " (rel L2 vs ref "
        << error_stats(got, ref).rel_l2 << ")";
    return testing::AssertionFailure() << msg.str() << where.str();
  }
  return testing::AssertionSuccess();
}

testing::AssertionResult check_max_logits(const std::vector<double>& got, const std::vector<double>& ref,
                                          const std::vector<double>& magnitude, DType dtype, std::string_view context) {
  std::ostringstream where;
  where << " [max_logits, inputs " << magi::to_string(dtype) << "; " << context << "]";
  if (got.size() != ref.size() || magnitude.size() != ref.size())
    return testing::AssertionFailure() << "size " << got.size() << " != reference size " << ref.size() << where.str();
  const ErrorStats e = error_stats(got, ref);
  if (e.non_finite_mismatch >= 0) {
    const auto i = static_cast<std::size_t>(e.non_finite_mismatch);
    return testing::AssertionFailure() << "non-finite mismatch at index " << i << ": got " << got[i] << ", ref "
                                       << ref[i] << where.str();
  }
  const double size = std::max(e.max_ref, *std::max_element(magnitude.begin(), magnitude.end()));
  const double error = size > 0.0 ? e.max_abs / size : e.max_abs;
  const double bound = tolerance_for(Quantity::MaxLogits, dtype).bound;
  if (!(error <= bound)) {
    std::ostringstream msg;
    msg.precision(6);
    msg << "max abs error / largest |terms| = " << error << " > " << bound << " (max abs " << e.max_abs
        << ", max|ref| " << e.max_ref << ", terms " << size << ")";
    return testing::AssertionFailure() << msg.str() << where.str();
  }
  return testing::AssertionSuccess();
}

testing::AssertionResult check_grad_cancelling(std::string_view name, const std::vector<double>& got,
                                               const std::vector<double>& ref, const std::vector<double>& magnitude,
                                               DType dtype, std::string_view context,
                                               const std::vector<uint8_t>& exact_zero) {
  if (magnitude.size() != ref.size())
    return testing::AssertionFailure() << name << ": magnitude size " << magnitude.size() << " != reference size "
                                       << ref.size() << " [" << context << "]";
  double ref2 = 0.0, magnitude2 = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(ref[i])) continue;
    ref2 += ref[i] * ref[i];
    magnitude2 += magnitude[i] * magnitude[i];
  }
  constexpr double kFloor = 0.01;
  if (std::sqrt(ref2) >= kFloor * std::sqrt(magnitude2))
    return check_close(name, got, ref, Quantity::Grad, dtype, context, exact_zero);
  std::ostringstream where;
  where << " [" << name << ", grad (cancelled: ||ref|| " << std::sqrt(ref2) << " < 1% of its terms' "
        << std::sqrt(magnitude2) << "), inputs " << magi::to_string(dtype) << "; " << context << "]";
  if (got.size() != ref.size())
    return testing::AssertionFailure() << "size " << got.size() << " != reference size " << ref.size() << where.str();
  const ErrorStats e = error_stats(got, ref, exact_zero);
  if (e.non_finite_mismatch >= 0) {
    const auto i = static_cast<std::size_t>(e.non_finite_mismatch);
    return testing::AssertionFailure() << "non-finite mismatch at index " << i << ": got " << got[i] << ", ref "
                                       << ref[i] << where.str();
  }
  if (e.zero_mismatch >= 0) {
    const auto i = static_cast<std::size_t>(e.zero_mismatch);
    return testing::AssertionFailure() << "index " << i << " must be exactly 0 (empty row or unread key), got "
                                       << got[i] << where.str();
  }
  double diff2 = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i)
    if (std::isfinite(ref[i])) diff2 += (got[i] - ref[i]) * (got[i] - ref[i]);
  const double floor = kFloor * std::sqrt(magnitude2);
  const double error = floor > 0.0 ? std::sqrt(diff2) / floor : std::sqrt(diff2);
  const double bound = tolerance_for(Quantity::Grad, dtype).bound;
  if (!(error <= bound))
    return testing::AssertionFailure() << "||got - ref|| / (1% of ||terms||) = " << error << " > " << bound
                                       << " (max abs " << e.max_abs << " at index " << e.worst_index << ")"
                                       << where.str();
  return testing::AssertionSuccess();
}

testing::AssertionResult check_bitwise_equal(std::string_view name, const HostTensor& a, const HostTensor& b,
                                             std::string_view context) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape())
    return testing::AssertionFailure() << name << ": dtype/shape differ [" << context << "]";
  const auto& x = a.bytes();
  const auto& y = b.bytes();
  const std::size_t elem = static_cast<std::size_t>(dtype_size(a.dtype()));
  for (std::size_t i = 0; i < x.size(); i += elem) {
    if (std::memcmp(&x[i], &y[i], elem) != 0) {
      const std::vector<double> va = a.values(), vb = b.values();
      std::ostringstream msg;
      msg.precision(17);
      msg << name << ": not bitwise identical at element " << i / elem << " (" << va[i / elem] << " vs "
          << vb[i / elem] << ") [" << context << "]";
      return testing::AssertionFailure() << msg.str();
    }
  }
  return testing::AssertionSuccess();
}

}  // namespace magi::test
