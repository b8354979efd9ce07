// Mask pictures (src/mask/picture.hpp): rasterisation against the dense keep matrix, the grey image's size
// and values, and describe()'s text.
#include <gtest/gtest.h>

#include <random>

#include "magi/error.hpp"
#include "magi/mask.hpp"
#include "mask/picture.hpp"
#include "reference/naive_attention.hpp"
#include "reference/random_inputs.hpp"

namespace magi::picture {
namespace {

// Kept fraction of each grid cell, by brute force over the dense keep matrix.
TEST(MaskPicture, RasterizeMatchesBruteForce) {
  const uint64_t seed = magi::test::fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 20; ++trial) {
    const int32_t tq = std::uniform_int_distribution<int32_t>(1, 150)(rng);
    const int32_t tk = std::uniform_int_distribution<int32_t>(1, 150)(rng);
    const Mask mask = magi::test::random_rectangles(rng, tq, tk, 12);
    const int32_t rows = std::uniform_int_distribution<int32_t>(1, tq)(rng);
    const int32_t cols = std::uniform_int_distribution<int32_t>(1, tk)(rng);
    const MaskGrid grid = rasterize(mask, rows, cols);
    const auto keep = magi::test::dense_keep(mask);
    for (int32_t r = 0; r < rows; ++r)
      for (int32_t c = 0; c < cols; ++c) {
        const int64_t q0 = int64_t{r} * tq / rows, q1 = int64_t{r + 1} * tq / rows;
        const int64_t k0 = int64_t{c} * tk / cols, k1 = int64_t{c + 1} * tk / cols;
        int64_t kept = 0;
        for (int64_t q = q0; q < q1; ++q)
          for (int64_t k = k0; k < k1; ++k) kept += keep[static_cast<size_t>(q * tk + k)];
        const int64_t total = (q1 - q0) * (k1 - k0);
        const size_t i = static_cast<size_t>(r) * cols + c;
        ASSERT_DOUBLE_EQ(grid.kept_fraction[i], total ? static_cast<double>(kept) / total : 0.0)
            << "seed " << seed << " trial " << trial << " cell " << r << "," << c;
        ASSERT_EQ(grid.state[i], kept == 0 ? 0 : kept == total ? 2 : 1) << "seed " << seed << " trial " << trial;
      }
  }
}

TEST(MaskPicture, GrayImageIsBoundedAndScalesSmallMasksUp) {
  const GrayImage small = gray_image(masks::causal(4, 4));
  ASSERT_EQ(small.width, 256);
  ASSERT_EQ(small.height, 256);
  EXPECT_EQ(small.pixels[0], 255);                    // (q 0, k 0) kept
  EXPECT_EQ(small.pixels[255], 0);                    // (q 0, k 3) masked
  EXPECT_EQ(small.pixels[255 * 256 + 255], 255);      // (q 3, k 3) kept
  const GrayImage large = gray_image(masks::full(100000, 50000));
  EXPECT_EQ(large.width, 512);
  EXPECT_EQ(large.height, 1024);
  for (uint8_t p : large.pixels) ASSERT_EQ(p, 255);
}

TEST(MaskDescribe, ListsSlicesAreaAndPictureAndRejectsInvalidMasks) {
  const std::string text = describe(masks::varlen_causal({0, 3, 8}));
  for (const char* fragment : {"mask: 2 slices, total_q 8, total_k 8 (valid)", "area: 21 of 64 cells", "causal", "picture"})
    EXPECT_NE(text.find(fragment), std::string::npos) << fragment << "\n" << text;
  Mask overlapping{{{{0, 4}, {0, 4}, MaskType::Full}, {{2, 3}, {1, 2}, MaskType::Full}}, 4, 4};
  EXPECT_THROW(describe(overlapping), InvalidArgument);
}

}  // namespace
}  // namespace magi::picture
