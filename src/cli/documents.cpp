#include "cli/documents.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "magi/error.hpp"

namespace magi::cli {

double NormalSampler::operator()() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  constexpr double kTwoPow53 = 9007199254740992.0;
  // u1 in (0, 1] so log(u1) is finite.
  const double u1 = (static_cast<double>(engine_() >> 11) + 1.0) / kTwoPow53;
  const double u2 = static_cast<double>(engine_() >> 11) / kTwoPow53;
  const double radius = std::sqrt(-2.0 * std::log(u1));
  const double angle = 2.0 * std::numbers::pi * u2;
  spare_ = radius * std::sin(angle);
  has_spare_ = true;
  return radius * std::cos(angle);
}

std::vector<int32_t> draw_documents(int32_t total, uint64_t seed, const DocumentShape& shape) {
  if (total < 0) throw InvalidArgument("documents: total tokens must be >= 0, got " + std::to_string(total));
  const int32_t min_length = std::max(1, shape.min_length);
  const int32_t max_length =
      std::max(min_length, shape.max_length > 0 ? shape.max_length : std::max(min_length, total / 2));
  NormalSampler normal(seed);
  std::vector<int32_t> cu{0};
  int32_t used = 0;
  while (used < total) {
    const double length = shape.median_length * std::exp(shape.sigma * normal());
    const int32_t clipped = static_cast<int32_t>(std::clamp<int64_t>(std::llround(length), int64_t{min_length},
                                                            int64_t{max_length}));
    const int32_t take = std::min(clipped, total - used);
    if (take < min_length && cu.size() > 1) {
      cu.back() = total;  // too short to stand alone: extend the previous document
      break;
    }
    used += take;
    cu.push_back(used);
  }
  return cu;
}

}  // namespace magi::cli
