// Mask type names and exact areas (SPEC section 2).
#include "magi/mask.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <string>

#include "magi/error.hpp"

namespace magi {
namespace {

constexpr std::array<std::string_view, 4> kTypeNames = {"full", "causal", "inv_causal", "bi_causal"};

bool equals_ignoring_case(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

// sum_{i=0}^{n-1} clamp(i + c, 0, m) for n, m >= 0: zero, then a unit-slope ramp, then a plateau at m.
// Every term of the ramp is < m <= 2^31 and there are < 2^31 of them, so halving before multiplying
// keeps the product within the final sum (< 2^62).
int64_t sum_clamped_ramp(int64_t n, int64_t c, int64_t m) {
  const int64_t ramp_begin = std::clamp<int64_t>(-c, 0, n);             // first i with i + c >= 0
  const int64_t ramp_end = std::clamp<int64_t>(m - c, ramp_begin, n);   // first i with i + c >= m
  const int64_t count = ramp_end - ramp_begin;
  int64_t ramp = 0;
  if (count > 0) {
    const int64_t ends = (ramp_begin + c) + (ramp_end - 1 + c);  // first + last term
    ramp = count % 2 == 0 ? (count / 2) * ends : count * (ends / 2);
  }
  return ramp + (n - ramp_end) * m;
}

}  // namespace

std::string_view to_string(MaskType type) {
  const auto id = static_cast<int32_t>(type);
  if (id < 0 || id >= static_cast<int32_t>(kTypeNames.size())) {
    throw InvalidArgument("mask type id " + std::to_string(id) +
                          " is unknown; allowed: 0 (full), 1 (causal), 2 (inv_causal), 3 (bi_causal)");
  }
  return kTypeNames[static_cast<size_t>(id)];
}

MaskType parse_mask_type(std::string_view text, std::string_view what) {
  for (size_t id = 0; id < kTypeNames.size(); ++id) {
    if (equals_ignoring_case(text, kTypeNames[id]) || text == std::to_string(id)) {
      return static_cast<MaskType>(id);
    }
  }
  throw InvalidArgument(std::string(what) + " \"" + std::string(text) +
                        "\" is unknown; allowed: full, causal, inv_causal, bi_causal (or ids 0..3)");
}

int64_t area(const Slice& slice) {
  const int64_t rows = slice.q.size();
  const int64_t cols = slice.k.size();
  if (rows == 0 || cols == 0) return 0;
  switch (slice.type) {
    case MaskType::Causal:
    case MaskType::InvCausal:
      // Local row i keeps clamp(i + cols - rows + 1, 0, cols) keys (causal); the inverse-causal slice is
      // the same shape rotated by 180 degrees, so it has the same area.
      return sum_clamped_ramp(rows, cols - rows + 1, cols);
    case MaskType::BiCausal:
      // Every row keeps the same cols - rows + 1 keys, none when rows > cols.
      return cols >= rows ? rows * (cols - rows + 1) : 0;
    case MaskType::Full:
    default:  // kept_keys treats an unknown id as full; stay consistent with it
      return rows * cols;
  }
}

int64_t Mask::area() const {
  int64_t total = 0;
  for (const Slice& slice : slices) total += magi::area(slice);
  return total;
}

double Mask::density() const {
  if (total_q <= 0 || total_k <= 0) return 0.0;
  return static_cast<double>(area()) / (static_cast<double>(total_q) * static_cast<double>(total_k));
}

}  // namespace magi
