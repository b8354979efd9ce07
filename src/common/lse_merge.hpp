// The lse merge of two partial results of the same rows (SPEC section 3). The only implementation;
// distributed, q-overlap and split-k paths all call it.
#pragma once

#include <cmath>
#include <limits>

#if defined(__CUDACC__)
#define MAGI_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MAGI_HOST_DEVICE inline
#endif

namespace magi {

// Merged lse; -inf with -inf stays -inf, merging with -inf is the identity.
template <class T>
MAGI_HOST_DEVICE T merge_lse(T l1, T l2) {
  const T hi = l1 > l2 ? l1 : l2;
  const T lo = l1 > l2 ? l2 : l1;
  if (hi == -std::numeric_limits<T>::infinity()) return hi;
  return hi + std::log1p(std::exp(lo - hi));
}

// Weights of the two parts in the merged output: out = w1 * o1 + w2 * o2.
template <class T>
struct MergeWeights {
  T lse, w1, w2;
};

template <class T>
MAGI_HOST_DEVICE MergeWeights<T> merge_weights(T l1, T l2) {
  const T lse = merge_lse(l1, l2);
  if (lse == -std::numeric_limits<T>::infinity()) return {lse, T(0), T(0)};
  return {lse, std::exp(l1 - lse), std::exp(l2 - lse)};
}

}  // namespace magi
