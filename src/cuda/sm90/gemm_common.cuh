// Building blocks of the Hopper kernels (sm_90a) on CuTe: the element types, one warpgroup GEMM over all k-steps,
// an accumulator viewed as the A operand of the next GEMM, and the persistent schedule (its launch and its two-slot
// work ring).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>
#include <algorithm>

#include "cuda/kernel_common.cuh"
#include "cuda/small_kernels.hpp"  // check_launch
#include "magi/error.hpp"

namespace magi::cuda::sm90 {

using namespace cute;

template <class T>
struct CuteElement;
template <>
struct CuteElement<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CuteElement<__half> {
  using type = cutlass::half_t;
};

// The A-operand view of a 16-bit copy of an accumulator: ((2, 2, N / 8), M, N) -> ((2, 2, 2), M, N / 16), the
// k-steps of P V along the accumulator's columns (the register order of the two layouts is the same).
template <class Layout>
__device__ __forceinline__ constexpr auto accumulator_as_a_operand(Layout acc) {
  auto split = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(split), get<1>(split), get<2, 0>(split)), get<1>(acc),
                     coalesce(make_layout(get<2, 1>(split), get<2>(acc))));
}

// p, opaque to the optimiser (so that what is computed from it is not hoisted out of a loop).
template <class P>
__device__ __forceinline__ P* launder(P* p) {
  asm volatile("" : "+l"(p));
  return p;
}

// Issues one warpgroup GEMM C (+)= A B over all k-steps (kZero: C = A B) and commits it; the caller waits.
template <bool kZero, bool kRegistersA, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void issue_gemm(Mma& mma, TA& a, const TB& b, TC& c) {
  if constexpr (kRegistersA) warpgroup_fence_operand(a);
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZero) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kRegistersA) warpgroup_fence_operand(a);
}

// A TMA pipeline of one CTA: `producer` says which side this thread is on; thread 0 leads. In a cluster of
// kClusterSize blocks, CUTLASS's pipeline sends each consumer release to every block of the cluster's row (it assumes
// multicast loads), so it is told the cluster's shape: a stage is then refilled once the consumers of every block
// have released it (the blocks walk the same items).
template <class Pipeline, int kClusterSize = 1>
__device__ __forceinline__ Pipeline make_tma_pipeline(typename Pipeline::SharedStorage& storage, int stage_bytes,
                                                      int consumer_threads, bool producer) {
  typename Pipeline::Params params;
  params.transaction_bytes = stage_bytes;
  params.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = consumer_threads;
  return Pipeline(storage, params, Shape<Int<kClusterSize>, _1, _1>{});
}

// A TMA pipeline of one block that a cluster's other blocks never touch (CUTLASS's, given the cluster's shape, counts
// every block's consumers in each block's empty barriers): full[s] takes the producer's arrival and the stage's bytes,
// empty[s] every consumer thread's release. The interface of CUTLASS's PipelineTmaAsync, as far as the kernels use it.
template <int kStages>
struct BlockTmaPipeline {
  static constexpr int Stages = kStages;
  using PipelineState = cutlass::PipelineState<kStages>;
  struct SharedStorage {
    cutlass::arch::ClusterTransactionBarrier full[kStages];
    cutlass::arch::ClusterBarrier empty[kStages];
  };
  SharedStorage* storage;
  uint32_t stage_bytes;

  // Thread 0 initialises the barriers; the caller fences and syncs before their first use.
  __device__ BlockTmaPipeline(SharedStorage& shared, uint32_t bytes, int consumer_threads)
      : storage(&shared), stage_bytes(bytes) {
    if (threadIdx.x == 0)
      for (int s = 0; s < kStages; ++s) {
        shared.full[s].init(1);
        shared.empty[s].init(consumer_threads);
      }
  }
  __device__ void producer_acquire(const PipelineState& state) {
    storage->empty[state.index()].wait(state.phase());
    storage->full[state.index()].arrive_and_expect_tx(stage_bytes);
  }
  __device__ uint64_t* producer_get_barrier(const PipelineState& state) {
    return reinterpret_cast<uint64_t*>(&storage->full[state.index()]);
  }
  __device__ void consumer_wait(const PipelineState& state) { storage->full[state.index()].wait(state.phase()); }
  __device__ void consumer_release(const PipelineState& state) { storage->empty[state.index()].arrive(); }
};

// The concatenated-heads view (BwdParams::cat_group) of a [tokens, hq, d] tensor: a TMA map over (d columns, the
// group's heads, tokens, kv heads), boxes of box_cols columns x the group x rows / group tokens x 1 with the 128-byte
// swizzle, so that one box fills a swizzle-atom column of `rows` rows in the order row = token * group + head. (CuTe's
// make_tma_copy takes the box's shape at compile time; the group is known at run time.)
template <class Element>
TmaDescriptor make_cat_tensor_map(const Element* base, int d, int group, int tokens, int kv_heads, int box_cols,
                                  int rows) {
  static_assert(sizeof(Element) == 2 || sizeof(Element) == 4, "16-bit inputs or the fp32 dQ accumulator");
  constexpr bool kBf16 = std::is_same_v<Element, cutlass::bfloat16_t>;
  constexpr CUtensorMapDataType kType = sizeof(Element) == 4 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                        : kBf16              ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                             : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const auto e = static_cast<cuuint64_t>(sizeof(Element));
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(group),
                              static_cast<cuuint64_t>(tokens > 1 ? tokens : 1), static_cast<cuuint64_t>(kv_heads)};
  const cuuint64_t strides[3] = {d * e, dims[1] * dims[3] * d * e, dims[1] * d * e};  // bytes, dims 1 .. 3
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(group),
                             static_cast<cuuint32_t>(rows / group), 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  TmaDescriptor map{};
  const CUresult result = cutlass::call_cuTensorMapEncodeTiled(
      &map, kType, 4, const_cast<Element*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS)
    throw Error("cuda backward: the concatenated-heads TMA map failed (CUresult " + std::to_string(result) + ")");
  return map;
}

// Launches a persistent Hopper kernel: one block per SM that the margin leaves (at least one; `blocks_per_sm` where
// that many fit an SM: the margin then leaves that share of the SMs' room free), at most one per work,
// after zeroing the launch's work counter (claim_work_index). Clusters of `cluster` blocks (each cluster one work at a
// time): as many as fit the SMs the margin leaves, at least one.
template <class Kernel, class KernelFunction>
void launch_persistent(KernelFunction kernel, const typename Kernel::Params& params, int num_work, int sm_margin,
                       int32_t* work_counter, cudaStream_t stream, const char* name, int cluster = 1,
                       int blocks_per_sm = 1) {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
  // Blocks an SM can hold at once (every sm_90 device has the same SM; asked once, not in every launch).
  static const int per_sm = [&] {
    int resident = 0;
    if (blocks_per_sm > 1 &&
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, Kernel::kThreads, Kernel::kSmemBytes) !=
            cudaSuccess)
      resident = 1;
    return std::clamp(resident, 1, blocks_per_sm);
  }();
  const int usable = (sms - sm_margin > 1 ? sms - sm_margin : 1) * per_sm;
  cudaMemsetAsync(work_counter, 0, sizeof(int32_t), stream);
  if (cluster == 1) {
    kernel<<<usable < num_work ? usable : num_work, Kernel::kThreads, Kernel::kSmemBytes, stream>>>(params);
    detail::check_launch(name);
    return;
  }
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = cluster;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  config.blockDim = dim3(Kernel::kThreads);
  config.dynamicSmemBytes = Kernel::kSmemBytes;
  config.stream = stream;
  config.gridDim = dim3(usable / cluster * cluster);
  int active = 0;  // clusters resident at once (a GPC's SMs may not all pair up)
  if (cudaOccupancyMaxActiveClusters(&active, kernel, &config) != cudaSuccess) active = 0;
  int clusters = usable / cluster;
  if (active > 0 && active < clusters) clusters = active;
  if (clusters > num_work) clusters = num_work;
  if (clusters < 1) clusters = 1;
  config.gridDim = dim3(clusters * cluster);
  cudaLaunchKernelEx(&config, kernel, params);
  detail::check_launch(name);
}

// Cluster barriers whose arrivals come from the other block: a release at cluster scope on the arriving side (what
// the arriving threads read or wrote before is done) and an acquire at cluster scope on the waiting side.
__device__ __forceinline__ void arrive_cluster_barrier(cutlass::arch::ClusterBarrier& barrier, uint32_t block_rank) {
  const uint32_t remote = cute::set_block_rank(cute::cast_smem_ptr_to_uint(&barrier), block_rank);
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
// A relaxed arrival: for a hand-back whose only hazard is the other block's later writes over what this thread read,
// once those reads have completed (their values used, wgmma reads waited for). The release above makes the arriving
// thread wait for every memory operation it issued before (e.g. global reductions still in flight), once per arrival.
__device__ __forceinline__ void arrive_cluster_barrier_relaxed(cutlass::arch::ClusterBarrier& barrier,
                                                               uint32_t block_rank) {
  const uint32_t remote = cute::set_block_rank(cute::cast_smem_ptr_to_uint(&barrier), block_rank);
  asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
__device__ __forceinline__ void wait_cluster_barrier(cutlass::arch::ClusterBarrier& barrier, int phase) {
  const uint32_t at = cute::cast_smem_ptr_to_uint(&barrier);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred ready;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 ready, [%1], %2;\n"
        "selp.u32 %0, 1, 0, ready;\n}"
        : "=r"(done)
        : "r"(at), "r"(phase)
        : "memory");
  } while (done == 0);
}

// A published work: its index and, for a work of the launch, its (tile, head) and the tile's items (count 0
// past the last work). The producer computes them anyway; the consumers read them from shared memory instead of
// computing work_coords and loading the tile when they start the work.
struct PublishedWork {
  int linear;
  detail::WorkCoords at;
  detail::TileInfo info;
};

// Works in pairs for a cluster of two blocks (FwdParams::pairs): none, pairs of tiles (the list's tiles 2i and
// 2i + 1), or pairs of q heads (2j and 2j + 1 of each tile).
enum class Pairs : int { None, Tiles, Heads };
// The coordinates of work `linear` (which counts pairs) for block `rank` of its cluster.
__device__ __forceinline__ detail::WorkCoords pair_work_coords(int linear, int heads, detail::DeviceList list,
                                                               Pairs pairs, int rank) {
  if (pairs == Pairs::Heads) {
    list.heads_per_pass /= 2;
    detail::WorkCoords at = detail::work_coords(linear, heads / 2, list);
    at.head = 2 * at.head + rank;
    return at;
  }
  list.num_tiles /= 2;
  list.heavy_tiles /= 2;
  detail::WorkCoords at = detail::work_coords(linear, heads, list);
  at.tile_index = 2 * at.tile_index + rank;
  return at;
}

// The persistent schedule of both families (first_work_index, claim_work_index), fed by the producer: it claims
// the work indices and hands each to the consumers through a two-slot ring in shared memory. An index past the
// last work ends the block. In a cluster the first block's producer claims for all and hands each index to the
// other blocks' producers through a two-slot mailbox in each one's shared memory.
struct WorkRing {
  // CUTLASS's barrier asm has no memory clobber: the slot's loads and stores must stay between the waits and arrives.
  static __device__ __forceinline__ void keep_order() { asm volatile("" ::: "memory"); }

  PublishedWork slot[2];
  cutlass::arch::ClusterBarrier full[2], empty[2];
  int peer_slot[2];  // the mailbox (the cluster's other blocks)
  cutlass::arch::ClusterTransactionBarrier peer_full[2];
  cutlass::arch::ClusterBarrier peer_empty[2];  // (the first block: every other block has read slot s)

  __device__ void init(int consumer_threads, int cluster_blocks = 2) {
    for (int s = 0; s < 2; ++s) {
      full[s].init(1);
      empty[s].init(consumer_threads);
      peer_full[s].init(1);
      peer_empty[s].init(cluster_blocks - 1);
    }
  }
  // Producer: the n-th work of this block (n = 0, 1, ...), published for the consumers; works of `list` over
  // `heads` heads (work_coords), num_work of them.
  __device__ PublishedWork publish(int n, int32_t* counter, const detail::DeviceList& list, int heads, int num_work) {
    return publish_index(
        n, [&] { return n == 0 ? detail::first_work_index() : detail::claim_work_index(counter); }, list, heads,
        num_work);
  }
  // Producer of a block in a cluster: the n-th work of its cluster, the same in every block (the first block claims
  // it: cluster c starts with work c, then takes the counter's next index plus the number of clusters).
  // `pairs`: the blocks take a pair of works (FwdParams::pairs), each its own of the pair.
  template <int kClusterBlocks = 2>
  __device__ PublishedWork publish_in_cluster(int n, int32_t* counter, const detail::DeviceList& list, int heads,
                                              int num_work, Pairs pairs = Pairs::None) {
    return publish_index(
        n,
        [&] {
          const int s = n & 1;
          if (cute::block_rank_in_cluster() == 0) {
            if (n >= 2) wait_cluster_barrier(peer_empty[s], ((n >> 1) - 1) & 1);
            const int clusters = static_cast<int>(cute::cluster_grid_dims().x);
            const int linear =
                n == 0 ? static_cast<int>(cute::cluster_id_in_grid().x) : atomicAdd(counter, 1) + clusters;
            CUTE_UNROLL
            for (int block = 1; block < kClusterBlocks; ++block) {
              const uint32_t to = cute::set_block_rank(cute::cast_smem_ptr_to_uint(&peer_slot[s]), block);
              const uint32_t to_full = cute::set_block_rank(cute::cast_smem_ptr_to_uint(&peer_full[s]), block);
              asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(to),
                           "r"(linear), "r"(to_full)
                           : "memory");
            }
            return linear;
          }
          peer_full[s].arrive_and_expect_tx(sizeof(int));
          peer_full[s].wait((n >> 1) & 1);
          const int linear = *static_cast<volatile int*>(&peer_slot[s]);
          arrive_cluster_barrier(peer_empty[s], 0);
          return linear;
        },
        list, heads, num_work, pairs);
  }
  // Once the consumers have released the work two before: index() is the n-th work.
  template <class Index>
  __device__ __forceinline__ PublishedWork publish_index(int n, Index&& index, const detail::DeviceList& list, int heads,
                                                         int num_work, Pairs pairs = Pairs::None) {
    const int s = n & 1;
    if (n >= 2) empty[s].wait(((n >> 1) - 1) & 1);
    keep_order();
    PublishedWork work{index(), {0, 0}, {0, 0, 0, 0}};
    if (work.linear < num_work) {
      work.at = pairs != Pairs::None
                    ? pair_work_coords(work.linear, heads, list, pairs, static_cast<int>(cute::block_rank_in_cluster()))
                    : detail::work_coords(work.linear, heads, list);
      work.info = list.tiles[work.at.tile_index];
    }
    slot[s] = work;
    keep_order();
    full[s].arrive();
    return work;
  }
  // Consumers: wait for the n-th work of this block (its index), read it (once waited for), release it (the
  // producer may then publish work n + 2 into its slot); take = all three.
  __device__ __forceinline__ int wait(int n) {
    full[n & 1].wait((n >> 1) & 1);
    keep_order();
    return slot[n & 1].linear;
  }
  __device__ __forceinline__ const PublishedWork& read(int n) const { return slot[n & 1]; }
  __device__ __forceinline__ void release(int n) {
    keep_order();
    empty[n & 1].arrive();
  }
  __device__ __forceinline__ PublishedWork take(int n) {
    wait(n);
    const PublishedWork work = slot[n & 1];
    release(n);
    return work;
  }
};

}  // namespace magi::cuda::sm90
