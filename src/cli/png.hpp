// Minimal PNG writer (libpng): 8-bit greyscale images.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "magi/mask.hpp"

namespace magi::cli {

// `pixels` holds height rows of width bytes (0 = black, 255 = white). Throws InvalidArgument naming the
// path when the file cannot be written.
void write_png_gray(const std::string& path, int32_t width, int32_t height, const std::vector<uint8_t>& pixels);

// A picture of `mask` (cli/mask_picture.hpp): white = all kept, black = none, grey = kept fraction; at
// most 1024 pixels on a side, small masks scaled up by whole pixels.
void write_mask_png(const Mask& mask, const std::string& path);

}  // namespace magi::cli
