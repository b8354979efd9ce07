// Backward kernels for the head-dim tiles above 256 (320 .. 1024): the head dim is split over the warps so that
// registers and shared memory stay bounded whatever D is.
//  - dk/dv: one block = dkdv_tile_k(D) keys (32 up to D 512, 16 above) of one kv head, 8 warps. K and V stay in
//    shared memory; Q and dO arrive in kSplitBwdRows-row steps of the by_k_tile items' 64-row chunks. Per step:
//      phase 1: S^T = K Q^T and dP^T = V dO^T, the full-D reductions split over warps (each warp a 16-key x
//               32-row tile over every kSplit-th 16-column unit of D), partial sums reduced in shared memory
//               in a fixed order; P^T = exp2(S^T scale - lse2), dS^T = P^T (dP^T - Delta) as 16-bit tiles;
//      phase 2: dV[:, cols] += P^T dO[:, cols], dK[:, cols] += dS^T Q[:, cols]: each warp 16 keys x its
//               interleaved 16-column units (<= 128 fp32 accumulator registers a thread);
//      kDq (default mode): dQ[:, cols] = dS K[:, cols], added to p.dq_accum with fp32 atomics.
//  - dq (deterministic mode): one block = kSplitBwdRows q rows of one q head (Q, dO resident), walking its
//    by_q_tile items' key tiles with the same phase 1 and accumulating dQ in registers split by columns.
// Included at the end of backward_kernel.cuh (it uses that header's cell math, stores and item helpers).
#pragma once

#include "cuda/sm80/backward_kernel.cuh"

namespace magi::cuda::detail {

template <int kD_, bool kPaired_ = false>
struct SplitBwdConfig {
  static constexpr int kD = kD_;
  // Two blocks per SM (<= 128 registers a thread): phase 1 sums S^T, then dP^T (one matrix's accumulators and
  // operands live at a time), dQ runs row tile by row tile, and the next step is looked up after phase 2.
  static constexpr bool kPaired = kPaired_;
  static constexpr int kN = dkdv_tile_k(kD);  // keys of a dk/dv block, of a dq step
  static constexpr int kM = kSplitBwdRows;    // q rows of a dk/dv step, of a dq block
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kUnits = kD / 16;  // 16-column units of D
  // Phase 1: warp tiles of 16 keys x 32 rows, kSplit warps per tile, each summing every kSplit-th unit.
  static constexpr int kTileRows = 32;
  static constexpr int kKeyTiles = kN / 16;
  static constexpr int kTiles = kKeyTiles * (kM / kTileRows);
  static constexpr int kSplit = kWarps / kTiles;
  static constexpr int kSplitUnits = (kUnits + kSplit - 1) / kSplit;
  static constexpr int kFrags = kTileRows / 8 * 4;  // fp32 fragment registers of one matrix of a warp tile
  static constexpr int kShare = kFrags / kSplit;    // of them, the cells a warp finishes
  // Phase 2: warps = key tiles x column groups; a warp owns units g + kColGroups j.
  static constexpr int kColGroups = kWarps / kKeyTiles;
  static constexpr int kColUnits = (kUnits + kColGroups - 1) / kColGroups;
  // dQ: every warp all kM rows x units w + kWarps j.
  static constexpr int kDqUnits = (kUnits + kWarps - 1) / kWarps;
  static constexpr int kRowTiles = kM / 16;
  static constexpr int kPdsCols = kDkdvTileQ;  // P^T / dS^T rows hold 64 q columns (Swizzled<64>), kM used
  // Shared memory, bytes: K, V [kN][kD]; Q, dO [kM][kD] (Swizzled<kD>); the partial sums [warp][frag][lane], whose
  // space P^T, dS^T [kN][kPdsCols] take once they are summed; lse2, Delta [kM].
  static constexpr int kKVBytes = kN * kD * 2;
  static constexpr int kQOBytes = kM * kD * 2;  // dO - Q
  static constexpr int kRedBytes = kWarps * kFrags * 32 * 4;
  static constexpr int kPdsBytes = kN * kPdsCols * 2;
  static constexpr int kOffV = kKVBytes, kOffQ = 2 * kKVBytes, kOffdO = kOffQ + kQOBytes;
  static constexpr int kOffRed = kOffdO + kQOBytes, kOffP = kOffRed, kOffdS = kOffP + kPdsBytes;
  static constexpr int kOffLse = kOffRed + kRedBytes, kOffDelta = kOffLse + kM * 4;
  static constexpr int kSmemBytes = kOffDelta + kM * 4;
  static_assert(2 * kPdsBytes <= kRedBytes, "P^T and dS^T fit the partial sums' space");
  static_assert(kSmemBytes == split_bwd_smem_bytes(kD), "tiles.hpp's count is this layout");
  static_assert(kD % 64 == 0 && kM % kTileRows == 0 && kM <= kPdsCols && kDkdvTileQ % kM == 0, "tile shapes");
  static_assert(kSplit == 4 || kSplit == 8, "unit addressing (UnitAddr) needs 4 or 8 groups");
  static_assert(kColGroups == 4 || kColGroups == 8, "unit addressing (UnitAddr) needs 4 or 8 groups");
  static_assert(kFrags % kSplit == 0 && kShare % 2 == 0, "each warp finishes whole cell pairs");
};

// Per-thread ldmatrix address of the 16-column units u = group + kGroups j of a Swizzled<kD> tile: with kGroups a
// power of two >= 4 the swizzle XOR only touches the group's own chunk bits, so unit j is base + an immediate.
// thread_row: the tile row this lane addresses; chunk_bit: which 8-column half of the unit it addresses.
template <int kD, int kGroups>
struct UnitAddr {
  static_assert(kGroups == 4 || kGroups == 8, "power of two, >= 4");
  uint32_t base;
  __device__ __forceinline__ UnitAddr(uint32_t tile, int thread_row, int group, int chunk_bit)
      : base(tile + static_cast<uint32_t>(thread_row * kD * 2 + (((2 * group + chunk_bit) ^ (thread_row & 7)) * 16))) {}
  __device__ __forceinline__ uint32_t at(int row_offset, int j) const {
    return base + static_cast<uint32_t>(row_offset * kD * 2 + j * kGroups * 32);
  }
};

// Copies rows [0, kRows) x [0, kD) of a strided global tile into a Swizzled<kD> shared tile; rows >= rows_valid and
// columns >= cols_valid become zeros. Warp w copies rows w + 8 i, lane l the 16-byte chunks l + 32 m: the row's
// swizzle (row % 8 = w) is fixed, so every copy is one base address + immediates (any kD / 8 chunk count).
template <int kRows, int kD, int kThreads, class T>
__device__ __forceinline__ void load_rows_async(uint32_t smem, const T* global, int64_t row_stride, int rows_valid,
                                                int cols_valid, const T* fallback) {
  static_assert(kThreads == 256 && kRows % 8 == 0, "8 warps, whole groups of 8 rows");
  constexpr int kChunks = kD / 8, kColPasses = (kChunks + 31) / 32;
  const int w = static_cast<int>(threadIdx.x) / 32, l = static_cast<int>(threadIdx.x) % 32;
  const uint32_t dst = smem + static_cast<uint32_t>(w * kD * 2 + (l ^ w) * 16);
  const T* const src = global + w * row_stride + l * 8;
#pragma unroll
  for (int i = 0; i < kRows / 8; ++i) {
#pragma unroll
    for (int m = 0; m < kColPasses; ++m) {
      if (kChunks % 32 != 0 && l + 32 * m >= kChunks) continue;
      const bool valid = w + 8 * i < rows_valid && (l + 32 * m) * 8 < cols_valid;
      cp_async16(dst + i * 8 * kD * 2 + m * 512, valid ? src + i * 8 * row_stride + m * 256 : fallback, valid);
    }
  }
}

// Phase 1 of both kernels: from K, V (keys k_base + [0, kN)) and Q, dO, lse2, Delta (rows q_base + [0, kM)) in
// shared memory, P^T (kWriteP) and dS^T into their 16-bit tiles. kKMajor: the item is of a k-major list (the
// per-16-key test bits), else of a q-major one (kWorkMasked). Every thread calls it; it ends with a barrier.
template <class T, class C, bool kWriteP, bool kKMajor>
__device__ __forceinline__ void split_probabilities(const BwdParams& p, unsigned char* smem, const WorkItem& w,
                                                    int k_base, int q_base, int warp, int lane) {
  constexpr int kD = C::kD;
  constexpr int kNB = C::kTileRows / 8;
  const uint32_t s0 = smem_addr(smem);
  float* const red = reinterpret_cast<float*>(smem + C::kOffRed);
  const float* const s_lse = reinterpret_cast<const float*>(smem + C::kOffLse);
  const float* const s_delta = reinterpret_cast<const float*>(smem + C::kOffDelta);
  const int tile = warp % C::kTiles, split = warp / C::kTiles;
  const int key_tile = tile % C::kKeyTiles, row_group = tile / C::kKeyTiles;

  // The kSplit partials of this warp's share of the tile's fragment registers, summed in split order (the same
  // bits whichever run). red: [warp = split * kTiles + tile][frag][lane].
  auto reduce = [&](const float (&acc)[kNB][4], float (&sum)[C::kShare]) {
#pragma unroll
    for (int f = 0; f < C::kFrags; ++f) red[(warp * C::kFrags + f) * 32 + lane] = acc[f / 4][f % 4];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < C::kShare; ++i) {
      const int f = split * C::kShare + i;
      float total = 0.0f;
#pragma unroll
      for (int s = 0; s < C::kSplit; ++s) total += red[((s * C::kTiles + tile) * C::kFrags + f) * 32 + lane];
      sum[i] = total;
    }
    __syncthreads();
  };
  // S^T and dP^T partials: 16 keys x 32 rows over this warp's units of D.
  float s_sum[C::kShare], dp_sum[C::kShare];
  if constexpr (C::kPaired) {
    // One matrix at a time (m = 0: S^T from K, Q; 1: dP^T from V, dO): the same mma order per cell as below.
    const UnitAddr<kD, C::kSplit> a_rows(s0, key_tile * 16 + (lane % 16), split, lane / 16);  // A: K, V
    const UnitAddr<kD, C::kSplit> b_rows(s0 + C::kOffQ, row_group * C::kTileRows + (lane % 8) + (lane / 16) * 8,
                                         split, (lane / 8) % 2);  // B: Q, dO
    auto one = [&](int m, float (&sum)[C::kShare]) {
      float acc[kNB][4];
#pragma unroll
      for (int i = 0; i < kNB; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;
#pragma unroll
      for (int j = 0; j < C::kSplitUnits; ++j) {
        if (C::kUnits % C::kSplit != 0 && split + C::kSplit * j >= C::kUnits) break;  // warp-uniform
        uint32_t a[4];
        ldmatrix_x4(a, a_rows.at(0, j) + m * C::kKVBytes);
#pragma unroll
        for (int nb = 0; nb < kNB / 2; ++nb) {
          uint32_t b[4];
          ldmatrix_x4(b, b_rows.at(nb * 16, j) + m * C::kQOBytes);
          Mma<T>::run(acc[2 * nb], a, b[0], b[1]);
          Mma<T>::run(acc[2 * nb + 1], a, b[2], b[3]);
        }
      }
      reduce(acc, sum);
    };
    one(0, s_sum);
    one(1, dp_sum);
  } else {
    float st[kNB][4], dpt[kNB][4];
#pragma unroll
    for (int i = 0; i < kNB; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.0f;
    const UnitAddr<kD, C::kSplit> a_rows(s0, key_tile * 16 + (lane % 16), split, lane / 16);  // A: K, V
    const UnitAddr<kD, C::kSplit> b_rows(s0 + C::kOffQ, row_group * C::kTileRows + (lane % 8) + (lane / 16) * 8,
                                         split, (lane / 8) % 2);  // B: Q, dO
#pragma unroll
    for (int j = 0; j < C::kSplitUnits; ++j) {
      if (C::kUnits % C::kSplit != 0 && split + C::kSplit * j >= C::kUnits) break;  // warp-uniform
      uint32_t ak[4], av[4];
      ldmatrix_x4(ak, a_rows.at(0, j));
      ldmatrix_x4(av, a_rows.at(0, j) + C::kKVBytes);
#pragma unroll
      for (int nb = 0; nb < kNB / 2; ++nb) {
        uint32_t bq[4], bo[4];
        ldmatrix_x4(bq, b_rows.at(nb * 16, j));
        ldmatrix_x4(bo, b_rows.at(nb * 16, j) + C::kQOBytes);
        Mma<T>::run(st[2 * nb], ak, bq[0], bq[1]);
        Mma<T>::run(st[2 * nb + 1], ak, bq[2], bq[3]);
        Mma<T>::run(dpt[2 * nb], av, bo[0], bo[1]);
        Mma<T>::run(dpt[2 * nb + 1], av, bo[2], bo[3]);
      }
    }
    reduce(st, s_sum);
    reduce(dpt, dp_sum);
  }

  // P^T and dS^T of the share's cells, in pairs of adjacent rows (one 32-bit store each).
  const bool masked = kKMajor ? ((w.flags >> (kWorkTestGroupShift + key_tile)) & 1) != 0 : (w.flags & kWorkMasked) != 0;
  with_softcap(p, [&](auto softcap) {
#pragma unroll
    for (int i = 0; i < C::kShare; i += 2) {
      const int f = split * C::kShare + i;
      const int nb = f / 4, e = f % 4;
      const int key_local = key_tile * 16 + lane / 4 + 8 * (e / 2);
      const int row_local = row_group * C::kTileRows + nb * 8 + (lane % 4) * 2;
      KeyInterval rows{0, 1 << 30};
      if (masked) {
        rows = item_queries(w, k_base + key_local);
        rows.lo -= q_base, rows.hi -= q_base;
      }
      float pv[2], dsv[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const BwdCell cell = bwd_cell<decltype(softcap)::value>(p, s_sum[i + c], dp_sum[i + c], s_lse[row_local + c],
                                                                s_delta[row_local + c], rows.contains(row_local + c));
        pv[c] = cell.p;
        dsv[c] = cell.ds;
      }
      const uint32_t at = Swizzled<C::kPdsCols>::element(key_local, row_local);
      if constexpr (kWriteP)
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s0 + C::kOffP + at), "r"(Mma<T>::pack(pv[0], pv[1])));
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s0 + C::kOffdS + at), "r"(Mma<T>::pack(dsv[0], dsv[1])));
    }
  });
  __syncthreads();
}

// dQ[kM rows][units warp + kWarps j] = dS K from the dS^T tile and K in shared memory; sink(j, mt, frag) receives
// unit j's fragments of row tile mt ([8-column block][4]) for every unit this warp owns. C::kPaired: row tiles
// outermost (K read once per row tile, with a third of the registers live), else every row tile per K load.
template <class T, class C, class Sink>
__device__ __forceinline__ void split_dq_units(unsigned char* smem, int warp, int lane, Sink&& sink) {
  constexpr int kD = C::kD;
  const uint32_t s0 = smem_addr(smem);
  if constexpr (C::kPaired) {
#pragma unroll
    for (int mt = 0; mt < C::kRowTiles; ++mt) {
      uint32_t a[C::kKeyTiles][4];  // A: dS (rows x keys), transposed loads of dS^T
#pragma unroll
      for (int kk = 0; kk < C::kKeyTiles; ++kk)
        ldmatrix_x4_trans(a[kk], ds_t_address(s0 + C::kOffdS, mt, lane) + kk * 16 * C::kPdsCols * 2);
      const UnitAddr<kD, C::kWarps> k_t(s0, (lane % 8) + ((lane / 8) % 2) * 8, warp, lane / 16);  // B^T: K
#pragma unroll
      for (int j = 0; j < C::kDqUnits; ++j) {
        if (C::kUnits % C::kWarps != 0 && warp + C::kWarps * j >= C::kUnits) break;  // warp-uniform
        float acc[2][4];
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][e] = acc[1][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < C::kKeyTiles; ++kk) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, k_t.at(kk * 16, j));
          Mma<T>::run(acc[0], a[kk], b[0], b[1]);
          Mma<T>::run(acc[1], a[kk], b[2], b[3]);
        }
        sink(j, mt, acc);
      }
    }
  } else {
    uint32_t a[C::kRowTiles][C::kKeyTiles][4];  // A: dS (rows x keys), transposed loads of dS^T
#pragma unroll
    for (int mt = 0; mt < C::kRowTiles; ++mt)
#pragma unroll
      for (int kk = 0; kk < C::kKeyTiles; ++kk)
        ldmatrix_x4_trans(a[mt][kk], ds_t_address(s0 + C::kOffdS, mt, lane) + kk * 16 * C::kPdsCols * 2);
    const UnitAddr<kD, C::kWarps> k_t(s0, (lane % 8) + ((lane / 8) % 2) * 8, warp, lane / 16);  // B^T: K rows = keys
#pragma unroll
    for (int j = 0; j < C::kDqUnits; ++j) {
      if (C::kUnits % C::kWarps != 0 && warp + C::kWarps * j >= C::kUnits) break;  // warp-uniform
      float acc[C::kRowTiles][2][4];
#pragma unroll
      for (int mt = 0; mt < C::kRowTiles; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][0][e] = acc[mt][1][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < C::kKeyTiles; ++kk) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, k_t.at(kk * 16, j));
#pragma unroll
        for (int mt = 0; mt < C::kRowTiles; ++mt) {
          Mma<T>::run(acc[mt][0], a[mt][kk], b[0], b[1]);
          Mma<T>::run(acc[mt][1], a[mt][kk], b[2], b[3]);
        }
      }
#pragma unroll
      for (int mt = 0; mt < C::kRowTiles; ++mt) sink(j, mt, acc[mt]);
    }
  }
}

template <class T, int kD, bool kDq, bool kPaired>
__device__ __forceinline__ void dkdv_split_tile(const BwdParams& p, int linear, unsigned char* smem) {
  using C = SplitBwdConfig<kD, kPaired>;
  constexpr int kN = C::kN, kM = C::kM, kThreads = C::kThreads;
  const uint32_t s0 = smem_addr(smem);

  const WorkCoords at = work_coords(linear, p.hkv, p.list);
  const TileInfo info = p.list.tiles[at.tile_index];
  const int kv_head = at.head;
  const int group = p.hq / p.hkv;
  const int k_base = info.tile * kN;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;

  const int64_t q_stride = int64_t{p.hq} * p.d;
  const int64_t kv_stride = int64_t{p.hkv} * p.d;
  const T* q_tensor = static_cast<const T*>(p.q);
  const T* dout_tensor = static_cast<const T*>(p.dout);
  const T* k_head = static_cast<const T*>(p.k) + int64_t{kv_head} * p.d;
  const T* v_head = static_cast<const T*>(p.v) + int64_t{kv_head} * p.d;
  load_rows_async<kN, kD, kThreads>(s0, k_head + k_base * kv_stride, kv_stride, p.tk - k_base, p.d, k_head);
  load_rows_async<kN, kD, kThreads>(s0 + C::kOffV, v_head + k_base * kv_stride, kv_stride, p.tk - k_base, p.d, v_head);

  // The steps: iteration `it` is item it % count of q head kv_head * group + it / count; each item's 64-row chunk
  // runs in kM-row steps, those that hold none of its rows skipped.
  const int first = info.first, count = info.count;
  const int total = count * group;
  struct Step {
    int it, q_base;
    WorkItem w;
  };
  auto next_step = [&](Step s) {  // the step after s; it == total: none
    for (;;) {
      s.q_base += kM;
      if (s.q_base % kDkdvTileQ == 0 || s.q_base >= s.w.q1) {
        if (++s.it >= total) return s;
        s.w = p.list.items[first + s.it % count];
        s.q_base = (s.w.q0 / kDkdvTileQ) * kDkdvTileQ;
      }
      if (s.q_base + kM > s.w.q0) return s;
    }
  };
  auto issue_loads = [&](const Step& s) {
    const int head = kv_head * group + s.it / count;
    const int64_t offset = s.q_base * q_stride + int64_t{head} * p.d;
    load_rows_async<kM, kD, kThreads>(s0 + C::kOffQ, q_tensor + offset, q_stride, p.tq - s.q_base, p.d, q_tensor);
    load_rows_async<kM, kD, kThreads>(s0 + C::kOffdO, dout_tensor + offset, q_stride, p.tq - s.q_base, p.d,
                                      dout_tensor);
    load_row_stats_async<kM>(p, head, s.q_base, reinterpret_cast<float*>(smem + C::kOffLse),
                             reinterpret_cast<float*>(smem + C::kOffDelta), tid);
  };
  Step step{-1, 0, WorkItem{}};
  step.w.q1 = 0;  // next_step moves to iteration 0
  step = next_step(step);
  if (step.it < total) issue_loads(step);
  cp_async_commit();

  // Phase 2: this warp's 16 keys and units g + kColGroups j.
  const int key_tile = warp % C::kKeyTiles, col_group = warp / C::kKeyTiles;
  float dk[C::kColUnits][2][4], dv[C::kColUnits][2][4];
#pragma unroll
  for (int j = 0; j < C::kColUnits; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[j][0][e] = dk[j][1][e] = dv[j][0][e] = dv[j][1][e] = 0.0f;
  const FragAddr<C::kPdsCols> pds_a(s0 + C::kOffP, key_tile * 16 + (lane % 16), lane / 16);  // A: P^T, dS^T
  const UnitAddr<kD, C::kColGroups> qo_t(s0 + C::kOffQ, (lane % 8) + ((lane / 8) % 2) * 8, col_group,
                                         lane / 16);  // B^T: Q, dO rows

#pragma unroll 1
  while (step.it < total) {
    Step next;
    if constexpr (!kPaired) next = next_step(step);
    const int head = kv_head * group + step.it / count;
    const int q_base = step.q_base;
    cp_async_wait<0>();
    __syncthreads();  // this step's loads are visible, the previous step's dQ is done with dS^T
    split_probabilities<T, C, true, true>(p, smem, step.w, k_base, q_base, warp, lane);

#pragma unroll
    for (int t = 0; t < kM / 16; ++t) {
      uint32_t ap[4], ads[4];
      ldmatrix_x4(ap, pds_a.at(0, t));
      ldmatrix_x4(ads, pds_a.at(0, t) + C::kPdsBytes);
#pragma unroll
      for (int j = 0; j < C::kColUnits; ++j) {
        if (C::kUnits % C::kColGroups != 0 && col_group + C::kColGroups * j >= C::kUnits) break;
        const uint32_t b_addr = qo_t.at(t * 16, j);
        uint32_t bo[4], bq[4];
        ldmatrix_x4_trans(bo, b_addr + C::kQOBytes);
        ldmatrix_x4_trans(bq, b_addr);
        Mma<T>::run(dv[j][0], ap, bo[0], bo[1]);
        Mma<T>::run(dv[j][1], ap, bo[2], bo[3]);
        Mma<T>::run(dk[j][0], ads, bq[0], bq[1]);
        Mma<T>::run(dk[j][1], ads, bq[2], bq[3]);
      }
    }
    // Every warp past phase 2: Q and dO are free, the next step's loads overlap dQ (which reads only dS^T and K).
    __syncthreads();
    if constexpr (kPaired) next = next_step(step);
    if (next.it < total) issue_loads(next);
    cp_async_commit();
    if constexpr (kDq) {
      // The step's rows lie within kM rows of its base: 32-bit offsets from one 64-bit chunk pointer.
      float* const rows = p.dq_accum + (int64_t{q_base} * p.hq + head) * p.d;
      const int row_stride = p.hq * p.d;
      split_dq_units<T, C>(smem, warp, lane, [&](int j, int mt, const float (&acc)[2][4]) {
        const int unit_col = (warp + C::kWarps * j) * 16;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = mt * 16 + lane / 4 + 8 * r;
          const bool row_valid = q_base + row < p.tq;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
          // Lanes 2i and 2i + 1 trade halves: the even lane adds 4 columns of block 0, the odd one of block 1.
          const bool odd = lane & 1;
          const float give0 = odd ? acc[0][2 * r] : acc[1][2 * r];
          const float give1 = odd ? acc[0][2 * r + 1] : acc[1][2 * r + 1];
          const float got0 = __shfl_xor_sync(0xffffffffu, give0, 1);
          const float got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
          const float4 v = odd ? make_float4(got0, got1, acc[1][2 * r], acc[1][2 * r + 1])
                               : make_float4(acc[0][2 * r], acc[0][2 * r + 1], got0, got1);
          const int col = unit_col + (odd ? 8 : 0) + ((lane % 4) & 2) * 2;
          red_add_v4(rows + (row * row_stride + col), v, row_valid && col < p.d);
#else
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const int col = unit_col + b * 8 + (lane % 4) * 2;
            if (row_valid && col < p.d) {
              atomicAdd(rows + (row * row_stride + col), acc[b][2 * r]);
              atomicAdd(rows + (row * row_stride + col + 1), acc[b][2 * r + 1]);
            }
          }
#endif
        }
      });
    }
    step = next;
  }
  cp_async_wait<0>();

  // dK, dV: element pairs (a warp's units are 16 columns apart from the next group's).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = k_base + key_tile * 16 + lane / 4 + 8 * r;
    if (key >= p.tk) continue;
    const int64_t base = key * kv_stride + int64_t{kv_head} * p.d;
#pragma unroll
    for (int j = 0; j < C::kColUnits; ++j) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int col = (col_group + C::kColGroups * j) * 16 + b * 8 + (lane % 4) * 2;
        if (col < p.d) {
          store_pair<T>(p.dk, base + col, dk[j][b][2 * r], dk[j][b][2 * r + 1], p.grad_fp32);
          store_pair<T>(p.dv, base + col, dv[j][b][2 * r], dv[j][b][2 * r + 1], p.dv_fp32);
        }
      }
    }
  }
}

template <class T, int kD>
__device__ __forceinline__ void dq_split_tile(const BwdParams& p, int linear, unsigned char* smem) {
  using C = SplitBwdConfig<kD>;
  constexpr int kN = C::kN, kM = C::kM, kThreads = C::kThreads;
  const uint32_t s0 = smem_addr(smem);

  const WorkCoords at = work_coords(linear, p.hq, p.list);
  const TileInfo info = p.list.tiles[at.tile_index];
  const int head = at.head;
  const int kv_head = head / (p.hq / p.hkv);
  const int q_base = info.tile * kM;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;

  const int64_t q_stride = int64_t{p.hq} * p.d;
  const int64_t kv_stride = int64_t{p.hkv} * p.d;
  const T* q_tensor = static_cast<const T*>(p.q);
  const T* dout_tensor = static_cast<const T*>(p.dout);
  const T* k_head = static_cast<const T*>(p.k) + int64_t{kv_head} * p.d;
  const T* v_head = static_cast<const T*>(p.v) + int64_t{kv_head} * p.d;
  const int64_t q_offset = q_base * q_stride + int64_t{head} * p.d;
  load_rows_async<kM, kD, kThreads>(s0 + C::kOffQ, q_tensor + q_offset, q_stride, p.tq - q_base, p.d, q_tensor);
  load_rows_async<kM, kD, kThreads>(s0 + C::kOffdO, dout_tensor + q_offset, q_stride, p.tq - q_base, p.d,
                                    dout_tensor);
  load_row_stats_async<kM>(p, head, q_base, reinterpret_cast<float*>(smem + C::kOffLse),
                           reinterpret_cast<float*>(smem + C::kOffDelta), tid);
  cp_async_commit();

  float acc[C::kDqUnits][C::kRowTiles][2][4];
#pragma unroll
  for (int j = 0; j < C::kDqUnits; ++j)
#pragma unroll
    for (int mt = 0; mt < C::kRowTiles; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][mt][0][e] = acc[j][mt][1][e] = 0.0f;

  for (int item = info.first; item < info.first + info.count; ++item) {
    const WorkItem w = p.list.items[item];
    const int k0 = (w.k0 / kN) * kN;
    __syncthreads();  // the previous key tile's readers are done
    load_rows_async<kN, kD, kThreads>(s0, k_head + k0 * kv_stride, kv_stride, p.tk - k0, p.d, k_head);
    load_rows_async<kN, kD, kThreads>(s0 + C::kOffV, v_head + k0 * kv_stride, kv_stride, p.tk - k0, p.d, v_head);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    split_probabilities<T, C, false, false>(p, smem, w, k0, q_base, warp, lane);
    split_dq_units<T, C>(smem, warp, lane, [&](int j, int mt, const float (&part)[2][4]) {
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][mt][b][e] += part[b][e];
    });
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < C::kRowTiles; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = q_base + mt * 16 + lane / 4 + 8 * r;
      if (row >= p.tq) continue;
      const int64_t base = row * q_stride + int64_t{head} * p.d;
#pragma unroll
      for (int j = 0; j < C::kDqUnits; ++j) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const int col = (warp + C::kWarps * j) * 16 + b * 8 + (lane % 4) * 2;
          if (col >= p.d) continue;
          const float x = acc[j][mt][b][2 * r], y = acc[j][mt][b][2 * r + 1];
          if (p.accumulate_dq) {
            float2* const to = reinterpret_cast<float2*>(static_cast<float*>(p.dq) + base + col);
            const float2 old = *to;
            *to = make_float2(old.x + x, old.y + y);
          } else {
            store_pair<T>(p.dq, base + col, x, y, p.grad_fp32);
          }
        }
      }
    }
  }
}

}  // namespace magi::cuda::detail
