// Throughput of the CUDA backend (SPEC section 6): TFLOP/s of forward and backward, CUDA events between
// back-to-back calls, median of `reps` calls after warm-up (time_ms). Prints CSV rows and writes the masks it used
// (document lengths etc.) as JSON so that scripts/bench_peers.py measures the peers on the same masks.
//
// usage: flash_bench [--cases out.json] [--reps N] [--warm-ms MS] [--quick] [--only MASK[,MASK]]
//                    [--dims 64,128,256] [--seq 8192] [--batch 2] [--deterministic] [--sm-margin N] [--impl NAME]
//                    [--fwd-tile-q 64|128|192] [--family auto|sm80|sm90] [--bwd-family auto|sm80|sm90] [--large-d] [--fwd-variant 0|1|2|3]
//                    [--bwd-variant 0|1] [--forward-only] [--fwd-heads-per-pass N] [--heads N] [--kv-heads N]
//                    [--cat-gqa] [--stages] [--fwd-pairs -1|0|1] [--fwd-aligned -1|0|1]
//                    [--bwd-aligned -1|0|1]
//   --fwd-pairs: the Hopper forward's pairs of q tiles on clusters (PlanTuning::forward_pairs; default -1, the plan's).
//   --fwd-aligned / --bwd-aligned: the Hopper forward's q tiles / dk/dv kernel's k tiles aligned to the slices
//   (PlanTuning::forward_aligned_tiles / backward_aligned_tiles; default -1, the plan's).
//   --family pins both kernels' family, --bwd-family (given after it) the backward's alone.
//   --warm-ms: back-to-back calls before each measurement (default 300 ms; 0: three calls), so that the clocks
//   have settled under the power cap (see time_ms).
//   --batch sequences of --seq tokens (bf16); --quick = D 128 only. The backward runs in the default
//   mode (dq by atomics); --deterministic also times the deterministic backward (rows `magi_det`); --forward-only
//   times no backward (its columns print 0).
//   --sm-margin N: persistent grids leaving N SMs free (the API's default is 4 when
//   CUDA_DEVICE_MAX_CONNECTIONS > 1); --impl names the rows (default `magi`).
//   --large-d: the large head dims (D 320, 512, 1024 unless --dims), one sequence of --seq tokens (full, causal) and
//   the long-tailed documents over the same tokens (varlen causal).
//   --fwd-variant pins the large-D forward's variant (0 resident, 1 deep, 2 streamed, 3 paired; default: the plan's choice);
//   --bwd-variant the large-D dk/dv kernel's (0 single, 1 paired: two blocks per SM, D 320 only).
//   --fwd-heads-per-pass N: the forward's work order in passes of N q heads (a divisor of the q heads; all = one
//   pass). --heads N: q heads (default 16); --kv-heads N: GQA, N kv heads (a divisor of the q heads; default: as
//   many as q heads); --cat-gqa: the backward with concatenated q heads (MAGI_ATTENTION_CATGQA;
//   PlanTuning::backward_cat_gqa). --stages: after each case's timing, one more forward and backward in profile mode
//   (MAGI_ATTENTION_PROFILE_MODE's per-kernel times on stderr: the backward's preprocess, dk/dv kernel and dq
//   conversion apart; with --deterministic, the deterministic backward's too).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "common/arguments.hpp"
#include "common/long_tailed_documents.hpp"
#include "cuda/backend.hpp"
#include "magi/error.hpp"
#include "magi/flops.hpp"
#include "magi/mask.hpp"

namespace {

#define CHECK(expr)                                                                          \
  do {                                                                                       \
    const cudaError_t err_ = (expr);                                                         \
    if (err_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(err_));             \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

struct Case {
  std::string name;
  std::vector<int32_t> cu_seqlens;  // documents (for the peers' masks)
  int32_t window = 0;               // sliding window (left), 0 = none
  int32_t block = 0;                // block-causal block size
  int32_t question = 0;             // shared question length
  magi::Mask mask;
};

std::vector<int32_t> prefix(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> cu{0};
  for (int32_t l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

std::vector<Case> make_cases(int32_t seq, int32_t batch, bool large_d) {
  using namespace magi;
  const int32_t total = seq * batch;
  const std::vector<int32_t> batch_cu = prefix(std::vector<int32_t>(static_cast<size_t>(batch), seq));
  const std::vector<int32_t> docs = magi::bench::long_tailed_cu_seqlens(total, 42);
  std::vector<Case> cases;
  cases.push_back({"full", batch_cu, 0, 0, 0, masks::varlen_full(batch_cu)});
  cases.push_back({"causal", batch_cu, 0, 0, 0, masks::varlen_causal(batch_cu)});
  if (large_d) {
    cases.push_back({"varlen_causal", docs, 0, 0, 0, masks::varlen_causal(docs)});
    return cases;
  }
  cases.push_back({"varlen_full", docs, 0, 0, 0, masks::varlen_full(docs)});
  cases.push_back({"varlen_causal", docs, 0, 0, 0, masks::varlen_causal(docs)});
  cases.push_back({"sliding_window_1024", batch_cu, 1024, 0, 0, masks::varlen_sliding_window(batch_cu, 1024, 0)});
  cases.push_back({"varlen_block_causal_512", docs, 0, 512, 0, masks::varlen_block_causal(docs, 512)});
  std::vector<int32_t> answers(6, (total - total / 4) / 6);
  const int32_t question = total - 6 * answers[0];
  std::vector<int32_t> sq_lengths{question};
  sq_lengths.insert(sq_lengths.end(), answers.begin(), answers.end());
  cases.push_back({"shared_question", prefix(sq_lengths), 0, 0, question, masks::shared_question(question, answers)});
  return cases;
}

// Random 16-bit normal-ish values (bf16 bits), generated on the host once per size.
std::vector<uint16_t> random_bf16(size_t n, uint64_t seed) {
  std::vector<uint16_t> out(n);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    // Sum of 4 uniforms ~ roughly normal, std ~ 0.58 * 2.
    float x = 0;
    for (int j = 0; j < 4; ++j) x += static_cast<float>((s >> (16 * j)) & 0xffff) / 65535.0f - 0.5f;
    x *= 1.7f;
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    out[i] = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
  }
  return out;
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Under sustained load the H200 runs at its 700 W cap and lowers its clocks within ~100 ms; the D 128 backward
// then loses ~10% against its first few calls (558 -> 503 TFLOP/s), cuDNN's ~3% (2026-11-28, docs/performance.md).
// So every measurement runs warm_ms of back-to-back calls first: all cases, ours and the peers
// (scripts/bench_peers.py, the same protocol), are timed at the clocks that training sees, whatever ran before.
// The timed calls are queued back to back too, an event between each two, one wait at the end: a call's time is
// the GPU's, not the host's launch latency, which training hides by running ahead (a wait after every call put
// ~10 us of idle GPU into each measurement, 5% of a 200 us call). Two calls stay in flight while warming.
template <class F>
double time_ms(F&& fn, int reps, int warm_ms, cudaStream_t stream) {
  cudaEvent_t in_flight[2];
  for (cudaEvent_t& e : in_flight) CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  const auto warm_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(warm_ms);
  for (int i = 0; i < 3 || std::chrono::steady_clock::now() < warm_until; ++i) {
    if (i >= 2) CHECK(cudaEventSynchronize(in_flight[i % 2]));
    fn();
    CHECK(cudaEventRecord(in_flight[i % 2], stream));
  }
  std::vector<cudaEvent_t> marks(static_cast<size_t>(reps) + 1);
  for (cudaEvent_t& e : marks) CHECK(cudaEventCreate(&e));
  CHECK(cudaEventRecord(marks[0], stream));  // behind the warm-up's last calls: the queue is ahead already
  for (int i = 0; i < reps; ++i) {
    fn();
    CHECK(cudaEventRecord(marks[static_cast<size_t>(i) + 1], stream));
  }
  CHECK(cudaEventSynchronize(marks.back()));
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, marks[static_cast<size_t>(i)], marks[static_cast<size_t>(i) + 1]));
    times.push_back(ms);
  }
  for (cudaEvent_t e : marks) CHECK(cudaEventDestroy(e));
  for (cudaEvent_t e : in_flight) CHECK(cudaEventDestroy(e));
  return median(times);
}

}  // namespace

int main(int argc, char** argv) {
  std::string cases_path;
  int reps = 30;
  int warm_ms = 300;
  bool quick = false;
  std::vector<std::string> only;  // mask names; empty: every case
  std::string dims_arg;
  int32_t seq = 8192, batch = 2;
  bool deterministic_too = false;
  bool forward_only = false;  // A/B runs of forward kernels: the backward columns stay 0
  bool large_d = false;
  bool stages = false;
  int sm_margin = 0;
  int32_t heads = 16, kv_heads = 0;  // kv_heads 0: as many as q heads
  std::string impl = "magi";
  magi::cuda::PlanTuning tuning;  // --fwd-tile-q pins the forward q tile (default: the planner's choice)
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--cases") && i + 1 < argc) cases_path = argv[++i];
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--warm-ms") && i + 1 < argc) warm_ms = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = magi::bench::parse_name_list(argv[++i]);
    else if (!std::strcmp(argv[i], "--dims") && i + 1 < argc) dims_arg = argv[++i];
    else if (!std::strcmp(argv[i], "--seq") && i + 1 < argc) seq = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--batch") && i + 1 < argc) batch = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--deterministic")) deterministic_too = true;
    else if (!std::strcmp(argv[i], "--forward-only")) forward_only = true;
    else if (!std::strcmp(argv[i], "--large-d")) large_d = true, batch = 1;
    else if (!std::strcmp(argv[i], "--stages")) stages = true;
    else if (!std::strcmp(argv[i], "--fwd-variant") && i + 1 < argc) tuning.forward_variant = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--bwd-variant") && i + 1 < argc) tuning.backward_variant = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--sm-margin") && i + 1 < argc) sm_margin = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--impl") && i + 1 < argc) impl = argv[++i];
    else if (!std::strcmp(argv[i], "--fwd-tile-q") && i + 1 < argc) tuning.forward_tile_q = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--fwd-pairs") && i + 1 < argc) tuning.forward_pairs = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--fwd-aligned") && i + 1 < argc)
      tuning.forward_aligned_tiles = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--bwd-aligned") && i + 1 < argc)
      tuning.backward_aligned_tiles = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--heads") && i + 1 < argc) heads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--kv-heads") && i + 1 < argc) kv_heads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--cat-gqa")) tuning.backward_cat_gqa = true;
    else if (!std::strcmp(argv[i], "--fwd-heads-per-pass") && i + 1 < argc)
      tuning.forward_heads_per_pass = std::atoi(argv[++i]);
    else if ((!std::strcmp(argv[i], "--family") || !std::strcmp(argv[i], "--bwd-family")) && i + 1 < argc) {
      // --family: both kernels' family; --bwd-family (after it): the backward's alone.
      const bool both = !std::strcmp(argv[i], "--family");
      const std::string family = argv[++i];
      magi::cuda::KernelFamily chosen = magi::cuda::KernelFamily::Auto;
      if (family == "sm80") chosen = magi::cuda::KernelFamily::Sm80;
      else if (family == "sm90") chosen = magi::cuda::KernelFamily::Sm90;
      else if (family != "auto") {
        std::fprintf(stderr, "flash_bench: %s '%s' (allowed: auto, sm80, sm90)\n", argv[i - 1], family.c_str());
        return 2;
      }
      if (both) tuning.forward_family = chosen;
      tuning.backward_family = chosen;
    } else {
      // A mistyped option would otherwise measure something other than what was asked for.
      std::fprintf(stderr, "flash_bench: unknown argument '%s' or missing value (see the usage at the top of %s)\n",
                   argv[i], "bench/cuda/flash_bench.cpp");
      return 2;
    }
  }
  if (reps <= 0 || warm_ms < 0) {
    std::fprintf(stderr, "flash_bench: --reps %d must be positive and --warm-ms %d not negative\n", reps, warm_ms);
    return 2;
  }
  if (seq <= 0 || batch <= 0) {
    std::fprintf(stderr, "flash_bench: --seq and --batch must be positive\n");
    return 2;
  }
  if (heads <= 0) {
    std::fprintf(stderr, "flash_bench: --heads %d must be positive\n", heads);
    return 2;
  }
  if (kv_heads == 0) kv_heads = heads;
  if (kv_heads <= 0 || heads % kv_heads != 0) {
    std::fprintf(stderr, "flash_bench: --kv-heads %d must divide the %d q heads\n", kv_heads, heads);
    return 2;
  }
  const std::vector<Case> cases = make_cases(seq, batch, large_d);
  for (const std::string& name : only) {
    if (std::none_of(cases.begin(), cases.end(), [&](const Case& c) { return c.name == name; })) {
      std::string names;
      for (const Case& c : cases) names += (names.empty() ? "" : ", ") + c.name;
      std::fprintf(stderr, "flash_bench: --only '%s' is not a case here (allowed: %s)\n", name.c_str(), names.c_str());
      return 2;
    }
  }
  const int32_t total = seq * batch;
  std::vector<int32_t> dims = large_d ? std::vector<int32_t>{320, 512, 1024}
                              : quick ? std::vector<int32_t>{128}
                                      : std::vector<int32_t>{64, 128, 256};
  if (!dims_arg.empty()) dims = magi::bench::parse_int_list(dims_arg);

  if (!cases_path.empty()) {
    std::ofstream js(cases_path);
    js << "{\"seq\": " << seq << ", \"batch\": " << batch << ", \"heads\": " << heads << ", \"dims\": [";
    for (size_t i = 0; i < dims.size(); ++i) js << (i ? ", " : "") << dims[i];
    js << "], \"cases\": [";
    for (size_t c = 0; c < cases.size(); ++c) {
      const Case& k = cases[c];
      js << (c ? ", " : "") << "{\"name\": \"" << k.name << "\", \"window\": " << k.window << ", \"block\": " << k.block
         << ", \"question\": " << k.question << ", \"area\": " << k.mask.area() << ", \"cu_seqlens\": [";
      for (size_t i = 0; i < k.cu_seqlens.size(); ++i) js << (i ? ", " : "") << k.cu_seqlens[i];
      js << "]}";
    }
    js << "]}\n";
  }

  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("impl,mask,tokens,head_dim,fwd_tflops,bwd_tflops,fwd_ms,bwd_ms\n");
  for (int32_t d : dims) {
    const size_t n = static_cast<size_t>(total) * heads * d;
    const size_t n_kv = static_cast<size_t>(total) * kv_heads * d;
    std::vector<void*> buffers;
    auto device_copy = [&](const std::vector<uint16_t>& host) {
      void* p = nullptr;
      CHECK(cudaMalloc(&p, host.size() * 2));
      CHECK(cudaMemcpy(p, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
      buffers.push_back(p);
      return p;
    };
    auto device_alloc = [&](size_t bytes) {
      void* p = nullptr;
      CHECK(cudaMalloc(&p, bytes));
      CHECK(cudaMemset(p, 0, bytes));
      buffers.push_back(p);
      return p;
    };
    void* q = device_copy(random_bf16(n, 1 + d));
    void* k = device_copy(random_bf16(n_kv, 2 + d));
    void* v = device_copy(random_bf16(n_kv, 3 + d));
    void* dout = device_copy(random_bf16(n, 4 + d));
    void* out = device_alloc(n * 2);
    void* lse = device_alloc(static_cast<size_t>(total) * heads * 4);
    void* dq = device_alloc(n * 2);
    void* dk = device_alloc(n_kv * 2);
    void* dv = device_alloc(n_kv * 2);
    const magi::Device dev{magi::DeviceType::CUDA, 0};
    auto view3 = [&](void* p) { return magi::TensorView(p, magi::DType::BF16, {total, heads, d}, dev); };
    auto view3_kv = [&](void* p) { return magi::TensorView(p, magi::DType::BF16, {total, kv_heads, d}, dev); };
    magi::ForwardArgs fa;
    fa.q = view3(q);
    fa.k = view3_kv(k);
    fa.v = view3_kv(v);
    fa.out = view3(out);
    fa.lse = magi::TensorView(lse, magi::DType::F32, {total, heads}, dev);
    magi::BackwardArgs ba;
    ba.q = fa.q;
    ba.k = fa.k;
    ba.v = fa.v;
    ba.out = fa.out;
    ba.lse = fa.lse;
    ba.dout = view3(dout);
    ba.dq = view3(dq);
    ba.dk = view3_kv(dk);
    ba.dv = view3_kv(dv);
    magi::cuda::Options options;
    options.softmax_scale = 1.0 / std::sqrt(static_cast<double>(d));
    options.sm_margin = sm_margin;

    for (const Case& c : cases) {
      if (!only.empty() && std::find(only.begin(), only.end(), c.name) == only.end()) continue;
      auto plan = magi::cuda::make_plan(c.mask, heads, kv_heads, d, 0, tuning);
      const magi::cuda::PlanStats ps = magi::cuda::stats(*plan);
      std::fprintf(stderr,
                   "# %s %s D %d: %s forward, %s backward, %d x %d tiles, variant %d, bwd variant %d, forward passes "
                   "of %d heads, kv heads %d, backward head groups of %d, forward pairs %lld%s%s\n",
                   impl.c_str(), c.name.c_str(), d,
                   ps.forward_family == magi::cuda::KernelFamily::Sm90 ? "sm90" : "sm80",
                   ps.backward_family == magi::cuda::KernelFamily::Sm90 ? "sm90" : "sm80", ps.forward_tile_q,
                   ps.forward_tile_k, ps.forward_variant, ps.backward_variant, ps.forward_heads_per_pass, kv_heads,
                   ps.backward_cat_group, static_cast<long long>(ps.forward_pairs),
                   ps.forward_aligned_tiles ? ", forward tiles aligned to the slices" : "",
                   ps.backward_aligned_tiles ? ", backward tiles aligned to the slices" : "");
      const double fwd_ms = time_ms([&] { magi::cuda::forward(*plan, fa, options, stream); }, reps, warm_ms, stream);
      const double bwd_ms =
          forward_only ? 0.0
                       : time_ms([&] { magi::cuda::backward(*plan, ba, options, stream); }, reps, warm_ms, stream);
      const int64_t area = c.mask.area();
      const double fwd_tf = magi::flops_forward(area, heads, d) / (fwd_ms * 1e-3) / 1e12;
      const double bwd_tf = forward_only ? 0.0 : magi::flops_backward(area, heads, d) / (bwd_ms * 1e-3) / 1e12;
      std::printf("%s,%s,%d,%d,%.1f,%.1f,%.3f,%.3f\n", impl.c_str(), c.name.c_str(), total, d, fwd_tf, bwd_tf, fwd_ms,
                  bwd_ms);
      if (deterministic_too && !forward_only) {
        magi::cuda::Options det = options;
        det.deterministic = true;
        // The API's deterministic plans: on the global grid unless told otherwise (api_engine.cpp).
        magi::cuda::PlanTuning det_tuning = tuning;
        if (det_tuning.forward_aligned_tiles == -1) det_tuning.forward_aligned_tiles = 0;
        if (det_tuning.backward_aligned_tiles == -1) det_tuning.backward_aligned_tiles = 0;
        const auto det_plan = magi::cuda::make_plan(c.mask, heads, kv_heads, d, 0, det_tuning);
        const double det_ms =
            time_ms([&] { magi::cuda::backward(*det_plan, ba, det, stream); }, reps, warm_ms, stream);
        const double det_tf = magi::flops_backward(area, heads, d) / (det_ms * 1e-3) / 1e12;
        std::printf("%s_det,%s,%d,%d,%.1f,%.1f,%.3f,%.3f\n", impl.c_str(), c.name.c_str(), total, d, fwd_tf, det_tf,
                    fwd_ms, det_ms);
      }
      if (stages) {
        magi::cuda::Options timed = options;
        timed.profile = true;
        magi::cuda::forward(*plan, fa, timed, stream);
        if (!forward_only) magi::cuda::backward(*plan, ba, timed, stream);
        if (!forward_only && deterministic_too) {
          timed.deterministic = true;
          magi::cuda::backward(*plan, ba, timed, stream);
        }
      }
      std::fflush(stdout);
    }
    for (void* p : buffers) CHECK(cudaFree(p));
  }
  CHECK(cudaStreamDestroy(stream));
  return 0;
}
