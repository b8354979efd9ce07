// Downsampled pictures of a mask: each cell of a rows x cols grid holds the fraction of its (q, k)
// tokens that the mask keeps. Cost is O(sum of slice rows + rows * cols), never O(Tq * Tk).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "magi/mask.hpp"

namespace magi::picture {

struct MaskGrid {
  int32_t rows = 0;
  int32_t cols = 0;
  std::vector<double> kept_fraction;  // rows * cols, row-major, in [0, 1]
  std::vector<uint8_t> state;         // 0 = no cell kept, 1 = some, 2 = all (exact, not rounded)
};

// Grid cell (r, c) covers q rows [r * Tq / rows, (r + 1) * Tq / rows) and likewise for keys.
MaskGrid rasterize(const Mask& mask, int32_t rows, int32_t cols);

// A text picture about 64 characters wide: '#' = every cell kept, '+' = some, '.' = none.
std::string text_picture(const Mask& mask, int32_t max_cols = 64);

// A greyscale picture (white = all kept, black = none, grey = kept fraction), row-major bytes: at most 1024
// pixels on a side, small masks scaled up by whole pixels so that they stay visible.
struct GrayImage {
  int32_t width = 0, height = 0;
  std::vector<uint8_t> pixels;
};
GrayImage gray_image(const Mask& mask);

}  // namespace magi::picture
