// `magi-attn mask`: presets match the library builders, descriptions report the true area, --json
// round-trips, --png writes a valid picture of bounded size.
#include <gtest/gtest.h>

#include <algorithm>
#include <regex>

#include "cli/npy.hpp"
#include "cli_test_helpers.hpp"
#include "magi/mask.hpp"

namespace magi::cli::test {
namespace {

struct PresetCase {
  std::vector<std::string> args;
  Mask expected;
};

std::vector<PresetCase> preset_cases() {
  return {
      {{"--preset", "full", "--tq", "100", "--tk", "70"}, masks::full(100, 70)},
      {{"--preset", "causal", "--tq", "64", "--tk", "100"}, masks::causal(64, 100)},
      {{"--preset", "varlen_full", "--docs", "0,10,30,100"}, masks::varlen_full({0, 10, 30, 100})},
      {{"--preset", "varlen_full", "--docs", "0"}, masks::varlen_full({0})},  // no documents
      {{"--preset", "varlen_causal", "--docs", "0,50,60,61,200"}, masks::varlen_causal({0, 50, 60, 61, 200})},
      {{"--preset", "sliding_window", "--tq", "300", "--window", "40", "--window-right", "7"},
       masks::sliding_window(300, 40, 7)},
      {{"--preset", "block_causal", "--tq", "1000", "--block", "96"}, masks::block_causal(1000, 96)},
      {{"--preset", "varlen_block_causal", "--docs", "0,300,310,1000", "--block", "64"},
       masks::varlen_block_causal({0, 300, 310, 1000}, 64)},
      {{"--preset", "shared_question", "--question", "50", "--answers", "20,30,5"},
       masks::shared_question(50, {20, 30, 5})},
      {{"--preset", "global_sliding_window", "--tq", "500", "--global", "16", "--window", "64"},
       masks::global_sliding_window(500, 16, 64)},
  };
}

int64_t reported_area(const std::string& out) {
  std::smatch m;
  const std::regex area_line(R"(area: ([0-9,]+) of)");
  if (!std::regex_search(out, m, area_line)) return -1;
  std::string digits = m[1];
  digits.erase(std::remove(digits.begin(), digits.end(), ','), digits.end());
  return std::stoll(digits);
}

std::string args_text(const std::vector<std::string>& args) {
  std::string text;
  for (const auto& a : args) text += a + " ";
  return text;
}

TEST(CliMask, PresetsDescribeTheLibraryBuilders) {
  for (const PresetCase& c : preset_cases()) {
    std::vector<std::string> args = {"mask"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    const CliResult r = run_cli(args);
    ASSERT_EQ(r.exit_code, 0) << args_text(args) << describe(r);
    EXPECT_EQ(reported_area(r.out), c.expected.area()) << args_text(args) << r.out;
    EXPECT_NE(r.out.find("mask: " + std::to_string(c.expected.slices.size()) + " slice"), std::string::npos)
        << args_text(args) << r.out;
    EXPECT_NE(r.out.find("total_q " + std::to_string(c.expected.total_q) + ", total_k " +
                         std::to_string(c.expected.total_k)),
              std::string::npos)
        << args_text(args) << r.out;
  }
}

TEST(CliMask, JsonOutputRoundTripsToTheBuilderMask) {
  for (const PresetCase& c : preset_cases()) {
    std::vector<std::string> args = {"mask", "--json"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    const CliResult r = run_cli(args);
    ASSERT_EQ(r.exit_code, 0) << args_text(args) << describe(r);
    const Mask parsed = mask_from_json(r.out);
    EXPECT_EQ(parsed.slices, c.expected.slices) << args_text(args);
    EXPECT_EQ(parsed.total_q, c.expected.total_q) << args_text(args);
    EXPECT_EQ(parsed.total_k, c.expected.total_k) << args_text(args);
  }
}

TEST(CliMask, DocumentsPresetIsReproducibleFromItsSeed) {
  const std::vector<std::string> args = {"mask", "--preset", "documents", "--tq", "20000", "--seed", "7", "--json"};
  const CliResult a = run_cli(args), b = run_cli(args);
  ASSERT_EQ(a.exit_code, 0) << describe(a);
  EXPECT_EQ(a.out, b.out);
  const Mask mask = mask_from_json(a.out);
  EXPECT_EQ(mask.total_q, 20000);
  EXPECT_NO_THROW(validate(mask));
  // Block-causal inside documents: every row keeps at least its own diagonal key, and no row sees
  // keys past the end of its 128-token block.
  for (int32_t q = 0; q < mask.total_q; q += 97) {
    int64_t kept = 0, last = -1;
    for (const Slice& s : mask.slices) {
      const Range keys = kept_keys(s, q);
      kept += keys.size();
      if (!keys.empty()) last = std::max<int64_t>(last, keys.end - 1);
    }
    EXPECT_GE(kept, 1) << "row " << q;
    EXPECT_GE(last, q) << "row " << q;
    EXPECT_LT(last, (q / 128 + 1) * 128 + 128) << "row " << q;
  }
  const CliResult other = run_cli({"mask", "--preset", "documents", "--tq", "20000", "--seed", "8", "--json"});
  EXPECT_NE(other.out, a.out) << "different seeds should draw different documents";
}

TEST(CliMask, TextPictureOfACausalMask) {
  const CliResult r = run_cli({"mask", "--preset", "causal", "--tq", "8"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  // One character per token for small masks: row i keeps keys 0..i.
  for (int i = 0; i < 8; ++i) {
    const std::string row = "  " + std::string(i + 1, '#') + std::string(7 - i, '.') + "\n";
    EXPECT_NE(r.out.find(row), std::string::npos) << "row " << i << "\n" << r.out;
  }
}

TEST(CliMask, LargeMaskPictureStaysNarrowAndListIsTruncated) {
  const CliResult r = run_cli({"mask", "--preset", "block_causal", "--tq", "100000", "--block", "100"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  std::istringstream lines(r.out);
  int picture_rows = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.size() > 2 && line.find_first_not_of("#+.", 2) == std::string::npos && line.rfind("  ", 0) == 0) {
      EXPECT_LE(line.size(), 2u + 64u) << line;
      ++picture_rows;
    }
  }
  EXPECT_GT(picture_rows, 4);
  EXPECT_LE(picture_rows, 48);
  EXPECT_NE(r.out.find("more)"), std::string::npos) << "1000 slices should be truncated";
  EXPECT_LT(r.out.size(), 8000u);
}

TEST(CliMask, MaskFileIsValidatedAndDescribed) {
  TempDir dir;
  const std::string json = R"({"q_ranges": [[0, 10], [10, 20]], "k_ranges": [[0, 10], [0, 20]],
                              "attn_type_map": ["causal", "bi_causal"]})";
  write_file(dir / "m.json", std::vector<unsigned char>(json.begin(), json.end()));
  const CliResult r = run_cli({"mask", "--mask", dir / "m.json"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  Mask expected;
  expected.slices = {{{0, 10}, {0, 10}, MaskType::Causal}, {{10, 20}, {0, 20}, MaskType::BiCausal}};
  expected.total_q = 20;
  expected.total_k = 20;
  EXPECT_EQ(reported_area(r.out), expected.area()) << r.out;
  EXPECT_NE(r.out.find("bi_causal"), std::string::npos) << r.out;
}

struct PngInfo {
  bool signature_ok = false;
  uint32_t width = 0, height = 0;
  int bit_depth = 0, color_type = -1;
};

PngInfo read_png_header(const std::string& path) {
  const std::string bytes = slurp(path);
  PngInfo info;
  const std::string signature = "\x89PNG\r\n\x1a\n";
  if (bytes.size() < 33 || bytes.compare(0, 8, signature) != 0 || bytes.compare(12, 4, "IHDR") != 0) return info;
  info.signature_ok = true;
  auto be32 = [&](size_t at) {
    return (uint32_t{static_cast<unsigned char>(bytes[at])} << 24) |
           (uint32_t{static_cast<unsigned char>(bytes[at + 1])} << 16) |
           (uint32_t{static_cast<unsigned char>(bytes[at + 2])} << 8) | uint32_t{static_cast<unsigned char>(bytes[at + 3])};
  };
  info.width = be32(16);
  info.height = be32(20);
  info.bit_depth = static_cast<unsigned char>(bytes[24]);
  info.color_type = static_cast<unsigned char>(bytes[25]);
  return info;
}

TEST(CliMask, PngIsValidGreyscaleAndBounded) {
  TempDir dir;
  struct Case {
    std::vector<std::string> args;
    uint32_t width, height;
  };
  const std::vector<Case> cases = {
      {{"--preset", "causal", "--tq", "16"}, 256, 256},                 // small: scaled up by whole pixels
      {{"--preset", "causal", "--tq", "4096", "--tk", "1024"}, 256, 1024},  // downsampled, aspect kept
      {{"--preset", "documents", "--tq", "200000", "--seed", "3"}, 1024, 1024},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {"mask", "--png", dir / "m.png"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    const CliResult r = run_cli(args);
    ASSERT_EQ(r.exit_code, 0) << args_text(args) << describe(r);
    const PngInfo info = read_png_header(dir / "m.png");
    EXPECT_TRUE(info.signature_ok) << args_text(args);
    EXPECT_EQ(info.width, c.width) << args_text(args);
    EXPECT_EQ(info.height, c.height) << args_text(args);
    EXPECT_EQ(info.bit_depth, 8);
    EXPECT_EQ(info.color_type, 0) << "greyscale";
    fs::remove(dir / "m.png");
  }
}

}  // namespace
}  // namespace magi::cli::test
