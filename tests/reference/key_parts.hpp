// Masks of keys that arrive in parts (as in context parallelism): the cells of a mask with keys in [k0, k1).
// Header-only: the test programs that split keys already link the dist planning code.
#pragma once

#include <cstdint>

#include "distributed/band.hpp"
#include "magi/mask.hpp"

namespace magi::test {

inline Mask keys_between(const Mask& mask, int32_t k0, int32_t k1) {
  Mask part{{}, mask.total_q, mask.total_k};
  for (const Slice& s : mask.slices) dist::append_slices(dist::clip_cols(dist::band_of(s), {k0, k1}), part.slices);
  return part;
}

}  // namespace magi::test
