// Long-tailed document lengths for the distributed GPU benchmarks (gpu_dist_attn_throughput.cpp measures,
// dist_cost_model.cpp predicts; both must see the same masks): Pareto alpha 1.2, at least 256 tokens,
// at most 8192, multiples of 64, the last document cut so that the lengths sum to `total`.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace magi::bench {

inline std::vector<int32_t> long_tailed_cu_seqlens(int32_t total, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int32_t> cu{0};
  while (cu.back() < total) {
    const double x = 256.0 / std::pow(1.0 - u(rng), 1.0 / 1.2);
    const int32_t len = std::max(64, static_cast<int32_t>(std::min(x, 8192.0)) / 64 * 64);
    cu.push_back(std::min(total, cu.back() + len));
  }
  return cu;
}

}  // namespace magi::bench
