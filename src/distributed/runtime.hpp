// One planned distributed-attention problem: dispatch + comm plan for every rank, resolved config, and the
// communicator. Immutable once built; cached in the runtime LRU (runtime.cpp).
#pragma once

#include <initializer_list>

#include <cstdint>
#include <memory>
#include <mutex>

#include "distributed/comm_plan.hpp"
#include "distributed/dispatch.hpp"
#include "distributed/qo_plan.hpp"
#include "magi/comm.hpp"
#include "magi/dist.hpp"

namespace magi::dist {

namespace gpu {
struct State;  // device streams, events and staging buffers (gpu_runtime.cpp)
}

// The plan of kv heads [kv_head_begin, kv_head_end) (and their q heads): k/v stages and the q/out route.
struct ClassPlan {
  int32_t kv_head_begin = 0, kv_head_end = 0;
  CommPlan plan;
  QoPlan qo;
};

// Config and environment resolved once, when the runtime is keyed (so the key reflects them).
struct RuntimeSwitches {
  bool backward_high_precision = false;  // MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE
  DsinkReduceOp dsink_op = DsinkReduceOp::None;
  int32_t ranks_per_node = 0;            // hierarchical comm; 0 = flat
  bool forward_inplace_correct = true;   // MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT
  RouteOptions routes;                   // MAGI_ATTENTION_QO_COMM, FLATTEN_HEAD_GROUPS, *_HIGH_PRECISION_REDUCE
};

// The dtype in which partial results (out of the q/out route; dk, dv, and dq of that route) cross the wire: the
// input's, as in the reference system, unless high-precision reduce is on or the caller asked for results wider than
// the inputs (fp32 dk of bf16 inputs): then fp32 (fp64 for fp64 inputs), so that the distributed error stays within
// twice the single device's (SPEC section 5) instead of rounding every partial to the input's precision.
DType partial_wire_dtype(DType input, bool high_precision, std::initializer_list<DType> results);

class DistAttnRuntime {
 public:
  // `fixed`: the dispatch to keep (a new mask on dispatched tensors), else the solver's for this mask.
  DistAttnRuntime(const Mask& mask, const HeadShape& heads, std::shared_ptr<comm::Communicator> comm,
                  const DistConfig& config, const RuntimeSwitches& switches, const Dispatch* fixed = nullptr);

  void forward(const ForwardArgs& local, StreamHandle stream) const;
  void backward(const BackwardArgs& local, StreamHandle stream) const;

  int32_t rank() const { return rank_; }
  const Dispatch& dispatch() const { return dispatch_; }
  // The k/v plan of the first head class (of every head unless routes go beyond k/v).
  const CommPlan& plan() const { return classes_.front().plan; }
  const RankPlan& mine() const { return plan().ranks[static_cast<size_t>(rank_)]; }
  const std::vector<ClassPlan>& classes() const { return classes_; }
  const RouteOptions& route_options() const { return switches_.routes; }
  comm::Communicator& comm() const { return *comm_; }
  const std::shared_ptr<comm::Communicator>& comm_ptr() const { return comm_; }
  const HeadShape& heads() const { return heads_; }
  const DistConfig& config() const { return config_; }
  PlanSummary summary() const;
  bool backward_high_precision() const { return switches_.backward_high_precision; }
  DsinkReduceOp dsink_op() const { return switches_.dsink_op; }
  // true: each forward stage merges into the running out/lse in place (prev_out / prev_lse); false: each
  // stage writes a partial out/lse that the runtime merges afterwards.
  bool forward_inplace_correct() const { return switches_.forward_inplace_correct; }

 private:
  HeadShape heads_;
  std::shared_ptr<comm::Communicator> comm_;
  DistConfig config_;
  RuntimeSwitches switches_;
  int32_t rank_;
  int64_t planned_slices_;  // of the global mask this plan was made from
  Dispatch dispatch_;
  RouteSolution routes_;
  std::vector<ClassPlan> classes_;
  // Device tensors (NCCL engine): built on the first device call, then reused. Declared last: released
  // before the communicator.
  gpu::State& gpu_state() const;
  mutable std::mutex gpu_mutex_;
  mutable std::shared_ptr<gpu::State> gpu_state_;
};

}  // namespace magi::dist
