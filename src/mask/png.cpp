#include "mask/png.hpp"

#include <png.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>

#include "mask/picture.hpp"
#include "magi/error.hpp"

namespace magi::picture {
namespace {

// libpng reports errors through a callback that must not return; it longjmps back to write_png_gray,
// which turns the saved message into an exception after libpng's state is freed.
struct ErrorState {
  char message[256] = "unknown libpng error";
};

void on_png_error(png_structp png, png_const_charp message) {
  auto* state = static_cast<ErrorState*>(png_get_error_ptr(png));
  std::snprintf(state->message, sizeof(state->message), "%s", message);
  png_longjmp(png, 1);
}
void on_png_warning(png_structp, png_const_charp) {}

}  // namespace

void write_png_gray(const std::string& path, int32_t width, int32_t height, const std::vector<uint8_t>& pixels) {
  if (width <= 0 || height <= 0 || pixels.size() != static_cast<size_t>(width) * static_cast<size_t>(height))
    throw InvalidArgument(path + ": cannot write a " + std::to_string(width) + "x" + std::to_string(height) +
                          " PNG from " + std::to_string(pixels.size()) + " pixels");
  FILE* file = std::fopen(path.c_str(), "wb");
  if (!file) throw InvalidArgument(path + ": cannot create: " + std::strerror(errno));

  ErrorState state;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &state, on_png_error, on_png_warning);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  bool ok = png && info;
  if (ok) {
    if (setjmp(png_jmpbuf(png))) {
      ok = false;
    } else {
      png_init_io(png, file);
      png_set_IHDR(png, info, static_cast<png_uint_32>(width), static_cast<png_uint_32>(height), 8,
                   PNG_COLOR_TYPE_GRAY, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
      png_write_info(png, info);
      for (int32_t row = 0; row < height; ++row)
        png_write_row(png, pixels.data() + static_cast<size_t>(row) * static_cast<size_t>(width));
      png_write_end(png, nullptr);
    }
  }
  png_destroy_write_struct(png ? &png : nullptr, info ? &info : nullptr);
  const bool closed = std::fclose(file) == 0;
  if (!ok || !closed) {
    std::remove(path.c_str());
    throw InvalidArgument(path + ": cannot write PNG: " + (ok ? std::string("close failed") : state.message));
  }
}

void write_mask_png(const Mask& mask, const std::string& path) {
  const GrayImage image = gray_image(mask);
  write_png_gray(path, image.width, image.height, image.pixels);
}

}  // namespace magi::picture
