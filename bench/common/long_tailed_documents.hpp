// Long-tailed document lengths for the benchmarks, and the distributed benchmarks' masks built on them
// (flash_bench and the peers it hands them to; gpu_dist_attn_throughput measures, dist_cost_model predicts:
// all must see the same masks): Pareto alpha 1.2, at least 256 tokens, at most 8192, multiples of 64, the
// last document cut so that they sum to `total`.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "magi/mask.hpp"

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

// The distributed benchmarks' masks over `total` tokens: full, causal, varlen_full or varlen_causal
// (documents above, seed 42).
inline Mask distributed_bench_mask(const std::string& kind, int32_t total) {
  if (kind == "full") return masks::full(total, total);
  if (kind == "causal") return masks::causal(total, total);
  if (kind == "varlen_full") return masks::varlen_full(long_tailed_cu_seqlens(total, 42));
  return masks::varlen_causal(long_tailed_cu_seqlens(total, 42));
}

}  // namespace magi::bench
