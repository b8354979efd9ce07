#include "cli/png.hpp"

#include <png.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>

#include "cli/mask_picture.hpp"
#include "magi/error.hpp"

namespace magi::cli {
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
  constexpr int64_t kMaxSide = 1024, kMinSide = 256;
  const int64_t tq = std::max<int64_t>(mask.total_q, 1), tk = std::max<int64_t>(mask.total_k, 1);
  // Downsample so the longer side is at most kMaxSide, keeping the aspect ratio.
  const double shrink = std::max(1.0, static_cast<double>(std::max(tq, tk)) / kMaxSide);
  const int32_t rows = static_cast<int32_t>(std::max<int64_t>(1, std::llround(tq / shrink)));
  const int32_t cols = static_cast<int32_t>(std::max<int64_t>(1, std::llround(tk / shrink)));
  const MaskGrid grid = rasterize(mask, rows, cols);
  // Small masks: replicate each cell into a square of pixels so the picture is visible.
  const int32_t scale = static_cast<int32_t>(std::max<int64_t>(1, kMinSide / std::max(rows, cols)));
  const int32_t width = cols * scale, height = rows * scale;
  std::vector<uint8_t> pixels(static_cast<size_t>(width) * height, 0);
  if (!grid.kept_fraction.empty()) {
    for (int32_t y = 0; y < height; ++y)
      for (int32_t x = 0; x < width; ++x) {
        const double f = grid.kept_fraction[static_cast<size_t>(y / scale) * cols + x / scale];
        pixels[static_cast<size_t>(y) * width + x] = static_cast<uint8_t>(std::lround(255.0 * f));
      }
  }
  write_png_gray(path, width, height, pixels);
}

}  // namespace magi::cli
