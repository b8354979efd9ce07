// Small helper kernels of the portable backend: fills, backward preprocessing, dsink reduction.
#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/check.hpp"
#include "cuda/elementwise.hpp"
#include "cuda/kernel_common.cuh"
#include "cuda/small_kernels.hpp"
#include "magi/error.hpp"

namespace magi::cuda::detail {

void check_launch(const char* what) { check(cudaGetLastError(), (std::string("launch of ") + what).c_str()); }

namespace {

__global__ void fill_kernel(float* data, int64_t n, float value) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i < n) data[i] = value;
}

// Eight consecutive elements as floats (16-bit: one 16-byte load; fp32: two), through the read-only path: out and
// dout are inputs, so the loads of a lane's next piece need not wait for its stores of the piece before.
template <class T>
__device__ __forceinline__ void load8_as_float(const void* base, int64_t i, bool fp32, float (&x)[8]) {
  if (fp32) {
    const float4* at = reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    const float4 a = __ldg(at), b = __ldg(at + 1);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
    return;
  }
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(base) + i));
  const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int e = 0; e < 8; ++e) x[e] = to_float(h[e]);
}

// Delta = dout . out (fp32) per (row, head), optional dout conversion, optional zeroing of the dq accumulator (the
// atomics' target, spread over the threads; one pass instead of a memset of its own), ssh dsink. A row takes a group of
// kGroup lanes, each two or more 16-byte pieces of it (D is a multiple of 8; the API asks 16-byte aligned tensors),
// so a warp holds 32 / kGroup rows at once: with a row a warp and 8-byte pieces, half the lanes idled at D 64 and
// the pass ran at ~2 TB/s for want of bytes in flight. The groups past tq * hq zero the padding rows [tq, tq_pad)
// of Delta and lse2: the kernels read whole 64-row chunks, and the scratch may come fresh from the caller's
// allocator.
template <class T, int kGroup>
__global__ void preprocess_kernel(const PreprocessArgs a) {
  if (a.dq_zero != nullptr) {  // a few 16-byte stores a thread, before the row's loads (which need not wait for them)
    float4* const zero = reinterpret_cast<float4*>(a.dq_zero);
    const int64_t threads = int64_t{gridDim.x} * blockDim.x;
    for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < a.dq_zero_floats / 4; i += threads)
      zero[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const int64_t row_head = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / kGroup;
  const int lane = static_cast<int>(threadIdx.x % kGroup);
  if (row_head >= int64_t{a.tq} * a.hq) {
    const int64_t pad = row_head - int64_t{a.tq} * a.hq;
    if (pad >= int64_t{a.tq_pad - a.tq} * a.hq || lane != 0) return;
    const int64_t hm = stats_index(static_cast<int>(pad % a.hq), a.tq + static_cast<int>(pad / a.hq), a.tq_pad,
                                   a.cat_group);
    a.delta[hm] = 0.0f;
    a.lse2[hm] = 0.0f;
    return;
  }
  const int row = static_cast<int>(row_head / a.hq), head = static_cast<int>(row_head % a.hq);
  const int64_t base = row_head * a.d;  // [Tq, Hq, D] contiguous: (row * hq + head) * d
  const float lse = __ldg(a.lse + row_head);
  float dot = 0.0f;
#pragma unroll 2
  for (int c = lane * 8; c < a.d; c += kGroup * 8) {
    float g[8], o[8];
    load8_as_float<T>(a.dout, base + c, a.dout_fp32, g);
    load8_as_float<T>(a.out, base + c, a.out_fp32, o);
    if (a.dout16 != nullptr) {
      // Delta from the dout the kernels' dP = dO V^T reads: against the fp32 dout it would miss dP by dout's
      // rounding, an error that does not cancel in dS (a row with one key then gets dq != 0).
      T h[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        h[e] = from_float<T>(g[e]);
        g[e] = to_float(h[e]);
      }
      *reinterpret_cast<uint4*>(static_cast<T*>(a.dout16) + base + c) = *reinterpret_cast<const uint4*>(h);
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) dot += g[e] * o[e];
  }
  // A group's lanes take the same path; the other groups of the warp may have left (padding rows).
  const unsigned group_mask =
      kGroup == 32 ? 0xffffffffu : ((1u << kGroup) - 1) << (threadIdx.x % 32 / kGroup * kGroup);
#pragma unroll
  for (int offset = kGroup / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(group_mask, dot, offset, kGroup);
  if (lse == -INFINITY) dot = 0.0f;
  if (lane == 0) {
    const int64_t hm = stats_index(head, row, a.tq_pad, a.cat_group);
    a.delta[hm] = dot;
    a.lse2[hm] = lse == -INFINITY ? 0.0f : lse * kLog2e;
  }
  if (a.sink_kind == kSinkSSH) {
    for (int s = lane; s < a.sink_len; s += kGroup) {
      const int64_t index = (int64_t{row} * a.sink_len + s) * a.hq + head;
      a.dsink[index] = lse == -INFINITY ? 0.0f : -expf(a.sink[index] - lse) * dot;
    }
  }
}

constexpr int kReduceThreads = 256;

__global__ void dsink_sh_kernel(const float* sink, const float* lse, const float* delta, int tq_pad, int cat_group,
                                float* dsink, int tq, int hq) {
  const int index = static_cast<int>(blockIdx.x);  // s * hq + head
  const int head = index % hq;
  const float value = sink[index];
  double sum = 0.0;
  for (int row = static_cast<int>(threadIdx.x); row < tq; row += kReduceThreads) {
    const int64_t i = int64_t{row} * hq + head;
    if (lse[i] != -INFINITY)
      sum += static_cast<double>(expf(value - lse[i]) * delta[stats_index(head, row, tq_pad, cat_group)]);
  }
  __shared__ double partial[kReduceThreads];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int width = kReduceThreads / 2; width > 0; width /= 2) {
    if (static_cast<int>(threadIdx.x) < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) dsink[index] = static_cast<float>(-partial[0]);
}

// Four elements per thread: a 16-byte load, two 4-byte stores (the destination is only pair-aligned, like
// every 16-bit output of these kernels).
template <class T>
__global__ void convert_kernel(const float4* src, uint32_t* dst, int64_t n4) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= n4) return;
  const float4 v = src[i];
  dst[2 * i] = pack_pair<T>(v.x, v.y);
  dst[2 * i + 1] = pack_pair<T>(v.z, v.w);
}

// Any length and alignment: one element per thread.
template <class T>
__global__ void convert_scalar_kernel(const float* src, T* dst, int64_t n) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = from_float<T>(src[i]);
}

// dq from dq_accum in fragment order (cuda/params.hpp, dq_fragment_base): a thread takes 8 columns of the rows
// 16 w + i + {0, 8} of one consumer's half of a chunk, four consecutive threads' 16-byte fragments (64 contiguous
// bytes); neighbouring threads take neighbouring columns, so the stores of a row are contiguous. 16-bit out, or
// fp32 out (kAccumulate: added to). aligned16: dq's base is 16-byte aligned (whole 8-column stores).
template <class T, bool kFp32, bool kAccumulate>
__global__ void convert_fragments_kernel(const float* frag, void* dq, int tq, int hq, int d, int tile_d,
                                         bool aligned16) {
  const int blocks8 = tile_d / 16;  // 8-column blocks of a consumer's half
  int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= int64_t{(tq + 63) / 64} * hq * 2 * 32 * blocks8) return;
  const int nb = static_cast<int>(i % blocks8);
  i /= blocks8;
  const int row8 = static_cast<int>(i % 8), w = static_cast<int>(i / 8 % 4), consumer = static_cast<int>(i / 32 % 2);
  i /= 64;
  const int head = static_cast<int>(i % hq), chunk = static_cast<int>(i / hq);
  const int col = consumer * (tile_d / 2) + nb * 8;
  if (col >= d) return;  // the tile's columns past d (d is a multiple of 8)
  const float4* const src =
      reinterpret_cast<const float4*>(frag + dq_fragment_base(chunk, head, consumer, hq, tile_d)) + nb * 128 +
      32 * w + 4 * row8;
  float4 v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = src[k];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = chunk * 64 + 16 * w + row8 + 8 * r;
    if (row >= tq) continue;
    float x[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[2 * k] = r ? v[k].z : v[k].x;
      x[2 * k + 1] = r ? v[k].w : v[k].y;
    }
    const int64_t at = (int64_t{row} * hq + head) * d + col;
    if constexpr (kFp32) {
      float* const out = static_cast<float*>(dq) + at;
      if (aligned16) {
        float4* const out4 = reinterpret_cast<float4*>(out);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float4 y = make_float4(x[4 * h], x[4 * h + 1], x[4 * h + 2], x[4 * h + 3]);
          if constexpr (kAccumulate) {
            const float4 o = out4[h];
            y.x += o.x, y.y += o.y, y.z += o.z, y.w += o.w;
          }
          out4[h] = y;
        }
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] = kAccumulate ? out[e] + x[e] : x[e];
      }
    } else {
      uint32_t pairs[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) pairs[e] = pack_pair<T>(x[2 * e], x[2 * e + 1]);
      auto* const out = reinterpret_cast<uint32_t*>(static_cast<T*>(dq) + at);  // pair-aligned at least
      if (aligned16) {
        *reinterpret_cast<uint4*>(out) = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) out[e] = pairs[e];
      }
    }
  }
}

__global__ void add_kernel(float* dst, const float* src, int64_t n) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i < n) dst[i] += src[i];
}

}  // namespace

void launch_add(float* dst, const float* src, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  add_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(dst, src, n);
  check_launch("add_kernel");
}

void launch_convert(int dtype, const float* src, void* dst, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const auto address = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
  if (n % 4 == 0 && address(src) % 16 == 0 && address(dst) % 8 == 0) {
    const int64_t n4 = n / 4;
    const unsigned blocks = static_cast<unsigned>((n4 + 255) / 256);
    const auto* s = reinterpret_cast<const float4*>(src);
    auto* d = static_cast<uint32_t*>(dst);
    if (dtype == kBf16) convert_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(s, d, n4);
    else convert_kernel<__half><<<blocks, 256, 0, stream>>>(s, d, n4);
  } else {
    const unsigned blocks = static_cast<unsigned>((n + 255) / 256);
    if (dtype == kBf16) convert_scalar_kernel<<<blocks, 256, 0, stream>>>(src, static_cast<__nv_bfloat16*>(dst), n);
    else convert_scalar_kernel<<<blocks, 256, 0, stream>>>(src, static_cast<__half*>(dst), n);
  }
  check_launch("convert_kernel");
}

void launch_convert_fragments(int dtype, bool out_fp32, bool accumulate, const float* fragments, void* dq, int tq,
                              int hq, int d, int tile_d, cudaStream_t stream) {
  const int64_t threads = int64_t{(tq + 63) / 64} * hq * 64 * (tile_d / 16);
  if (threads == 0) return;
  const unsigned blocks = static_cast<unsigned>((threads + 255) / 256);
  const bool aligned16 = reinterpret_cast<uintptr_t>(dq) % 16 == 0;
  if (out_fp32 && accumulate)
    convert_fragments_kernel<float, true, true><<<blocks, 256, 0, stream>>>(fragments, dq, tq, hq, d, tile_d, aligned16);
  else if (out_fp32)
    convert_fragments_kernel<float, true, false><<<blocks, 256, 0, stream>>>(fragments, dq, tq, hq, d, tile_d, aligned16);
  else if (dtype == kBf16)
    convert_fragments_kernel<__nv_bfloat16, false, false>
        <<<blocks, 256, 0, stream>>>(fragments, dq, tq, hq, d, tile_d, aligned16);
  else
    convert_fragments_kernel<__half, false, false><<<blocks, 256, 0, stream>>>(fragments, dq, tq, hq, d, tile_d, aligned16);
  check_launch("convert_fragments_kernel");
}

void launch_fill(float* data, int64_t n, float value, cudaStream_t stream) {
  if (n == 0) return;
  fill_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(data, n, value);
  check_launch("fill_kernel");
}

void launch_preprocess(int dtype, const PreprocessArgs& args, cudaStream_t stream) {
  const int64_t rows = int64_t{args.tq_pad} * args.hq;  // the rows and the padding rows
  if (rows == 0) return;
  // Lanes per row: half of its D / 8 pieces, at most a warp.
  auto launch = [&](auto group) {
    constexpr int kGroup = decltype(group)::value;
    const unsigned blocks = static_cast<unsigned>((rows * kGroup + 255) / 256);
    if (dtype == kBf16) preprocess_kernel<__nv_bfloat16, kGroup><<<blocks, 256, 0, stream>>>(args);
    else preprocess_kernel<__half, kGroup><<<blocks, 256, 0, stream>>>(args);
  };
  const int pieces = args.d / 16;
  if (pieces >= 32) launch(std::integral_constant<int, 32>{});
  else if (pieces >= 16) launch(std::integral_constant<int, 16>{});
  else if (pieces >= 8) launch(std::integral_constant<int, 8>{});
  else if (pieces >= 4) launch(std::integral_constant<int, 4>{});
  else if (pieces >= 2) launch(std::integral_constant<int, 2>{});
  else launch(std::integral_constant<int, 1>{});
  check_launch("preprocess_kernel");
}

void launch_dsink_sh(const float* sink, const float* lse, const float* delta, int tq_pad, int cat_group, float* dsink,
                     int sink_len, int tq, int hq, cudaStream_t stream) {
  if (sink_len * hq == 0) return;
  dsink_sh_kernel<<<sink_len * hq, kReduceThreads, 0, stream>>>(sink, lse, delta, tq_pad, cat_group, dsink, tq, hq);
  check_launch("dsink_sh_kernel");
}

}  // namespace magi::cuda::detail

namespace magi::cuda {

void fill(float* data, int64_t n, float value, cudaStream_t stream) { detail::launch_fill(data, n, value, stream); }

void convert(const float* src, void* dst, HalfType type, int64_t n, cudaStream_t stream) {
  detail::launch_convert(type == HalfType::BF16 ? detail::kBf16 : detail::kFp16, src, dst, n, stream);
}

}  // namespace magi::cuda
