// The kept cells of one slice as a rectangle cut by two diagonals:
//   rows.start <= q < rows.end,  cols.start <= k < cols.end,  diag_lo <= k - q <= diag_hi.
// SPEC section 2's four types are this shape (CAUSAL bounds k - q above at its bottom-right corner,
// INV_CAUSAL below at its top-left corner). Unlike a slice, the shape stays exact under clipping to
// row/column windows and under shifting into another coordinate system, which is what dispatch and the
// comm plan need; to_slices turns it back into at most three slices with the same cells.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "magi/mask.hpp"

namespace magi::dist {

struct Band {
  static constexpr int64_t kUnbounded = std::numeric_limits<int32_t>::max() * int64_t{4};

  Range rows;
  Range cols;
  int64_t diag_lo = -kUnbounded;
  int64_t diag_hi = kUnbounded;
};

Band band_of(const Slice& slice);
// The cells of `band` inside rows x cols.
Band clip(const Band& band, Range rows, Range cols);
Band clip_rows(const Band& band, Range rows);
Band clip_cols(const Band& band, Range cols);
// The same cells with q -> q + dq, k -> k + dk.
Band shift(const Band& band, int32_t dq, int32_t dk);

// Appends at most three non-empty slices whose kept cells are exactly the band's cells.
void append_slices(const Band& band, std::vector<Slice>& out);
// Number of kept cells (magi::area of the slices above).
int64_t area(const Band& band);
// The union of the kept keys over all rows: one contiguous range (empty if the band keeps nothing).
Range kept_cols(const Band& band);
// The rows that keep at least one key: one contiguous range (empty if the band keeps nothing).
Range kept_rows(const Band& band);

}  // namespace magi::dist
