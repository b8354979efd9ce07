// The portable CUDA backend against the fp64 reference (SPEC section 5) on the SPEC section 7 cases, random
// rectangles, every head-dim tile, GQA, sink / softcap / fp32 outputs; determinism and graph replay; random valid calls
// through the public API (CudaFuzz).
// Labelled `gpu`: CI (no GPU) skips it with `ctest -LE gpu`.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <sstream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/cuda_test_support.hpp"
#include "cuda/sm90/tiles.hpp"
#include "magi/attention.hpp"
#include "magi/error.hpp"
#include "magi/mask.hpp"
#include "reference/key_parts.hpp"
#include "reference/random_inputs.hpp"

namespace magi::test {
namespace {

// The Hopper family's run of this suite on another GPU: nothing of it can run there. A Hopper GPU runs the suite
// whatever tiles the build has (asking only for tile 128 skipped everything, reported as passed, in a build of 64).
class FamilyRunsHere : public testing::Environment {
 public:
  void SetUp() override {
    if (family_under_test() != cuda::KernelFamily::Sm90) return;
    for (int32_t d = 8; d <= 1024; d += 8)
      if (cuda::sm90_forward_available(d, 0)) return;
    GTEST_SKIP() << "MAGI_ATTENTION_KERNEL_BACKEND=ffa_sm90: device 0 cannot run the sm_90a kernels";
  }
};
[[maybe_unused]] testing::Environment* const family_check = testing::AddGlobalTestEnvironment(new FamilyRunsHere);

CaseConfig config(DType dtype, int32_t hq, int32_t hkv, int32_t d) {
  CaseConfig c;
  c.dtype = dtype;
  c.heads_q = hq;
  c.heads_kv = hkv;
  c.head_dim = d;
  c.backend = Backend::Cuda;
  return c;
}

class Spec7Cases : public testing::TestWithParam<DType> {};

TEST_P(Spec7Cases, MatchReference) {
  const uint64_t seed = fresh_seed();
  int index = 0;
  for (const auto& named : cases::all()) {
    // Alternate head layouts and dims over the cases to cover GQA and the tiles without multiplying time.
    const int32_t dims[] = {64, 128, 96};
    const int32_t heads[][2] = {{2, 2}, {4, 2}, {1, 1}};
    CaseConfig c = config(GetParam(), heads[index % 3][0], heads[index % 3][1], dims[index % 3]);
    EXPECT_TRUE(check_cuda_case(named.mask, c, seed + index, named.name));
    ++index;
  }
}
INSTANTIATE_TEST_SUITE_P(Dtypes, Spec7Cases, testing::Values(DType::BF16, DType::F16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

struct RectCase {
  int32_t tq, tk, slices;
};

class RandomRectangles : public testing::TestWithParam<RectCase> {};

TEST_P(RandomRectangles, MatchReference) {
  const RectCase r = GetParam();
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Mask mask = random_rectangles(rng, r.tq, r.tk, r.slices);
  // fp16 for the 100-slice masks, bf16 otherwise; GQA 4:2 at D 64 keeps the fp64 reference affordable.
  CaseConfig c = config(r.slices == 100 ? DType::F16 : DType::BF16, 4, 2, 64);
  const std::string name = "random " + std::to_string(r.tq) + "x" + std::to_string(r.tk) + " with " +
                           std::to_string(r.slices) + " slices";
  EXPECT_TRUE(check_cuda_case(mask, c, seed + 1, name));
}
INSTANTIATE_TEST_SUITE_P(Sizes, RandomRectangles,
                         testing::Values(RectCase{1024, 1024, 10}, RectCase{1024, 1024, 100},
                                         RectCase{1024, 1024, 1000}, RectCase{2048, 2048, 10},
                                         RectCase{2048, 2048, 100}, RectCase{2048, 2048, 1000},
                                         RectCase{2048, 4096, 10}, RectCase{2048, 4096, 100},
                                         RectCase{2048, 4096, 1000}, RectCase{4096, 2048, 10},
                                         RectCase{4096, 2048, 100}, RectCase{4096, 2048, 1000}),
                         [](const auto& info) {
                           return std::to_string(info.param.tq) + "x" + std::to_string(info.param.tk) + "_" +
                                  std::to_string(info.param.slices);
                         });

struct FeatureCase {
  std::string name;
  DType dtype;
  int32_t hq, hkv, d;
  SinkLayout sink;
  double softcap;
  bool fp32_outputs;
  bool mixed_buffers = false;  // out, dq, dv fp32; dout, dk 16-bit
  bool sink_neg_inf = false;   // some sinks -inf (a whole head, and every head's first sink)
};

class Features : public testing::TestWithParam<FeatureCase> {};

TEST_P(Features, MatchReference) {
  const FeatureCase f = GetParam();
  if (!cuda::head_dim_supported(f.d)) GTEST_SKIP() << "this build has no head-dim tile for " << f.d;
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Mask mask = random_rectangles(rng, 512, 640, 40);
  CaseConfig c = config(f.dtype, f.hq, f.hkv, f.d);
  c.sink_layout = f.sink;
  c.sink_len = 3;
  c.softcap = f.softcap;
  c.fp32_outputs = f.fp32_outputs;
  c.mixed_buffers = f.mixed_buffers;
  c.sink_neg_inf = f.sink_neg_inf;
  EXPECT_TRUE(check_cuda_case(mask, c, seed + 1, f.name));
}
INSTANTIATE_TEST_SUITE_P(
    All, Features,
    testing::Values(FeatureCase{"d64_bf16", DType::BF16, 8, 8, 64, SinkLayout::None, 0.0, false},
                    FeatureCase{"d96_fp16", DType::F16, 4, 2, 96, SinkLayout::None, 0.0, false},
                    FeatureCase{"d128_bf16_gqa", DType::BF16, 32, 4, 128, SinkLayout::None, 0.0, false},
                    FeatureCase{"d192_bf16", DType::BF16, 4, 2, 192, SinkLayout::None, 0.0, false},
                    FeatureCase{"d256_fp16", DType::F16, 2, 1, 256, SinkLayout::None, 0.0, false},
                    FeatureCase{"d256_bf16_mqa", DType::BF16, 4, 1, 256, SinkLayout::None, 0.0, false},
                    FeatureCase{"d256_bf16_gqa_sink_softcap", DType::BF16, 4, 2, 256, SinkLayout::SH, 30.0, true},
                    FeatureCase{"d40_bf16", DType::BF16, 2, 2, 40, SinkLayout::None, 0.0, false},
                    FeatureCase{"d8_bf16_gqa", DType::BF16, 4, 2, 8, SinkLayout::None, 0.0, false},
                    FeatureCase{"d136_fp16", DType::F16, 2, 1, 136, SinkLayout::None, 0.0, false},
                    FeatureCase{"d248_bf16", DType::BF16, 2, 2, 248, SinkLayout::None, 0.0, false},
                    FeatureCase{"sink_sh", DType::BF16, 4, 2, 64, SinkLayout::SH, 0.0, false},
                    FeatureCase{"sink_ssh_fp16", DType::F16, 4, 4, 128, SinkLayout::SSH, 0.0, false},
                    FeatureCase{"softcap", DType::BF16, 2, 1, 128, SinkLayout::None, 30.0, false},
                    FeatureCase{"softcap_small", DType::F16, 2, 2, 64, SinkLayout::None, 2.0, false},
                    FeatureCase{"fp32_outputs", DType::BF16, 4, 2, 128, SinkLayout::None, 0.0, true},
                    FeatureCase{"fp32_outputs_sink_softcap", DType::F16, 2, 1, 64, SinkLayout::SSH, 5.0, true},
                    FeatureCase{"mixed_buffers", DType::BF16, 4, 2, 64, SinkLayout::None, 0.0, false, true},
                    FeatureCase{"sink_sh_neg_inf", DType::BF16, 4, 2, 64, SinkLayout::SH, 0.0, false, false, true},
                    FeatureCase{"sink_ssh_neg_inf", DType::F16, 2, 2, 128, SinkLayout::SSH, 0.0, false, false, true}),
    [](const auto& info) { return info.param.name; });

TEST(CudaBackend, FullWithSshSink) {
  const uint64_t seed = fresh_seed();
  CaseConfig c = config(DType::BF16, 2, 1, 128);
  c.sink_layout = SinkLayout::SSH;
  c.sink_len = 4;
  EXPECT_TRUE(check_cuda_case(cases::full(1024), c, seed, "full 1k with ssh sink"));
}

TEST(CudaBackend, EmptyMaskGivesZerosAndMinusInf) {
  Mask mask;
  mask.total_q = 100;
  mask.total_k = 70;
  mask.slices.push_back(make_slice(10, 20, 5, 9, MaskType::Full));
  mask.slices.push_back(make_slice(30, 40, 0, 0, MaskType::Causal));  // empty slice
  CaseConfig c = config(DType::F16, 2, 1, 64);
  EXPECT_TRUE(check_cuda_case(mask, c, fresh_seed(), "mostly empty"));
  // Item-less q tiles before and after the busy ones, in every head-dim tile's q tiles (the copy kernel).
  Mask sparse{{make_slice(700, 760, 0, 300, MaskType::Causal)}, 1000, 300};
  for (int32_t d : {64, 128, 256})
    if (cuda::head_dim_supported(d))
      EXPECT_TRUE(check_cuda_case(sparse, config(DType::BF16, 2, 1, d), fresh_seed(), "item-less tiles"));
  // A plan without items runs the portable forward, also where the Hopper one has a tile the portable one lacks.
  const Mask no_items{{}, 1000, 300};
  for (int32_t d : {64, 320, 1000}) {
    if (!cuda::head_dim_supported(d)) continue;
    CaseConfig sink = config(DType::BF16, 2, 1, d);
    sink.sink_layout = SinkLayout::SH;
    EXPECT_TRUE(check_cuda_case(no_items, sink, fresh_seed(), "no items, sink, D " + std::to_string(d)));
  }
}

// The deterministic (two-kernel) backward against the reference: q-overlap, GQA, every tile, sink, softcap,
// fp32 gradients. (Every other case runs the default path, dq by atomics.)
TEST(CudaBackend, DeterministicModeMatchesReference) {
  const uint64_t seed = fresh_seed();
  CaseConfig gqa = config(DType::BF16, 8, 2, 128);
  EXPECT_TRUE(check_cuda_case(cases::mixed_types_q_overlap(), gqa, seed, "mixed types, q-overlap", true));
  std::mt19937_64 rng(seed);
  const Mask mask = random_rectangles(rng, 512, 640, 40);
  CaseConfig d64 = config(DType::F16, 4, 2, 64);
  d64.sink_layout = SinkLayout::SH;
  d64.sink_len = 3;
  EXPECT_TRUE(check_cuda_case(mask, d64, seed + 1, "random 512x640, sh sink", true));
  if (!cuda::head_dim_supported(256)) return;  // a build without tile 256 (MAGI_ATTN_CUDA_HEAD_DIMS)
  CaseConfig d256 = config(DType::BF16, 2, 1, 256);
  d256.softcap = 20.0;
  d256.fp32_outputs = true;
  EXPECT_TRUE(check_cuda_case(mask, d256, seed + 2, "random 512x640, d256 softcap fp32", true));
}

// Small deterministic-mode cases (the sanitizers run them: the dq kernel beside the dk/dv kernels, and on Hopper
// at D 128 the dk/dv kernel's dQ adds in turns).
TEST(CudaBackend, DeterministicModeSmallCase) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Mask mask = random_rectangles(rng, 300, 260, 12);
  CaseConfig c = config(DType::F16, 4, 2, 64);
  EXPECT_TRUE(check_cuda_case(mask, c, seed + 1, "random 300x260", true));
  CaseConfig d128 = config(DType::BF16, 4, 2, 128);
  EXPECT_TRUE(check_cuda_case(mask, d128, seed + 3, "random 300x260, d128", true));
  if (!cuda::head_dim_supported(256)) return;  // a build without tile 256 (MAGI_ATTN_CUDA_HEAD_DIMS)
  CaseConfig d256 = config(DType::BF16, 2, 1, 256);
  EXPECT_TRUE(check_cuda_case(mask, d256, seed + 2, "random 300x260, d256", true));
}

// dQ by 64-row chunks (the dk/dv kernels' adds): chunks without adds (rows without keys, between and after busy
// ones), a partial last chunk, several k tiles adding to one chunk, GQA / MQA, both modes and 16-bit dtypes. dq
// starts as NaN, so a chunk nobody writes fails.
TEST(CudaBackend, DqOfChunksWithAndWithoutAddsMatchesReference) {
  Mask mask;
  mask.total_q = 457;
  mask.total_k = 390;
  mask.slices = {make_slice(0, 70, 0, 300, MaskType::Full), make_slice(200, 260, 100, 390, MaskType::Causal),
                 make_slice(300, 330, 0, 50, MaskType::InvCausal), make_slice(430, 457, 250, 390, MaskType::Full)};
  const uint64_t seed = fresh_seed();
  int index = 0;
  for (const bool deterministic : {false, true}) {
    for (const CaseConfig& c : {config(DType::BF16, 4, 2, 128), config(DType::F16, 3, 1, 64)}) {
      const std::string name = "chunks with and without adds, " + std::string(to_string(c.dtype)) + ", D " +
                               std::to_string(c.head_dim) + (deterministic ? ", deterministic" : "");
      EXPECT_TRUE(check_cuda_case(mask, c, seed + index++, name, deterministic));
    }
  }
}

// The backward in two kernels at D 256 (the dk/dv kernel without dQ, then the dq kernel: the deterministic mode; the
// Hopper family's own dq kernel, 128-row tiles of 32-key items): rows without keys between and after busy ones, a
// partial last tile, q-overlap, GQA / MQA, a head dim padded to the tile, sink, softcap, 16-bit and fp32 gradients.
// Outputs start poisoned, so a row nobody writes fails.
TEST(CudaBackend, TwoKernelBackwardAtD256MatchesReference) {
  if (!cuda::head_dim_supported(256)) return;  // a build without tile 256 (MAGI_ATTN_CUDA_HEAD_DIMS)
  Mask gaps;
  gaps.total_q = 457;
  gaps.total_k = 390;
  gaps.slices = {make_slice(0, 70, 0, 300, MaskType::Full), make_slice(200, 260, 100, 390, MaskType::Causal),
                 make_slice(300, 330, 0, 50, MaskType::InvCausal), make_slice(430, 457, 250, 390, MaskType::Full)};
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Mask rectangles = random_rectangles(rng, 600, 520, 30);
  const Mask overlap = cases::mixed_types_q_overlap();
  CaseConfig gqa = config(DType::BF16, 4, 2, 256);
  CaseConfig mqa = config(DType::F16, 3, 1, 200);
  mqa.sink_layout = SinkLayout::SSH;
  mqa.sink_len = 3;
  CaseConfig capped = config(DType::BF16, 2, 2, 256);
  capped.softcap = 15.0;
  capped.fp32_outputs = true;
  int index = 0;
  for (const Mask* mask : std::initializer_list<const Mask*>{&gaps, &rectangles, &overlap})
    for (const CaseConfig* c : std::initializer_list<const CaseConfig*>{&gqa, &mqa, &capped})
      EXPECT_TRUE(check_cuda_case(*mask, *c, seed + index++, "two-kernel backward at D 256, " + c->describe(), true));
}

// Every row keeps one key, so dq and dk are exactly 0. With an fp32 dout the kernels read it rounded to 16 bits;
// Delta = dout . out from the unrounded dout left dq of dout's rounding (rel error ~1 before the fix).
TEST(CudaBackend, Fp32DoutRowsWithOneKeyGiveZeroDq) {
  const uint64_t seed = fresh_seed();
  for (DType dtype : {DType::BF16, DType::F16}) {
    CaseConfig c = config(dtype, 4, 2, 128);
    c.fp32_outputs = true;
    EXPECT_TRUE(check_cuda_case(masks::full(300, 1), c, seed, "one key per row, fp32 dout"));
    EXPECT_TRUE(check_cuda_case(masks::full(300, 1), c, seed + 1, "one key per row, fp32 dout", /*deterministic=*/true));
  }
}

// Runs forward + backward twice on the same inputs and requires bitwise-identical results.
TEST(CudaBackend, DeterministicAcrossRuns) {
  const uint64_t seed = fresh_seed();
  const Mask mask = cases::mixed_types_q_overlap();
  CaseConfig c = config(DType::BF16, 8, 2, 128);
  CaseData d = make_case(mask, c, seed);
  DeviceCase dev(d, c);
  auto plan = test_plan(mask, c.heads_q, c.heads_kv, c.head_dim);
  std::vector<HostTensor> first;
  for (int run = 0; run < 2; ++run) {
    dev.poison();
    cuda::forward(*plan, dev.forward_args(), cuda_options(c, true), nullptr);
    cuda::backward(*plan, dev.backward_args(), cuda_options(c, true), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<HostTensor> now = {dev.out.download(), dev.lse.download(), dev.dq.download(), dev.dk.download(),
                                   dev.dv.download()};
    if (run == 0) {
      first = std::move(now);
      continue;
    }
    const char* names[] = {"out", "lse", "dq", "dk", "dv"};
    for (size_t i = 0; i < now.size(); ++i)
      EXPECT_TRUE(check_bitwise_equal(names[i], first[i], now[i], "seed " + std::to_string(seed)));
  }
}

// Same results from two runs: bitwise, except dq of the default mode (fp32 atomics in varying order),
// which must agree within the gradient tolerance.
testing::AssertionResult same_results(const std::vector<HostTensor>& a, const std::vector<HostTensor>& b,
                                      bool deterministic, DType dtype, const std::string& context) {
  const char* names[] = {"out", "lse", "dq", "dk", "dv", "dsink"};
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].defined()) continue;
    auto ok = !deterministic && std::string(names[i]) == "dq"
                  ? check_close("dq", b[i].values(), a[i].values(), Quantity::Grad, dtype, context)
                  : check_bitwise_equal(names[i], a[i], b[i], context);
    if (!ok) return ok;
  }
  return testing::AssertionSuccess();
}

// Captures forward + backward in a CUDA graph (both backward modes), replays it, and compares with the
// eager results.
TEST(CudaBackend, GraphCaptureAndReplay) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Mask mask = random_rectangles(rng, 700, 900, 30);
  CaseConfig c = config(DType::F16, 4, 2, 64);
  c.sink_layout = SinkLayout::SH;
  CaseData d = make_case(mask, c, seed);
  DeviceCase dev(d, c);
  auto plan = test_plan(mask, c.heads_q, c.heads_kv, c.head_dim);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (bool deterministic : {true, false}) {
    const cuda::Options o = cuda_options(c, deterministic);
    const std::string context = std::string(deterministic ? "deterministic" : "default") + ", seed " +
                                std::to_string(seed);
    dev.poison();
    cuda::forward(*plan, dev.forward_args(), o, stream);
    cuda::backward(*plan, dev.backward_args(), o, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<HostTensor> eager = {dev.out.download(), dev.lse.download(), dev.dq.download(),
                                     dev.dk.download(), dev.dv.download(), dev.dsink.download()};

    cudaGraph_t graph;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    cuda::forward(*plan, dev.forward_args(), o, stream);
    cuda::backward(*plan, dev.backward_args(), o, stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int replay = 0; replay < 2; ++replay) {
      dev.poison();
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      std::vector<HostTensor> now = {dev.out.download(), dev.lse.download(), dev.dq.download(),
                                     dev.dk.download(), dev.dv.download(), dev.dsink.download()};
      EXPECT_TRUE(same_results(eager, now, deterministic, c.dtype, context));
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
}

// Through the API edge with the caller's workspace (as the Python package passes torch's memory): a stream that
// never ran the call captures forward + backward in global mode (no allocation or host sync while capturing; the
// plan made on another stream serves it), replays bitwise equal to the eager deterministic run, and a workspace
// too small or misaligned is an InvalidArgument naming it.
TEST(CudaBackend, CallerWorkspaceCapturesOnAFreshStream) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Mask mask = random_rectangles(rng, 600, 520, 20);
  CaseConfig c = config(DType::BF16, 4, 2, 128);
  c.sink_layout = SinkLayout::SSH;
  CaseData d = make_case(mask, c, seed);
  DeviceCase dev(d, c);
  AttentionOptions o;
  o.sink_layout = c.sink_layout;
  o.deterministic = true;
  magi::forward(mask, dev.forward_args(), o, nullptr);
  magi::backward(mask, dev.backward_args(), o, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto eager = dev.results();

  ForwardArgs f = dev.forward_args();
  BackwardArgs b = dev.backward_args();
  const int64_t f_bytes = workspace_bytes(f, o), b_bytes = workspace_bytes(b, o);
  ASSERT_GT(f_bytes, 0);
  ASSERT_GT(b_bytes, 0);
  void *f_ws = nullptr, *b_ws = nullptr;
  ASSERT_EQ(cudaMalloc(&f_ws, static_cast<size_t>(f_bytes)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b_ws, static_cast<size_t>(b_bytes) + 16), cudaSuccess);
  f.workspace = {f_ws, f_bytes};
  b.workspace = {b_ws, b_bytes};
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  magi::forward(mask, f, o, stream);
  magi::backward(mask, b, o, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  dev.poison();
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const auto replayed = dev.results();
  ASSERT_EQ(eager.size(), replayed.size());
  for (size_t i = 0; i < eager.size(); ++i)
    EXPECT_TRUE(check_bitwise_equal(eager[i].first, eager[i].second, replayed[i].second, "seed " + std::to_string(seed)));

  BackwardArgs small = b;
  small.workspace.bytes = b_bytes - 1;
  EXPECT_THROW(
      {
        try {
          magi::backward(mask, small, o, stream);
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find("workspace"), std::string::npos) << e.what();
          throw;
        }
      },
      InvalidArgument);
  BackwardArgs misaligned = b;
  misaligned.workspace = {static_cast<char*>(b_ws) + 4, b_bytes};
  EXPECT_THROW(magi::backward(mask, misaligned, o, stream), InvalidArgument);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(f_ws);
  cudaFree(b_ws);
}

// A persistent grid squeezed onto one SM (every block walks many tiles) must give the same results as the
// full grid, for forward and backward in both modes; profile mode must not change results either.
TEST(CudaBackend, SmMarginAndProfileModeKeepResults) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Mask mask = random_rectangles(rng, 1000, 1200, 50);
  CaseConfig c = config(DType::BF16, 4, 2, 128);
  CaseData d = make_case(mask, c, seed);
  DeviceCase dev(d, c);
  auto plan = test_plan(mask, c.heads_q, c.heads_kv, c.head_dim);
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  for (bool deterministic : {true, false}) {
    std::vector<HostTensor> reference;
    for (int margin : {0, sms - 1}) {
      cuda::Options o = cuda_options(c, deterministic);
      o.sm_margin = margin;
      o.profile = margin != 0;
      dev.poison();
      cuda::forward(*plan, dev.forward_args(), o, nullptr);
      cuda::backward(*plan, dev.backward_args(), o, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<HostTensor> now = {dev.out.download(), dev.lse.download(), dev.dq.download(),
                                     dev.dk.download(), dev.dv.download()};
      if (margin == 0) {
        reference = std::move(now);
        continue;
      }
      EXPECT_TRUE(same_results(reference, now, deterministic, c.dtype,
                               std::string(deterministic ? "deterministic" : "default") + ", seed " +
                                   std::to_string(seed)));
    }
  }
}

// 100k slices (50k two-token causal documents + 50k two-token full documents): too large for the dense
// reference, so the CPU engine (fp32 accumulation on the same rounded inputs) is the reference here.
TEST(CudaBackend, HundredThousandSlicesMatchCpuEngine) {
  const uint64_t seed = fresh_seed();
  Mask mask;
  mask.total_q = mask.total_k = 200000;
  for (int32_t doc = 0; doc < 100000; ++doc)
    mask.slices.push_back(make_slice(2 * doc, 2 * doc + 2, 2 * doc, 2 * doc + 2,
                                     doc % 2 == 0 ? MaskType::Causal : MaskType::Full));
  CaseConfig c = config(DType::F16, 2, 1, 64);
  c.backend = Backend::Cpu;
  CaseData d = make_case(mask, c, seed);
  EngineResult cpu = run_forward(d, c);
  run_backward(d, c, cpu);

  DeviceCase dev(d, c);
  auto plan = test_plan(mask, c.heads_q, c.heads_kv, c.head_dim);
  EXPECT_EQ(cuda::stats(*plan).forward_items, 100000);
  cuda::forward(*plan, dev.forward_args(), cuda_options(c), nullptr);
  cuda::backward(*plan, dev.backward_args(), cuda_options(c), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::string context = "100k slices, seed " + std::to_string(seed);
  EXPECT_TRUE(check_close("out", dev.out.download().values(), cpu.out.values(), Quantity::Out, c.dtype, context));
  EXPECT_TRUE(check_close("lse", dev.lse.download().values(), cpu.lse.values(), Quantity::Lse, c.dtype, context));
  EXPECT_TRUE(check_close("dq", dev.dq.download().values(), cpu.dq.values(), Quantity::Grad, c.dtype, context));
  EXPECT_TRUE(check_close("dk", dev.dk.download().values(), cpu.dk.values(), Quantity::Grad, c.dtype, context));
  EXPECT_TRUE(check_close("dv", dev.dv.download().values(), cpu.dv.values(), Quantity::Grad, c.dtype, context));
}

// Causal documents of 40-239 tokens over 1500 rows (the planner's 64-row forward tile case on the portable family).
Mask short_causal_documents(std::mt19937_64& rng) {
  std::vector<int32_t> cu{0};
  while (cu.back() < 1500) cu.push_back(std::min(1500, cu.back() + 40 + static_cast<int32_t>(rng() % 200)));
  return masks::varlen_causal(cu);
}

// Both forward q tiles on the same masks (the planner picks 64 rows for fragmented masks, 128 otherwise),
// with q-overlap, GQA, sink and softcap; and the planner's choice itself.
TEST(CudaBackend, ForwardTileChoicesMatchReference) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Mask rectangles = random_rectangles(rng, 900, 700, 40);
  const Mask documents = short_causal_documents(rng);
  int index = 0;
  const bool sm90 = testing_sm90();
  // The tile choices below are those of each D's own tile: a build without it (e.g. only the large tiles) runs D in
  // a larger one, whose choices differ.
  auto own_tile = [](int32_t d) {
    return cuda::head_dim_supported(d) &&
           cuda::stats(*cuda::make_plan(masks::full(64, 64), 1, 1, d, 0)).padded_head_dim == d;
  };
  // The Hopper forward: 192, 128 or 64 rows at D 64, 128 or 64 at D 128, 128 at D 256.
  auto tiles = [&](int32_t d) {
    if (!sm90) return std::vector<int32_t>{64, 128};
    std::vector<int32_t> choices;
    for (int i = 0; i < cuda::sm90::forward_tile_q_choices(d); ++i)
      choices.push_back(cuda::sm90::forward_tile_q_choice(d, i));
    return choices;
  };
  for (const Mask* mask : {&rectangles, &documents}) {
    for (int32_t d : {64, 128, 256}) {  // D 256: 8 warps x 128 x 64, or 4 warps x 64 x 32
      for (int32_t tile : tiles(d)) {
        if (!own_tile(d)) continue;
        CaseConfig c = config(index % 2 ? DType::F16 : DType::BF16, 4, 2, d);
        if (index % 3 == 0) c.sink_layout = SinkLayout::SSH;
        if (index % 4 == 1) c.softcap = 15.0;
        cuda::PlanTuning tuning;
        tuning.forward_tile_q = tile;
        EXPECT_TRUE(check_cuda_case(*mask, c, seed + index, mask == &documents ? "short documents" : "rectangles",
                                    false, tuning));
        ++index;
      }
    }
  }
  if (own_tile(128)) {
    EXPECT_EQ(cuda::stats(*test_plan(documents, 1, 1, 128)).forward_tile_q, 64) << "seed " << seed;
    EXPECT_EQ(cuda::stats(*test_plan(masks::full(1024, 1024), 1, 1, 128)).forward_tile_q, 128);
    EXPECT_EQ(cuda::stats(*test_plan(masks::causal(1024, 1024), 1, 1, 128)).forward_tile_q, 128);
  }
  if (own_tile(64)) {  // the Hopper forward's three consumers of 64 rows at D 64 where they pay, else 64-row tiles
    EXPECT_EQ(cuda::stats(*test_plan(masks::full(1536, 1536), 1, 1, 64)).forward_tile_q, sm90 ? 192 : 128);
    EXPECT_EQ(cuda::stats(*test_plan(masks::varlen_full(cu_seqlens_of({256, 256, 256, 256})), 1, 1, 64)).forward_tile_q,
              sm90 ? 64 : 128);
    // A plan without items (its rows take the sink) runs the portable forward, in a tile that family has.
    EXPECT_EQ(cuda::stats(*test_plan(Mask{{}, 1536, 300}, 1, 1, 64)).forward_tile_q, 128);
  }
  int smem_optin = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0), cudaSuccess);
  const bool large_d256_fits = smem_optin >= 128 * 1024;  // Q, K, V tiles of the 8-warp D 256 block
  if (own_tile(256))
    EXPECT_EQ(cuda::stats(*test_plan(masks::full(1024, 1024), 1, 1, 256)).forward_tile_q,
              large_d256_fits || sm90 ? 128 : 64);
  cuda::PlanTuning bad;
  bad.forward_tile_q = 96;
  EXPECT_THROW(test_plan(documents, 1, 1, cuda::head_dim_supported(128) ? 128 : 64, bad), InvalidArgument);
}

// The Hopper forward's pairs of works (sm90::forward_takes_pairs: a cluster of two blocks multicasting K / V): pairs
// of q tiles (tiles with a partner, tiles alone: each its own partner, both blocks computing it) and, where one kv
// head serves an even number of q heads, pairs of q heads; q-overlap, softcap, an SM margin, CUDA graph capture;
// judged against the reference (with the backward on that forward's out and lse), and out, lse and max_logits
// bitwise those of the same plan without pairs (the blocks' arithmetic is the same).
TEST(CudaBackend, ForwardPairsMatchReferenceAndSingleTiles) {
  if (!testing_sm90() || !cuda::head_dim_supported(128) ||
      cuda::stats(*test_plan(masks::full(64, 64), 1, 1, 128)).padded_head_dim != 128)
    GTEST_SKIP() << "no Hopper forward at tile 128 in this build or on this device";
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const std::pair<std::string, Mask> cases[] = {
      {"full 640 (two pairs of tiles and a tile alone)", masks::full(640, 640)},
      {"varlen full", masks::varlen_full(cu_seqlens_of({384, 200, 300, 500, 152}))},
      {"causal 512 (every tile alone)", masks::causal(512, 512)},
      {"rectangles", random_rectangles(rng, 900, 700, 40)},
  };
  // q heads over kv heads: 3:3 pairs q tiles, 4:2 and (with the first mask) 4:1 pair q heads.
  const std::pair<int32_t, int32_t> head_counts[] = {{3, 3}, {4, 2}, {4, 1}};
  auto forward_outputs = [](const DeviceCase& dev) {
    std::vector<std::pair<std::string, HostTensor>> r;
    for (auto& [name, t] : dev.results())
      if (name == "out" || name == "lse" || name == "max_logits") r.emplace_back(name, std::move(t));
    return r;
  };
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  int index = 0;
  for (const auto& [name, mask] : cases) {
    for (const auto& [heads_q, heads_kv] : head_counts) {
      if (heads_kv == 1 && index > 2) continue;
      CaseConfig c = config(index % 2 ? DType::F16 : DType::BF16, heads_q, heads_kv, 128);
      if (index % 3 == 1) c.softcap = 20.0;
      const std::string context = name + ", " + c.describe() + ", seed " + std::to_string(seed);
      cuda::PlanTuning pairs, singles;
      pairs.forward_pairs = 1;
      singles.forward_pairs = 0;
      pairs.forward_tile_q = singles.forward_tile_q = 128;  // (short documents would take 64-row tiles: no pairs)
      pairs.forward_aligned_tiles = singles.forward_aligned_tiles = 0;  // (pairs are taken on the global grid only)
      const auto paired = test_plan(mask, heads_q, heads_kv, 128, pairs);
      ASSERT_GT(cuda::stats(*paired).forward_pairs, 0) << context;
      EXPECT_EQ(cuda::stats(*paired).forward_pairs_of_heads, heads_q / heads_kv % 2 == 0) << context;
      EXPECT_TRUE(check_cuda_case(mask, c, seed + index, name + ", pairs", false, pairs));
      CaseData data = make_case(mask, c, seed + index);
      DeviceCase dev(data, c);
      const cuda::Options o = cuda_options(c);
      dev.poison();
      cuda::forward(*test_plan(mask, heads_q, heads_kv, 128, singles), dev.forward_args(), o, stream);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const auto single = forward_outputs(dev);
      std::vector<std::pair<std::string, std::vector<std::pair<std::string, HostTensor>>>> runs;
      dev.poison();
      cuda::forward(*paired, dev.forward_args(), o, stream);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      runs.emplace_back("pairs", forward_outputs(dev));
      cuda::Options margin = o;
      margin.sm_margin = 8;
      dev.poison();
      cuda::forward(*paired, dev.forward_args(), margin, stream);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      runs.emplace_back("pairs with an SM margin", forward_outputs(dev));
      if (index < 3) {  // replayed from a CUDA graph (global capture mode)
        cudaGraph_t graph;
        ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
        cuda::forward(*paired, dev.forward_args(), o, stream);
        ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
        cudaGraphExec_t exec;
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
        dev.poison();
        ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        runs.emplace_back("pairs from a CUDA graph", forward_outputs(dev));
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      }
      for (const auto& [how, outputs] : runs)
        for (size_t i = 0; i < single.size(); ++i)
          EXPECT_TRUE(check_bitwise_equal(single[i].first, single[i].second, outputs[i].second,
                                          how + " against single works, " + context));
      ++index;
    }
  }
  cudaStreamDestroy(stream);
  // The planner's choice (pairs of works counted): where the tiles stream long key ranges, pairs of q heads of one kv
  // head, else pairs of q tiles where at most an eighth of them would be a tile alone.
  EXPECT_EQ(cuda::stats(*test_plan(masks::full(4096, 4096), 2, 2, 128)).forward_pairs, 16 * 2);
  EXPECT_EQ(cuda::stats(*test_plan(masks::full(1024, 1024), 2, 2, 128)).forward_pairs, 0);  // 1024 keys a tile
  EXPECT_EQ(cuda::stats(*test_plan(masks::causal(4096, 4096), 2, 2, 128)).forward_pairs, 0);
  EXPECT_EQ(cuda::stats(*test_plan(masks::full(640, 4096), 2, 2, 128)).forward_pairs, 0);  // two pairs, a tile alone
  const cuda::PlanStats gqa = cuda::stats(*test_plan(masks::causal(4096, 4096), 4, 2, 128));
  EXPECT_TRUE(gqa.forward_pairs_of_heads);
  EXPECT_EQ(gqa.forward_pairs, 32 * 2);
  EXPECT_EQ(cuda::stats(*test_plan(masks::causal(1024, 1024), 4, 2, 128)).forward_pairs, 0);
  cuda::PlanTuning off, bad;
  off.forward_pairs = 0;
  EXPECT_EQ(cuda::stats(*test_plan(masks::full(4096, 4096), 2, 2, 128, off)).forward_pairs, 0);
  EXPECT_EQ(cuda::stats(*test_plan(masks::causal(4096, 4096), 4, 2, 128, off)).forward_pairs, 0);
  bad.forward_pairs = 2;
  EXPECT_THROW(test_plan(masks::full(4096, 4096), 2, 2, 128, bad), InvalidArgument);
  bad.forward_pairs = -2;
  EXPECT_THROW(test_plan(masks::full(4096, 4096), 2, 2, 128, bad), InvalidArgument);
}

// The Hopper kernels' tiles aligned to the slices (tiling::by_q_tile_aligned for the forward's q tiles,
// by_k_tile_aligned for the dk/dv kernel's k tiles): documents of any length (tiles of 64 rows or keys between them, a
// last tile past the tensor), empty rows between slices, causal slices whose first rows keep nothing, q-overlap; bf16 /
// fp16, GQA, softcap, sinks, fp32 outputs (the general epilogue), D 128 and 256; against the reference (forward and
// backward, the deterministic mode too), and an SM margin and a CUDA graph replay of the forward bitwise equal to the
// plain launch.
TEST(CudaBackend, AlignedTilesMatchReference) {
  if (!testing_sm90()) GTEST_SKIP() << "no Hopper forward on this device";
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  auto gaps = [] {  // documents with rows between them that no slice takes
    Mask m;
    m.total_q = m.total_k = 900;
    m.slices = {{{0, 150}, {0, 150}, MaskType::Causal}, {{300, 520}, {260, 520}, MaskType::Causal},
                {{600, 890}, {600, 890}, MaskType::Full}, {{700, 800}, {0, 64}, MaskType::Full}};
    return m;
  };
  const std::pair<std::string, Mask> cases[] = {
      {"varlen causal, odd lengths", masks::varlen_causal(cu_seqlens_of({100, 300, 77, 640, 190, 5, 260}))},
      {"varlen full, 64-row documents", masks::varlen_full(cu_seqlens_of({64, 192, 64, 320, 130}))},
      {"block causal", masks::varlen_block_causal(cu_seqlens_of({500, 700, 130}), 192)},
      {"gaps and q-overlap", gaps()},
      {"causal, more rows than keys", [] {
         Mask m;
         m.total_q = 1000;
         m.total_k = 700;
         m.slices = {{{0, 1000}, {0, 700}, MaskType::Causal}};
         return m;
       }()},
      {"rectangles", random_rectangles(rng, 700, 600, 30)},
      {"tiny", masks::varlen_causal(cu_seqlens_of({3, 40}))},
  };
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  int index = 0;
  for (const int32_t d : {64, 128, 256}) {  // (at D 64 the backward's tiles only)
    if (!cuda::head_dim_supported(d) || cuda::stats(*test_plan(masks::full(64, 64), 1, 1, d)).padded_head_dim != d)
      continue;
    for (const auto& [name, mask] : cases) {
      CaseConfig c = config(index % 2 ? DType::F16 : DType::BF16, index % 3 == 0 ? 4 : 2, 2, d);
      if (index % 4 == 1) c.softcap = 20.0;
      if (index % 4 == 2) c.sink_layout = SinkLayout::SH;
      if (index % 5 == 3) c.fp32_outputs = true;
      cuda::PlanTuning aligned;
      aligned.forward_aligned_tiles = aligned.backward_aligned_tiles = 1;
      aligned.forward_tile_q = 128;
      const std::string context = name + ", " + c.describe() + ", seed " + std::to_string(seed);
      const auto plan = test_plan(mask, c.heads_q, c.heads_kv, d, aligned);
      ASSERT_EQ(cuda::stats(*plan).forward_aligned_tiles, d != 64) << context;
      ASSERT_TRUE(cuda::stats(*plan).backward_aligned_tiles) << context;
      EXPECT_TRUE(check_cuda_case(mask, c, seed + index, name + ", aligned tiles", false, aligned));
      if (index % 3 == 2)
        EXPECT_TRUE(check_cuda_case(mask, c, seed + index, name + ", aligned tiles", true, aligned));
      CaseData data = make_case(mask, c, seed + index);
      DeviceCase dev(data, c);
      const cuda::Options o = cuda_options(c);
      std::vector<std::pair<std::string, std::vector<std::pair<std::string, HostTensor>>>> runs;
      auto run = [&](const std::string& how, const cuda::Options& options, bool graph) {
        dev.poison();
        if (graph) {
          cudaGraph_t g;
          ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
          cuda::forward(*plan, dev.forward_args(), options, stream);
          ASSERT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
          cudaGraphExec_t exec;
          ASSERT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
          ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
          ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
          cudaGraphExecDestroy(exec);
          cudaGraphDestroy(g);
        } else {
          cuda::forward(*plan, dev.forward_args(), options, stream);
          ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        }
        std::vector<std::pair<std::string, HostTensor>> r;
        for (auto& [what, t] : dev.results())
          if (what == "out" || what == "lse" || what == "max_logits") r.emplace_back(what, std::move(t));
        runs.emplace_back(how, std::move(r));
      };
      if (d == 64) {  // the backward's tiles: an SM margin against none
        auto backward_outputs = [&](const cuda::Options& options) {
          dev.poison();
          cuda::forward(*plan, dev.forward_args(), o, stream);
          cuda::backward(*plan, dev.backward_args(), options, stream);
          EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
          return dev.results();
        };
        cuda::Options margin = o;
        margin.sm_margin = 8;
        const auto plain = backward_outputs(o), with_margin = backward_outputs(margin);
        for (size_t j = 0; j < plain.size(); ++j)
          if (plain[j].first != "dq" && plain[j].first != "dsink")  // (their adds run in any order)
            EXPECT_TRUE(check_bitwise_equal(plain[j].first, plain[j].second, with_margin[j].second,
                                            "backward with an SM margin, " + context));
        ++index;
        continue;
      }
      run("plain", o, false);
      cuda::Options margin = o;
      margin.sm_margin = 8;
      run("an SM margin", margin, false);
      if (index < 3) run("a CUDA graph", o, true);
      for (size_t i = 1; i < runs.size(); ++i)
        for (size_t j = 0; j < runs[0].second.size(); ++j)
          EXPECT_TRUE(check_bitwise_equal(runs[0].second[j].first, runs[0].second[j].second, runs[i].second[j].second,
                                          runs[i].first + " against the plain launch, " + context));
      ++index;
    }
  }
  cudaStreamDestroy(stream);
  if (index == 0) GTEST_SKIP() << "no Hopper forward at tiles 128 or 256 in this build";
  // The planner's choice: aligned where the global grid computes clearly more cells (tiles.hpp).
  cuda::PlanTuning tile128;
  tile128.forward_tile_q = 128;
  if (cuda::head_dim_supported(128)) {
    const Mask docs = masks::varlen_causal(cu_seqlens_of({768, 576, 768, 256, 1792}));
    EXPECT_TRUE(cuda::stats(*test_plan(docs, 2, 2, 128, tile128)).forward_aligned_tiles);
    EXPECT_TRUE(cuda::stats(*test_plan(docs, 2, 2, 128)).backward_aligned_tiles);
    const cuda::PlanStats causal = cuda::stats(*test_plan(masks::causal(4096, 4096), 2, 2, 128));
    EXPECT_FALSE(causal.forward_aligned_tiles);
    EXPECT_FALSE(causal.backward_aligned_tiles);
    cuda::PlanTuning bad;
    bad.forward_aligned_tiles = 2;
    EXPECT_THROW(test_plan(masks::full(256, 256), 2, 2, 128, bad), InvalidArgument);
    bad.forward_aligned_tiles = -1;
    bad.backward_aligned_tiles = -2;
    EXPECT_THROW(test_plan(masks::full(256, 256), 2, 2, 128, bad), InvalidArgument);
  }
}

// The forward's work order in passes of q heads (work_coords): every pass size gives the reference's result, with
// q-overlap, GQA, sink and softcap. The planner takes passes for the Hopper forward over long key ranges only.
TEST(CudaBackend, ForwardPassOrdersMatchReference) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Mask rectangles = random_rectangles(rng, 900, 700, 40);
  const Mask documents = short_causal_documents(rng);
  // 400 rows without keys after the documents: whole q tiles of any height without items, which the copy kernel
  // writes while each pass of the attention kernel spans only the tiles before them.
  const Mask then_empty = [&] {
    Mask m = short_causal_documents(rng);
    m.total_q += 400;
    return m;
  }();
  int index = 0;
  for (const Mask* mask : {&rectangles, &documents, &then_empty}) {
    for (int32_t per_pass : {1, 2}) {
      for (int32_t d : {64, 128}) {
        if (!cuda::head_dim_supported(d)) continue;  // a build without tile 128 (MAGI_ATTN_CUDA_HEAD_DIMS)
        CaseConfig c = config(index % 2 ? DType::F16 : DType::BF16, 4, 2, d);
        if (index % 3 == 0) c.sink_layout = SinkLayout::SH;
        if (index % 4 == 1) c.softcap = 15.0;
        cuda::PlanTuning tuning;
        tuning.forward_heads_per_pass = per_pass;
        EXPECT_TRUE(check_cuda_case(*mask, c, seed + index,
                                    (mask == &rectangles  ? "rectangles, passes of "
                                     : mask == &documents ? "documents, passes of "
                                                          : "documents then 400 empty rows, passes of ") +
                                        std::to_string(per_pass),
                                    false, tuning));
        ++index;
      }
    }
  }
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  int32_t expected = 16;  // one pass
  if (testing_sm90())
    for (int32_t h = 1; h <= std::max(1, sms / 32); ++h)
      if (16 % h == 0) expected = h;
  // Works of 1280 keys: passes at tile 128, one pass at tile 64 (sm90/tiles.hpp: forward_pass_min_keys); a build
  // without tile 64 runs D 64 in tile 128 (MAGI_ATTN_CUDA_HEAD_DIMS), with its rule.
  const Mask long_documents = masks::varlen_full({0, 1280, 2560, 3840});
  const cuda::PlanStats d64 = cuda::stats(*test_plan(long_documents, 16, 4, 64));
  EXPECT_EQ(d64.forward_heads_per_pass, d64.padded_head_dim == 64 ? 16 : expected) << "tile " << d64.padded_head_dim;
  if (!cuda::head_dim_supported(128)) return;  // the plans below are D 128's (a build without tile 128)
  EXPECT_EQ(cuda::stats(*test_plan(masks::full(1024, 4096), 16, 4, 128)).forward_heads_per_pass, expected)
      << "seed " << seed;
  EXPECT_EQ(cuda::stats(*test_plan(documents, 16, 4, 128)).forward_heads_per_pass, 16) << "seed " << seed;
  EXPECT_EQ(cuda::stats(*test_plan(long_documents, 16, 4, 128)).forward_heads_per_pass, expected);
  cuda::PlanTuning pinned;
  pinned.forward_heads_per_pass = 8;
  EXPECT_EQ(cuda::stats(*test_plan(documents, 16, 4, 128, pinned)).forward_heads_per_pass, 8);
  for (int32_t bad : {3, -2, 32}) {
    pinned.forward_heads_per_pass = bad;
    EXPECT_THROW(test_plan(documents, 16, 4, 128, pinned), InvalidArgument) << bad;
  }
}

// Causal documents over the keys, then 150 query rows with no slice: split at a key, whole q tiles of the
// second part have no items (they only take the first part's result), and the last rows are empty in both.
Mask documents_then_empty_rows(std::mt19937_64& rng) {
  std::vector<int32_t> cu{0};
  while (cu.back() < 500) cu.push_back(cu.back() + 40 + static_cast<int32_t>(rng() % 260));
  Mask mask = masks::varlen_causal(cu);
  mask.total_q += 150;
  return mask;
}

// Without max_logits the forward's 64-key items (D 128, and D 256 in 128-row tiles) keep a row's stale maximum
// until a logit exceeds it by 2^8 in the exponent (lazy rescale; D 256 in 64-row tiles skips only unmoved maxima);
// lse, out and the backward built on that lse must not notice. Sharper logits than the default scale make the maxima jump past the slack as well as stay within it;
// also with softcap and GQA.
TEST(CudaBackend, LazyRescaleWithoutMaxLogitsMatchesReference) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  int index = 0;
  for (int32_t d : {128, 256}) {
    if (!cuda::head_dim_supported(d)) continue;
    for (double scale : {0.0, 0.35}) {
      for (bool causal : {true, false}) {
        CaseConfig c = config(index % 2 ? DType::F16 : DType::BF16, 4, index % 3 == 0 ? 1 : 4, d);
        c.max_logits = false;
        if (scale > 0.0) c.softmax_scale = scale;
        if (index % 4 == 3) c.softcap = 20.0;
        const Mask mask = causal ? masks::causal(1000, 1000) : random_rectangles(rng, 900, 1300, 40);
        EXPECT_TRUE(check_cuda_case(mask, c, seed + index, std::string(causal ? "causal" : "rectangles") +
                                                               " without max_logits, scale " + std::to_string(scale)));
        ++index;
      }
    }
  }
}

// ForwardArgs::prev_out / prev_lse on the GPU: keys in two parts, the second call merging the first's
// partial result (in place, and into a 16-bit out), against the fp64 reference of the whole mask, on random
// rectangles and on documents whose parts have item-less q tiles (the copy kernel).
TEST(CudaBackend, PartialResultMergeMatchesTheWholeMask) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  int index = 0;
  for (bool in_place : {true, false}) {
    // 384: the Hopper forward's column split; 520: the D-split forward; 1000: the Hopper forward's clusters (prev_lse
    // read by both blocks, lse written by one)
    for (int32_t d : {64, 128, 384, 520, 1000}) {
      if (!cuda::head_dim_supported(d) ||
          (family_under_test() == cuda::KernelFamily::Sm90 && !cuda::sm90_forward_available(d, 0)))
        continue;
      for (bool documents : {false, true}) {
        CaseConfig c = config(index % 2 ? DType::F16 : DType::BF16, 4, 2, d);
        c.backward = false;
        c.max_logits = false;
        if (index % 2 == 0) c.sink_layout = SinkLayout::SSH;
        const Mask mask = documents ? documents_then_empty_rows(rng) : random_rectangles(rng, 700, 600, 30);
        const int32_t at = static_cast<int32_t>(rng() % (mask.total_k + 1));
        const Mask first_keys = keys_between(mask, 0, at), second_keys = keys_between(mask, at, mask.total_k);
        CaseData data = make_case(mask, c, seed + index);
        const ReferenceForward expected = reference_forward(data.problem);
        DeviceCase dev(data, c);
        const int64_t tq = mask.total_q;
        DeviceTensor part_out(HostTensor::poisoned(DType::F32, {tq, c.heads_q, d}));
        DeviceTensor part_lse(HostTensor::poisoned(DType::F32, {tq, c.heads_q}));
        ForwardArgs first = dev.forward_args();
        first.out = part_out.view();
        first.lse = part_lse.view();
        first.max_logits = TensorView();
        forward(first_keys, first, c.options());
        ForwardArgs second = first;
        second.sink = TensorView();
        second.prev_out = part_out.view();
        second.prev_lse = part_lse.view();
        if (!in_place) {
          second.out = dev.out.view();
          second.lse = dev.lse.view();
        }
        AttentionOptions options = c.options();
        options.sink_layout = SinkLayout::None;
        forward(second_keys, second, options);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::string context = "seed " + std::to_string(seed) + ", " + c.describe() + ", keys split at " +
                                    std::to_string(at) + (in_place ? ", in place" : ", into out") +
                                    (documents ? ", documents + empty rows" : ", rectangles");
        EXPECT_TRUE(check_close("out", (in_place ? part_out : dev.out).download().values(), expected.out, Quantity::Out,
                                c.dtype, context));
        EXPECT_TRUE(check_close("lse", (in_place ? part_lse : dev.lse).download().values(), expected.lse, Quantity::Lse,
                                c.dtype, context));
        ++index;
      }
    }
  }
}

// BackwardArgs::accumulate_dq: the backward of two key parts, the second adding into the first's fp32 dq,
// gives the whole mask's dq: in both backward modes, into a 16-byte aligned dq (the fused kernel's atomics
// add in place) and into one that is only 8-byte aligned (accumulator + add pass).
TEST(CudaBackend, AccumulatedDqOfTwoKeyPartsMatchesTheWholeMask) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  int index = 0;
  // D 256 in the deterministic mode: the Hopper family's dq kernel adds into dq itself.
  const int32_t wide = cuda::head_dim_supported(256) ? 256 : 128;
  for (bool deterministic : {false, true}) {
    for (bool aligned : {true, false}) {
      const int32_t d = index % 2 ? 64 : deterministic ? wide : 128;
      CaseConfig c = config(index % 2 ? DType::F16 : DType::BF16, 4, 2, d);
      c.fp32_outputs = true;
      c.max_logits = false;
      c.deterministic = deterministic;
      const Mask mask = random_rectangles(rng, 700, 600, 30);
      const int32_t at = static_cast<int32_t>(rng() % 601);
      const Mask first_keys = keys_between(mask, 0, at), second_keys = keys_between(mask, at, mask.total_k);
      CaseData data = make_case(mask, c, seed + index);
      const ReferenceGrads expected = reference_backward(data.problem, data.dout);
      DeviceCase dev(data, c);
      forward(mask, dev.forward_args(), c.options());  // the parts' backward takes the whole out and lse
      const int64_t n = mask.total_q * c.heads_q * d;
      DeviceTensor storage(HostTensor::poisoned(DType::F32, {n + 2}));
      BackwardArgs b = dev.backward_args();
      b.dq = aligned ? dev.dq.view()
                     : TensorView(static_cast<float*>(storage.view().data) + 2, DType::F32, {mask.total_q, c.heads_q, d},
                                  storage.view().device);
      backward(first_keys, b, c.options());
      b.accumulate_dq = true;
      backward(second_keys, b, c.options());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<double> got = aligned ? dev.dq.download().values() : storage.download().values();
      if (!aligned) got.erase(got.begin(), got.begin() + 2);
      got.resize(static_cast<size_t>(n));
      const std::string context = "seed " + std::to_string(seed) + ", " + c.describe() + ", keys split at " +
                                  std::to_string(at) + (aligned ? ", aligned dq" : ", 8-byte aligned dq");
      EXPECT_TRUE(check_close("dq", got, expected.dq, Quantity::Grad, c.dtype, context));
      ++index;
    }
  }
}

// The default backward on one plan, call after call, switching between a 16-bit dq and an fp32 dq that is only
// 8-byte aligned (both through the plan's fp32 accumulator) and between the plain grid and a persistent grid on
// one SM (every block walks many tiles): documents with q-overlap, GQA, 64-row chunks without any work item
// (rows with no key: dq must be 0) and a partial last chunk; every call against fp64.
TEST(CudaBackend, DefaultBackwardReusesItsPlanCleanly) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  Mask mask = documents_then_empty_rows(rng);
  // q-overlap with the first documents, on keys of its own (slice areas must not overlap)
  mask.slices.push_back(make_slice(10, 140, mask.total_k, mask.total_k + 100, MaskType::Full));
  mask.total_k += 100;
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  int index = 0;
  for (int32_t d : {64, 128}) {
    CaseConfig c = config(d == 64 ? DType::F16 : DType::BF16, 4, 2, d);
    c.max_logits = false;
    CaseData data = make_case(mask, c, seed + index++);
    const ReferenceGrads expected = reference_backward(data.problem, data.dout);
    DeviceCase dev(data, c);
    auto plan = test_plan(mask, c.heads_q, c.heads_kv, d);
    const int64_t n = int64_t{mask.total_q} * c.heads_q * d;
    DeviceTensor storage(HostTensor::poisoned(DType::F32, {n + 2}));
    const TensorView fp32_dq(static_cast<float*>(storage.view().data) + 2, DType::F32, {mask.total_q, c.heads_q, d},
                             storage.view().device);
    const struct {
      const char* what;
      bool fp32_dq;
      int margin;
    } calls[] = {{"16-bit dq", false, 0}, {"8-byte aligned fp32 dq", true, 0}, {"16-bit dq again", false, 0},
                 {"16-bit dq, persistent grid on one SM", false, sms - 1}, {"16-bit dq, plain grid", false, 0}};
    for (const auto& call : calls) {
      dev.poison();
      cuda::forward(*plan, dev.forward_args(), cuda_options(c), nullptr);
      BackwardArgs b = dev.backward_args();
      if (call.fp32_dq) b.dq = fp32_dq;
      cuda::Options o = cuda_options(c);
      o.sm_margin = call.margin;
      cuda::backward(*plan, b, o, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<double> got = call.fp32_dq ? storage.download().values() : dev.dq.download().values();
      if (call.fp32_dq) got.erase(got.begin(), got.begin() + 2);
      const std::string context = "seed " + std::to_string(seed) + ", " + c.describe() + ", " + call.what;
      EXPECT_TRUE(check_close("dq", got, expected.dq, Quantity::Grad, c.dtype, context));
      EXPECT_TRUE(check_close("dk", dev.dk.download().values(), expected.dk, Quantity::Grad, c.dtype, context));
    }
  }
}

// The kernels read rows in 16-byte pieces and write element pairs: the API rejects inputs (and out) whose
// address is not 16-byte aligned and gradients not aligned to two elements, names the tensor, and leaves the
// outputs alone.
TEST(CudaBackend, MisalignedTensorsAreRejectedByName) {
  const uint64_t seed = fresh_seed();
  const Mask mask = masks::causal(256, 256);
  CaseConfig c = config(DType::BF16, 2, 1, 64);
  CaseData d = make_case(mask, c, seed);
  DeviceCase dev(d, c);  // each allocation has 16 spare bytes: the shifts stay inside it
  AttentionOptions options;
  options.backend = Backend::Cuda;
  auto shifted = [](TensorView t, int bytes) {
    t.data = static_cast<unsigned char*>(t.data) + bytes;
    return t;
  };
  auto expect_rejected = [](const std::function<void()>& call, const std::string& name, int alignment) {
    const std::string message = invalid_argument_message(call);
    EXPECT_NE(message.find(name + ": the cuda backend needs an address aligned to " + std::to_string(alignment) +
                           " bytes"),
              std::string::npos)
        << message;
  };
  for (const std::string name : {"q", "k", "v", "out"}) {
    ForwardArgs a = dev.forward_args();
    TensorView* t = name == "q" ? &a.q : name == "k" ? &a.k : name == "v" ? &a.v : &a.out;
    *t = shifted(*t, 8);
    expect_rejected([&] { forward(mask, a, options); }, name, 16);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (float x : dev.lse.download().values()) ASSERT_TRUE(std::isnan(x)) << "lse written by a rejected call";
  forward(mask, dev.forward_args(), options);  // aligned: accepted
  for (const std::string name : {"dout", "dq", "dk", "dv"}) {
    BackwardArgs a = dev.backward_args();
    TensorView* t = name == "dout" ? &a.dout : name == "dq" ? &a.dq : name == "dk" ? &a.dk : &a.dv;
    const bool gradient = name != "dout";
    *t = shifted(*t, gradient ? 2 : 8);  // bf16 gradients: element pairs, 4 bytes
    expect_rejected([&] { backward(mask, a, options); }, name, gradient ? 4 : 16);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (float x : dev.dk.download().values()) ASSERT_TRUE(std::isnan(x)) << "dk written by a rejected call";
}

// Gradients need only two elements' alignment. The dk/dv kernels (both modes) write whole 8-column blocks in
// 16-byte stores when dk and dv allow it and element pairs otherwise: both paths must write the same bits
// everywhere (keys past the last whole tile, head dims that leave part of the padded tile unused, fp32
// gradients).
TEST(CudaBackend, DkDvAreTheSameAtPairAlignedAddresses) {
  const uint64_t seed = fresh_seed();
  const Mask mask = masks::varlen_causal({0, 100, 300});
  for (const bool deterministic : {false, true}) {
    AttentionOptions options;
    options.backend = Backend::Cuda;
    options.deterministic = deterministic;
    for (const int32_t d : {64, 96, 256}) {
      if (!cuda::head_dim_supported(d)) continue;
      for (const bool fp32 : {false, true}) {
        CaseConfig c = config(DType::BF16, 4, 2, d);
        c.fp32_outputs = fp32;
        const CaseData data = make_case(mask, c, seed + d);
        DeviceCase dev(data, c);
        forward(mask, dev.forward_args(), options);
        backward(mask, dev.backward_args(), options);
        const HostTensor dk = dev.dk.download(), dv = dev.dv.download();
        DeviceTensor dk_buffer(HostTensor::poisoned(dk.dtype(), dk.shape()));
        DeviceTensor dv_buffer(HostTensor::poisoned(dv.dtype(), dv.shape()));
        const int shift = 2 * static_cast<int>(dtype_size(dk.dtype()));  // one element pair past 16 bytes
        auto shifted = [&](const DeviceTensor& t) {
          TensorView v = t.view();
          v.data = static_cast<unsigned char*>(v.data) + shift;
          return v;
        };
        BackwardArgs a = dev.backward_args();
        a.dk = shifted(dk_buffer);
        a.dv = shifted(dv_buffer);
        backward(mask, a, options);
        for (const auto& [name, aligned, view] :
             {std::tuple{"dk", &dk, a.dk}, std::tuple{"dv", &dv, a.dv}}) {
          HostTensor got(aligned->dtype(), aligned->shape());
          ASSERT_EQ(cudaMemcpy(got.view().data, view.data, got.bytes().size(), cudaMemcpyDeviceToHost), cudaSuccess);
          EXPECT_TRUE(std::equal(got.bytes().begin(), got.bytes().end(), aligned->bytes().begin()))
              << name << " differs between the 16-byte and the pair stores (D " << d << (fp32 ? ", fp32" : ", bf16")
              << (deterministic ? ", deterministic" : "") << ", seed " << seed << ")";
        }
      }
    }
  }
}

// MAGI_ATTENTION_AUTO_RANGE_MERGE in deterministic mode: slices merged at multiples of cuda::kTileMultiple (list
// neighbours, in order) give the same work items, so forward and backward are bitwise those of the mask as given:
// directly on two plans, and through the API toggling the variable. Outside deterministic mode any exact merge
// runs within the SPEC bounds.
struct MergeableMask {
  std::string name;
  Mask mask;
  bool always_merges;  // at multiples of cuda::kTileMultiple (the random one may happen not to)
};
std::vector<MergeableMask> mergeable_masks(std::mt19937_64& rng) {
  std::vector<MergeableMask> out;
  out.push_back({"cut rectangles 700x900", random_cut_rectangles(rng, 700, 900, 16, 4, cuda::kTileMultiple), false});
  const Mask docs = masks::varlen_causal(cu_seqlens_of({640, 200, 384}));
  Mask banded{{}, docs.total_q, docs.total_k};
  for (const Slice& s : docs.slices) row_bands(s, cuda::kTileMultiple, banded.slices);
  out.push_back({"varlen causal in row bands", banded, true});
  constexpr int32_t t = cuda::kTileMultiple;
  out.push_back({"2x2 full blocks",
                 Mask{{make_slice(0, t, 0, t, MaskType::Full), make_slice(0, t, t, 2 * t, MaskType::Full),
                       make_slice(t, 2 * t, 0, t, MaskType::Full), make_slice(t, 2 * t, t, 2 * t, MaskType::Full)},
                      2 * t, 2 * t},
                 true});
  return out;
}

TEST(CudaBackend, AutoRangeMergeKeepsDeterministicBits) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  int index = 0;
  for (const auto& [name, mask, always_merges] : mergeable_masks(rng)) {
    const Mask merged = merge_slices(mask, MergeRule{cuda::kTileMultiple});
    for (int32_t d : {64, 128, 256}) {
      if (!cuda::head_dim_supported(d)) continue;
      CaseConfig c = config(d == 64 ? DType::F16 : DType::BF16, 4, 2, d);
      if (index % 2 == 0) c.sink_layout = SinkLayout::SH;
      if (index % 3 == 0) c.softcap = 30.0;
      CaseData data = make_case(mask, c, seed + index++);
      DeviceCase dev(data, c);
      const std::string context = name + " (" + std::to_string(mask.slices.size()) + " -> " +
                                  std::to_string(merged.slices.size()) + " slices), " + c.describe() + ", seed " +
                                  std::to_string(seed);
      std::vector<std::vector<std::pair<std::string, HostTensor>>> results;
      // The global grid: its tiles divide the merge multiple (tiles aligned to the slices may not; the API plans
      // those merges without them).
      cuda::PlanTuning grid;
      grid.forward_aligned_tiles = grid.backward_aligned_tiles = 0;
      for (const Mask* m : {&mask, &merged}) {
        auto plan = test_plan(*m, c.heads_q, c.heads_kv, d, grid);
        dev.poison();
        cuda::forward(*plan, dev.forward_args(), cuda_options(c, true), nullptr);
        cuda::backward(*plan, dev.backward_args(), cuda_options(c, true), nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        results.push_back(dev.results());
      }
      for (size_t i = 0; i < results[0].size(); ++i)
        EXPECT_TRUE(check_bitwise_equal(results[0][i].first, results[0][i].second, results[1][i].second, context));

      // The API with the variable off, then on: the same bits.
      AttentionOptions options = c.options();
      options.backend = Backend::Cuda;
      options.deterministic = true;
      std::vector<std::vector<std::pair<std::string, HostTensor>>> api;
      for (const char* on : {"0", "1"}) {
        setenv("MAGI_ATTENTION_AUTO_RANGE_MERGE", on, 1);
        env::reset_for_testing();
        dev.poison();
        magi::forward(mask, dev.forward_args(), options);
        magi::backward(mask, dev.backward_args(), options);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        api.push_back(dev.results());
      }
      unsetenv("MAGI_ATTENTION_AUTO_RANGE_MERGE");
      env::reset_for_testing();
      for (size_t i = 0; i < api[0].size(); ++i)
        EXPECT_TRUE(check_bitwise_equal(api[0][i].first, api[0][i].second, api[1][i].second, context + ", API"));
    }
    if (always_merges) EXPECT_LT(merged.slices.size(), mask.slices.size()) << name;
  }
}

TEST(CudaBackend, AutoRangeMergedMasksMatchReference) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  std::vector<MergeableMask> all = mergeable_masks(rng);
  all.push_back({"cut rectangles 500x600, anywhere", random_cut_rectangles(rng, 500, 600, 12, 4, 1), false});
  int index = 0;
  for (const auto& [name, mask, always_merges] : all) {
    const CaseConfig c = index % 2 == 0 ? config(DType::BF16, 4, 2, 128) : config(DType::F16, 2, 1, 64);
    EXPECT_TRUE(check_cuda_case(merge_slices(mask), c, seed + index++, name + ", merged"));
  }
}

// Large head dims (tiles above 256: the D-split forward; in the Hopper family's run the Hopper forward up to 512 and
// at 576 / 768 / 1024 in clusters of two blocks (520: in the 576 tile, two 320-column blocks of 128 rows), 776 with
// the second block's last consumer on 8 real columns; 456 in the 512 tile, whose consumers take the items in turn),
// every mask kind and feature against the fp64 reference;
// parametrised over D x dtype x case, skipped only where this build lacks the tile (MAGI_ATTN_CUDA_HEAD_DIMS).
// Forward and backward through the API (the backward from the kernel's own out and lse).
struct LargeDimCase {
  std::string name;
  int32_t hq = 2, hkv = 2;
  SinkLayout sink = SinkLayout::None;
  double softcap = 0.0;
  bool fp32_outputs = false;
  int sm_margin = 0;  // > 0: the persistent grid
};
Mask large_dim_mask(const std::string& name, std::mt19937_64& rng) {
  if (name.rfind("full", 0) == 0) return masks::full(384, 448);
  if (name.rfind("causal", 0) == 0) return masks::causal(512, 512);
  if (name.rfind("varlen", 0) == 0) return masks::varlen_causal(std::vector<int32_t>{0, 100, 356, 420, 700});
  return random_rectangles(rng, 512, 640, 30);  // random slices of all types, q-overlap, uncovered rows
}
class LargeHeadDim : public testing::TestWithParam<std::tuple<int32_t, DType, LargeDimCase>> {};
TEST_P(LargeHeadDim, MatchReference) {
  const auto [d, dtype, lc] = GetParam();
  if (!cuda::head_dim_supported(d)) GTEST_SKIP() << "head dim " << d << " is not in this build's tiles";
  if (family_under_test() == cuda::KernelFamily::Sm90 && !cuda::sm90_forward_available(d, 0))
    GTEST_SKIP() << "the Hopper forward has no tile for D " << d;
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  CaseConfig c = config(dtype, lc.hq, lc.hkv, d);
  c.sink_layout = lc.sink;
  c.softcap = lc.softcap;
  c.fp32_outputs = lc.fp32_outputs;
  const Mask mask = large_dim_mask(lc.name, rng);
  if (lc.sm_margin == 0) {
    EXPECT_TRUE(check_cuda_case(mask, c, seed + 1, lc.name));
    return;
  }
  // The persistent grid gives the plain grid's bits.
  CaseData data = make_case(mask, c, seed + 1);
  DeviceCase dev(data, c);
  auto plan = test_plan(mask, c.heads_q, c.heads_kv, d);
  std::vector<HostTensor> results[2];
  for (int margin : {0, lc.sm_margin}) {
    cuda::Options o = cuda_options(c);
    o.sm_margin = margin;
    dev.poison();
    cuda::forward(*plan, dev.forward_args(), o, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    results[margin != 0] = {dev.out.download(), dev.lse.download()};
  }
  EXPECT_TRUE(same_results(results[0], results[1], true, c.dtype, "sm margin, seed " + std::to_string(seed)));
  EXPECT_TRUE(check_cuda_case(mask, c, seed + 1, lc.name));
}
INSTANTIATE_TEST_SUITE_P(
    Dims, LargeHeadDim,
    testing::Combine(testing::Values(264, 320, 376, 456, 512, 520, 768, 776, 1024), testing::Values(DType::BF16, DType::F16),
                     testing::Values(LargeDimCase{"full"}, LargeDimCase{"causal"}, LargeDimCase{"varlen_causal"},
                                     LargeDimCase{"random_slices", 4, 2},
                                     LargeDimCase{"random_slices_sink_sh", 2, 1, SinkLayout::SH},
                                     LargeDimCase{"causal_sink_ssh_fp32_out", 2, 2, SinkLayout::SSH, 0.0, true},
                                     LargeDimCase{"random_slices_softcap", 2, 2, SinkLayout::None, 20.0},
                                     LargeDimCase{"varlen_mqa_persistent", 4, 1, SinkLayout::None, 0.0, false, 2})),
    [](const auto& info) {
      return "d" + std::to_string(std::get<0>(info.param)) +
             (std::get<1>(info.param) == DType::BF16 ? "_bf16_" : "_fp16_") + std::get<2>(info.param).name;
    });

// Head dims above 256: the backward kernels alone (the portable D-split ones; on sm_90 the Hopper clusters of two to
// four blocks) against the fp64 reference (out and lse from the reference). Full / causal / varlen causal / random
// slices of every type with q-overlap, empty rows, GQA and MQA, sinks (sh, ssh) and softcap, fp32 gradients, the
// persistent grids (SM margin), and the deterministic mode bitwise over two runs; D 264, 520, 760 and 776 run padded
// in the next larger tile (on sm_90 at 776 the last of the 1024 tile's four blocks holds 8 columns of D).
struct LargeDimBackwardCase {
  std::string name;
  int32_t d;
  DType dtype;
  int32_t hq, hkv;
  int mask;  // 0 full, 1 causal, 2 varlen causal, 3 random slices (all types, q-overlap), 4 mixed types q-overlap,
             // 5 bi-causal with Sq > Sk (empty rows)
  SinkLayout sink = SinkLayout::None;
  double softcap = 0.0;
  bool fp32_outputs = false;
  bool deterministic = false;
  int sm_margin = 0;
};

std::vector<LargeDimBackwardCase> large_dim_backward_cases() {
  std::vector<LargeDimBackwardCase> cases;
  for (int32_t d : {264, 320, 384, 512, 520, 760, 776, 1024}) {
    const std::string dim = "d" + std::to_string(d) + "_";
    cases.push_back({dim + "full_bf16_gqa", d, DType::BF16, 4, 2, 0});
    cases.push_back({dim + "causal_fp16_softcap", d, DType::F16, 2, 1, 1, SinkLayout::None, 20.0});
    cases.push_back({dim + "varlen_causal_bf16_ssh_sink", d, DType::BF16, 2, 2, 2, SinkLayout::SSH});
    cases.push_back({dim + "random_fp16_mqa_sh_sink_persistent", d, DType::F16, 4, 1, 3, SinkLayout::SH, 0.0, false,
                     false, 8});
    cases.push_back({dim + "random_bf16_fp32_grads_deterministic", d, DType::BF16, 2, 1, 3, SinkLayout::None, 0.0,
                     true, true});
    cases.push_back({dim + "mixed_types_fp16_deterministic_persistent", d, DType::F16, 4, 2, 4, SinkLayout::None, 5.0,
                     false, true, 4});
    cases.push_back({dim + "bi_causal_empty_rows_bf16", d, DType::BF16, 2, 1, 5});
  }
  return cases;
}

class LargeHeadDimBackward : public testing::TestWithParam<LargeDimBackwardCase> {};

TEST_P(LargeHeadDimBackward, MatchesReference) {
  const LargeDimBackwardCase& lc = GetParam();
  if (!cuda::head_dim_supported(lc.d)) GTEST_SKIP() << "this build has no head-dim tile for " << lc.d;
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const int32_t tokens = lc.d <= 520 ? 384 : 256;  // the fp64 reference's time
  Mask mask;
  switch (lc.mask) {
    case 0: mask = masks::full(tokens, tokens); break;
    case 1: mask = masks::causal(tokens, tokens); break;
    case 2: mask = masks::varlen_causal(std::vector<int32_t>{0, 37, 200, tokens - 40, tokens}); break;
    case 3: mask = random_rectangles(rng, tokens, tokens + 64, 24); break;
    case 4: mask = cases::mixed_types_q_overlap(); break;
    default: mask = cases::causal_sq_gt_sk(MaskType::BiCausal); break;
  }
  CaseConfig c = config(lc.dtype, lc.hq, lc.hkv, lc.d);
  c.sink_layout = lc.sink;
  c.sink_len = 3;
  c.softcap = lc.softcap;
  c.fp32_outputs = lc.fp32_outputs;
  EXPECT_TRUE(check_cuda_backward_case(mask, c, seed + 1, lc.name, lc.deterministic, lc.deterministic ? 2 : 1,
                                       lc.sm_margin));
}
INSTANTIATE_TEST_SUITE_P(Dims, LargeHeadDimBackward, testing::ValuesIn(large_dim_backward_cases()),
                         [](const auto& info) { return info.param.name; });

// The D-split dk/dv kernel's variants (one or two blocks per SM) sum every cell in the same order: dK, dV (and dQ
// in deterministic mode) bitwise equal, in the plain and the persistent grid; a variant that does not fit the tile
// is refused.
TEST(CudaBackend, LargeHeadDimBackwardVariantsAgree) {
  if (!cuda::head_dim_supported(320)) GTEST_SKIP() << "this build has no head-dim tile for 320";
  if (family_under_test() == cuda::KernelFamily::Sm90) GTEST_SKIP() << "the portable family's run covers these";
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Mask mask = random_rectangles(rng, 384, 448, 24);
  CaseConfig c = config(DType::BF16, 4, 2, 320);
  CaseData d = make_case(mask, c, seed);
  DeviceCase dev(d, c);
  cuda::PlanTuning paired;
  paired.backward_variant = 1;  // kLargeBwdPaired
  std::shared_ptr<cuda::Plan> paired_plan;
  try {
    paired_plan = test_plan(mask, c.heads_q, c.heads_kv, c.head_dim, paired);
  } catch (const InvalidArgument&) {
    GTEST_SKIP() << "two D 320 backward blocks do not fit this device's shared memory";
  }
  EXPECT_EQ(cuda::stats(*paired_plan).backward_variant, 1);
  cuda::PlanTuning single;
  single.backward_variant = 0;
  auto single_plan = test_plan(mask, c.heads_q, c.heads_kv, c.head_dim, single);
  EXPECT_EQ(cuda::stats(*single_plan).backward_variant, 0);
  if (cuda::head_dim_supported(512))
    EXPECT_THROW(test_plan(mask, c.heads_q, c.heads_kv, 512, paired), InvalidArgument);
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  for (bool deterministic : {true, false}) {
    for (int margin : {0, sms - 2}) {
      cuda::Options o = cuda_options(c, deterministic);
      o.sm_margin = margin;
      std::vector<HostTensor> results[2];
      for (int v = 0; v < 2; ++v) {
        dev.poison();
        cuda::forward(*single_plan, dev.forward_args(), o, nullptr);
        cuda::backward(v == 0 ? *single_plan : *paired_plan, dev.backward_args(), o, nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        results[v] = {dev.out.download(), dev.lse.download(), dev.dq.download(), dev.dk.download(), dev.dv.download()};
      }
      EXPECT_TRUE(same_results(results[0], results[1], deterministic, c.dtype,
                               std::string(deterministic ? "deterministic" : "default") + ", margin " +
                                   std::to_string(margin) + ", seed " + std::to_string(seed)));
    }
  }
}

// MAGI_ATTENTION_CATGQA (PlanTuning::backward_cat_gqa): the Hopper backward up to D 128 runs the q heads of a kv
// head as concatenated rows where their number divides 64; elsewhere the plan takes no groups. Short documents, a
// causal diagonal, q-overlap and empty rows put masked rows inside every chunk; every group size from 2 to 64.
TEST(CudaBackend, ConcatenatedHeadsMatchReference) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  cuda::PlanTuning cat;
  cat.backward_cat_gqa = true;
  const bool hopper = testing_sm90();
  auto expected_group = [&](int32_t hq, int32_t hkv, int32_t d, int32_t padded_d) {
    const int32_t g = hq / hkv;
    return hopper && cuda::sm90_backward_available(d, 0) && padded_d <= 128 && g > 1 && 64 % g == 0 ? g : 1;
  };
  std::vector<Slice> docs;
  const std::vector<int32_t> cu = cu_seqlens_of({3, 70, 1, 29, 130, 17, 64, 9});
  for (size_t i = 0; i + 1 < cu.size(); ++i)
    docs.push_back(make_slice(cu[i], cu[i + 1], cu[i], cu[i + 1], MaskType::Causal));
  Mask varlen_causal;
  varlen_causal.slices = docs;
  varlen_causal.total_q = varlen_causal.total_k = cu.back();
  struct Case {
    std::string name;
    Mask mask;
    DType dtype;
    int32_t hq, hkv, d;
    SinkLayout sink = SinkLayout::None;
    double softcap = 0.0;
    bool fp32 = false;
  };
  const std::vector<Case> all = {
      {"varlen causal 2:1", varlen_causal, DType::BF16, 4, 2, 128},
      {"varlen causal 4:1 d64", varlen_causal, DType::F16, 8, 2, 64},
      {"q-overlap 8:1", cases::mixed_types_q_overlap(), DType::BF16, 8, 1, 128},
      {"random 16:1 d96 softcap", random_rectangles(rng, 300, 380, 20), DType::BF16, 32, 2, 96, SinkLayout::None, 20.0},
      {"empty rows 4:1 sh sink", cases::causal_sq_gt_sk(MaskType::BiCausal), DType::F16, 4, 1, 64, SinkLayout::SH},
      {"block causal 2:1 ssh fp32", cases::varlen_block_causal(), DType::BF16, 2, 1, 40, SinkLayout::SSH, 0.0, true},
      {"varlen causal 64:1", varlen_causal, DType::BF16, 64, 1, 64},
      {"sliding window 32:1", masks::sliding_window(200, 37, 0), DType::F16, 32, 1, 128},
      {"3:1 (no groups)", varlen_causal, DType::BF16, 6, 2, 64},
  };
  int index = 0;
  for (const Case& k : all) {
    if (!cuda::head_dim_supported(k.d)) continue;  // a build without the tile (e.g. 64 only)
    CaseConfig c = config(k.dtype, k.hq, k.hkv, k.d);
    c.sink_layout = k.sink;
    c.sink_len = 2;
    c.softcap = k.softcap;
    c.fp32_outputs = k.fp32;
    const cuda::PlanStats stats = cuda::stats(*test_plan(k.mask, k.hq, k.hkv, k.d, cat));
    EXPECT_EQ(stats.backward_cat_group, expected_group(k.hq, k.hkv, k.d, stats.padded_head_dim)) << k.name;
    for (bool deterministic : {false, true})
      EXPECT_TRUE(check_cuda_case(k.mask, c, seed + index, "concatenated heads, " + k.name, deterministic, cat));
    ++index;
  }
  // The planner keeps the plain walk where concatenation would push the first wave out of L2 (a 1024 window over 2 x 8k
  // tokens, group 4, on the H100 / H200's 50 MB), and concatenates causal documents.
  int l2 = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0), cudaSuccess);
  const std::vector<int32_t> two_docs = {0, 8192, 16384};
  if (!cuda::head_dim_supported(128)) return;  // (the rest plans D 128 and D 96)
  const cuda::PlanStats window =
      cuda::stats(*test_plan(masks::varlen_sliding_window(two_docs, 1024, 0), 16, 4, 128, cat));
  if (hopper && cuda::sm90_backward_available(128, 0) && window.padded_head_dim == 128 && l2 >= (40 << 20) &&
      l2 <= (60 << 20)) {
    EXPECT_EQ(window.backward_cat_group, 1);
    EXPECT_EQ(cuda::stats(*test_plan(masks::varlen_causal(two_docs), 16, 4, 128, cat)).backward_cat_group, 4);
  }
  // Deterministic mode with concatenated heads: bitwise the same over runs.
  const Case& k = all[3];
  CaseConfig c = config(k.dtype, k.hq, k.hkv, k.d);
  CaseData d = make_case(k.mask, c, seed + 100);
  DeviceCase dev(d, c);
  auto plan = test_plan(k.mask, c.heads_q, c.heads_kv, c.head_dim, cat);
  std::vector<HostTensor> first;
  for (int run = 0; run < 2; ++run) {
    dev.poison();
    cuda::forward(*plan, dev.forward_args(), cuda_options(c, true), nullptr);
    cuda::backward(*plan, dev.backward_args(), cuda_options(c, true), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<HostTensor> now = {dev.dq.download(), dev.dk.download(), dev.dv.download()};
    if (run == 0) {
      first = std::move(now);
      continue;
    }
    const char* names[] = {"dq", "dk", "dv"};
    for (size_t i = 0; i < now.size(); ++i)
      EXPECT_TRUE(check_bitwise_equal(names[i], first[i], now[i], "seed " + std::to_string(seed)));
  }
}

// ---- Random valid calls through the public C++ API (magi::forward / backward on device tensors) ----
// Every draw is a call the SPEC allows: any grid from one token, masks from random slices, cut slices (exact
// merges), documents, windows and the other builders, GQA / MQA, every head dim the build runs (multiples of 8),
// sink, softcap, scale, fp32 / mixed outputs, deterministic mode, a caller workspace, a fresh stream,
// accumulate_dq. Judged by SPEC section 5; structural zeros must be exactly zero and inputs untouched.
struct ApiCall {
  std::string name;
  Mask mask;
  CaseConfig config;
  bool caller_workspace = false, own_stream = false, accumulate_dq = false;
};

ApiCall random_api_call(std::mt19937_64& rng) {
  auto uniform = [&](int32_t lo, int32_t hi) { return std::uniform_int_distribution<int32_t>(lo, hi)(rng); };
  const int32_t heads[][2] = {{1, 1}, {2, 1}, {2, 2}, {4, 2}, {3, 3}, {6, 2}, {8, 1}, {5, 5}};
  const auto& h = heads[uniform(0, 7)];
  const bool large = cuda::head_dim_supported(320) && uniform(0, 4) == 0;
  int32_t d = 64;
  for (int draw = 0; draw < 64; ++draw) {
    const int32_t candidate = large ? 8 * uniform(33, 128) : 8 * uniform(1, 32);
    if (cuda::head_dim_supported(candidate)) {
      d = candidate;
      break;
    }
  }
  ApiCall call;
  CaseConfig& c = call.config;
  c = config(uniform(0, 1) ? DType::BF16 : DType::F16, h[0], h[1], d);
  // The fp64 reference's cost bounds the grid: about 3e8 (cell, head, column) products.
  const int64_t budget = 300'000'000 / (int64_t{h[0]} * d);
  const int32_t side = static_cast<int32_t>(std::min<int64_t>(1500, std::sqrt(static_cast<double>(budget))));
  RandomMask drawn = random_mask(rng, uniform(1, side), uniform(1, side));
  call.mask = std::move(drawn.mask);
  c.softcap = uniform(0, 3) == 0 ? 0.5 + uniform(0, 60) / 2.0 : 0.0;
  if (uniform(0, 2) == 0) {
    c.sink_layout = uniform(0, 1) ? SinkLayout::SH : SinkLayout::SSH;
    c.sink_len = uniform(1, 8);
    c.sink_mean = uniform(-3, 4);
    c.sink_neg_inf = uniform(0, 5) == 0;
  }
  const int32_t outputs = uniform(0, 7);
  c.fp32_outputs = outputs < 2;
  c.mixed_buffers = outputs == 2;
  if (uniform(0, 4) == 0) c.softmax_scale = uniform(1, 40) / 100.0;
  c.max_logits = uniform(0, 1) == 1;
  if (uniform(0, 2) == 0) c.deterministic = uniform(0, 1) == 1;
  call.caller_workspace = uniform(0, 3) == 0;
  call.own_stream = uniform(0, 3) == 0;
  call.accumulate_dq = c.dq_dtype() == DType::F32 && uniform(0, 2) == 0;
  call.name = drawn.kind + "_" + std::to_string(call.mask.total_q) + "x" + std::to_string(call.mask.total_k) + "_n" +
              std::to_string(call.mask.slices.size()) + (call.caller_workspace ? "_workspace" : "") +
              (call.own_stream ? "_stream" : "") + (call.accumulate_dq ? "_accumulate" : "");
  return call;
}

// A caller-owned device buffer for args.workspace.
struct DeviceBytes {
  void* data = nullptr;
  explicit DeviceBytes(int64_t bytes) {
    if (bytes > 0) MAGI_CUDA_CHECK(cudaMalloc(&data, static_cast<size_t>(bytes)));
  }
  ~DeviceBytes() { cudaFree(data); }
};

testing::AssertionResult check_api_call(const ApiCall& call, uint64_t seed) {
  const CaseConfig& c = call.config;
  std::ostringstream context_stream;
  context_stream << "case " << call.name << ", " << c.describe() << ", deterministic "
                 << (c.deterministic ? (*c.deterministic ? "on" : "off") : "default") << ", seed " << seed;
  const std::string context = context_stream.str();
  auto failed = [&](const char* what) { return testing::AssertionFailure() << what << " [" << context << "]"; };
  try {
    CaseData d = make_case(call.mask, c, seed);
    DeviceCase dev(d, c);
    const AttentionOptions o = c.options();
    cudaStream_t stream = nullptr;
    if (call.own_stream) MAGI_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    struct StreamGuard {
      cudaStream_t s;
      ~StreamGuard() {
        if (s) cudaStreamDestroy(s);
      }
    } guard{stream};

    ForwardArgs fa = dev.forward_args();
    DeviceBytes fwd_space(call.caller_workspace ? workspace_bytes(fa, o) : 0);
    if (call.caller_workspace) fa.workspace = {fwd_space.data, workspace_bytes(fa, o)};
    forward(call.mask, fa, o, stream);
    MAGI_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (auto ok = judge_forward(d, c, dev.download(), context); !ok) return ok;

    // accumulate_dq: dq starts from values exact in fp32 (multiples of 2^-10 in [-1, 1]), taken off after.
    std::vector<double> dq0;
    if (call.accumulate_dq) {
      std::mt19937_64 rng(seed + 7);
      dq0.resize(d.q.values().size());
      for (double& x : dq0) x = std::uniform_int_distribution<int32_t>(-1024, 1024)(rng) / 1024.0;
      dev.dq.upload(HostTensor::from_values(dq0, DType::F32, d.q.shape()));
    }
    BackwardArgs ba = dev.backward_args();
    ba.accumulate_dq = call.accumulate_dq;
    DeviceBytes bwd_space(call.caller_workspace ? workspace_bytes(ba, o) : 0);
    if (call.caller_workspace) ba.workspace = {bwd_space.data, workspace_bytes(ba, o)};
    backward(call.mask, ba, o, stream);
    MAGI_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (auto ok = judge_backward(d, c, dev.download(), context, dq0); !ok) return ok;
    const std::pair<const DeviceTensor*, const HostTensor*> inputs[] = {
        {&dev.q, &d.q}, {&dev.k, &d.k}, {&dev.v, &d.v}, {&dev.sink, &d.sink}, {&dev.dout, &d.dout_tensor}};
    for (const auto& [now, before] : inputs)
      if (before->defined() && now->download().bytes() != before->bytes()) return failed("an input was modified");

    // The deterministic mode's promise: the same gradients, bit for bit, on a second run (dq poisoned first).
    if (c.deterministic.value_or(false) && !call.accumulate_dq) {
      const auto first = dev.results();
      dev.dq.upload(HostTensor::poisoned(c.dq_dtype(), d.q.shape()));
      backward(call.mask, ba, o, stream);
      MAGI_CUDA_CHECK(cudaStreamSynchronize(stream));
      const auto again = dev.results();
      for (size_t i = 0; i < first.size(); ++i)
        if (auto ok = check_bitwise_equal(first[i].first, first[i].second, again[i].second, context); !ok) return ok;
    }
    return testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "threw: " << e.what() << " [" << context << "]";
  }
}

// Twelve random calls a run (fresh seeds: `--gtest_repeat=N` draws N x 12 more).
TEST(CudaFuzz, RandomCallsThroughTheApiMatchReference) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 12; ++i) {
    const ApiCall call = random_api_call(rng);
    const testing::AssertionResult ok = check_api_call(call, seed + 1000 * (i + 1));
    EXPECT_TRUE(ok) << (call.mask.slices.size() <= 40 ? "\nmask: " + mask_to_json(call.mask) : std::string());
  }
}

TEST(CudaBackend, PlanRejectsUncompiledHeadDim) {
  EXPECT_FALSE(cuda::head_dim_supported(0));
  EXPECT_FALSE(cuda::head_dim_supported(12));
  EXPECT_FALSE(cuda::head_dim_supported(1032));
  EXPECT_FALSE(cuda::head_dim_supported(260));
  EXPECT_THROW(test_plan(cases::full(64), 1, 1, 1032), NotAvailable);
  // Head dims above 256 exist where the build has a larger tile (MAGI_ATTN_CUDA_HEAD_DIMS: 320 and up, large, all);
  // 320 is the smallest such tile, so it runs wherever any of them is built.
  const bool large_built = cuda::head_dim_supported(320);
  EXPECT_EQ(cuda::head_dim_supported(264), large_built);
  if (!large_built) EXPECT_THROW(test_plan(cases::full(64), 1, 1, 264), NotAvailable);
  else EXPECT_GT(cuda::stats(*cuda::make_plan(cases::full(64), 1, 1, 264, 0)).padded_head_dim, 256);
}

// The family a plan runs is the one asked for (the suite runs once per family), and Auto picks the Hopper forward
// exactly where it can run.
TEST(CudaBackend, PlansRunTheFamilyAskedFor) {
  const Mask mask = masks::causal(1024, 1024);
  const int32_t d0 = cuda::head_dim_supported(128) ? 128 : 64;  // a build may lack tile 128
  const cuda::PlanStats s = cuda::stats(*test_plan(mask, 2, 1, d0));
  EXPECT_EQ(s.forward_family, testing_sm90() ? cuda::KernelFamily::Sm90 : cuda::KernelFamily::Sm80);
  if (s.padded_head_dim == 128) EXPECT_EQ(s.forward_tile_k, testing_sm90() ? 128 : 64);
  // The backward follows the family at every head-dim tile.
  EXPECT_EQ(s.backward_family, testing_sm90() ? cuda::KernelFamily::Sm90 : cuda::KernelFamily::Sm80);
  EXPECT_EQ(cuda::stats(*test_plan(mask, 2, 1, 64)).backward_family, s.backward_family);
  // (A build without some tile runs that head dim padded in a larger one: only the exact tiles are checked.)
  if (cuda::head_dim_supported(256)) {
    const cuda::PlanStats d256 = cuda::stats(*test_plan(mask, 2, 1, 256));
    if (d256.padded_head_dim == 256) EXPECT_EQ(d256.backward_family, s.backward_family);
  }
  if (cuda::head_dim_supported(320)) {
    const cuda::PlanStats d320 = cuda::stats(*test_plan(mask, 2, 1, 320));
    EXPECT_EQ(d320.backward_family, s.backward_family);
    // A backward_variant asks for the portable D-split backward.
    cuda::PlanTuning variant;
    variant.backward_variant = 0;
    EXPECT_EQ(cuda::stats(*cuda::make_plan(mask, 2, 1, 320, 0, variant)).backward_family, cuda::KernelFamily::Sm80);
    if (cuda::sm90_backward_available(320, 0)) {
      variant.backward_family = cuda::KernelFamily::Sm90;
      EXPECT_THROW(cuda::make_plan(mask, 2, 1, 320, 0, variant), InvalidArgument);
    }
  }
  if (cuda::head_dim_supported(1024))
    EXPECT_EQ(cuda::stats(*test_plan(mask, 2, 1, 1024)).backward_family, s.backward_family);
  // The Hopper forward at tile 512 (64-row tiles above 320); a forward_variant asks for the portable one.
  if (cuda::head_dim_supported(512) && cuda::stats(*test_plan(mask, 2, 1, 512)).padded_head_dim == 512) {
    const cuda::PlanStats large = cuda::stats(*test_plan(mask, 2, 1, 512));
    EXPECT_EQ(large.forward_family, s.forward_family);
    EXPECT_EQ(large.forward_tile_q, 64);
    if (testing_sm90()) {
      cuda::PlanTuning variant;
      variant.forward_variant = 0;
      EXPECT_EQ(cuda::stats(*cuda::make_plan(mask, 2, 1, 512, 0, variant)).forward_family, cuda::KernelFamily::Sm80);
      variant.forward_family = cuda::KernelFamily::Sm90;
      EXPECT_THROW(cuda::make_plan(mask, 2, 1, 512, 0, variant), InvalidArgument);
    }
  }
  // Tiles 576 / 768 / 1024: the Hopper forward in clusters of two blocks, where it is available.
  for (int32_t d : {576, 1024}) {
    if (!cuda::head_dim_supported(d)) continue;
    EXPECT_EQ(cuda::stats(*cuda::make_plan(mask, 2, 1, d, 0)).forward_family,
              cuda::sm90_forward_available(d, 0) ? cuda::KernelFamily::Sm90 : cuda::KernelFamily::Sm80);
    EXPECT_EQ(cuda::stats(*test_plan(mask, 2, 1, d)).forward_family, s.forward_family);
  }
  if (!cuda::head_dim_supported(128)) return;  // (the rest plans D 128)
  cuda::PlanTuning portable_bwd;
  portable_bwd.backward_family = cuda::KernelFamily::Sm80;
  EXPECT_EQ(cuda::stats(*test_plan(mask, 2, 1, 128, portable_bwd)).backward_family, cuda::KernelFamily::Sm80);
  const bool available = cuda::sm90_forward_available(128, 0);
  EXPECT_EQ(cuda::stats(*cuda::make_plan(mask, 2, 1, 128, 0)).forward_family,
            available ? cuda::KernelFamily::Sm90 : cuda::KernelFamily::Sm80);
  cuda::PlanTuning forced;
  forced.forward_family = cuda::KernelFamily::Sm90;
  if (available) {
    EXPECT_EQ(cuda::stats(*cuda::make_plan(mask, 2, 1, 128, 0, forced)).forward_family, cuda::KernelFamily::Sm90);
    // The Hopper forward's row tiles at D 128 are 64 and 128 (a build without tile 128 pads to 256: 128); 192 is
    // D 64's alone.
    forced.forward_tile_q = 192;
    EXPECT_THROW(cuda::make_plan(mask, 2, 1, 128, 0, forced), InvalidArgument);
  } else {
    EXPECT_THROW(cuda::make_plan(mask, 2, 1, 128, 0, forced), NotAvailable);
  }
}

}  // namespace
}  // namespace magi::test
