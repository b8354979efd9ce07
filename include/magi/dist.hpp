// Distributed (context parallel) attention, SPEC section 4.
//
// Every rank of a communicator holds a share of one long sequence. make_runtime_key plans once per
// (mask, shapes, communicator, config) (cached in an LRU of MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE
// entries) and checks that all ranks agree. Then:
//   dispatch(global) -> local shard, calc_attn(local q, k, v) -> local out/lse (equal to the matching rows
//   of the single-device result), calc_attn_backward -> local dq/dk/dv, undispatch(local) -> global.
// Local tensors use the thd layout of magi/attention.hpp with local_q_tokens / local_k_tokens rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "magi/attention.hpp"
#include "magi/comm.hpp"
#include "magi/mask.hpp"
#include "magi/tensor.hpp"

namespace magi::dist {

enum class DispatchAlgorithm : int32_t {
  Greedy,      // largest chunk first to the least loaded rank (the reference heuristic)
  GreedySwap,  // greedy, then local search on the most loaded rank: pairwise swaps, and an exact
               // re-split with another rank when the pair holds <= 16 chunks
  Locality,    // greedy_swap over runs of consecutive chunks: the longest runs whose largest rank area stays
               // within 2% of greedy_swap's, so documents stay on few ranks and fewer kv rows travel
};
std::string_view to_string(DispatchAlgorithm algorithm);

enum class DsinkReduceOp : int32_t { None, Sum, Avg };  // MAGI_ATTENTION_DSINK_ALL_REDUCE_OP

// The largest chunk_size make_runtime_key takes: a chunk longer than the sequence only pads every rank's share
// with zero rows (2^29 asked for 137 GB), so chunks are bounded by the longer sequence, or 16384 for short ones.
inline int64_t max_chunk_size(int64_t total_q, int64_t total_k) {
  return std::max({total_q, total_k, int64_t{16384}});
}

struct DistConfig {
  int32_t chunk_size = 512;
  int32_t overlap_degree = 1;  // remote stages; 0 = one stage fetched before any compute (no overlap)
  DispatchAlgorithm algorithm = DispatchAlgorithm::Locality;
  AttentionOptions attention;  // per-stage kernel options (scale, softcap, sink layout, backend, threads)
  // Unset = environment (MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE, MAGI_ATTENTION_DSINK_ALL_REDUCE_OP).
  // fp32 partial dk/dv on the wire instead of the input dtype (always so where dq, dk or dv is fp32 and the inputs
  // 16-bit: the distributed error then stays within twice the single device's, SPEC section 5).
  std::optional<bool> backward_high_precision_reduce;
  std::optional<DsinkReduceOp> dsink_reduce_op;        // across ranks, for the shared (sh) sink only
  double comm_timeout_seconds = 300.0;  // set on the communicator: a collective taking longer throws comm::CommError
  // Hierarchical comm (unset = MAGI_ATTENTION_HIERARCHICAL_COMM): the cp group as nodes x ranks_per_node
  // consecutive ranks. Remote kv crosses to a node once (to the rank with the owner's intra-node index)
  // and fans out there; partial dk/dv are summed there before crossing back.
  std::optional<bool> hierarchical_comm;
  int32_t ranks_per_node = 0;  // 0 = Communicator::ranks_per_node()
  // Query/output routes (unset = MAGI_ATTENTION_QO_COMM): where it moves fewer bytes, a rank hands the attention
  // of its q rows against another rank's kv to that rank (q travels, partial out / lse come back; backward: q,
  // out, dout, lse travel, partial dq comes back) instead of fetching the kv, while the busiest rank's compute grows
  // by 2% at most. Host and device tensors.
  std::optional<bool> qo_comm;
  // Unset = MAGI_ATTENTION_FLATTEN_HEAD_GROUPS: routes are chosen per (rank pair, kv head group), and head-group
  // units of the busiest rank's work move to the kv owner while that lowers the busiest rank's compute.
  std::optional<bool> flatten_head_groups;
  // Unset = MAGI_ATTENTION_FORWARD_HIGH_PRECISION_REDUCE: the q/out route's partial out in fp32 on the wire (always
  // so where out is fp32 and the inputs 16-bit).
  std::optional<bool> forward_high_precision_reduce;
};

struct HeadShape {
  int32_t heads_q = 1;
  int32_t heads_kv = 1;
  int32_t head_dim = 64;
};

// Per-rank balance and communication of a plan, for summaries (`magi-attn dist-run`) and benchmarks.
struct PlanSummary {
  int32_t cp = 1;
  int32_t chunk_size = 0;
  int32_t local_q_tokens = 0, local_k_tokens = 0;
  int64_t planned_slices = 0;           // of the global mask as planned (fewer with MAGI_ATTENTION_AUTO_RANGE_MERGE)
  std::vector<int64_t> rank_area;       // kept cells computed by each rank
  int64_t area_lower_bound = 0;         // max(ceil(total / cp), largest chunk)
  int64_t area_count_aware_bound = 0;   // tighter: also uses that every rank holds the same number of chunks
  std::vector<int64_t> fetched_kv_rows; // [rank] remote kv rows each rank fetches (k and v each)
  int64_t ring_kv_rows = 0;             // what ring attention moves: cp * (cp - 1) * local_k_tokens
  int64_t kv_row_elements = 0;          // heads_kv * head_dim: one row of k (or v); bytes = this * dtype size
  int32_t ranks_per_node = 0;           // hierarchical comm: ranks per node (0 = flat)
  int64_t inter_node_kv_rows = 0;       // hierarchical comm: kv rows that cross nodes (each once per node)
  // Routes (qo_comm / flatten_head_groups): units of (rank pair x kv head group, or rank pair when not
  // flattened) that take the q/out route, of route_units per pair; bytes moved by this plan and by the kv-only
  // one, forward and forward + backward, as the planner estimates them for 2-byte inputs.
  bool qo_comm = false, flatten_head_groups = false;
  int64_t qo_units = 0;
  int32_t route_units = 1;
  int64_t forward_bytes = 0, bytes = 0, kv_only_forward_bytes = 0, kv_only_bytes = 0;
  double imbalance() const;             // max rank area / mean rank area (1 = perfect)
  std::string to_text() const;
};

class DistAttnRuntime;  // the plan and its caches (src/distributed)

class RuntimeKey {
 public:
  RuntimeKey() = default;
  explicit RuntimeKey(std::shared_ptr<const DistAttnRuntime> runtime) : runtime_(std::move(runtime)) {}
  const DistAttnRuntime& runtime() const;
  int32_t local_q_tokens() const;
  int32_t local_k_tokens() const;
  PlanSummary summary() const;

 private:
  std::shared_ptr<const DistAttnRuntime> runtime_;
};

// Collective: every rank calls it with the same mask, shapes and config, else InvalidArgument on every rank.
// With MAGI_ATTENTION_AUTO_RANGE_MERGE=1 (read here) the plan is made from merge_slices(mask), except in
// deterministic mode (config.attention.deterministic, else MAGI_ATTENTION_DETERMINISTIC_MODE), where the mask stays
// as given and only the single-device calls merge under their bit-keeping rule.
RuntimeKey make_runtime_key(const Mask& mask, const HeadShape& heads, std::shared_ptr<comm::Communicator> comm,
                            const DistConfig& config = {});
// Collective: a key for another mask over the same sequences (mask.total_q / total_k as `dispatched`'s) that keeps
// `dispatched`'s partition, so tensors dispatched with it serve layers whose masks differ: the same heads, comm
// and config, its own comm plan. InvalidArgument on every rank if the totals differ or the ranks disagree.
RuntimeKey make_runtime_key_for_new_mask(const RuntimeKey& dispatched, const Mask& mask);

enum class Axis : int32_t { Q, K };  // q/out/lse/dout/ssh-sink rows, or k/v rows

// `stream` (every call below): for device tensors the caller's cudaStream_t; the call's work runs after what the
// stream holds and the stream's later work after the call (nullptr = the legacy default stream). Host tensors
// ignore it. The calls return once their results are complete.

// Copies this rank's rows of `global` [T, ...] (T = mask.total_q or total_k) into `local`
// [local tokens, ...]; padding rows become zero. Same dtype and trailing shape. Local, no communication.
void dispatch(const RuntimeKey& key, Axis axis, const TensorView& global, const TensorView& local,
              StreamHandle stream = nullptr);
// Collective inverse: every rank receives the whole global tensor (padding dropped).
void undispatch(const RuntimeKey& key, Axis axis, const TensorView& local, const TensorView& global,
                StreamHandle stream = nullptr);
// Global token index of each local row (>= the real length for padding), e.g. for RoPE.
std::vector<int32_t> position_ids(const RuntimeKey& key, Axis axis = Axis::Q);

// Collective: torch.roll of a dispatched tensor along the global sequence without undispatching it:
// out[global g] = local[global (g - shift) mod T] (T = the axis's real length), e.g. labels for multi-token
// prediction (shift -1, -2, ...); padding rows become zero. out may be local. The gradient of a roll by `shift`
// is the roll of the output gradient by -shift. Host tensors (device tensors: NotAvailable for now).
void roll(const RuntimeKey& key, Axis axis, const TensorView& local, const TensorView& out, int64_t shift,
          StreamHandle stream = nullptr);

// Collective. Local tensors: q [Lq, Hq, D], k/v [Lk, Hkv, D], out [Lq, Hq, D], lse [Lq, Hq],
// sink sh [S, Hq] (the same on every rank) or ssh [Lq, S, Hq] (dispatched), max_logits [Hq] (global max).
// Dtypes as magi::forward's; no prev_out / prev_lse (the runtime merges the key parts itself); outputs share no
// memory with each other or with an input. Checked on every rank before any communication.
void calc_attn(const RuntimeKey& key, const ForwardArgs& local, StreamHandle stream = nullptr);
// Collective. out/lse as returned by calc_attn; dq/dk/dv local (overwritten: no accumulate_dq); dsink partial per
// rank unless reduced.
void calc_attn_backward(const RuntimeKey& key, const BackwardArgs& local, StreamHandle stream = nullptr);

// The LRU of runtimes (tests, memory control): all of them, or those over one communicator.
size_t runtime_cache_size();
void clear_runtime_cache();
void clear_runtime_cache(const comm::Communicator& comm);

}  // namespace magi::dist
