#include "mask/picture.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "magi/error.hpp"

namespace magi::picture {
namespace {

// Boundaries of `parts` nearly equal pieces of [0, total).
int64_t boundary(int64_t index, int64_t total, int64_t parts) { return index * total / parts; }
// The piece that contains token x: the largest c with boundary(c) <= x.
int64_t piece_of(int64_t x, int64_t total, int64_t parts) { return ((x + 1) * parts + total - 1) / total - 1; }

}  // namespace

MaskGrid rasterize(const Mask& mask, int32_t rows, int32_t cols) {
  const int64_t tq = mask.total_q, tk = mask.total_k;
  MaskGrid grid;
  grid.rows = rows;
  grid.cols = cols;
  if (tq <= 0 || tk <= 0 || rows <= 0 || cols <= 0) return grid;
  const size_t cells = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  // kept[r][c] = partial[r][c] + (number of rows covering column c fully) * width(c); the full-coverage
  // counts are a difference array along c, so each kept interval costs O(1).
  std::vector<int64_t> partial(cells, 0);
  std::vector<int64_t> full_diff(static_cast<size_t>(rows) * (cols + 1), 0);
  for (const Slice& slice : mask.slices) {
    for (int32_t q = slice.q.start; q < slice.q.end; ++q) {
      const Range keys = kept_keys(slice, q);
      if (keys.empty()) continue;
      const int64_t r = piece_of(q, tq, rows);
      const int64_t c0 = piece_of(keys.start, tk, cols), c1 = piece_of(keys.end - 1, tk, cols);
      int64_t* row_partial = partial.data() + r * cols;
      if (c0 == c1) {
        row_partial[c0] += keys.size();
        continue;
      }
      row_partial[c0] += boundary(c0 + 1, tk, cols) - keys.start;
      row_partial[c1] += keys.end - boundary(c1, tk, cols);
      full_diff[r * (cols + 1) + c0 + 1] += 1;
      full_diff[r * (cols + 1) + c1] -= 1;
    }
  }
  grid.kept_fraction.resize(cells);
  grid.state.resize(cells);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t height = boundary(r + 1, tq, rows) - boundary(r, tq, rows);
    int64_t full_rows = 0;
    for (int64_t c = 0; c < cols; ++c) {
      full_rows += full_diff[r * (cols + 1) + c];
      const int64_t width = boundary(c + 1, tk, cols) - boundary(c, tk, cols);
      const int64_t kept = partial[r * cols + c] + full_rows * width;
      const int64_t total = height * width;
      const size_t i = static_cast<size_t>(r * cols + c);
      grid.kept_fraction[i] = total > 0 ? static_cast<double>(kept) / static_cast<double>(total) : 0.0;
      grid.state[i] = kept == 0 ? 0 : kept >= total ? 2 : 1;
    }
  }
  return grid;
}

std::string text_picture(const Mask& mask, int32_t max_cols) {
  const int64_t tq = mask.total_q, tk = mask.total_k;
  if (tq <= 0 || tk <= 0) return "(empty grid)\n";
  // One character per token when the mask is small; otherwise ~max_cols wide with rows halved because
  // terminal characters are about twice as tall as wide.
  int32_t cols, rows;
  if (tk <= max_cols && tq <= max_cols) {
    cols = static_cast<int32_t>(tk);
    rows = static_cast<int32_t>(tq);
  } else {
    cols = static_cast<int32_t>(std::min<int64_t>(tk, max_cols));
    const double aspect = static_cast<double>(tq) / static_cast<double>(tk);
    rows = static_cast<int32_t>(std::clamp<int64_t>(std::llround(cols * aspect / 2.0), 1, std::min<int64_t>(tq, 48)));
  }
  const MaskGrid grid = rasterize(mask, rows, cols);
  std::ostringstream os;
  os << "(" << rows << " x " << cols << " characters; each about " << (tq + rows - 1) / rows << " q x "
     << (tk + cols - 1) / cols << " k tokens; '#' all kept, '+' some, '.' none)\n";
  for (int32_t r = 0; r < rows; ++r) {
    os << "  ";
    for (int32_t c = 0; c < cols; ++c) os << ".+#"[grid.state[static_cast<size_t>(r) * cols + c]];
    os << '\n';
  }
  return os.str();
}

GrayImage gray_image(const Mask& mask) {
  constexpr int64_t kMaxSide = 1024, kMinSide = 256;
  const int64_t tq = std::max<int64_t>(mask.total_q, 1), tk = std::max<int64_t>(mask.total_k, 1);
  // Downsample so the longer side is at most kMaxSide, keeping the aspect ratio.
  const double shrink = std::max(1.0, static_cast<double>(std::max(tq, tk)) / kMaxSide);
  const int32_t rows = static_cast<int32_t>(std::max<int64_t>(1, std::llround(tq / shrink)));
  const int32_t cols = static_cast<int32_t>(std::max<int64_t>(1, std::llround(tk / shrink)));
  const MaskGrid grid = rasterize(mask, rows, cols);
  // Small masks: replicate each cell into a square of pixels so the picture is visible.
  const int32_t scale = static_cast<int32_t>(std::max<int64_t>(1, kMinSide / std::max(rows, cols)));
  GrayImage image;
  image.width = cols * scale;
  image.height = rows * scale;
  image.pixels.assign(static_cast<size_t>(image.width) * image.height, 0);
  if (!grid.kept_fraction.empty()) {
    for (int32_t y = 0; y < image.height; ++y)
      for (int32_t x = 0; x < image.width; ++x) {
        const double f = grid.kept_fraction[static_cast<size_t>(y / scale) * cols + x / scale];
        image.pixels[static_cast<size_t>(y) * image.width + x] = static_cast<uint8_t>(std::lround(255.0 * f));
      }
  }
  return image;
}

}  // namespace magi::picture
