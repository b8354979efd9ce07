// Distributed attention on GPUs (NCCL engine), one process per GPU (forked, or under mpirun): TFLOP/s
// per GPU (SPEC section 6: FLOPs / (max time over ranks * cp)) of calc_attn forward and backward for
// full, causal, varlen full and varlen causal masks over `tokens per GPU x cp` tokens, against the
// single-GPU kernel (magi::forward / magi::backward, backend cuda) on the same mask kind at `tokens per
// GPU` tokens, measured in the same run. Prints a table on rank 0.
//   dist_attn_gpu_bench (this file's program) [--tokens-per-gpu N] [--heads H] [--kv-heads H] [--head-dim D]
//                       [--overlaps 0,1,2] [--masks full,causal,varlen_full,varlen_causal]
//                       [--iters N] [--chunk-size N] [--ring 0|1] [--stage-kernels 0|1] [--stage-cp N]
//   --stage-kernels 1: also time each rank's stage kernels alone (forward and backward, no communication) and
//   print them under the table row, to tell kernel efficiency on the stage masks from time spent waiting.
//   --stage-cp N: only that, for all N ranks' plans in turn on each process's GPU (one GPU suffices).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "comm/nccl_communicator.hpp"
#include "comm/nccl_local_launch.hpp"
#include "cuda/small_kernels.hpp"
#include "distributed/comm_plan.hpp"
#include "distributed/cost_model.hpp"
#include "distributed/dispatch.hpp"
#include "distributed/gpu_kernels.hpp"
#include "magi/dist.hpp"
#include "magi/flops.hpp"
#include "common/arguments.hpp"
#include "common/long_tailed_documents.hpp"

namespace {

using magi::comm::NcclCommunicator;

struct Options {
  int32_t tokens_per_gpu = 16384;
  int32_t heads = 16;
  int32_t kv_heads = 16;  // GQA when fewer than heads
  int32_t head_dim = 128;
  int32_t chunk_size = 512;
  int32_t iters = 20;
  int32_t warmup = 3;
  std::vector<int32_t> overlaps{0, 1, 2};
  bool ring = true;  // measure the ring-attention baseline
  bool stage_kernels = false;  // also time each rank's stage kernels alone (no comm), per rank
  int32_t stage_cp = 0;         // > 0: only time the stage kernels of all stage_cp ranks' plans on this GPU
  std::vector<std::string> masks{"full", "causal", "varlen_full", "varlen_causal"};
};

void check(cudaError_t code, const char* what) {
  if (code != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(code));
}


class Buffer {
 public:
  explicit Buffer(size_t bytes) {
    check(cudaMalloc(&ptr_, bytes), "cudaMalloc");
    check(cudaMemset(ptr_, 0, bytes), "cudaMemset");
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { cudaFree(ptr_); }
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

// Random bf16 values (normal, std 1) on the device: one block of 1M values drawn once (per seed offset),
// repeated over the buffer (drawing 10^8 normals per buffer would dominate the run).
void fill_random(void* dst, int64_t n, uint64_t seed) {
  constexpr int64_t kBlock = 1 << 20;
  static std::vector<uint16_t> block = [] {
    std::mt19937_64 rng(12345);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<uint16_t> values(static_cast<size_t>(kBlock + 4096));
    for (auto& h : values) {
      const float f = normal(rng);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      h = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
    }
    return values;
  }();
  const uint16_t* src = block.data() + seed % 4096;  // different tensors start at different offsets
  auto* out = static_cast<uint16_t*>(dst);
  for (int64_t at = 0; at < n; at += kBlock)
    check(cudaMemcpy(out + at, src, static_cast<size_t>(std::min(kBlock, n - at)) * 2, cudaMemcpyHostToDevice),
          "cudaMemcpy");
}

magi::TensorView view(const Buffer& b, magi::DType dtype, std::initializer_list<int64_t> shape, int32_t device) {
  return magi::TensorView(b.get(), dtype, shape, magi::Device{magi::DeviceType::CUDA, device});
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Every rank's value; the max.
double max_over_ranks(NcclCommunicator& comm, double mine) {
  std::vector<double> all(static_cast<size_t>(comm.size()));
  comm.allgather(&mine, sizeof(mine), all.data());
  return *std::max_element(all.begin(), all.end());
}

struct Timing {
  double fwd_ms = 0, bwd_ms = 0;
};

// Random bf16 q, k, v, dout and output buffers of one attention problem (tq query rows, tk key rows, the
// options' heads) on `device`, with the forward and backward arguments over them.
struct Problem {
  Buffer q, k, v, out, lse, dout, dq, dk, dv;
  magi::ForwardArgs forward;
  magi::BackwardArgs backward;

  Problem(int64_t tq, int64_t tk, const Options& o, int32_t device, uint64_t seed)
      : q(tq * o.heads * o.head_dim * 2), k(tk * o.kv_heads * o.head_dim * 2), v(tk * o.kv_heads * o.head_dim * 2),
        out(tq * o.heads * o.head_dim * 2), lse(tq * o.heads * 4), dout(tq * o.heads * o.head_dim * 2),
        dq(tq * o.heads * o.head_dim * 2), dk(tk * o.kv_heads * o.head_dim * 2), dv(tk * o.kv_heads * o.head_dim * 2) {
    using magi::DType;
    const int64_t h = o.heads, hk = o.kv_heads, d = o.head_dim;
    fill_random(q.get(), tq * h * d, seed);
    fill_random(k.get(), tk * hk * d, seed + 100);
    fill_random(v.get(), tk * hk * d, seed + 200);
    fill_random(dout.get(), tq * h * d, seed + 300);
    forward.q = view(q, DType::BF16, {tq, h, d}, device);
    forward.k = view(k, DType::BF16, {tk, hk, d}, device);
    forward.v = view(v, DType::BF16, {tk, hk, d}, device);
    forward.out = view(out, DType::BF16, {tq, h, d}, device);
    forward.lse = view(lse, DType::F32, {tq, h}, device);
    backward.q = forward.q;
    backward.k = forward.k;
    backward.v = forward.v;
    backward.out = forward.out;
    backward.lse = forward.lse;
    backward.dout = view(dout, DType::BF16, {tq, h, d}, device);
    backward.dq = view(dq, DType::BF16, {tq, h, d}, device);
    backward.dk = view(dk, DType::BF16, {tk, hk, d}, device);
    backward.dv = view(dv, DType::BF16, {tk, hk, d}, device);
  }
};

// Median over iterations of the slowest rank's time per call (host clock around each call; calc_attn
// returns once its results are on the device).
Timing time_distributed(NcclCommunicator& comm, const std::shared_ptr<NcclCommunicator>& comm_ptr,
                        const magi::Mask& mask, const Options& o, int32_t overlap, magi::dist::PlanSummary* summary) {
  using namespace magi;
  dist::DistConfig config;
  config.chunk_size = o.chunk_size;
  config.overlap_degree = overlap;
  config.attention.backend = Backend::Cuda;
  const dist::HeadShape heads{o.heads, o.kv_heads, o.head_dim};
  const dist::RuntimeKey key = dist::make_runtime_key(mask, heads, comm_ptr, config);
  *summary = key.summary();
  const Problem p(key.local_q_tokens(), key.local_k_tokens(), o, comm.cuda_device(), 1 + comm.rank());
  const ForwardArgs& f = p.forward;
  const BackwardArgs& b = p.backward;
  std::vector<double> fwd, bwd;
  for (int32_t i = 0; i < o.warmup + o.iters; ++i) {
    comm.barrier();
    auto t0 = std::chrono::steady_clock::now();
    dist::calc_attn(key, f);
    const double tf = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    comm.barrier();
    t0 = std::chrono::steady_clock::now();
    dist::calc_attn_backward(key, b);
    const double tb = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const double max_f = max_over_ranks(comm, tf), max_b = max_over_ranks(comm, tb);
    if (i >= o.warmup) fwd.push_back(max_f), bwd.push_back(max_b);
  }
  return {median(fwd), median(bwd)};
}

// The single-GPU kernel on this rank's GPU, CUDA events, median.
Timing time_single(const magi::Mask& mask, const Options& o, int32_t dev) {
  using namespace magi;
  const Problem p(mask.total_q, mask.total_k, o, dev, 1);
  const ForwardArgs& f = p.forward;
  const BackwardArgs& b = p.backward;
  AttentionOptions options;
  options.backend = Backend::Cuda;
  cudaEvent_t e0, e1, e2;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventCreate(&e2);
  std::vector<double> fwd, bwd;
  for (int32_t i = 0; i < o.warmup + o.iters; ++i) {
    cudaEventRecord(e0, nullptr);
    forward(mask, f, options);
    cudaEventRecord(e1, nullptr);
    backward(mask, b, options);
    cudaEventRecord(e2, nullptr);
    check(cudaEventSynchronize(e2), "cudaEventSynchronize");
    float ms_f = 0, ms_b = 0;
    cudaEventElapsedTime(&ms_f, e0, e1);
    cudaEventElapsedTime(&ms_b, e1, e2);
    if (i >= o.warmup) fwd.push_back(ms_f), bwd.push_back(ms_b);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaEventDestroy(e2);
  return {median(fwd), median(bwd)};
}


// ---- ring-attention baseline (zigzag) ----
// Rank r holds chunks r and 2cp-1-r of 2cp equal chunks (q and kv). Step s computes the local q against
// the kv of rank r - s, received from r - 1 while step s - 1 computed (double buffer). Backward: the kv
// travels the same way; each step's partial dk/dv is added to an fp32 accumulator that travels with it
// and reaches its owner after cp hops.

class StreamEvents {
 public:
  explicit StreamEvents(size_t n) : events_(n) {
    for (auto& e : events_) check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~StreamEvents() {
    for (auto& e : events_) cudaEventDestroy(e);
  }
  cudaEvent_t operator[](size_t i) const { return events_[i]; }

 private:
  std::vector<cudaEvent_t> events_;
};

// Sends `bytes` of each send buffer to rank + 1 and receives as many from rank - 1, one NCCL group.
void ring_shift(NcclCommunicator& comm, std::initializer_list<std::pair<const void*, void*>> buffers, int64_t bytes,
                cudaStream_t stream) {
  const int32_t n = comm.size(), me = comm.rank();
  std::vector<int64_t> send(static_cast<size_t>(n), 0), recv(static_cast<size_t>(n), 0), zeros(static_cast<size_t>(n), 0);
  send[(me + 1) % n] = bytes;
  recv[(me + n - 1) % n] = bytes;
  ncclGroupStart();
  for (const auto& [from, to] : buffers) comm.enqueue_all_to_all_v(from, send, zeros, to, recv, zeros, stream);
  comm.await_launch(ncclGroupEnd(), "ring shift");  // non-blocking communicator: enqueued only after this
}

Timing time_ring(NcclCommunicator& comm, const magi::Mask& mask, const Options& o) {
  using namespace magi;
  namespace g = magi::dist::gpu;
  const int32_t cp = comm.size(), me = comm.rank(), dev = comm.cuda_device();
  const int64_t l = mask.total_q / cp, h = o.heads, hk = o.kv_heads, d = o.head_dim;
  const int64_t q_elems = l * h * d, kv_elems = l * hk * d;
  std::vector<Mask> stage_masks;
  for (int32_t s = 0; s < cp; ++s) stage_masks.push_back(magi::dist::zigzag_block_mask(mask, cp, me, (me - s + cp) % cp));
  // The stages of all ranks must cover the mask exactly once.
  double my_area = 0;
  for (const Mask& m : stage_masks) my_area += static_cast<double>(m.area());
  std::vector<double> areas(static_cast<size_t>(cp));
  comm.allgather(&my_area, sizeof(my_area), areas.data());
  double total_area = 0;
  for (double a : areas) total_area += a;
  if (total_area != static_cast<double>(mask.area()))
    throw std::runtime_error("ring baseline: stage masks cover " + std::to_string(total_area) + " cells, the mask " +
                             std::to_string(mask.area()));
  Buffer q(q_elems * 2), k(kv_elems * 2), v(kv_elems * 2), out(q_elems * 2), lse(l * h * 4), dout(q_elems * 2),
      dq(q_elems * 2), dk(kv_elems * 2), dv(kv_elems * 2);
  Buffer bk0(kv_elems * 2), bk1(kv_elems * 2), bv0(kv_elems * 2), bv1(kv_elems * 2);
  Buffer acc_out(q_elems * 4), acc_lse(l * h * 4), part_out(q_elems * 4), part_lse(l * h * 4);
  Buffer acc_dq(q_elems * 4), part_dk(kv_elems * 4), part_dv(kv_elems * 4);
  Buffer dk0(kv_elems * 4), dk1(kv_elems * 4), dv0(kv_elems * 4), dv1(kv_elems * 4);
  fill_random(q.get(), q_elems, 1 + me);
  fill_random(k.get(), kv_elems, 100 + me);
  fill_random(v.get(), kv_elems, 200 + me);
  fill_random(dout.get(), q_elems, 300 + me);
  void* bufk[2] = {bk0.get(), bk1.get()};
  void* bufv[2] = {bv0.get(), bv1.get()};
  float* bufdk[2] = {static_cast<float*>(dk0.get()), static_cast<float*>(dk1.get())};
  float* bufdv[2] = {static_cast<float*>(dv0.get()), static_cast<float*>(dv1.get())};
  const auto cur_k = [&](int32_t s) { return s == 0 ? k.get() : bufk[s % 2]; };
  const auto cur_v = [&](int32_t s) { return s == 0 ? v.get() : bufv[s % 2]; };
  cudaStream_t compute;
  check(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), "cudaStreamCreate");
  const cudaStream_t comm_stream = comm.comm_stream();
  StreamEvents kv_arrived(cp + 1), dk_arrived(cp + 1), computed(cp + 1);
  cudaEvent_t done;
  check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
  AttentionOptions options;
  options.backend = Backend::Cuda;
  const auto tv = [&](void* p, DType t, std::initializer_list<int64_t> shape) {
    return TensorView(p, t, shape, Device{DeviceType::CUDA, dev});
  };
  const int64_t kv_bytes = kv_elems * 2, acc_bytes = kv_elems * 4;

  // Step s's kv on the compute stream; step s + 1's starts around the ring while step s computes (into the
  // buffer step s - 1 read, once that step has computed).
  const auto kv_for_step = [&](int32_t s) {
    if (s + 1 < cp) {
      if (s > 0) check(cudaStreamWaitEvent(comm_stream, computed[s - 1], 0), "cudaStreamWaitEvent");
      ring_shift(comm, {{cur_k(s), bufk[(s + 1) % 2]}, {cur_v(s), bufv[(s + 1) % 2]}}, kv_bytes, comm_stream);
      check(cudaEventRecord(kv_arrived[s + 1], comm_stream), "cudaEventRecord");
    }
    if (s > 0) check(cudaStreamWaitEvent(compute, kv_arrived[s], 0), "cudaStreamWaitEvent");
  };

  const auto forward_pass = [&] {
    cuda::detail::launch_fill(static_cast<float*>(acc_out.get()), q_elems, 0.f, compute);
    cuda::detail::launch_fill(static_cast<float*>(acc_lse.get()), l * h, -INFINITY, compute);
    for (int32_t s = 0; s < cp; ++s) {
      kv_for_step(s);
      if (!stage_masks[s].slices.empty()) {
        ForwardArgs f;
        f.q = tv(q.get(), DType::BF16, {l, h, d});
        f.k = tv(cur_k(s), DType::BF16, {l, hk, d});
        f.v = tv(cur_v(s), DType::BF16, {l, hk, d});
        f.out = tv(part_out.get(), DType::F32, {l, h, d});
        f.lse = tv(part_lse.get(), DType::F32, {l, h});
        forward(stage_masks[s], f, options, compute);
        g::lse_merge(static_cast<float*>(acc_out.get()), static_cast<float*>(acc_lse.get()),
                     static_cast<float*>(part_out.get()), static_cast<float*>(part_lse.get()), l * h, d, compute);
      }
      check(cudaEventRecord(computed[s], compute), "cudaEventRecord");
    }
    g::convert(static_cast<float*>(acc_out.get()), out.get(), g::Element::BF16, q_elems, compute);
    g::convert(static_cast<float*>(acc_lse.get()), lse.get(), g::Element::F32, l * h, compute);
    check(cudaEventRecord(done, compute), "cudaEventRecord");
    comm.wait_event(done, "ring forward");
  };

  const auto backward_pass = [&] {
    cuda::detail::launch_fill(bufdk[0], kv_elems, 0.f, compute);
    cuda::detail::launch_fill(bufdv[0], kv_elems, 0.f, compute);
    for (int32_t s = 0; s < cp; ++s) {
      kv_for_step(s);
      if (!stage_masks[s].slices.empty()) {
        BackwardArgs b;
        b.q = tv(q.get(), DType::BF16, {l, h, d});
        b.k = tv(cur_k(s), DType::BF16, {l, hk, d});
        b.v = tv(cur_v(s), DType::BF16, {l, hk, d});
        b.out = tv(out.get(), DType::BF16, {l, h, d});
        b.lse = tv(lse.get(), DType::F32, {l, h});
        b.dout = tv(dout.get(), DType::BF16, {l, h, d});
        b.dq = tv(acc_dq.get(), DType::F32, {l, h, d});
        b.accumulate_dq = s > 0;  // the first step writes dq, later ones add (as the magi runtime does)
        b.dk = tv(part_dk.get(), DType::F32, {l, hk, d});
        b.dv = tv(part_dv.get(), DType::F32, {l, hk, d});
        backward(stage_masks[s], b, options, compute);
      } else {
        if (s == 0) cuda::detail::launch_fill(static_cast<float*>(acc_dq.get()), q_elems, 0.f, compute);
        cuda::detail::launch_fill(static_cast<float*>(part_dk.get()), kv_elems, 0.f, compute);
        cuda::detail::launch_fill(static_cast<float*>(part_dv.get()), kv_elems, 0.f, compute);
      }
      // The accumulator of the kv held at step s arrived from rank - 1 (step 0: zeros, our own).
      if (s > 0) check(cudaStreamWaitEvent(compute, dk_arrived[s], 0), "cudaStreamWaitEvent");
      magi::cuda::detail::launch_add(bufdk[s % 2], static_cast<float*>(part_dk.get()), kv_elems, compute);
      magi::cuda::detail::launch_add(bufdv[s % 2], static_cast<float*>(part_dv.get()), kv_elems, compute);
      check(cudaEventRecord(computed[s], compute), "cudaEventRecord");
      check(cudaStreamWaitEvent(comm_stream, computed[s], 0), "cudaStreamWaitEvent");
      ring_shift(comm, {{bufdk[s % 2], bufdk[(s + 1) % 2]}, {bufdv[s % 2], bufdv[(s + 1) % 2]}}, acc_bytes, comm_stream);
      check(cudaEventRecord(dk_arrived[s + 1], comm_stream), "cudaEventRecord");
    }
    // After cp hops each accumulator is back with its owner.
    check(cudaStreamWaitEvent(compute, dk_arrived[cp], 0), "cudaStreamWaitEvent");
    g::convert(static_cast<float*>(acc_dq.get()), dq.get(), g::Element::BF16, q_elems, compute);
    g::convert(bufdk[cp % 2], dk.get(), g::Element::BF16, kv_elems, compute);
    g::convert(bufdv[cp % 2], dv.get(), g::Element::BF16, kv_elems, compute);
    check(cudaEventRecord(done, compute), "cudaEventRecord");
    comm.wait_event(done, "ring backward");
  };

  std::vector<double> fwd, bwd;
  for (int32_t i = 0; i < o.warmup + o.iters; ++i) {
    comm.barrier();
    auto t0 = std::chrono::steady_clock::now();
    forward_pass();
    const double tf = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    comm.barrier();
    t0 = std::chrono::steady_clock::now();
    backward_pass();
    const double tb = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const double max_f = max_over_ranks(comm, tf), max_b = max_over_ranks(comm, tb);
    if (i >= o.warmup) fwd.push_back(max_f), bwd.push_back(max_b);
  }
  cudaEventDestroy(done);
  cudaStreamDestroy(compute);
  return {median(fwd), median(bwd)};
}

// Each rank's stage kernels alone on its GPU (CUDA events, median), called as the runtime calls them: the
// host stage into fp32 accumulators, each remote stage merging into them (forward) or adding into the fp32 dq
// (backward); no communication, no reductions. Against the distributed time this separates kernel
// efficiency on the stage masks from waiting.
struct StageKernelTimes {
  double host_fwd = 0, remote_fwd = 0, host_bwd = 0, remote_bwd = 0;
};
StageKernelTimes time_stage_kernels(const magi::Mask& mask, const Options& o, int32_t cp, int32_t rank, int32_t overlap,
                                    int32_t dev) {
  using namespace magi;
  const dist::Dispatch dispatch = dist::make_dispatch(mask, cp, o.chunk_size, dist::DistConfig{}.algorithm);
  const dist::CommPlan plan = dist::make_comm_plan(mask, dispatch, overlap);
  const dist::RankPlan& mine = plan.ranks[static_cast<size_t>(rank)];
  const int64_t lq = dispatch.q.local_tokens(), lk = dispatch.k.local_tokens();
  int64_t rows = 1;
  for (const dist::StagePlan& sp : mine.stages) rows = std::max<int64_t>(rows, sp.buffer_rows);
  const int64_t tk = std::max(lk, rows), h = o.heads, hk = o.kv_heads, d = o.head_dim;
  const Problem p(lq, tk, o, dev, 7 + rank);
  const Buffer acc(lq * h * d * 4), acc_lse(lq * h * 4), acc_dk(tk * hk * d * 4), acc_dv(tk * hk * d * 4);
  const auto kv = [&](const TensorView& t, int64_t n) { return TensorView(t.data, t.dtype, {n, hk, d}, t.device); };
  // Forward or backward arguments whose k and v hold `n` rows (the host's own keys or one stage's buffer).
  const auto with_kv_rows = [&](auto args, int64_t n) {
    args.k = kv(args.k, n), args.v = kv(args.v, n);
    return args;
  };
  AttentionOptions options;
  options.backend = Backend::Cuda;
  cudaEvent_t e0, e1, e2;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventCreate(&e2);
  std::vector<double> times[4];
  const auto timed = [&](std::vector<double>& first, std::vector<double>& second, int32_t i, auto&& host, auto&& remote) {
    cudaEventRecord(e0, nullptr);
    if (!mine.host_mask.slices.empty()) host();
    cudaEventRecord(e1, nullptr);
    for (const dist::StagePlan& sp : mine.stages)
      if (!sp.mask.slices.empty()) remote(sp);
    cudaEventRecord(e2, nullptr);
    check(cudaEventSynchronize(e2), "cudaEventSynchronize");
    float a = 0, b = 0;
    cudaEventElapsedTime(&a, e0, e1);
    cudaEventElapsedTime(&b, e1, e2);
    if (i >= o.warmup) first.push_back(a), second.push_back(b);
  };
  const dist::StagePlan* last = nullptr;
  for (const dist::StagePlan& sp : mine.stages)
    if (!sp.mask.slices.empty()) last = &sp;
  ForwardArgs f = p.forward;
  f.out = view(acc, DType::F32, {lq, h, d}, dev);
  f.lse = view(acc_lse, DType::F32, {lq, h}, dev);
  BackwardArgs b = p.backward;  // out and lse: what the forward loop wrote
  b.dq = f.out;
  b.dk = view(acc_dk, DType::F32, {lk, hk, d}, dev);
  b.dv = view(acc_dv, DType::F32, {lk, hk, d}, dev);
  for (int32_t i = 0; i < o.warmup + o.iters; ++i)
    timed(times[0], times[1], i,
          [&] { forward(mine.host_mask, with_kv_rows(f, lk), options); },
          [&](const dist::StagePlan& sp) {
            ForwardArgs s = with_kv_rows(f, sp.buffer_rows);
            s.prev_out = f.out, s.prev_lse = f.lse;
            if (&sp == last) s.out = p.forward.out, s.lse = p.forward.lse;  // the last one writes the results
            forward(sp.mask, s, options);
          });
  for (int32_t i = 0; i < o.warmup + o.iters; ++i)
    timed(times[2], times[3], i,
          [&] { backward(mine.host_mask, with_kv_rows(b, lk), options); },
          [&](const dist::StagePlan& sp) {
            BackwardArgs s = with_kv_rows(b, sp.buffer_rows);
            s.accumulate_dq = true;
            s.dk = kv(p.backward.dk, sp.buffer_rows), s.dv = kv(p.backward.dv, sp.buffer_rows);
            backward(sp.mask, s, options);
          });
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaEventDestroy(e2);
  return {median(times[0]), median(times[1]), median(times[2]), median(times[3])};
}

// One line per mask and overlap degree: every rank's host + remote stage times (and the distributed call's
// times when measured, else negative).
void print_stage_kernels(const std::string& kind, int32_t overlap, const std::vector<StageKernelTimes>& all,
                         double dist_fwd_ms, double dist_bwd_ms) {
  std::printf("  stage kernels alone (%s, overlap %d), ms per rank, host + remote stages: fwd", kind.c_str(), overlap);
  if (dist_fwd_ms >= 0) std::printf(" (dist %.2f)", dist_fwd_ms);
  for (size_t r = 0; r < all.size(); ++r) std::printf(" [%zu] %.2f + %.2f", r, all[r].host_fwd, all[r].remote_fwd);
  std::printf("; bwd");
  if (dist_bwd_ms >= 0) std::printf(" (dist %.2f)", dist_bwd_ms);
  for (size_t r = 0; r < all.size(); ++r) std::printf(" [%zu] %.2f + %.2f", r, all[r].host_bwd, all[r].remote_bwd);
  std::printf("\n");
  std::fflush(stdout);
}

double tflops(double flops, double ms) { return flops / (ms * 1e-3) / 1e12; }

int run(std::shared_ptr<NcclCommunicator> comm, const Options& o) {
  const int32_t cp = comm->size();
  const bool root = comm->rank() == 0;
  comm->set_timeout(300.0);
  if (root) {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, comm->cuda_device());
    std::printf("device: %d x %s; %d tokens per GPU (total %d), heads %d:%d (q:kv), D %d, bf16, chunk %d, "
                "%d iterations after %d warm-ups, CUDA_DEVICE_MAX_CONNECTIONS=%s\n",
                cp, prop.name, o.tokens_per_gpu, o.tokens_per_gpu * cp, o.heads, o.kv_heads, o.head_dim, o.chunk_size,
                o.iters, o.warmup, std::getenv("CUDA_DEVICE_MAX_CONNECTIONS") ? std::getenv("CUDA_DEVICE_MAX_CONNECTIONS") : "unset");
    std::printf("| mask | overlap | dist fwd | dist bwd | single fwd | single bwd | ring fwd | ring bwd | "
                "fwd vs single | bwd vs single | fwd+bwd vs ring | imbalance | kv rows vs ring | fwd ms | bwd ms |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    std::fflush(stdout);
  }
  if (o.stage_cp > 0) {  // one GPU plays every rank's kernels in turn
    for (const std::string& kind : o.masks) {
      const magi::Mask global = magi::bench::distributed_bench_mask(kind, o.tokens_per_gpu * o.stage_cp);
      for (int32_t overlap : o.overlaps) {
        std::vector<StageKernelTimes> all;
        for (int32_t r = 0; r < o.stage_cp; ++r)
          all.push_back(time_stage_kernels(global, o, o.stage_cp, r, overlap, comm->cuda_device()));
        if (root) print_stage_kernels(kind, overlap, all, -1, -1);
      }
    }
    return 0;
  }
  for (const std::string& kind : o.masks) {
    const magi::Mask global = magi::bench::distributed_bench_mask(kind, o.tokens_per_gpu * cp);
    const magi::Mask per_gpu = magi::bench::distributed_bench_mask(kind, o.tokens_per_gpu);
    const Timing single = time_single(per_gpu, o, comm->cuda_device());
    const double single_fwd = tflops(magi::flops_forward(per_gpu.area(), o.heads, o.head_dim), single.fwd_ms);
    const double single_bwd = tflops(magi::flops_backward(per_gpu.area(), o.heads, o.head_dim), single.bwd_ms);
    const double flops_fwd = magi::flops_forward(global.area(), o.heads, o.head_dim);
    const double flops_bwd = magi::flops_backward(global.area(), o.heads, o.head_dim);
    Timing ring{-1, -1};
    if (o.ring) ring = time_ring(*comm, global, o);
    const double ring_fwd = o.ring ? tflops(flops_fwd, ring.fwd_ms * cp) : 0, ring_bwd = o.ring ? tflops(flops_bwd, ring.bwd_ms * cp) : 0;
    for (int32_t overlap : o.overlaps) {
      magi::dist::PlanSummary summary;
      const Timing t = time_distributed(*comm, comm, global, o, overlap, &summary);
      const double fwd = tflops(flops_fwd, t.fwd_ms * cp), bwd = tflops(flops_bwd, t.bwd_ms * cp);
      int64_t fetched = 0;
      for (int64_t f : summary.fetched_kv_rows) fetched += f;
      if (root) {
        std::printf("| %s | %d | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f%% | %.0f%% | %.2fx | %.3f | %.2f | %.2f | %.2f |\n",
                    kind.c_str(), overlap, fwd, bwd, single_fwd, single_bwd, ring_fwd, ring_bwd, 100 * fwd / single_fwd,
                    100 * bwd / single_bwd, o.ring ? (ring.fwd_ms + ring.bwd_ms) / (t.fwd_ms + t.bwd_ms) : 0.0,
                    summary.imbalance(),
                    summary.ring_kv_rows ? static_cast<double>(fetched) / summary.ring_kv_rows : 0.0, t.fwd_ms,
                    t.bwd_ms);
        std::fflush(stdout);
      }
      if (o.stage_kernels) {
        const StageKernelTimes mine = time_stage_kernels(global, o, cp, comm->rank(), overlap, comm->cuda_device());
        std::vector<StageKernelTimes> all(static_cast<size_t>(cp));
        comm->allgather(&mine, sizeof(mine), all.data());
        if (root) print_stage_kernels(kind, overlap, all, t.fwd_ms, t.bwd_ms);
      }
    }
    magi::dist::clear_runtime_cache();
  }
  if (root)
    std::printf("TFLOP/s per GPU (SPEC section 6); dist = FLOPs / (max time over ranks x cp), host clock around "
                "each call (it returns with results ready); single = CUDA events, %d tokens on one GPU; ring = zigzag ring "
                "attention, same kernel, same timing as dist; fwd+bwd vs ring = ring time / dist time.\n",
                o.tokens_per_gpu);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--tokens-per-gpu") o.tokens_per_gpu = std::stoi(value);
    else if (flag == "--heads") o.heads = std::stoi(value);
    else if (flag == "--kv-heads") o.kv_heads = std::stoi(value);
    else if (flag == "--head-dim") o.head_dim = std::stoi(value);
    else if (flag == "--chunk-size") o.chunk_size = std::stoi(value);
    else if (flag == "--iters") o.iters = std::stoi(value);
    else if (flag == "--overlaps") o.overlaps = magi::bench::parse_int_list(value);
    else if (flag == "--ring") o.ring = value != "0";
    else if (flag == "--stage-kernels") o.stage_kernels = value != "0";
    else if (flag == "--stage-cp") o.stage_cp = std::stoi(value);
    else if (flag == "--masks") {
      o.masks.clear();
      std::stringstream in(value);
      for (std::string item; std::getline(in, item, ',');) {
        if (item != "full" && item != "causal" && item != "varlen_full" && item != "varlen_causal") {
          std::fprintf(stderr, "--masks: unknown mask '%s' (allowed: full, causal, varlen_full, varlen_causal)\n",
                       item.c_str());
          return 2;
        }
        o.masks.push_back(item);
      }
    }
    else {
      std::fprintf(stderr, "unknown option %s (allowed: --tokens-per-gpu --heads --kv-heads --head-dim --chunk-size --iters "
                           "--overlaps --ring 0|1 --stage-kernels 0|1 --stage-cp N --masks a,b)\n", flag.c_str());
      return 2;
    }
  }
  return magi::comm::run_on_local_gpus([&](std::shared_ptr<NcclCommunicator> comm) {
    const int code = run(comm, o);
    magi::dist::clear_runtime_cache();
    return code;
  });
}
