// Hopper forward (sm_90a). A block is a producer warpgroup on one SM that brings each work's Q and each work item's K
// and V tiles into swizzled shared memory with TMA (mbarrier pipelines: Q two works deep up to D 128, K one item ahead
// of V), and two consumer warpgroups (three at D 64; one in the 64-row tiles at D 64 / 128, of which three / two
// blocks share an SM) that run S = Q K^T (wgmma, both operands in shared memory) and O += P V (P from registers).
// Up to D 320 each consumer holds 64 q rows; above, two hold the same 64 rows and half of O's columns each; at tiles 576 / 768 / 1024 a cluster of two blocks takes each tile, each block part of D
// (tiles.hpp), the clusters claiming works dynamically. A consumer issues the next item's Q K^T before its P V of the
// current one and computes the softmax while both run; the consumers take turns to issue (ping-pong), so the tensor
// cores serve the others while one computes its softmax. At tiles 384 / 512 (one block, O's columns split) the
// consumers take the items in turn instead, each item's S and softmax by one, P V by both (consume_in_turns).
// At D 64 a work's first Q K^T goes out beside the last P V of the work before, so that the epilogue runs under it;
// elsewhere the plain epilogue's row factors run under the last P V (docs/cuda_notes.md, "The work's end, traced").
// The grid is persistent, fed by the producer (WorkRing). Masking, softcap, the online softmax and the epilogue (sink,
// merge with a previous result, lse, max_logits) are the portable family's (src/cuda/forward_common.cuh).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>
#include <string>

#include "magi/error.hpp"

#include "cuda/forward_common.cuh"
#include "cuda/sm80/forward_kernel.cuh"  // the item-less tiles' copy kernel
#include "cuda/sm90/gemm_common.cuh"
#include "cuda/sm90/tiles.hpp"

namespace magi::cuda::sm90 {

using namespace cute;
using detail::FwdParams;
using detail::KeyInterval;
using detail::TileInfo;
using detail::WorkCoords;
using detail::WorkItem;

// kPlainOut: the plain epilogue's kernel (tiles.hpp: forward_has_plain_out), out through shared memory and a TMA
// store where forward_stages_out. kPairs: a cluster of two blocks takes a pair of works that read the same K / V
// tiles, two q tiles or two q heads of one kv head (FwdParams::pairs, tiles.hpp forward_takes_pairs); each block loads
// half of every K / V tile and multicasts it to both, so that the pair reads K and V from L2 once.
template <class T, int kD, int kTileQ, bool kPlainOut = false, bool kPairs = false>
struct ForwardKernel {
  using Element = typename CuteElement<T>::type;
  static_assert(!kPlainOut || forward_has_plain_out(kD), "the plain epilogue needs all of a row's columns");
  static constexpr bool kStageOut = kPlainOut && forward_stages_out(kD);
  static constexpr int kM = kTileQ, kN = forward_tile_k(kD, kTileQ);
  static constexpr int kBlocksPerSm = forward_blocks_per_sm(kD, kTileQ);
  static constexpr int kKStages = forward_k_stages(kD, kTileQ), kVStages = forward_stages(kD, kTileQ);
  static constexpr int kQStages = forward_q_stages(kD);
  static constexpr int kConsumers = forward_consumers(kD, kM);
  static constexpr int kClusterSize = forward_cluster_size(kD);
  static constexpr bool kCluster = kClusterSize > 1;  // D split over the blocks of a cluster
  static_assert(!kPairs || (!kCluster && kPlainOut && forward_takes_pairs(kD, kTileQ)), "pairs: tiles.hpp");
  static constexpr int kLaunchCluster = kPairs ? 2 : kClusterSize;  // blocks a cluster
  static constexpr int kBlockD = forward_block_head_dim(kD);  // the part of D this block holds
  static constexpr bool kSplitColumns = forward_splits_columns(kD);
  static constexpr int kOCols = kSplitColumns ? kBlockD / kConsumers : kBlockD;  // O's columns in one consumer
  // In one block's column split (tiles 384 and 512) the consumers take the items in turn: item t of the block
  // (counted over its works) is consumer t % 2's, which computes its S over all of D and its softmax and hands P
  // (16-bit) and the rows' new maxima and rescale factors over through shared memory; both add P V over their halves
  // of O. One consumer's softmax then runs while the other's Q K^T holds the tensor cores. (Before, each computed S
  // over its half of D and added the other's at every item, so both waited there: A/B, H200, fwd, D 512 +6..+9%,
  // D 384 +3..+7% against its Q held in registers.)
  static constexpr bool kTakeTurns = kSplitColumns && !kCluster;
  static_assert(kOCols % 64 == 0 || !kSplitColumns, "a consumer's V columns are whole 128-byte swizzle atoms");
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kNBlocks = kN / 8, kOBlocks = kOCols / 8;
  static constexpr int kSRegisters = kM / (kSplitColumns ? 1 : kConsumers) * kN / 128;  // S's fp32 per thread
  // Registers per thread after the producer gives its share to the consumers (setmaxnreg). The consumers' increase
  // waits until the producer's decrease frees enough of the launch's 168 (128 with three consumers) per thread, so
  // the sum must fit (else the kernel hangs). The producer spills below 56 (D 128, nvcc 13); D 256's consumers spill
  // least at 232.
  static constexpr int kLaunchRegisters = 65536 / kThreads / kBlocksPerSm / 8 * 8;
  // One consumer a block: 80 registers a thread at launch at D 64 (three blocks an SM), 128 at D 128 (two).
  static constexpr int kProducerRegisters =
      kConsumers == 3 || kBlocksPerSm == 3 ? 32 : kBlockD == 320 ? 24 : kBlockD > 128 ? 40 : 56;
  static constexpr int kConsumerRegisters = kConsumers == 3       ? 160
                                            : kBlocksPerSm == 3   ? 128
                                            : kConsumers == 1     ? 200
                                            : kBlockD == 320      ? 240
                                            : kBlockD > 128       ? 232
                                                                  : 224;
  static_assert(kProducerRegisters + kConsumers * kConsumerRegisters <= (kConsumers + 1) * kLaunchRegisters,
                "setmaxnreg: the consumers would wait for registers forever");

  // Row split: one tiled MMA over both consumers (64 rows each). Column split: each consumer is a tiled MMA of its own.
  static constexpr int kMmaGroups = kSplitColumns ? 1 : kConsumers;
  using AtomLayout = Layout<Shape<Int<kMmaGroups>, _1, _1>>;
  using MmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kM / kMmaGroups>, Int<kN>, Int<kBlockD>>>(),
      AtomLayout{}));
  using MmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kM / kMmaGroups>, Int<kOCols>, Int<kN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayout{}));
  // kTakeTurns: P V of the other consumer's items, P from its shared-memory slot.
  using MmaOShared = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kM / kMmaGroups>, Int<kOCols>, Int<kN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayout{}));
  // kTakeTurns: four slots of P (item t in slot t % 4: two per consumer, so that one is written while the other
  // consumer may still read the last), rows x keys, keys contiguous.
  static constexpr int kPSlots = 4;
  using LayoutP = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Element>{}, Shape<Int<kM>, Int<kN>, Int<kPSlots>>{}));
  using LayoutQ =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kM>, Int<kBlockD>, Int<kQStages>>{}));
  template <int kStages>
  using LayoutKV =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kN>, Int<kBlockD>, Int<kStages>>{}));
  using LayoutK = LayoutKV<kKStages>;
  using LayoutV = LayoutKV<kVStages>;
  // V read transposed (D x keys) as the B operand of P V.
  using LayoutVt = decltype(composition(
      LayoutV{}, make_ordered_layout(Shape<Int<kBlockD>, Int<kN>, Int<kVStages>>{}, Step<_2, _1, _3>{})));
  // Global [rows, heads, D] as (rows, D, heads).
  using GmemLayout = Layout<Shape<int32_t, int32_t, int32_t>, Stride<int64_t, _1, int64_t>>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemLayout{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(LayoutQ{}),
                                      Shape<Int<kM>, Int<kBlockD>>{}, _1{}));
  using KVCopy = std::conditional_t<kPairs, SM90_TMA_LOAD_MULTICAST, SM90_TMA_LOAD>;
  using TmaKV = decltype(make_tma_copy(KVCopy{}, GmemTensor{}, take<0, 2>(LayoutK{}), Shape<Int<kN>, Int<kBlockD>>{},
                                       Int<kPairs ? 2 : 1>{}));
  // A consumer's 64 rows of out (kStageOut), the source of its TMA store.
  using LayoutO = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<_64, Int<kBlockD>>{}));
  using GmemTensorOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GmemLayout{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{}, LayoutO{}, Shape<_64, Int<kBlockD>>{}, _1{}));
  // Named barrier of a consumer's 128 threads around its out tile (ids past the turns' and the column split's).
  static constexpr int kOutBarrier = kConsumers + 2;
  static_assert(!kStageOut || kOutBarrier + kConsumers <= 8, "CUTLASS leaves named barriers 0 .. 7 to kernels");
  // At D 128 a consumer loads each item's description before it waits for the item's Q K^T, so that the load's
  // latency (an L2 round trip for a work's first item) runs under the GEMM instead of before the softmax. A/B (H200,
  // fwd): 16 x 1k causal +5.6%, the document / window masks +1..+4%, full and causal equal; D 64 and 256 lost up to 3%
  // (the registers it holds), so they load it at the softmax.
  static constexpr bool kItemEarly = kD == 128;
  using PipelineK = cutlass::PipelineTmaAsync<kKStages>;
  using PipelineV = cutlass::PipelineTmaAsync<kVStages>;

  struct SharedStorage {
    alignas(1024) Element q[cosize_v<LayoutQ>];
    alignas(1024) Element k[cosize_v<LayoutK>];
    alignas(1024) Element v[cosize_v<LayoutV>];
    alignas(1024) Element o[kStageOut ? kConsumers * cosize_v<LayoutO> : 0];
    // Column split in one block: S over each consumer's half of D, [item parity][consumer][register][thread]. In a
    // cluster: the S part of the consumer's peer in the other block, written by the peer (st.async, 16 bytes each:
    // after v, the array is aligned) and counted by s_peer_full[item parity][consumer].
    float s_half[kCluster ? 2 : 0][kConsumers][kSRegisters][128];
    typename PipelineK::SharedStorage pipeline_k;
    typename PipelineV::SharedStorage pipeline_v;
    cutlass::arch::ClusterTransactionBarrier q_full[kQStages];
    cutlass::arch::ClusterBarrier q_empty[kQStages];
    WorkRing work;
    cutlass::arch::ClusterTransactionBarrier s_peer_full[kCluster ? 2 : 1][kConsumers];
    // kTakeTurns: the slots' P, and per slot and thread the owner's {new maxima, rescale factors} of its two rows
    // (the same rows in both consumers' threads of one index); row sums added at a work's end, by work parity.
    struct Turns {
      alignas(1024) Element p[cosize_v<LayoutP>];
      float4 scales[kPSlots][128];
      float2 sums[2][kConsumers][128];
      cutlass::arch::ClusterBarrier p_full[kPSlots], p_empty[kPSlots];
    };
    std::conditional_t<kTakeTurns, Turns, char> turns;
  };
  static_assert(offsetof(SharedStorage, s_half) % 16 == 0);
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static constexpr int kStageBytes = kN * kBlockD * sizeof(Element);  // one K or V tile
  static_assert(kSmemBytes <= forward_smem_bytes(kD, kM), "tiles.hpp's shared-memory size is the planner's");

  struct Params {
    FwdParams p;
    TmaQ tma_q;
    TmaKV tma_k, tma_v;
    int num_work;
    std::conditional_t<kStageOut, TmaO, int> tma_o;
  };

  static Params make_params(const FwdParams& p, int num_work) {
    // Descriptors need a non-empty tensor; a call without keys loads nothing.
    auto tensor = [&](const void* data, int rows, int heads) {
      return make_tensor(make_gmem_ptr(static_cast<const Element*>(data)),
                         make_layout(make_shape(max(rows, 1), p.d, heads),
                                     make_stride(int64_t{heads} * p.d, _1{}, int64_t{p.d})));
    };
    return {p,
            make_tma_copy(SM90_TMA_LOAD{}, tensor(p.q, p.tq, p.hq), take<0, 2>(LayoutQ{}),
                          Shape<Int<kM>, Int<kBlockD>>{}, _1{}),
            make_tma_copy(KVCopy{}, tensor(p.k, p.tk, p.hkv), take<0, 2>(LayoutK{}), Shape<Int<kN>, Int<kBlockD>>{},
                          Int<kPairs ? 2 : 1>{}),
            make_tma_copy(KVCopy{}, tensor(p.v, p.tk, p.hkv), take<0, 2>(LayoutV{}), Shape<Int<kN>, Int<kBlockD>>{},
                          Int<kPairs ? 2 : 1>{}),
            num_work, [&] {
              if constexpr (kStageOut) {
                Tensor out = make_tensor(make_gmem_ptr(static_cast<Element*>(p.out)),
                                         make_layout(make_shape(max(p.tq, 1), p.d, p.hq),
                                                     make_stride(int64_t{p.hq} * p.d, _1{}, int64_t{p.d})));
                return make_tma_copy(SM90_TMA_STORE{}, out, LayoutO{}, Shape<_64, Int<kBlockD>>{}, _1{});
              } else {
                return 0;
              }
            }()};
  }

  // One thread issues every load: Q once per work (into the stage the consumers freed longest ago), then K and V of
  // each item, K one item ahead (its wait comes first in a step).
  static __device__ __forceinline__ void produce(const Params& params, SharedStorage& shared, PipelineK& pipeline_k,
                                                 PipelineV& pipeline_v) {
    const FwdParams& p = params.p;
    Tensor mQ = params.tma_q.get_tma_tensor(make_shape(max(p.tq, 1), p.d, p.hq));
    Tensor mK = params.tma_k.get_tma_tensor(make_shape(max(p.tk, 1), p.d, p.hkv));
    Tensor mV = params.tma_v.get_tma_tensor(make_shape(max(p.tk, 1), p.d, p.hkv));
    Tensor sQ = make_tensor(make_smem_ptr(shared.q), LayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k), LayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v), LayoutV{});
    auto write_k = cutlass::make_producer_start_state<PipelineK>();
    auto write_v = cutlass::make_producer_start_state<PipelineV>();
    int q_loads = 0;
    const int part = kCluster ? static_cast<int>(cute::block_rank_in_cluster()) : 0;  // this block's part of D
    // Pairs: this block's half of each K / V tile, multicast to both blocks.
    const int kv_half = kPairs ? static_cast<int>(cute::block_rank_in_cluster()) : 0;
    constexpr uint16_t kv_blocks = kPairs ? 0b11 : 0;
    for (int n = 0;; ++n) {
      const PublishedWork work =
          kLaunchCluster > 1
              ? shared.work.publish_in_cluster(n, p.work_counter, p.list, p.hq, params.num_work,
                                               !kPairs ? Pairs::None : p.pairs_of_heads ? Pairs::Heads : Pairs::Tiles)
                             : shared.work.publish(n, p.work_counter, p.list, p.hq, params.num_work);
      if (work.linear >= params.num_work) break;
      const WorkCoords at = work.at;
      const TileInfo info = work.info;
      if (info.count == 0) continue;
      const int kv_head = at.head / (p.hq / p.hkv);
      // The tile's rows and each item's key chunk from their first row (DeviceList::tile_unit: on either grid).
      const int q_start = detail::tile_rows(p.list, info.tile, kM).start;
      Tensor gQ = local_tile(domain_offset(make_coord(q_start, 0), mQ(_, _, at.head)), Shape<Int<kM>, Int<kBlockD>>{},
                             make_coord(0, part));
      auto chunk_of = [&](auto const& m, int item) {
        const int k_start = detail::chunk_start(p.list, p.list.items[item].k0, kN);
        return local_tile(domain_offset(make_coord(k_start, 0), m(_, _, kv_head)), Shape<Int<kN>, Int<kBlockD>>{},
                          make_coord(0, part));
      };
      const int q_stage = q_loads % kQStages;
      auto [tQg, tQs] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      if (q_loads >= kQStages) shared.q_empty[q_stage].wait((q_loads / kQStages - 1) & 1);
      shared.q_full[q_stage].arrive_and_expect_tx(kM * kBlockD * sizeof(Element));
      copy(params.tma_q.with(reinterpret_cast<uint64_t&>(shared.q_full[q_stage]), 0), tQg, tQs(_, q_stage));
      ++q_loads;
      const int end = info.first + info.count;
      for (int item = info.first, next_k = info.first; item < end; ++item) {
        for (; next_k <= item + 1 && next_k < end; ++next_k) {
          auto [tKg, tKs] = tma_partition(params.tma_k, kv_half, Layout<Int<kPairs ? 2 : 1>>{}, group_modes<0, 2>(sK),
                                          group_modes<0, 2>(chunk_of(mK, next_k)));
          pipeline_k.producer_acquire(write_k);
          copy(params.tma_k.with(*pipeline_k.producer_get_barrier(write_k), kv_blocks), tKg, tKs(_, write_k.index()));
          ++write_k;
        }
        auto [tVg, tVs] = tma_partition(params.tma_v, kv_half, Layout<Int<kPairs ? 2 : 1>>{}, group_modes<0, 2>(sV),
                                        group_modes<0, 2>(chunk_of(mV, item)));
        pipeline_v.producer_acquire(write_v);
        copy(params.tma_v.with(*pipeline_v.producer_get_barrier(write_v), kv_blocks), tVg, tVs(_, write_v.index()));
        ++write_v;
      }
    }
  }

  static __device__ __forceinline__ void consume(const Params& params, SharedStorage& shared, PipelineK& pipeline_k,
                                                 PipelineV& pipeline_v) {
    if constexpr (kTakeTurns) {
      consume_in_turns(params, shared, pipeline_k, pipeline_v);
    } else {
      consume_together(params, shared, pipeline_k, pipeline_v);
    }
  }

  // kTakeTurns (see there). Per work, consumer c walks its items j (the block's item t + j, c's where (t + j) % 2 == c):
  // for each of its own, it issues S_j, then adds the other's item j - 1 (its slot's factors, P V from the slot)
  // while S_j runs, then its softmax of S_j (on the maxima item j - 1 left), publishes slot j, and issues its own
  // P V from registers. The GEMM groups in flight are the same wherever paths meet (else ptxas serialises every wgmma
  // of the kernel): one P V between own items, none at a work's ends.
  static __device__ __forceinline__ void consume_in_turns(const Params& params, SharedStorage& shared,
                                                          PipelineK& pipeline_k, PipelineV& pipeline_v) {
    const FwdParams& p = params.p;
    const int thread = static_cast<int>(threadIdx.x) - 128;  // 0 .. 255
    const int lane = thread % 32;
    const int group = thread / 128;  // this consumer warpgroup
    const int mma_thread = thread % 128;
    const int strip = mma_thread / 32;  // this warp's 16 rows of the tile
    MmaS mma_s;
    MmaO mma_o;
    MmaOShared mma_o_shared;
    auto thread_s = mma_s.get_thread_slice(mma_thread);
    auto thread_o = mma_o.get_thread_slice(mma_thread);
    auto thread_o_shared = mma_o_shared.get_thread_slice(mma_thread);
    auto& turns = shared.turns;
    // S's descriptors rebuilt per item from an opaque base (hoisted, 32 k-steps of Q and K took 128 registers).
    Tensor sVt = local_tile(make_tensor(make_smem_ptr(shared.v), LayoutVt{}),
                            Shape<Int<kOCols>, Int<kN>, Int<kVStages>>{}, make_coord(group, 0, 0));
    Tensor tOrV = thread_o.partition_fragment_B(sVt);
    Tensor tOrVShared = thread_o_shared.partition_fragment_B(sVt);
    Tensor sP = make_tensor(make_smem_ptr(turns.p), LayoutP{});
    Tensor tOrPShared = thread_o_shared.partition_fragment_A(sP);
    Tensor tSsP = thread_s.partition_C(sP);  // where this thread's P goes, in S's register order

    const bool softcapped = p.softcap > 0.0f;
    const float logit_scale = softcapped ? 1.0f : p.scale_log2;
    const float max_slack = p.max_logits == nullptr ? 8.0f / logit_scale : 0.0f;
    cutlass::PipelineState<kVStages> read_v;
    int q_phase = 0;
    Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kM>, Int<kN>>{});
    Tensor rP = make_tensor<Element>(tSrS.layout());
    Tensor tOrP = make_tensor(rP.data(), accumulator_as_a_operand(rP.layout()));
    Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kM>, Int<kOCols>>{});
    auto& acc = *reinterpret_cast<float(*)[kOBlocks][4]>(raw_pointer_cast(tOrO.data()));
    auto& s = *reinterpret_cast<float(*)[kNBlocks][4]>(raw_pointer_cast(tSrS.data()));
    auto keep_order = [] { asm volatile("" ::: "memory"); };
    auto release_q = [&] {
      shared.q_empty[0].arrive();
      q_phase ^= 1;
    };
    auto rescale = [&](float scale0, float scale1) {
      if (!__any_sync(0xffffffffu, scale0 != 1.0f || scale1 != 1.0f)) return;
#pragma unroll
      for (int i = 0; i < kOBlocks; ++i) {
        acc[i][0] *= scale0;
        acc[i][1] *= scale0;
        acc[i][2] *= scale1;
        acc[i][3] *= scale1;
      }
    };

    int t = 0;  // the block's items before this work (the same count in both consumers)
    int linear = shared.work.wait(0);
    clear(tOrO);
    for (int n = 0; linear < params.num_work; ++n) {
      const WorkCoords at = shared.work.read(n).at;
      const TileInfo info = shared.work.read(n).info;
      shared.work.release(n);
      const int head = at.head;
      const int row0 = info.tile * kM + strip * 16 + lane / 4;
      const int count = info.count;
      float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
      float block_max = -INFINITY;
      auto slot_of = [&](int j) { return (t + j) % kPSlots; };
      auto phase_of = [&](int j) { return static_cast<uint32_t>((t + j) / kPSlots) & 1; };
      // S_j = Q K_j^T over all of D (K's stages follow the block's items; only their owner reads and frees them).
      auto issue_s = [&](int j) {
        const cutlass::PipelineState<kKStages> k_state((t + j) % kKStages, ((t + j) / kKStages) & 1, 0);
        if (j < 2) shared.q_full[0].wait(q_phase);
        pipeline_k.consumer_wait(k_state);
        Tensor q = thread_s.partition_fragment_A(make_tensor(make_smem_ptr(launder(shared.q)), LayoutQ{}));
        Tensor k = thread_s.partition_fragment_B(make_tensor(make_smem_ptr(launder(shared.k)), LayoutK{}));
        Tensor q_stage = q(_, _, _, 0);
        issue_gemm<true, false>(mma_s, q_stage, k(_, _, _, k_state.index()), tSrS);
      };
      auto s_done = [&](int j) {
        pipeline_k.consumer_release(cutlass::PipelineState<kKStages>((t + j) % kKStages, 0, 0));
        if (j + 2 >= count) release_q();  // this consumer's last S of the work
      };
      // The softmax of the own item j; P into registers and its slot, with the rows' maxima and factors.
      auto softmax_and_publish = [&](int j, float (&scale_old)[2]) {
        if (softcapped) detail::softcap_logits(s, p);
        const WorkItem w = p.list.items[info.first + j];
        if (w.flags & detail::kWorkMasked) {
          const int k0 = w.k0 / kN * kN;
          const KeyInterval keys[2] = {detail::item_keys(w, row0), detail::item_keys(w, row0 + 8)};
          const bool all = detail::keeps_all(keys[0], k0, k0 + kN) && detail::keeps_all(keys[1], k0, k0 + kN);
          if (!__all_sync(0xffffffffu, all)) detail::mask_cells(s, keys, k0, lane);
        }
        detail::online_softmax<kNBlocks, true>(s, row_max, row_sum, scale_old, logit_scale, max_slack);
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) rP(i) = static_cast<Element>(tSrS(i));
        const int slot = slot_of(j);
        if (t + j >= kPSlots) turns.p_empty[slot].wait(phase_of(j) ^ 1);
        keep_order();
        copy(rP, tSsP(_, _, _, slot));
        turns.scales[slot][mma_thread] = make_float4(row_max[0], row_max[1], scale_old[0], scale_old[1]);
        cutlass::arch::fence_view_async_shared();  // P is read next by the other consumer's tensor cores
        keep_order();
        turns.p_full[slot].arrive();
      };
      // The other consumer's item j: its factors, then P V from its slot.
      auto take_other = [&](int j) {
        const int slot = slot_of(j);
        turns.p_full[slot].wait(phase_of(j));
        keep_order();
        const float4 f = turns.scales[slot][mma_thread];
        row_max[0] = f.x;
        row_max[1] = f.y;
        row_sum[0] *= f.z;
        row_sum[1] *= f.w;
        return f;
      };
      auto issue_pv_other = [&](int j) {
        pipeline_v.consumer_wait(read_v);
        Tensor p_slot = tOrPShared(_, _, _, slot_of(j));
        issue_gemm<false, false>(mma_o_shared, p_slot, tOrVShared(_, _, _, read_v.index()), tOrO);
      };
      auto issue_pv_own = [&] {
        pipeline_v.consumer_wait(read_v);
        issue_gemm<false, true>(mma_o, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
      };
      auto pv_done = [&] {
        pipeline_v.consumer_release(read_v);
        ++read_v;
      };
      auto other_done = [&](int j) {
        pv_done();
        keep_order();
        turns.p_empty[slot_of(j)].arrive();
      };
      // Own item j whose item j - 1 is the other's; on entry this consumer's P V of item j - 2 may be in flight
      // (kFirst: nothing is).
      auto own_after_other = [&](int j, auto first) {
        issue_s(j);
        const float4 f = take_other(j - 1);
        warpgroup_wait<1>();  // P V of item j - 2 done (S_j may run)
        if constexpr (!decltype(first)::value) pv_done();
        rescale(f.z, f.w);
        issue_pv_other(j - 1);
        warpgroup_wait<1>();  // S_j done; P V of item j - 1 may run
        s_done(j);
        float scale_old[2];
        softmax_and_publish(j, scale_old);
        warpgroup_wait<0>();
        other_done(j - 1);
        rescale(scale_old[0], scale_old[1]);
        issue_pv_own();
      };

      if (count > 0) {
        const bool owns_first = (t & 1) == group;
        if (count == 1 && !owns_first) {  // nothing of this work is this consumer's
          release_q();
          const float4 f = take_other(0);
          rescale(f.z, f.w);
          issue_pv_other(0);
          warpgroup_wait<0>();
          other_done(0);
        } else {
          int j;
          if (owns_first) {
            issue_s(0);
            warpgroup_wait<0>();
            s_done(0);
            float scale_old[2];
            softmax_and_publish(0, scale_old);
            issue_pv_own();  // (O is clear)
            j = 2;
          } else {
            own_after_other(1, cute::true_type{});
            j = 3;
          }
          for (; j < count; j += 2) own_after_other(j, cute::false_type{});
          if (j == count) {  // the last item is the other's
            const float4 f = take_other(count - 1);
            warpgroup_wait<0>();
            pv_done();
            rescale(f.z, f.w);
            issue_pv_other(count - 1);
            warpgroup_wait<0>();
            other_done(count - 1);
          } else {
            warpgroup_wait<0>();
            pv_done();
          }
        }
      }
      t += count;
      const int next = shared.work.wait(n + 1);
      // Both consumers' row sums, added in each (a + b == b + a).
      turns.sums[n & 1][group][mma_thread] = make_float2(row_sum[0], row_sum[1]);
      cutlass::arch::NamedBarrier::sync(128 * kConsumers, kConsumers + 1);
      const float2 other_sum = turns.sums[n & 1][group ^ 1][mma_thread];
      row_sum[0] += other_sum.x;
      row_sum[1] += other_sum.y;
      float lse_rows[2];
      detail::finish_forward_rows<T, kOBlocks>(p, acc, row_max, row_sum, logit_scale, row0, head, lane, block_max,
                                               group * kOCols, kOCols, lse_rows);
      // Both have read prev_lse (it may be lse) before the first writes lse; their rows' lse agree.
      cutlass::arch::NamedBarrier::sync(128 * kConsumers, kConsumers);
      if (group == 0 && lane % 4 == 0)
        for (int r = 0; r < 2; ++r)
          if (row0 + 8 * r < p.tq) p.lse[int64_t{row0 + 8 * r} * p.hq + head] = lse_rows[r];
      detail::publish_max_logits(p, block_max, head, lane);
      clear(tOrO);
      linear = next;
    }
  }

  static __device__ __forceinline__ void consume_together(const Params& params, SharedStorage& shared,
                                                          PipelineK& pipeline_k, PipelineV& pipeline_v) {
    const FwdParams& p = params.p;
    const int thread = static_cast<int>(threadIdx.x) - 128;  // 0 .. 128 * kConsumers - 1
    const int lane = thread % 32;
    const int group = thread / 128;  // this consumer warpgroup
    const int mma_thread = kSplitColumns ? thread % 128 : thread;
    const int strip = mma_thread / 32;  // this warp's 16 rows of the tile
    // Ping-pong: the consumers take turns to issue their GEMMs, in a ring (named barrier `group` says it is this
    // one's turn: the consumer itself and the one before it meet there), so that one's softmax runs while the tensor
    // cores serve the others. All walk the same items, so the turns keep their order for the whole kernel; group 0
    // starts.
    auto wait_turn = [&] {
      if constexpr (kConsumers > 1) cutlass::arch::NamedBarrier::sync(2 * 128, group);
    };
    auto pass_turn = [&] {
      if constexpr (kConsumers > 1) cutlass::arch::NamedBarrier::arrive(2 * 128, (group + 1) % kConsumers);
    };
    if (group == kConsumers - 1) pass_turn();
    MmaS mma_s;
    MmaO mma_o;
    auto thread_s = mma_s.get_thread_slice(mma_thread);
    auto thread_o = mma_o.get_thread_slice(mma_thread);
    // Q's GEMM descriptors, built where they are used: hoisted out of the loops they take a 64-bit register per
    // k-step, which above D 128 spilled and were reloaded from local memory inside the item loop.
    auto q_tensor = [&](Element* q) { return make_tensor(make_smem_ptr(q), LayoutQ{}); };
    Tensor tSrQ = thread_s.partition_fragment_A(q_tensor(shared.q));  // descriptors per stage
    auto q_operand = [&](int stage) {
      if constexpr (kD <= 128) return tSrQ(_, _, _, stage);
      return thread_s.partition_fragment_A(q_tensor(launder(shared.q)))(_, _, _, stage);
    };
    Tensor tSrK = thread_s.partition_fragment_B(make_tensor(make_smem_ptr(shared.k), LayoutK{}));
    // Column split: this consumer's S part plus the other's (the same sum in both, a + b == b + a). In one block the
    // other is the other consumer, through shared memory, a barrier per item; in a cluster it is this consumer's peer
    // in the other block, which stores its part into this block's shared memory (st.async, counted by an mbarrier)
    // as this one stores into the peer's. Two buffers by item parity: an item's store comes after the peer has
    // waited for the last item, i.e. after this side's read of the item before.
    int s_parity = 0, s_phase = 0;
    const uint32_t peer = kCluster ? (cute::block_rank_in_cluster() ^ 1) : 0;
    auto add_other_half = [&](auto& s) {
      if constexpr (kCluster) {
        static_assert(kSRegisters % 4 == 0);
        // As float4 [register / 4][thread]: 16-byte stores and loads.
        auto& full = shared.s_peer_full[s_parity][group];
        float4* part = reinterpret_cast<float4*>(&shared.s_half[s_parity][group][0][0]) + thread % 128;
        if (thread % 128 == 0) full.arrive_and_expect_tx(kSRegisters * 128 * 4);
        const uint32_t to = cute::set_block_rank(cute::cast_smem_ptr_to_uint(part), peer);
        const uint32_t to_full = cute::set_block_rank(cute::cast_smem_ptr_to_uint(&full), peer);
        CUTE_UNROLL
        for (int i = 0; i < kSRegisters; i += 4)
          asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
                       :
                       : "r"(to + i / 4 * 128 * 16), "f"(s(i)), "f"(s(i + 1)), "f"(s(i + 2)), "f"(s(i + 3)),
                         "r"(to_full)
                       : "memory");
        full.wait(s_phase);
        CUTE_UNROLL
        for (int i = 0; i < kSRegisters; i += 4) {
          const float4 v = part[i / 4 * 128];
          s(i) += v.x;
          s(i + 1) += v.y;
          s(i + 2) += v.z;
          s(i + 3) += v.w;
        }
        s_phase ^= s_parity;
        s_parity ^= 1;
      }
    };
    // This consumer's columns of V (all of them in the row split): whole swizzle atoms, so the slice's descriptors
    // start on an atom.
    Tensor sVt = local_tile(make_tensor(make_smem_ptr(shared.v), LayoutVt{}),
                            Shape<Int<kOCols>, Int<kN>, Int<kVStages>>{}, make_coord(kSplitColumns ? group : 0, 0, 0));
    Tensor tOrV = thread_o.partition_fragment_B(sVt);

    const bool softcapped = p.softcap > 0.0f;
    const float logit_scale = softcapped ? 1.0f : p.scale_log2;
    // Lazy rescale (see online_softmax); max_logits needs the true maxima.
    const float max_slack = p.max_logits == nullptr ? 8.0f / logit_scale : 0.0f;
    cutlass::PipelineState<kKStages> read_k;
    cutlass::PipelineState<kVStages> read_v;
    int q_stage = 0, q_phase = 0;  // the Q stage of the work whose Q K^T comes next
    Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kM>, Int<kN>>{});
    Tensor rP = make_tensor<Element>(tSrS.layout());
    Tensor tOrP = make_tensor(rP.data(), accumulator_as_a_operand(rP.layout()));
    Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kM>, Int<kOCols>>{});
    auto& acc = *reinterpret_cast<float(*)[kOBlocks][4]>(raw_pointer_cast(tOrO.data()));
    auto to_p = [&] {
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) rP(i) = static_cast<Element>(tSrS(i));
    };
    // S = Q K^T of the item that K's read stage holds; the caller has this consumer's turn.
    auto issue_s = [&] {
      auto q = q_operand(q_stage);
      issue_gemm<true, false>(mma_s, q, tSrK(_, _, _, read_k.index()), tSrS);
    };
    // After a work's last Q K^T: its Q stage is free for the producer.
    auto release_q = [&] {
      shared.q_empty[q_stage].arrive();
      if (++q_stage == kQStages) {
        q_stage = 0;
        q_phase ^= 1;
      }
    };
    auto wait_first_s_operands = [&] {
      shared.q_full[q_stage].wait(q_phase);
      pipeline_k.consumer_wait(read_k);
    };

    // Works without items reach this kernel only where rows take a sink (else the launcher sends them to the copy
    // kernel); the producer loads nothing for them.
    auto has_items = [&](int n) { return shared.work.read(n).info.count > 0; };
    // At D 64 a work's first Q K^T goes out beside the last P V of the work before (its Q has a stage of its own),
    // and that work's epilogue runs under it (tiles.hpp). That GEMM is issued on every path, so that the groups in
    // flight agree where paths meet (else ptxas serialises every wgmma of the kernel); before a work without items
    // and past a block's last work it is a stand-in whose result nobody reads (its shared memory may be stale or
    // being refilled).
    constexpr bool kFirstSEarly = forward_first_s_early(kD);
    // A work is waited for (its index known) before the last P V of the work before, and released once its
    // description is read at its start.
    int linear = shared.work.wait(0);
    if constexpr (kFirstSEarly) {
      if (has_items(0)) wait_first_s_operands();
      wait_turn();
      issue_s();
      pass_turn();
    }
    clear(tOrO);
    for (int n = 0; linear < params.num_work; ++n) {
      const WorkCoords at = shared.work.read(n).at;
      const TileInfo info = shared.work.read(n).info;
      shared.work.release(n);
      const int head = at.head;
      const detail::TileRows rows = detail::tile_rows(p.list, info.tile, kM);
      const int row0 = rows.start + strip * 16 + lane / 4;
      const int row_end = min(p.tq, rows.end);  // rows past it are another tile's
      float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
      // In a cluster prev_lse (which may be lse) is read before the work's first exchange with the other block, and
      // block 0 writes lse after its last: so the other block never reads a row's merged lse.
      float prev_lse[2] = {0.0f, 0.0f};
      if constexpr (kCluster) {
        if (p.prev_out != nullptr)
          for (int r = 0; r < 2; ++r)
            if (row0 + 8 * r < p.tq) prev_lse[r] = p.prev_lse[int64_t{row0 + 8 * r} * p.hq + head];
      }

      // Softcap, mask and online softmax of one item's S; scale_old: how O must be rescaled.
      // kItemEarly: `early` is the item, loaded before its Q K^T is waited for; else it is loaded here.
      auto softmax = [&](int item, const WorkItem& early, float (&scale_old)[2]) {
        auto& s = *reinterpret_cast<float(*)[kNBlocks][4]>(raw_pointer_cast(tSrS.data()));
        if (softcapped) detail::softcap_logits(s, p);
        const int flags = kItemEarly ? early.flags : p.list.items[item].flags;
        if (flags & detail::kWorkMasked) {
          const WorkItem w = kItemEarly ? early : p.list.items[item];
          const int k0 = detail::chunk_start(p.list, w.k0, kN);
          const KeyInterval keys[2] = {detail::item_keys(w, row0), detail::item_keys(w, row0 + 8)};
          const bool all = detail::keeps_all(keys[0], k0, k0 + kN) && detail::keeps_all(keys[1], k0, k0 + kN);
          if (!__all_sync(0xffffffffu, all)) detail::mask_cells(s, keys, k0, lane);
        }
        detail::online_softmax<kNBlocks, true>(s, row_max, row_sum, scale_old, logit_scale, max_slack);
      };
      auto rescale = [&](const float (&scale_old)[2]) {
        if (!__any_sync(0xffffffffu, scale_old[0] != 1.0f || scale_old[1] != 1.0f)) return;
#pragma unroll
        for (int i = 0; i < kOBlocks; ++i) {
          acc[i][0] *= scale_old[0];
          acc[i][1] *= scale_old[0];
          acc[i][2] *= scale_old[1];
          acc[i][3] *= scale_old[1];
        }
      };

      if constexpr (kFirstSEarly) warpgroup_wait<0>();  // the work's first Q K^T, or a stand-in
      int next;
      float block_max = -INFINITY;
      // The plain epilogue's row factors (and lse), and the out tile free again: while the last P V runs (the row
      // sums are final once the last item's softmax is done); after the work they took ~1000 cycles (H200, D 128
      // trace). With three consumers (160 registers) only after it: beside the next work's Q K^T they spilled.
      float factor[2];
      const bool out_issuer = thread % 128 == 0;
      auto prepare_plain_out = [&] {
        if constexpr (kPlainOut) {
          detail::plain_row_factors<kD != 128>(p, row_max, row_sum, logit_scale, row0, head, lane, block_max, factor,
                                               row_end);
          if constexpr (kStageOut) {  // this consumer's out tile, once its last TMA store has read it
            if (out_issuer) tma_store_wait<0>();
            cutlass::arch::NamedBarrier::sync(128, kOutBarrier + group);
          }
        }
      };
      if (info.count > 0) {
        float scale_old[2];
        const WorkItem first_item = kItemEarly ? p.list.items[info.first] : WorkItem{};
        if constexpr (!kFirstSEarly) {
          wait_first_s_operands();
          wait_turn();
          issue_s();
          pass_turn();
          warpgroup_wait<0>();
        }
        pipeline_k.consumer_release(read_k);
        ++read_k;
        if (info.count == 1) release_q();
        add_other_half(tSrS);
        softmax(info.first, first_item, scale_old);
        to_p();
        // Each further item: its S = Q K^T issued beside P V of the last one, the softmax between. Every warpgroup
        // runs every item, also one none of whose cells its 64 rows keep: skipping those took four inlined
        // variants of this step, which cost more in instruction fetch than they saved (A/B, H100, D 128: full +3%,
        // sliding window +4.5%, block-causal -5%).
        for (int item = info.first + 1; item < info.first + info.count; ++item) {
          const WorkItem w = kItemEarly ? p.list.items[item] : WorkItem{};
          pipeline_k.consumer_wait(read_k);
          pipeline_v.consumer_wait(read_v);
          wait_turn();
          issue_s();
          issue_gemm<false, true>(mma_o, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
          pass_turn();
          warpgroup_wait<1>();  // S of this item ready; P V of the last one may still run
          pipeline_k.consumer_release(read_k);
          ++read_k;
          if (item + 1 == info.first + info.count) release_q();
          add_other_half(tSrS);
          softmax(item, w, scale_old);
          warpgroup_wait<0>();
          pipeline_v.consumer_release(read_v);
          ++read_v;
          rescale(scale_old);
          to_p();
        }
        next = shared.work.wait(n + 1);
        pipeline_v.consumer_wait(read_v);
        if constexpr (kFirstSEarly) {
          if (has_items(n + 1)) wait_first_s_operands();
        }
        wait_turn();
        issue_gemm<false, true>(mma_o, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
        if constexpr (kFirstSEarly) issue_s();
        pass_turn();
        if constexpr (kConsumers < 3) prepare_plain_out();
        warpgroup_wait<kFirstSEarly ? 1 : 0>();
        pipeline_v.consumer_release(read_v);
        ++read_v;
      } else {
        if constexpr (kCluster) {  // an exchange of nothing, for prev_lse's order above
          clear(tSrS);
          add_other_half(tSrS);
        }
        next = shared.work.wait(n + 1);
        if constexpr (kFirstSEarly) {
          if (has_items(n + 1)) wait_first_s_operands();
          wait_turn();
          issue_s();
          pass_turn();
        }
        if constexpr (kConsumers < 3) prepare_plain_out();
      }
      if constexpr (kConsumers == 3) prepare_plain_out();

      if constexpr (kSplitColumns || kCluster) {
        float lse_rows[2];
        const int part = kCluster ? static_cast<int>(cute::block_rank_in_cluster()) : 0;
        detail::finish_forward_rows<T, kOBlocks>(p, acc, row_max, row_sum, logit_scale, row0, head, lane, block_max,
                                                 part * kBlockD + (kSplitColumns ? group * kOCols : 0), kOCols,
                                                 lse_rows, kCluster ? prev_lse : nullptr);
        // Both consumers of a column split have read prev_lse (it may be lse) before the first writes lse; their rows'
        // lse agree, and so do the blocks' of a cluster.
        if constexpr (kSplitColumns) cutlass::arch::NamedBarrier::sync(128 * kConsumers, kConsumers);
        if (part == 0 && (group == 0 || !kSplitColumns) && lane % 4 == 0)
          for (int r = 0; r < 2; ++r)
            if (row0 + 8 * r < p.tq) p.lse[int64_t{row0 + 8 * r} * p.hq + head] = lse_rows[r];
      } else if constexpr (kStageOut) {
        // This consumer's 64 rows into its out tile (free: prepare_plain_out), then stored by TMA (rows past tq,
        // columns past d clipped by the TMA unit).
        // LayoutO by hand (CuTe's indexing spilled): column c of row x at byte (c / 64) 8192 + (x / 8) 1024 +
        // (x % 8) 128 + 16 ((c % 64 / 8) ^ (x % 8)) + 2 (c % 8); this thread's rows x % 8 = lane / 4.
        const uint32_t tile = detail::smem_addr(shared.o) + group * uint32_t{cosize_v<LayoutO> * sizeof(Element)};
        const uint32_t at = tile + (strip % 4) * 2048 + (lane / 4) * 128 + (lane % 4) * 4;
        const uint32_t chunk_x = (lane / 4) * 16;
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int i = 0; i < kOBlocks; ++i)
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at + (i / 8) * 8192 + r * 1024 + (((i % 8) * 16) ^ chunk_x)),
                         "r"(detail::pack_pair<T>(acc[i][2 * r] * factor[r], acc[i][2 * r + 1] * factor[r])));
        Tensor sO = make_tensor(make_smem_ptr(shared.o + group * cosize_v<LayoutO>), LayoutO{});
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(128, kOutBarrier + group);
        if (out_issuer && rows.start + 64 * group < rows.end) {  // (a short tile's second 64 rows are another's)
          Tensor mO = params.tma_o.get_tma_tensor(make_shape(max(p.tq, 1), p.d, p.hq));
          Tensor gO = local_tile(domain_offset(make_coord(rows.start + 64 * group, 0), mO(_, _, head)),
                                 Shape<_64, Int<kBlockD>>{}, make_coord(0, 0));
          auto [tOg, tOs] =
              tma_partition(params.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO), group_modes<0, 2>(gO));
          copy(params.tma_o, tOs, tOg);
          tma_store_arrive();
        }
      } else if constexpr (kPlainOut) {
        detail::store_plain_rows<T, kOBlocks>(p, acc, factor, row0, head, lane, row_end);
      } else {
        detail::finish_forward_rows<T, kOBlocks>(p, acc, row_max, row_sum, logit_scale, row0, head, lane, block_max,
                                                 0, kOBlocks * 8, nullptr, nullptr, row_end);
      }
      detail::publish_max_logits(p, block_max, head, lane);
      clear(tOrO);
      linear = next;
    }
    warpgroup_wait<0>();
    if constexpr (kStageOut) {
      if (thread % 128 == 0) tma_store_wait<0>();  // the block's shared memory outlives its last store's read
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, Kernel::kBlocksPerSm) forward_kernel(const __grid_constant__ typename Kernel::Params params) {
  extern __shared__ __align__(1024) unsigned char smem[];
  auto& shared = *reinterpret_cast<typename Kernel::SharedStorage*>(smem);
  const int warp_group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    for (int stage = 0; stage < Kernel::kQStages; ++stage) {
      shared.q_full[stage].init(1);
      shared.q_empty[stage].init(Kernel::kConsumers * 128);
    }
    shared.work.init(Kernel::kConsumers * 128);
  }
  auto pipeline_k = make_tma_pipeline<typename Kernel::PipelineK, Kernel::kLaunchCluster>(
      shared.pipeline_k, Kernel::kStageBytes, Kernel::kTakeTurns ? 128 : Kernel::kConsumers * 128, warp_group == 0);
  auto pipeline_v = make_tma_pipeline<typename Kernel::PipelineV, Kernel::kLaunchCluster>(
      shared.pipeline_v, Kernel::kStageBytes, Kernel::kConsumers * 128, warp_group == 0);
  if constexpr (Kernel::kTakeTurns) {
    if (threadIdx.x == 0)
      for (int slot = 0; slot < Kernel::kPSlots; ++slot) {
        shared.turns.p_full[slot].init(128);
        shared.turns.p_empty[slot].init(128);
      }
  }
  if constexpr (Kernel::kCluster) {
    if (threadIdx.x == 0)
      for (auto& per_parity : shared.s_peer_full)
        for (auto& barrier : per_parity) barrier.init(1);
  }
  cutlass::arch::fence_barrier_init();
  if constexpr (Kernel::kLaunchCluster > 1)
    cute::cluster_sync();  // the peer's barriers exist before the first store into its shared memory
  else
    __syncthreads();

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Kernel::kProducerRegisters>();
    if (threadIdx.x == 0) Kernel::produce(params, shared, pipeline_k, pipeline_v);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Kernel::kConsumerRegisters>();
    Kernel::consume(params, shared, pipeline_k, pipeline_v);
  }
  // No block leaves while its peer may still arrive on its barriers or store into its shared memory.
  if constexpr (Kernel::kLaunchCluster > 1) {
    __syncwarp();
    cute::cluster_sync();
  }
}

template <class Kernel>
void launch_forward_works(const FwdParams& p, int num_work, int sm_margin, cudaStream_t stream) {
  launch_persistent<Kernel>(forward_kernel<Kernel>, Kernel::make_params(p, num_work), num_work, sm_margin,
                            p.work_counter, stream, "sm90 forward_kernel", Kernel::kLaunchCluster, Kernel::kBlocksPerSm);
}

// The tiles with items on the Hopper kernel (the plain epilogue's where the call and the tile allow it); the item-less
// ones (the last `itemless` of the order) by the copy kernel of the portable family (their rows take out 0 and lse
// -inf, or the previous result).
template <class T, int kD, int kTileQ>
void launch_forward_tiles(const FwdParams& p, int itemless, int sm_margin, cudaStream_t stream) {
  FwdParams with_items = p;
  with_items.list = detail::without_last_tiles(p.list, itemless);
  const int num_work = with_items.list.num_tiles * p.hq;
  // The TMA store needs a 16-byte aligned out (the API edge requires one; direct callers may pass any).
  const bool plain = p.sink_kind == detail::kSinkNone && p.prev_out == nullptr && !p.out_fp32 &&
                     (!forward_stages_out(kD) || reinterpret_cast<uintptr_t>(p.out) % 16 == 0);
  if (num_work > 0) {
    if constexpr (forward_takes_pairs(kD, kTileQ)) {
      if (plain && p.pairs.num_tiles > 0) {  // pairs of tiles hold every tile with items
        FwdParams paired = p;
        paired.list = p.pairs_of_heads ? with_items.list : p.pairs;
        const int works = p.pairs_of_heads ? paired.list.num_tiles * (p.hq / 2) : p.pairs.num_tiles / 2 * p.hq;
        launch_forward_works<ForwardKernel<T, kD, kTileQ, true, true>>(paired, works, sm_margin, stream);
      } else if (plain) {
        launch_forward_works<ForwardKernel<T, kD, kTileQ, true>>(with_items, num_work, sm_margin, stream);
      } else {
        launch_forward_works<ForwardKernel<T, kD, kTileQ>>(with_items, num_work, sm_margin, stream);
      }
    } else if constexpr (forward_has_plain_out(kD)) {
      if (plain) launch_forward_works<ForwardKernel<T, kD, kTileQ, true>>(with_items, num_work, sm_margin, stream);
      else launch_forward_works<ForwardKernel<T, kD, kTileQ>>(with_items, num_work, sm_margin, stream);
    } else {
      launch_forward_works<ForwardKernel<T, kD, kTileQ>>(with_items, num_work, sm_margin, stream);
    }
  }
  detail::launch_itemless_tiles<T, kD, kTileQ>(p, itemless, stream);
}

template <class T, int kD, int kChoice = 0>
void launch_forward_kernel(const FwdParams& p, int tile_q, int itemless, int sm_margin, cudaStream_t stream) {
  if constexpr (kChoice < forward_tile_q_choices(kD)) {
    constexpr int kTileQ = forward_tile_q_choice(kD, kChoice);
    if (tile_q == kTileQ) return launch_forward_tiles<T, kD, kTileQ>(p, itemless, sm_margin, stream);
    return launch_forward_kernel<T, kD, kChoice + 1>(p, tile_q, itemless, sm_margin, stream);
  } else {
    throw magi::Error("cuda sm_90a forward: head-dim tile " + std::to_string(kD) + " has no " +
                      std::to_string(tile_q) + "-row q tile");
  }
}

}  // namespace magi::cuda::sm90
