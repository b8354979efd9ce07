// Distributed attention on device tensors (NCCL engine), one process per GPU (forked, or under
// mpirun): bf16 out/lse/dq/dk/dv of dispatch -> calc_attn -> calc_attn_backward -> undispatch against
// the single-GPU kernel (magi::forward / magi::backward, backend cuda) and the fp64 CPU reference
// (SPEC section 5: the SPEC bounds, and a max error at most 2x the single-GPU one); both forward merges;
// the per-rank timelines of MAGI_ATTENTION_PROFILE_DIR.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <sstream>
#include <string>

#include "comm/nccl_communicator.hpp"
#include "comm/nccl_local_launch.hpp"
#include "cuda/backend.hpp"
#include "distributed/timeline.hpp"
#include "magi/dist.hpp"
#include "magi/env.hpp"
#include "reference/compare.hpp"
#include "reference/naive_attention.hpp"
#include "reference/random_inputs.hpp"

namespace magi::dist {
namespace {

using test::HostTensor;

std::shared_ptr<comm::NcclCommunicator>& world_slot() {
  static std::shared_ptr<comm::NcclCommunicator> world;
  return world;
}
comm::NcclCommunicator& world() { return *world_slot(); }

uint64_t shared_seed() {
  uint64_t mine = test::fresh_seed();
  std::vector<uint64_t> all(static_cast<size_t>(world().size()));
  world().allgather(&mine, sizeof(mine), all.data());
  return all[0];
}

// An owning device buffer on the world's GPU, viewed as one tensor.
class DeviceTensor {
 public:
  DeviceTensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
    bytes_ = static_cast<size_t>(dtype_size(dtype));
    for (int64_t s : shape_) bytes_ *= static_cast<size_t>(s);
    if (cudaMalloc(&data_, bytes_ + 16) != cudaSuccess) throw std::runtime_error("cudaMalloc");
    poison();
  }
  explicit DeviceTensor(const HostTensor& host) : DeviceTensor(host.dtype(), host.shape()) {
    cudaMemcpy(data_, host.bytes().data(), bytes_, cudaMemcpyHostToDevice);
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor() { cudaFree(data_); }
  void poison() { cudaMemset(data_, 0xFF, bytes_); }  // NaN in bf16, fp16 and fp32
  TensorView view() const {
    TensorView v;
    v.data = data_;
    v.dtype = dtype_;
    v.ndim = static_cast<int32_t>(shape_.size());
    for (size_t i = 0; i < shape_.size(); ++i) v.shape[i] = shape_[i];
    v.device = Device{DeviceType::CUDA, world().cuda_device()};
    return v;
  }
  HostTensor download() const {
    HostTensor host(dtype_, shape_);
    cudaMemcpy(host.view().data, data_, bytes_, cudaMemcpyDeviceToHost);
    return host;
  }

 private:
  DType dtype_;
  std::vector<int64_t> shape_;
  size_t bytes_ = 0;
  void* data_ = nullptr;
};

constexpr DType kDtype = DType::BF16;
const HeadShape kHeads{2, 1, 128};  // GQA; small enough for the fp64 reference on the host

struct Results {
  HostTensor out, lse, dq, dk, dv;
};

struct Problem {
  Mask mask;
  HeadShape heads;
  HostTensor q, k, v, dout;
  test::ReferenceForward ref_fwd;
  test::ReferenceGrads ref_grads;
  Results single;  // single-GPU kernel on the global tensors
  DType results = kDtype;  // of out, dq, dk, dv (single GPU and distributed)
};

AttentionOptions options(bool deterministic) {
  AttentionOptions o;
  o.backend = Backend::Cuda;
  o.deterministic = deterministic;
  return o;
}

// Global inputs from the shared seed (same on every rank), the fp64 reference and the single-GPU result.
Problem make_problem(const Mask& mask, uint64_t seed, const HeadShape& heads = kHeads, DType results = kDtype) {
  Problem p;
  p.mask = mask;
  p.heads = heads;
  p.results = results;
  std::mt19937_64 rng(seed);
  const int64_t t = mask.total_q, hq = heads.heads_q, hkv = heads.heads_kv, d = heads.head_dim;
  p.q = HostTensor::from_values(test::random_normal(rng, static_cast<size_t>(t * hq * d), kDtype), kDtype, {t, hq, d});
  p.k = HostTensor::from_values(test::random_normal(rng, static_cast<size_t>(t * hkv * d), kDtype), kDtype, {t, hkv, d});
  p.v = HostTensor::from_values(test::random_normal(rng, static_cast<size_t>(t * hkv * d), kDtype), kDtype, {t, hkv, d});
  p.dout = HostTensor::from_values(test::random_normal(rng, static_cast<size_t>(t * hq * d), kDtype), kDtype, {t, hq, d});
  test::ReferenceProblem ref;
  ref.mask = mask;
  ref.heads_q = heads.heads_q;
  ref.heads_kv = heads.heads_kv;
  ref.head_dim = heads.head_dim;
  ref.q = p.q.values();
  ref.k = p.k.values();
  ref.v = p.v.values();
  p.ref_fwd = test::reference_forward(ref);
  p.ref_grads = test::reference_backward(ref, p.dout.values());

  DeviceTensor q(p.q), k(p.k), v(p.v), dout(p.dout);
  DeviceTensor out(results, {t, hq, d}), lse(DType::F32, {t, hq}), dq(results, {t, hq, d}), dk(results, {t, hkv, d}),
      dv(results, {t, hkv, d});
  ForwardArgs f;
  f.q = q.view();
  f.k = k.view();
  f.v = v.view();
  f.out = out.view();
  f.lse = lse.view();
  magi::forward(mask, f, options(false));
  BackwardArgs b;
  b.q = q.view();
  b.k = k.view();
  b.v = v.view();
  b.out = out.view();
  b.lse = lse.view();
  b.dout = dout.view();
  b.dq = dq.view();
  b.dk = dk.view();
  b.dv = dv.view();
  magi::backward(mask, b, options(false));
  cudaDeviceSynchronize();
  p.single = {out.download(), lse.download(), dq.download(), dk.download(), dv.download()};
  return p;
}

struct DistRun {
  int32_t overlap_degree = 1;
  bool high_precision = true;
  bool deterministic = false;
  int32_t chunk_size = 128;
  bool qo_comm = false, flatten_head_groups = false, forward_high_precision = false;
};

// dispatch -> calc_attn -> calc_attn_backward -> undispatch; every output poisoned first.
// Also returns the local outputs (for bitwise comparisons).
Results run_distributed(const Problem& p, const DistRun& run, Results* local = nullptr) {
  DistConfig config;
  config.chunk_size = run.chunk_size;
  config.overlap_degree = run.overlap_degree;
  config.attention = options(run.deterministic);
  config.backward_high_precision_reduce = run.high_precision;
  config.comm_timeout_seconds = 120.0;
  config.qo_comm = run.qo_comm;
  config.flatten_head_groups = run.flatten_head_groups;
  config.forward_high_precision_reduce = run.forward_high_precision;
  const RuntimeKey key = make_runtime_key(p.mask, p.heads, world_slot(), config);
  const int64_t t = p.mask.total_q, lq = key.local_q_tokens(), lk = key.local_k_tokens();
  const int64_t hq = p.heads.heads_q, hkv = p.heads.heads_kv, d = p.heads.head_dim;

  DeviceTensor gq(p.q), gk(p.k), gv(p.v), gdout(p.dout);
  DeviceTensor q(kDtype, {lq, hq, d}), k(kDtype, {lk, hkv, d}), v(kDtype, {lk, hkv, d}), dout(kDtype, {lq, hq, d});
  dispatch(key, Axis::Q, gq.view(), q.view());
  dispatch(key, Axis::K, gk.view(), k.view());
  dispatch(key, Axis::K, gv.view(), v.view());
  dispatch(key, Axis::Q, gdout.view(), dout.view());

  DeviceTensor out(p.results, {lq, hq, d}), lse(DType::F32, {lq, hq});
  ForwardArgs f;
  f.q = q.view();
  f.k = k.view();
  f.v = v.view();
  f.out = out.view();
  f.lse = lse.view();
  calc_attn(key, f);

  DeviceTensor dq(p.results, {lq, hq, d}), dk(p.results, {lk, hkv, d}), dv(p.results, {lk, hkv, d});
  BackwardArgs b;
  b.q = q.view();
  b.k = k.view();
  b.v = v.view();
  b.out = out.view();
  b.lse = lse.view();
  b.dout = dout.view();
  b.dq = dq.view();
  b.dk = dk.view();
  b.dv = dv.view();
  calc_attn_backward(key, b);
  if (local != nullptr) *local = {out.download(), lse.download(), dq.download(), dk.download(), dv.download()};

  DeviceTensor g_out(p.results, {t, hq, d}), g_lse(DType::F32, {t, hq}), g_dq(p.results, {t, hq, d}),
      g_dk(p.results, {t, hkv, d}), g_dv(p.results, {t, hkv, d});
  undispatch(key, Axis::Q, out.view(), g_out.view());
  undispatch(key, Axis::Q, lse.view(), g_lse.view());
  undispatch(key, Axis::Q, dq.view(), g_dq.view());
  undispatch(key, Axis::K, dk.view(), g_dk.view());
  undispatch(key, Axis::K, dv.view(), g_dv.view());
  return {g_out.download(), g_lse.download(), g_dq.download(), g_dk.download(), g_dv.download()};
}

// SPEC bounds against the reference, and (when asked) max error <= 2x the single-GPU kernel's.
void judge(const Problem& p, const Results& got, const std::string& context, bool within_2x_of_single) {
  struct Item {
    const char* name;
    const HostTensor* dist;
    const HostTensor* single;
    const std::vector<double>* ref;
    test::Quantity quantity;
  };
  const Item items[] = {{"out", &got.out, &p.single.out, &p.ref_fwd.out, test::Quantity::Out},
                        {"lse", &got.lse, &p.single.lse, &p.ref_fwd.lse, test::Quantity::Lse},
                        {"dq", &got.dq, &p.single.dq, &p.ref_grads.dq, test::Quantity::Grad},
                        {"dk", &got.dk, &p.single.dk, &p.ref_grads.dk, test::Quantity::Grad},
                        {"dv", &got.dv, &p.single.dv, &p.ref_grads.dv, test::Quantity::Grad}};
  for (const Item& item : items) {
    const std::vector<double> dist = item.dist->values(), single = item.single->values();
    EXPECT_TRUE(test::check_close(item.name, dist, *item.ref, item.quantity, kDtype, context));
    EXPECT_TRUE(test::check_close(std::string(item.name) + " (single GPU)", single, *item.ref, item.quantity, kDtype,
                                  context));
    const test::ErrorStats e_dist = test::error_stats(dist, *item.ref), e_single = test::error_stats(single, *item.ref);
    // A floor for quantities the kernels get (almost) exactly right.
    const double floor = 1e-6 * std::max(1.0, e_single.max_ref);
    if (world().rank() == 0)
      std::printf("  %-28s %-4s max err dist %.3e single %.3e (ratio %.2f), rel L2 dist %.3e single %.3e\n",
                  context.c_str(), item.name, e_dist.max_abs, e_single.max_abs,
                  e_single.max_abs > 0 ? e_dist.max_abs / e_single.max_abs : 0.0, e_dist.rel_l2, e_single.rel_l2);
    if (within_2x_of_single)
      EXPECT_LE(e_dist.max_abs, 2.0 * e_single.max_abs + floor)
          << item.name << ": distributed max error vs single GPU, " << context;
  }
}

std::vector<int32_t> doc_cu_seqlens(int32_t total) {
  // Uneven documents, not aligned to the 128-token chunks.
  std::vector<int32_t> cu{0};
  const int32_t lengths[] = {301, 77, 530, 190, 612, 45};
  for (int32_t len : lengths)
    if (cu.back() + len < total) cu.push_back(cu.back() + len);
  cu.push_back(total);
  return cu;
}

struct NamedMask {
  std::string name;
  Mask mask;
};

const Problem& problem_for(const NamedMask& m, uint64_t seed) {
  static std::map<std::string, Problem> problems;
  auto it = problems.find(m.name);
  if (it == problems.end()) it = problems.emplace(m.name, make_problem(m.mask, seed)).first;
  return it->second;
}

constexpr int32_t kTotal = 2048;

class DistAttnGpu : public ::testing::TestWithParam<int> {};

std::vector<NamedMask> masks() {
  return {{"full", masks::full(kTotal, kTotal)},
          {"causal", masks::causal(kTotal, kTotal)},
          {"varlen_causal", masks::varlen_causal(doc_cu_seqlens(kTotal))}};
}

TEST_P(DistAttnGpu, MatchesSingleGpuAndReference) {
  static const uint64_t seed = shared_seed();
  const NamedMask m = masks()[static_cast<size_t>(GetParam())];
  const Problem& p = problem_for(m, seed);
  for (int32_t overlap : {0, 1, 2}) {
    const std::string context = m.name + " cp" + std::to_string(world().size()) + " overlap" + std::to_string(overlap) +
                                " seed " + std::to_string(seed);
    judge(p, run_distributed(p, {overlap, true, false, 128}), context + " fp32-reduce", true);
  }
  // Partials on the wire in bf16 (the default): SPEC bounds only (one more rounding of dk/dv partials).
  judge(p, run_distributed(p, {2, false, false, 128}), m.name + " bf16-reduce seed " + std::to_string(seed), false);
}

// fp32 results of bf16 inputs with the default (input-dtype) reduce: the partials then cross the wire in fp32, so
// the distributed error stays within twice the single GPU's (SPEC section 5), on the k/v and the q/out routes.
TEST(DistAttnGpuFp32Results, WithinTwiceTheSingleGpuErrorWithoutHighPrecisionReduce) {
  static const uint64_t seed = shared_seed();
  const Problem p = make_problem(masks::varlen_causal(doc_cu_seqlens(kTotal)), seed, kHeads, DType::F32);
  for (bool qo : {false, true}) {
    DistRun run{1, false, false, 128};
    run.qo_comm = qo;
    judge(p, run_distributed(p, run),
          std::string("fp32 results") + (qo ? " q/out route" : "") + " seed " + std::to_string(seed), true);
  }
}

INSTANTIATE_TEST_SUITE_P(Masks, DistAttnGpu, ::testing::Values(0, 1, 2), [](const auto& info) {
  return masks()[static_cast<size_t>(info.param)].name;
});

// Head dims above 256: the stages run the D-split kernels (D 520 in the 576 tile), forward and backward.
TEST(DistAttnGpuLargeHeadDim, MatchesSingleGpuAndReference) {
  if (!cuda::head_dim_supported(520)) GTEST_SKIP() << "this build has no head-dim tile for 520";
  static const uint64_t seed = shared_seed();
  static const Problem p = make_problem(masks::varlen_causal(doc_cu_seqlens(1024)), seed, HeadShape{2, 1, 520});
  for (int32_t overlap : {0, 2})
    judge(p, run_distributed(p, {overlap, true, false, 128}),
          "D 520 varlen causal cp" + std::to_string(world().size()) + " overlap" + std::to_string(overlap) + " seed " +
              std::to_string(seed),
          true);
}

TEST(DistAttnGpuDeterminism, TwoRunsAreBitwiseEqual) {
  static const uint64_t seed = shared_seed();
  const NamedMask m = masks()[2];
  const Problem& p = problem_for(m, seed);
  Results first, second;
  run_distributed(p, {2, false, true, 128}, &first);
  run_distributed(p, {2, false, true, 128}, &second);
  EXPECT_TRUE(test::check_bitwise_equal("out", first.out, second.out, "seed " + std::to_string(seed)));
  EXPECT_TRUE(test::check_bitwise_equal("lse", first.lse, second.lse, "seed " + std::to_string(seed)));
  EXPECT_TRUE(test::check_bitwise_equal("dq", first.dq, second.dq, "seed " + std::to_string(seed)));
  EXPECT_TRUE(test::check_bitwise_equal("dk", first.dk, second.dk, "seed " + std::to_string(seed)));
  EXPECT_TRUE(test::check_bitwise_equal("dv", first.dv, second.dv, "seed " + std::to_string(seed)));
}

// MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT=0: each remote stage writes the partial out / lse buffers and lse_merge
// folds them in (the tests above run the in-place default). Remote stages need two or more GPUs; at cp = 1 this runs
// the local stage only.
TEST(DistAttnGpuInplaceCorrect, OutOfPlaceMergeMatchesSingleGpuAndIsDeterministic) {
  static const uint64_t seed = shared_seed();
  setenv("MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT", "0", 1);
  env::reset_for_testing();
  const NamedMask m = masks()[2];
  const Problem& p = problem_for(m, seed);
  for (int32_t overlap : {0, 2}) {
    const std::string context = m.name + " out-of-place merge cp" + std::to_string(world().size()) + " overlap" +
                                std::to_string(overlap) + " seed " + std::to_string(seed);
    judge(p, run_distributed(p, {overlap, true, false, 128}), context, true);
  }
  Results first, second;
  run_distributed(p, {2, false, true, 128}, &first);
  run_distributed(p, {2, false, true, 128}, &second);
  const std::string context = "out-of-place merge, seed " + std::to_string(seed);
  EXPECT_TRUE(test::check_bitwise_equal("out", first.out, second.out, context));
  EXPECT_TRUE(test::check_bitwise_equal("lse", first.lse, second.lse, context));
  unsetenv("MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT");
  env::reset_for_testing();
}

// MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE on device tensors: the local stage runs last into its own dk/dv buffers
// (added after the reductions, its dq into the running sum); gradients still match, deterministic mode bitwise.
TEST(DistAttnGpuHideTail, LocalStageLastMatchesSingleGpuAndIsDeterministic) {
  static const uint64_t seed = shared_seed();
  setenv("MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE", "1", 1);
  env::reset_for_testing();
  const NamedMask m = masks()[2];
  const Problem& p = problem_for(m, seed);
  for (int32_t overlap : {0, 2}) {
    const std::string context = m.name + " hide tail reduce cp" + std::to_string(world().size()) + " overlap" +
                                std::to_string(overlap) + " seed " + std::to_string(seed);
    judge(p, run_distributed(p, {overlap, true, false, 128}), context, true);
  }
  Results first, second;
  run_distributed(p, {2, false, true, 128}, &first);
  run_distributed(p, {2, false, true, 128}, &second);
  const std::string context = "hide tail reduce, seed " + std::to_string(seed);
  for (auto [name, x, y] : {std::tuple{"dq", &first.dq, &second.dq}, {"dk", &first.dk, &second.dk},
                            {"dv", &first.dv, &second.dv}})
    EXPECT_TRUE(test::check_bitwise_equal(name, *x, *y, context));
  unsetenv("MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE");
  env::reset_for_testing();
}

// MAGI_ATTENTION_PROFILE_DIR on device tensors: a forward + backward writes this rank's rank_N.json with the device
// runtime's spans (CUDA-event times converted to wall-clock microseconds, so they fall inside the call), and
// `magi-attn trace DIR` merges the ranks' files.
TEST(DistAttnGpuProfile, ProfileDirWritesEachRanksTimelineThatTraceReads) {
  const uint64_t seed = shared_seed();
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("magi_gpu_profile_" + std::to_string(seed));
  setenv("MAGI_ATTENTION_PROFILE_DIR", dir.c_str(), 1);
  env::reset_for_testing();
  const NamedMask m = masks()[2];
  const Problem& p = problem_for(m, seed);
  clear_runtime_cache();  // planned afresh, so the planning spans are in this call's timeline
  const double before_us = Timeline::now_us();
  run_distributed(p, {1, true, false, 128});
  const double after_us = Timeline::now_us();
  world().barrier();

  const int32_t me = world().rank();
  int32_t rank = -1;
  const std::vector<Span> spans = read_spans((dir / ("rank_" + std::to_string(me) + ".json")).string(), &rank);
  EXPECT_EQ(rank, me);
  const auto find = [&](const std::string& name, const std::string& lane) -> const Span* {
    for (const Span& s : spans)
      if (s.name == name && s.lane == lane) return &s;
    return nullptr;
  };
  std::vector<std::pair<std::string, std::string>> expected = {
      {"plan (dispatch + comm plan)", "host"},  {"plan (device routes and streams)", "host"},
      {"forward local attention", "compute"},   {"backward local attention", "compute"},
      {"backward store dq / dk / dv", "compute"}};
  if (world().size() > 1) {
    expected.push_back({"forward stage 0 k/v exchange", "comm"});
    expected.push_back({"backward stage 0 k/v exchange", "comm"});
    expected.push_back({"backward stage 0 dk/dv reduce", "comm"});
  }
  for (const auto& [name, lane] : expected) EXPECT_NE(find(name, lane), nullptr) << name << " (" << lane << ")";
  for (const Span& s : spans) {
    EXPECT_LE(s.start_us, s.end_us) << s.name;
    // 1 ms of slack for the anchor event's dating.
    EXPECT_GE(s.start_us, before_us - 1e3) << s.name << " starts before the call";
    EXPECT_LE(s.end_us, after_us + 1e3) << s.name << " ends after the call";
  }
  const Span* forward = find("forward local attention", "compute");
  const Span* backward = find("backward local attention", "compute");
  if (forward != nullptr && backward != nullptr) EXPECT_LE(forward->end_us, backward->start_us);
  EXPECT_GT(overlap_of(spans).compute_us, 0.0);
  world().barrier();

  if (me == 0) {
#ifdef MAGI_CLI_PATH
    const std::filesystem::path report = dir / "trace_report.txt";
    const std::string command =
        std::string("'") + MAGI_CLI_PATH + "' trace '" + dir.string() + "' > '" + report.string() + "' 2>&1";
    const int status = std::system(command.c_str());
    std::ifstream in(report);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << text;
    EXPECT_NE(text.find("merged " + std::to_string(world().size()) + " ranks"), std::string::npos) << text;
    EXPECT_TRUE(std::filesystem::exists(dir / "trace.json"));
#endif
    std::filesystem::remove_all(dir);
  }
  world().barrier();
  unsetenv("MAGI_ATTENTION_PROFILE_DIR");
  env::reset_for_testing();
}

// A shared (sh) sink and max_logits: the sink counts once (host stage), dsink is summed over ranks
// (dsink op sum), max_logits is the global max; judged against the fp64 reference.
TEST(DistAttnGpuSink, SharedSinkMaxLogitsAndSummedDsink) {
  const uint64_t seed = shared_seed();
  const int32_t t = 1024, sink_len = 2;
  const Mask mask = masks::causal(t, t);
  const int64_t hq = kHeads.heads_q, hkv = kHeads.heads_kv, d = kHeads.head_dim;
  std::mt19937_64 rng(seed);
  const HostTensor q = HostTensor::from_values(test::random_normal(rng, static_cast<size_t>(t * hq * d), kDtype), kDtype, {t, hq, d});
  const HostTensor k = HostTensor::from_values(test::random_normal(rng, static_cast<size_t>(t * hkv * d), kDtype), kDtype, {t, hkv, d});
  const HostTensor v = HostTensor::from_values(test::random_normal(rng, static_cast<size_t>(t * hkv * d), kDtype), kDtype, {t, hkv, d});
  const HostTensor dout = HostTensor::from_values(test::random_normal(rng, static_cast<size_t>(t * hq * d), kDtype), kDtype, {t, hq, d});
  std::vector<double> sink_values = test::random_normal(rng, static_cast<size_t>(sink_len * hq), DType::F32);
  for (double& x : sink_values) x += 3.0;  // a noticeable share of each row's mass
  const HostTensor sink = HostTensor::from_values(sink_values, DType::F32, {sink_len, hq});

  test::ReferenceProblem ref;
  ref.mask = mask;
  ref.heads_q = kHeads.heads_q;
  ref.heads_kv = kHeads.heads_kv;
  ref.head_dim = kHeads.head_dim;
  ref.sink_layout = SinkLayout::SH;
  ref.sink_len = sink_len;
  ref.q = q.values();
  ref.k = k.values();
  ref.v = v.values();
  ref.sink = sink.values();
  const test::ReferenceForward ref_fwd = test::reference_forward(ref);
  const test::ReferenceGrads ref_grads = test::reference_backward(ref, dout.values());

  DistConfig config;
  config.chunk_size = 128;
  config.overlap_degree = 2;
  config.attention = options(false);
  config.attention.sink_layout = SinkLayout::SH;
  config.dsink_reduce_op = DsinkReduceOp::Sum;
  config.backward_high_precision_reduce = true;
  const RuntimeKey key = make_runtime_key(mask, kHeads, world_slot(), config);
  const int64_t lq = key.local_q_tokens(), lk = key.local_k_tokens();
  DeviceTensor gq(q), gk(k), gv(v), gdout(dout), dsink_in(sink);
  DeviceTensor lq_t(kDtype, {lq, hq, d}), lk_t(kDtype, {lk, hkv, d}), lv_t(kDtype, {lk, hkv, d}), ldout(kDtype, {lq, hq, d});
  dispatch(key, Axis::Q, gq.view(), lq_t.view());
  dispatch(key, Axis::K, gk.view(), lk_t.view());
  dispatch(key, Axis::K, gv.view(), lv_t.view());
  dispatch(key, Axis::Q, gdout.view(), ldout.view());
  DeviceTensor out(kDtype, {lq, hq, d}), lse(DType::F32, {lq, hq}), max_logits(DType::F32, {hq});
  ForwardArgs f;
  f.q = lq_t.view();
  f.k = lk_t.view();
  f.v = lv_t.view();
  f.sink = dsink_in.view();
  f.out = out.view();
  f.lse = lse.view();
  f.max_logits = max_logits.view();
  calc_attn(key, f);
  DeviceTensor dq(kDtype, {lq, hq, d}), dk(kDtype, {lk, hkv, d}), dv(kDtype, {lk, hkv, d}), dsink(DType::F32, {sink_len, hq});
  BackwardArgs b;
  b.q = f.q;
  b.k = f.k;
  b.v = f.v;
  b.sink = f.sink;
  b.out = out.view();
  b.lse = lse.view();
  b.dout = ldout.view();
  b.dq = dq.view();
  b.dk = dk.view();
  b.dv = dv.view();
  b.dsink = dsink.view();
  calc_attn_backward(key, b);
  DeviceTensor g_out(kDtype, {t, hq, d}), g_lse(DType::F32, {t, hq}), g_dq(kDtype, {t, hq, d}), g_dk(kDtype, {t, hkv, d}),
      g_dv(kDtype, {t, hkv, d});
  undispatch(key, Axis::Q, out.view(), g_out.view());
  undispatch(key, Axis::Q, lse.view(), g_lse.view());
  undispatch(key, Axis::Q, dq.view(), g_dq.view());
  undispatch(key, Axis::K, dk.view(), g_dk.view());
  undispatch(key, Axis::K, dv.view(), g_dv.view());
  const std::string context = "causal 1k + sh sink, seed " + std::to_string(seed);
  EXPECT_TRUE(test::check_close("out", g_out.download().values(), ref_fwd.out, test::Quantity::Out, kDtype, context));
  EXPECT_TRUE(test::check_close("lse", g_lse.download().values(), ref_fwd.lse, test::Quantity::Lse, kDtype, context));
  EXPECT_TRUE(test::check_max_logits(max_logits.download().values(), ref_fwd.max_logits, ref_fwd.max_logits_magnitude,
                                     kDtype, context));
  EXPECT_TRUE(test::check_close("dq", g_dq.download().values(), ref_grads.dq, test::Quantity::Grad, kDtype, context));
  EXPECT_TRUE(test::check_close("dk", g_dk.download().values(), ref_grads.dk, test::Quantity::Grad, kDtype, context));
  EXPECT_TRUE(test::check_close("dv", g_dv.download().values(), ref_grads.dv, test::Quantity::Grad, kDtype, context));
  EXPECT_TRUE(test::check_dsink(dsink.download().values(), ref_grads.dsink, ref_grads.dsink_magnitude, kDtype, context));
}

TEST(DistAttnGpuErrors, HostTensorsWithNcclCommunicatorAreRejected) {
  const Mask mask = masks::causal(512, 512);
  DistConfig config;
  config.chunk_size = 64;
  const RuntimeKey key = make_runtime_key(mask, kHeads, world_slot(), config);
  const int64_t lq = key.local_q_tokens();
  HostTensor q(kDtype, {lq, kHeads.heads_q, kHeads.head_dim}), out(kDtype, {lq, kHeads.heads_q, kHeads.head_dim});
  DeviceTensor k(kDtype, {key.local_k_tokens(), kHeads.heads_kv, kHeads.head_dim});
  DeviceTensor dq(kDtype, {lq, kHeads.heads_q, kHeads.head_dim}), lse(DType::F32, {lq, kHeads.heads_q});
  ForwardArgs f;
  f.q = dq.view();  // on the device
  f.k = k.view();
  f.v = q.view();   // on the host: rejected, naming v
  f.out = out.view();
  f.lse = lse.view();
  try {
    calc_attn(key, f);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("v:"), std::string::npos) << e.what();
  }
}

// roll of device tensors equals rolling the global tensor, for rows of 2, 4 and 256 bytes, in place too, shifts
// past the length and negative; the host roll of the same rows agrees.
TEST(DistAttnGpuRoll, MatchesRollingTheGlobalTensor) {
  const Mask mask = masks::varlen_causal(test::cu_seqlens_of({300, 90, 211}));
  DistConfig config;
  config.chunk_size = 40;  // padding rows at the end
  const RuntimeKey key = make_runtime_key(mask, kHeads, world_slot(), config);
  const int64_t total = mask.total_q, local_rows = key.local_q_tokens();
  std::mt19937_64 rng(shared_seed());
  for (const auto& [dtype, width] : {std::pair{DType::BF16, int64_t{1}}, {DType::F32, int64_t{1}}, {DType::BF16, int64_t{128}}})
    for (int64_t shift : {int64_t{1}, int64_t{-1}, int64_t{7}, total + 3, int64_t{-2} * total - 5, int64_t{0}}) {
      const std::string what = std::string(to_string(dtype)) + " x" + std::to_string(width) + " shift " + std::to_string(shift);
      const HostTensor global = HostTensor::from_values(test::random_normal(rng, static_cast<size_t>(total * width), dtype),
                                                        dtype, {total, width});
      DeviceTensor g(global), local(dtype, {local_rows, width}), rolled(dtype, {local_rows, width}),
          back(dtype, {total, width});
      dispatch(key, Axis::Q, g.view(), local.view());
      roll(key, Axis::Q, local.view(), rolled.view(), shift);
      undispatch(key, Axis::Q, rolled.view(), back.view());
      const auto got = back.download().values(), in = global.values();
      const int64_t s = ((shift % total) + total) % total;
      for (int64_t row = 0; row < total; ++row)
        for (int64_t c = 0; c < width; ++c)
          ASSERT_EQ(got[row * width + c], in[((row - s + total) % total) * width + c]) << what << " row " << row;
      // Padding rows of the rolled local tensor hold zeros; in place gives the same rows.
      const auto local_rolled = rolled.download().values();
      const auto positions = position_ids(key, Axis::Q);
      for (int64_t i = 0; i < local_rows; ++i)
        if (positions[i] >= total)
          for (int64_t c = 0; c < width; ++c) ASSERT_EQ(local_rolled[i * width + c], 0.0) << what << " padding row " << i;
      roll(key, Axis::Q, local.view(), local.view(), shift);
      EXPECT_EQ(local.download().bytes(), rolled.download().bytes()) << what << " (in place)";
    }
}

// MAGI_ATTENTION_QO_COMM and MAGI_ATTENTION_FLATTEN_HEAD_GROUPS on device tensors: 32 documents of 64 rows whose
// first 64 rows also see every key, so their chunk's work is handed to the kv owners (q rows out, partial out / lse
// back; backward q, out, dout, lse out, partial dq back), and 2 kv heads, so flattening may split the heads into
// classes. Matches the single GPU and the reference; deterministic runs are bitwise equal.
TEST(DistAttnGpuRoutes, QueryOutputRoutesAndHeadClassesMatchSingleGpuAndAreDeterministic) {
  static const uint64_t seed = shared_seed();
  Mask mask = masks::varlen_causal(test::cu_seqlens_of(std::vector<int32_t>(32, 64)));
  mask.slices.push_back(test::make_slice(0, 64, 64, 2048, MaskType::Full));
  const HeadShape heads{4, 2, 128};
  static const Problem p = make_problem(mask, seed, heads);
  for (const bool flatten : {false, true}) {
    DistConfig config;
    config.chunk_size = 64;
    config.qo_comm = true;
    config.flatten_head_groups = flatten;
    const RuntimeKey key = make_runtime_key(mask, heads, world_slot(), config);
    if (world().size() >= 2)
      ASSERT_GT(key.summary().qo_units, 0) << "the solver routed nothing: the test would prove nothing";
    for (int32_t overlap : {0, 2}) {
      DistRun run{overlap, true, false, 64, true, flatten, overlap == 2};
      const std::string context = std::string(flatten ? "qo + flattened" : "qo") + " cp" +
                                  std::to_string(world().size()) + " overlap" + std::to_string(overlap) + " seed " +
                                  std::to_string(seed);
      judge(p, run_distributed(p, run), context, true);
    }
    DistRun run{2, false, true, 64, true, flatten, false};
    Results first, second;
    run_distributed(p, run, &first);
    run_distributed(p, run, &second);
    const std::string context = std::string(flatten ? "qo + flattened" : "qo") + ", seed " + std::to_string(seed);
    for (auto [name, x, y] : {std::tuple{"out", &first.out, &second.out}, {"lse", &first.lse, &second.lse},
                              {"dq", &first.dq, &second.dq}, {"dk", &first.dk, &second.dk}, {"dv", &first.dv, &second.dv}})
      EXPECT_TRUE(test::check_bitwise_equal(name, *x, *y, context));
  }
}

}  // namespace
}  // namespace magi::dist

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return magi::comm::run_on_local_gpus([](std::shared_ptr<magi::comm::NcclCommunicator> comm) {
    magi::dist::world_slot() = std::move(comm);
    magi::dist::world().set_timeout(300.0);
    const int rank = magi::dist::world().rank();
    if (rank != 0) GTEST_FLAG_SET(brief, true);  // other ranks print their failures only
    const bool ok = RUN_ALL_TESTS() == 0;
    if (!ok) std::fprintf(stderr, "[rank %d] failed\n", rank);
    magi::dist::clear_runtime_cache();  // runtimes hold the communicator
    magi::dist::world_slot().reset();
    return ok ? 0 : 1;
  });
}
