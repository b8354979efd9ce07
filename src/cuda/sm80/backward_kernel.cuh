// Backward flash kernels.
//  - dk/dv: one block = one k tile (128 keys up to D 128, 64 at D 256) of one kv head; it walks the
//    by_k_tile items of its tile for every q head of the GQA group, recomputing P^T and dS^T, and
//    accumulates dV += P^T dO, dK += dS^T Q in registers (D <= 128: half of P^T / dS^T from registers, half
//    from the warp pair's partner; D 256: all staged in shared memory).
//  - Deterministic mode, no atomics on values: a dq kernel, one block = one q tile (128 rows; 64 for
//    D 256) of one q head over the by_q_tile items, dQ += dS K, recomputing S and dP (7 GEMMs).
//  - Default mode: the dk/dv kernel (kDq) also adds dQ += dS K for each chunk into an fp32 buffer with
//    atomics (5 GEMMs, FA2's scheme); the atomics' order varies, so dq is not bitwise reproducible.
//  - Head-dim tiles above 256: the D-split kernels of backward_split_d.cuh (included at the end).
#pragma once

#include <type_traits>

#include "cuda/kernel_common.cuh"
#include "cuda/sm80/mma.cuh"
#include "cuda/sm80/tiles.hpp"

namespace magi::cuda::detail {

// Elementwise part shared by both kernels: the probability and dS (w.r.t. q.k) of one cell.
struct BwdCell {
  float p, ds;
};
template <bool kSoftcap>
__device__ __forceinline__ BwdCell bwd_cell(const BwdParams& prm, float qk, float dp, float lse2, float delta,
                                            bool kept) {
  float s2, dfactor;
  if constexpr (kSoftcap) {
    const float t = tanhf(qk * prm.softcap_pre);
    s2 = prm.softcap_post * t;
    dfactor = prm.softmax_scale * (1.0f - t * t);
  } else {
    s2 = qk * prm.scale_log2;
    dfactor = prm.softmax_scale;
  }
  // Branch-free: ex2(-inf) = 0 for dropped cells (a predicated exp made the compiler reload the scale from
  // constant memory per cell).
  const float pr = fast_exp2(kept ? s2 - lse2 : -INFINITY);
  return {pr, kept ? pr * (dp - delta) * dfactor : 0.0f};
}

// Runs body(std::true_type / std::false_type) so that a branch sits outside the element loops.
template <class F>
__device__ __forceinline__ void with_bool(bool value, F&& body) {
  if (value) body(std::true_type{});
  else body(std::false_type{});
}
template <class F>
__device__ __forceinline__ void with_softcap(const BwdParams& prm, F&& body) {
  with_bool(prm.softcap > 0.0f, body);
}

// Row statistics from the preprocess kernel, head-major and padded: any row < tq_pad may be read.
__device__ __forceinline__ float load_lse2(const BwdParams& prm, int row, int head) {
  return prm.lse2[int64_t{head} * prm.tq_pad + row];
}
__device__ __forceinline__ float load_delta(const BwdParams& prm, int row, int head) {
  return prm.delta[int64_t{head} * prm.tq_pad + row];
}

template <int kD, bool kDq>
struct DkdvConfig {
  static constexpr int kM = kDkdvTileQ;             // q rows per item chunk
  static constexpr int kN = dkdv_tile_k(kD);  // keys per block
  // D <= 128: one warp pair per 32 keys (see dkdv_register_tile). D 256: 8 warps, P^T and dS^T staged in
  // shared memory, d columns split between warp halves.
  static constexpr bool kRegisterResident = kD <= 128;
  static constexpr int kWarps = kRegisterResident ? kN / 16 : 8;  // 8 in the D-split kernel too
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = kD <= 128 ? 2 : 1;  // double-buffered Q/dO where shared memory allows
  static constexpr int kSmemBytes = dkdv_smem_bytes(kD, kDq);  // laid out by the tile functions
};

// dQ += dS K for one 64-row chunk, added to p.dq_accum with atomics. dS^T ([kN keys][64 rows], Swizzled<64>) and
// K ([kN][kD]) are in shared memory: `ds_t[mt]` addresses this thread's ldmatrix row of dS^T for keys [0, 16)
// and row tile mt (the next 16 keys are 16 rows further), `k_t` the K^T fragments with this warp's column
// offset folded in. Warps form kRowGroups groups of kRowTiles 16-row tiles and kWarps / kRowGroups column
// groups of kCols columns (squarer warp tiles read less shared memory per MMA), 64 columns at a time.
template <class T, int kD, int kN, int kCols, int kRowTiles, int kRowGroups>
__device__ __forceinline__ void accumulate_dq(const BwdParams& p, const uint32_t (&ds_t)[kRowTiles],
                                              const FragAddr<kD>& k_t, int q0, int head, int warp, int lane) {
  constexpr int kChunk = kCols < 64 ? kCols : 64;
  constexpr int kDsRowBytes = kDkdvTileQ * 2;
  const int col_group = warp / kRowGroups;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Hopper's vector atomics: lanes 2j and 2j + 1 trade halves so that each adds 4 consecutive columns (the
  // even lane of column block i, the odd lane of block i + 1): a quarter of the ops.
  const bool odd = lane & 1;
  const int lane_col = col_group * kCols + (odd ? 8 : 0) + ((lane % 4) & 2) * 2;
#else
  const int lane_col = col_group * kCols + (lane % 4) * 2;
#endif
  // The chunk's base is uniform over the block and a lane's rows lie within 64 rows of it (32-bit offsets;
  // make_plan bounds Hq * D); each atomic then addresses a row pointer + a compile-time immediate.
  float* const chunk = p.dq_accum + (int64_t{q0} * p.hq + head) * p.d;
  const int row0 = (warp % kRowGroups) * 16 * kRowTiles + lane / 4;  // + 16 mt + 8 r
#pragma unroll
  for (int c = 0; c < kCols / kChunk; ++c) {
    float acc[kRowTiles][kChunk / 8][4];
#pragma unroll
    for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
      for (int i = 0; i < kChunk / 8; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      uint32_t a[kRowTiles][4];
#pragma unroll
      for (int mt = 0; mt < kRowTiles; ++mt) ldmatrix_x4_trans(a[mt], ds_t[mt] + kk * 16 * kDsRowBytes);
#pragma unroll
      for (int dp = 0; dp < kChunk / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, k_t.at(kk * 16, c * (kChunk / 16) + dp));
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt) {
          Mma<T>::run(acc[mt][2 * dp], a[mt], b[0], b[1]);
          Mma<T>::run(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < kRowTiles; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + mt * 16 + r * 8;
        const bool row_valid = q0 + row < p.tq;  // no early exit: the whole warp shuffles below
        float* const row_ptr = chunk + (row * p.hq * p.d + lane_col);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#pragma unroll
        for (int i = 0; i < kChunk / 8; i += 2) {
          const float give0 = odd ? acc[mt][i][2 * r] : acc[mt][i + 1][2 * r];
          const float give1 = odd ? acc[mt][i][2 * r + 1] : acc[mt][i + 1][2 * r + 1];
          const float got0 = __shfl_xor_sync(0xffffffffu, give0, 1);
          const float got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
          const float4 v = odd ? make_float4(got0, got1, acc[mt][i + 1][2 * r], acc[mt][i + 1][2 * r + 1])
                               : make_float4(acc[mt][i][2 * r], acc[mt][i][2 * r + 1], got0, got1);
          const int offset = c * kChunk + i * 8;
          red_add_v4(row_ptr + offset, v, row_valid && lane_col + offset < p.d);
        }
#else
#pragma unroll
        for (int i = 0; i < kChunk / 8; ++i) {
          const int offset = c * kChunk + i * 8;
          if (row_valid && lane_col + offset < p.d) {
            atomicAdd(row_ptr + offset, acc[mt][i][2 * r]);
            atomicAdd(row_ptr + offset + 1, acc[mt][i][2 * r + 1]);
          }
        }
#endif
      }
    }
  }
}

// This thread's ldmatrix row of a Swizzled<64> dS^T tile, for dS row tile `row_tile` (16 rows) as the A operand
// of dQ += dS K (transposed load: lanes supply keys).
__device__ __forceinline__ uint32_t ds_t_address(uint32_t ds_tile, int row_tile, int lane) {
  const int key = (lane % 8) + (lane / 16) * 8;
  return ds_tile + Swizzled<kDkdvTileQ>::offset(key, (row_tile * 2 + (lane / 8) % 2) * 8);
}

// The lse2 and Delta rows of one kM-row chunk of one head into shared memory: threads [0, kM / 2) issue one
// 16-byte copy each (first lse2, then Delta); the others return false.
template <int kM>
__device__ __forceinline__ bool load_row_stats_async(const BwdParams& p, int head, int q0, float* lse_stage,
                                                     float* delta_stage, int tid) {
  if (tid >= 2 * kM / 4) return false;
  const bool is_lse = tid < kM / 4;
  const int chunk = is_lse ? tid : tid - kM / 4;
  const float* src = (is_lse ? p.lse2 : p.delta) + int64_t{head} * p.tq_pad + q0 + chunk * 4;
  cp_async16(smem_addr((is_lse ? lse_stage : delta_stage) + chunk * 4), src, true);
  return true;
}

// dK and dV of one 16-key m-tile (this thread's keys key0 and key0 + 8), columns col0 + [0, kCols) of the tile's
// accumulator fragments, to global memory (rows beyond tk and columns beyond d are dropped): whole 8-column
// blocks (store_row_blocks) when dk and dv are 16-byte aligned (p.vector_stores), else element pairs.
template <class T, int kCols>
__device__ __forceinline__ void store_dkdv(const BwdParams& p, const float (&dk)[kCols / 8][4],
                                           const float (&dv)[kCols / 8][4], int key0, int col0, int kv_head) {
  const int64_t kv_stride = int64_t{p.hkv} * p.d;
  if (p.vector_stores) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int col_base = col0 - (lane % 4) * 2;  // the fragments' column 0
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = key0 + r * 8;
      const int64_t base = key * kv_stride + int64_t{kv_head} * p.d + col_base;
      store_row_blocks<T, kCols / 8>(p.dk, base, dk, r, 1.0f, p.d - col_base, p.grad_fp32, key < p.tk, lane);
      store_row_blocks<T, kCols / 8>(p.dv, base, dv, r, 1.0f, p.d - col_base, p.dv_fp32, key < p.tk, lane);
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + r * 8;
    if (key >= p.tk) continue;
    const int64_t base = key * kv_stride + int64_t{kv_head} * p.d;
#pragma unroll
    for (int i = 0; i < kCols / 8; ++i) {
      const int col = col0 + i * 8;
      if (col < p.d) {
        store_pair<T>(p.dk, base + col, dk[i][2 * r], dk[i][2 * r + 1], p.grad_fp32);
        store_pair<T>(p.dv, base + col, dv[i][2 * r], dv[i][2 * r + 1], p.dv_fp32);
      }
    }
  }
}

// Rows (q) that a work item keeps for key k: the transpose of item_keys, via kept_queries' bounds.
__device__ __forceinline__ KeyInterval item_queries(const WorkItem& w, int k) {
  int lo = w.q0, hi = w.q1;
  if (w.flags & kWorkCausal) lo = max(lo, k - w.causal_offset);    // k <= q + causal_offset
  if (w.flags & kWorkInv) hi = min(hi, k - w.inv_offset + 1);      // k >= q + inv_offset
  if (k < w.k0 || k >= w.k1) hi = lo;
  return {lo, hi};
}

// dk/dv for D <= 128. Warp pairs own 32 keys: in phase 1 each warp of a pair computes S^T and dP^T for the
// pair's keys and its half of the chunk's rows, so P^T and dS^T come out of the tensor cores already in the
// layout of the A operand of dV += P^T dO and dK += dS^T Q; in phase 2 each warp accumulates dK, dV for the
// pair's keys and its half of the d columns, over its own rows (A from registers) and then, after a pair
// barrier, over the partner's rows (A from shared memory). Against one warp per 16 keys x all rows, each warp
// reads half of Q and dO per GEMM instead of all of it: the kernel was bound by shared-memory reads.
template <class T, int kD, bool kDq>
__device__ __forceinline__ void dkdv_register_tile(const BwdParams& p, int linear, unsigned char* smem) {
  using Cfg = DkdvConfig<kD, kDq>;
  constexpr int kM = Cfg::kM, kN = Cfg::kN, kThreads = Cfg::kThreads, kStages = Cfg::kStages;
  constexpr int kDSteps = kD / 16;
  constexpr int kHalfD = kD / 2;
  constexpr int kRows = kM / 2;  // a warp's rows in phase 1
  static_assert(kM == kDkdvTileQ && kRows == 32, "phase 1 covers 32 keys x 32 rows per warp");

  const uint32_t sK = smem_addr(smem);
  const uint32_t sV = sK + kN * kD * 2;
  const uint32_t sQ0 = sV + kN * kD * 2;              // [stage][kM][kD]
  const uint32_t sdO0 = sQ0 + kStages * kM * kD * 2;  // [stage][kM][kD]
  float* const sLse = reinterpret_cast<float*>(smem + (sdO0 + kStages * kM * kD * 2 - sK));  // [stage][kM]
  float* const sDelta = sLse + kStages * kM;                                                // [stage][kM]
  // P^T and dS^T ([kN keys][kM rows], Swizzled<kM>). kDq: two dS^T buffers, chunk i's in buffer i % 2: its
  // dQ += dS K runs at the end of iteration i + 1, after the barrier that iteration starts with.
  constexpr uint32_t kPdsBytes = kN * kM * 2;
  const uint32_t sP = smem_addr(sDelta + kStages * kM);
  const uint32_t sdS = sP + kPdsBytes;
  auto ds_buffer = [&](int it) { return sdS + (kDq ? (it & 1) * kPdsBytes : 0u); };
  // Each stage's work item arrives with its Q/dO (cp.async) and is read from shared memory where used: items
  // held in registers across iterations cost ~20 of them.
  const WorkItem* const sItem = reinterpret_cast<const WorkItem*>(smem + (sdS + (kDq ? 2 : 1) * kPdsBytes - sK));
  static_assert(sizeof(WorkItem) == 32, "an item is two 16-byte copies (dkdv_smem_bytes counts 32 bytes a stage)");

  const WorkCoords at = work_coords(linear, p.hkv, p.list);
  const TileInfo info = p.list.tiles[at.tile_index];
  const int kv_head = at.head;
  const int group = p.hq / p.hkv;
  const int k_base = info.tile * kN;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;
  const int pair = warp / 2, half = warp % 2;  // keys [32 pair, +32); rows [32 half, +32); d [half kD/2, +kD/2)
  const int my_key0 = k_base + pair * 32 + lane / 4;  // + 16 mt + 8 r

  const int64_t q_stride = int64_t{p.hq} * p.d;
  const int64_t kv_stride = int64_t{p.hkv} * p.d;
  const T* q_tensor = static_cast<const T*>(p.q);
  const T* dout_tensor = static_cast<const T*>(p.dout);
  const T* k_head = static_cast<const T*>(p.k) + int64_t{kv_head} * p.d;
  const T* v_head = static_cast<const T*>(p.v) + int64_t{kv_head} * p.d;

  load_tile_async<kN, kD, kThreads>(sK, k_head + k_base * kv_stride, kv_stride, p.tk - k_base, p.d, k_head);
  load_tile_async<kN, kD, kThreads>(sV, v_head + k_base * kv_stride, kv_stride, p.tk - k_base, p.d, v_head);

  const int first = info.first, count = info.count;
  const int total = count * group;
  // Iteration i is item i % count of q head kv_head * group + i / count; cursors step through that order
  // (no division in the loop): `load` is the iteration whose loads are issued next, `fetch` the one whose
  // q0 is read from global memory next (two ahead).
  struct Cursor {
    int pos, head;
    __device__ __forceinline__ void advance(int count) {
      if (++pos == count) pos = 0, ++head;
    }
  };
  Cursor load{0, kv_head * group}, fetch{0, kv_head * group};
  const TileLoader<kM, kD, kThreads> qo_loader(q_stride, p.d);
  auto issue_loads = [&](int q0, int stage) {
    const int64_t offset = q0 * q_stride + int64_t{load.head} * p.d;
    qo_loader.issue(sQ0 + stage * kM * kD * 2, q_tensor + offset, q_stride, p.tq - q0, q_tensor);
    qo_loader.issue(sdO0 + stage * kM * kD * 2, dout_tensor + offset, q_stride, p.tq - q0, dout_tensor);
    if (!load_row_stats_async<kM>(p, load.head, q0, sLse + stage * kM, sDelta + stage * kM, tid)) {
      const int half_item = tid - 2 * kM / 4;  // the item, in two 16-byte halves
      if (half_item < 2)
        cp_async16(smem_addr(sItem + stage) + half_item * 16,
                   reinterpret_cast<const char*>(p.list.items + first + load.pos) + half_item * 16, true);
    }
    load.advance(count);
  };
  auto fetch_q0 = [&]() {
    const int q0 = (p.list.items[first + fetch.pos].q0 / kM) * kM;
    fetch.advance(count);
    return q0;
  };
  int next_q0 = 0;  // the chunk of iteration it + 1
  if (total > 0) {
    fetch.advance(count);  // the first chunk's q0 is in the tile's info
    issue_loads(info.first_minor0 / kM * kM, 0);
    if (total > 1) next_q0 = fetch_q0();
  }
  cp_async_commit();

  float dk[2][kHalfD / 8][4], dv[2][kHalfD / 8][4];  // [key tile][8-column block]
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int i = 0; i < kHalfD / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[mt][i][e] = dv[mt][i][e] = 0.0f;

  const FragAddr<kD> kv_a(sK, pair * 32 + (lane % 16), lane / 16);                            // A: K, V rows
  const FragAddr<kD> qo_b(sQ0, half * kRows + (lane % 8) + (lane / 16) * 8, (lane / 8) % 2);  // B: Q, dO rows
  // B^T: Q, dO rows of this warp's half (the partner's are kRows rows away), this warp's d columns.
  const FragAddr<kD> qo_t(sQ0, half * kRows + (lane % 8) + ((lane / 8) % 2) * 8, half * (kHalfD / 8) + lane / 16);
  const uint32_t partner_rows = half ? -uint32_t{kRows * kD * 2} : uint32_t{kRows * kD * 2};
  // A: the partner's P^T / dS^T (its rows, the pair's keys).
  const FragAddr<kM> pds_a(sP, pair * 32 + (lane % 16), (1 - half) * (kRows / 8) + lane / 16);
  constexpr uint32_t kKV = kN * kD * 2;            // sV - sK
  constexpr uint32_t kQO = kStages * kM * kD * 2;  // sdO - sQ
  // This thread's P^T / dS^T stores: key pair * 32 + lane / 4 (+ 16 mt, + 8), row chunk 4 half + nb.
  const uint32_t pds_store = sP + (pair * 32 + lane / 4) * kM * 2 + (lane % 4) * 4;
  const int pds_chunk = (half * 4) ^ (lane / 4);  // ^ nb: the swizzled chunk of 8-row block nb
  // dQ: warps split the chunk's rows into kDqRowGroups groups and the columns into the rest.
  constexpr int kDqRowTiles = kD >= 128 ? 2 : 1;
  constexpr int kDqRowGroups = 4 / kDqRowTiles;
  constexpr int kDqCols = kD / (Cfg::kWarps / kDqRowGroups);
  const FragAddr<kD> k_t(sK, lane % 16, (warp / kDqRowGroups) * (kDqCols / 8) + lane / 16);  // B^T: K rows = keys
  uint32_t ds_t[kDqRowTiles];
#pragma unroll
  for (int mt = 0; mt < kDqRowTiles; ++mt) ds_t[mt] = ds_t_address(0, (warp % kDqRowGroups) * kDqRowTiles + mt, lane);
  int prev_q0 = 0, prev_head = 0;  // kDq: the chunk whose dQ is pending
  auto pending_dq = [&](int chunk_iteration) {  // its dS^T is in ds_buffer(chunk_iteration)
    uint32_t ds[kDqRowTiles];
#pragma unroll
    for (int mt = 0; mt < kDqRowTiles; ++mt) ds[mt] = ds_t[mt] + ds_buffer(chunk_iteration);
    accumulate_dq<T, kD, kN, kDqCols, kDqRowTiles, kDqRowGroups>(p, ds, k_t, prev_q0, prev_head, warp, lane);
  };

  static_assert(kStages == 2, "the next chunk's loads overlap this one's work");
  for (int it = 0; it < total; ++it) {
    const int stage = it & 1;
    [[maybe_unused]] const int head = load.pos == 0 ? load.head - 1 : load.head;  // `load` is one ahead
    cp_async_wait<0>();
    __syncthreads();
    const WorkItem& w = sItem[stage];
    const int q0 = (w.q0 / kM) * kM;
    if (it + 1 < total) issue_loads(next_q0, stage ^ 1);
    cp_async_commit();
    if (it + 2 < total) next_q0 = fetch_q0();
    const uint32_t stage_offset = stage * kM * kD * 2;

    // Phase 1: S^T = K Q^T, then dP^T = V dO^T: the pair's 32 keys x this warp's 32 rows (one operand pair
    // at a time keeps the live fragments to 12 registers).
    float st[2][kRows / 8][4], dpt[2][kRows / 8][4];  // [key tile][8-row block]
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int i = 0; i < kRows / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[mt][i][e] = dpt[mt][i][e] = 0.0f;
    auto gemm_t = [&](float (&acc)[2][kRows / 8][4], uint32_t a_offset, uint32_t b_offset) {
#pragma unroll
      for (int ks = 0; ks < kDSteps; ++ks) {
        uint32_t a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(a[mt], kv_a.at(mt * 16, ks) + a_offset);
#pragma unroll
        for (int nb = 0; nb < kRows / 16; ++nb) {
          uint32_t b[4];
          ldmatrix_x4(b, qo_b.at(nb * 16, ks) + b_offset);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            Mma<T>::run(acc[mt][2 * nb], a[mt], b[0], b[1]);
            Mma<T>::run(acc[mt][2 * nb + 1], a[mt], b[2], b[3]);
          }
        }
      }
    };
    gemm_t(st, 0, stage_offset);
    gemm_t(dpt, kKV, stage_offset + kQO);

    // P^T and dS^T, packed straight into A fragments (rows = keys, k index = q) and stored for the partner (and
    // for dQ). Only warps whose keys the plan marks (they keep part of the chunk's rows) take the per-cell test;
    // kept rows are tested relative to q0.
    const bool masked = (w.flags >> (kWorkTestGroupShift + 2 * pair)) & 3;
    KeyInterval rows[2][2] = {{{0, 1 << 30}, {0, 1 << 30}}, {{0, 1 << 30}, {0, 1 << 30}}};
    if (masked) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          rows[mt][r] = item_queries(w, my_key0 + mt * 16 + r * 8);
          rows[mt][r].lo -= q0, rows[mt][r].hi -= q0;
        }
    }
    uint32_t a_p[kRows / 16][2][4], a_ds[kRows / 16][2][4];  // [16-row step][key tile]
    const uint32_t ds_store = pds_store + (ds_buffer(it) - sP);
    with_softcap(p, [&](auto softcap) {
      with_bool(masked, [&](auto is_masked) {
#pragma unroll
        for (int nb = 0; nb < kRows / 8; ++nb) {
          const int col0 = half * kRows + nb * 8 + (lane % 4) * 2;
          const float2 lse2 = *reinterpret_cast<const float2*>(sLse + stage * kM + col0);
          const float2 delta = *reinterpret_cast<const float2*>(sDelta + stage * kM + col0);
          const uint32_t chunk = static_cast<uint32_t>(pds_chunk ^ nb) * 16;
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            float pv[4], dsv[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const bool kept = decltype(is_masked)::value ? rows[mt][e / 2].contains(col0 + (e % 2)) : true;
              const BwdCell c = bwd_cell<decltype(softcap)::value>(p, st[mt][nb][e], dpt[mt][nb][e],
                                                                   e % 2 ? lse2.y : lse2.x, e % 2 ? delta.y : delta.x,
                                                                   kept);
              pv[e] = c.p;
              dsv[e] = c.ds;
            }
            const int t = nb / 2, hi = (nb % 2) * 2;  // 8-row block 2t -> regs 0,1; 2t + 1 -> regs 2,3
            a_p[t][mt][hi] = Mma<T>::pack(pv[0], pv[1]);
            a_p[t][mt][hi + 1] = Mma<T>::pack(pv[2], pv[3]);
            a_ds[t][mt][hi] = Mma<T>::pack(dsv[0], dsv[1]);
            a_ds[t][mt][hi + 1] = Mma<T>::pack(dsv[2], dsv[3]);
            const uint32_t at = mt * 16 * kM * 2 + chunk;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(pds_store + at), "r"(a_p[t][mt][hi]));
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(pds_store + at + 8 * kM * 2), "r"(a_p[t][mt][hi + 1]));
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ds_store + at), "r"(a_ds[t][mt][hi]));
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ds_store + at + 8 * kM * 2), "r"(a_ds[t][mt][hi + 1]));
          }
        }
      });
    });

    // Phase 2: dV += P^T dO, dK += dS^T Q for the pair's keys and this warp's d columns; 16 rows per step.
    auto gemm_2 = [&](const uint32_t (&ap)[2][4], const uint32_t (&ads)[2][4], uint32_t b_rows) {
#pragma unroll
      for (int dp = 0; dp < kHalfD / 16; ++dp) {
        const uint32_t b_addr = qo_t.at(0, dp) + stage_offset + b_rows;
        uint32_t bo[4], bq[4];
        ldmatrix_x4_trans(bo, b_addr + kQO);
        ldmatrix_x4_trans(bq, b_addr);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          Mma<T>::run(dv[mt][2 * dp], ap[mt], bo[0], bo[1]);
          Mma<T>::run(dv[mt][2 * dp + 1], ap[mt], bo[2], bo[3]);
          Mma<T>::run(dk[mt][2 * dp], ads[mt], bq[0], bq[1]);
          Mma<T>::run(dk[mt][2 * dp + 1], ads[mt], bq[2], bq[3]);
        }
      }
    };
#pragma unroll
    for (int t = 0; t < kRows / 16; ++t) gemm_2(a_p[t], a_ds[t], t * 16 * kD * 2);
    // The partner's P^T / dS^T: its stores above are visible after the pair's barrier (ids 1.. ; 0 is
    // __syncthreads').
    asm volatile("bar.sync %0, 64;\n" ::"r"(1 + pair) : "memory");
#pragma unroll
    for (int t = 0; t < kRows / 16; ++t) {
      uint32_t ap[2][4], ads[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const uint32_t a_addr = pds_a.at(mt * 16, t);
        ldmatrix_x4(ap[mt], a_addr);
        ldmatrix_x4(ads[mt], a_addr + (ds_buffer(it) - sP));
      }
      gemm_2(ap, ads, partner_rows + t * 16 * kD * 2);
    }
    if constexpr (kDq) {
      if (it > 0) pending_dq(it - 1);
      prev_q0 = q0;
      prev_head = head;
    }
  }
  cp_async_wait<0>();
  if constexpr (kDq) {
    if (total > 0) {
      __syncthreads();  // the last chunk's dS^T is staged
      pending_dq(total - 1);
    }
  }

#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
    store_dkdv<T, kHalfD>(p, dk[mt], dv[mt], my_key0 + mt * 16, half * kHalfD + (lane % 4) * 2, kv_head);
}

template <class T, int kD, bool kDq>
__device__ __forceinline__ void dkdv_staged_tile(const BwdParams& p, int linear, unsigned char* smem) {
  using Cfg = DkdvConfig<kD, kDq>;
  constexpr int kM = Cfg::kM, kN = Cfg::kN, kThreads = Cfg::kThreads, kStages = Cfg::kStages;
  constexpr int kDSteps = kD / 16;
  constexpr int kHalfD = kD / 2;
  using SM = Swizzled<kM>;

  const uint32_t sK = smem_addr(smem);
  const uint32_t sV = sK + kN * kD * 2;
  const uint32_t sQ0 = sV + kN * kD * 2;                   // [stage][kM][kD]
  const uint32_t sdO0 = sQ0 + kStages * kM * kD * 2;       // [stage][kM][kD]
  const uint32_t sP = sdO0 + kStages * kM * kD * 2;        // [kN][kM]
  const uint32_t sdS = sP + kN * kM * 2;                   // [kN][kM]
  unsigned char* const row_stats = smem + (sdS + kN * kM * 2 - sK);
  float* const sLse = reinterpret_cast<float*>(row_stats);            // [stage][kM]
  float* const sDelta = sLse + kStages * kM;                          // [stage][kM]

  const WorkCoords at = work_coords(linear, p.hkv, p.list);
  const TileInfo info = p.list.tiles[at.tile_index];
  const int kv_head = at.head;
  const int group = p.hq / p.hkv;
  const int k_base = info.tile * kN;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;
  const int key_group = warp % 4;  // 16 keys
  const int half = warp / 4;       // phase 1: q columns [half*32, +32); phase 2: d columns [half*kD/2, +kD/2)

  const int64_t q_stride = int64_t{p.hq} * p.d;
  const int64_t kv_stride = int64_t{p.hkv} * p.d;
  const T* q_tensor = static_cast<const T*>(p.q);
  const T* dout_tensor = static_cast<const T*>(p.dout);
  const T* k_head = static_cast<const T*>(p.k) + int64_t{kv_head} * p.d;
  const T* v_head = static_cast<const T*>(p.v) + int64_t{kv_head} * p.d;

  load_tile_async<kN, kD, kThreads>(sK, k_head + k_base * kv_stride, kv_stride, p.tk - k_base, p.d, k_head);
  load_tile_async<kN, kD, kThreads>(sV, v_head + k_base * kv_stride, kv_stride, p.tk - k_base, p.d, v_head);

  const int first = info.first, count = info.count;
  const int total = count * group;

  // Everything one iteration reads (Q, dO, lse2, Delta of a 64-row chunk of one head) as cp.async.
  auto issue_loads = [&](const WorkItem& w, int iteration, int stage) {
    const int head = kv_head * group + iteration / count;
    const int q0 = (w.q0 / kM) * kM;
    const int64_t offset = q0 * q_stride + int64_t{head} * p.d;
    load_tile_async<kM, kD, kThreads>(sQ0 + stage * kM * kD * 2, q_tensor + offset, q_stride, p.tq - q0, p.d, q_tensor);
    load_tile_async<kM, kD, kThreads>(sdO0 + stage * kM * kD * 2, dout_tensor + offset, q_stride, p.tq - q0, p.d,
                                      dout_tensor);
    load_row_stats_async<kM>(p, head, q0, sLse + stage * kM, sDelta + stage * kM, tid);
  };
  // Items are fetched one iteration ahead so that their global loads never stall the pipeline.
  auto item_at = [&](int iteration) { return p.list.items[first + iteration % count]; };
  WorkItem current{}, next{};
  if (total > 0) {
    current = item_at(0);
    next = total > 1 ? item_at(1) : current;
    issue_loads(current, 0, 0);
  }
  cp_async_commit();

  float dk[kHalfD / 8][4], dv[kHalfD / 8][4];
#pragma unroll
  for (int i = 0; i < kHalfD / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.0f;

  const FragAddr<kD> kv_a(sK, key_group * 16 + (lane % 16), lane / 16);              // A: K, V rows
  const FragAddr<kD> qo_b(sQ0, half * 32 + (lane % 8) + (lane / 16) * 8, (lane / 8) % 2);  // B: Q, dO rows
  const FragAddr<kM> pds_a(sP, key_group * 16 + (lane % 16), lane / 16);             // A: P^T, dS^T
  const FragAddr<kD> qo_t(sQ0, (lane % 8) + ((lane / 8) % 2) * 8, half * (kHalfD / 8) + lane / 16);  // B^T
  constexpr uint32_t kKV = kN * kD * 2;        // sV - sK
  constexpr uint32_t kQO = kStages * kM * kD * 2;  // sdO - sQ
  constexpr uint32_t kPdS = kN * kM * 2;       // sdS - sP

  for (int it = 0; it < total; ++it) {
    const int stage = kStages == 2 ? it & 1 : 0;
    const WorkItem w = current;
    const int q0 = (w.q0 / kM) * kM;
    cp_async_wait<0>();
    __syncthreads();
    if (kStages == 2 && it + 1 < total) issue_loads(next, it + 1, (it + 1) & 1);
    cp_async_commit();
    const WorkItem after_next = it + 2 < total ? item_at(it + 2) : next;
    const uint32_t stage_offset = stage * kM * kD * 2;

    // Phase 1: S^T = K Q^T and dP^T = V dO^T for 16 keys x 32 rows per warp.
    float st[4][4], dpt[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kDSteps; ++ks) {
      uint32_t ak[4], av[4];
      const uint32_t a_addr = kv_a.at(0, ks);
      ldmatrix_x4(ak, a_addr);
      ldmatrix_x4(av, a_addr + kKV);
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
        const uint32_t b_addr = qo_b.at(nb * 16, ks) + stage_offset;
        uint32_t bq[4], bo[4];
        ldmatrix_x4(bq, b_addr);
        ldmatrix_x4(bo, b_addr + kQO);
        Mma<T>::run(st[2 * nb], ak, bq[0], bq[1]);
        Mma<T>::run(st[2 * nb + 1], ak, bq[2], bq[3]);
        Mma<T>::run(dpt[2 * nb], av, bo[0], bo[1]);
        Mma<T>::run(dpt[2 * nb + 1], av, bo[2], bo[3]);
      }
    }
    const bool masked = (w.flags & kWorkMasked) != 0;
    with_softcap(p, [&](auto softcap) {
#pragma unroll
      for (int nb = 0; nb < 4; ++nb) {
        // This thread's two q columns of the block: their kept key intervals, computed once.
        const int col0 = half * 32 + nb * 8 + (lane % 4) * 2;
        KeyInterval keys[2] = {{0, 1 << 30}, {0, 1 << 30}};
        if (masked) keys[0] = item_keys(w, q0 + col0), keys[1] = item_keys(w, q0 + col0 + 1);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int key_local = key_group * 16 + lane / 4 + r * 8;
          const int col = col0;
          float pv[2], dsv[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const bool kept = keys[j].contains(k_base + key_local);
            const BwdCell c = bwd_cell<decltype(softcap)::value>(p, st[nb][2 * r + j], dpt[nb][2 * r + j],
                                                                 sLse[stage * kM + col + j],
                                                                 sDelta[stage * kM + col + j], kept);
            pv[j] = c.p;
            dsv[j] = c.ds;
          }
          const uint32_t off = SM::element(key_local, col);
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sP + off), "r"(Mma<T>::pack(pv[0], pv[1])));
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + off), "r"(Mma<T>::pack(dsv[0], dsv[1])));
        }
      }
    });
    __syncthreads();

    // Phase 2: dV += P^T dO, dK += dS^T Q for 16 keys x kD/2 columns per warp.
#pragma unroll
    for (int t = 0; t < kM / 16; ++t) {
      uint32_t ap[4], ads[4];
      const uint32_t a_addr = pds_a.at(0, t);
      ldmatrix_x4(ap, a_addr);
      ldmatrix_x4(ads, a_addr + kPdS);
#pragma unroll
      for (int dp = 0; dp < kHalfD / 16; ++dp) {
        const uint32_t b_addr = qo_t.at(t * 16, dp) + stage_offset;
        uint32_t bo[4], bq[4];
        ldmatrix_x4_trans(bo, b_addr + kQO);
        ldmatrix_x4_trans(bq, b_addr);
        Mma<T>::run(dv[2 * dp], ap, bo[0], bo[1]);
        Mma<T>::run(dv[2 * dp + 1], ap, bo[2], bo[3]);
        Mma<T>::run(dk[2 * dp], ads, bq[0], bq[1]);
        Mma<T>::run(dk[2 * dp + 1], ads, bq[2], bq[3]);
      }
    }
    // One stage: Q and dO are free once every warp is past phase 2, so the next chunk's loads overlap dQ += dS K
    // (which reads only dS^T and K).
    if (kStages == 1) {
      __syncthreads();
      if (it + 1 < total) issue_loads(next, it + 1, 0);
      cp_async_commit();
    }
    if constexpr (kDq) {
      FragAddr<kD> k_t = qo_t;  // same pattern (and column half) as the Q/dO B^T fragments, over K
      k_t.base = qo_t.base - (sQ0 - sK);
      const uint32_t ds_t[1] = {ds_t_address(sdS, warp % 4, lane)};
      accumulate_dq<T, kD, kN, kHalfD, 1, 4>(p, ds_t, k_t, q0, kv_head * group + it / count, warp, lane);
    }
    current = next;
    next = after_next;
  }
  cp_async_wait<0>();

  store_dkdv<T, kHalfD>(p, dk, dv, k_base + key_group * 16 + lane / 4, half * kHalfD + (lane % 4) * 2, kv_head);
}

// The D-split kernels' tiles (backward_split_d.cuh, included at the end).
template <class T, int kD, bool kDq, bool kPaired>
__device__ __forceinline__ void dkdv_split_tile(const BwdParams& p, int linear, unsigned char* smem);
template <class T, int kD>
__device__ __forceinline__ void dq_split_tile(const BwdParams& p, int linear, unsigned char* smem);

template <class T, int kD, bool kDq, bool kPaired>
__device__ __forceinline__ void dkdv_kernel_tile(const BwdParams& p, int linear, unsigned char* smem) {
  if constexpr (split_d_backward(kD)) dkdv_split_tile<T, kD, kDq, kPaired>(p, linear, smem);
  else if constexpr (DkdvConfig<kD, kDq>::kRegisterResident) dkdv_register_tile<T, kD, kDq>(p, linear, smem);
  else dkdv_staged_tile<T, kD, kDq>(p, linear, smem);
}

template <int kD>
struct DqConfig {
  static constexpr int kM = dq_tile_q(kD);
  static constexpr int kN = dq_tile_k(kD);
  static constexpr int kWarps = split_d_backward(kD) ? 8 : 4;
  static constexpr int kMTiles = kM / (16 * kWarps);  // 16-row m-tiles per warp, kWarps * 16 rows apart
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kSmemBytes = split_d_backward(kD) ? split_bwd_smem_bytes(kD) : (2 * kM + 2 * kN) * kD * 2;
};

template <class T, int kD>
__device__ __forceinline__ void dq_resident_tile(const BwdParams& p, int linear, unsigned char* smem) {
  using Cfg = DqConfig<kD>;
  constexpr int kM = Cfg::kM, kN = Cfg::kN, kThreads = Cfg::kThreads, kMT = Cfg::kMTiles;
  constexpr int kStride = 16 * Cfg::kWarps;
  constexpr int kDSteps = kD / 16;
  constexpr int kNBlocks = kN / 8;
  constexpr int kDBlocks = kD / 8;

  const uint32_t sQ = smem_addr(smem);
  const uint32_t sdO = sQ + kM * kD * 2;
  const uint32_t sK = sdO + kM * kD * 2;
  const uint32_t sV = sK + kN * kD * 2;

  const WorkCoords at = work_coords(linear, p.hq, p.list);
  const TileInfo info = p.list.tiles[at.tile_index];
  const int head = at.head;
  const int kv_head = head / (p.hq / p.hkv);
  const int q_base = info.tile * kM;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int warp_row = warp * 16;
  const int my_row0 = q_base + warp_row + lane / 4;  // + mt * kStride + r * 8

  const int64_t q_stride = int64_t{p.hq} * p.d;
  const int64_t kv_stride = int64_t{p.hkv} * p.d;
  const T* q_tensor = static_cast<const T*>(p.q);
  const T* dout_tensor = static_cast<const T*>(p.dout);
  const T* k_head = static_cast<const T*>(p.k) + int64_t{kv_head} * p.d;
  const T* v_head = static_cast<const T*>(p.v) + int64_t{kv_head} * p.d;

  const int64_t q_offset = q_base * q_stride + int64_t{head} * p.d;
  load_tile_async<kM, kD, kThreads>(sQ, q_tensor + q_offset, q_stride, p.tq - q_base, p.d, q_tensor);
  load_tile_async<kM, kD, kThreads>(sdO, dout_tensor + q_offset, q_stride, p.tq - q_base, p.d, dout_tensor);
  int item = info.first;
  const int item_end = info.first + info.count;
  auto issue_kv = [&](int k0) {
    load_tile_async<kN, kD, kThreads>(sK, k_head + k0 * kv_stride, kv_stride, p.tk - k0, p.d, k_head);
    load_tile_async<kN, kD, kThreads>(sV, v_head + k0 * kv_stride, kv_stride, p.tk - k0, p.d, v_head);
  };
  if (item < item_end) issue_kv((p.list.items[item].k0 / kN) * kN);
  cp_async_commit();

  float lse2[kMT][2], delta[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      lse2[mt][r] = load_lse2(p, my_row0 + mt * kStride + r * 8, head);
      delta[mt][r] = load_delta(p, my_row0 + mt * kStride + r * 8, head);
    }
  float acc[kMT][kDBlocks][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int i = 0; i < kDBlocks; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.0f;

  const FragAddr<kD> qo_a(sQ, warp_row + (lane % 16), lane / 16);
  const FragAddr<kD> kv_b(sK, (lane % 8) + (lane / 16) * 8, (lane / 8) % 2);
  const FragAddr<kD> k_t(sK, (lane % 8) + ((lane / 8) % 2) * 8, lane / 16);
  constexpr uint32_t kQO = kM * kD * 2;  // sdO - sQ
  constexpr uint32_t kKV = kN * kD * 2;  // sV - sK

  for (; item < item_end; ++item) {
    const int k0 = (p.list.items[item].k0 / kN) * kN;
    const int flags = p.list.items[item].flags;
    const int next_k0 = item + 1 < item_end ? (p.list.items[item + 1].k0 / kN) * kN : 0;  // fetched early
    cp_async_wait<0>();
    __syncthreads();

    float s[kMT][kNBlocks][4], dpv[kMT][kNBlocks][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int i = 0; i < kNBlocks; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][i][e] = dpv[mt][i][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kDSteps; ++ks) {
      uint32_t aq[kMT][4], ao[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const uint32_t a_addr = qo_a.at(mt * kStride, ks);
        ldmatrix_x4(aq[mt], a_addr);
        ldmatrix_x4(ao[mt], a_addr + kQO);
      }
#pragma unroll
      for (int nb = 0; nb < kN / 16; ++nb) {
        const uint32_t b_addr = kv_b.at(nb * 16, ks);
        uint32_t bk[4], bv[4];
        ldmatrix_x4(bk, b_addr);
        ldmatrix_x4(bv, b_addr + kKV);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          Mma<T>::run(s[mt][2 * nb], aq[mt], bk[0], bk[1]);
          Mma<T>::run(s[mt][2 * nb + 1], aq[mt], bk[2], bk[3]);
          Mma<T>::run(dpv[mt][2 * nb], ao[mt], bv[0], bv[1]);
          Mma<T>::run(dpv[mt][2 * nb + 1], ao[mt], bv[2], bv[3]);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      KeyInterval keys[2] = {{0, 1 << 30}, {0, 1 << 30}};
      if (flags & kWorkMasked) {
        const WorkItem w = p.list.items[item];  // an L1 hit; keeps the bounds out of the loop's registers
        keys[0] = item_keys(w, my_row0 + mt * kStride);
        keys[1] = item_keys(w, my_row0 + mt * kStride + 8);
      }
      with_softcap(p, [&](auto softcap) {
#pragma unroll
        for (int nb = 0; nb < kNBlocks; ++nb) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e / 2;
            const int col = k0 + nb * 8 + (lane % 4) * 2 + (e % 2);
            s[mt][nb][e] = bwd_cell<decltype(softcap)::value>(p, s[mt][nb][e], dpv[mt][nb][e], lse2[mt][r],
                                                              delta[mt][r], keys[r].contains(col)).ds;
          }
        }
      });
    }
    // dQ += dS K.
#pragma unroll
    for (int t = 0; t < kN / 16; ++t) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        a[mt][0] = Mma<T>::pack(s[mt][2 * t][0], s[mt][2 * t][1]);
        a[mt][1] = Mma<T>::pack(s[mt][2 * t][2], s[mt][2 * t][3]);
        a[mt][2] = Mma<T>::pack(s[mt][2 * t + 1][0], s[mt][2 * t + 1][1]);
        a[mt][3] = Mma<T>::pack(s[mt][2 * t + 1][2], s[mt][2 * t + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < kD / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, k_t.at(t * 16, dp));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          Mma<T>::run(acc[mt][2 * dp], a[mt], b[0], b[1]);
          Mma<T>::run(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();
    if (item + 1 < item_end) issue_kv(next_k0);
    cp_async_commit();
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = my_row0 + mt * kStride + r * 8;
      if (row >= p.tq) continue;
      const int64_t base = row * q_stride + int64_t{head} * p.d;
      if (p.accumulate_dq) {
        // All of the row's loads before its first store (see the forward's merge epilogue: interleaved, each
        // pair would wait a full memory latency, since the compiler may not reorder them).
        float2* const at = reinterpret_cast<float2*>(static_cast<float*>(p.dq) + base);
        float2 sum[kDBlocks];
#pragma unroll
        for (int i = 0; i < kDBlocks; ++i) {
          const int col = i * 8 + (lane % 4) * 2;
          sum[i] = col < p.d ? at[col / 2] : make_float2(0.f, 0.f);
        }
#pragma unroll
        for (int i = 0; i < kDBlocks; ++i) {
          const int col = i * 8 + (lane % 4) * 2;
          if (col < p.d) at[col / 2] = make_float2(sum[i].x + acc[mt][i][2 * r], sum[i].y + acc[mt][i][2 * r + 1]);
        }
        continue;
      }
#pragma unroll
      for (int i = 0; i < kDBlocks; ++i) {
        const int col = i * 8 + (lane % 4) * 2;
        if (col < p.d) store_pair<T>(p.dq, base + col, acc[mt][i][2 * r], acc[mt][i][2 * r + 1], p.grad_fp32);
      }
    }
  }
}

template <class T, int kD>
__device__ __forceinline__ void dq_kernel_tile(const BwdParams& p, int linear, unsigned char* smem) {
  if constexpr (split_d_backward(kD)) dq_split_tile<T, kD>(p, linear, smem);
  else dq_resident_tile<T, kD>(p, linear, smem);
}

// Plain grid (one block per work index; the hardware balances best when no SM margin is asked for).
// kPaired (D-split tiles only, bwd_split_paired_fits): two blocks per SM.
template <class T, int kD, bool kDq, bool kPaired = false>
__global__ void __launch_bounds__(DkdvConfig<kD, kDq>::kThreads, kPaired ? 2 : 1) dkdv_kernel(const BwdParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  dkdv_kernel_tile<T, kD, kDq, kPaired>(p, static_cast<int>(blockIdx.x), smem);
}

// Persistent grid (for_each_work).
template <class T, int kD, bool kDq, bool kPaired = false>
__global__ void __launch_bounds__(DkdvConfig<kD, kDq>::kThreads, kPaired ? 2 : 1)
    dkdv_kernel_persistent(const BwdParams p, int num_work) {
  extern __shared__ __align__(128) unsigned char smem[];
  for_each_work(num_work, p.work_counter, [&](int linear) { dkdv_kernel_tile<T, kD, kDq, kPaired>(p, linear, smem); });
}

// Plain grid (one block per work index; the hardware balances best when no SM margin is asked for).
template <class T, int kD>
__global__ void __launch_bounds__(DqConfig<kD>::kThreads) dq_kernel(const BwdParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  dq_kernel_tile<T, kD>(p, static_cast<int>(blockIdx.x), smem);
}

// Persistent grid (for_each_work).
template <class T, int kD>
__global__ void __launch_bounds__(DqConfig<kD>::kThreads) dq_kernel_persistent(const BwdParams p, int num_work) {
  extern __shared__ __align__(128) unsigned char smem[];
  for_each_work(num_work, p.work_counter, [&](int linear) { dq_kernel_tile<T, kD>(p, linear, smem); });
}

}  // namespace magi::cuda::detail

#include "cuda/sm80/backward_split_d.cuh"
