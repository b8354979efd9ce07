// Backward, deterministic by construction: pass A runs one task per (k tile, kv head) and accumulates
// dk, dv over that tile's items and the q heads of its group in a fixed order; pass B runs one task per
// (q tile, q head) and accumulates dq, recomputing the probabilities. No task writes another's output,
// so the bits never depend on the thread count or schedule.
//
// With s = softcap(scale q.k) and P = exp(s - lse~) (lse~ includes the sink):
//   dP = dO v^T,  dS = P (dP - Delta),  Delta = dO . out~,  dU = dS * ds/du  (1 - (s/c)^2 with softcap)
//   dv = P^T dO,  dk = scale dU^T q,  dq = scale dU k,  dsink = -sum_i exp(sink - lse~_i) Delta_i.
#include <omp.h>

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "cpu/engine.hpp"
#include "cpu/kernels.hpp"
#include "cpu/pack.hpp"
#include "cpu/plan.hpp"

namespace magi::cpu {
namespace {

template <class T>
constexpr T kNegInf = -std::numeric_limits<T>::infinity();

inline int round_up(int x, int multiple) { return (x + multiple - 1) / multiple * multiple; }

template <class T>
struct BackwardInputs {
  const Plan& plan;
  const EngineOptions& options;
  int64_t total_q, total_k, heads_q, heads_kv, dim;
  int64_t row_stride;  // D rounded up to whole vectors (zero padded)
  const T* q;          // [Hq][Tq][row_stride]
  const T* dout;       // [Hq][Tq][row_stride]
  const T* k;          // [Hkv][Tk][row_stride]
  const T* qt;         // transposed q tiles
  const T* dot;        // transposed dO tiles
  TransposedLayout q_layout;
  const T* kt;  // transposed key tiles
  const T* vt;  // transposed value tiles
  TransposedLayout k_layout;
  const T* lse;    // [Hq][Tq] (lse~)
  const T* delta;  // [Hq][Tq]
};

template <class T>
struct BackwardScratch {
  int64_t ld;                    // tile + one vector: columns of every scratch matrix
  AlignedArray<T> probs;         // pass A: P [tile_q][ld];  pass B: P^T [tile_k][ld]
  AlignedArray<T> grads;         // dP, then dU, in the orientation of probs
  AlignedArray<T> slope;         // softcap derivative ds/du, same orientation
  AlignedArray<T> acc_a;         // [max(tile_q, tile_k)][row_stride]: dq, or dk
  AlignedArray<T> acc_b;         // [tile_k][row_stride]: dv
  AlignedArray<T> shift, delta;  // [ld] per-column lse and Delta (pass B)

  BackwardScratch(const TileConfig& tiles, int64_t row_stride) {
    const int64_t tile = std::max(tiles.tile_q, tiles.tile_k);
    ld = tile + Simd<float>::W;
    probs.reset(static_cast<size_t>(tile * ld));
    grads.reset(static_cast<size_t>(tile * ld));
    slope.reset(static_cast<size_t>(tile * ld));
    acc_a.reset(static_cast<size_t>(tile * row_stride));
    acc_b.reset(static_cast<size_t>(tiles.tile_k * row_stride));
    shift.reset(static_cast<size_t>(ld));
    delta.reset(static_cast<size_t>(ld));
  }
};

// Columns [keep_begin, keep_end) of the item's keys kept by query row q.
inline std::pair<int, int> kept_columns(const tiling::TileWork& w, const Slice& slice, int32_t q) {
  const int n = w.k.size();
  if (!w.needs_mask) return {0, n};
  const Range kept = kept_keys(slice, q);
  const int begin = std::clamp(kept.start - w.k.start, 0, n);
  return {begin, std::clamp(kept.end - w.k.start, begin, n)};
}

// Pass A, one item and one q head: probs <- P [m][n], grads <- dU [m][n] (row per query; zero where not
// kept). The logits are bitwise those of the forward (same fused chains, same scale and softcap).
template <class T>
void item_grads_by_row(const BackwardInputs<T>& in, const tiling::TileWork& w, int64_t head, int64_t kv_head,
                       BackwardScratch<T>& s) {
  constexpr int W = Simd<T>::W;
  const int64_t D = in.dim;
  const int m = w.q.size(), n = w.k.size(), n_padded = round_up(n, W);
  const int32_t tile_q = in.plan.tiles.tile_q, tile_k = in.plan.tiles.tile_k;
  const int64_t q_tile = w.q.start / tile_q, i0 = w.q.start - q_tile * tile_q;
  const int64_t k_tile = w.k.start / tile_k, j0 = w.k.start - k_tile * tile_k;
  const Slice& slice = in.plan.mask.slices[w.slice];
  const T softcap = static_cast<T>(in.options.softcap);
  const T scale = static_cast<T>(in.options.softmax_scale);
  const int64_t ld = s.ld;
  T* p_all = s.probs.data();
  T* dp_all = s.grads.data();

  const int64_t q_at = in.q_layout.offset(head, q_tile) + i0, k_at = in.k_layout.offset(kv_head, k_tile) + j0;
  gemm_kmajor(in.qt + q_at, in.q_layout.ld, m, in.kt + k_at, in.k_layout.ld, static_cast<int>(D), n_padded,
              p_all, ld, false);
  gemm_kmajor(in.dot + q_at, in.q_layout.ld, m, in.vt + k_at, in.k_layout.ld, static_cast<int>(D), n_padded,
              dp_all, ld, false);

  const int64_t row0 = head * in.total_q + w.q.start;
  for (int r = 0; r < m; ++r) {
    T* p = p_all + r * ld;
    T* dp = dp_all + r * ld;
    const T lse = in.lse[row0 + r];
    const auto [keep_begin, keep_end] = kept_columns(w, slice, w.q.start + r);
    if (lse == kNegInf<T> || keep_begin == keep_end) {  // nothing kept: no gradient flows
      std::fill(p, p + n_padded, T(0));
      std::fill(dp, dp + n_padded, T(0));
      continue;
    }
    T* slope = s.slope.data();
    for (int j = 0; j < n_padded; ++j) p[j] *= scale;
    if (softcap > 0) softcap_inplace(p, slope, n_padded, softcap);  // slope = ds/du
    std::fill(p, p + keep_begin, kNegInf<T>);
    std::fill(p + keep_end, p + n_padded, kNegInf<T>);
    exp_shift_sum(p, n_padded, lse);
    const T delta = in.delta[row0 + r];
    if (softcap > 0) {
      for (int j = keep_begin; j < keep_end; ++j) dp[j] = p[j] * (dp[j] - delta) * slope[j];
      std::fill(dp, dp + keep_begin, T(0));
      std::fill(dp + keep_end, dp + n_padded, T(0));
    } else {
      // P is 0 outside the kept columns and dP is finite there (zero-padded operands), so dU is 0.
      for (int j = 0; j < n_padded; ++j) dp[j] = p[j] * (dp[j] - delta);
    }
  }
}

// Pass B, one item: probs <- P^T [n][m], grads <- dU^T [n][m] (column per query; zero where not kept).
template <class T>
void item_grads_by_column(const BackwardInputs<T>& in, const tiling::TileWork& w, int64_t head,
                          int64_t kv_head, BackwardScratch<T>& s) {
  constexpr int W = Simd<T>::W;
  const int64_t D = in.dim;
  const int m = w.q.size(), n = w.k.size(), m_padded = round_up(m, W);
  const int32_t tile_q = in.plan.tiles.tile_q, tile_k = in.plan.tiles.tile_k;
  const int64_t q_tile = w.q.start / tile_q, i0 = w.q.start - q_tile * tile_q;
  const int64_t k_tile = w.k.start / tile_k, j0 = w.k.start - k_tile * tile_k;
  const Slice& slice = in.plan.mask.slices[w.slice];
  const T softcap = static_cast<T>(in.options.softcap);
  const T scale = static_cast<T>(in.options.softmax_scale);
  const int64_t ld = s.ld;
  T* pt = s.probs.data();
  T* dpt = s.grads.data();
  T* slope = s.slope.data();

  const int64_t q_at = in.q_layout.offset(head, q_tile) + i0, k_at = in.k_layout.offset(kv_head, k_tile) + j0;
  gemm_kmajor(in.kt + k_at, in.k_layout.ld, n, in.qt + q_at, in.q_layout.ld, static_cast<int>(D), m_padded,
              pt, ld, false);
  gemm_kmajor(in.vt + k_at, in.k_layout.ld, n, in.dot + q_at, in.q_layout.ld, static_cast<int>(D), m_padded,
              dpt, ld, false);

  // Per column: lse as the shift (+inf where the row is empty or past the item, so P = 0) and Delta.
  const int64_t row0 = head * in.total_q + w.q.start;
  for (int c = 0; c < m_padded; ++c) {
    const T lse = c < m ? in.lse[row0 + c] : kNegInf<T>;
    s.shift[c] = lse == kNegInf<T> ? std::numeric_limits<T>::infinity() : lse;
    s.delta[c] = c < m ? in.delta[row0 + c] : T(0);
  }
  for (int j = 0; j < n; ++j) {
    T* row = pt + j * ld;
    for (int c = 0; c < m_padded; ++c) row[c] *= scale;
    if (softcap > 0) softcap_inplace(row, slope + j * ld, m_padded, softcap);
  }
  if (w.needs_mask)
    for (int c = 0; c < m; ++c) {
      const auto [keep_begin, keep_end] = kept_columns(w, slice, w.q.start + c);
      for (int j = 0; j < keep_begin; ++j) pt[j * ld + c] = kNegInf<T>;
      for (int j = keep_end; j < n; ++j) pt[j * ld + c] = kNegInf<T>;
    }
  for (int j = 0; j < n; ++j) {
    T* p = pt + j * ld;
    T* dp = dpt + j * ld;
    exp_sub_columns(p, s.shift.data(), static_cast<T*>(nullptr), m_padded);
    if (softcap > 0) {
      const T* sl = slope + j * ld;
      for (int c = 0; c < m_padded; ++c) dp[c] = p[c] * (dp[c] - s.delta[c]) * sl[c];
    } else {
      for (int c = 0; c < m_padded; ++c) dp[c] = p[c] * (dp[c] - s.delta[c]);
    }
  }
}

// Pass A: dk, dv of key tile `tile` for kv head `kv_head`.
template <class T>
void dkdv_task(const BackwardInputs<T>& in, int32_t tile, int64_t kv_head, BackwardScratch<T>& s,
               const BackwardArgs& args) {
  const Plan& plan = in.plan;
  const int64_t D = in.dim, Dp = in.row_stride;
  const int32_t tile_k = plan.tiles.tile_k;
  const int32_t k0 = tile * tile_k;
  const int32_t keys = static_cast<int32_t>(std::min<int64_t>(tile_k, in.total_k - k0));
  const int64_t group = in.heads_q / in.heads_kv;
  T* dk = s.acc_a.data();
  T* dv = s.acc_b.data();
  std::fill(dk, dk + keys * Dp, T(0));
  std::fill(dv, dv + keys * Dp, T(0));

  for (int64_t i = plan.by_k.offsets[tile]; i < plan.by_k.offsets[tile + 1]; ++i) {
    const tiling::TileWork& w = plan.by_k.items[i];
    const int m = w.q.size(), n = w.k.size();
    const int j0 = w.k.start - k0;
    for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
      item_grads_by_row<T>(in, w, head, kv_head, s);
      const int64_t row0 = head * in.total_q + w.q.start;
      // dv[n][D] += P^T dO[m][D];  dk[n][D] += dU^T q[m][D]  (scaled when stored); P, dU are k-major.
      gemm_kmajor(s.probs.data(), s.ld, n, in.dout + row0 * Dp, Dp, m, static_cast<int>(Dp), dv + j0 * Dp, Dp,
                  true);
      gemm_kmajor(s.grads.data(), s.ld, n, in.q + row0 * Dp, Dp, m, static_cast<int>(Dp), dk + j0 * Dp, Dp,
                  true);
    }
  }
  const T scale = static_cast<T>(in.options.softmax_scale);
  for (int32_t j = 0; j < keys; ++j) {
    const int64_t offset = ((k0 + j) * in.heads_kv + kv_head) * D;
    store_row<T>(dk + j * Dp, scale, args.dk, offset, static_cast<int>(D));
    store_row<T>(dv + j * Dp, T(1), args.dv, offset, static_cast<int>(D));
  }
}

// Pass B: dq of q tile `tile` for q head `head`.
template <class T>
void dq_task(const BackwardInputs<T>& in, int32_t tile, int64_t head, BackwardScratch<T>& s,
             const BackwardArgs& args) {
  const Plan& plan = in.plan;
  const int64_t D = in.dim, Dp = in.row_stride;
  const int32_t tile_q = plan.tiles.tile_q;
  const int32_t q0 = tile * tile_q;
  const int32_t rows = static_cast<int32_t>(std::min<int64_t>(tile_q, in.total_q - q0));
  const int64_t kv_head = head / (in.heads_q / in.heads_kv);
  T* dq = s.acc_a.data();
  std::fill(dq, dq + rows * Dp, T(0));

  for (int64_t i = plan.by_q.offsets[tile]; i < plan.by_q.offsets[tile + 1]; ++i) {
    const tiling::TileWork& w = plan.by_q.items[i];
    const int m = w.q.size(), n = w.k.size();
    item_grads_by_column<T>(in, w, head, kv_head, s);
    // dq[m][D] += dU[m][n] k[n][D]  (grads holds dU^T, k-major)
    gemm_kmajor(s.grads.data(), s.ld, m, in.k + (kv_head * in.total_k + w.k.start) * Dp, Dp, n,
                static_cast<int>(Dp), dq + (w.q.start - q0) * Dp, Dp, true);
  }
  const T scale = static_cast<T>(in.options.softmax_scale);
  for (int32_t r = 0; r < rows; ++r)
    store_row<T>(dq + r * Dp, scale, args.dq, ((q0 + r) * in.heads_q + head) * D, static_cast<int>(D));
}

template <class T>
void backward_impl(const Plan& plan, const BackwardArgs& args, const EngineOptions& options) {
  const int threads = resolve_threads(options.num_threads);
  const int64_t total_q = args.q.shape[0], heads_q = args.q.shape[1], dim = args.q.shape[2];
  const int64_t total_k = args.k.shape[0], heads_kv = args.k.shape[1];

  const TransposedLayout q_layout = transposed_layout(total_q, plan.tiles.tile_q, dim);
  const TransposedLayout k_layout = transposed_layout(total_k, plan.tiles.tile_k, dim);
  const int64_t row_stride = padded_row(dim);
  Workspace<T>& ws = Workspace<T>::of_this_thread();
  using Slot = typename Workspace<T>::Slot;
  auto rows_buffer = [&](Slot slot, const TensorView& x) {
    T* p = ws.get(slot, x.shape[0] * x.shape[1] * row_stride);
    pack_rows<T>(x, row_stride, threads, p);
    return p;
  };
  auto transposed_buffer = [&](Slot slot, const TensorView& x, const TransposedLayout& layout) {
    T* p = ws.get(slot, transposed_size<T>(layout, x.shape[1]));
    pack_transposed<T>(x, layout, threads, p);
    return p;
  };
  const T* q = rows_buffer(Workspace<T>::Q, args.q);
  const T* dout = rows_buffer(Workspace<T>::DOut, args.dout);
  const T* k = rows_buffer(Workspace<T>::K, args.k);
  const T* qt = transposed_buffer(Workspace<T>::QT, args.q, q_layout);
  const T* dot = transposed_buffer(Workspace<T>::DOutT, args.dout, q_layout);
  const T* kt = transposed_buffer(Workspace<T>::KT, args.k, k_layout);
  const T* vt = transposed_buffer(Workspace<T>::VT, args.v, k_layout);

  // lse~ and Delta = dO . out~ per (head, row); rows with lse = -inf get Delta 0.
  T* lse = ws.get(Workspace<T>::Lse, heads_q * total_q);
  T* delta = ws.get(Workspace<T>::Delta, heads_q * total_q);
#pragma omp parallel num_threads(threads)
  {
    AlignedArray<T> out_row(static_cast<size_t>(dim));
    AlignedArray<T> column(static_cast<size_t>(dim * Simd<T>::W));
#pragma omp for schedule(static)
    for (int64_t row = 0; row < total_q; ++row)
      for (int64_t h = 0; h < heads_q; ++h) {
        const T l = load_scalar<T>(args.lse, row * heads_q + h);
        load_row<T>(args.out, (row * heads_q + h) * dim, static_cast<int>(dim), T(1), out_row.data());
        const T* d_row = dout + (h * total_q + row) * row_stride;
        const T dot = gemm_dot(d_row, out_row.data(), static_cast<int>(dim), column.data());
        lse[h * total_q + row] = l;
        delta[h * total_q + row] = l == kNegInf<T> ? T(0) : dot;
      }
  }

  const BackwardInputs<T> in{plan, options, total_q,  total_k, heads_q, heads_kv, dim, row_stride, q, dout, k,
                             qt,   dot,     q_layout, kt,      vt,      k_layout, lse, delta};
  const int64_t k_tiles = static_cast<int64_t>(plan.k_tile_order.size());
  const int64_t q_tiles = static_cast<int64_t>(plan.q_tile_order.size());
  // Scratch allocated here, not in the parallel region, so that an allocation failure propagates.
  std::vector<BackwardScratch<T>> scratches;
  scratches.reserve(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) scratches.emplace_back(plan.tiles, row_stride);
#pragma omp parallel num_threads(threads)
  {
    BackwardScratch<T>& scratch = scratches[static_cast<size_t>(omp_get_thread_num())];
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t task = 0; task < k_tiles * heads_kv; ++task)
      dkdv_task<T>(in, plan.k_tile_order[task / heads_kv], task % heads_kv, scratch, args);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < q_tiles * heads_q; ++task)
      dq_task<T>(in, plan.q_tile_order[task / heads_q], task % heads_q, scratch, args);
  }

  // dsink: each head's sum over rows in row order (sh), or per row (ssh).
  if (options.sink_layout != SinkLayout::None && args.sink.defined()) {
    const bool shared = options.sink_layout == SinkLayout::SH;
    const int64_t count = shared ? args.sink.shape[0] : args.sink.shape[1];
    const float* sink = args.sink.as<const float>();
    float* dsink = args.dsink.as<float>();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t hs = 0; hs < heads_q * count; ++hs) {
      const int64_t h = hs / count, sidx = hs % count;
      double total = 0;
      for (int64_t row = 0; row < total_q; ++row) {
        const double l = lse[h * total_q + row];
        const int64_t at = shared ? sidx * heads_q + h : (row * count + sidx) * heads_q + h;
        const double term =
            l == kNegInf<T> ? 0.0 : -std::exp(double{sink[at]} - l) * delta[h * total_q + row];
        if (shared)
          total += term;
        else
          dsink[at] = static_cast<float>(term);
      }
      if (shared) dsink[sidx * heads_q + h] = static_cast<float>(total);
    }
  }
}

}  // namespace

void backward(const Plan& plan, const BackwardArgs& args, const EngineOptions& options) {
  if (options.accumulate_fp64)
    backward_impl<double>(plan, args, options);
  else
    backward_impl<float>(plan, args, options);
}

}  // namespace magi::cpu
