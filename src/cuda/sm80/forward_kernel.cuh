// Forward flash kernel: one block = one q tile of one head; it walks every work item of its tile (all
// slices touching it, so q-overlap merges inside one online softmax) and writes out/lse once.
// Each warp owns kMTiles 16-row m-tiles (rows mt * 16 * warps + warp * 16), so every K/V fragment read
// from shared memory feeds kMTiles independent MMAs. K then V of each item stream through shared memory with
// cp.async: the V load overlaps Q K^T, the next K load overlaps softmax and P V.
#pragma once

#include <cfloat>

#include "cuda/forward_common.cuh"
#include "cuda/kernel_common.cuh"
#include "cuda/small_kernels.hpp"  // check_launch
#include "cuda/sm80/mma.cuh"
#include "cuda/sm80/tiles.hpp"

namespace magi::cuda::detail {

template <int kD, int kTileQ = kFwdTileQ>
struct FwdConfig {
  static constexpr int kWarps = fwd_warps(kD, kTileQ);
  static constexpr int kMTiles = kTileQ / (16 * kWarps);
  static_assert(kMTiles >= 1 && kMTiles * 16 * kWarps == kTileQ, "q tile must be whole m-tiles per warp");
  static constexpr int kMTileStride = 16 * kWarps;  // rows between a warp's m-tiles
  static constexpr int kM = kTileQ;
  static constexpr int kN = fwd_tile_k(kD, kTileQ);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kSmemBytes = fwd_smem_bytes(kD, kTileQ);
};

// A q tile without work items and without a sink: its rows only take the previous partial result (the merge
// with nothing is the identity: out = prev_out, lse = prev_lse; zero where prev_lse = -inf) or, with none,
// become empty rows (out 0, lse -inf). A kernel of its own (forward_itemless_kernel), written as a coalesced
// copy: in a distributed run most q tiles of a remote stage have no remote keys, and the main kernel's
// fragment-ordered epilogue cost several times the bytes' bandwidth there (and its registers). Rows whose
// out and lse already are the previous result (in place) are left alone.
template <class T, int kD, int kRows, int kWarps>
__device__ __forceinline__ void write_itemless_tile(const FwdParams& p, int q_base, int head, int q_end) {
  constexpr int kPairs = (kD / 2 + 31) / 32;  // float2 columns per lane
  constexpr int kRowsInFlight = 4;            // rows whose loads a warp issues before storing
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const bool merge = p.prev_out != nullptr;
  const bool in_place = merge && static_cast<const void*>(p.prev_out) == p.out && p.prev_lse == p.lse;
  const int rows = min(kRows, min(p.tq, q_end) - q_base);
  const int64_t q_stride = int64_t{p.hq} * p.d;
  for (int r0 = warp * kRowsInFlight; r0 < rows; r0 += kWarps * kRowsInFlight) {
    float lse[kRowsInFlight];
    float2 v[kRowsInFlight][kPairs];
#pragma unroll
    for (int j = 0; j < kRowsInFlight; ++j) {
      const int row = q_base + r0 + j;
      lse[j] = merge && r0 + j < rows ? p.prev_lse[int64_t{row} * p.hq + head] : -INFINITY;
#pragma unroll
      for (int c = 0; c < kPairs; ++c) {
        const int col = (c * 32 + lane) * 2;
        const bool keep = !in_place && lse[j] != -INFINITY && col < p.d;
        v[j][c] = keep ? *reinterpret_cast<const float2*>(p.prev_out + row * q_stride + int64_t{head} * p.d + col)
                       : make_float2(0.f, 0.f);
      }
    }
#pragma unroll
    for (int j = 0; j < kRowsInFlight; ++j) {
      const int row = q_base + r0 + j;
      if (r0 + j >= rows || (in_place && lse[j] != -INFINITY)) continue;  // in place: already the result
      if (lane == 0) p.lse[int64_t{row} * p.hq + head] = lse[j];
#pragma unroll
      for (int c = 0; c < kPairs; ++c) {
        const int col = (c * 32 + lane) * 2;
        if (col < p.d) store_pair<T>(p.out, row * q_stride + int64_t{head} * p.d + col, v[j][c].x, v[j][c].y, p.out_fp32);
      }
    }
  }
}

// kWarpTests: masked items' m-tiles that keep all or none of the item's keys are recognised per warp (and with
// two m-tiles per warp, "none" drops their MMAs). Chosen per kernel from H100 A/Bs (flash_bench, masked masks):
// up to D 128 both grids gain 2-11% (also the sm_80 code, run on the H100: varlen causal +7%); the D 256
// persistent kernel lost 1-3%.
template <int kD, int kTileQ, bool kPersistent>
constexpr bool kUseWarpTests = !kPersistent || kD <= 128;
template <class T, int kD, int kTileQ, bool kWarpTests>
__device__ __forceinline__ void forward_kernel_tile(const FwdParams& p, int linear, unsigned char* smem) {
  using Cfg = FwdConfig<kD, kTileQ>;
  constexpr int kM = Cfg::kM, kN = Cfg::kN, kThreads = Cfg::kThreads, kMT = Cfg::kMTiles;
  constexpr int kDSteps = kD / 16;  // k-steps of Q K^T
  constexpr int kNBlocks = kN / 8;  // 8-wide column blocks of S
  constexpr int kDBlocks = kD / 8;  // 8-wide column blocks of O

  const uint32_t sQ = smem_addr(smem);
  const uint32_t sK = sQ + kM * kD * 2;
  const uint32_t sV = sK + kN * kD * 2;

  const WorkCoords at = work_coords(linear, p.hq, p.list);
  const TileInfo info = p.list.tiles[at.tile_index];
  const int tile = info.tile;
  const int head = at.head;
  const int kv_head = head / (p.hq / p.hkv);
  const int q_base = tile * kM;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;

  const int64_t q_stride = int64_t{p.hq} * p.d;
  const int64_t kv_stride = int64_t{p.hkv} * p.d;
  const T* q_tensor = static_cast<const T*>(p.q);
  const T* k_head = static_cast<const T*>(p.k) + int64_t{kv_head} * p.d;
  const T* v_head = static_cast<const T*>(p.v) + int64_t{kv_head} * p.d;

  int item = info.first;
  const int item_end = info.first + info.count;
  auto key_tile = [](int k) { return (k / kN) * kN; };  // the key tile holding key k
  if (item < item_end) {  // (item-less tiles come here only when a sink joins their rows: no Q or K needed)
    load_tile_async<kM, kD, kThreads>(sQ, q_tensor + q_base * q_stride + int64_t{head} * p.d, q_stride,
                                      p.tq - q_base, p.d, q_tensor);
    cp_async_commit();
    const int k0 = key_tile(info.first_minor0);
    // Not k_head: with it shared here, ptxas kept the loop's K addresses in per-thread registers (34 more
    // instructions per item; H100, D 128 full +4% without).
    const T* first_k = static_cast<const T*>(p.k) + int64_t{kv_head} * p.d;
    load_tile_async<kN, kD, kThreads>(sK, first_k + k0 * kv_stride, kv_stride, p.tk - k0, p.d, first_k);
  }
  cp_async_commit();

  float acc[kMT][kDBlocks][4];
  float row_max[kMT][2], row_sum[kMT][2];  // row_max in logit units (raw, or log2 when softcapped)
  const bool softcapped = p.softcap > 0.0f;
  const float logit_scale = softcapped ? 1.0f : p.scale_log2;
  // With 64-key items from D 128 on, a row keeps its (stale) maximum until a logit exceeds it by more than 2^8 in
  // the exponent (FA4's lazy rescale): the terms stay below 2^8, and most items then leave every scale at exactly
  // 1, so a warp skips its rescale (H100: D 128 full +3%, shared question +2%; D 256 in 128 x 64 tiles +1-2%).
  // max_logits needs the true maxima: no slack then. D 64 lost 3% with it, D 256 in 64 x 32 tiles 1-2%.
  constexpr bool kLazyRescale = kD >= 128 && kN == 64;
  const float max_slack = p.max_logits == nullptr ? 8.0f / logit_scale : 0.0f;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int i = 0; i < kDBlocks; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.0f;
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }
  // Row of element e (0..3) of m-tile mt: my_row0 + mt * Cfg::kMTileStride + (e / 2) * 8.
  const int my_row0 = q_base + warp * 16 + lane / 4;

  const FragAddr<kD> q_addr(sQ, warp * 16 + (lane % 16), lane / 16);
  const FragAddr<kD> k_addr(sK, (lane % 8) + (lane / 16) * 8, (lane / 8) % 2);
  // V^T fragments use Q's pattern without the warp's row offset: same swizzle registers, another base.
  FragAddr<kD> v_addr = q_addr;
  v_addr.base = q_addr.base + (sV - sQ) - warp * 16 * kD * 2;

  for (; item < item_end; ++item) {
    // Only k0 and the flags stay live; a masked item re-reads its bounds (an L1 hit) to save registers.
    const int k0 = key_tile(p.list.items[item].k0);
    const int flags = p.list.items[item].flags;
    const int next_k0 = item + 1 < item_end ? key_tile(p.list.items[item + 1].k0) : 0;  // fetched early
    cp_async_wait<0>();
    __syncthreads();
    load_tile_async<kN, kD, kThreads>(sV, v_head + k0 * kv_stride, kv_stride, p.tk - k0, p.d, v_head);
    cp_async_commit();

    // Masked items: most m-tiles (diagonals, document edges) keep all or none of the item's keys, recognised per
    // warp when kWarpTests: "none" contributes nothing (the row state stays), "all" skips the per-cell test.
    // With two m-tiles per warp (64 rows apart, so a causal diagonal's decisions fall on every warp alike) a
    // "none" m-tile also drops its MMAs, decided before them; the m-tiles that run are a compile-time set in
    // the lambdas below (no predicates in the MMA loops). With one m-tile the MMAs run anyway and the decision
    // follows them: deciding first made ptxas schedule the loop worse (H100: -2 to -4% on every mask, D 256).
    unsigned mma_set = (1u << kMT) - 1;
    if constexpr (kWarpTests && kMT == 2) {
      if (flags & kWorkMasked) {
        const WorkItem w = p.list.items[item];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const int row = my_row0 + mt * Cfg::kMTileStride;
          const bool none = keeps_none(item_keys(w, row), k0, k0 + kN) && keeps_none(item_keys(w, row + 8), k0, k0 + kN);
          if (__all_sync(0xffffffffu, none)) mma_set &= ~(1u << mt);
        }
      }
    }
    uint32_t p_frag[kMT][kN / 16][4];
    // S = Q K^T and the online softmax for the m-tiles in kActive; P as 16-bit A fragments.
    auto scores = [&](auto active_set) {
      constexpr unsigned kActive = decltype(active_set)::value;
      float s[kMT][kNBlocks][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int i = 0; i < kNBlocks; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < kDSteps; ++ks) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
          if ((kActive >> mt) & 1u) ldmatrix_x4(a[mt], q_addr.at(mt * Cfg::kMTileStride, ks));
#pragma unroll
        for (int nb = 0; nb < kN / 16; ++nb) {
          uint32_t b[4];
          ldmatrix_x4(b, k_addr.at(nb * 16, ks));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            if (!((kActive >> mt) & 1u)) continue;
            Mma<T>::run(s[mt][2 * nb], a[mt], b[0], b[1]);
            Mma<T>::run(s[mt][2 * nb + 1], a[mt], b[2], b[3]);
          }
        }
      }

#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        if (!((kActive >> mt) & 1u)) continue;
        if (softcapped) softcap_logits(s[mt], p);
        if (flags & kWorkMasked) {
          const WorkItem w = p.list.items[item];  // re-read (an L1 hit) rather than kept in registers
          const int row = my_row0 + mt * Cfg::kMTileStride;
          const KeyInterval keys[2] = {item_keys(w, row), item_keys(w, row + 8)};
          bool test_cells = true;
          if constexpr (kWarpTests) {
            const int k_end = k0 + kN;
            if (kMT == 1 && __all_sync(0xffffffffu, keeps_none(keys[0], k0, k_end) && keeps_none(keys[1], k0, k_end))) {
#pragma unroll
              for (int t = 0; t < kN / 16; ++t)
                p_frag[mt][t][0] = p_frag[mt][t][1] = p_frag[mt][t][2] = p_frag[mt][t][3] = 0u;
              continue;
            }
            test_cells = !__all_sync(0xffffffffu, keeps_all(keys[0], k0, k_end) && keeps_all(keys[1], k0, k_end));
          }
          if (test_cells) mask_cells(s[mt], keys, k0, lane);
        }
        // Online softmax: new row maxima, rescale what was accumulated so far.
        float scale_old[2];
        auto rescale = [&](int r) {
#pragma unroll
          for (int i = 0; i < kDBlocks; ++i) {
            acc[mt][i][2 * r] *= scale_old[r];
            acc[mt][i][2 * r + 1] *= scale_old[r];
          }
        };
        online_softmax<kNBlocks, kLazyRescale>(s[mt], row_max[mt], row_sum[mt], scale_old, logit_scale, max_slack);
        if constexpr (kD < 128) {
          rescale(0);
          rescale(1);
        }
        // Once the maxima settle (or stay within the slack), most items leave every row's scale at exactly 1; from
        // D 128 on the warp then skips the multiplies, bitwise neutral (H100, D 256: full +6%, varlen causal +1%);
        // at D 64 the test cost 1-3% (that kernel multiplies unconditionally).
        if constexpr (kD >= 128) {
          if (__any_sync(0xffffffffu, scale_old[0] != 1.0f || scale_old[1] != 1.0f)) {
            rescale(0);
            rescale(1);
          }
        }
        // P as 16-bit A fragments right away: half the registers of the fp32 tile while P V waits for V.
#pragma unroll
        for (int t = 0; t < kN / 16; ++t) {
          p_frag[mt][t][0] = Mma<T>::pack(s[mt][2 * t][0], s[mt][2 * t][1]);
          p_frag[mt][t][1] = Mma<T>::pack(s[mt][2 * t][2], s[mt][2 * t][3]);
          p_frag[mt][t][2] = Mma<T>::pack(s[mt][2 * t + 1][0], s[mt][2 * t + 1][1]);
          p_frag[mt][t][3] = Mma<T>::pack(s[mt][2 * t + 1][2], s[mt][2 * t + 1][3]);
        }
      }
    };

    for_active_set<kMT>(mma_set, scores);

    // V ready; K is free: fetch the next item's K while P V runs.
    cp_async_wait<0>();
    __syncthreads();
    if (item + 1 < item_end) {
      load_tile_async<kN, kD, kThreads>(sK, k_head + next_k0 * kv_stride, kv_stride, p.tk - next_k0, p.d, k_head);
    }
    cp_async_commit();

    // O += P V for the m-tiles in kActive.
    auto accumulate = [&](auto active_set) {
      constexpr unsigned kActive = decltype(active_set)::value;
#pragma unroll
      for (int t = 0; t < kN / 16; ++t) {
#pragma unroll
        for (int dp = 0; dp < kD / 16; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_addr.at(t * 16, dp));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            if (!((kActive >> mt) & 1u)) continue;
            Mma<T>::run(acc[mt][2 * dp], p_frag[mt][t], b[0], b[1]);
            Mma<T>::run(acc[mt][2 * dp + 1], p_frag[mt][t], b[2], b[3]);
          }
        }
      }
    };
    for_active_set<kMT>(mma_set, accumulate);
  }
  cp_async_wait<0>();

  // Epilogue: normalise, fold in the sink, write out / lse, contribute to max_logits.
  float block_max = -INFINITY;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
    finish_forward_rows<T, kDBlocks>(p, acc[mt], row_max[mt], row_sum[mt], logit_scale, my_row0 + mt * Cfg::kMTileStride,
                                     head, lane, block_max);
  publish_max_logits(p, block_max, head, lane);
}


// Plain grid (one block per work index; the hardware balances best when no SM margin is asked for).
template <class T, int kD, int kTileQ>
__global__ void __launch_bounds__(FwdConfig<kD, kTileQ>::kThreads) forward_kernel(const FwdParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  forward_kernel_tile<T, kD, kTileQ, kUseWarpTests<kD, kTileQ, false>>(
      p, static_cast<int>(blockIdx.x), smem);
}

// Persistent grid (for_each_work).
// The minimum blocks per SM steer ptxas (nvcc 13, D 128): with an explicit 1, the 128-row kernel spilled 16
// bytes instead of 132 (none now); the 64-row one keeps 3 resident blocks (168 registers) instead of 2 (198).
template <class T, int kD, int kTileQ>
__global__ void __launch_bounds__(FwdConfig<kD, kTileQ>::kThreads, FwdConfig<kD, kTileQ>::kMTiles == 1 && kD <= 128 ? 3 : 1)
    forward_kernel_persistent(const FwdParams p, int num_work) {
  extern __shared__ __align__(128) unsigned char smem[];
  for_each_work(num_work, p.work_counter, [&](int linear) {
    forward_kernel_tile<T, kD, kTileQ, kUseWarpTests<kD, kTileQ, true>>(p, linear, smem);
  });
}

// The plan's item-less q tiles (the last of its order, from `first` on), one block per (tile, head).
template <class T, int kD, int kTileQ>
__global__ void __launch_bounds__(fwd_block_warps(kD, kTileQ) * 32) forward_itemless_kernel(const FwdParams p, int first) {
  const int linear = static_cast<int>(blockIdx.x);
  const TileRows rows = tile_rows(p.list, p.list.tiles[first + linear / p.hq].tile, kTileQ);
  write_itemless_tile<T, kD, kTileQ, fwd_block_warps(kD, kTileQ)>(p, rows.start, linear % p.hq, rows.end);
}

// The last `itemless_tiles` tiles of the list on the copy kernel (both families' launchers).
template <class T, int kD, int kTileQ>
void launch_itemless_tiles(const FwdParams& params, int itemless_tiles, cudaStream_t stream) {
  if (itemless_tiles == 0) return;
  forward_itemless_kernel<T, kD, kTileQ><<<itemless_tiles * params.hq, fwd_block_warps(kD, kTileQ) * 32, 0, stream>>>(
      params, params.list.num_tiles - itemless_tiles);
  check_launch("forward_itemless_kernel");
}

}  // namespace magi::cuda::detail
