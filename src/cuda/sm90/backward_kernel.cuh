// Hopper backward (sm_90a): dK, dV and dQ in one kernel over the plan's k-major list. A block is three warpgroups
// on one SM and holds one k tile of one kv head: a producer that brings K and V once per tile (after the tile's first
// chunk) and, for every q head of the GQA group and every item of the tile, the item's 64-row chunk of Q and dO (TMA,
// swizzled), its lse2 / Delta rows and the item itself (bulk copies) through a two-stage mbarrier pipeline; and two
// consumers that run, per chunk (wgmma):
//   S^T = K Q^T, dP^T = V dO^T                (both operands in shared memory)
//   P^T, dS^T from them (the portable family's bwd_cell: softcap, masks, empty rows)
//   dV += P^T dO, dK += dS^T Q, dQ = dS K     (dS through shared memory)
// Up to D 128 a tile is 128 keys and each consumer owns 64 of them: P^T and dS^T stay in its registers as the A
// operands of dV and dK, each consumer takes half of dQ's D columns (at D 64 the consumers take whole chunks' dQ in
// turn: kDqWhole), and dQ goes through shared memory (in fragment order: detail::dq_fragment_base) to a bulk
// reduce-add into p.dq_accum that a warp of the producer warpgroup issues (one such writer per consumer), so that the
// consumer only hands the tile over. At D 256 (kWide) a tile is 64
// keys (a consumer's dK and dV of 64 keys x 256 would need 256 registers a thread) and the consumers split the work
// by role: one computes S^T, P^T and
// dV += P^T dO for all 256 columns, the other dP^T, dS^T and dK += dS^T Q; P^T (times the dS factor) crosses in
// fp32 through shared memory, dS^T in 16 bits for dQ = dS K, whose columns the two split; dQ goes out by vector
// reductions from registers (its fp32 tile does not fit beside two stages of Q and dO). At tile 256 itself the
// backward runs this kernel without dQ, beside the Hopper dq kernel (dq_kernel.cuh), in both modes: faster on every
// mask; the reductions remain for a plan without keys there and for the clusters.
// Tiles above 256 run as clusters of two to four blocks of the D 256 layout, each holding its part of D (tiles.hpp):
// each role adds to its S^T or dP^T over the block's part what the same role of every other block computed over
// theirs, which those blocks store into this one's shared memory (st.async, counted by an mbarrier); every block sums
// the parts in rank order, so P^T and dS^T are the same bits in all, and each block's dV, dK and dQ are its columns.
// Concatenated heads (MAGI_ATTENTION_CATGQA, kCat, up to D 128): the q heads of the kv head are one sequence of rows
// token x group + head, walked once (TMA boxes of 64 / group tokens x every head of the group; docs/cuda_notes.md).
// Deterministic mode: dK / dV are reproducible as they are (a block sums its chunks in a fixed order); up to D 128
// the dQ reduce-adds take turns in a fixed order (OrderedDqAdds), from D 256 on the kernel runs without dQ (kDq)
// beside a dq kernel (the Hopper one at tile 256, the portable one above).
// The grid is persistent (WorkRing). dK / dV stay in registers for the whole tile and are stored at its end.
#pragma once

#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "cuda/sm80/backward_kernel.cuh"  // bwd_cell, item_queries: the per-cell math of both families
#include "cuda/sm90/gemm_common.cuh"
#include "cuda/sm90/tiles.hpp"

namespace magi::cuda::sm90 {

using detail::BwdParams;
using detail::KeyInterval;
using detail::TileInfo;
using detail::WorkCoords;
using detail::WorkItem;

constexpr uint64_t kEvictNormal = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);  // CuTe's default

// The consumers' S^T / dP^T GEMMs (M keys, N chunk rows, K D), dV += P^T dO and dK += dS^T Q (M keys, N D, K rows;
// P^T and dS^T from registers). Up to D 128 the consumers split the keys; at D 256 each runs its GEMMs alone.
template <class Element, int kN, int kM, int kD, int kConsumers, bool kWide>
auto sdp_mma() {
  constexpr int kSplit = kWide ? 1 : kConsumers;
  return make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<Int<kN / kSplit>, Int<kM>, Int<kD>>>(),
                        Layout<Shape<Int<kSplit>, _1, _1>>{});
}
template <class Element, int kN, int kM, int kD, int kConsumers, bool kWide>
auto kv_mma() {
  constexpr int kSplit = kWide ? 1 : kConsumers;
  return make_tiled_mma(GMMA::rs_op_selector<Element, Element, float, Shape<Int<kN / kSplit>, Int<kD>, Int<kM>>,
                                             GMMA::Major::K, GMMA::Major::MN>(),
                        Layout<Shape<Int<kSplit>, _1, _1>>{});
}

// The dQ reduce-adds of one consumer (D <= 128), issued by a warp of the producer warpgroup. Default: unordered
// (the TMA unit adds). Deterministic (p.dq_semaphores set): each (consumer, q head, chunk) takes its adds in item
// rank order: an add waits until its semaphore counts `rank` finished adds, and counts itself once complete, before
// its warp waits for anything else (so that no count is held back while a turn is awaited). With concatenated heads
// the semaphores count per (consumer, kv head, chunk of concatenated rows): as many.
struct OrderedDqAdds {
  int32_t* pending = nullptr;  // the semaphore of the last add, not yet counted

  // Before the add of `chunk` of `head` (a kv head with concatenated heads, cat of them): in order, wait for its turn.
  __device__ __forceinline__ void wait_turn(const BwdParams& p, int cat, int consumer, int head, int chunk, int rank) {
    if (p.dq_semaphores == nullptr) return;
    const int64_t heads = p.hq / cat, chunks = int64_t{p.tq_pad} * cat / detail::kDkdvTileQ;
    int32_t* const semaphore = p.dq_semaphores + (consumer * heads + head) * chunks + chunk;
    int32_t done = -1;
    while (true) {
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(done) : "l"(semaphore) : "memory");
      if (done == rank) break;
      __nanosleep(64);
    }
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
    pending = semaphore;
  }
  // After the add's tile is read: in order, the add complete and counted.
  __device__ __forceinline__ void count() {
    if (pending == nullptr) return;
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(pending) : "memory");
    pending = nullptr;
  }
};

// kSoftcap: a kernel of its own, so that its extra live registers (tanh's derivative needs S and dP at once) do not
// make ptxas serialise the wgmma pipeline of the common kernel (C7512).
// kDq: dQ added here; without it (the deterministic mode from D 256 on) the portable dq kernel computes dQ.
// kCat: the q heads of a kv head concatenated (BwdParams::cat_group; D <= 128 with dQ): a kernel of its own, so that
// the common one keeps its compile-time chunk arithmetic (with it at run time the deterministic mode lost 5-13%).
template <class T, int kTile, bool kSoftcap, bool kDq, bool kCat = false>
struct BackwardKernel {
  using Element = typename CuteElement<T>::type;
  static constexpr int kClusterSize = backward_cluster_size(kTile);
  static constexpr bool kCluster = kClusterSize > 1;
  static constexpr int kD = backward_block_head_dim(kTile);  // the columns this block holds
  static constexpr bool kWide = kD > 128;
  static constexpr int kM = detail::kDkdvTileQ;        // q rows per chunk (the k-major list's items)
  static constexpr int kN = backward_tile_k(kTile);    // keys per block (the k-major list's tiles)
  static_assert(kM == 64 && kN == (kWide ? 64 : 128) && kD <= 256, "64-row chunks; 128-key tiles, 64 above D 128");
  static_assert(!kCluster || kWide, "a cluster's blocks have the wide layout");
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  // Cluster: the parts each role receives per chunk (fp32, kN x kM each), from every other block.
  static constexpr int kParts = kClusterSize - 1;
  // Q / dO stages: two where shared memory holds them beside the parts (up to tile 576), else one (768, 1024: the
  // stage is then handed back as soon as dV and dK are issued and done, before the dQ GEMM).
  static constexpr int kStages =
      !kCluster || (2 * kN * kD + 2 * 2 * kM * kD) * 2 + 2 * kParts * kN * kM * 4 + 1024 <= 227 * 1024 ? 2 : 1;
  static constexpr bool kDqWriter = kDq && !kWide;
  // dQ tiles per consumer (D <= 128): two, so that a consumer stores its next chunk's dQ while the writer still waits
  // for the last one's turn (deterministic mode) or for the TMA unit to read it.
  static constexpr int kDqBuffers = 2;
  // D 64: chunk j's whole dQ (all D columns over the tile's 128 keys) is the work of consumer
  // j % 2 alone, which waits for the other's half of dS^T; the other goes on (ds_full / ds_empty). The two then
  // alternate a heavy and a light chunk out of step, instead of meeting at a 256-thread barrier every chunk (their
  // elementwise phases fell together). At D 128 a whole dQ would take 64 more registers than a consumer has.
  static constexpr bool kDqWhole = kDqWriter && !kCat && kD == 64;
  static constexpr int kDqCols = kDqWhole ? kD : kD / kConsumers;  // dQ columns of one consumer's tile
  static_assert(!kCat || kDqWriter, "concatenated heads: the kernel that adds dQ at D <= 128");
  // setmaxnreg: the producer's share goes to the consumers; the sum must fit the launch's 168 per thread.
  // (nvcc 13, D 128: the consumers spill below 240; the producer spills ~180 bytes at 24, off the critical path.)
  static constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;
  static_assert(kProducerRegisters + kConsumers * kConsumerRegisters <= (kConsumers + 1) * 168, "setmaxnreg budget");

  using SplitCols = Layout<Shape<_1, Int<kConsumers>, _1>>;
  using MmaSdP = decltype(sdp_mma<Element, kN, kM, kD, kConsumers, kWide>());
  using MmaKV = decltype(kv_mma<Element, kN, kM, kD, kConsumers, kWide>());
  // dQ = dS K: M = the chunk's 64 rows, consumers split the D columns; dS and K^T both MN-major in shared memory.
  using MmaDq = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kM>, Int<kD / kConsumers>, Int<kN>>, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      SplitCols{}));
  using MmaDqWhole = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float,
                                                                  Shape<Int<kM>, Int<kD>, Int<kN>>, GMMA::Major::MN,
                                                                  GMMA::Major::MN>()));

  // Wide: dQ = dS K by role, the first kDqCols0 columns in role 0, the rest in role 1 (whole 64-column swizzle atoms of
  // K^T each: at D 192 a role's half would not be).
  static constexpr int kDqCols0 = (kD / 2 + 63) / 64 * 64;
  template <int kCols>
  using MmaDqColumns = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kM>, Int<kCols>, Int<kN>>, GMMA::Major::MN,
                           GMMA::Major::MN>()));
  using LayoutKV = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kN>, Int<kD>>{}));
  using LayoutKt =
      decltype(composition(LayoutKV{}, make_ordered_layout(Shape<Int<kD>, Int<kN>>{}, Step<_2, _1>{})));
  using LayoutQ =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kM>, Int<kD>, Int<kStages>>{}));
  // Q and dO read transposed (D x rows) as the B operands of dK += dS^T Q and dV += P^T dO.
  using LayoutQt = decltype(composition(
      LayoutQ{}, make_ordered_layout(Shape<Int<kD>, Int<kM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // dS (rows x keys, rows contiguous). Up to D 128 two buffers: chunk i's in buffer i % 2, so that one barrier per
  // chunk suffices (a consumer past chunk i + 1's barrier knows the other finished chunk i's GEMMs). At D 256 one:
  // its writer is past the barrier where the other consumer hands over the next chunk's P^T, after its dQ GEMM. In a
  // cluster the dS space first receives the other blocks' dP^T parts (fp32: twice a dS tile each).
  static constexpr int kDsBuffers = kWide ? 1 : 2;
  static constexpr int kDsSpace = kCluster ? 2 * kParts : 1;
  using LayoutdS =
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<Int<kM>, Int<kN>, Int<kDsBuffers>>{}));
  // Global [rows, heads, D] as (rows, D, heads).
  using GmemLayout = Layout<Shape<int32_t, int32_t, int32_t>, Stride<int64_t, _1, int64_t>>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemLayout{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(LayoutQ{}),
                                      Shape<Int<kM>, Int<kD>>{}, _1{}));
  // dQ of one consumer (kM rows x kD / 2 columns, fp32), the source of its reduce-add: 128-byte swizzled for the
  // concatenated heads' TMA unit; one head at a time, its space holds the tile in fragment order.
  using LayoutdQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{}, Shape<Int<kM>, Int<kD / kConsumers>>{}));
  static constexpr int kDqTile = kM * kDqCols;  // floats
  static_assert(kDqWhole || kDqTile == cosize_v<LayoutdQ>, "a consumer's dQ tile");
  using TmaKV =
      decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, LayoutKV{}, Shape<Int<kN>, Int<kD>>{}, _1{}));
  // In a cluster each block's pipeline is its own (the blocks load different columns).
  using Pipeline = std::conditional_t<kCluster, BlockTmaPipeline<kStages>, cutlass::PipelineTmaAsync<kStages>>;
  using PipelineState = cutlass::PipelineState<kStages>;
  static constexpr uint32_t kStageBytes = 2 * kM * kD * sizeof(Element) + 2 * kM * sizeof(float) + sizeof(WorkItem);

  struct DqTiles {  // up to D 128: [consumer][buffer]
    alignas(1024) float dq[kConsumers * kDqBuffers * kDqTile];
  };
  // Wide: P^T times the dS factor, fp32, in the S^T fragment's order ([register / 4][thread], float4); in a cluster
  // this space first receives the other blocks' S^T parts, in the same order (g over the first).
  struct PTiles {
    alignas(16) float g[(kCluster ? kParts : 1) * kN * kM];
  };
  struct SharedStorage {
    alignas(1024) Element k[cosize_v<LayoutKV>];
    alignas(1024) Element v[cosize_v<LayoutKV>];
    alignas(1024) Element q[cosize_v<LayoutQ>];
    alignas(1024) Element dout[cosize_v<LayoutQ>];
    alignas(1024) Element ds[kDsSpace * cosize_v<LayoutdS>];
    std::conditional_t<kWide, PTiles, DqTiles> tiles;
    alignas(16) float lse2[kStages][kM];
    alignas(16) float delta[kStages][kM];
    alignas(16) WorkItem item[kStages];  // the chunk's item (a global load at its use stalled the consumers)
    typename Pipeline::SharedStorage pipeline;
    cutlass::arch::ClusterTransactionBarrier kv_full;
    cutlass::arch::ClusterBarrier kv_empty;
    // Cluster: the other blocks' parts have arrived, per role; the other blocks' buffers may be written (their
    // consumer warps are done with the last chunk's).
    cutlass::arch::ClusterTransactionBarrier part_full[kCluster ? 2 : 1];
    cutlass::arch::ClusterBarrier peer_free;
    // The dQ handover (D <= 128), per consumer and buffer: full once its 128 threads stored the tile, empty once the
    // writer's TMA unit read it.
    cutlass::arch::ClusterBarrier dq_full[kConsumers][kDqBuffers], dq_empty[kConsumers][kDqBuffers];
    // kDqWhole: dS buffer b holds both consumers' dS^T of the chunks that consumer b owns (chunk j in buffer j % 2);
    // full once all 256 threads stored theirs, empty once its owner's dQ GEMM read it.
    cutlass::arch::ClusterBarrier ds_full[kDsBuffers], ds_empty[kDsBuffers];
    WorkRing work;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "Hopper's shared memory per block");

  struct Params {
    BwdParams p;
    TmaQ tma_q, tma_do;
    TmaKV tma_k, tma_v;
    int num_work;
    TmaDescriptor cat_q, cat_do, cat_dq;  // p.cat_group > 1: make_cat_tensor_map's views of Q, dO and dq_accum
  };
  // Concatenated heads: a stage's Q (dO) is kD / 64 boxes of 64 rows x 64 columns, one after another; a consumer's
  // dQ tile kD / 64 boxes of 64 rows x 32 fp32 columns.
  static constexpr auto kQOffsets = get_nonswizzle_portion(LayoutQ{});
  static constexpr auto kDqOffsets = get_nonswizzle_portion(LayoutdQ{});
  static_assert(kQOffsets(make_coord(8, 0, 0)) == 8 * 64 && (kStages == 1 || kQOffsets(make_coord(0, 0, 1)) == kM * kD) &&
                    (kD == 64 || kQOffsets(make_coord(0, 64, 0)) == kM * 64),
                "Q stages in 64-column blocks of 64 contiguous 128-byte rows");
  static_assert(kDqOffsets(make_coord(8, 0)) == 8 * 32 && (kD < 128 || kDqOffsets(make_coord(0, 32)) == kM * 32),
                "dQ tiles in 32-column blocks of 64 contiguous 128-byte rows");

  static Params make_params(const BwdParams& p, int num_work) {
    // Descriptors need a non-empty tensor.
    auto tensor = [&](const void* data, int rows, int heads) {
      return make_tensor(make_gmem_ptr(static_cast<const Element*>(data)),
                         make_layout(make_shape(max(rows, 1), p.d, heads),
                                     make_stride(int64_t{heads} * p.d, _1{}, int64_t{p.d})));
    };
    auto chunk = [&](const void* data) {
      return make_tma_copy(SM90_TMA_LOAD{}, tensor(data, p.tq, p.hq), take<0, 2>(LayoutQ{}),
                           Shape<Int<kM>, Int<kD>>{}, _1{});
    };
    auto tile = [&](const void* data) {
      return make_tma_copy(SM90_TMA_LOAD{}, tensor(data, p.tk, p.hkv), LayoutKV{}, Shape<Int<kN>, Int<kD>>{}, _1{});
    };
    Params params{p, chunk(p.q), chunk(p.dout), tile(p.k), tile(p.v), num_work, {}, {}, {}};
    if constexpr (kCat) {
      params.cat_q = make_cat_tensor_map(static_cast<const Element*>(p.q), p.d, p.cat_group, p.tq, p.hkv, 64, kM);
      params.cat_do = make_cat_tensor_map(static_cast<const Element*>(p.dout), p.d, p.cat_group, p.tq, p.hkv, 64, kM);
      params.cat_dq = make_cat_tensor_map(p.dq_accum, p.d, p.cat_group, p.tq, p.hkv, 32, kM);
    }
    return params;
  }

  // One thread issues every load: K and V once per work (after the consumers are done with the last one's), then
  // per (q head, item) the chunk's Q, dO, lse2 and Delta into the next pipeline stage; in a cluster, this block's
  // columns of K, V, Q and dO, and the works of its cluster (the blocks of a cluster walk the same chunks).
  static __device__ __forceinline__ void produce(const Params& params, SharedStorage& shared, Pipeline& pipeline) {
    const BwdParams& p = params.p;
    Tensor mQ = params.tma_q.get_tma_tensor(make_shape(max(p.tq, 1), p.d, p.hq));
    Tensor mdO = params.tma_do.get_tma_tensor(make_shape(max(p.tq, 1), p.d, p.hq));
    Tensor mK = params.tma_k.get_tma_tensor(make_shape(max(p.tk, 1), p.d, p.hkv));
    Tensor mV = params.tma_v.get_tma_tensor(make_shape(max(p.tk, 1), p.d, p.hkv));
    Tensor sQ = make_tensor(make_smem_ptr(shared.q), LayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(shared.dout), LayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k), LayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v), LayoutKV{});
    PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    const int group = p.hq / p.hkv;
    const int cat = kCat ? p.cat_group : 1, walked = kCat ? 1 : group;  // heads walked per work
    const int part = kCluster ? static_cast<int>(cute::block_rank_in_cluster()) : 0;  // this block's columns
    int kv_loads = 0;
    for (int n = 0;; ++n) {
      const PublishedWork work =
          kCluster ? shared.work.template publish_in_cluster<kClusterSize>(n, p.work_counter, p.list, p.hkv,
                                                                         params.num_work)
                   : shared.work.publish(n, p.work_counter, p.list, p.hkv, params.num_work);
      if (work.linear >= params.num_work) break;
      const WorkCoords at = work.at;
      const TileInfo info = work.info;
      if (info.count == 0) continue;
      const int kv_head = at.head;
      // The tile's keys from their first (DeviceList::tile_unit: on either grid).
      const int k_start = detail::tile_rows(p.list, info.tile, kN).start;
      Tensor gK = local_tile(domain_offset(make_coord(k_start, 0), mK(_, _, kv_head)), Shape<Int<kN>, Int<kD>>{},
                             make_coord(0, part));
      Tensor gV = local_tile(domain_offset(make_coord(k_start, 0), mV(_, _, kv_head)), Shape<Int<kN>, Int<kD>>{},
                             make_coord(0, part));
      auto [tKg, tKs] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVg, tVs] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      // K and V go out after the work's first chunk: that chunk's stage is free while the consumers still run the
      // work before, whose K / V they hold until its last chunk.
      bool kv_loaded = false;
      // (The partitions as arguments: a lambda capturing structured bindings is C++20.)
      auto load_kv = [&](auto& k_global, auto& k_shared, auto& v_global, auto& v_shared) {
        if (kv_loads > 0) shared.kv_empty.wait((kv_loads - 1) & 1);
        shared.kv_full.arrive_and_expect_tx(2 * kN * kD * sizeof(Element));
        copy(params.tma_k.with(reinterpret_cast<uint64_t&>(shared.kv_full), 0), k_global, k_shared);
        copy(params.tma_v.with(reinterpret_cast<uint64_t&>(shared.kv_full), 0), v_global, v_shared);
        ++kv_loads;
        kv_loaded = true;
      };
      for (int head = kv_head * group; head < kv_head * group + walked; ++head) {
        Tensor gQ = local_tile(mQ(_, _, head), Shape<Int<kM>, Int<kD>>{}, make_coord(_, part));
        Tensor gdO = local_tile(mdO(_, _, head), Shape<Int<kM>, Int<kD>>{}, make_coord(_, part));
        auto [tQg, tQs] =
            tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
        auto [tdOg, tdOs] =
            tma_partition(params.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
        for (int item = info.first + info.count - 1; item >= info.first; --item) {  // see rank_dq_adds
          const int chunk = p.list.items[item].q0 / (kM / cat);
          pipeline.producer_acquire(write);
          uint64_t* const full = pipeline.producer_get_barrier(write);
          const int s = write.index();
          if constexpr (kCat) {
            for (int c = 0; c < kD / 64; ++c) {
              const int at = s * kM * kD + c * kM * 64;
              SM90_TMA_LOAD_4D::copy(&params.cat_q, full, kEvictNormal, shared.q + at, c * 64, 0, chunk * (kM / cat),
                                     kv_head);
              SM90_TMA_LOAD_4D::copy(&params.cat_do, full, kEvictNormal, shared.dout + at, c * 64, 0,
                                     chunk * (kM / cat), kv_head);
            }
          } else {
            copy(params.tma_q.with(*full, 0), tQg(_, chunk), tQs(_, s));
            copy(params.tma_do.with(*full, 0), tdOg(_, chunk), tdOs(_, s));
          }
          // Rows below tq_pad (x cat): whole chunks exist. stats_index's layouts.
          const int64_t stats = int64_t{kCat ? kv_head : head} * p.tq_pad * cat + chunk * kM;
          SM90_BULK_COPY_G2S::copy(p.lse2 + stats, full, shared.lse2[s], kM * sizeof(float));
          SM90_BULK_COPY_G2S::copy(p.delta + stats, full, shared.delta[s], kM * sizeof(float));
          static_assert(sizeof(WorkItem) % 16 == 0, "bulk copies move multiples of 16 bytes");
          SM90_BULK_COPY_G2S::copy(p.list.items + item, full, &shared.item[s], sizeof(WorkItem));
          ++write;
          if (!kv_loaded) load_kv(tKg, tKs, tVg, tVs);
        }
      }
    }
  }

  // The consumers' persistent loop (both layouts): per work (a k tile of one kv head) begin(), then per chunk (each
  // q head of the kv head's group, the tile's items last first: see rank_dq_adds) chunk(head, k_base, stage, release,
  // last) once its stage is full (the item is in the stage; release() hands the stage back), then end(kv_head,
  // k_base). kChunkCanFreeKv: the work's last chunk (last) arrives on kv_empty itself, as
  // soon as its GEMMs are past K and V (the next work's K / V then load under the rest of that chunk and end());
  // else this loop does, after it.
  template <bool kChunkCanFreeKv, class Begin, class Chunk, class End>
  static __device__ __forceinline__ void for_each_chunk(const Params& params, SharedStorage& shared, Pipeline& pipeline,
                                                        Begin&& begin, Chunk&& chunk, End&& end) {
    const BwdParams& p = params.p;
    const int group = p.hq / p.hkv, walked = kCat ? 1 : group;
    constexpr bool chunk_frees_kv = kChunkCanFreeKv;
    PipelineState read;
    int kv_phase = 0;
    for (int n = 0;; ++n) {
      // Not the published description: read from the ring, it cost the D <= 128 backward 1-2% (ring.sh A/B).
      const int linear = shared.work.take(n).linear;
      if (linear >= params.num_work) break;
      const WorkCoords at = detail::work_coords(linear, p.hkv, p.list);
      const TileInfo info = p.list.tiles[at.tile_index];
      const detail::TileRows keys = detail::tile_rows(p.list, info.tile, kN);
      const int k_base = keys.start;
      begin();
      if (info.count > 0) {
        shared.kv_full.wait(kv_phase);
        kv_phase ^= 1;
        for (int head = at.head * group; head < at.head * group + walked; ++head) {
          for (int item = info.first + info.count - 1; item >= info.first; --item) {
            const int stage = read.index();
            pipeline.consumer_wait(read);
            const bool last = chunk_frees_kv && item == info.first && head == at.head * group + walked - 1;
            chunk(
                head, k_base, stage,
                [&] {
                  pipeline.consumer_release(read);
                  ++read;
                },
                last);
          }
        }
        if (!chunk_frees_kv) shared.kv_empty.arrive();
      }
      end(at.head, k_base, min(p.tk, keys.end));
    }
  }

  // dK or dV of this thread's keys (k_base + key_local + {0, 8}) from the accumulator's [8-column block][2 row +
  // column] view, this block's columns (from col0); keys past tk and columns past d dropped. Whole 8-column blocks
  // (store_row_blocks, as the portable family) when dk and dv are 16-byte aligned, else element pairs.
  template <class Acc>
  static __device__ __forceinline__ void store_key_rows(const BwdParams& p, void* out, const Acc& acc, bool fp32,
                                                        int kv_head, int k_base, int k_end, int key_local,
                                                        int lane, int col0 = 0) {
    if (p.vector_stores) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int key = k_base + key_local + 8 * r;
        const int64_t row = (int64_t{key} * p.hkv + kv_head) * p.d + col0;
        detail::store_row_blocks<T>(out, row, acc, r, 1.0f, p.d - col0, fp32, key < k_end, lane);
      }
      return;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = k_base + key_local + 8 * r;
      if (key >= k_end) continue;
      const int64_t base = (int64_t{key} * p.hkv + kv_head) * p.d;
#pragma unroll
      for (int nb = 0; nb < kD / 8; ++nb) {
        const int col = col0 + nb * 8 + (lane % 4) * 2;
        if (col < p.d) detail::store_pair<T>(out, base + col, acc[nb][2 * r], acc[nb][2 * r + 1], fp32);
      }
    }
  }

  static __device__ __forceinline__ void consume(const Params& params, SharedStorage& shared, Pipeline& pipeline) {
    if constexpr (kWide) {
      consume_wide(params, shared, pipeline);
    } else {
      consume_narrow(params, shared, pipeline);
    }
  }

  static __device__ __forceinline__ void consume_narrow(const Params& params, SharedStorage& shared,
                                                        Pipeline& pipeline) {
    const BwdParams& p = params.p;
    const int thread = static_cast<int>(threadIdx.x) - 128;  // 0 .. 255
    const int lane = thread % 32;
    const int warp = thread / 32;  // keys [16 warp, +16) of the tile in S^T; rows [16 (warp % 4), +16) in dQ
    const int consumer = thread / 128;
    MmaSdP mma_sdp;
    MmaKV mma_kv;
    std::conditional_t<kDqWhole, MmaDqWhole, MmaDq> mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(thread);
    auto thr_kv = mma_kv.get_thread_slice(thread);
    auto thr_dq = mma_dq.get_thread_slice(kDqWhole ? thread % 128 : thread);
    // This thread's dS^T stores: keys key_local + {0, 8}, rows 8 nb + 2 (lane % 4) + {0, 1} (LayoutdS, by hand:
    // CuTe's partition kept 32 addresses live).
    const uint32_t ds_store = detail::smem_addr(shared.ds) + (warp * 16 + lane / 4) * kM * 2 + (lane % 4) * 4;
    const uint32_t ds_chunk = (lane / 4) * 16;
    static_assert(kM * sizeof(Element) == 128, "a key's 64 rows are one 128-byte swizzle row");

    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kN>, Int<kM>>{});
    Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<Int<kN>, Int<kM>>{});
    Tensor tdVrdV = partition_fragment_C(mma_kv, Shape<Int<kN>, Int<kD>>{});
    Tensor tdKrdK = partition_fragment_C(mma_kv, Shape<Int<kN>, Int<kD>>{});
    Tensor tDqrdQ = partition_fragment_C(mma_dq, Shape<Int<kM>, Int<kD>>{});
    Tensor rP = make_tensor<Element>(tSrS.layout());
    Tensor rdS = make_tensor<Element>(tSrS.layout());
    Tensor tKVrP = make_tensor(rP.data(), accumulator_as_a_operand(rP.layout()));
    Tensor tKVrdS = make_tensor(rdS.data(), accumulator_as_a_operand(rdS.layout()));
    static_assert(size(decltype(tSrS){}) == kM / 2, "S^T: this thread's 2 keys x kM / 4 rows");
    static_assert(size(decltype(tdKrdK){}) == kD / 2, "dK: 2 keys x kD / 4 columns");
    static_assert(size(decltype(tDqrdQ){}) == kDqCols / 2, "dQ: 2 rows x kDqCols / 4 columns");
    // The fragments in the wgmma accumulator layout: [8-column block][2 row + column] (rows lane / 4 + {0, 8}).
    auto& s = *reinterpret_cast<float(*)[kM / 8][4]>(raw_pointer_cast(tSrS.data()));
    auto& dp = *reinterpret_cast<float(*)[kM / 8][4]>(raw_pointer_cast(tSrdP.data()));
    auto& dq = *reinterpret_cast<float(*)[kDqCols / 8][4]>(raw_pointer_cast(tDqrdQ.data()));

    const int key_local = warp * 16 + lane / 4;  // this thread's keys: + {0, 8}
    int chunks = 0;  // this block's chunks so far (the dS buffer)
    auto begin = [&] {
      clear(tdVrdV);
      clear(tdKrdK);
    };
    auto chunk = [&](int head, int k_base, int stage, auto&& release, bool last) {
      const WorkItem w = shared.item[stage];
      const int cat = kCat ? p.cat_group : 1;
      const int token0 = w.q0 & -(kM / cat);  // the chunk's first token (its rows: token x cat + head in the group)
      [[maybe_unused]] const int buffer = chunks & 1;  // the dS and dQ tiles (with dQ only)
      // The operands' descriptors, rebuilt per chunk from an opaque base: hoisted out of the loops, the ~90
      // of them took registers that the accumulators need (spills).
      Element* const base = launder(shared.k);
      auto at_smem = [&](const Element* member) { return make_smem_ptr(base + (member - shared.k)); };
      Tensor tSrK = thr_sdp.partition_fragment_A(make_tensor(at_smem(shared.k), LayoutKV{}));
      Tensor tSrV = thr_sdp.partition_fragment_A(make_tensor(at_smem(shared.v), LayoutKV{}));
      Tensor tSrQ = thr_sdp.partition_fragment_B(make_tensor(at_smem(shared.q), LayoutQ{}));
      Tensor tSrdO = thr_sdp.partition_fragment_B(make_tensor(at_smem(shared.dout), LayoutQ{}));
      Tensor tKVrQt = thr_kv.partition_fragment_B(make_tensor(at_smem(shared.q), LayoutQt{}));
      Tensor tKVrdOt = thr_kv.partition_fragment_B(make_tensor(at_smem(shared.dout), LayoutQt{}));
      Tensor tDqrdS = thr_dq.partition_fragment_A(make_tensor(at_smem(shared.ds), LayoutdS{}));
      Tensor tDqrKt = thr_dq.partition_fragment_B(make_tensor(at_smem(shared.k), LayoutKt{}));
      issue_gemm<true, false>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
      issue_gemm<true, false>(mma_sdp, tSrV, tSrdO(_, _, _, stage), tSrdP);
      // Only warps whose 16 keys the plan marks take the per-cell test; kept rows relative to q0.
      const bool masked = (w.flags >> (detail::kWorkTestGroupShift + warp)) & 1;
      KeyInterval rows[2] = {{0, 1 << 30}, {0, 1 << 30}};
      if (masked) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          rows[r] = detail::item_queries(w, k_base + key_local + 8 * r);
          rows[r].lo = (rows[r].lo - token0) * cat, rows[r].hi = (rows[r].hi - token0) * cat;
        }
      }
      // P^T, then dS^T, into 16-bit A operands; dV += P^T dO issued between them. Without softcap P is
      // computed while dP^T is still in the tensor cores (bwd_cell's arithmetic, in two passes: P = 0 where
      // not kept, so dS needs no mask); with it, bwd_cell once both are done. The wgmma issues stay outside
      // the per-warp `masked` branch: the four warps of a warpgroup must issue the same wgmma instruction
      // (issued from both branches, with their own A registers, dV came out garbage).
      auto p_and_ds = [&](auto is_masked) {
        auto kept = [&](int nb, int e) {
          return decltype(is_masked)::value ? rows[e / 2].contains(nb * 8 + (lane % 4) * 2 + e % 2) : true;
        };
#pragma unroll
        for (int nb = 0; nb < kM / 8; ++nb) {
          const int col0 = nb * 8 + (lane % 4) * 2;
          const float2 lse2 = *reinterpret_cast<const float2*>(&shared.lse2[stage][col0]);
          if constexpr (kSoftcap) {
            const float2 delta = *reinterpret_cast<const float2*>(&shared.delta[stage][col0]);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const detail::BwdCell c = detail::bwd_cell<true>(
                  p, s[nb][e], dp[nb][e], e % 2 ? lse2.y : lse2.x, e % 2 ? delta.y : delta.x, kept(nb, e));
              rP(nb * 4 + e) = static_cast<Element>(c.p);
              rdS(nb * 4 + e) = static_cast<Element>(c.ds);
            }
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float lse = e % 2 ? lse2.y : lse2.x;
              s[nb][e] = detail::fast_exp2(kept(nb, e) ? s[nb][e] * p.scale_log2 - lse : -INFINITY);
              rP(nb * 4 + e) = static_cast<Element>(s[nb][e]);
            }
          }
        }
      };
      warpgroup_wait<kSoftcap ? 0 : 1>();  // S^T (and dP^T with softcap)
      detail::with_bool(masked, p_and_ds);
      issue_gemm<false, true>(mma_kv, tKVrP, tKVrdOt(_, _, _, stage), tdVrdV);
      if constexpr (!kSoftcap) {
        warpgroup_wait<1>();  // dP^T (dV may still run)
#pragma unroll
        for (int nb = 0; nb < kM / 8; ++nb) {
          const float2 delta = *reinterpret_cast<const float2*>(&shared.delta[stage][nb * 8 + (lane % 4) * 2]);
#pragma unroll
          for (int e = 0; e < 4; ++e)
            rdS(nb * 4 + e) =
                static_cast<Element>(s[nb][e] * (dp[nb][e] - (e % 2 ? delta.y : delta.x)) * p.softmax_scale);
        }
      }
      if constexpr (kDq) {
        // kDqWhole: this chunk's dQ is the owner's; the other stores its dS^T once the owner's dQ of two chunks ago
        // has read the buffer.
        const bool owner = !kDqWhole || consumer == buffer;
        if constexpr (kDqWhole)
          if (!owner) shared.ds_empty[buffer].wait(((chunks / 2) & 1) ^ 1);  // a fresh barrier passes parity 1
        // dS^T into buffer `buffer` of the dS tile (rows contiguous, 128-byte swizzle: the 16-byte chunk
        // q / 8 of key row k sits at chunk (q / 8) ^ (k % 8)); this thread's two keys are k % 8 = lane / 4.
        {
          const auto* pairs = reinterpret_cast<const uint32_t*>(raw_pointer_cast(rdS.data()));
          const uint32_t at = ds_store + buffer * uint32_t{kM * kN * sizeof(Element)};
  #pragma unroll
          for (int nb = 0; nb < kM / 8; ++nb)
  #pragma unroll
            for (int r = 0; r < 2; ++r)
              asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at + r * 8 * kM * 2 + ((nb * 16) ^ ds_chunk)),
                           "r"(pairs[nb * 2 + r]));
        }
        cutlass::arch::fence_view_async_shared();  // dS^T's ordinary stores, read next by the tensor cores
        if constexpr (kDqWhole) {
          shared.ds_full[buffer].arrive();
          if (owner) shared.ds_full[buffer].wait((chunks / 2) & 1);
        } else {
          cutlass::arch::NamedBarrier::sync(128 * kConsumers, 0);
        }
        if (owner) {
          // dQ before dK, so that dQ's way out (shared memory, TMA) overlaps dK += dS^T Q.
          Tensor ds_operand = tDqrdS(_, _, _, buffer);
          issue_gemm<true, false>(mma_dq, ds_operand, tDqrKt, tDqrdQ);
          issue_gemm<false, true>(mma_kv, tKVrdS, tKVrQt(_, _, _, stage), tdKrdK);
          warpgroup_wait<1>();  // dQ: the last GEMM that reads K or V
          if constexpr (kDqWhole) shared.ds_empty[buffer].arrive();
          if (last) shared.kv_empty.arrive();
          // dQ rows 16 (warp % 4) + lane / 4 + {0, 8}, this consumer's columns, into its next dQ tile once the
          // writer has read it the last time, then handed to it (write_dq). One head at a time: in fragment order
          // (detail::dq_fragment_base), 16 bytes a store. Concatenated heads: LayoutdQ for the TMA unit, by hand
          // (column c of row r at byte (c / 32) 8192 + (r / 8) 1024 + (r % 8) 128 + 16 ((c % 32 / 4) ^ (r % 8)) +
          // 4 (c % 4); r % 8 = lane / 4 here).
          const int tiles = kDqWhole ? chunks / 2 : chunks;  // this consumer's dQ tiles before this one
          const int dq_buffer = tiles % kDqBuffers;
          const uint32_t tile =
              detail::smem_addr(shared.tiles.dq) + (consumer * kDqBuffers + dq_buffer) * uint32_t{kDqTile * 4};
          shared.dq_empty[consumer][dq_buffer].wait(((tiles / kDqBuffers) & 1) ^ 1);
          if constexpr (kCat) {
            const uint32_t at = tile + (warp % 4) * 2048 + (lane / 4) * 128 + (lane % 2) * 8;
            const uint32_t chunk_x = (((lane % 4) / 2) ^ (lane / 4)) * 16;
  #pragma unroll
            for (int nb = 0; nb < kDqCols / 8; ++nb)
  #pragma unroll
              for (int r = 0; r < 2; ++r)
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at + (nb / 4) * 8192 + r * 1024 +
                                                                       (((nb % 4) * 32) ^ chunk_x)),
                             "f"(dq[nb][2 * r]), "f"(dq[nb][2 * r + 1]));
          } else {
            // A whole tile is the two halves' fragment order one after the other: the same stores, twice as many.
            const uint32_t at = tile + ((warp % 4) * 32 + lane) * 16;
  #pragma unroll
            for (int nb = 0; nb < kDqCols / 8; ++nb)
              asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(at + nb * 128 * 16), "f"(dq[nb][0]),
                           "f"(dq[nb][1]), "f"(dq[nb][2]), "f"(dq[nb][3]));
          }
          cutlass::arch::fence_view_async_shared();
          shared.dq_full[consumer][dq_buffer].arrive();
        } else {
          issue_gemm<false, true>(mma_kv, tKVrdS, tKVrQt(_, _, _, stage), tdKrdK);
          if (last) shared.kv_empty.arrive();  // its GEMMs on K and V (S^T, dP^T) are done
        }
      } else {
        issue_gemm<false, true>(mma_kv, tKVrdS, tKVrQt(_, _, _, stage), tdKrdK);
      }
      warpgroup_wait<0>();
      if constexpr (!kDq)
        if (last) shared.kv_empty.arrive();
      // P^T and dS^T live until the GEMMs that read them from registers are done.
      warpgroup_fence_operand(tKVrP);
      warpgroup_fence_operand(tKVrdS);
      release();
      ++chunks;
    };
    // dK (the cells' dS already carries the softmax scale) and dV.
    auto end = [&](int kv_head, int k_base, int k_end) {
      auto& dk = *reinterpret_cast<float(*)[kD / 8][4]>(raw_pointer_cast(tdKrdK.data()));
      auto& dv = *reinterpret_cast<float(*)[kD / 8][4]>(raw_pointer_cast(tdVrdV.data()));
      store_key_rows(p, p.dk, dk, p.grad_fp32, kv_head, k_base, k_end, key_local, lane);
      store_key_rows(p, p.dv, dv, p.dv_fp32, kv_head, k_base, k_end, key_local, lane);
    };
    for_each_chunk<true>(params, shared, pipeline, begin, chunk, end);
  }

  // D <= 128 with dQ: warp 1 + c of the producer warpgroup takes consumer c's dQ tiles, walking the same works and
  // chunks (the list tells each tile's head, rows and rank), and adds them to dq_accum by TMA (rows past tq, columns
  // past d clipped by the TMA unit); a tile is handed back once read.
  static __device__ __forceinline__ void write_dq(const Params& params, SharedStorage& shared, int consumer) {
    const BwdParams& p = params.p;
    const bool leader = threadIdx.x % 32 == 0;
    const int group = p.hq / p.hkv;
    const int cat = kCat ? p.cat_group : 1, walked = kCat ? 1 : group;
    OrderedDqAdds adds;
    int tiles = 0;   // this consumer's dQ tiles so far
    int chunks = 0;  // the block's chunks so far (kDqWhole: consumer chunks % 2 owns the chunk's dQ)
    for (int n = 0;; ++n) {
      // Not the published description: read from the ring, it cost the D <= 128 backward 1-2% (ring.sh A/B).
      const int linear = shared.work.take(n).linear;
      if (linear >= params.num_work) break;
      const WorkCoords at = detail::work_coords(linear, p.hkv, p.list);
      const TileInfo info = p.list.tiles[at.tile_index];
      for (int head = at.head * group; head < at.head * group + walked && info.count > 0; ++head) {
        for (int item = info.first + info.count - 1; item >= info.first; --item) {
          if (kDqWhole && chunks++ % 2 != consumer) continue;
          const WorkItem w = p.list.items[item];
          const int chunk = w.q0 / (kM / cat);
          const int buffer = tiles % kDqBuffers;
          float* const tile = shared.tiles.dq + (consumer * kDqBuffers + buffer) * kDqTile;
          if (leader) {
            shared.dq_full[consumer][buffer].wait((tiles / kDqBuffers) & 1);
            // Addresses before the turn: in the deterministic mode the adds of a chunk run in a chain.
            const int cat_token0 = chunk * (kM / cat), cat_col0 = kDqWhole ? 0 : consumer * (kD / kConsumers);
            // A whole tile covers both halves; its adds take the turns of half 0.
            const int half = kDqWhole ? 0 : consumer;
            float* const to = p.dq_accum + detail::dq_fragment_base(chunk, head, half, p.hq, kD);
            adds.wait_turn(p, cat, half, kCat ? at.head : head, chunk, w.rank);
            if constexpr (kCat) {
              for (int c = 0; c < kDqCols / 32; ++c)
                SM90_TMA_REDUCE_ADD_4D::copy(&params.cat_dq, tile + c * kM * 32, cat_col0 + c * 32, 0, cat_token0,
                                             at.head);
            } else {
              asm volatile(
                  "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(to),
                  "r"(detail::smem_addr(tile)), "n"(kDqTile * 4)
                  : "memory");
            }
            tma_store_arrive();
            tma_store_wait<0>();  // the tile is read
            shared.dq_empty[consumer][buffer].arrive();
            adds.count();
          }
          __syncwarp();
          ++tiles;
        }
      }
    }
    if (leader) tma_store_wait<0>();
  }

  // D 256, a consumer's share by its role (0: S^T, P^T, dV; 1: dP^T, dS^T, dK; both: half of dQ's columns).
  // Per chunk: role 0 hands over g = P^T times the dS factor (bwd_cell's split: dS = g (dP - Delta)) at barrier
  // kGReady and issues dV; role 1 takes g, issues dK, stores dS^T; at barrier kDsReady both issue their dQ half.
  // (kGReady is a sync for both, not an arrive for role 0: racecheck reported the g handover as a race at times.)
  // The g buffer is rewritten only past the next kDsReady, by when role 1 has read it. One body for both roles (a
  // role is warp-uniform): the barriers both sync on sit at one instruction (compute-sanitizer's synccheck rejects
  // a named barrier synced from two places).
  static __device__ __forceinline__ void consume_wide(const Params& params, SharedStorage& shared,
                                                      Pipeline& pipeline) {
    constexpr int kGReady = 1, kDsReady = 2;
    const BwdParams& p = params.p;
    const int thread = static_cast<int>(threadIdx.x) - 128;  // 0 .. 255 (dQ's split)
    const int own = thread % 128;                              // in this consumer
    const int role = thread / 128;
    const int lane = thread % 32;
    const int warp = own / 32;  // keys [16 warp, +16) of the tile in S^T / dP^T, dV / dK; rows of dQ
    const int key_local = warp * 16 + lane / 4;  // this thread's keys: + {0, 8}
    MmaSdP mma_sdp;
    MmaKV mma_kv;
    auto thr_sdp = mma_sdp.get_thread_slice(own);
    auto thr_kv = mma_kv.get_thread_slice(own);
    const uint32_t ds_store = detail::smem_addr(shared.ds) + key_local * kM * 2 + (lane % 4) * 4;
    const uint32_t ds_chunk = (lane / 4) * 16;
    static_assert(kM * sizeof(Element) == 128, "a key's 64 rows are one 128-byte swizzle row");

    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kN>, Int<kM>>{});     // S^T or dP^T
    Tensor tKVrAcc = partition_fragment_C(mma_kv, Shape<Int<kN>, Int<kD>>{});   // dV or dK
    Tensor rA = make_tensor<Element>(tSrS.layout());  // P^T or dS^T, 16-bit
    Tensor tKVrA = make_tensor(rA.data(), accumulator_as_a_operand(rA.layout()));
    static_assert(size(decltype(tSrS){}) == kM / 2, "S^T: this thread's 2 keys x kM / 4 rows");
    static_assert(size(decltype(tKVrAcc){}) == kD / 2, "dV / dK: 2 keys x kD / 4 columns");
    auto& s = *reinterpret_cast<float(*)[kM / 8][4]>(raw_pointer_cast(tSrS.data()));
    // g in the fragment's order: registers 4 j .. 4 j + 3 of thread t at float4 index j * 128 + t (conflict-free).
    float4* const g = reinterpret_cast<float4*>(shared.tiles.g) + own;
    // Cluster: where the other blocks' parts of this role's matrix arrive (g's space for S^T, dS's for dP^T), in the
    // same order, and this block's columns. The part of the block e ranks after this one (mod the cluster) is in slot
    // e - 1 (slots of kN x kM floats).
    float4* const part =
        reinterpret_cast<float4*>(role == 0 ? shared.tiles.g : reinterpret_cast<float*>(shared.ds)) + own;
    constexpr int kSlot = kN * kM / 4;  // float4s
    const uint32_t rank = kCluster ? cute::block_rank_in_cluster() : 0;
    const int col0 = rank * kD;
    auto block_after = [&](int d) -> uint32_t { return kClusterSize == 2 ? rank ^ 1 : (rank + d) % kClusterSize; };
    int chunks = 0;  // this block's chunks so far (the exchange's phases)
    // This role's S^T or dP^T over the whole of D: the blocks' parts summed in rank order (the same bits in every
    // block; with two, own + other == other + own). A part is stored into another block once that block's consumer
    // warps are done with the buffers of the chunk before (peer_free), which they read until their dQ GEMM.
    auto add_other_parts = [&] {
      auto& full = shared.part_full[role];
      if (own == 0) full.arrive_and_expect_tx(kParts * kN * kM * 4);
      if (chunks > 0) wait_cluster_barrier(shared.peer_free, (chunks - 1) & 1);
      CUTE_UNROLL
      for (int d = 1; d < kClusterSize; ++d) {  // to block rank + d, whose slot for this block is kClusterSize - 1 - d
        const uint32_t block = block_after(d);
        const uint32_t to = cute::set_block_rank(cute::cast_smem_ptr_to_uint(part + (kClusterSize - 1 - d) * kSlot),
                                                 block);
        const uint32_t to_full = cute::set_block_rank(cute::cast_smem_ptr_to_uint(&full), block);
        CUTE_UNROLL
        for (int j = 0; j < kM / 8; ++j)
          asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
                       :
                       : "r"(to + j * 128 * 16), "f"(s[j][0]), "f"(s[j][1]), "f"(s[j][2]), "f"(s[j][3]), "r"(to_full)
                       : "memory");
      }
      full.wait(chunks & 1);
      if constexpr (kClusterSize == 2) {
        CUTE_UNROLL
        for (int j = 0; j < kM / 8; ++j) {
          const float4 v = part[j * 128];
          s[j][0] += v.x;
          s[j][1] += v.y;
          s[j][2] += v.z;
          s[j][3] += v.w;
        }
      } else {
        CUTE_UNROLL
        for (int j = 0; j < kM / 8; ++j) {
          float4 sum;
          CUTE_UNROLL
          for (int b = 0; b < kClusterSize; ++b) {
            const int e = (b - static_cast<int>(rank) + kClusterSize) % kClusterSize;
            const float4 other = part[(e == 0 ? 0 : e - 1) * kSlot + j * 128];
            const float4 x = e == 0 ? make_float4(s[j][0], s[j][1], s[j][2], s[j][3]) : other;
            if (b == 0) {
              sum = x;
            } else {
              sum.x += x.x;
              sum.y += x.y;
              sum.z += x.z;
              sum.w += x.w;
            }
          }
          s[j][0] = sum.x;
          s[j][1] = sum.y;
          s[j][2] = sum.z;
          s[j][3] = sum.w;
        }
      }
    };

    auto begin = [&] { clear(tKVrAcc); };
    auto chunk = [&](int head, int k_base, int stage, auto&& release, bool) {
      const WorkItem w = shared.item[stage];
      const int q0 = w.q0 / kM * kM;
      // Descriptors rebuilt per chunk from an opaque base (see consume_narrow).
      Element* const base = launder(shared.k);
      auto at_smem = [&](const Element* member) { return make_smem_ptr(base + (member - shared.k)); };
      Tensor tSrKV = thr_sdp.partition_fragment_A(make_tensor(at_smem(role == 0 ? shared.k : shared.v), LayoutKV{}));
      Tensor tSrQ = thr_sdp.partition_fragment_B(make_tensor(at_smem(role == 0 ? shared.q : shared.dout), LayoutQ{}));
      Tensor tKVrB =  // dO^T for dV, Q^T for dK
          thr_kv.partition_fragment_B(make_tensor(at_smem(role == 0 ? shared.dout : shared.q), LayoutQt{}));
      issue_gemm<true, false>(mma_sdp, tSrKV, tSrQ(_, _, _, stage), tSrS);
      // Role 0: only warps whose 16 keys the plan marks take the per-cell test; kept rows relative to q0.
      const bool masked = role == 0 && ((w.flags >> (detail::kWorkTestGroupShift + warp)) & 1);
      KeyInterval rows[2] = {{0, 1 << 30}, {0, 1 << 30}};
      if (masked) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          rows[r] = detail::item_queries(w, k_base + key_local + 8 * r);
          rows[r].lo -= q0, rows[r].hi -= q0;
        }
      }
      warpgroup_wait<0>();
      if constexpr (kCluster) add_other_parts();
      if (role == 0) {
        // bwd_cell's P and dS factor; P = 0 where not kept, so that dS = g (dP - Delta) needs no mask.
        detail::with_bool(masked, [&](auto is_masked) {
#pragma unroll
          for (int nb = 0; nb < kM / 8; ++nb) {
            const int col0 = nb * 8 + (lane % 4) * 2;
            const float2 lse2 = *reinterpret_cast<const float2*>(&shared.lse2[stage][col0]);
            float gv[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const bool kept = decltype(is_masked)::value ? rows[e / 2].contains(col0 + e % 2) : true;
              float s2, factor;
              if constexpr (kSoftcap) {
                const float t = tanhf(s[nb][e] * p.softcap_pre);
                s2 = p.softcap_post * t;
                factor = p.softmax_scale * (1.0f - t * t);
              } else {
                s2 = s[nb][e] * p.scale_log2;
                factor = p.softmax_scale;
              }
              const float pr = detail::fast_exp2(kept ? s2 - (e % 2 ? lse2.y : lse2.x) : -INFINITY);
              rA(nb * 4 + e) = static_cast<Element>(pr);
              gv[e] = pr * factor;
            }
            g[nb * 128] = make_float4(gv[0], gv[1], gv[2], gv[3]);  // (in a cluster over what this thread read)
          }
        });
      }
      cutlass::arch::NamedBarrier::sync(256, kGReady);
      if (role == 1) {
#pragma unroll
        for (int nb = 0; nb < kM / 8; ++nb) {
          const float2 delta = *reinterpret_cast<const float2*>(&shared.delta[stage][nb * 8 + (lane % 4) * 2]);
          const float4 gv = g[nb * 128];
          rA(nb * 4) = static_cast<Element>(gv.x * (s[nb][0] - delta.x));
          rA(nb * 4 + 1) = static_cast<Element>(gv.y * (s[nb][1] - delta.y));
          rA(nb * 4 + 2) = static_cast<Element>(gv.z * (s[nb][2] - delta.x));
          rA(nb * 4 + 3) = static_cast<Element>(gv.w * (s[nb][3] - delta.y));
        }
      }
      issue_gemm<false, true>(mma_kv, tKVrA, tKVrB(_, _, _, stage), tKVrAcc);  // dV += P^T dO, dK += dS^T Q
      if (kDq && role == 1) {
        // dS^T into the dS tile (rows contiguous, 128-byte swizzle: the 16-byte chunk q / 8 of key row k sits
        // at chunk (q / 8) ^ (k % 8)); this thread's two keys are k % 8 = lane / 4.
        const auto* pairs = reinterpret_cast<const uint32_t*>(raw_pointer_cast(rA.data()));
#pragma unroll
        for (int nb = 0; nb < kM / 8; ++nb)
#pragma unroll
          for (int r = 0; r < 2; ++r)
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ds_store + r * 8 * kM * 2 + ((nb * 16) ^ ds_chunk)),
                         "r"(pairs[nb * 2 + r]));
        cutlass::arch::fence_view_async_shared();  // read next by the tensor cores
      }
      cutlass::arch::NamedBarrier::sync(256, kDsReady);
      // dV / dK done before dQ is issued: P^T / dS^T's registers then hold dQ (else they spill).
      warpgroup_wait<0>();
      warpgroup_fence_operand(tKVrA);
      if constexpr (kStages == 1) release();  // Q and dO read: the next chunk's load runs under the dQ GEMM
      auto finish = [&] {
        // This warp is done with g and dS (its loads used, the dQ GEMM waited for): the other blocks may store their
        // next parts. Relaxed: a release would first wait for this thread's dQ reductions of the chunk before.
        if constexpr (kCluster) {
          __syncwarp();
          if (lane == 0)
            CUTE_UNROLL
            for (int d = 1; d < kClusterSize; ++d) arrive_cluster_barrier_relaxed(shared.peer_free, block_after(d));
        }
        ++chunks;
        if constexpr (kStages > 1) release();
      };
      if constexpr (kDq) {
        // dQ = dS K, role 0 the first kDqCols0 columns, role 1 the rest: one GEMM split by columns where both halves
        // are whole swizzle atoms of K^T, else one per role.
        auto dq_columns = [&](auto mma_dq, int mma_thread, auto columns, auto b_tile, int first) {
          constexpr int kCols = decltype(columns)::value;
          auto thr_dq = mma_dq.get_thread_slice(mma_thread);
          Tensor tDqrdQ = partition_fragment_C(mma_dq, Shape<Int<kM>, Int<decltype(b_tile)::value>>{});
          static_assert(size(decltype(tDqrdQ){}) == kCols / 2, "dQ: 2 rows x kCols / 4 columns");
          Tensor tDqrdS = thr_dq.partition_fragment_A(make_tensor(at_smem(shared.ds), LayoutdS{}));
          Tensor sKt = local_tile(make_tensor(at_smem(shared.k), LayoutKt{}),
                                  Shape<Int<decltype(b_tile)::value>, Int<kN>>{},
                                  make_coord(first / decltype(b_tile)::value, 0));
          Tensor tDqrKt = thr_dq.partition_fragment_B(sKt);
          Tensor ds_operand = tDqrdS(_, _, _, 0);
          issue_gemm<true, false>(mma_dq, ds_operand, tDqrKt, tDqrdQ);
          warpgroup_wait<0>();
          finish();
          auto& dq = *reinterpret_cast<float(*)[kCols / 8][4]>(raw_pointer_cast(tDqrdQ.data()));
          add_dq_rows<kCols>(p, dq, head, q0 + key_local, col0 + first, lane);
        };
        if constexpr (2 * kDqCols0 == kD) {
          dq_columns(MmaDq{}, thread, Int<kD / 2>{}, Int<kD>{}, role * (kD / 2));
        } else if (role == 0) {
          dq_columns(MmaDqColumns<kDqCols0>{}, own, Int<kDqCols0>{}, Int<kDqCols0>{}, 0);
        } else {
          dq_columns(MmaDqColumns<kD - kDqCols0>{}, own, Int<kD - kDqCols0>{}, Int<kD - kDqCols0>{}, kDqCols0);
        }
      } else {
        finish();
      }
    };
    // dV (role 0) or dK (role 1: the cells' dS already carries the softmax scale).
    auto end = [&](int kv_head, int k_base, int k_end) {
      auto& acc = *reinterpret_cast<float(*)[kD / 8][4]>(raw_pointer_cast(tKVrAcc.data()));
      store_key_rows(p, role == 0 ? p.dv : p.dk, acc, role == 0 ? p.dv_fp32 : p.grad_fp32, kv_head, k_base, k_end,
                     key_local, lane, col0);
    };
    for_each_chunk<false>(params, shared, pipeline, begin, chunk, end);
  }

  // Wide: this thread's dQ (rows `row`, + 8; columns col0 + 8 nb + 2 (lane % 4) + {0, 1}, nb < kCols / 8) added to
  // dq_accum by 16-byte reductions: lanes 2i and 2i + 1 swap halves so that each holds 4 adjacent columns of one
  // 8-column block (even lanes block nb, odd lanes block nb + 1). Rows past tq and columns past d are skipped.
  template <int kCols, class Dq>
  static __device__ __forceinline__ void add_dq_rows(const BwdParams& p, const Dq& dq, int head, int row,
                                                     int col0, int lane) {
    const bool odd = lane & 1;
    const int lane_col = col0 + (lane % 4 / 2) * 4 + (odd ? 8 : 0);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int q = row + 8 * r;
      float* const at = p.dq_accum + ((int64_t{q} * p.hq + head) * p.d + lane_col);
#pragma unroll
      for (int nb = 0; nb < kCols / 8; nb += 2) {
        const float give0 = odd ? dq[nb][2 * r] : dq[nb + 1][2 * r];
        const float give1 = odd ? dq[nb][2 * r + 1] : dq[nb + 1][2 * r + 1];
        const float got0 = __shfl_xor_sync(0xffffffffu, give0, 1);
        const float got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
        const float4 v = odd ? make_float4(got0, got1, dq[nb + 1][2 * r], dq[nb + 1][2 * r + 1])
                             : make_float4(dq[nb][2 * r], dq[nb][2 * r + 1], got0, got1);
#if defined(__CUDA_ARCH__)
        detail::red_add_v4(at + nb * 8, v, q < p.tq && lane_col + nb * 8 < p.d);
#endif
      }
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    backward_kernel(const __grid_constant__ typename Kernel::Params params) {
  extern __shared__ __align__(1024) unsigned char smem[];
  auto& shared = *reinterpret_cast<typename Kernel::SharedStorage*>(smem);
  const int warp_group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    shared.kv_full.init(1);
    shared.kv_empty.init(Kernel::kConsumers * 128);
    shared.work.init(Kernel::kConsumers * 128 + (Kernel::kDqWriter ? Kernel::kConsumers * 32 : 0),
                     Kernel::kClusterSize);
    if constexpr (Kernel::kCluster) {
      for (auto& barrier : shared.part_full) barrier.init(1);
      shared.peer_free.init(Kernel::kConsumers * 4 * Kernel::kParts);
    }
    if constexpr (Kernel::kDqWriter)
      for (int c = 0; c < Kernel::kConsumers; ++c)
        for (int b = 0; b < Kernel::kDqBuffers; ++b) {
          shared.dq_full[c][b].init(128);
          shared.dq_empty[c][b].init(1);
        }
    if constexpr (Kernel::kDqWhole)
      for (int b = 0; b < Kernel::kDsBuffers; ++b) {
        shared.ds_full[b].init(Kernel::kConsumers * 128);
        shared.ds_empty[b].init(128);
      }
  }
  auto pipeline = [&] {
    if constexpr (Kernel::kCluster)
      return typename Kernel::Pipeline(shared.pipeline, Kernel::kStageBytes, Kernel::kConsumers * 128);
    else
      return make_tma_pipeline<typename Kernel::Pipeline>(shared.pipeline, Kernel::kStageBytes,
                                                          Kernel::kConsumers * 128, warp_group == 0);
  }();
  cutlass::arch::fence_barrier_init();
  if constexpr (Kernel::kCluster)
    cute::cluster_sync();  // the other block's barriers exist before the first store into its shared memory
  else
    __syncthreads();

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Kernel::kProducerRegisters>();
    if (threadIdx.x == 0) Kernel::produce(params, shared, pipeline);
    if constexpr (Kernel::kDqWriter) {
      const int warp = threadIdx.x / 32;
      if (warp >= 1 && warp <= Kernel::kConsumers) Kernel::write_dq(params, shared, warp - 1);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Kernel::kConsumerRegisters>();
    Kernel::consume(params, shared, pipeline);
  }
  // No block leaves while the other may still arrive on its barriers or store into its shared memory.
  if constexpr (Kernel::kCluster) {
    __syncwarp();
    cute::cluster_sync();
  }
}

template <class T, int kTile, bool kSoftcap, bool kDq, bool kCat = false>
void launch_backward_variant(const BwdParams& p, int sm_margin, cudaStream_t stream) {
  using Kernel = BackwardKernel<T, kTile, kSoftcap, kDq, kCat>;
  const int num_work = p.list.num_tiles * p.hkv;
  if (num_work == 0) return;
  launch_persistent<Kernel>(backward_kernel<Kernel>, Kernel::make_params(p, num_work), num_work, sm_margin,
                            p.work_counter, stream, "sm90 backward_kernel", Kernel::kClusterSize);
}

template <class T, int kTile>
void launch_backward_kernel(const BwdParams& p, int sm_margin, cudaStream_t stream) {
  const bool dq = p.dq_accum != nullptr;
  if (p.cat_group > 1) {
    // The planner concatenates heads only where this kernel adds dQ (tiles 64 and 128).
    if constexpr (BackwardKernel<T, kTile, false, true>::kDqWriter) {
      if (!dq) throw Error("cuda backward: concatenated heads need the dk/dv kernel to add dQ (BwdParams::dq_accum)");
      if (p.softcap > 0.0f) launch_backward_variant<T, kTile, true, true, true>(p, sm_margin, stream);
      else launch_backward_variant<T, kTile, false, true, true>(p, sm_margin, stream);
      return;
    } else {
      throw Error("cuda backward: concatenated heads at head-dim tile " + std::to_string(kTile) +
                  " (allowed: 64, 128)");
    }
  }
  if (p.softcap > 0.0f) {
    if (dq) launch_backward_variant<T, kTile, true, true>(p, sm_margin, stream);
    else launch_backward_variant<T, kTile, true, false>(p, sm_margin, stream);
  } else {
    if (dq) launch_backward_variant<T, kTile, false, true>(p, sm_margin, stream);
    else launch_backward_variant<T, kTile, false, false>(p, sm_margin, stream);
  }
}

}  // namespace magi::cuda::sm90
