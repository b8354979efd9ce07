// The CLI's GPU path: `magi-attn run --backend cuda|reference|auto` and `magi-attn demo` on the GPU, judged
// against in-process calls on device tensors and the naive fp64 reference; and the one-line refusal of
// --backend cuda when no GPU is visible (CUDA_VISIBLE_DEVICES=-1).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cli/cli_test_helpers.hpp"
#include "cli/npy.hpp"
#include "cuda/cuda_test_support.hpp"
#include "reference/naive_attention.hpp"
#include "reference/random_inputs.hpp"

namespace magi::cli::test {
namespace {

using magi::test::DeviceTensor;
using TestTensor = magi::test::HostTensor;

constexpr int32_t kTq = 300, kTk = 400, kHq = 4, kHkv = 2, kD = 64, kSink = 2;

// q-overlap (a causal and an inv-causal slice share rows), bi-causal with Sq > Sk (empty rows) and rows
// 290..299 that no slice covers.
Mask test_mask() {
  Mask mask;
  mask.slices = {magi::test::make_slice(0, 100, 0, 150, MaskType::Full),
                 magi::test::make_slice(100, 200, 0, 200, MaskType::Causal),
                 magi::test::make_slice(100, 200, 250, 400, MaskType::InvCausal),
                 magi::test::make_slice(200, 290, 200, 250, MaskType::BiCausal)};
  mask.total_q = kTq;
  mask.total_k = kTk;
  return mask;
}

struct Problem {
  std::vector<double> q, k, v, dout, sink;  // as written to the files
};

struct Files {
  std::vector<std::string> args;  // `run` and every input option
};

Files write_inputs(const TempDir& dir, const Problem& p, DType file_dtype) {
  const std::string json = mask_to_json(test_mask());
  write_file(dir / "mask.json", std::vector<unsigned char>(json.begin(), json.end()));
  write_npy_file(dir / "q.npy", file_dtype, {kTq, kHq, kD}, p.q);
  write_npy_file(dir / "k.npy", file_dtype, {kTk, kHkv, kD}, p.k);
  write_npy_file(dir / "v.npy", file_dtype, {kTk, kHkv, kD}, p.v);
  write_npy_file(dir / "do.npy", file_dtype, {kTq, kHq, kD}, p.dout);
  write_npy_file(dir / "sink.npy", DType::F32, {kTq, kSink, kHq}, p.sink);
  return {{"run", "--mask", dir / "mask.json", "--q", dir / "q.npy", "--k", dir / "k.npy", "--v", dir / "v.npy", "--do",
           dir / "do.npy", "--sink", dir / "sink.npy", "--sink-layout", "ssh"}};
}

Problem random_problem(std::mt19937_64& rng) {
  Problem p;
  p.q = normal_values(rng, size_t{kTq} * kHq * kD);
  p.k = normal_values(rng, size_t{kTk} * kHkv * kD);
  p.v = normal_values(rng, size_t{kTk} * kHkv * kD);
  p.dout = normal_values(rng, size_t{kTq} * kHq * kD);
  p.sink = normal_values(rng, size_t{kTq} * kSink * kHq);
  for (double& s : p.sink) s = round_to(DType::F32, s + 2.0);
  return p;
}

std::vector<double> rounded(const std::vector<double>& values, DType dtype) { return magi::test::rounded(values, dtype); }

const char* const kOutputs[] = {"out", "lse", "dq", "dk", "dv", "dsink"};

// In-process forward + backward on device tensors (GPU 0): inputs rounded like the CLI rounds them, every
// output buffer fp32 (fp64 for fp64 inputs) like the CLI's; returns the outputs widened to double.
std::vector<std::vector<double>> in_process(const Problem& p, DType dtype, Backend backend) {
  const DType wide = dtype == DType::F64 ? DType::F64 : DType::F32;
  DeviceTensor q(TestTensor::from_values(rounded(p.q, dtype), dtype, {kTq, kHq, kD}));
  DeviceTensor k(TestTensor::from_values(rounded(p.k, dtype), dtype, {kTk, kHkv, kD}));
  DeviceTensor v(TestTensor::from_values(rounded(p.v, dtype), dtype, {kTk, kHkv, kD}));
  DeviceTensor dout(TestTensor::from_values(rounded(p.dout, dtype), wide, {kTq, kHq, kD}));
  DeviceTensor sink(TestTensor::from_values(p.sink, DType::F32, {kTq, kSink, kHq}));
  DeviceTensor out(TestTensor::poisoned(wide, {kTq, kHq, kD})), lse(TestTensor::poisoned(wide, {kTq, kHq}));
  DeviceTensor dq(TestTensor::poisoned(wide, {kTq, kHq, kD})), dk(TestTensor::poisoned(wide, {kTk, kHkv, kD})),
      dv(TestTensor::poisoned(wide, {kTk, kHkv, kD})), dsink(TestTensor::poisoned(DType::F32, {kTq, kSink, kHq}));
  AttentionOptions options;
  options.backend = backend;
  options.sink_layout = SinkLayout::SSH;
  ForwardArgs f;
  f.q = q.view();
  f.k = k.view();
  f.v = v.view();
  f.sink = sink.view();
  f.out = out.view();
  f.lse = lse.view();
  magi::forward(test_mask(), f, options, nullptr);
  BackwardArgs b;
  b.q = q.view();
  b.k = k.view();
  b.v = v.view();
  b.out = out.view();
  b.lse = lse.view();
  b.dout = dout.view();
  b.sink = sink.view();
  b.dq = dq.view();
  b.dk = dk.view();
  b.dv = dv.view();
  b.dsink = dsink.view();
  magi::backward(test_mask(), b, options, nullptr);
  MAGI_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<std::vector<double>> r;
  for (const DeviceTensor* t : {&out, &lse, &dq, &dk, &dv, &dsink}) {
    std::vector<double> values = t->download().values();
    for (double& x : values) x = round_to(DType::F32, x);  // the files are fp32
    r.push_back(std::move(values));
  }
  return r;
}

std::vector<std::vector<double>> read_outputs(const TempDir& dir) {
  std::vector<std::vector<double>> r;
  for (const char* name : kOutputs) r.push_back(read_npy(dir / (std::string("out/") + name + ".npy")).values);
  return r;
}

// Equal up to `bound` in rel L2 (lse: max abs over finite values, -inf exactly where the reference has it).
void expect_close(const std::vector<std::vector<double>>& got, const std::vector<std::vector<double>>& want,
                  double bound, const std::string& context) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size()) << kOutputs[i] << " " << context;
    if (std::string(kOutputs[i]) == "lse") {
      double worst = 0.0;
      for (size_t j = 0; j < got[i].size(); ++j) {
        if (std::isinf(want[i][j])) {
          EXPECT_EQ(got[i][j], want[i][j]) << "lse[" << j << "] " << context;
        } else {
          ASSERT_TRUE(std::isfinite(got[i][j])) << "lse[" << j << "] = " << got[i][j] << " " << context;
          worst = std::max(worst, std::fabs(got[i][j] - want[i][j]));
        }
      }
      EXPECT_LE(worst, bound) << "lse max abs error " << context;
    } else {
      for (double x : got[i]) ASSERT_FALSE(std::isnan(x)) << kOutputs[i] << " has NaN " << context;
      EXPECT_LE(rel_l2(got[i], want[i]), bound) << kOutputs[i] << " rel L2 " << context;
    }
  }
}

std::string context_of(uint64_t seed, const CliResult& r) { return "seed " + std::to_string(seed) + "\n" + describe(r); }

TEST(CliOnGpu, RunCudaMatchesInProcessCall) {
  const uint64_t seed = magi::test::fresh_seed();
  std::mt19937_64 rng(seed);
  const Problem p = random_problem(rng);
  TempDir dir;
  Files files = write_inputs(dir, p, DType::F32);
  files.args.insert(files.args.end(), {"--dtype", "bf16", "--backend", "cuda", "--out-dir", dir / "out"});
  const CliResult r = run_cli(files.args);
  ASSERT_EQ(r.exit_code, 0) << context_of(seed, r);
  EXPECT_NE(r.out.find("bf16 on cuda (GPU: "), std::string::npos) << r.out;
  // The kernels are deterministic: the same call in process gives the same numbers.
  expect_close(read_outputs(dir), in_process(p, DType::BF16, Backend::Cuda), 1e-6, context_of(seed, r));
}

TEST(CliOnGpu, AutoPicksTheGpuKernelsFor16BitInputs) {
  const uint64_t seed = magi::test::fresh_seed();
  std::mt19937_64 rng(seed);
  const Problem p = random_problem(rng);
  TempDir dir;
  Files files = write_inputs(dir, p, DType::F32);
  files.args.insert(files.args.end(), {"--dtype", "fp16", "--out-dir", dir / "out"});
  const CliResult r = run_cli(files.args);
  ASSERT_EQ(r.exit_code, 0) << context_of(seed, r);
  EXPECT_NE(r.out.find("fp16 on cuda (GPU: "), std::string::npos) << r.out;
  expect_close(read_outputs(dir), in_process(p, DType::F16, Backend::Cuda), 1e-6, context_of(seed, r));
}

// fp64 files on the exact GPU engine against the naive CPU fp64 reference; the files are fp32, so the
// bound is fp32 rounding.
TEST(CliOnGpu, RunReferenceFp64MatchesNaiveReference) {
  const uint64_t seed = magi::test::fresh_seed();
  std::mt19937_64 rng(seed);
  const Problem p = random_problem(rng);
  TempDir dir;
  Files files = write_inputs(dir, p, DType::F64);
  files.args.insert(files.args.end(), {"--backend", "reference", "--out-dir", dir / "out"});
  const CliResult r = run_cli(files.args);
  ASSERT_EQ(r.exit_code, 0) << context_of(seed, r);
  EXPECT_NE(r.out.find("fp64 on reference (GPU: "), std::string::npos) << r.out;
  magi::test::ReferenceProblem problem;
  problem.mask = test_mask();
  problem.heads_q = kHq;
  problem.heads_kv = kHkv;
  problem.head_dim = kD;
  problem.sink_layout = SinkLayout::SSH;
  problem.sink_len = kSink;
  problem.q = p.q;
  problem.k = p.k;
  problem.v = p.v;
  problem.sink = p.sink;
  const auto fwd = magi::test::reference_forward(problem);
  const auto grads = magi::test::reference_backward(problem, p.dout);
  expect_close(read_outputs(dir), {fwd.out, fwd.lse, grads.dq, grads.dk, grads.dv, grads.dsink}, 2e-6,
               context_of(seed, r));
}

// MAGI_ATTENTION_KERNEL_BACKEND=sdpa sends auto to the exact engine: the same files as --backend reference.
TEST(CliOnGpu, SdpaEnvRoutesAutoToTheReferenceEngine) {
  const uint64_t seed = magi::test::fresh_seed();
  std::mt19937_64 rng(seed);
  const Problem p = random_problem(rng);
  TempDir a, b;
  Files fa = write_inputs(a, p, DType::F32), fb = write_inputs(b, p, DType::F32);
  fa.args.insert(fa.args.end(), {"--dtype", "bf16", "--out-dir", a / "out"});
  fb.args.insert(fb.args.end(), {"--dtype", "bf16", "--backend", "reference", "--out-dir", b / "out"});
  const CliResult ra = run_cli(fa.args, {"MAGI_ATTENTION_KERNEL_BACKEND=sdpa"});
  const CliResult rb = run_cli(fb.args);
  ASSERT_EQ(ra.exit_code, 0) << context_of(seed, ra);
  ASSERT_EQ(rb.exit_code, 0) << context_of(seed, rb);
  EXPECT_NE(ra.out.find("bf16 on reference (GPU: "), std::string::npos) << ra.out;
  for (const char* name : kOutputs) {
    const std::string file = std::string("out/") + name + ".npy";
    EXPECT_EQ(slurp(a.path() / file), slurp(b.path() / file)) << name << " differs; seed " << seed;
  }
}

TEST(CliOnGpu, DemoRunsOnTheGpu) {
  const CliResult r = run_cli({"demo", "--tokens", "4096", "--heads-q", "4", "--heads-kv", "2", "--head-dim", "128"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("forward + backward on cuda (GPU: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("TFLOP/s"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("result    PASS"), std::string::npos) << r.out;
}

TEST(CliOnGpu, DemoReferenceRunsOnTheGpuEngine) {
  const CliResult r = run_cli({"demo", "--backend", "reference", "--tokens", "1024", "--head-dim", "64"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("forward + backward on reference (GPU: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("result    PASS"), std::string::npos) << r.out;
}

// With no visible GPU: --backend cuda is one clear error line (exit 2); auto falls back to the CPU.
TEST(CliOnGpu, NoVisibleGpu) {
  const std::vector<std::string> hidden = {"CUDA_VISIBLE_DEVICES=-1"};
  const uint64_t seed = magi::test::fresh_seed();
  std::mt19937_64 rng(seed);
  const Problem p = random_problem(rng);
  TempDir dir;
  Files files = write_inputs(dir, p, DType::F32);
  std::vector<std::string> cuda_args = files.args, auto_args = files.args;
  cuda_args.insert(cuda_args.end(), {"--backend", "cuda", "--out-dir", dir / "out_cuda"});
  expect_one_line_error(run_cli(cuda_args, hidden), {"--backend cuda", "no CUDA GPU"});
  EXPECT_FALSE(fs::exists(dir.path() / "out_cuda"));
  expect_one_line_error(run_cli({"demo", "--backend", "cuda", "--tokens", "256"}, hidden), {"--backend cuda", "no CUDA GPU"});
  auto_args.insert(auto_args.end(), {"--out-dir", dir / "out"});
  const CliResult r = run_cli(auto_args, hidden);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("fp32 on cpu;"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace magi::cli::test
