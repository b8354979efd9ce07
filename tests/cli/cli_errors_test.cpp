// `magi-attn` bad input: one test per class of error. Each asserts exit code 2, exactly one stderr line
// "magi-attn: error: ..." that names the problem, and that nothing was written.
#include <gtest/gtest.h>

#include <cstring>

#include "cli/npy.hpp"
#include "cli_test_helpers.hpp"

namespace magi::cli::test {
namespace {

constexpr int64_t kTq = 32, kTk = 40, kHq = 4, kHkv = 2, kD = 8;

// A valid problem on disk; tests break one thing at a time.
class CliErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(std::random_device{}());
    write_text("mask.json", R"({"q_ranges": [[0, 32]], "k_ranges": [[0, 40]], "attn_type_map": ["causal"]})");
    write_npy_file(dir_ / "q.npy", DType::F32, {kTq, kHq, kD}, normal_values(rng, kTq * kHq * kD));
    write_npy_file(dir_ / "k.npy", DType::F32, {kTk, kHkv, kD}, normal_values(rng, kTk * kHkv * kD));
    write_npy_file(dir_ / "v.npy", DType::F32, {kTk, kHkv, kD}, normal_values(rng, kTk * kHkv * kD));
    write_npy_file(dir_ / "do.npy", DType::F32, {kTq, kHq, kD}, normal_values(rng, kTq * kHq * kD));
    write_npy_file(dir_ / "sink.npy", DType::F32, {2, kHq}, normal_values(rng, 2 * kHq));
  }

  void write_text(const std::string& name, const std::string& text) {
    write_file(dir_ / name, std::vector<unsigned char>(text.begin(), text.end()));
  }
  void write_bytes(const std::string& name, const std::string& bytes) { write_text(name, bytes); }

  std::vector<std::string> valid_args() const {
    return {"run",         "--mask", dir_ / "mask.json", "--q", dir_ / "q.npy", "--k", dir_ / "k.npy",
            "--v",         dir_ / "v.npy", "--do", dir_ / "do.npy", "--out-dir", out_dir()};
  }
  std::string out_dir() const { return dir_ / "out"; }

  // Runs and checks the error contract plus "nothing written": the out dir was never created.
  void expect_error(std::vector<std::string> args, const std::vector<std::string>& fragments,
                    const std::vector<std::string>& env = {}) {
    const CliResult r = run_cli(args, env);
    expect_one_line_error(r, fragments);
    EXPECT_TRUE(r.out.empty()) << describe(r);
    EXPECT_FALSE(fs::exists(out_dir())) << "an output folder was created despite the error";
  }

  std::vector<std::string> with(std::vector<std::string> args, const std::string& option, const std::string& value) {
    for (size_t i = 0; i + 1 < args.size(); ++i)
      if (args[i] == option) {
        args[i + 1] = value;
        return args;
      }
    args.push_back(option);
    args.push_back(value);
    return args;
  }
  std::vector<std::string> without(std::vector<std::string> args, const std::string& option) {
    for (size_t i = 0; i + 1 < args.size(); ++i)
      if (args[i] == option) {
        args.erase(args.begin() + static_cast<std::ptrdiff_t>(i), args.begin() + static_cast<std::ptrdiff_t>(i + 2));
        break;
      }
    return args;
  }

  TempDir dir_;
};

TEST_F(CliErrors, ValidBaselineRuns) {
  const CliResult r = run_cli(valid_args());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(fs::exists(out_dir() + "/dv.npy"));
}

TEST_F(CliErrors, MissingInputFile) {
  const std::string missing = dir_ / "nope.npy";
  expect_error(with(valid_args(), "--k", missing), {"--k", missing, "cannot open"});
}

TEST_F(CliErrors, DirectoryAsInputFile) {
  const std::string folder = dir_ / "a_folder";
  fs::create_directories(folder);
  expect_error(with(valid_args(), "--q", folder), {"--q", folder, "is a directory"});
  expect_error(with(valid_args(), "--mask", folder), {folder, "is a directory"});
}

TEST_F(CliErrors, DemoHeadDimNotAMultipleOfEightBeforeAnyWork) {
  // One line: the check runs before the demo prints its first step.
  expect_error({"demo", "--tokens", "300", "--head-dim", "12"}, {"--head-dim", "12", "multiple of 8"});
}

TEST_F(CliErrors, WrongRank) {
  write_npy_file(dir_ / "q2.npy", DType::F32, {kTq, kHq * kD}, std::vector<double>(kTq * kHq * kD, 0.0));
  expect_error(with(valid_args(), "--q", dir_ / "q2.npy"), {"--q", "q2.npy", "expected shape [Tq, Hq, D]", "[32, 32]"});
}

TEST_F(CliErrors, HeadDimMismatch) {
  write_npy_file(dir_ / "v2.npy", DType::F32, {kTk, kHkv, 16}, std::vector<double>(kTk * kHkv * 16, 0.0));
  expect_error(with(valid_args(), "--v", dir_ / "v2.npy"), {"--v", "v2.npy", "expected shape [40, 2, 8]", "[40, 2, 16]"});
}

TEST_F(CliErrors, DoutShapeMismatch) {
  write_npy_file(dir_ / "do2.npy", DType::F32, {kTq - 1, kHq, kD}, std::vector<double>((kTq - 1) * kHq * kD, 0.0));
  expect_error(with(valid_args(), "--do", dir_ / "do2.npy"), {"--do", "do2.npy", "[32, 4, 8]", "[31, 4, 8]"});
}

// Hand-made .npy bytes: magic, version 1.0, header length, header padded to 64 bytes, data.
std::string raw_npy(const std::string& descr, const std::string& order, const std::string& shape, size_t data_bytes) {
  std::string header = "{'descr': '" + descr + "', 'fortran_order': " + order + ", 'shape': " + shape + ", }";
  header.append(64 - 10 - header.size() % 64 - 1 + (header.size() % 64 + 11 > 64 ? 64 : 0), ' ');
  header += '\n';
  std::string bytes = "\x93NUMPY";
  bytes += '\x01';
  bytes += '\x00';
  bytes += static_cast<char>(header.size() & 0xff);
  bytes += static_cast<char>(header.size() >> 8);
  return bytes + header + std::string(data_bytes, '\0');
}

TEST_F(CliErrors, WrongDtypeInt32) {
  write_bytes("qi.npy", raw_npy("<i4", "False", "(32, 4, 8)", kTq * kHq * kD * 4));
  expect_error(with(valid_args(), "--q", dir_ / "qi.npy"), {"--q", "qi.npy", "unsupported dtype '<i4'", "'<f4'", "'<f8'"});
}

TEST_F(CliErrors, FortranOrder) {
  write_bytes("qf.npy", raw_npy("<f4", "True", "(32, 4, 8)", kTq * kHq * kD * 4));
  expect_error(with(valid_args(), "--q", dir_ / "qf.npy"), {"--q", "qf.npy", "fortran_order"});
}

TEST_F(CliErrors, BigEndian) {
  write_bytes("qb.npy", raw_npy(">f8", "False", "(32, 4, 8)", kTq * kHq * kD * 8));
  expect_error(with(valid_args(), "--q", dir_ / "qb.npy"), {"qb.npy", "big-endian"});
}

TEST_F(CliErrors, TruncatedData) {
  write_bytes("qt.npy", raw_npy("<f4", "False", "(32, 4, 8)", kTq * kHq * kD * 4 - 3));
  expect_error(with(valid_args(), "--q", dir_ / "qt.npy"), {"qt.npy", "truncated"});
}

TEST_F(CliErrors, NotAnNpyFile) {
  write_text("text.npy", "hello, this is not numpy");
  expect_error(with(valid_args(), "--q", dir_ / "text.npy"), {"text.npy", "bad magic"});
}

TEST_F(CliErrors, OverlappingMask) {
  write_text("overlap.json", R"({"q_ranges": [[0, 20], [10, 32]], "k_ranges": [[0, 40], [0, 40]],
                                 "attn_type_map": ["full", "full"]})");
  expect_error(with(valid_args(), "--mask", dir_ / "overlap.json"), {"--mask", "overlap.json", "overlap"});
}

TEST_F(CliErrors, MaskRangeOutOfBounds) {
  write_text("oob.json", R"({"q_ranges": [[0, 32]], "k_ranges": [[0, 50]], "attn_type_map": ["full"]})");
  expect_error(with(valid_args(), "--mask", dir_ / "oob.json"), {"--mask", "oob.json", "k_range end 50", "40"});
}

TEST_F(CliErrors, MaskStartAfterEnd) {
  write_text("rev.json", R"({"q_ranges": [[10, 5]], "k_ranges": [[0, 40]], "attn_type_map": ["full"]})");
  expect_error(with(valid_args(), "--mask", dir_ / "rev.json"), {"rev.json", "start 10 > end 5"});
}

TEST_F(CliErrors, MaskUnknownType) {
  write_text("type.json", R"({"q_ranges": [[0, 32]], "k_ranges": [[0, 40]], "attn_type_map": ["diagonal"]})");
  expect_error(with(valid_args(), "--mask", dir_ / "type.json"), {"type.json", "diagonal"});
}

TEST_F(CliErrors, MaskMalformedJson) {
  write_text("bad.json", R"({"q_ranges": [[0, 32]], )");
  expect_error(with(valid_args(), "--mask", dir_ / "bad.json"), {"--mask", "bad.json", "JSON"});
}

TEST_F(CliErrors, MaskTotalsDisagreeWithTensors) {
  write_text("totals.json", R"({"q_ranges": [[0, 32]], "k_ranges": [[0, 40]], "attn_type_map": [0],
                                "total_q": 64, "total_k": 40})");
  expect_error(with(valid_args(), "--mask", dir_ / "totals.json"), {"totals.json", "total_q 64", "32"});
}

TEST_F(CliErrors, MaskLongerThanTensors) {
  // No totals in the JSON: they come from q (32 rows), and a q range up to 48 does not fit.
  write_text("long.json", R"({"q_ranges": [[0, 48]], "k_ranges": [[0, 40]], "attn_type_map": [0]})");
  expect_error(with(valid_args(), "--mask", dir_ / "long.json"), {"long.json", "q_range end 48", "total_q 32"});
}

TEST_F(CliErrors, UnknownOption) {
  auto args = valid_args();
  args.push_back("--bogus");
  args.push_back("1");
  expect_error(args, {"unknown option '--bogus'", "allowed:", "--mask", "--out-dir"});
}

TEST_F(CliErrors, MissingRequiredOption) {
  expect_error(without(valid_args(), "--v"), {"missing required option --v"});
}

TEST_F(CliErrors, OptionWithoutValue) {
  auto args = without(valid_args(), "--out-dir");
  args.push_back("--out-dir");
  const CliResult r = run_cli(args);
  expect_one_line_error(r, {"--out-dir", "needs a value"});
}

TEST_F(CliErrors, BadDtypeValue) {
  expect_error(with(valid_args(), "--dtype", "fp8"), {"--dtype", "fp8", "bf16", "fp16", "fp32", "fp64"});
}

TEST_F(CliErrors, BadBackendValue) {
  expect_error(with(valid_args(), "--backend", "tpu"), {"--backend", "tpu"});
}

TEST_F(CliErrors, BadNumber) {
  expect_error(with(valid_args(), "--softcap", "abc"), {"--softcap", "abc", "not a finite number"});
}

TEST_F(CliErrors, BadSinkLayout) {
  auto args = with(with(valid_args(), "--sink", dir_ / "sink.npy"), "--sink-layout", "hs");
  expect_error(args, {"--sink-layout", "hs", "sh", "ssh"});
  // The error lists only what passes ("none" is a layout of the API, not of a given --sink).
  const CliResult r = run_cli(with(args, "--sink-layout", "nonsense"));
  EXPECT_EQ(r.err.find("none"), std::string::npos) << describe(r);
  expect_error(with(args, "--sink-layout", "none"), {"--sink-layout", "'none'", "(allowed: sh, ssh)"});
}

TEST_F(CliErrors, SinkWithoutLayout) {
  expect_error(with(valid_args(), "--sink", dir_ / "sink.npy"), {"--sink needs --sink-layout"});
}

TEST_F(CliErrors, SinkShapeDoesNotMatchLayout) {
  // [2, Hq] is an sh sink; as ssh it needs [Tq, S, Hq].
  auto args = with(with(valid_args(), "--sink", dir_ / "sink.npy"), "--sink-layout", "ssh");
  expect_error(args, {"--sink", "sink.npy", "[Tq, S, Hq]", "[2, 4]"});
}

TEST_F(CliErrors, MixedInputDtypesNeedDtype) {
  write_npy_file(dir_ / "k64.npy", DType::F64, {kTk, kHkv, kD}, std::vector<double>(kTk * kHkv * kD, 0.5));
  expect_error(with(valid_args(), "--k", dir_ / "k64.npy"), {"mixed dtypes", "--dtype"});
  const CliResult r = run_cli(with(with(valid_args(), "--k", dir_ / "k64.npy"), "--dtype", "fp32"));
  EXPECT_EQ(r.exit_code, 0) << describe(r);
}

TEST_F(CliErrors, BadEnvironmentVariable) {
  expect_error(valid_args(), {"MAGI_ATTENTION_DSINK_ALL_REDUCE_OP", "max"},
               {"MAGI_ATTENTION_DSINK_ALL_REDUCE_OP=max"});
}

TEST_F(CliErrors, OutDirIsAFile) {
  write_text("out", "a file, not a folder");
  const CliResult r = run_cli(valid_args());
  expect_one_line_error(r, {"--out-dir", "not a directory"});
  EXPECT_EQ(slurp(out_dir()), "a file, not a folder");
}

TEST_F(CliErrors, ExistingOutDirIsLeftUntouched) {
  fs::create_directories(out_dir());
  write_text("out/keep.txt", "mine");
  const CliResult r = run_cli(with(valid_args(), "--dtype", "fp8"));
  expect_one_line_error(r, {"--dtype"});
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(out_dir())) names.push_back(entry.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"keep.txt"});
}

TEST_F(CliErrors, UnknownCommandAndNoCommand) {
  expect_one_line_error(run_cli({"frobnicate"}), {"unknown command 'frobnicate'", "run", "mask", "demo", "env"});
  expect_one_line_error(run_cli({}), {"missing command"});
}

TEST_F(CliErrors, MaskCommandErrors) {
  expect_one_line_error(run_cli({"mask", "--preset", "zigzag", "--tq", "8"}), {"unknown preset 'zigzag'", "causal"});
  expect_one_line_error(run_cli({"mask", "--preset", "causal"}), {"needs --tq"});
  expect_one_line_error(run_cli({"mask", "--preset", "full", "--tq", "8", "--block", "4"}),
                        {"--block is not used by preset 'full'"});
  expect_one_line_error(run_cli({"mask"}), {"exactly one of --mask", "--preset"});
  expect_one_line_error(run_cli({"mask", "--preset", "block_causal", "--tq", "-3", "--block", "4"}),
                        {"--tq", "out of range"});
  write_text("overlap.json", R"({"q_ranges": [[0, 20], [10, 32]], "k_ranges": [[0, 40], [0, 40]],
                                 "attn_type_map": [0, 0]})");
  const std::string png = dir_ / "never.png";
  expect_one_line_error(run_cli({"mask", "--mask", dir_ / "overlap.json", "--png", png}), {"overlap"});
  EXPECT_FALSE(fs::exists(png));
}

TEST_F(CliErrors, DemoOptionErrors) {
  expect_one_line_error(run_cli({"demo", "--heads-q", "6", "--heads-kv", "4"}), {"--heads-kv 4 must divide --heads-q 6"});
  expect_one_line_error(run_cli({"demo", "--tokens", "0"}), {"--tokens", "out of range"});
  expect_one_line_error(run_cli({"demo", "--dtype", "int8"}), {"--dtype", "int8"});
}

}  // namespace
}  // namespace magi::cli::test
