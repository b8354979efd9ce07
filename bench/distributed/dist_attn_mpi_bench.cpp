// Distributed attention on the CPU under mpirun: forward + backward time per overlap degree, against
// the single-device CPU engine on the same global problem (run on rank 0 while the others wait).
//   mpirun -np 4 dist_attn_mpi_bench [tokens=8192] [heads=4] [head_dim=64] [runs=5]
// Reports TFLOP/s per rank = FLOPs / (max time over ranks * cp) (SPEC section 6), fwd + bwd.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "magi/dist.hpp"
#include "magi/flops.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Buffers {
  std::vector<float> q, k, v, out, lse, dout, dq, dk, dv;
  Buffers(int64_t tq, int64_t tk, int64_t hq, int64_t hkv, int64_t d, std::mt19937_64& rng)
      : q(tq * hq * d), k(tk * hkv * d), v(tk * hkv * d), out(tq * hq * d), lse(tq * hq), dout(tq * hq * d),
        dq(tq * hq * d), dk(tk * hkv * d), dv(tk * hkv * d) {
    std::normal_distribution<float> normal;
    for (auto* t : {&q, &k, &v, &dout})
      for (auto& x : *t) x = normal(rng);
  }
};

magi::ForwardArgs forward_args(Buffers& b, int64_t tq, int64_t tk, int64_t hq, int64_t hkv, int64_t d) {
  using magi::DType;
  using magi::TensorView;
  return {TensorView(b.q.data(), DType::F32, {tq, hq, d}), TensorView(b.k.data(), DType::F32, {tk, hkv, d}),
          TensorView(b.v.data(), DType::F32, {tk, hkv, d}), {}, TensorView(b.out.data(), DType::F32, {tq, hq, d}),
          TensorView(b.lse.data(), DType::F32, {tq, hq}), {}};
}

magi::BackwardArgs backward_args(Buffers& b, int64_t tq, int64_t tk, int64_t hq, int64_t hkv, int64_t d) {
  using magi::DType;
  using magi::TensorView;
  const auto f = forward_args(b, tq, tk, hq, hkv, d);
  return {f.q, f.k, f.v, f.out, f.lse, TensorView(b.dout.data(), DType::F32, {tq, hq, d}), {},
          TensorView(b.dq.data(), DType::F32, {tq, hq, d}), TensorView(b.dk.data(), DType::F32, {tk, hkv, d}),
          TensorView(b.dv.data(), DType::F32, {tk, hkv, d}), {}};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  magi::comm::MpiEnvironment mpi(&argc, &argv);
  const auto world = magi::comm::mpi_world();
  const int32_t tokens = argc > 1 ? std::atoi(argv[1]) : 8192, hq = argc > 2 ? std::atoi(argv[2]) : 4;
  const int32_t d = argc > 3 ? std::atoi(argv[3]) : 64, runs = argc > 4 ? std::atoi(argv[4]) : 5, hkv = hq;
  const bool root = world->rank() == 0;
  std::mt19937_64 rng(12345);  // the same documents on every rank
  std::vector<int32_t> cu{0};
  std::lognormal_distribution<double> tail(6.5, 0.8);
  while (cu.back() < tokens) cu.push_back(std::min(tokens, cu.back() + std::max(16, static_cast<int32_t>(tail(rng)))));
  const magi::Mask mask = magi::masks::varlen_causal(cu);
  const double flops = magi::flops_forward(mask.area(), hq, d) + magi::flops_backward(mask.area(), hq, d);
  magi::AttentionOptions options;
  options.backend = magi::Backend::Cpu;

  if (root) {
    std::printf("varlen causal, %d tokens in %zu documents, Hq=Hkv=%d, D=%d, fp32, cp %d\n", tokens, cu.size() - 1,
                hq, d, world->size());
    Buffers g(tokens, tokens, hq, hkv, d, rng);
    std::vector<double> times;
    for (int r = 0; r <= runs; ++r) {
      const auto t0 = Clock::now();
      magi::forward(mask, forward_args(g, tokens, tokens, hq, hkv, d), options);
      magi::backward(mask, backward_args(g, tokens, tokens, hq, hkv, d), options);
      if (r > 0) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());  // first run warms up
    }
    std::printf("single device (rank 0 alone): %8.2f ms  %7.4f TFLOP/s\n", median(times) * 1e3,
                flops / median(times) / 1e12);
  }
  world->barrier();

  for (int32_t degree : {0, 1, 2, 4}) {
    magi::dist::DistConfig config;
    config.chunk_size = 256;
    config.overlap_degree = degree;
    config.attention = options;
    const auto key = magi::dist::make_runtime_key(mask, {hq, hkv, d}, world, config);
    Buffers local(key.local_q_tokens(), key.local_k_tokens(), hq, hkv, d, rng);
    std::vector<double> times;
    for (int r = 0; r <= runs; ++r) {
      world->barrier();
      const auto t0 = Clock::now();
      const int64_t lq = key.local_q_tokens(), lk = key.local_k_tokens();
      magi::dist::calc_attn(key, forward_args(local, lq, lk, hq, hkv, d));
      magi::dist::calc_attn_backward(key, backward_args(local, lq, lk, hq, hkv, d));
      double t = std::chrono::duration<double>(Clock::now() - t0).count();
      std::vector<double> all(static_cast<size_t>(world->size()));
      world->allgather(&t, sizeof(t), all.data());
      if (r > 0) times.push_back(*std::max_element(all.begin(), all.end()));
    }
    if (root) {
      const double t = median(times);
      std::printf("distributed, overlap degree %d:  %8.2f ms  %7.4f TFLOP/s per rank\n", degree, t * 1e3,
                  flops / (t * world->size()) / 1e12);
      if (degree == 0) std::printf("%s", key.summary().to_text().c_str());
    }
  }
  return 0;
}
