// Hopper dq kernel (sm_90a; tiles.hpp: sm90_dq_kernel). The backward's second kernel beside the dk/dv kernel run
// without dQ: q-major over the plan's dq_sm90 list, so dq needs no reductions and has the same bits every run. A block
// per SM (persistent): the producer warpgroup's first thread brings each work's Q and dO (128 rows) and each item's K
// and V (32 keys) into swizzled shared memory with TMA; two consumer warpgroups, 64 rows each, compute S = Q K^T and
// dP = dO V^T (wgmma from shared memory), dS by the portable family's cell math (bwd_cell), and dQ += dS K (dS from
// registers, K read transposed), then store their rows of dq. A consumer issues the next item's S and dP right behind
// this item's dQ, so that the tensor cores have them queued while it computes dS, and the consumers take turns to
// issue (ping-pong), so that the other's GEMMs run while this one computes.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "cuda/sm80/backward_kernel.cuh"  // bwd_cell: the per-cell math of both families
#include "cuda/sm90/gemm_common.cuh"
#include "cuda/sm90/tiles.hpp"

namespace magi::cuda::sm90 {

using namespace cute;

template <class T, int kD>
struct DqKernel {
  using Element = typename CuteElement<T>::type;
  using BwdParams = detail::BwdParams;
  static constexpr int kM = dq_tile_q(), kN = dq_tile_k(), kStages = dq_stages();
  static constexpr int kConsumers = kM / 64;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kNBlocks = kN / 8, kDBlocks = kD / 8;
  // Registers a thread after setmaxnreg: the producer 40 (as the forward's at D 256), a consumer 232 (dQ 128 fp32, S
  // and dP 16 each, dS 8; ptxas spills 4 bytes).
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
  static_assert(kProducerRegisters + kConsumers * kConsumerRegisters <= (kConsumers + 1) * kLaunchRegisters,
                "setmaxnreg: the consumers would wait for registers forever");

  // One tiled MMA over the consumers (64 rows each). S and dP: both operands K-major in shared memory.
  using AtomLayout = Layout<Shape<Int<kConsumers>, _1, _1>>;
  using MmaS = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kN>, Int<kD>>>(),
                                       AtomLayout{}));
  // dQ += dS K: dS from registers, K as (D x keys), MN-major.
  using MmaDq = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kD>, Int<kN>>, GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayout{}));
  using LayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kM>, Int<kD>>{}));
  using LayoutKV =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kN>, Int<kD>, Int<kStages>>{}));
  using LayoutKt = decltype(composition(
      LayoutKV{}, make_ordered_layout(Shape<Int<kD>, Int<kN>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // Global [rows, heads, D] as (rows, D, heads).
  using GmemLayout = Layout<Shape<int32_t, int32_t, int32_t>, Stride<int64_t, _1, int64_t>>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemLayout{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, LayoutQ{}, Shape<Int<kM>, Int<kD>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(LayoutKV{}),
                                       Shape<Int<kN>, Int<kD>>{}, _1{}));
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;  // a stage: one item's K and V

  struct SharedStorage {
    alignas(1024) Element q[cosize_v<LayoutQ>];
    alignas(1024) Element dout[cosize_v<LayoutQ>];
    alignas(1024) Element k[cosize_v<LayoutKV>];
    alignas(1024) Element v[cosize_v<LayoutKV>];
    typename Pipeline::SharedStorage pipeline;
    cutlass::arch::ClusterTransactionBarrier qdo_full;  // a work's Q and dO
    cutlass::arch::ClusterBarrier qdo_empty;
    WorkRing work;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static constexpr int kStageBytes = kN * kD * sizeof(Element);  // one K or V tile
  static_assert(kSmemBytes <= 227 * 1024, "an H100 / H200 block's shared memory");

  struct Params {
    BwdParams p;
    TmaQ tma_q, tma_dout;
    TmaKV tma_k, tma_v;
    int num_work;
  };

  static Params make_params(const BwdParams& p, int num_work) {
    auto tensor = [&](const void* data, int rows, int heads) {
      return make_tensor(make_gmem_ptr(static_cast<const Element*>(data)),
                         make_layout(make_shape(max(rows, 1), p.d, heads),
                                     make_stride(int64_t{heads} * p.d, _1{}, int64_t{p.d})));
    };
    auto rows_copy = [&](const void* data) {
      return make_tma_copy(SM90_TMA_LOAD{}, tensor(data, p.tq, p.hq), LayoutQ{}, Shape<Int<kM>, Int<kD>>{}, _1{});
    };
    auto keys_copy = [&](const void* data) {
      return make_tma_copy(SM90_TMA_LOAD{}, tensor(data, p.tk, p.hkv), take<0, 2>(LayoutKV{}),
                           Shape<Int<kN>, Int<kD>>{}, _1{});
    };
    return {p, rows_copy(p.q), rows_copy(p.dout), keys_copy(p.k), keys_copy(p.v), num_work};
  }

  // One thread issues every load: Q and dO once per work (after the consumers' last S / dP of the work before), K and
  // V per item into the stages.
  static __device__ __forceinline__ void produce(const Params& params, SharedStorage& shared, Pipeline& pipeline) {
    const BwdParams& p = params.p;
    Tensor mQ = params.tma_q.get_tma_tensor(make_shape(max(p.tq, 1), p.d, p.hq));
    Tensor mO = params.tma_dout.get_tma_tensor(make_shape(max(p.tq, 1), p.d, p.hq));
    Tensor mK = params.tma_k.get_tma_tensor(make_shape(max(p.tk, 1), p.d, p.hkv));
    Tensor mV = params.tma_v.get_tma_tensor(make_shape(max(p.tk, 1), p.d, p.hkv));
    Tensor sQ = make_tensor(make_smem_ptr(shared.q), LayoutQ{});
    Tensor sO = make_tensor(make_smem_ptr(shared.dout), LayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k), LayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v), LayoutKV{});
    auto write = cutlass::make_producer_start_state<Pipeline>();
    int loads = 0;
    for (int n = 0;; ++n) {
      const PublishedWork work = shared.work.publish(n, p.work_counter, p.list, p.hq, params.num_work);
      if (work.linear >= params.num_work) break;
      const detail::TileInfo info = work.info;
      if (info.count == 0) continue;
      const int head = work.at.head;
      const int kv_head = head / (p.hq / p.hkv);
      Tensor gQ = local_tile(mQ(_, _, head), Shape<Int<kM>, Int<kD>>{}, make_coord(info.tile, 0));
      Tensor gO = local_tile(mO(_, _, head), Shape<Int<kM>, Int<kD>>{}, make_coord(info.tile, 0));
      Tensor gK = local_tile(mK(_, _, kv_head), Shape<Int<kN>, Int<kD>>{}, make_coord(_, 0));
      Tensor gV = local_tile(mV(_, _, kv_head), Shape<Int<kN>, Int<kD>>{}, make_coord(_, 0));
      auto [tQg, tQs] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tOg, tOs] =
          tma_partition(params.tma_dout, _0{}, Layout<_1>{}, group_modes<0, 2>(sO), group_modes<0, 2>(gO));
      auto [tKg, tKs] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVg, tVs] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      if (loads > 0) shared.qdo_empty.wait((loads - 1) & 1);
      shared.qdo_full.arrive_and_expect_tx(2 * kM * kD * sizeof(Element));
      copy(params.tma_q.with(reinterpret_cast<uint64_t&>(shared.qdo_full), 0), tQg, tQs);
      copy(params.tma_dout.with(reinterpret_cast<uint64_t&>(shared.qdo_full), 0), tOg, tOs);
      ++loads;
      for (int item = info.first; item < info.first + info.count; ++item) {
        const int tile_k = p.list.items[item].k0 / kN;
        pipeline.producer_acquire(write);
        copy(params.tma_k.with(*pipeline.producer_get_barrier(write), 0), tKg(_, tile_k), tKs(_, write.index()));
        copy(params.tma_v.with(*pipeline.producer_get_barrier(write), 0), tVg(_, tile_k), tVs(_, write.index()));
        ++write;
      }
    }
  }

  static __device__ __forceinline__ void consume(const Params& params, SharedStorage& shared, Pipeline& pipeline) {
    const BwdParams& p = params.p;
    const int thread = static_cast<int>(threadIdx.x) - 128;  // 0 .. 128 * kConsumers - 1
    const int lane = thread % 32;
    const int strip = thread / 32;  // this warp's 16 rows of the tile
    MmaS mma_s;
    MmaDq mma_dq;
    auto thread_s = mma_s.get_thread_slice(thread);
    auto thread_dq = mma_dq.get_thread_slice(thread);
    Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kM>, Int<kN>>{});
    Tensor tSrdP = partition_fragment_C(mma_s, Shape<Int<kM>, Int<kN>>{});
    Tensor rdS = make_tensor<Element>(tSrS.layout());
    Tensor tDqrdS = make_tensor(rdS.data(), accumulator_as_a_operand(rdS.layout()));
    Tensor tDqrAcc = partition_fragment_C(mma_dq, Shape<Int<kM>, Int<kD>>{});
    static_assert(size(decltype(tSrS){}) == kN / 2, "S: 2 rows x kN / 4 keys a thread");
    static_assert(size(decltype(tDqrAcc){}) == kD / 2, "dQ: 2 rows x kD / 4 columns a thread");
    auto& s = *reinterpret_cast<float(*)[kNBlocks][4]>(raw_pointer_cast(tSrS.data()));
    auto& dp = *reinterpret_cast<float(*)[kNBlocks][4]>(raw_pointer_cast(tSrdP.data()));
    auto& acc = *reinterpret_cast<float(*)[kDBlocks][4]>(raw_pointer_cast(tDqrAcc.data()));

    // Descriptors built where they are used, from an opaque base (hoisted, the k-steps' descriptors take a register
    // each and spill at D 256).
    auto issue_s_dp = [&](int stage) {
      Tensor q = thread_s.partition_fragment_A(make_tensor(make_smem_ptr(launder(shared.q)), LayoutQ{}));
      Tensor k = thread_s.partition_fragment_B(make_tensor(make_smem_ptr(launder(shared.k)), LayoutKV{}));
      issue_gemm<true, false>(mma_s, q, k(_, _, _, stage), tSrS);
      Tensor o = thread_s.partition_fragment_A(make_tensor(make_smem_ptr(launder(shared.dout)), LayoutQ{}));
      Tensor v = thread_s.partition_fragment_B(make_tensor(make_smem_ptr(launder(shared.v)), LayoutKV{}));
      issue_gemm<true, false>(mma_s, o, v(_, _, _, stage), tSrdP);
    };
    auto issue_dq = [&](int stage) {
      Tensor kt = thread_dq.partition_fragment_B(make_tensor(make_smem_ptr(launder(shared.k)), LayoutKt{}));
      issue_gemm<false, true>(mma_dq, tDqrdS, kt(_, _, _, stage), tDqrAcc);
    };
    // dS of this thread's cells (dropped cells 0), 16-bit, in the A operand's registers.
    auto compute_ds = [&](const detail::WorkItem& w, int row0, const float (&lse2)[2], const float (&delta)[2]) {
      const int k0 = w.k0 / kN * kN;
      const bool masked = (w.flags & detail::kWorkMasked) != 0;
      detail::KeyInterval keys[2] = {{0, 1 << 30}, {0, 1 << 30}};
      if (masked) {
        keys[0] = detail::item_keys(w, row0);
        keys[1] = detail::item_keys(w, row0 + 8);
      }
      detail::with_softcap(p, [&](auto softcap) {
        detail::with_bool(masked, [&](auto is_masked) {
          CUTE_UNROLL
          for (int nb = 0; nb < kNBlocks; ++nb) {
            CUTE_UNROLL
            for (int e = 0; e < 4; ++e) {
              const int col = k0 + nb * 8 + (lane % 4) * 2 + e % 2;
              const bool kept = decltype(is_masked)::value ? keys[e / 2].contains(col) : true;
              rdS(nb * 4 + e) = static_cast<Element>(
                  detail::bwd_cell<decltype(softcap)::value>(p, s[nb][e], dp[nb][e], lse2[e / 2], delta[e / 2], kept)
                      .ds);
            }
          }
        });
      });
    };

    // Ping-pong: the consumers take turns to issue their GEMMs (named barrier `group`: this consumer's turn; the one
    // before it in the ring arrives there), so that one computes its dS while the tensor cores run the other's.
    const int group = thread / 128;
    auto wait_turn = [&] { cutlass::arch::NamedBarrier::sync(2 * 128, group); };
    auto pass_turn = [&] { cutlass::arch::NamedBarrier::arrive(2 * 128, (group + 1) % kConsumers); };
    if (group == kConsumers - 1) pass_turn();
    cutlass::PipelineState<kStages> read;
    int qdo_phase = 0;
    int linear = shared.work.wait(0);
    for (int n = 0; linear < params.num_work; ++n) {
      const detail::WorkCoords at = shared.work.read(n).at;
      const detail::TileInfo info = shared.work.read(n).info;
      shared.work.release(n);
      const int head = at.head;
      const int row0 = info.tile * kM + strip * 16 + lane / 4;
      float lse2[2], delta[2];
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r;
        const bool in = row < p.tq;
        lse2[r] = in ? p.lse2[detail::stats_index(head, row, p.tq_pad, 1)] : 0.0f;
        delta[r] = in ? p.delta[detail::stats_index(head, row, p.tq_pad, 1)] : 0.0f;
      }
      clear(tDqrAcc);
      warpgroup_fence_operand(tDqrAcc);  // zeroed before the work's first GEMMs (else ptxas serialises every wgmma)
      if (info.count > 0) {
        shared.qdo_full.wait(qdo_phase);
        qdo_phase ^= 1;
        pipeline.consumer_wait(read);
        wait_turn();
        issue_s_dp(read.index());
        pass_turn();
        cutlass::PipelineState<kStages> last = read;
        for (int j = 0; j < info.count; ++j) {
          const detail::WorkItem w = p.list.items[info.first + j];
          warpgroup_wait<0>();  // S and dP of item j (and dQ of item j - 1) done
          if (j > 0) pipeline.consumer_release(last);
          if (j + 1 == info.count) shared.qdo_empty.arrive();  // the work's last read of Q and dO
          compute_ds(w, row0, lse2, delta);
          last = read;
          ++read;
          const bool more = j + 1 < info.count;
          if (more) pipeline.consumer_wait(read);
          wait_turn();
          issue_dq(last.index());
          if (more) issue_s_dp(read.index());
          pass_turn();
        }
        warpgroup_wait<0>();
        pipeline.consumer_release(last);
      }
      // This thread's rows of dq (dS carries the softmax scale): rows past tq and columns past d are not stored.
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r;
        if (row >= p.tq) continue;
        const int64_t base = (int64_t{row} * p.hq + head) * p.d;
        if (p.accumulate_dq) {
          // Eight loads before their stores (one at a time, each pair would wait a memory latency; all of a row's at
          // once, their registers beside dQ's spilled).
          float2* const to = reinterpret_cast<float2*>(static_cast<float*>(p.dq) + base);
          constexpr int kBatch = 8;
          CUTE_UNROLL
          for (int i0 = 0; i0 < kDBlocks; i0 += kBatch) {
            float2 sum[kBatch];
            CUTE_UNROLL
            for (int i = 0; i < kBatch; ++i) {
              const int col = (i0 + i) * 8 + (lane % 4) * 2;
              sum[i] = col < p.d ? to[col / 2] : make_float2(0.f, 0.f);
            }
            CUTE_UNROLL
            for (int i = 0; i < kBatch; ++i) {
              const int col = (i0 + i) * 8 + (lane % 4) * 2;
              if (col < p.d)
                to[col / 2] = make_float2(sum[i].x + acc[i0 + i][2 * r], sum[i].y + acc[i0 + i][2 * r + 1]);
            }
          }
          continue;
        }
        CUTE_UNROLL
        for (int i = 0; i < kDBlocks; ++i) {
          const int col = i * 8 + (lane % 4) * 2;
          if (col < p.d) detail::store_pair<T>(p.dq, base + col, acc[i][2 * r], acc[i][2 * r + 1], p.grad_fp32);
        }
      }
      linear = shared.work.wait(n + 1);
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    dq_kernel(const __grid_constant__ typename Kernel::Params params) {
  extern __shared__ __align__(1024) unsigned char smem[];
  auto& shared = *reinterpret_cast<typename Kernel::SharedStorage*>(smem);
  const int warp_group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_dout.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    shared.qdo_full.init(1);
    shared.qdo_empty.init(Kernel::kConsumers * 128);
    shared.work.init(Kernel::kConsumers * 128);
  }
  auto pipeline = make_tma_pipeline<typename Kernel::Pipeline>(shared.pipeline, 2 * Kernel::kStageBytes,
                                                               Kernel::kConsumers * 128, warp_group == 0);
  cutlass::arch::fence_barrier_init();
  __syncthreads();
  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Kernel::kProducerRegisters>();
    if (threadIdx.x == 0) Kernel::produce(params, shared, pipeline);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Kernel::kConsumerRegisters>();
    Kernel::consume(params, shared, pipeline);
  }
}

// dq of every (q tile, head) of params.list (the plan's dq_sm90 list: tiles of dq_tile_q() rows, items of
// dq_tile_k() keys) on a persistent grid of (SMs - sm_margin) blocks; params.list must hold an item.
template <class T, int kD>
void launch_dq_kernel(const detail::BwdParams& params, int sm_margin, cudaStream_t stream) {
  using Kernel = DqKernel<T, kD>;
  const int num_work = params.list.num_tiles * params.hq;
  if (num_work == 0) return;
  launch_persistent<Kernel>(dq_kernel<Kernel>, Kernel::make_params(params, num_work), num_work, sm_margin,
                            params.work_counter, stream, "sm90 dq_kernel");
}

}  // namespace magi::cuda::sm90
