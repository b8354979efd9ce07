// CPU engine benchmark: time, mask area and GFLOP/s (SPEC section 6 FLOP counts) of forward and
// backward over masks whose area differs by orders of magnitude at the same token count, showing that
// time follows area, not Tq x Tk. Calls the engine directly (plan built once, outside the timing).
//
//   engine_bench                       # everything (about a minute on 2 cores)
//   engine_bench --benchmark_filter=causal_8k_h4_d128   # the dense GFLOP/s figure
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cpu/engine.hpp"
#include "magi/flops.hpp"
#include "magi/mask.hpp"

namespace {

using magi::DType;
using magi::Mask;

// Document lengths from a long-tailed (log-normal) distribution, fixed seed so runs are comparable.
std::vector<int32_t> long_tailed_cu_seqlens(int32_t total, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> length(6.0, 1.2);  // median ~400 tokens, tail to many thousands
  std::vector<int32_t> cu{0};
  while (cu.back() < total) {
    const int32_t len = std::max<int32_t>(1, static_cast<int32_t>(length(rng)));
    cu.push_back(std::min(total, cu.back() + len));
  }
  return cu;
}

std::vector<int32_t> uniform_cu_seqlens(int32_t total, int32_t doc) {
  std::vector<int32_t> cu{0};
  while (cu.back() < total) cu.push_back(std::min(total, cu.back() + doc));
  return cu;
}

struct Problem {
  Mask mask;
  int32_t heads_q, heads_kv, dim;
  DType dtype;
  double softcap = 0.0;
};

// Random inputs in the problem's dtype (bf16/fp16 as bit patterns).
std::vector<unsigned char> random_tensor(int64_t count, DType dtype, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<unsigned char> bytes(static_cast<size_t>(count * magi::dtype_size(dtype)));
  for (int64_t i = 0; i < count; ++i) {
    const float x = normal(rng);
    switch (dtype) {
      case DType::F64:
        reinterpret_cast<double*>(bytes.data())[i] = x;
        break;
      case DType::F32:
        reinterpret_cast<float*>(bytes.data())[i] = x;
        break;
      case DType::BF16:
        reinterpret_cast<uint16_t*>(bytes.data())[i] = magi::float_to_bf16_bits(x);
        break;
      case DType::F16:
        reinterpret_cast<uint16_t*>(bytes.data())[i] = magi::float_to_fp16_bits(x);
        break;
    }
  }
  return bytes;
}

void run(benchmark::State& state, const Problem& p, bool backward) {
  const int64_t tq = p.mask.total_q, tk = p.mask.total_k;
  std::mt19937_64 rng(42);
  auto q = random_tensor(tq * p.heads_q * p.dim, p.dtype, rng);
  auto k = random_tensor(tk * p.heads_kv * p.dim, p.dtype, rng);
  auto v = random_tensor(tk * p.heads_kv * p.dim, p.dtype, rng);
  auto dout = random_tensor(tq * p.heads_q * p.dim, p.dtype, rng);
  std::vector<unsigned char> out(q.size()), dq(q.size()), dk(k.size()), dv(v.size());
  std::vector<float> lse(static_cast<size_t>(tq * p.heads_q));

  magi::ForwardArgs fa;
  fa.q = magi::TensorView(q.data(), p.dtype, {tq, p.heads_q, p.dim});
  fa.k = magi::TensorView(k.data(), p.dtype, {tk, p.heads_kv, p.dim});
  fa.v = magi::TensorView(v.data(), p.dtype, {tk, p.heads_kv, p.dim});
  fa.out = magi::TensorView(out.data(), p.dtype, {tq, p.heads_q, p.dim});
  fa.lse = magi::TensorView(lse.data(), DType::F32, {tq, p.heads_q});
  magi::cpu::EngineOptions options;
  options.softmax_scale = 1.0 / std::sqrt(static_cast<double>(p.dim));
  options.accumulate_fp64 = p.dtype == DType::F64;
  options.softcap = p.softcap;

  const auto plan = magi::cpu::make_plan(p.mask, p.heads_q, p.heads_kv, p.dim);
  magi::BackwardArgs ba;
  if (backward) {
    magi::cpu::forward(*plan, fa, options);
    ba.q = fa.q;
    ba.k = fa.k;
    ba.v = fa.v;
    ba.out = fa.out;
    ba.lse = fa.lse;
    ba.dout = magi::TensorView(dout.data(), p.dtype, {tq, p.heads_q, p.dim});
    ba.dq = magi::TensorView(dq.data(), p.dtype, {tq, p.heads_q, p.dim});
    ba.dk = magi::TensorView(dk.data(), p.dtype, {tk, p.heads_kv, p.dim});
    ba.dv = magi::TensorView(dv.data(), p.dtype, {tk, p.heads_kv, p.dim});
  }

  for (auto _ : state) {
    if (backward)
      magi::cpu::backward(*plan, ba, options);
    else
      magi::cpu::forward(*plan, fa, options);
    benchmark::ClobberMemory();
  }

  const int64_t area = p.mask.area();
  const double flops =
      backward ? magi::flops_backward(area, p.heads_q, p.dim) : magi::flops_forward(area, p.heads_q, p.dim);
  state.counters["area"] = static_cast<double>(area);
  state.counters["density"] = p.mask.density();
  // A rate counter: printed as "GFLOP=<value>/s".
  state.counters["GFLOP"] =
      benchmark::Counter(flops * static_cast<double>(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
}

void add(const std::string& name, Problem p) {
  for (bool backward : {false, true}) {
    benchmark::RegisterBenchmark((name + (backward ? "/bwd" : "/fwd")).c_str(),
                                 [p, backward](benchmark::State& s) { run(s, p, backward); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->MinTime(0.5);
  }
}

void register_all() {
  constexpr int32_t kTokens = 32768;
  // Same 32k tokens, heads 2, D 64: only the area differs.
  add("causal_32k", {magi::masks::causal(kTokens, kTokens), 2, 2, 64, DType::F32});
  add("varlen_causal_32k_docs1k",
      {magi::masks::varlen_causal(uniform_cu_seqlens(kTokens, 1024)), 2, 2, 64, DType::F32});
  add("varlen_causal_32k_longtail",
      {magi::masks::varlen_causal(long_tailed_cu_seqlens(kTokens, 7)), 2, 2, 64, DType::F32});
  add("sliding_window_32k_w1k", {magi::masks::sliding_window(kTokens, 1024, 0), 2, 2, 64, DType::F32});
  add("varlen_block_causal_32k_docs4k_b512",
      {magi::masks::varlen_block_causal(uniform_cu_seqlens(kTokens, 4096), 512), 2, 2, 64, DType::F32});
  add("block_causal_8k_b512", {magi::masks::block_causal(8192, 512), 2, 2, 64, DType::F32});
  // Dense figure of merit: causal 8k, 4 heads, D 128, fp32; and the 16-bit emulation path.
  add("causal_8k_h4_d128", {magi::masks::causal(8192, 8192), 4, 4, 128, DType::F32});
  add("causal_8k_h4_d128_bf16", {magi::masks::causal(8192, 8192), 4, 4, 128, DType::BF16});
  add("causal_4k_h8kv2_d64_gqa", {magi::masks::causal(4096, 4096), 8, 2, 64, DType::F32});
  add("causal_4k_h8kv2_d64_softcap", {magi::masks::causal(4096, 4096), 8, 2, 64, DType::F32, 30.0});
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
