// SPEC section 5 accuracy rules, in one place. Every engine test judges results through these.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "magi/tensor.hpp"
#include "reference/random_inputs.hpp"

namespace magi::test {

enum class Quantity { Out, Grad, Lse, MaxLogits, DSink };
std::string_view to_string(Quantity quantity);

enum class Metric {
  MaxAbsRelative,  // max |got - ref| / max |ref|
  RelL2,           // ||got - ref||_2 / ||ref||_2
  MaxAbs,          // max |got - ref| over finite reference values
};

struct Tolerance {
  Metric metric;
  double bound;
};

// The bound for `quantity` when the inputs were `dtype` (the computation's dtype, not the buffer's).
Tolerance tolerance_for(Quantity quantity, DType dtype);

struct ErrorStats {
  double rel_l2 = 0.0;
  double max_abs = 0.0;           // over elements where both are finite
  double max_abs_relative = 0.0;  // max_abs / max |ref|
  double max_ref = 0.0;
  int64_t worst_index = -1;       // index of max_abs
  int64_t non_finite_mismatch = -1;  // first index where got is NaN, or where finiteness differs from ref
  int64_t zero_mismatch = -1;        // first index flagged in `exact_zero` where got is not exactly 0
};
ErrorStats error_stats(const std::vector<double>& got, const std::vector<double>& ref,
                       const std::vector<uint8_t>& exact_zero = {});

// Judges `got` against the fp64 reference by SPEC section 5. Also: NaN never passes; lse (and anything
// else) must be -inf exactly where ref is; elements flagged in `exact_zero` (empty rows, keys nobody
// reads: zero by structure, not by cancellation) must be exactly 0.
// `context` (case name, seed, ...) is appended to the failure message.
testing::AssertionResult check_close(std::string_view name, const std::vector<double>& got,
                                     const std::vector<double>& ref, Quantity quantity, DType dtype,
                                     std::string_view context, const std::vector<uint8_t>& exact_zero = {});

// dsink (an fp32 buffer) sums signed per-row terms that may cancel: its error is judged as
// ||got - ref||_2 / ||magnitude||_2, magnitude being the summed absolute terms, against the gradient bound
// of `dtype` (the fp32 bound for fp64 inputs).
testing::AssertionResult check_dsink(const std::vector<double>& got, const std::vector<double>& ref,
                                     const std::vector<double>& magnitude, DType dtype, std::string_view context);

// dq / dk where their terms may cancel: judged like check_close (Quantity::Grad), except that ||ref||_2 in the
// relative L2 error is never taken below 1% of ||magnitude||_2 (ReferenceGrads::dq_magnitude / dk_magnitude).
// A gradient that cancelled to under 1% of its terms (rows of one key, a sink beside one key) is then held to
// the bound times that floor, instead of to a relative error of rounding noise against a reference near 0.
// max_logits (an fp32 buffer): a logit sums D products, so its rounding is that of terms as large as
// `magnitude` (ReferenceForward::max_logits_magnitude), however near 0 they cancel. Max abs error over the largest
// magnitude, against the MaxLogits bound; -inf exactly where a head keeps no cell.
testing::AssertionResult check_max_logits(const std::vector<double>& got, const std::vector<double>& ref,
                                          const std::vector<double>& magnitude, DType dtype, std::string_view context);

testing::AssertionResult check_grad_cancelling(std::string_view name, const std::vector<double>& got,
                                               const std::vector<double>& ref, const std::vector<double>& magnitude,
                                               DType dtype, std::string_view context,
                                               const std::vector<uint8_t>& exact_zero = {});

// Bitwise equality of two buffers (determinism).
testing::AssertionResult check_bitwise_equal(std::string_view name, const HostTensor& a, const HostTensor& b,
                                             std::string_view context);

}  // namespace magi::test
