// Host time of one magi::forward / magi::backward call through the C++ API on device tensors: the baseline that
// the Python package's call overhead is measured against (bench/python/call_overhead.py, same case).
// `host` = time to enqueue one call (many calls back to back, no sync inside), `wall` = with the final sync,
// per call. bf16, one full-mask sequence.
//
// usage: api_overhead_bench [--tokens 1024] [--heads 16] [--dim 128] [--calls 100]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <cstdlib>
#include <cstring>
#include <string>
#include "magi/attention.hpp"
#include "magi/mask.hpp"

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s failed: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

void* device_buffer(size_t bytes, uint8_t fill) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  check(cudaMemset(p, fill, bytes), "cudaMemset");  // 0x3c..: finite bf16 values around 0.01
  return p;
}

template <class F>
void time_calls(const char* name, int64_t calls, cudaStream_t stream, F call) {
  for (int i = 0; i < 20; ++i) call();
  check(cudaStreamSynchronize(stream), "sync");
  std::vector<double> host, wall;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < calls; ++i) call();
    const auto t1 = std::chrono::steady_clock::now();
    check(cudaStreamSynchronize(stream), "sync");
    const auto t2 = std::chrono::steady_clock::now();
    host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
    wall.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count() / calls);
  }
  std::sort(host.begin(), host.end());
  std::sort(wall.begin(), wall.end());
  std::printf("cpp %s host_us=%.2f wall_us=%.2f\n", name, host[2], wall[2]);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 1024, heads = 16, dim = 128, calls = 100;  // few calls: the launch queue never fills
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int64_t value = std::atoll(argv[i + 1]);
    if (flag == "--tokens") tokens = value;
    else if (flag == "--heads") heads = value;
    else if (flag == "--dim") dim = value;
    else if (flag == "--calls") calls = value;
    else {
      std::fprintf(stderr, "api_overhead_bench: unknown option %s (allowed: --tokens, --heads, --dim, --calls)\n", argv[i]);
      return 2;
    }
  }
  const size_t elems = static_cast<size_t>(tokens * heads * dim);
  const magi::Device dev{magi::DeviceType::CUDA, 0};
  const auto bf16 = magi::DType::BF16;
  void *q = device_buffer(elems * 2, 0x3c), *k = device_buffer(elems * 2, 0x3c), *v = device_buffer(elems * 2, 0x3c);
  void *out = device_buffer(elems * 2, 0), *dout = device_buffer(elems * 2, 0x3c);
  void *dq = device_buffer(elems * 2, 0), *dk = device_buffer(elems * 2, 0), *dv = device_buffer(elems * 2, 0);
  void* lse = device_buffer(static_cast<size_t>(tokens * heads) * 4, 0);
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const magi::Mask mask = magi::masks::full(static_cast<int32_t>(tokens), static_cast<int32_t>(tokens));
  magi::ForwardArgs f;
  f.q = {q, bf16, {tokens, heads, dim}, dev};
  f.k = {k, bf16, {tokens, heads, dim}, dev};
  f.v = {v, bf16, {tokens, heads, dim}, dev};
  f.out = {out, bf16, {tokens, heads, dim}, dev};
  f.lse = {lse, magi::DType::F32, {tokens, heads}, dev};
  magi::BackwardArgs b;
  b.q = f.q, b.k = f.k, b.v = f.v, b.out = f.out, b.lse = f.lse;
  b.dout = {dout, bf16, {tokens, heads, dim}, dev};
  b.dq = {dq, bf16, {tokens, heads, dim}, dev};
  b.dk = {dk, bf16, {tokens, heads, dim}, dev};
  b.dv = {dv, bf16, {tokens, heads, dim}, dev};
  std::printf("# magi api_overhead: full mask, %lld tokens, %lld heads, D %lld, bf16, %lld calls a repetition\n",
              static_cast<long long>(tokens), static_cast<long long>(heads), static_cast<long long>(dim),
              static_cast<long long>(calls));
  time_calls("forward", calls, stream, [&] { magi::forward(mask, f, {}, stream); });
  time_calls("forward_backward", calls, stream, [&] {
    magi::forward(mask, f, {}, stream);
    magi::backward(mask, b, {}, stream);
  });
  return 0;
}
