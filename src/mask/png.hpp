// PNG files of mask pictures (libpng; target magi_png, kept out of the core library): 8-bit greyscale.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "magi/mask.hpp"

namespace magi::picture {

// `pixels` holds height rows of width bytes (0 = black, 255 = white). Throws InvalidArgument naming the
// path when the file cannot be written.
void write_png_gray(const std::string& path, int32_t width, int32_t height, const std::vector<uint8_t>& pixels);

// gray_image(mask) (mask/picture.hpp) as a PNG file.
void write_mask_png(const Mask& mask, const std::string& path);

}  // namespace magi::picture
