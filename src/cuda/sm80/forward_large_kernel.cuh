// Forward flash kernel for large head dims (tiles 320 .. 1024): D is split so that shared memory and registers stay
// bounded whatever D is. One block = one q tile (kM rows) of one head, 8 warps; as in forward_kernel.cuh it walks
// every work item of its tile in one online softmax and writes out / lse once.
//
// Per item (kN = 64 keys):
//   S = Q K^T    S [kM x kN] tiled over the warps by (16 rows x kSN keys); the full-D reduction runs over 64-column
//                K chunks streamed through a cp.async ring (Q resident in shared memory, or streamed beside K).
//   softmax      each warp's partial row maxima go through shared memory; every warp sharing a row combines them in
//                the same order (so they agree bitwise), writes its P (16-bit) to shared memory; the key warp 0 of a
//                row publishes its rescale factor.
//   O += P V     O [kM x D] (fp32) split over the warps by columns (kOCols each; by rows too where a warp's share
//                would exceed 128 registers); V streams through the ring in chunks of kVK keys x D; every warp reads
//                P as its A operand.
// The ring is one sequence of loads per item (kDChunks K chunks, then kVChunks V chunks); load L + stages - 1 is
// issued while load L is consumed, each kind in its own `stages` buffers (a buffer is rewritten only after the
// barrier that follows its last reader).
#pragma once

#include <cfloat>

#include "cuda/forward_common.cuh"
#include "cuda/kernel_common.cuh"
#include "cuda/sm80/forward_kernel.cuh"
#include "cuda/sm80/mma.cuh"
#include "cuda/sm80/tiles.hpp"

namespace magi::cuda::detail {

template <int kD, int kVariant>
struct LargeFwdConfig {
  static_assert(is_large_head_dim(kD) && kD % kLargeFwdChunk == 0, "large-D tiles are whole 64-column chunks");
  static_assert(kVariant >= 0 && kVariant < kLargeFwdVariants, "unknown large-D forward variant");
  static constexpr int kWarps = kLargeFwdWarps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kM = large_fwd_tile_q(kD);
  static constexpr int kN = kLargeFwdTileK;
  static constexpr int kDC = kLargeFwdChunk;
  static constexpr int kDChunks = kD / kDC;
  static constexpr bool kQResident = large_fwd_q_resident(kVariant);
  static constexpr int kStages = large_fwd_stages(kVariant);
  static constexpr int kVK = large_fwd_v_keys(kD, kVariant);
  static constexpr int kVChunks = kN / kVK;
  static constexpr int kSeq = kDChunks + kVChunks;  // loads per item
  // S: warps over (16-row strips x key columns).
  static constexpr int kSWarpsM = kM / 16;
  static constexpr int kSWarpsN = kWarps / kSWarpsM;
  static constexpr int kSN = kN / kSWarpsN;  // keys per warp
  static_assert(kSWarpsM * kSWarpsN == kWarps && kSN % 16 == 0, "S tiles: whole 16-row x 16-key blocks per warp");
  // O: warps over (rows x columns).
  static constexpr int kOWarpsN = large_fwd_col_warps(kD);
  static constexpr int kOWarpsM = kWarps / kOWarpsN;
  static constexpr int kOCols = kD / kOWarpsN;
  static constexpr int kORows = kM / kOWarpsM;
  static constexpr int kOMTiles = kORows / 16;
  static constexpr int kOBlocks = kOCols / 8;
  static constexpr int kOBlocksStored = (kOBlocks + 3) / 4 * 4;  // store_row_blocks writes groups of four
  static_assert(kOWarpsN > 0 && kOCols % 16 == 0 && kORows % 16 == 0, "O tiles: whole m-tiles x 16 columns");
  // Shared memory (bytes): Q (resident, or a ring of chunks), K ring, V ring, P, row arrays.
  static constexpr int kQBytes = kQResident ? kM * kD * 2 : kStages * kM * kDC * 2;
  static constexpr int kQStage = kM * kDC * 2;
  static constexpr int kKStage = kN * kDC * 2;
  static constexpr int kVStage = kVK * kD * 2;
  static constexpr int kPBytes = kM * kN * 2;
  static constexpr int kOffK = kQBytes;
  static constexpr int kOffV = kOffK + kStages * kKStage;
  static constexpr int kOffP = kOffV + kStages * kVStage;
  static constexpr int kOffRows = kOffP + kPBytes;
  static constexpr int kSmemBytes = kOffRows + large_fwd_row_bytes(kD);
  static_assert(kSmemBytes == large_fwd_smem_bytes(kD, kVariant), "tiles.hpp and the kernel disagree");
};

template <class T, int kD, int kVariant>
__device__ __forceinline__ void forward_large_tile(const FwdParams& p, int linear, unsigned char* smem) {
  using Cfg = LargeFwdConfig<kD, kVariant>;
  constexpr int kM = Cfg::kM, kN = Cfg::kN, kDC = Cfg::kDC, kThreads = Cfg::kThreads;
  constexpr int kStages = Cfg::kStages, kDChunks = Cfg::kDChunks, kVChunks = Cfg::kVChunks, kVK = Cfg::kVK;
  constexpr int kSNBlocks = Cfg::kSN / 8;

  const uint32_t sQ = smem_addr(smem);
  const uint32_t sK = sQ + Cfg::kOffK;
  const uint32_t sV = sQ + Cfg::kOffV;
  const uint32_t sP = sQ + Cfg::kOffP;
  float* const part_max = reinterpret_cast<float*>(smem + Cfg::kOffRows);  // [kSWarpsN][kM]
  float* const part_sum = part_max + Cfg::kSWarpsN * kM;                   // [kSWarpsN][kM]
  float* const row_scale = part_sum + Cfg::kSWarpsN * kM;                  // [kM]
  float* const final_max = row_scale + kM;                                 // [kM]

  const WorkCoords at = work_coords(linear, p.hq, p.list);
  const TileInfo info = p.list.tiles[at.tile_index];
  const int head = at.head;
  const int kv_head = head / (p.hq / p.hkv);
  const int q_base = info.tile * kM;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;

  const int64_t q_stride = int64_t{p.hq} * p.d;
  const int64_t kv_stride = int64_t{p.hkv} * p.d;
  const T* q_tile = static_cast<const T*>(p.q) + q_base * q_stride + int64_t{head} * p.d;
  const T* k_head = static_cast<const T*>(p.k) + int64_t{kv_head} * p.d;
  const T* v_head = static_cast<const T*>(p.v) + int64_t{kv_head} * p.d;
  const int items = info.count;

  // Load L of the tile's sequence (item L / kSeq, position L % kSeq) into its ring buffer; nothing past the last item.
  auto issue = [&](int load) {
    const int item = load / Cfg::kSeq, pos = load - item * Cfg::kSeq;
    if (item >= items) return;
    const int k0 = (p.list.items[info.first + item].k0 / kN) * kN;
    if (pos < kDChunks) {
      const int stage = (item * kDChunks + pos) % kStages;
      load_tile_async<kN, kDC, kThreads>(sK + stage * Cfg::kKStage, k_head + k0 * kv_stride + pos * kDC, kv_stride,
                                         p.tk - k0, p.d - pos * kDC, k_head);
      if constexpr (!Cfg::kQResident)
        load_tile_async<kM, kDC, kThreads>(sQ + stage * Cfg::kQStage, q_tile + pos * kDC, q_stride, p.tq - q_base,
                                           p.d - pos * kDC, k_head);
    } else {
      const int chunk = pos - kDChunks;
      const int stage = (item * kVChunks + chunk) % kStages;
      const int key0 = k0 + chunk * kVK;
      load_tile_async<kVK, kD, kThreads>(sV + stage * Cfg::kVStage, v_head + key0 * kv_stride, kv_stride, p.tk - key0,
                                         p.d, v_head);
    }
  };
  // Consumer step of load L: it has landed (and Q with the first), every warp is done with load L - 1's buffers.
  auto next_step = [&](int load) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    issue(load + kStages - 1);
    cp_async_commit();
  };

  if (items > 0) {  // (item-less tiles come here only when a sink joins their rows: no Q or K needed)
    if constexpr (Cfg::kQResident)
      load_tile_async<kM, kD, kThreads>(sQ, q_tile, q_stride, p.tq - q_base, p.d, k_head);
  }
  cp_async_commit();
#pragma unroll
  for (int l = 0; l < kStages - 1; ++l) {
    issue(l);
    cp_async_commit();
  }

  // S strip of this warp: rows s_row0 + {0, 8} (+ lane / 4), keys s_key0 + [0, kSN).
  const int s_rows = (warp / Cfg::kSWarpsN) * 16, s_warp_n = warp % Cfg::kSWarpsN, s_keys = s_warp_n * Cfg::kSN;
  const int my_row0 = q_base + s_rows + lane / 4;
  // O block of this warp: rows o_rows + [0, kORows), columns o_col0 + [0, kOCols).
  const int o_rows = (warp / Cfg::kOWarpsN) * Cfg::kORows, o_col0 = (warp % Cfg::kOWarpsN) * Cfg::kOCols;

  const FragAddr<Cfg::kQResident ? kD : kDC> q_addr(sQ, s_rows + (lane % 16), lane / 16);
  const FragAddr<kDC> k_addr(sK, s_keys + (lane % 8) + (lane / 16) * 8, (lane / 8) % 2);
  // P fragments: this lane's row and first chunk; the key step is a run-time index (the V loop stays rolled).
  const uint32_t p_row = sP + (o_rows + lane % 16) * kN * 2;
  const int p_chunk0 = lane / 16, p_swizzle = lane % 8;
  // V^T fragments: key rows lane % 16, the warp's columns folded into the chunk (the swizzle is on its low bits).
  const FragAddr<kD> v_addr(sV, lane % 16, lane / 16 + o_col0 / 8);

  float acc[Cfg::kOMTiles][Cfg::kOBlocksStored][4];
#pragma unroll
  for (int mt = 0; mt < Cfg::kOMTiles; ++mt)
#pragma unroll
    for (int i = 0; i < Cfg::kOBlocksStored; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};  // the S strip's rows (logit units)
  const bool softcapped = p.softcap > 0.0f;
  const float logit_scale = softcapped ? 1.0f : p.scale_log2;

  for (int item = 0; item < items; ++item) {
    const int load0 = item * Cfg::kSeq;
    // S = Q K^T over the K chunks.
    float s[kSNBlocks][4];
#pragma unroll
    for (int i = 0; i < kSNBlocks; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
    for (int c = 0; c < kDChunks; ++c) {
      next_step(load0 + c);
      const int stage = (item * kDChunks + c) % kStages;
      const uint32_t k_stage = stage * Cfg::kKStage;
      const uint32_t q_off = Cfg::kQResident ? c * 128 : stage * Cfg::kQStage;  // 128 bytes = 64 columns' chunks
#pragma unroll
      for (int kk = 0; kk < kDC / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, q_addr.at(0, kk) + q_off);
#pragma unroll
        for (int nb = 0; nb < Cfg::kSN / 16; ++nb) {
          uint32_t b[4];
          ldmatrix_x4(b, k_addr.at(nb * 16, kk) + k_stage);
          Mma<T>::run(s[2 * nb], a, b[0], b[1]);
          Mma<T>::run(s[2 * nb + 1], a, b[2], b[3]);
        }
      }
    }

    // Softmax: softcap, mask, this warp's row maxima to shared memory, combined by every warp of the rows.
    const WorkItem w = p.list.items[info.first + item];
    const int k0 = (w.k0 / kN) * kN;
    if (softcapped) softcap_logits(s, p);
    if (w.flags & kWorkMasked) {
      const KeyInterval keys[2] = {item_keys(w, my_row0), item_keys(w, my_row0 + 8)};
      const int strip0 = k0 + s_keys, strip1 = strip0 + Cfg::kSN;
      if (!__all_sync(0xffffffffu, keeps_all(keys[0], strip0, strip1) && keeps_all(keys[1], strip0, strip1)))
        mask_cells(s, keys, strip0, lane);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int nb = 0; nb < kSNBlocks; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * r], s[nb][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      if (lane % 4 == 0) part_max[s_warp_n * kM + s_rows + lane / 4 + 8 * r] = mx;
    }
    __syncthreads();
    float scale_old[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = s_rows + lane / 4 + 8 * r;
      float mx = row_max[r];
#pragma unroll
      for (int j = 0; j < Cfg::kSWarpsN; ++j) mx = fmaxf(mx, part_max[j * kM + row]);
      softmax_row_terms(s, row_max, row_sum, scale_old, logit_scale, r, mx);
      if (s_warp_n == 0 && lane % 4 == 0) row_scale[row] = scale_old[r];
    }
    // P (16-bit) to shared memory, row-major [kM x kN], swizzled like every tile.
#pragma unroll
    for (int nb = 0; nb < kSNBlocks; ++nb)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = s_rows + lane / 4 + 8 * r, col = s_keys + nb * 8 + (lane % 4) * 2;
        const uint32_t packed = Mma<T>::pack(s[nb][2 * r], s[nb][2 * r + 1]);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sP + Swizzled<kN>::element(row, col)), "r"(packed));
      }

    // O += P V over the V chunks; the first one's barrier also publishes P and the row scales.
#pragma unroll 1
    for (int vc = 0; vc < kVChunks; ++vc) {
      next_step(load0 + kDChunks + vc);
      if (vc == 0) {
        float scales[Cfg::kOMTiles][2];
        bool unit = true;
#pragma unroll
        for (int mt = 0; mt < Cfg::kOMTiles; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            scales[mt][r] = row_scale[o_rows + mt * 16 + lane / 4 + 8 * r];
            unit = unit && scales[mt][r] == 1.0f;
          }
        if (!__all_sync(0xffffffffu, unit)) {
#pragma unroll
          for (int mt = 0; mt < Cfg::kOMTiles; ++mt)
#pragma unroll
            for (int i = 0; i < Cfg::kOBlocks; ++i) {
              acc[mt][i][0] *= scales[mt][0];
              acc[mt][i][1] *= scales[mt][0];
              acc[mt][i][2] *= scales[mt][1];
              acc[mt][i][3] *= scales[mt][1];
            }
        }
      }
      const uint32_t v_stage = ((item * kVChunks + vc) % kStages) * Cfg::kVStage;
#pragma unroll
      for (int t = 0; t < kVK / 16; ++t) {
        uint32_t a[Cfg::kOMTiles][4];
#pragma unroll
        for (int mt = 0; mt < Cfg::kOMTiles; ++mt) {
          const int chunk = (p_chunk0 + 2 * (vc * (kVK / 16) + t)) ^ p_swizzle;
          ldmatrix_x4(a[mt], p_row + mt * 16 * kN * 2 + chunk * 16);
        }
#pragma unroll
        for (int dp = 0; dp < Cfg::kOCols / 16; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_addr.at(t * 16, dp) + v_stage);
#pragma unroll
          for (int mt = 0; mt < Cfg::kOMTiles; ++mt) {
            Mma<T>::run(acc[mt][2 * dp], a[mt], b[0], b[1]);
            Mma<T>::run(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: the S warps' row sums and maxima to shared memory; each O warp normalises and writes its columns.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = s_rows + lane / 4 + 8 * r;
    if (lane % 4 == 0) {
      part_sum[s_warp_n * kM + row] = sum;
      if (s_warp_n == 0) final_max[row] = row_max[r];
    }
  }
  __syncthreads();
  float block_max = -INFINITY;
  float lse_rows[Cfg::kOMTiles][2];
#pragma unroll
  for (int mt = 0; mt < Cfg::kOMTiles; ++mt) {
    float maxima[2], sums[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = o_rows + mt * 16 + lane / 4 + 8 * r;
      float total = 0.0f;
#pragma unroll
      for (int j = 0; j < Cfg::kSWarpsN; ++j) total += part_sum[j * kM + row];
      maxima[r] = final_max[row];
      sums[r] = lane % 4 == 0 ? total : 0.0f;  // finish_forward_rows adds the quad's four
    }
    finish_forward_rows<T, Cfg::kOBlocksStored>(p, acc[mt], maxima, sums, logit_scale, q_base + o_rows + mt * 16 + lane / 4,
                                                head, lane, block_max, o_col0, Cfg::kOCols, lse_rows[mt]);
  }
  __syncthreads();  // every warp has read prev_lse (it may be lse) before the first column's warps store lse
  if (o_col0 == 0 && lane % 4 == 0) {
#pragma unroll
    for (int mt = 0; mt < Cfg::kOMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = q_base + o_rows + mt * 16 + lane / 4 + 8 * r;
        if (row < p.tq) p.lse[int64_t{row} * p.hq + head] = lse_rows[mt][r];
      }
  }
  publish_max_logits(p, block_max, head, lane);
}

// Plain grid (one block per work index).
template <class T, int kD, int kVariant>
__global__ void __launch_bounds__(LargeFwdConfig<kD, kVariant>::kThreads, large_fwd_blocks_per_sm(kVariant))
    forward_large_kernel(const FwdParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  forward_large_tile<T, kD, kVariant>(p, static_cast<int>(blockIdx.x), smem);
}

// Persistent grid (for_each_work).
template <class T, int kD, int kVariant>
__global__ void __launch_bounds__(LargeFwdConfig<kD, kVariant>::kThreads, large_fwd_blocks_per_sm(kVariant))
    forward_large_kernel_persistent(const FwdParams p, int num_work) {
  extern __shared__ __align__(128) unsigned char smem[];
  for_each_work(num_work, p.work_counter, [&](int linear) { forward_large_tile<T, kD, kVariant>(p, linear, smem); });
}

}  // namespace magi::cuda::detail
