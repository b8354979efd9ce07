// `magi-attn run` end to end: .npy inputs and a mask JSON in, .npy outputs checked against the naive
// fp64 reference (tests/reference) on the same rounded inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cli/npy.hpp"
#include "cli_test_helpers.hpp"
#include "magi/tensor.hpp"
#include "reference/naive_attention.hpp"
#include "reference/random_inputs.hpp"

namespace magi::cli::test {
namespace {

// Mixed types, two slices sharing q rows (merged exactly), Sq < Sk for bi_causal, and rows 46..47 that
// no slice covers. Totals are left out of the JSON: they come from q and k.
constexpr const char* kMaskJson = R"({"q_ranges": [[0, 16], [16, 40], [16, 40], [40, 46]],
  "k_ranges": [[0, 32], [0, 40], [48, 64], [50, 60]],
  "attn_type_map": ["full", "causal", 2, "bi_causal"]})";

Mask expected_mask() {
  Mask mask;
  mask.slices = {magi::test::make_slice(0, 16, 0, 32, MaskType::Full),
                 magi::test::make_slice(16, 40, 0, 40, MaskType::Causal),
                 magi::test::make_slice(16, 40, 48, 64, MaskType::InvCausal),
                 magi::test::make_slice(40, 46, 50, 60, MaskType::BiCausal)};
  mask.total_q = 48;
  mask.total_k = 64;
  return mask;
}

constexpr int32_t kTq = 48, kTk = 64, kHq = 4, kHkv = 2, kD = 16, kSink = 2;

struct Problem {
  std::vector<double> q, k, v, dout, sink;  // as written to the files
};

Problem random_problem(std::mt19937_64& rng, SinkLayout layout) {
  Problem p;
  p.q = normal_values(rng, size_t{kTq} * kHq * kD);
  p.k = normal_values(rng, size_t{kTk} * kHkv * kD);
  p.v = normal_values(rng, size_t{kTk} * kHkv * kD);
  p.dout = normal_values(rng, size_t{kTq} * kHq * kD);
  if (layout == SinkLayout::SH) p.sink = normal_values(rng, size_t{kSink} * kHq);
  if (layout == SinkLayout::SSH) p.sink = normal_values(rng, size_t{kTq} * kSink * kHq);
  return p;
}

// Writes the inputs in `file_dtype` and returns the argument list for them.
std::vector<std::string> write_inputs(const TempDir& dir, const Problem& p, DType file_dtype, SinkLayout layout,
                                      bool with_dout) {
  write_file(dir / "mask.json", std::vector<unsigned char>(kMaskJson, kMaskJson + std::strlen(kMaskJson)));
  write_npy_file(dir / "q.npy", file_dtype, {kTq, kHq, kD}, p.q);
  write_npy_file(dir / "k.npy", file_dtype, {kTk, kHkv, kD}, p.k);
  write_npy_file(dir / "v.npy", file_dtype, {kTk, kHkv, kD}, p.v);
  std::vector<std::string> args = {"run", "--mask", dir / "mask.json", "--q", dir / "q.npy", "--k", dir / "k.npy",
                                    "--v", dir / "v.npy", "--out-dir", dir / "out"};
  if (with_dout) {
    write_npy_file(dir / "do.npy", file_dtype, {kTq, kHq, kD}, p.dout);
    args.insert(args.end(), {"--do", dir / "do.npy"});
  }
  if (layout != SinkLayout::None) {
    const std::vector<int64_t> shape = layout == SinkLayout::SH ? std::vector<int64_t>{kSink, kHq}
                                                                : std::vector<int64_t>{kTq, kSink, kHq};
    write_npy_file(dir / "sink.npy", file_dtype, shape, p.sink);
    args.insert(args.end(), {"--sink", dir / "sink.npy", "--sink-layout", std::string(to_string(layout))});
  }
  return args;
}

magi::test::ReferenceProblem reference_problem(const Problem& p, DType dtype, SinkLayout layout, double scale,
                                               double softcap) {
  magi::test::ReferenceProblem r;
  r.mask = expected_mask();
  r.heads_q = kHq;
  r.heads_kv = kHkv;
  r.head_dim = kD;
  r.softmax_scale = scale;
  r.softcap = softcap;
  r.sink_layout = layout;
  r.sink_len = layout == SinkLayout::None ? 0 : kSink;
  r.q = magi::test::rounded(p.q, dtype);
  r.k = magi::test::rounded(p.k, dtype);
  r.v = magi::test::rounded(p.v, dtype);
  r.sink = magi::test::rounded(p.sink, DType::F32);  // the sink is fp32 whatever the compute dtype
  return r;
}

// Reads an output: it must exist, be float32 and have `shape`.
std::vector<double> read_output(const TempDir& dir, const std::string& name, const std::vector<int64_t>& shape) {
  const fs::path path = dir.path() / "out" / name;
  EXPECT_TRUE(fs::exists(path)) << path;
  if (!fs::exists(path)) return {};
  const NpyArray a = read_npy(path.string());
  EXPECT_EQ(a.dtype, DType::F32) << name;
  EXPECT_EQ(a.shape, shape) << name;
  return a.values;
}

void expect_lse_close(const std::vector<double>& got, const std::vector<double>& ref, double tol,
                      const std::string& context) {
  ASSERT_EQ(got.size(), ref.size()) << context;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) EXPECT_EQ(got[i], ref[i]) << context << " lse[" << i << "]";
    else EXPECT_LE(std::fabs(got[i] - ref[i]), tol) << context << " lse[" << i << "] got " << got[i] << " ref " << ref[i];
  }
}

TEST(CliRun, ForwardOnlyFp32MatchesReference) {
  const uint64_t seed = magi::test::fresh_seed();
  std::mt19937_64 rng(seed);
  const std::string context = "seed " + std::to_string(seed);
  TempDir dir;
  const Problem p = random_problem(rng, SinkLayout::None);
  const CliResult r = run_cli(write_inputs(dir, p, DType::F32, SinkLayout::None, false));
  ASSERT_EQ(r.exit_code, 0) << describe(r);

  const auto ref = magi::test::reference_forward(reference_problem(p, DType::F32, SinkLayout::None, 0.0, 0.0));
  const auto out = read_output(dir, "out.npy", {kTq, kHq, kD});
  const auto lse = read_output(dir, "lse.npy", {kTq, kHq});
  EXPECT_LE(rel_l2(out, ref.out), 1e-5) << context;
  expect_lse_close(lse, ref.lse, 1e-5, context);
  // Uncovered rows 46, 47: out exactly 0 and lse -inf.
  for (size_t i = size_t{46} * kHq * kD; i < out.size(); ++i) ASSERT_EQ(out[i], 0.0) << context;
  EXPECT_TRUE(std::isinf(lse[46 * kHq]) && lse[46 * kHq] < 0) << context;
  // Forward only: no gradient files.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path() / "out"), fs::directory_iterator()), 2) << context;
}

TEST(CliRun, ForwardBackwardFp64WithSshSinkSoftcapAndScale) {
  const uint64_t seed = magi::test::fresh_seed();
  std::mt19937_64 rng(seed);
  const std::string context = "seed " + std::to_string(seed);
  TempDir dir;
  const Problem p = random_problem(rng, SinkLayout::SSH);
  auto args = write_inputs(dir, p, DType::F64, SinkLayout::SSH, true);
  args.insert(args.end(), {"--softcap", "5", "--softmax-scale", "0.3", "--backend", "cpu", "--threads", "2"});
  const CliResult r = run_cli(args);
  ASSERT_EQ(r.exit_code, 0) << describe(r);

  const auto problem = reference_problem(p, DType::F64, SinkLayout::SSH, 0.3, 5.0);
  const auto ref = magi::test::reference_forward(problem);
  const auto grads = magi::test::reference_backward(problem, p.dout);
  // Outputs are float32 files: the only error left is that rounding.
  EXPECT_LE(rel_l2(read_output(dir, "out.npy", {kTq, kHq, kD}), ref.out), 1e-6) << context;
  expect_lse_close(read_output(dir, "lse.npy", {kTq, kHq}), ref.lse, 1e-5, context);
  EXPECT_LE(rel_l2(read_output(dir, "dq.npy", {kTq, kHq, kD}), grads.dq), 1e-6) << context;
  EXPECT_LE(rel_l2(read_output(dir, "dk.npy", {kTk, kHkv, kD}), grads.dk), 1e-6) << context;
  EXPECT_LE(rel_l2(read_output(dir, "dv.npy", {kTk, kHkv, kD}), grads.dv), 1e-6) << context;
  EXPECT_LE(rel_l2(read_output(dir, "dsink.npy", {kTq, kSink, kHq}), grads.dsink), 1e-6) << context;
}

TEST(CliRun, Bf16WithShSinkMatchesReferenceOnRoundedInputs) {
  const uint64_t seed = magi::test::fresh_seed();
  std::mt19937_64 rng(seed);
  const std::string context = "seed " + std::to_string(seed);
  TempDir dir;
  const Problem p = random_problem(rng, SinkLayout::SH);
  auto args = write_inputs(dir, p, DType::F32, SinkLayout::SH, true);
  args.insert(args.end(), {"--dtype", "bf16"});
  const CliResult r = run_cli(args);
  ASSERT_EQ(r.exit_code, 0) << describe(r);

  const auto problem = reference_problem(p, DType::BF16, SinkLayout::SH, 0.0, 0.0);
  const auto ref = magi::test::reference_forward(problem);
  const auto grads = magi::test::reference_backward(problem, magi::test::rounded(p.dout, DType::BF16));
  // SPEC section 5 bf16 bounds.
  EXPECT_LE(rel_l2(read_output(dir, "out.npy", {kTq, kHq, kD}), ref.out), 1e-2) << context;
  expect_lse_close(read_output(dir, "lse.npy", {kTq, kHq}), ref.lse, 1e-3, context);
  EXPECT_LE(rel_l2(read_output(dir, "dq.npy", {kTq, kHq, kD}), grads.dq), 2e-2) << context;
  EXPECT_LE(rel_l2(read_output(dir, "dk.npy", {kTk, kHkv, kD}), grads.dk), 2e-2) << context;
  EXPECT_LE(rel_l2(read_output(dir, "dv.npy", {kTk, kHkv, kD}), grads.dv), 2e-2) << context;
  EXPECT_LE(rel_l2(read_output(dir, "dsink.npy", {kSink, kHq}), grads.dsink), 2e-2) << context;
}

TEST(CliRun, Fp32RunEqualsInProcessCallBitForBit) {
  // The program is a thin layer over magi::forward: same inputs, same backend, same bits.
  const uint64_t seed = magi::test::fresh_seed();
  std::mt19937_64 rng(seed);
  TempDir dir;
  const Problem p = random_problem(rng, SinkLayout::None);
  auto args = write_inputs(dir, p, DType::F32, SinkLayout::None, false);
  args.insert(args.end(), {"--backend", "cpu"});
  const CliResult r = run_cli(args);
  ASSERT_EQ(r.exit_code, 0) << describe(r);

  auto q = magi::test::HostTensor::from_values(p.q, DType::F32, {kTq, kHq, kD});
  auto k = magi::test::HostTensor::from_values(p.k, DType::F32, {kTk, kHkv, kD});
  auto v = magi::test::HostTensor::from_values(p.v, DType::F32, {kTk, kHkv, kD});
  auto out = magi::test::HostTensor::poisoned(DType::F32, {kTq, kHq, kD});
  auto lse = magi::test::HostTensor::poisoned(DType::F32, {kTq, kHq});
  ForwardArgs fwd;
  fwd.q = q.view();
  fwd.k = k.view();
  fwd.v = v.view();
  fwd.out = out.view();
  fwd.lse = lse.view();
  AttentionOptions options;
  options.backend = Backend::Cpu;
  forward(expected_mask(), fwd, options);
  EXPECT_EQ(read_output(dir, "out.npy", {kTq, kHq, kD}), out.values()) << "seed " << seed;
  EXPECT_EQ(read_output(dir, "lse.npy", {kTq, kHq}), lse.values()) << "seed " << seed;
}

TEST(CliRun, CreatesNestedOutDirAndReplacesOldOutputs) {
  const uint64_t seed = magi::test::fresh_seed();
  std::mt19937_64 rng(seed);
  TempDir dir;
  const Problem p = random_problem(rng, SinkLayout::None);
  auto args = write_inputs(dir, p, DType::F32, SinkLayout::None, false);
  const std::string nested = dir / "a/b/c";
  args.back() = nested;  // --out-dir is last
  fs::create_directories(nested);
  write_file(nested + "/out.npy", std::vector<unsigned char>{'o', 'l', 'd'});
  fs::remove_all(dir / "a");
  ASSERT_EQ(run_cli(args).exit_code, 0);
  const NpyArray out = read_npy(nested + "/out.npy");
  EXPECT_EQ(out.shape, (std::vector<int64_t>{kTq, kHq, kD}));
  // Again into the existing folder: files are replaced, no temporaries are left behind.
  ASSERT_EQ(run_cli(args).exit_code, 0);
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(nested)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"lse.npy", "out.npy"}));
}

TEST(CliRun, MaskWithMatchingTotalsRuns) {
  const uint64_t seed = magi::test::fresh_seed();
  std::mt19937_64 rng(seed);
  TempDir dir;
  const Problem p = random_problem(rng, SinkLayout::None);
  auto args = write_inputs(dir, p, DType::F32, SinkLayout::None, false);
  const std::string with_totals = R"({"q_ranges": [[0, 48]], "k_ranges": [[0, 64]], "attn_type_map": [0],
                                      "total_q": 48, "total_k": 64})";
  write_file(dir / "mask.json", std::vector<unsigned char>(with_totals.begin(), with_totals.end()));
  const CliResult ok = run_cli(args);
  EXPECT_EQ(ok.exit_code, 0) << describe(ok);
  EXPECT_NE(ok.out.find("wrote out.npy lse.npy"), std::string::npos) << ok.out;
}

TEST(CliRun, SummaryShowsTheSlicesLeftByAutoRangeMerge) {
  const uint64_t seed = magi::test::fresh_seed();
  std::mt19937_64 rng(seed);
  TempDir dir;
  const Problem p = random_problem(rng, SinkLayout::None);
  auto args = write_inputs(dir, p, DType::F32, SinkLayout::None, false);
  // Four full quarters of the grid: one slice once merged.
  const std::string quarters = R"({"q_ranges": [[0, 24], [0, 24], [24, 48], [24, 48]],
                                   "k_ranges": [[0, 32], [32, 64], [0, 32], [32, 64]], "attn_type_map": [0, 0, 0, 0]})";
  write_file(dir / "mask.json", std::vector<unsigned char>(quarters.begin(), quarters.end()));
  const CliResult merged = run_cli(args, {"MAGI_ATTENTION_AUTO_RANGE_MERGE=1"});
  ASSERT_EQ(merged.exit_code, 0) << describe(merged);
  EXPECT_NE(merged.out.find("magi-attn run: 4 slices (1 after range merge), area 3072"), std::string::npos)
      << merged.out;
  const CliResult plain = run_cli(args);
  ASSERT_EQ(plain.exit_code, 0) << describe(plain);
  EXPECT_NE(plain.out.find("magi-attn run: 4 slices, area 3072"), std::string::npos) << plain.out;
}

}  // namespace
}  // namespace magi::cli::test
