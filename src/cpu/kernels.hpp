// Register-blocked micro-kernels of the CPU engine, written with GCC/Clang vector extensions so the same
// code compiles to AVX2/AVX-512 or SSE depending on -march. T is the compute type (float or double).
//
// One product shape serves every matmul of attention: C = A^T B with both operands "k-major" (the
// summed index is their row index). Q, dO, K, V are packed transposed per tile for the logits, and the
// probabilities are produced in whichever orientation the next product consumes, so nothing is
// transposed on the fly.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <utility>

namespace magi::cpu {

// Vector width and register blocking follow the compile target (-march / MAGI_ATTN_CPU_ARCH): AVX-512
// has 32 registers of 64 bytes, AVX2 16 of 32 bytes. MR x 2 accumulators leave room for the operands.
// The tile sizes (plan.hpp) are multiples of every W and MR below.
#if defined(__AVX512F__)
inline constexpr int kVectorBytes = 64;
inline constexpr int kBlockRows = 12;
#elif defined(__AVX__)
inline constexpr int kVectorBytes = 32;
inline constexpr int kBlockRows = 6;
#else  // SSE / NEON: 16-byte vectors, 16 or more registers
inline constexpr int kVectorBytes = 16;
inline constexpr int kBlockRows = 6;
#endif
inline constexpr int kBlockVecs = 2;

// One vector of T.
template <class T>
struct Simd {
  static constexpr int W = kVectorBytes / static_cast<int>(sizeof(T));
  typedef T V __attribute__((vector_size(kVectorBytes)));

  static V load(const T* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(T* p, V v) { std::memcpy(p, &v, sizeof v); }
  // {x, x, ...}: compiles to one broadcast (x + V{} would add a scalar 0 first, element stores worse).
  static V splat(T x) { return splat_of(x, std::make_index_sequence<W>{}); }

 private:
  template <size_t... I>
  static V splat_of(T x, std::index_sequence<I...>) {
    return V{((void)I, x)...};
  }
};

// C[r][c] (+)= sum_k A[k][r] * B[k][c] for an MR x (NV * W) block. Both operands are k-major, so each
// step broadcasts MR consecutive elements of one A row and loads NV vectors of one B row.
// Not inlined: inside the big task functions the register allocator spilled the accumulators.
template <class T, int MR, int NV, bool Accumulate>
__attribute__((noinline)) void kmajor_block(const T* a, int64_t lda, const T* b, int64_t ldb, int kdim, T* c,
                                            int64_t ldc) {
  using S = Simd<T>;
  using V = typename S::V;
  V acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Accumulate ? S::load(c + r * ldc + v * S::W) : V{};
  for (int k = 0; k < kdim; ++k) {
    V bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = S::load(b + v * S::W);
    for (int r = 0; r < MR; ++r) {
      const V x = S::splat(a[r]);
      for (int v = 0; v < NV; ++v) acc[r][v] += x * bv[v];
    }
    a += lda;
    b += ldb;
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) S::store(c + r * ldc + v * S::W, acc[r][v]);
}

template <class T>
using BlockKernel = void (*)(const T*, int64_t, const T*, int64_t, int, T*, int64_t);

// Kernels for every edge shape: [vecs - 1][accumulate][rows - 1].
template <class T, int NV, bool Accumulate, size_t... R>
constexpr std::array<BlockKernel<T>, sizeof...(R)> rows_table(std::index_sequence<R...>) {
  return {&kmajor_block<T, static_cast<int>(R) + 1, NV, Accumulate>...};
}
template <class T>
inline constexpr std::array<std::array<std::array<BlockKernel<T>, kBlockRows>, 2>, kBlockVecs> kEdgeKernels =
    {{
        {{rows_table<T, 1, false>(std::make_index_sequence<kBlockRows>{}),
          rows_table<T, 1, true>(std::make_index_sequence<kBlockRows>{})}},
        {{rows_table<T, 2, false>(std::make_index_sequence<kBlockRows>{}),
          rows_table<T, 2, true>(std::make_index_sequence<kBlockRows>{})}},
    }};
static_assert(kBlockVecs == 2, "kEdgeKernels lists one entry per vector count");

// C[m][n] (+)= A^T B with A [kdim][m] (leading dimension lda) and B [kdim][n] (ldb); n a multiple of W.
// Column panels outside, so one B panel (kdim x NV*W) stays in L1 while the row blocks stream.
// Each C element is one fused multiply-add chain over k in order, whatever the blocking: equal inputs
// give equal bits in every pass and item shape.
template <class T>
void gemm_kmajor(const T* a, int64_t lda, int m, const T* b, int64_t ldb, int kdim, int n, T* c, int64_t ldc,
                 bool accumulate) {
  constexpr int W = Simd<T>::W;
  for (int c0 = 0; c0 < n; c0 += kBlockVecs * W) {
    const int vecs = std::min(kBlockVecs, (n - c0) / W);
    for (int r0 = 0; r0 < m; r0 += kBlockRows) {
      const int rows = std::min(kBlockRows, m - r0);
      T* block = c + r0 * ldc + c0;
      if (rows == kBlockRows && vecs == kBlockVecs) {
        if (accumulate)
          kmajor_block<T, kBlockRows, kBlockVecs, true>(a + r0, lda, b + c0, ldb, kdim, block, ldc);
        else
          kmajor_block<T, kBlockRows, kBlockVecs, false>(a + r0, lda, b + c0, ldb, kdim, block, ldc);
      } else {
        kEdgeKernels<T>[vecs - 1][accumulate ? 1 : 0][rows - 1](a + r0, lda, b + c0, ldb, kdim, block, ldc);
      }
    }
  }
}

// a . b with exactly the arithmetic of gemm_nt (the same instruction sequence per lane), so that
// Delta = dO . out cancels dP = dO . v bit for bit in a row that reads a single key (its gradient is
// then exactly 0, as in exact arithmetic). `column` is scratch of depth * W elements, zero except in
// lane 0 (which this call overwrites).
template <class T>
T gemm_dot(const T* a, const T* b, int depth, T* column) {
  constexpr int W = Simd<T>::W;
  for (int d = 0; d < depth; ++d) column[d * W] = b[d];
  T result[W];
  kmajor_block<T, 1, 1, false>(a, 1, column, W, depth, result, W);
  return result[0];
}

// ---- exp ----
// exp(x) for x <= 0 (scores minus a row maximum or lse): Cody-Waite range reduction and a degree-5
// polynomial (Cephes expf coefficients), about 1 ulp; exactly 0 below the float range (incl. -inf).
inline Simd<float>::V exp_nonpositive(Simd<float>::V x) {
  using V = Simd<float>::V;
  typedef int32_t VI __attribute__((vector_size(kVectorBytes)));
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kShifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const auto underflow = x < -87.0f;
  x = underflow ? V{} - 87.0f : x;
  x = x > 88.0f ? V{} + 88.0f : x;
  const V t = x * kLog2e + kShifter;
  const V n = t - kShifter;
  const V r = x - n * kLn2Hi - n * kLn2Lo;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const V result = p * scale;
  return underflow ? V{} : result;
}

// row[j] = exp(row[j] - shift) for j < n (n a multiple of W); returns the sum.
inline float exp_shift_sum(float* row, int n, float shift) {
  using S = Simd<float>;
  S::V sum{};
  for (int j = 0; j < n; j += S::W) {
    const S::V e = exp_nonpositive(S::load(row + j) - shift);
    S::store(row + j, e);
    sum += e;
  }
  float total = 0.0f;
  for (int i = 0; i < S::W; ++i) total += sum[i];
  return total;
}

inline double exp_shift_sum(double* row, int n, double shift) {
  double total = 0.0;
  for (int j = 0; j < n; ++j) {
    row[j] = std::exp(row[j] - shift);
    total += row[j];
  }
  return total;
}

// ---- softcap ----
// tanh for floats: odd polynomial below 0.625 (Cephes tanhf coefficients), (1 - e) / (1 + e) with
// e = exp(-2|x|) above (no cancellation there); about 2 ulp.
inline Simd<float>::V tanh_float(Simd<float>::V x) {
  using V = Simd<float>::V;
  const V ax = x < 0.0f ? -x : x;
  const V z = x * x;
  V p = V{} - 5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const V small = p * z * x + x;
  const V e = exp_nonpositive(ax * -2.0f);
  V large = (1.0f - e) / (1.0f + e);
  large = x < 0.0f ? -large : large;
  return ax < 0.625f ? small : large;
}

// x[i] = cap * tanh(x[i] / cap) and, when slope is given, slope[i] = 1 - tanh^2 (= ds/du), i < count
// (a multiple of W for floats).
inline void softcap_inplace(float* x, float* slope, int count, float cap) {
  using S = Simd<float>;
  for (int i = 0; i < count; i += S::W) {
    const S::V t = tanh_float(S::load(x + i) / cap);
    S::store(x + i, t * cap);
    if (slope) S::store(slope + i, 1.0f - t * t);
  }
}

inline void softcap_inplace(double* x, double* slope, int count, double cap) {
  for (int i = 0; i < count; ++i) {
    const double t = std::tanh(x[i] / cap);
    x[i] = cap * t;
    if (slope) slope[i] = 1.0 - t * t;
  }
}

// Column-wise forms for probabilities stored transposed (one column per query row):
// x[c] = exp(x[c] - shift[c]), and sum[c] += x[c] when sum is given; c < count, a multiple of W.
inline void exp_sub_columns(float* x, const float* shift, float* sum, int count) {
  using S = Simd<float>;
  for (int c = 0; c < count; c += S::W) {
    const S::V e = exp_nonpositive(S::load(x + c) - S::load(shift + c));
    S::store(x + c, e);
    if (sum) S::store(sum + c, S::load(sum + c) + e);
  }
}

inline void exp_sub_columns(double* x, const double* shift, double* sum, int count) {
  for (int c = 0; c < count; ++c) {
    x[c] = std::exp(x[c] - shift[c]);
    if (sum) sum[c] += x[c];
  }
}

// m[c] = max(m[c], x[c]) for c < count, a multiple of W.
template <class T>
inline void max_columns(T* m, const T* x, int count) {
  using S = Simd<T>;
  for (int c = 0; c < count; c += S::W) {
    const typename S::V a = S::load(m + c), b = S::load(x + c);
    S::store(m + c, b > a ? b : a);
  }
}

template <class T>
T row_max(const T* row, int n) {
  using S = Simd<T>;
  typename S::V m = S::splat(-std::numeric_limits<T>::infinity());
  for (int j = 0; j < n; j += S::W) {
    const typename S::V x = S::load(row + j);
    m = x > m ? x : m;
  }
  T result = m[0];
  for (int i = 1; i < S::W; ++i) result = std::max<T>(result, m[i]);
  return result;
}

// ---- buffers ----
// A 64-byte-aligned array of T (scratch and packed operands).
template <class T>
class AlignedArray {
 public:
  AlignedArray() = default;
  explicit AlignedArray(size_t count, T fill = T(0)) { reset(count, fill); }
  void reset(size_t count, T fill = T(0)) {
    const size_t bytes = std::max<size_t>(64, (count * sizeof(T) + 63) / 64 * 64);
    data_.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
    if (!data_) throw std::bad_alloc();
    size_ = count;
    std::fill(data_.get(), data_.get() + count, fill);
  }
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T[], Free> data_;
  size_t size_ = 0;
};

}  // namespace magi::cpu
