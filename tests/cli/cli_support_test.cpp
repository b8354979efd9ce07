// Unit tests of the CLI's building blocks: the .npy codec, the option parser and the document-length sampler.
#include <gtest/gtest.h>

#include <random>

// The CLI support sources (the tests link only the library).
#include "cli/documents.hpp"
#include "cli/npy.hpp"
#include "cli/options.hpp"
#include "magi/attention.hpp"
#include "magi/error.hpp"
#include "reference/naive_attention.hpp"
#include "reference/random_inputs.hpp"

namespace magi::cli {
namespace {

std::vector<unsigned char> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

// .npy bytes with a hand-written header (version major.0), padded so the data starts at a multiple of 64.
std::vector<unsigned char> handmade_npy(const std::string& dict, int major, const std::string& data) {
  const size_t length_bytes = major == 1 ? 2 : 4;
  std::string header = dict;
  while ((8 + length_bytes + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string bytes = "\x93NUMPY";
  bytes += static_cast<char>(major);
  bytes += '\0';
  for (size_t i = 0; i < length_bytes; ++i) bytes += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return bytes_of(bytes + header + data);
}

std::string expect_npy_error(const std::vector<unsigned char>& bytes) {
  try {
    parse_npy(bytes, "some/file.npy");
  } catch (const InvalidArgument& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind("some/file.npy: ", 0), 0u) << message;
    return message;
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(Npy, RoundTripsShapesAndDtypes) {
  const uint64_t seed = magi::test::fresh_seed();
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  const std::vector<std::vector<int64_t>> shapes = {{}, {5}, {2, 3, 4}, {0, 3}, {3, 1, 2, 2}};
  for (DType dtype : {DType::F32, DType::F64}) {
    for (const auto& shape : shapes) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      std::vector<double> values(static_cast<size_t>(n));
      for (double& x : values) x = magi::round_to(dtype, normal(rng));
      const auto bytes = encode_npy(dtype, shape, values);
      // numpy's layout: magic, version 1.0, the data starting at a multiple of 64 bytes.
      ASSERT_GE(bytes.size(), 64u);
      EXPECT_EQ(std::string(bytes.begin(), bytes.begin() + 6), "\x93NUMPY");
      EXPECT_EQ(bytes[6], 1);
      const size_t data_start = 10 + bytes[8] + 256 * bytes[9];
      EXPECT_EQ(data_start % 64, 0u);
      EXPECT_EQ(bytes[data_start - 1], '\n');
      EXPECT_EQ(bytes.size() - data_start, static_cast<size_t>(n) * (dtype == DType::F32 ? 4 : 8));
      const NpyArray back = parse_npy(bytes, "x.npy");
      EXPECT_EQ(back.dtype, dtype);
      EXPECT_EQ(back.shape, shape);
      EXPECT_EQ(back.values, values) << "seed " << seed;
    }
  }
}

// numpy pads the header dict with spaces and a newline; other text after it (which numpy refuses) is malformed.
TEST(Npy, RefusesTextAfterTheHeaderDict) {
  const std::string data(8, '\0');
  for (const std::string& tail : {std::string(" junk"), std::string(", 'x'"), std::string(1, '\0')}) {
    const std::string message =
        expect_npy_error(handmade_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }" + tail, 1, data));
    EXPECT_NE(message.find("unexpected text after the dict"), std::string::npos) << message;
  }
  EXPECT_NO_THROW(parse_npy(handmade_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }  \n ", 1, data),
                            "x.npy"));
}

TEST(Npy, HeaderTextMatchesNumpy) {
  const auto bytes = encode_npy(DType::F32, std::vector<int64_t>{7}, std::vector<double>(7, 1.0));
  const size_t data_start = 10 + bytes[8] + 256 * bytes[9];
  ASSERT_EQ(data_start, 128u);  // 10 + 57 header characters + newline, rounded up to 64
  const std::string header(bytes.begin() + 10, bytes.begin() + static_cast<std::ptrdiff_t>(data_start));
  EXPECT_EQ(header.rfind("{'descr': '<f4', 'fortran_order': False, 'shape': (7,), }", 0), 0u) << header;
}

TEST(Npy, ReadsVersion2AndDoubleQuotedKeys) {
  const float data[2] = {1.5f, -2.0f};
  const auto bytes = handmade_npy(R"({"descr": "<f4", "shape": (2,), "fortran_order": False})", 2,
                                  std::string(reinterpret_cast<const char*>(data), sizeof data));
  const NpyArray a = parse_npy(bytes, "v2.npy");
  EXPECT_EQ(a.shape, std::vector<int64_t>{2});
  EXPECT_EQ(a.values, (std::vector<double>{1.5, -2.0}));
}

TEST(Npy, RejectsWhatTheContractDoesNotCover) {
  const std::string eight(8, '\0');
  EXPECT_NE(expect_npy_error(bytes_of("PK\x03\x04 zip file")).find("bad magic"), std::string::npos);
  EXPECT_NE(expect_npy_error(handmade_npy("{'descr': '<f8', 'fortran_order': False, 'shape': (1,), }", 3, eight))
                .find("version 3.0"),
            std::string::npos);
  EXPECT_NE(expect_npy_error(handmade_npy("{'descr': '<i8', 'fortran_order': False, 'shape': (1,), }", 1, eight))
                .find("unsupported dtype '<i8'"),
            std::string::npos);
  EXPECT_NE(expect_npy_error(handmade_npy("{'descr': '<f2', 'fortran_order': False, 'shape': (4,), }", 1, eight))
                .find("unsupported dtype '<f2'"),
            std::string::npos);
  EXPECT_NE(expect_npy_error(handmade_npy("{'descr': '>f8', 'fortran_order': False, 'shape': (1,), }", 1, eight))
                .find("big-endian"),
            std::string::npos);
  EXPECT_NE(expect_npy_error(handmade_npy("{'descr': '<f8', 'fortran_order': True, 'shape': (1,), }", 1, eight))
                .find("fortran_order"),
            std::string::npos);
  EXPECT_NE(expect_npy_error(handmade_npy("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", 1, eight))
                .find("truncated"),
            std::string::npos);
  EXPECT_NE(expect_npy_error(handmade_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", 1, eight))
                .find("bytes after the data"),
            std::string::npos);
  EXPECT_NE(expect_npy_error(handmade_npy("{'descr': '<f4', 'shape': (1,), }", 1, eight)).find("fortran_order"),
            std::string::npos);
  EXPECT_NE(expect_npy_error(handmade_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", 1, eight))
                .find("malformed"),
            std::string::npos);
  EXPECT_NE(expect_npy_error(handmade_npy("[1, 2, 3]", 1, eight)).find("malformed"), std::string::npos);
  const auto whole = encode_npy(DType::F64, std::vector<int64_t>{4}, std::vector<double>(4, 0.0));
  EXPECT_NE(expect_npy_error(std::vector<unsigned char>(whole.begin(), whole.begin() + 40)).find("truncated"),
            std::string::npos);
}

// (256, 2^53 + 2, 8) wraps around int64 to 4096 elements, which 16384 data bytes would have matched.
TEST(Npy, ShapeWhoseElementCountOverflowsIsRejected) {
  const std::string data(16384, '\0');
  EXPECT_NE(expect_npy_error(handmade_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (256, 9007199254740994, 8), }",
                                          1, data))
                .find("more elements than fit in 64 bits"),
            std::string::npos);
  // A zero extent makes the product 0 wherever it stands.
  const NpyArray empty =
      parse_npy(handmade_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1125899906842624, 1125899906842624, 0), }",
                             1, ""),
                "empty.npy");
  EXPECT_EQ(empty.values.size(), 0u);
}

TEST(Npy, MissingFileNamesThePath) {
  try {
    read_npy("/nonexistent/dir/q.npy");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/q.npy: cannot open"), std::string::npos) << e.what();
  }
}

Options demo_options() {
  return Options("demo", "demo [options]", "A test command.",
                 {{"size", "N", "a size"}, {"ratio", "X", "a ratio"}, {"docs", "LIST", "a list"}, {"fast", "", "a flag"}});
}

TEST(Options, ParsesValuesFlagsAndEqualsForm) {
  Options o = demo_options();
  const std::vector<std::string> args = {"--size", "12", "--ratio=-0.5", "--fast", "--docs", "0,4,9"};
  o.parse(args);
  EXPECT_FALSE(o.help_requested());
  EXPECT_EQ(o.get_int("size", 0, 0, 100), 12);
  EXPECT_EQ(o.get_double("ratio"), -0.5);
  EXPECT_TRUE(o.has("fast"));
  EXPECT_EQ(o.get_int_list("docs"), (std::vector<int64_t>{0, 4, 9}));
  EXPECT_EQ(o.get_int("missing-is-fine", 7, 0, 10), 7);
}

TEST(Options, NegativeNumbersAreValues) {
  Options o = demo_options();
  const std::vector<std::string> args = {"--ratio", "-3"};
  o.parse(args);
  EXPECT_EQ(o.get_double("ratio"), -3.0);
}

std::string parse_error(std::vector<std::string> args, const std::function<void(const Options&)>& use = {}) {
  Options o = demo_options();
  try {
    o.parse(args);
    if (use) use(o);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(Options, ErrorsNameTheOption) {
  EXPECT_NE(parse_error({"--nope", "1"}).find("unknown option '--nope' (allowed: --size, --ratio, --docs, --fast, --help)"),
            std::string::npos);
  EXPECT_NE(parse_error({"--size"}).find("--size needs a value"), std::string::npos);
  EXPECT_NE(parse_error({"--size", "--fast"}).find("--size needs a value"), std::string::npos);
  EXPECT_NE(parse_error({"--size", "1", "--size", "2"}).find("given twice"), std::string::npos);
  EXPECT_NE(parse_error({"--fast=1"}).find("takes no value"), std::string::npos);
  EXPECT_NE(parse_error({"stray"}).find("unexpected argument 'stray'"), std::string::npos);
  auto size = [](const Options& o) { o.get_int("size", 0, 0, 10); };
  EXPECT_NE(parse_error({"--size", "12x"}, size).find("--size: '12x' is not an integer"), std::string::npos);
  EXPECT_NE(parse_error({"--size", "11"}, size).find("out of range [0, 10]"), std::string::npos);
  auto ratio = [](const Options& o) { o.get_double("ratio"); };
  EXPECT_NE(parse_error({"--ratio", "nan"}, ratio).find("not a finite number"), std::string::npos);
  auto docs = [](const Options& o) { o.get_int_list("docs"); };
  EXPECT_NE(parse_error({"--docs", "1,,2"}, docs).find("--docs: '' is not an integer"), std::string::npos);
  auto need = [](const Options& o) { o.require("size"); };
  EXPECT_NE(parse_error({}, need).find("missing required option --size"), std::string::npos);
}

TEST(Options, ThreadsFollowTheLibraryLimit) {
  const auto threads = [](const std::string& value) {
    Options options("run", "run", "", {{"threads", "N", "threads"}});
    const std::vector<std::string> args = {"--threads", value};
    options.parse(args);
    return get_threads(options);
  };
  EXPECT_EQ(threads("0"), 0);
  EXPECT_EQ(threads(std::to_string(kMaxThreads)), kMaxThreads);
  for (const std::string bad : {std::to_string(kMaxThreads + 1), std::string("-1"), std::string("4096")}) {
    try {
      threads(bad);
      ADD_FAILURE() << "no error for --threads " << bad;
    } catch (const InvalidArgument& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("--threads"), std::string::npos) << message;
      EXPECT_NE(message.find("1 .. " + std::to_string(kMaxThreads)), std::string::npos) << message;
    }
  }
  Options none("run", "run", "", {{"threads", "N", "threads"}});
  EXPECT_EQ(get_threads(none), 0);
}

TEST(Options, HelpAnywhereWins) {
  Options o = demo_options();
  const std::vector<std::string> args = {"--nope", "-h"};
  o.parse(args);
  EXPECT_TRUE(o.help_requested());
  const std::string help = o.help_text();
  for (const char* fragment : {"usage: demo [options]", "--size N", "a ratio", "--fast", "--help"})
    EXPECT_NE(help.find(fragment), std::string::npos) << fragment << "\n" << help;
}

TEST(Documents, LengthsCoverTheTokensAndHaveALongTail) {
  for (uint64_t seed : {1ull, 2ull, 3ull, 99ull}) {
    const auto cu = draw_documents(100000, seed);
    ASSERT_GE(cu.size(), 2u);
    EXPECT_EQ(cu.front(), 0);
    EXPECT_EQ(cu.back(), 100000);
    int32_t shortest = 1 << 30, longest = 0;
    for (size_t i = 1; i < cu.size(); ++i) {
      const int32_t length = cu[i] - cu[i - 1];
      shortest = std::min(shortest, length);
      longest = std::max(longest, length);
    }
    EXPECT_GE(shortest, DocumentShape{}.min_length) << "seed " << seed;
    EXPECT_GT(longest, 8 * shortest) << "lengths should be long-tailed, seed " << seed;
    EXPECT_EQ(draw_documents(100000, seed), cu) << "same seed, same documents";
  }
  EXPECT_EQ(draw_documents(0, 1), std::vector<int32_t>{0});
  EXPECT_EQ(draw_documents(5, 1), (std::vector<int32_t>{0, 5}));
}

}  // namespace
}  // namespace magi::cli
