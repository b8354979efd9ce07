// Conversion between caller tensors (any dtype, [T, H, D]) and the engine's packed per-head buffers in
// the compute type, plus the sink's log-sum-exp. Packing costs O(T * H * D), negligible next to attention.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/kernels.hpp"
#include "magi/attention.hpp"
#include "magi/tensor.hpp"

namespace magi::cpu {

template <class T>
inline void load_row(const TensorView& x, int64_t offset, int n, T scale, T* dst) {
  switch (x.dtype) {
    case DType::F64: {
      const double* p = x.as<const double>() + offset;
      for (int i = 0; i < n; ++i) dst[i] = static_cast<T>(p[i] * scale);
      break;
    }
    case DType::F32: {
      const float* p = x.as<const float>() + offset;
      for (int i = 0; i < n; ++i) dst[i] = static_cast<T>(p[i]) * scale;
      break;
    }
    case DType::BF16: {
      const uint16_t* p = x.as<const uint16_t>() + offset;
      for (int i = 0; i < n; ++i) dst[i] = static_cast<T>(bf16_bits_to_float(p[i])) * scale;
      break;
    }
    case DType::F16: {
      const uint16_t* p = x.as<const uint16_t>() + offset;
      for (int i = 0; i < n; ++i) dst[i] = static_cast<T>(fp16_bits_to_float(p[i])) * scale;
      break;
    }
  }
}

// Writes src[i] * scale in x's dtype (16-bit outputs rounded to nearest even).
template <class T>
inline void store_row(const T* src, T scale, const TensorView& x, int64_t offset, int n) {
  switch (x.dtype) {
    case DType::F64: {
      double* p = x.as<double>() + offset;
      for (int i = 0; i < n; ++i) p[i] = static_cast<double>(src[i] * scale);
      break;
    }
    case DType::F32: {
      float* p = x.as<float>() + offset;
      for (int i = 0; i < n; ++i) p[i] = static_cast<float>(src[i] * scale);
      break;
    }
    case DType::BF16: {
      uint16_t* p = x.as<uint16_t>() + offset;
      for (int i = 0; i < n; ++i) p[i] = float_to_bf16_bits(static_cast<float>(src[i] * scale));
      break;
    }
    case DType::F16: {
      uint16_t* p = x.as<uint16_t>() + offset;
      for (int i = 0; i < n; ++i) p[i] = float_to_fp16_bits(static_cast<float>(src[i] * scale));
      break;
    }
  }
}

template <class T>
inline T load_scalar(const TensorView& x, int64_t index) {
  T value{};
  load_row<T>(x, index, 1, T(1), &value);
  return value;
}

template <class T>
inline void store_scalar(T value, const TensorView& x, int64_t index) {
  store_row<T>(&value, T(1), x, index, 1);
}

// Row length of packed rows: D rounded up to whole vectors of every compute type (D is a multiple of 8,
// the AVX-512 float vector is 16), so products over D need no partial vectors.
inline int64_t padded_row(int64_t dim) {
  const int64_t w = Simd<float>::W;
  return (dim + w - 1) / w * w;
}

// Packed operands and per-call arrays, kept per calling thread and reused across calls: fresh
// allocations of tens of MB were page-faulted on every call, a third of the time of sparse masks at 32k
// tokens. Buffers only grow; their contents are never assumed (packing writes every element it reads).
template <class T>
class Workspace {
 public:
  enum Slot : int { Q, K, V, DOut, QT, KT, VT, DOutT, Lse, Delta, kSlots };
  T* get(Slot slot, int64_t count) {
    AlignedArray<T>& buffer = buffers_[slot];
    if (buffer.size() < static_cast<size_t>(count)) buffer.reset(static_cast<size_t>(count));
    return buffer.data();
  }
  static Workspace& of_this_thread() {
    thread_local Workspace workspace;
    return workspace;
  }

 private:
  AlignedArray<T> buffers_[kSlots];
};

// x [tokens, heads, dim] -> packed [heads][tokens][row_stride], zero padded past dim.
template <class T>
void pack_rows(const TensorView& x, int64_t row_stride, int threads, T* packed) {
  const int64_t tokens = x.shape[0], heads = x.shape[1], dim = x.shape[2];
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      T* row = packed + (h * tokens + t) * row_stride;
      load_row<T>(x, (t * heads + h) * dim, static_cast<int>(dim), T(1), row);
      std::fill(row + dim, row + row_stride, T(0));
    }
}

// Keys (or values) transposed per tile: x [tokens, heads, dim] -> [heads][tiles][dim][ld], ld >= tile,
// zero-padded past the last token and in columns [tile, ld) so a vector read past an item's end is safe.
struct TransposedLayout {
  int64_t tile = 0;
  int64_t ld = 0;
  int64_t tiles = 0;
  int64_t dim = 0;
  int64_t offset(int64_t head, int64_t tile_index) const { return ((head * tiles + tile_index) * dim) * ld; }
};

// Tiles of `tile` tokens, one vector of padding columns.
inline TransposedLayout transposed_layout(int64_t tokens, int64_t tile, int64_t dim) {
  TransposedLayout layout;
  layout.tile = tile;
  layout.ld = tile + Simd<float>::W;
  layout.tiles = (tokens + tile - 1) / tile;
  layout.dim = dim;
  return layout;
}

template <class T>
void pack_transposed(const TensorView& x, const TransposedLayout& layout, int threads, T* packed) {
  const int64_t tokens = x.shape[0], heads = x.shape[1], dim = x.shape[2];
#pragma omp parallel num_threads(threads)
  {
    AlignedArray<T> row(static_cast<size_t>(dim));
#pragma omp for schedule(static)
    for (int64_t ht = 0; ht < heads * layout.tiles; ++ht) {
      const int64_t h = ht / layout.tiles, t = ht % layout.tiles;
      T* dst = packed + layout.offset(h, t);
      const int64_t count = std::min(tokens, (t + 1) * layout.tile) - t * layout.tile;
      for (int64_t j = 0; j < count; ++j) {
        load_row<T>(x, ((t * layout.tile + j) * heads + h) * dim, static_cast<int>(dim), T(1), row.data());
        for (int64_t d = 0; d < dim; ++d) dst[d * layout.ld + j] = row[d];
      }
      for (int64_t d = 0; d < dim; ++d)
        std::fill(dst + d * layout.ld + count, dst + (d + 1) * layout.ld, T(0));
    }
  }
}

template <class T>
int64_t transposed_size(const TransposedLayout& layout, int64_t heads) {
  return heads * layout.tiles * layout.dim * layout.ld;
}

// log(sum_s exp(sink_s)) for query row q and head h, or -inf without a sink.
template <class T>
inline T sink_lse(const TensorView& sink, SinkLayout layout, int64_t q, int64_t h, int64_t heads_q) {
  if (layout == SinkLayout::None || !sink.defined()) return -std::numeric_limits<T>::infinity();
  const int64_t count = layout == SinkLayout::SH ? sink.shape[0] : sink.shape[1];
  const float* base = sink.as<const float>() + (layout == SinkLayout::SSH ? q * count * heads_q : 0);
  T hi = -std::numeric_limits<T>::infinity();
  for (int64_t s = 0; s < count; ++s) hi = std::max<T>(hi, base[s * heads_q + h]);
  if (hi == -std::numeric_limits<T>::infinity()) return hi;
  T sum = 0;
  for (int64_t s = 0; s < count; ++s) sum += std::exp(static_cast<T>(base[s * heads_q + h]) - hi);
  return hi + std::log(sum);
}

// "All cores" is OpenMP's default team, capped: OMP_NUM_THREADS=100000 crashed its runtime.
inline int resolve_threads(int32_t requested) {
  return requested > 0 ? requested : std::min(omp_get_max_threads(), static_cast<int>(kMaxThreads));
}

}  // namespace magi::cpu
