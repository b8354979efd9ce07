// Backward flash kernels.
//  - dk/dv: one block = one k tile (64 keys) of one kv head; it walks the by_k_tile items of its tile for
//    every q head of the GQA group, recomputing P^T and dS^T, and accumulates dV += P^T dO, dK += dS^T Q
//    in registers (D <= 128: P^T / dS^T stay in registers; D 256: staged in shared memory).
//  - Deterministic mode, no atomics on values: a dq kernel, one block = one q tile (128 rows; 64 for
//    D 256) of one q head over the by_q_tile items, dQ += dS K, recomputing S and dP (7 GEMMs).
//  - Default mode: the dk/dv kernel (kDq) also adds dQ += dS K for each chunk into an fp32 buffer with
//    atomics (5 GEMMs, FA2's scheme); the atomics' order varies, so dq is not bitwise reproducible.
#pragma once

#include <type_traits>

#include "cuda/kernel_common.cuh"

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
  static constexpr int kN = dkdv_tile_k(kD, kDq);  // keys per block
  // D <= 128: one warp per 16 keys, each owns its keys end to end (P^T, dS^T stay in registers, one
  // barrier per step). D 256: 8 warps, P^T and dS^T staged in shared memory, d columns split between warp
  // halves.
  static constexpr bool kRegisterResident = kD <= 128;
  static constexpr int kWarps = kRegisterResident ? kN / 16 : 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = kD <= 128 ? 2 : 1;  // double-buffered Q/dO where shared memory allows
  static constexpr int kSmemBytes = dkdv_smem_bytes(kD, kDq);  // laid out by the tile functions
};

// dQ += dS K for one 64-row chunk, added to p.dq_accum with atomics. dS^T ([kN keys][64 rows]) and K
// ([kN][kD]) are in shared memory: `ds_t` addresses this thread's ldmatrix row of dS^T for keys [0, 16)
// (the next 16 keys are kDsRowBytes * 16 further), `k_t` the K^T fragments with this warp's column offset
// folded in. Warp w computes rows [16 (w % 4), +16) and columns [(w / 4) kCols, +kCols), 64 columns at a
// time to bound live registers.
template <class T, int kD, int kN, int kCols, int kDsRowBytes>
__device__ __forceinline__ void accumulate_dq(const BwdParams& p, uint32_t ds_t, const FragAddr<kD>& k_t, int q0,
                                              int head, int warp, int lane) {
  constexpr int kChunk = kCols < 64 ? kCols : 64;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Hopper's vector atomics: lanes 2j and 2j + 1 trade halves so that each adds 4 consecutive columns (the
  // even lane of column block i, the odd lane of block i + 1): a quarter of the ops.
  const bool odd = lane & 1;
  const int lane_col = (warp / 4) * kCols + (odd ? 8 : 0) + ((lane % 4) & 2) * 2;
#else
  const int lane_col = (warp / 4) * kCols + (lane % 4) * 2;
#endif
  // The chunk's base is uniform over the block and a lane's rows lie within 64 rows of it (32-bit offsets;
  // make_plan bounds Hq * D); each atomic then addresses a row pointer + a compile-time immediate.
  float* const chunk = p.dq_accum + (int64_t{q0} * p.hq + head) * p.d;
  const int row0 = (warp % 4) * 16 + lane / 4;
  float* row_ptr[2];
  bool row_valid[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_valid[r] = q0 + row0 + r * 8 < p.tq;  // no early exit: the whole warp shuffles below
    row_ptr[r] = chunk + ((row0 + r * 8) * p.hq * p.d + lane_col);
  }
#pragma unroll
  for (int c = 0; c < kCols / kChunk; ++c) {
    float acc[kChunk / 8][4];
#pragma unroll
    for (int i = 0; i < kChunk / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4_trans(a, ds_t + kk * 16 * kDsRowBytes);
#pragma unroll
      for (int dp = 0; dp < kChunk / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, k_t.at(kk * 16, c * (kChunk / 16) + dp));
        Mma<T>::run(acc[2 * dp], a, b[0], b[1]);
        Mma<T>::run(acc[2 * dp + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#pragma unroll
      for (int i = 0; i < kChunk / 8; i += 2) {
        const float give0 = odd ? acc[i][2 * r] : acc[i + 1][2 * r];
        const float give1 = odd ? acc[i][2 * r + 1] : acc[i + 1][2 * r + 1];
        const float got0 = __shfl_xor_sync(0xffffffffu, give0, 1);
        const float got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
        const float4 v = odd ? make_float4(got0, got1, acc[i + 1][2 * r], acc[i + 1][2 * r + 1])
                             : make_float4(acc[i][2 * r], acc[i][2 * r + 1], got0, got1);
        const int offset = c * kChunk + i * 8;
        red_add_v4(row_ptr[r] + offset, v, row_valid[r] && lane_col + offset < p.d);
      }
#else
#pragma unroll
      for (int i = 0; i < kChunk / 8; ++i) {
        const int offset = c * kChunk + i * 8;
        if (row_valid[r] && lane_col + offset < p.d) {
          atomicAdd(row_ptr[r] + offset, acc[i][2 * r]);
          atomicAdd(row_ptr[r] + offset + 1, acc[i][2 * r + 1]);
        }
      }
#endif
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

// dk/dv for D <= 128: each warp owns 16 keys; S^T and dP^T come out of the tensor cores in the
// layout of the A operand of dV += P^T dO and dK += dS^T Q, so P^T and dS^T never leave registers.
template <class T, int kD, bool kDq>
__device__ __forceinline__ void dkdv_register_tile(const BwdParams& p, int linear, unsigned char* smem) {
  using Cfg = DkdvConfig<kD, kDq>;
  constexpr int kM = Cfg::kM, kN = Cfg::kN, kThreads = Cfg::kThreads, kStages = Cfg::kStages;
  constexpr int kDSteps = kD / 16;
  constexpr int kQBlocks = kM / 8;  // 8-wide q column blocks of S^T

  const uint32_t sK = smem_addr(smem);
  const uint32_t sV = sK + kN * kD * 2;
  const uint32_t sQ0 = sV + kN * kD * 2;              // [stage][kM][kD]
  const uint32_t sdO0 = sQ0 + kStages * kM * kD * 2;  // [stage][kM][kD]
  float* const sLse = reinterpret_cast<float*>(smem + (sdO0 + kStages * kM * kD * 2 - sK));  // [stage][kM]
  float* const sDelta = sLse + kStages * kM;                                                // [stage][kM]
  // kDq: dS^T as [2][kN][kM + 8] (padded rows: the stores and the ldmatrix reads are conflict-free, and
  // every address is one register + an immediate). Chunk i's dS^T goes to buffer i % 2; its dQ += dS K runs
  // at the end of iteration i + 1, after the barrier that iteration starts with, overlapping other warps'
  // work; no barrier of its own.
  constexpr int kDsRowBytes = (kM + 8) * 2;
  constexpr uint32_t kDsBytes = kN * kDsRowBytes;
  const uint32_t sdS = smem_addr(sDelta + kStages * kM);

  const int tile = p.list.order[linear / p.hkv];
  const int kv_head = linear % p.hkv;
  const int group = p.hq / p.hkv;
  const int k_base = tile * kN;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;
  const int my_key0 = k_base + warp * 16 + lane / 4;  // and + 8

  const int64_t q_stride = int64_t{p.hq} * p.d;
  const int64_t kv_stride = int64_t{p.hkv} * p.d;
  const T* q_tensor = static_cast<const T*>(p.q);
  const T* dout_tensor = static_cast<const T*>(p.dout);
  const T* k_head = static_cast<const T*>(p.k) + int64_t{kv_head} * p.d;
  const T* v_head = static_cast<const T*>(p.v) + int64_t{kv_head} * p.d;

  load_tile_async<kN, kD, kThreads>(sK, k_head + k_base * kv_stride, kv_stride, p.tk - k_base, p.d, k_head);
  load_tile_async<kN, kD, kThreads>(sV, v_head + k_base * kv_stride, kv_stride, p.tk - k_base, p.d, v_head);

  const int first = p.list.offsets[tile];
  const int count = p.list.offsets[tile + 1] - first;
  const int total = count * group;
  // Iteration i is item i % count of q head kv_head * group + i / count; cursors step through that order
  // (no division in the loop): `load` is the iteration whose Q/dO are issued next, `fetch` the one whose
  // item is read from global memory next (two ahead).
  struct Cursor {
    int pos, head;
    __device__ __forceinline__ void advance(int count) {
      if (++pos == count) pos = 0, ++head;
    }
  };
  Cursor load{0, kv_head * group}, fetch{0, kv_head * group};
  const TileLoader<kM, kD, kThreads> qo_loader(q_stride, p.d);
  auto issue_loads = [&](const WorkItem& w, int head, int stage) {
    const int q0 = (w.q0 / kM) * kM;
    const int64_t offset = q0 * q_stride + int64_t{head} * p.d;
    qo_loader.issue(sQ0 + stage * kM * kD * 2, q_tensor + offset, q_stride, p.tq - q0, q_tensor);
    qo_loader.issue(sdO0 + stage * kM * kD * 2, dout_tensor + offset, q_stride, p.tq - q0, dout_tensor);
    if (tid < 2 * kM / 4) {  // 16-byte chunks: first lse2, then Delta
      const bool is_lse = tid < kM / 4;
      const int chunk = is_lse ? tid : tid - kM / 4;
      const float* src = (is_lse ? p.lse2 : p.delta) + int64_t{head} * p.tq_pad + q0 + chunk * 4;
      const float* dst = (is_lse ? sLse : sDelta) + stage * kM + chunk * 4;
      cp_async16(smem_addr(dst), src, true);
    }
  };
  auto fetch_item = [&]() {
    const WorkItem w = p.list.items[first + fetch.pos];
    fetch.advance(count);
    return w;
  };
  WorkItem current{}, next{};
  if (total > 0) {
    current = fetch_item();
    next = total > 1 ? fetch_item() : current;
    issue_loads(current, load.head, 0);
    load.advance(count);
  }
  cp_async_commit();

  float dk[kD / 8][4], dv[kD / 8][4];
#pragma unroll
  for (int i = 0; i < kD / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.0f;

  const FragAddr<kD> kv_a(sK, warp * 16 + (lane % 16), lane / 16);                  // A: K, V rows
  const FragAddr<kD> qo_b(sQ0, (lane % 8) + (lane / 16) * 8, (lane / 8) % 2);        // B: Q, dO rows
  const FragAddr<kD> qo_t(sQ0, (lane % 8) + ((lane / 8) % 2) * 8, lane / 16);        // B^T: Q, dO
  constexpr uint32_t kKV = kN * kD * 2;            // sV - sK
  constexpr uint32_t kQO = kStages * kM * kD * 2;  // sdO - sQ
  const uint32_t ds_store = sdS + (warp * 16 + lane / 4) * kDsRowBytes + (lane % 4) * 4;
  const uint32_t ds_load = sdS + ((lane % 8) + (lane / 16) * 8) * kDsRowBytes + ((warp % 4) * 2 + (lane / 8) % 2) * 16;
  // dQ: warps split the chunk's 4 row blocks x (kWarps / 4) column groups.
  constexpr int kDqCols = kD / (Cfg::kWarps / 4);
  const FragAddr<kD> k_t(sK, lane % 16, (warp / 4) * (kDqCols / 8) + lane / 16);  // B^T: K rows = keys
  int prev_q0 = 0, prev_head = 0;  // kDq: the chunk whose dQ is pending

  for (int it = 0; it < total; ++it) {
    const int stage = kStages == 2 ? it & 1 : 0;
    const WorkItem w = current;
    const int q0 = (w.q0 / kM) * kM;
    [[maybe_unused]] const int head = load.pos == 0 ? load.head - 1 : load.head;  // `load` is one ahead
    cp_async_wait<0>();
    __syncthreads();
    if (kStages == 2 && it + 1 < total) {
      issue_loads(next, load.head, (it + 1) & 1);
      load.advance(count);
    }
    cp_async_commit();
    const WorkItem after_next = it + 2 < total ? fetch_item() : next;
    const uint32_t stage_offset = stage * kM * kD * 2;

    // S^T = K Q^T and dP^T = V dO^T: this warp's 16 keys x all kM rows.
    float st[kQBlocks][4], dpt[kQBlocks][4];
#pragma unroll
    for (int i = 0; i < kQBlocks; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kDSteps; ++ks) {
      uint32_t ak[4], av[4];
      const uint32_t a_addr = kv_a.at(0, ks);
      ldmatrix_x4(ak, a_addr);
      ldmatrix_x4(av, a_addr + kKV);
#pragma unroll
      for (int nb = 0; nb < kM / 16; ++nb) {
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

    // P^T and dS^T, packed straight into A fragments (rows = keys, k index = q). Only warps that the plan marks
    // (their 16 keys keep part of the chunk's rows) take the per-cell test; kept rows are tested relative to q0.
    const bool masked = (w.flags >> (kWorkTestGroupShift + warp)) & 1;
    KeyInterval rows[2] = {{0, 1 << 30}, {0, 1 << 30}};
    if (masked) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        rows[r] = item_queries(w, my_key0 + r * 8);
        rows[r].lo -= q0, rows[r].hi -= q0;
      }
    }
    uint32_t a_p[kM / 16][4], a_ds[kM / 16][4];
    with_softcap(p, [&](auto softcap) {
      with_bool(masked, [&](auto is_masked) {
#pragma unroll
        for (int nb = 0; nb < kQBlocks; ++nb) {
          const int col0 = nb * 8 + (lane % 4) * 2;
          const float2 lse2 = *reinterpret_cast<const float2*>(sLse + stage * kM + col0);
          const float2 delta = *reinterpret_cast<const float2*>(sDelta + stage * kM + col0);
          float pv[4], dsv[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const bool kept = decltype(is_masked)::value ? rows[e / 2].contains(col0 + (e % 2)) : true;
            const BwdCell c = bwd_cell<decltype(softcap)::value>(p, st[nb][e], dpt[nb][e], e % 2 ? lse2.y : lse2.x,
                                                                 e % 2 ? delta.y : delta.x, kept);
            pv[e] = c.p;
            dsv[e] = c.ds;
          }
          const int t = nb / 2, half = (nb % 2) * 2;  // n-block 2t -> regs 0,1; 2t + 1 -> regs 2,3
          a_p[t][half] = Mma<T>::pack(pv[0], pv[1]);
          a_p[t][half + 1] = Mma<T>::pack(pv[2], pv[3]);
          a_ds[t][half] = Mma<T>::pack(dsv[0], dsv[1]);
          a_ds[t][half + 1] = Mma<T>::pack(dsv[2], dsv[3]);
          if constexpr (kDq) {  // dS^T for dQ += dS K in the next iteration
            const uint32_t at = ds_store + (it & 1) * kDsBytes + nb * 16;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(a_ds[t][half]));
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at + 8 * kDsRowBytes), "r"(a_ds[t][half + 1]));
          }
        }
      });
    });

    // dV += P^T dO, dK += dS^T Q.
#pragma unroll
    for (int t = 0; t < kM / 16; ++t) {
#pragma unroll
      for (int dp = 0; dp < kD / 16; ++dp) {
        const uint32_t b_addr = qo_t.at(t * 16, dp) + stage_offset;
        uint32_t bo[4], bq[4];
        ldmatrix_x4_trans(bo, b_addr + kQO);
        ldmatrix_x4_trans(bq, b_addr);
        Mma<T>::run(dv[2 * dp], a_p[t], bo[0], bo[1]);
        Mma<T>::run(dv[2 * dp + 1], a_p[t], bo[2], bo[3]);
        Mma<T>::run(dk[2 * dp], a_ds[t], bq[0], bq[1]);
        Mma<T>::run(dk[2 * dp + 1], a_ds[t], bq[2], bq[3]);
      }
    }
    if constexpr (kDq) {
      if (it > 0)
        accumulate_dq<T, kD, kN, kDqCols, kDsRowBytes>(p, ds_load + ((it - 1) & 1) * kDsBytes, k_t, prev_q0, prev_head,
                                                       warp, lane);
      prev_q0 = q0;
      prev_head = head;
    }
    current = next;
    next = after_next;
  }
  cp_async_wait<0>();
  if constexpr (kDq) {
    if (total > 0) {
      __syncthreads();  // the last chunk's dS^T is staged
      accumulate_dq<T, kD, kN, kDqCols, kDsRowBytes>(p, ds_load + ((total - 1) & 1) * kDsBytes, k_t, prev_q0,
                                                     prev_head, warp, lane);
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = my_key0 + r * 8;
    if (key >= p.tk) continue;
    const int64_t base = key * kv_stride + int64_t{kv_head} * p.d;
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) {
      const int col = i * 8 + (lane % 4) * 2;
      if (col < p.d) {
        store_pair<T>(p.dk, base + col, dk[i][2 * r], dk[i][2 * r + 1], p.grad_fp32);
        store_pair<T>(p.dv, base + col, dv[i][2 * r], dv[i][2 * r + 1], p.dv_fp32);
      }
    }
  }
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

  const int tile = p.list.order[linear / p.hkv];
  const int kv_head = linear % p.hkv;
  const int group = p.hq / p.hkv;
  const int k_base = tile * kN;
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

  const int first = p.list.offsets[tile];
  const int count = p.list.offsets[tile + 1] - first;
  const int total = count * group;

  // Everything one iteration reads (Q, dO, lse2, Delta of a 64-row chunk of one head) as cp.async.
  auto issue_loads = [&](const WorkItem& w, int iteration, int stage) {
    const int head = kv_head * group + iteration / count;
    const int q0 = (w.q0 / kM) * kM;
    const int64_t offset = q0 * q_stride + int64_t{head} * p.d;
    load_tile_async<kM, kD, kThreads>(sQ0 + stage * kM * kD * 2, q_tensor + offset, q_stride, p.tq - q0, p.d, q_tensor);
    load_tile_async<kM, kD, kThreads>(sdO0 + stage * kM * kD * 2, dout_tensor + offset, q_stride, p.tq - q0, p.d,
                                      dout_tensor);
    if (tid < 2 * kM / 4) {  // 16-byte chunks: first lse2, then Delta
      const bool is_lse = tid < kM / 4;
      const int chunk = is_lse ? tid : tid - kM / 4;
      const float* src = (is_lse ? p.lse2 : p.delta) + int64_t{head} * p.tq_pad + q0 + chunk * 4;
      const float* dst = (is_lse ? sLse : sDelta) + stage * kM + chunk * 4;
      cp_async16(smem_addr(dst), src, true);
    }
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
    if constexpr (kDq) {
      FragAddr<kD> k_t = qo_t;  // same pattern (and column half) as the Q/dO B^T fragments, over K
      k_t.base = qo_t.base - (sQ0 - sK);
      // dS^T is Swizzled<kM>: with the row's XOR fixed by lane % 8, each 16 keys are 16 rows further.
      const uint32_t ds_load = sdS + ((lane % 8) + (lane / 16) * 8) * kM * 2 +
                               ((((warp % 4) * 2 + (lane / 8) % 2)) ^ (lane % 8)) * 16;
      accumulate_dq<T, kD, kN, kHalfD, kM * 2>(p, ds_load, k_t, q0, kv_head * group + it / count, warp, lane);
    }
    if (kStages == 1) {
      __syncthreads();
      if (it + 1 < total) issue_loads(next, it + 1, 0);
      cp_async_commit();
    }
    current = next;
    next = after_next;
  }
  cp_async_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = k_base + key_group * 16 + lane / 4 + r * 8;
    if (key >= p.tk) continue;
    const int64_t base = key * kv_stride + int64_t{kv_head} * p.d;
#pragma unroll
    for (int i = 0; i < kHalfD / 8; ++i) {
      const int col = half * kHalfD + i * 8 + (lane % 4) * 2;
      if (col < p.d) {
        store_pair<T>(p.dk, base + col, dk[i][2 * r], dk[i][2 * r + 1], p.grad_fp32);
        store_pair<T>(p.dv, base + col, dv[i][2 * r], dv[i][2 * r + 1], p.dv_fp32);
      }
    }
  }
}

template <class T, int kD, bool kDq>
__device__ __forceinline__ void dkdv_kernel_tile(const BwdParams& p, int linear, unsigned char* smem) {
  if constexpr (DkdvConfig<kD, kDq>::kRegisterResident) dkdv_register_tile<T, kD, kDq>(p, linear, smem);
  else dkdv_staged_tile<T, kD, kDq>(p, linear, smem);
}

template <int kD>
struct DqConfig {
  static constexpr int kM = dq_tile_q(kD);
  static constexpr int kN = dq_tile_k(kD);
  static constexpr int kWarps = 4;
  static constexpr int kMTiles = kM / (16 * kWarps);  // 16-row m-tiles per warp, kWarps * 16 rows apart
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kSmemBytes = (2 * kM + 2 * kN) * kD * 2;
};

template <class T, int kD>
__device__ __forceinline__ void dq_kernel_tile(const BwdParams& p, int linear, unsigned char* smem) {
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

  const int tile = p.list.order[linear / p.hq];
  const int head = linear % p.hq;
  const int kv_head = head / (p.hq / p.hkv);
  const int q_base = tile * kM;
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
  int item = p.list.offsets[tile];
  const int item_end = p.list.offsets[tile + 1];
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

// Plain grid (one block per work index; the hardware balances best when no SM margin is asked for).
template <class T, int kD, bool kDq>
__global__ void __launch_bounds__(DkdvConfig<kD, kDq>::kThreads) dkdv_kernel(const BwdParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  dkdv_kernel_tile<T, kD, kDq>(p, static_cast<int>(blockIdx.x), smem);
}

// Persistent grid: block b starts with work b, then takes the next unclaimed index from a counter, so the
// plan's heaviest-first order is kept and blocks balance dynamically. Each work index is computed the
// same way whichever block takes it, so results do not depend on the schedule.
template <class T, int kD, bool kDq>
__global__ void __launch_bounds__(DkdvConfig<kD, kDq>::kThreads) dkdv_kernel_persistent(const BwdParams p, int num_work) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int next_work;
  int linear = static_cast<int>(blockIdx.x);
  while (linear < num_work) {
    dkdv_kernel_tile<T, kD, kDq>(p, linear, smem);
    if (threadIdx.x == 0) next_work = atomicAdd(p.work_counter, 1) + static_cast<int>(gridDim.x);
    __syncthreads();  // also: the next work item reuses shared memory
    linear = next_work;
    __syncthreads();
  }
}

// Plain grid (one block per work index; the hardware balances best when no SM margin is asked for).
template <class T, int kD>
__global__ void __launch_bounds__(DqConfig<kD>::kThreads) dq_kernel(const BwdParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  dq_kernel_tile<T, kD>(p, static_cast<int>(blockIdx.x), smem);
}

// Persistent grid: block b starts with work b, then takes the next unclaimed index from a counter, so the
// plan's heaviest-first order is kept and blocks balance dynamically. Each work index is computed the
// same way whichever block takes it, so results do not depend on the schedule.
template <class T, int kD>
__global__ void __launch_bounds__(DqConfig<kD>::kThreads) dq_kernel_persistent(const BwdParams p, int num_work) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int next_work;
  int linear = static_cast<int>(blockIdx.x);
  while (linear < num_work) {
    dq_kernel_tile<T, kD>(p, linear, smem);
    if (threadIdx.x == 0) next_work = atomicAdd(p.work_counter, 1) + static_cast<int>(gridDim.x);
    __syncthreads();  // also: the next work item reuses shared memory
    linear = next_work;
    __syncthreads();
  }
}

}  // namespace magi::cuda::detail
