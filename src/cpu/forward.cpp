// Forward: one task per (q tile, q head); each runs one online softmax over every item of its tile, so
// rows shared by several slices (q-overlap) are merged exactly. Tasks are independent: results do not
// depend on the thread count or schedule.
#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/lse_merge.hpp"
#include "cpu/engine.hpp"
#include "cpu/kernels.hpp"
#include "cpu/pack.hpp"
#include "cpu/plan.hpp"

namespace magi::cpu {
namespace {

template <class T>
constexpr T kNegInf = -std::numeric_limits<T>::infinity();

template <class T>
struct ForwardInputs {
  const Plan& plan;
  const ForwardArgs& args;
  const EngineOptions& options;
  int64_t total_q, total_k, heads_q, heads_kv, dim;
  int64_t row_stride;  // D rounded up to whole vectors (zero padded)
  const T* qt;         // transposed q tiles [Hq][q tiles][D][ld]
  TransposedLayout qt_layout;
  const T* kt;  // transposed key tiles [Hkv][k tiles][D][ld]
  TransposedLayout kt_layout;
  const T* v;  // [Hkv][Tk][row_stride]
};

template <class T>
struct ForwardScratch {
  int64_t ld;               // columns of `probs`: tile_q plus one vector
  AlignedArray<T> probs;    // [tile_k][ld]: logits, then probabilities, transposed (one column per row)
  AlignedArray<T> acc;      // [tile_q][row_stride]: unnormalised output
  AlignedArray<T> row_max;  // [ld] running max per row of the tile
  AlignedArray<T> row_sum;  // [ld]
  AlignedArray<T> block_max, shift, block_sum, rescale;  // [ld] per-item column statistics

  ForwardScratch(const TileConfig& tiles, int64_t row_stride)
      : ld(tiles.tile_q + Simd<float>::W),
        probs(static_cast<size_t>(tiles.tile_k * ld)),
        acc(static_cast<size_t>(tiles.tile_q * row_stride)),
        row_max(static_cast<size_t>(ld)),
        row_sum(static_cast<size_t>(ld)),
        block_max(static_cast<size_t>(ld)),
        shift(static_cast<size_t>(ld)),
        block_sum(static_cast<size_t>(ld)),
        rescale(static_cast<size_t>(ld)) {}
};

inline int round_up(int x, int multiple) { return (x + multiple - 1) / multiple * multiple; }

// Returns the largest kept logit of the task (-inf when it keeps none).
template <class T>
T forward_task(const ForwardInputs<T>& in, int32_t tile, int32_t head, ForwardScratch<T>& s) {
  constexpr int W = Simd<T>::W;
  const Plan& plan = in.plan;
  const int64_t D = in.dim, Dp = in.row_stride;
  const int32_t tile_q = plan.tiles.tile_q, tile_k = plan.tiles.tile_k;
  const int32_t q0 = tile * tile_q;
  const int32_t rows = static_cast<int32_t>(std::min<int64_t>(tile_q, in.total_q - q0));
  const int64_t kv_head = head / (in.heads_q / in.heads_kv);
  const T softcap = static_cast<T>(in.options.softcap);
  const T scale = static_cast<T>(in.options.softmax_scale);
  const T* qt_tile = in.qt + in.qt_layout.offset(head, tile);
  const T* v_head = in.v + kv_head * in.total_k * Dp;
  const int64_t ld = s.ld;

  std::fill(s.acc.data(), s.acc.data() + rows * Dp, T(0));
  std::fill(s.row_max.data(), s.row_max.data() + ld, kNegInf<T>);
  std::fill(s.row_sum.data(), s.row_sum.data() + ld, T(0));
  T max_logit = kNegInf<T>;

  for (int64_t i = plan.by_q.offsets[tile]; i < plan.by_q.offsets[tile + 1]; ++i) {
    const tiling::TileWork& w = plan.by_q.items[i];
    const Slice& slice = plan.mask.slices[w.slice];
    const int m = w.q.size(), n = w.k.size(), m_padded = round_up(m, W);
    const int r0 = w.q.start - q0;
    const int64_t k_tile = w.k.start / tile_k, j0 = w.k.start - k_tile * tile_k;
    T* probs = s.probs.data();

    // probs[n][m] = k q^T: keys are rows, the item's query rows are columns.
    gemm_kmajor(in.kt + in.kt_layout.offset(kv_head, k_tile) + j0, in.kt_layout.ld, n, qt_tile + r0,
                in.qt_layout.ld, static_cast<int>(D), m_padded, probs, ld, false);
    for (int j = 0; j < n; ++j) {
      T* row = probs + j * ld;
      for (int c = 0; c < m_padded; ++c) row[c] *= scale;
      if (softcap > 0) softcap_inplace(row, static_cast<T*>(nullptr), m_padded, softcap);
    }
    if (w.needs_mask)
      for (int c = 0; c < m; ++c) {
        const Range kept = kept_keys(slice, w.q.start + c);
        const int keep_begin = std::clamp(kept.start - w.k.start, 0, n);
        const int keep_end = std::clamp(kept.end - w.k.start, keep_begin, n);
        for (int j = 0; j < keep_begin; ++j) probs[j * ld + c] = kNegInf<T>;
        for (int j = keep_end; j < n; ++j) probs[j * ld + c] = kNegInf<T>;
      }

    // Online softmax per column: new running max, shift (0 where nothing is kept yet, so that exp of
    // -inf logits gives 0 rather than NaN), rescale of the earlier sum and output.
    T* block_max = s.block_max.data();
    std::fill(block_max, block_max + m_padded, kNegInf<T>);
    for (int j = 0; j < n; ++j) max_columns(block_max, probs + j * ld, m_padded);
    for (int c = 0; c < m_padded; ++c) {
      if (c >= m) {  // columns past the item: computed but never used
        s.shift[c] = T(0);
        continue;
      }
      max_logit = std::max(max_logit, block_max[c]);
      T& running = s.row_max[r0 + c];
      const T new_max = std::max(running, block_max[c]);
      const T shift = new_max == kNegInf<T> ? T(0) : new_max;
      s.rescale[c] = std::exp(running - shift);  // 0 for the first kept block
      s.shift[c] = shift;
      running = new_max;
    }
    std::fill(s.block_sum.data(), s.block_sum.data() + m_padded, T(0));
    for (int j = 0; j < n; ++j) exp_sub_columns(probs + j * ld, s.shift.data(), s.block_sum.data(), m_padded);
    for (int c = 0; c < m; ++c) {
      const T rescale = s.rescale[c];
      s.row_sum[r0 + c] = s.row_sum[r0 + c] * rescale + s.block_sum[c];
      if (rescale != T(1)) {
        T* acc_row = s.acc.data() + (r0 + c) * Dp;
        for (int64_t d = 0; d < Dp; ++d) acc_row[d] *= rescale;
      }
    }
    // acc[r0 .. r0+m][D] += P[m][n] v[n][D]  (probs is P^T, k-major)
    gemm_kmajor(probs, ld, m, v_head + w.k.start * Dp, Dp, n, static_cast<int>(Dp), s.acc.data() + r0 * Dp,
                Dp, true);
  }

  const ForwardArgs& a = in.args;
  for (int r = 0; r < rows; ++r) {
    const int64_t q = q0 + r;
    const T sum = s.row_sum[r];
    const T lse = sum > 0 ? s.row_max[r] + std::log(sum) : kNegInf<T>;
    const auto merged =
        merge_weights<T>(lse, sink_lse<T>(a.sink, in.options.sink_layout, q, head, in.heads_q));
    // out~ = (acc / sum) * exp(lse - lse~); empty rows give 0.
    const T factor = sum > 0 ? merged.w1 / sum : T(0);
    store_row<T>(s.acc.data() + r * Dp, factor, a.out, (q * in.heads_q + head) * D, static_cast<int>(D));
    store_scalar<T>(merged.lse, a.lse, q * in.heads_q + head);
  }
  return max_logit;
}

template <class T>
void forward_impl(const Plan& plan, const ForwardArgs& args, const EngineOptions& options) {
  const int threads = resolve_threads(options.num_threads);
  const int64_t total_q = args.q.shape[0], heads_q = args.q.shape[1], dim = args.q.shape[2];
  const int64_t total_k = args.k.shape[0], heads_kv = args.k.shape[1];

  const TransposedLayout qt_layout = transposed_layout(total_q, plan.tiles.tile_q, dim);
  const TransposedLayout kt_layout = transposed_layout(total_k, plan.tiles.tile_k, dim);
  const int64_t row_stride = padded_row(dim);
  Workspace<T>& ws = Workspace<T>::of_this_thread();
  T* qt = ws.get(Workspace<T>::QT, transposed_size<T>(qt_layout, heads_q));
  T* kt = ws.get(Workspace<T>::KT, transposed_size<T>(kt_layout, heads_kv));
  T* v = ws.get(Workspace<T>::V, total_k * heads_kv * row_stride);
  pack_transposed<T>(args.q, qt_layout, threads, qt);
  pack_transposed<T>(args.k, kt_layout, threads, kt);
  pack_rows<T>(args.v, row_stride, threads, v);
  const ForwardInputs<T> in{plan, args,       options, total_q,   total_k, heads_q,   heads_kv,
                            dim,  row_stride, qt,      qt_layout, kt,      kt_layout, v};

  const int64_t tiles = static_cast<int64_t>(plan.q_tile_order.size());
  const int64_t tasks = tiles * heads_q;
  std::vector<T> task_max(static_cast<size_t>(tasks), kNegInf<T>);
  // Scratch allocated here, not in the parallel region, so that an allocation failure propagates.
  std::vector<ForwardScratch<T>> scratches;
  scratches.reserve(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) scratches.emplace_back(plan.tiles, row_stride);
#pragma omp parallel num_threads(threads)
  {
    ForwardScratch<T>& scratch = scratches[static_cast<size_t>(omp_get_thread_num())];
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int32_t tile = plan.q_tile_order[task / heads_q];
      const int32_t head = static_cast<int32_t>(task % heads_q);
      task_max[task] = forward_task<T>(in, tile, head, scratch);
    }
  }

  if (args.max_logits.defined()) {
    for (int64_t h = 0; h < heads_q; ++h) {
      T head_max = kNegInf<T>;
      for (int64_t t = 0; t < tiles; ++t) head_max = std::max(head_max, task_max[t * heads_q + h]);
      store_scalar<T>(head_max, args.max_logits, h);
    }
  }
}

}  // namespace

void forward(const Plan& plan, const ForwardArgs& args, const EngineOptions& options) {
  if (options.accumulate_fp64)
    forward_impl<double>(plan, args, options);
  else
    forward_impl<float>(plan, args, options);
}

}  // namespace magi::cpu
