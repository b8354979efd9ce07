// FLOP accounting (SPEC section 6): the only place these formulas live.
#pragma once

#include <cstdint>

namespace magi {

constexpr double flops_forward(int64_t area, int64_t heads_q, int64_t head_dim) {
  return 4.0 * static_cast<double>(area) * static_cast<double>(heads_q) * static_cast<double>(head_dim);
}
constexpr double flops_backward(int64_t area, int64_t heads_q, int64_t head_dim) {
  return 2.5 * flops_forward(area, heads_q, head_dim);
}

}  // namespace magi
