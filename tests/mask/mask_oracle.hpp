// Brute-force readings of SPEC section 2 for the mask tests; independent of kept_keys / area / validate.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "magi/mask.hpp"

namespace magi::test {

// The SPEC table in local coordinates: i = q - qs, j = k - ks.
inline bool spec_keeps(const Slice& s, int64_t q, int64_t k) {
  if (q < s.q.start || q >= s.q.end || k < s.k.start || k >= s.k.end) return false;
  const int64_t i = q - s.q.start, j = k - s.k.start;
  const int64_t sq = int64_t{s.q.end} - s.q.start, sk = int64_t{s.k.end} - s.k.start;
  switch (s.type) {
    case MaskType::Full: return true;
    case MaskType::Causal: return j <= i + (sk - sq);
    case MaskType::InvCausal: return j >= i;
    case MaskType::BiCausal: return j >= i && j <= i + (sk - sq);
  }
  return false;
}

// How many slices keep each cell of the total_q x total_k grid (row-major).
inline std::vector<int32_t> cell_counts(const Mask& mask) {
  std::vector<int32_t> counts(static_cast<size_t>(mask.total_q) * static_cast<size_t>(mask.total_k), 0);
  for (const Slice& s : mask.slices) {
    for (int64_t q = s.q.start; q < s.q.end; ++q) {
      for (int64_t k = s.k.start; k < s.k.end; ++k) {
        if (spec_keeps(s, q, k)) ++counts[static_cast<size_t>(q * mask.total_k + k)];
      }
    }
  }
  return counts;
}

inline int64_t brute_area(const Slice& s) {
  int64_t n = 0;
  for (int64_t q = s.q.start; q < s.q.end; ++q) {
    for (int64_t k = s.k.start; k < s.k.end; ++k) n += spec_keeps(s, q, k) ? 1 : 0;
  }
  return n;
}

inline MaskType random_type(std::mt19937_64& rng) {
  return static_cast<MaskType>(std::uniform_int_distribution<int32_t>(0, 3)(rng));
}

// A random range inside [0, total], possibly empty.
inline Range random_range(std::mt19937_64& rng, int32_t total) {
  std::uniform_int_distribution<int32_t> pick(0, total);
  int32_t a = pick(rng), b = pick(rng);
  if (a > b) std::swap(a, b);
  return {a, b};
}

inline Slice random_slice(std::mt19937_64& rng, int32_t total_q, int32_t total_k) {
  return {random_range(rng, total_q), random_range(rng, total_k), random_type(rng)};
}

}  // namespace magi::test
