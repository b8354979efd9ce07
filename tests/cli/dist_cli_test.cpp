// `magi-attn dist-run` and `dist-demo` end to end under mpirun with cp 1..4: outputs written by rank 0
// against the single-device API (magi::forward / magi::backward, Backend::Reference, fp64 on the rounded
// inputs) by SPEC section 5; bad input stops every rank with exit 2, one line from rank 0 and nothing
// written. Each rank's streams and exit code are captured separately (a wrapper script per rank), so
// mpirun's own messages do not get in the way.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "cli/npy.hpp"
#include "cli_test_helpers.hpp"
#include "magi/attention.hpp"
#include "reference/compare.hpp"
#include "reference/naive_attention.hpp"
#include "reference/random_inputs.hpp"

#ifndef MAGI_MPIEXEC
#error "MAGI_MPIEXEC (the mpirun program) must be defined by the build"
#endif

namespace magi::cli::test {
namespace {

using magi::test::Quantity;

// Runs `magi-attn <args>` on `cp` ranks; result [r] is rank r's exit code and streams.
std::vector<CliResult> run_ranks(int cp, const std::vector<std::string>& args) {
  TempDir capture;
  const std::string wrapper = capture / "rank.sh";
  const std::string script =
      "#!/bin/sh\n"
      "r=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}\n"
      "d=\"$1\"; shift\n"
      "\"$@\" >\"$d/out.$r\" 2>\"$d/err.$r\" </dev/null\n"
      "echo $? >\"$d/exit.$r\"\n";
  write_file(wrapper, std::vector<unsigned char>(script.begin(), script.end()));
  std::string command = shell_quote(MAGI_MPIEXEC) + " -np " + std::to_string(cp) +
                        " --allow-run-as-root --oversubscribe -x OMP_NUM_THREADS=1 sh " + shell_quote(wrapper) + " " +
                        shell_quote(capture.path().string()) + " " + shell_quote(MAGI_CLI_PATH);
  for (const std::string& arg : args) command += " " + shell_quote(arg);
  command += " >" + shell_quote(capture / "mpirun.out") + " 2>&1";
  const int status = std::system(command.c_str());
  std::vector<CliResult> ranks(static_cast<size_t>(cp));
  for (int r = 0; r < cp; ++r) {
    const std::string suffix = "." + std::to_string(r);
    const std::string code = slurp(capture.path() / ("exit" + suffix));
    ranks[r].exit_code = code.empty() ? -1 : std::atoi(code.c_str());
    ranks[r].out = slurp(capture.path() / ("out" + suffix));
    ranks[r].err = slurp(capture.path() / ("err" + suffix));
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "mpirun failed:\n" << slurp(capture / "mpirun.out");
  return ranks;
}

std::string describe_ranks(const std::vector<CliResult>& ranks) {
  std::string text;
  for (size_t r = 0; r < ranks.size(); ++r) text += "=== rank " + std::to_string(r) + ": " + describe(ranks[r]);
  return text;
}

// Mixed types, shared q rows, uncovered rows 46..47, Tq < Tk (as in cli_run_test).
constexpr const char* kMaskJson = R"({"q_ranges": [[0, 16], [16, 40], [16, 40], [40, 46]],
  "k_ranges": [[0, 32], [0, 40], [48, 64], [50, 60]],
  "attn_type_map": ["full", "causal", 2, "bi_causal"]})";
constexpr int64_t kTq = 48, kTk = 64, kHq = 4, kHkv = 2, kD = 16, kSink = 2;

Mask expected_mask() {
  Mask mask;
  mask.slices = {magi::test::make_slice(0, 16, 0, 32, MaskType::Full),
                 magi::test::make_slice(16, 40, 0, 40, MaskType::Causal),
                 magi::test::make_slice(16, 40, 48, 64, MaskType::InvCausal),
                 magi::test::make_slice(40, 46, 50, 60, MaskType::BiCausal)};
  mask.total_q = kTq;
  mask.total_k = kTk;
  return mask;
}

struct Case {
  std::string name;
  int cp = 1;
  DType file_dtype = DType::F32;
  DType dtype = DType::F32;  // compute dtype (--dtype)
  SinkLayout sink = SinkLayout::None;
  bool backward = true;
  std::vector<std::string> extra;  // more options
  double softmax_scale = 0.0, softcap = 0.0;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class DistRun : public ::testing::TestWithParam<Case> {};

TEST_P(DistRun, MatchesSingleDeviceReference) {
  const Case& c = GetParam();
  const uint64_t seed = magi::test::fresh_seed();
  std::mt19937_64 rng(seed);
  const std::string context = c.name + ", seed " + std::to_string(seed);
  TempDir dir;
  const auto q = normal_values(rng, kTq * kHq * kD), k = normal_values(rng, kTk * kHkv * kD),
             v = normal_values(rng, kTk * kHkv * kD), dout = normal_values(rng, kTq * kHq * kD);
  const std::vector<int64_t> sink_shape =
      c.sink == SinkLayout::SH ? std::vector<int64_t>{kSink, kHq} : std::vector<int64_t>{kTq, kSink, kHq};
  int64_t sink_numel = 1;
  for (int64_t extent : sink_shape) sink_numel *= extent;
  const auto sink = c.sink == SinkLayout::None ? std::vector<double>{} : normal_values(rng, sink_numel);
  write_file(dir / "mask.json", std::vector<unsigned char>(kMaskJson, kMaskJson + std::strlen(kMaskJson)));
  write_npy_file(dir / "q.npy", c.file_dtype, {kTq, kHq, kD}, q);
  write_npy_file(dir / "k.npy", c.file_dtype, {kTk, kHkv, kD}, k);
  write_npy_file(dir / "v.npy", c.file_dtype, {kTk, kHkv, kD}, v);
  std::vector<std::string> args = {"dist-run", "--mask", dir / "mask.json", "--q", dir / "q.npy", "--k", dir / "k.npy",
                                   "--v", dir / "v.npy", "--out-dir", dir / "out", "--dtype",
                                   std::string(to_string(c.dtype))};
  if (std::find(c.extra.begin(), c.extra.end(), "--chunk-size") == c.extra.end())
    args.insert(args.end(), {"--chunk-size", "8"});
  if (c.backward) {
    write_npy_file(dir / "do.npy", c.file_dtype, {kTq, kHq, kD}, dout);
    args.insert(args.end(), {"--do", dir / "do.npy"});
  }
  if (c.sink != SinkLayout::None) {
    write_npy_file(dir / "sink.npy", c.file_dtype, sink_shape, sink);
    args.insert(args.end(), {"--sink", dir / "sink.npy", "--sink-layout", std::string(to_string(c.sink))});
  }
  args.insert(args.end(), c.extra.begin(), c.extra.end());
  const auto ranks = run_ranks(c.cp, args);
  for (const CliResult& r : ranks) ASSERT_EQ(r.exit_code, 0) << describe_ranks(ranks);
  EXPECT_NE(ranks[0].out.find("magi-attn dist-run: cp " + std::to_string(c.cp)), std::string::npos) << ranks[0].out;
  EXPECT_NE(ranks[0].out.find("vs lower bound"), std::string::npos) << ranks[0].out;
  EXPECT_NE(ranks[0].out.find("vs ring attention"), std::string::npos) << ranks[0].out;
  for (size_t r = 1; r < ranks.size(); ++r)
    EXPECT_TRUE(ranks[r].out.empty() && ranks[r].err.empty()) << describe_ranks(ranks);

  // The single-device API on the same rounded inputs, in fp64 with the exact engine.
  using magi::test::HostTensor;
  const auto rounded = [&](const std::vector<double>& x) { return magi::test::rounded(x, c.dtype); };
  HostTensor q_t = HostTensor::from_values(rounded(q), DType::F64, {kTq, kHq, kD});
  HostTensor k_t = HostTensor::from_values(rounded(k), DType::F64, {kTk, kHkv, kD});
  HostTensor v_t = HostTensor::from_values(rounded(v), DType::F64, {kTk, kHkv, kD});
  HostTensor do_t = HostTensor::from_values(rounded(dout), DType::F64, {kTq, kHq, kD});
  HostTensor sink_t;
  if (c.sink != SinkLayout::None)
    sink_t = HostTensor::from_values(magi::test::rounded(sink, DType::F32), DType::F32, sink_shape);
  HostTensor out = HostTensor::poisoned(DType::F64, {kTq, kHq, kD}), lse = HostTensor::poisoned(DType::F64, {kTq, kHq});
  AttentionOptions options;
  options.backend = Backend::Reference;
  options.sink_layout = c.sink;
  if (c.softmax_scale > 0) options.softmax_scale = c.softmax_scale;
  options.softcap = c.softcap;
  forward(expected_mask(), {q_t.view(), k_t.view(), v_t.view(), sink_t.view(), out.view(), lse.view(), {}}, options);

  // Outputs are fp32 files: fp64 runs are judged at the fp32 bounds.
  const DType judged = c.dtype == DType::F64 ? DType::F32 : c.dtype;
  const auto file = [&](const std::string& name, const std::vector<int64_t>& shape) {
    const fs::path path = dir.path() / "out" / name;
    if (!fs::exists(path)) {
      ADD_FAILURE() << name << " missing; " << context;
      return std::vector<double>{};
    }
    const NpyArray a = read_npy(path.string());
    EXPECT_EQ(a.dtype, DType::F32) << name;
    EXPECT_EQ(a.shape, shape) << name;
    return a.values;
  };
  EXPECT_TRUE(
      magi::test::check_close("out", file("out.npy", {kTq, kHq, kD}), out.values(), Quantity::Out, judged, context));
  EXPECT_TRUE(
      magi::test::check_close("lse", file("lse.npy", {kTq, kHq}), lse.values(), Quantity::Lse, judged, context));
  if (!c.backward) {
    EXPECT_EQ(std::distance(fs::directory_iterator(dir.path() / "out"), fs::directory_iterator()), 2) << context;
    return;
  }
  HostTensor dq = HostTensor::poisoned(DType::F64, {kTq, kHq, kD}),
             dk = HostTensor::poisoned(DType::F64, {kTk, kHkv, kD}),
             dv = HostTensor::poisoned(DType::F64, {kTk, kHkv, kD}), dsink;
  if (c.sink != SinkLayout::None) dsink = HostTensor::poisoned(DType::F32, sink_shape);
  backward(expected_mask(),
           {q_t.view(), k_t.view(), v_t.view(), out.view(), lse.view(), do_t.view(), sink_t.view(), dq.view(),
            dk.view(), dv.view(), dsink.view()},
           options);
  EXPECT_TRUE(
      magi::test::check_close("dq", file("dq.npy", {kTq, kHq, kD}), dq.values(), Quantity::Grad, judged, context));
  EXPECT_TRUE(
      magi::test::check_close("dk", file("dk.npy", {kTk, kHkv, kD}), dk.values(), Quantity::Grad, judged, context));
  EXPECT_TRUE(
      magi::test::check_close("dv", file("dv.npy", {kTk, kHkv, kD}), dv.values(), Quantity::Grad, judged, context));
  if (c.sink == SinkLayout::None) return;
  // dsink sums signed terms: judged against their magnitude (the naive reference gives it).
  magi::test::ReferenceProblem problem;
  problem.mask = expected_mask();
  problem.heads_q = kHq;
  problem.heads_kv = kHkv;
  problem.head_dim = kD;
  problem.softmax_scale = c.softmax_scale;
  problem.softcap = c.softcap;
  problem.sink_layout = c.sink;
  problem.sink_len = kSink;
  problem.q = rounded(q);
  problem.k = rounded(k);
  problem.v = rounded(v);
  problem.sink = magi::test::rounded(sink, DType::F32);
  const auto grads = magi::test::reference_backward(problem, rounded(dout));
  EXPECT_TRUE(
      magi::test::check_dsink(file("dsink.npy", sink_shape), dsink.values(), grads.dsink_magnitude, judged, context));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DistRun,
    ::testing::Values(
        Case{"cp1_fp32_sh_sink", 1, DType::F32, DType::F32, SinkLayout::SH, true, {}},
        Case{"cp2_fp64_ssh_sink_softcap_scale_overlap2", 2, DType::F64, DType::F64, SinkLayout::SSH, true,
             {"--softcap", "5", "--softmax-scale", "0.3", "--overlap-degree", "2", "--backend", "reference"}, 0.3, 5.0},
        Case{"cp3_bf16_chunk7_no_overlap", 3, DType::F32, DType::BF16, SinkLayout::None, true,
             {"--chunk-size", "7", "--overlap-degree", "0"}},
        Case{"cp3_fp32_forward_only", 3, DType::F32, DType::F32, SinkLayout::None, false, {}},
        Case{"cp4_fp32_sh_sink_hierarchical_greedy", 4, DType::F64, DType::F32, SinkLayout::SH, true,
             {"--hierarchical", "--ranks-per-node", "2", "--dispatch", "greedy"}},
        Case{"cp4_fp16_ssh_sink", 4, DType::F32, DType::F16, SinkLayout::SSH, true, {"--overlap-degree", "4"}}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// ---- bad input: exit 2 on every rank, one line from rank 0, nothing written ----

class DistRunErrors : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(magi::test::fresh_seed());
    write_text("mask.json", R"({"q_ranges": [[0, 32]], "k_ranges": [[0, 40]], "attn_type_map": ["causal"]})");
    write_npy_file(dir_ / "q.npy", DType::F32, {32, 4, 8}, normal_values(rng, 32 * 4 * 8));
    write_npy_file(dir_ / "k.npy", DType::F32, {40, 2, 8}, normal_values(rng, 40 * 2 * 8));
    write_npy_file(dir_ / "v.npy", DType::F32, {40, 2, 8}, normal_values(rng, 40 * 2 * 8));
  }
  void write_text(const std::string& name, const std::string& text) {
    write_file(dir_ / name, std::vector<unsigned char>(text.begin(), text.end()));
  }
  std::vector<std::string> valid_args() const {
    return {"dist-run", "--mask", dir_ / "mask.json", "--q", dir_ / "q.npy", "--k", dir_ / "k.npy",
            "--v", dir_ / "v.npy", "--out-dir", dir_ / "out", "--chunk-size", "4"};
  }
  void expect_error(const std::vector<std::string>& args, const std::vector<std::string>& fragments) {
    const auto ranks = run_ranks(GetParam(), args);
    expect_one_line_error(ranks[0], fragments);
    for (size_t r = 0; r < ranks.size(); ++r) {
      EXPECT_EQ(ranks[r].exit_code, 2) << "rank " << r << "\n" << describe_ranks(ranks);
      EXPECT_TRUE(ranks[r].out.empty()) << "rank " << r << "\n" << describe_ranks(ranks);
      if (r > 0) EXPECT_TRUE(ranks[r].err.empty()) << "rank " << r << "\n" << describe_ranks(ranks);
    }
    EXPECT_FALSE(fs::exists(dir_ / "out")) << "an output folder was created despite the error";
  }
  TempDir dir_;
};

TEST_P(DistRunErrors, ValidInputsRun) {
  const auto ranks = run_ranks(GetParam(), valid_args());
  for (const CliResult& r : ranks) EXPECT_EQ(r.exit_code, 0) << describe_ranks(ranks);
  EXPECT_TRUE(fs::exists(dir_ / "out/out.npy"));
}

TEST_P(DistRunErrors, SummaryShowsTheSlicesLeftByAutoRangeMerge) {
  // Two causal row bands on one diagonal: one slice merged. The ranks inherit the variable through mpirun.
  write_text("mask.json", R"({"q_ranges": [[0, 12], [12, 32]], "k_ranges": [[0, 20], [0, 40]],
                             "attn_type_map": ["causal", "causal"]})");
  setenv("MAGI_ATTENTION_AUTO_RANGE_MERGE", "1", 1);
  const auto ranks = run_ranks(GetParam(), valid_args());
  unsetenv("MAGI_ATTENTION_AUTO_RANGE_MERGE");
  for (const CliResult& r : ranks) ASSERT_EQ(r.exit_code, 0) << describe_ranks(ranks);
  EXPECT_NE(ranks[0].out.find(", 2 slices (1 after range merge), area "), std::string::npos) << ranks[0].out;
}

TEST_P(DistRunErrors, RanksPerNodeNeedsHierarchicalCommFromTheFlagOrTheEnvironment) {
  auto args = valid_args();
  args.insert(args.end(), {"--ranks-per-node", std::to_string(GetParam())});  // one node
  setenv("MAGI_ATTENTION_HIERARCHICAL_COMM", "1", 1);
  const auto ranks = run_ranks(GetParam(), args);
  unsetenv("MAGI_ATTENTION_HIERARCHICAL_COMM");
  for (const CliResult& r : ranks) ASSERT_EQ(r.exit_code, 0) << describe_ranks(ranks);
  fs::remove_all(dir_ / "out");
  expect_error(args, {"--ranks-per-node needs --hierarchical", "MAGI_ATTENTION_HIERARCHICAL_COMM=1"});
}

TEST_P(DistRunErrors, MissingInputFile) {
  auto args = valid_args();
  args[6] = dir_ / "nowhere.npy";  // --k
  expect_error(args, {"--k", "nowhere.npy"});
}

TEST_P(DistRunErrors, MaskDoesNotFitTensors) {
  write_text("mask.json", R"({"q_ranges": [[0, 32]], "k_ranges": [[0, 40]], "attn_type_map": [0],
                               "total_q": 40, "total_k": 40})");
  expect_error(valid_args(), {"--mask", "total_q"});
}

TEST_P(DistRunErrors, KeyShapeDoesNotMatchValue) {
  std::mt19937_64 rng(1);
  write_npy_file(dir_ / "v.npy", DType::F32, {40, 2, 16}, normal_values(rng, 40 * 2 * 16));
  expect_error(valid_args(), {"--v", "like k"});
}

TEST_P(DistRunErrors, UnknownOption) {
  auto args = valid_args();
  args.insert(args.end(), {"--overlap", "2"});
  expect_error(args, {"unknown option '--overlap'", "--overlap-degree"});
}

TEST_P(DistRunErrors, BadDistOption) {
  auto args = valid_args();
  args.insert(args.end(), {"--dispatch", "ring"});
  expect_error(args, {"--dispatch", "greedy_swap"});
}

TEST_P(DistRunErrors, CudaBackendIsRefusedOnEveryRank) {
  auto args = valid_args();
  args.insert(args.end(), {"--backend", "cuda"});
  expect_error(args, {"cuda"});
}

// Before, only rank 0's first attention call refused it, in the middle of a collective (MPI abort).
TEST_P(DistRunErrors, ThreadsAboveTheLibraryLimitStopEveryRank) {
  auto args = valid_args();
  args.insert(args.end(), {"--threads", std::to_string(kMaxThreads + 1)});
  expect_error(args, {"--threads", "1 .. " + std::to_string(kMaxThreads)});
}

TEST_P(DistRunErrors, ChunkSizeAboveTheLibraryLimitNamesTheOption) {
  auto args = valid_args();
  args.back() = "20000";  // --chunk-size
  expect_error(args, {"--chunk-size", "20000", "1 .. 16384"});
}

INSTANTIATE_TEST_SUITE_P(Cp, DistRunErrors, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return "cp" + std::to_string(info.param); });

// ---- dist-demo ----

class DistDemo : public ::testing::TestWithParam<int> {};

TEST_P(DistDemo, SmallRunPasses) {
  const std::string seed = std::to_string(magi::test::fresh_seed() & 0xffffffff);
  const int cp = GetParam();
  // The CPU ranks (MPI engine) whatever the machine: on GPUs the default would be one rank per GPU.
  std::vector<std::string> args = {"dist-demo", "--device", "cpu", "--tokens", "700", "--heads-q", "4", "--heads-kv",
                                   "2", "--head-dim", "32", "--chunk-size", "32", "--block", "64", "--runs", "1",
                                   "--seed", seed};
  if (cp == 3) args.insert(args.end(), {"--dtype", "bf16", "--overlap-degree", "2"});
  const auto ranks = run_ranks(cp, args);
  for (const CliResult& r : ranks) ASSERT_EQ(r.exit_code, 0) << "seed " << seed << "\n" << describe_ranks(ranks);
  EXPECT_NE(ranks[0].out.find("result    PASS"), std::string::npos) << ranks[0].out;
  EXPECT_NE(ranks[0].out.find("over " + std::to_string(cp) + " ranks"), std::string::npos) << ranks[0].out;
  EXPECT_NE(ranks[0].out.find("per rank"), std::string::npos) << ranks[0].out;
  for (size_t r = 1; r < ranks.size(); ++r) EXPECT_TRUE(ranks[r].out.empty()) << describe_ranks(ranks);
}

TEST_P(DistDemo, BadOptionStopsEveryRank) {
  const auto ranks = run_ranks(GetParam(), {"dist-demo", "--tokens", "0"});
  expect_one_line_error(ranks[0], {"--tokens"});
  for (size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_EQ(ranks[r].exit_code, 2) << describe_ranks(ranks);
    if (r > 0) EXPECT_TRUE(ranks[r].err.empty() && ranks[r].out.empty()) << describe_ranks(ranks);
  }
}

// Whether this magi-attn can put its ranks on GPUs here (then --device cuda is no error).
bool gpu_ranks_here() {
#if MAGI_ATTN_WITH_NCCL
  std::error_code error;
  return fs::directory_iterator("/proc/driver/nvidia/gpus", error) != fs::directory_iterator();
#else
  return false;
#endif
}

TEST_P(DistDemo, UnavailableDeviceCudaStopsEveryRank) {
  if (gpu_ranks_here()) GTEST_SKIP() << "this build has the NCCL engine and the machine has GPUs";
  const auto ranks = run_ranks(GetParam(), {"dist-demo", "--device", "cuda", "--tokens", "256"});
  expect_one_line_error(ranks[0], {"--device cuda", "allowed", "cpu"});
  for (size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_EQ(ranks[r].exit_code, 2) << describe_ranks(ranks);
    EXPECT_TRUE(ranks[r].out.empty()) << describe_ranks(ranks);
    if (r > 0) EXPECT_TRUE(ranks[r].err.empty()) << describe_ranks(ranks);
  }
}

TEST_P(DistDemo, UnknownDeviceNamesTheAllowedOnes) {
  const auto ranks = run_ranks(GetParam(), {"dist-demo", "--device", "gpu"});
  expect_one_line_error(ranks[0], {"--device", "'gpu'", "cpu, cuda"});
  for (size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_EQ(ranks[r].exit_code, 2) << describe_ranks(ranks);
    if (r > 0) EXPECT_TRUE(ranks[r].err.empty() && ranks[r].out.empty()) << describe_ranks(ranks);
  }
}

INSTANTIATE_TEST_SUITE_P(Cp, DistDemo, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return "cp" + std::to_string(info.param); });

// Without mpirun: the choice is made before any rank (or MPI) starts.
TEST(DistDemoAlone, UnavailableDeviceCudaIsOneLineError) {
  if (gpu_ranks_here()) GTEST_SKIP() << "this build has the NCCL engine and the machine has GPUs";
  const CliResult r = run_cli({"dist-demo", "--device", "cuda"});
  expect_one_line_error(r, {"--device cuda", "allowed", "cpu"});
  EXPECT_TRUE(r.out.empty()) << describe(r);
}

TEST(DistDemoAlone, HelpSaysWhetherGpuRanksAreBuilt) {
  const CliResult r = run_cli({"dist-demo", "--help"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("--device"), std::string::npos) << r.out;
#if MAGI_ATTN_WITH_NCCL
  EXPECT_NE(r.out.find("--device cuda available"), std::string::npos) << r.out;
#else
  EXPECT_NE(r.out.find("--device cpu only"), std::string::npos) << r.out;
#endif
}

}  // namespace
}  // namespace magi::cli::test
