// Distributed attention on top of the single-device API: each stage is one magi::forward / magi::backward
// call of the local q rows against a kv buffer (own rows, or rows fetched by group-cast), with the stage's
// remapped mask. Partial results are combined in a fixed order (host stage, then remote stages in order,
// sources in rank order), so results are bitwise reproducible. Forward stages merge into the running result
// inside the call (prev_out / prev_lse) or, with MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT=0, write
// partials that merge_into folds in afterwards.
#include "distributed/runtime.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <list>
#include <mutex>
#include <optional>
#include <sstream>

#include "comm/elements.hpp"
#include "comm/group_collective.hpp"
#include "common/lru_cache.hpp"
#include "common/lse_merge.hpp"
#include "distributed/timeline.hpp"
#include "magi/env.hpp"

#if MAGI_ATTN_WITH_NCCL
#include "distributed/gpu_runtime.hpp"
#endif

namespace magi::dist {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Host buffer of one dtype with a view helper.
struct Buffer {
  DType dtype = DType::F32;
  std::vector<std::byte> bytes;

  Buffer(DType dt, int64_t elements) : dtype(dt), bytes(static_cast<size_t>(elements * dtype_size(dt))) {}
  TensorView view(std::initializer_list<int64_t> shape) { return TensorView(bytes.data(), dtype, shape); }
  double at(int64_t i) const { return comm::load_element(dtype, bytes.data(), i); }
};

// Partial results are kept at fp32 (fp64 for fp64 inputs): the kernels accumulate at that precision anyway.
DType partial_dtype(DType input) { return input == DType::F64 ? DType::F64 : DType::F32; }

void require_rows(const TensorView& t, const char* name, int64_t rows, int32_t ndim) {
  if (t.ndim != ndim || t.shape[0] != rows)
    throw InvalidArgument(std::string(name) + ": expected " + std::to_string(ndim) + " dims with " +
                          std::to_string(rows) + " local rows (the runtime key's local length), got " +
                          shape_string(t));
  if (t.device.type != DeviceType::CPU)
    throw InvalidArgument(std::string(name) + ": host communicators need host tensors (allowed: CPU)");
}

void store_all(const std::vector<double>& values, const TensorView& dst) {
  for (int64_t i = 0; i < static_cast<int64_t>(values.size()); ++i) comm::store_element(dst.dtype, dst.data, i, values[i]);
}

void add_all(const Buffer& part, std::vector<double>& accum) {
  for (int64_t i = 0; i < static_cast<int64_t>(accum.size()); ++i) accum[i] += part.at(i);
}

// The kv fetch of one stage: k and v travel as two group-casts. With hierarchical comm, hop 1 (across
// nodes, overlapped with compute) fills the relay buffers and wait() fans them out inside the node.
struct StageFetch {
  const DistAttnRuntime& rt;
  int32_t stage;
  int64_t row_bytes;
  Buffer k, v;              // the stage buffers: [buffer_rows, Hkv, D]
  Buffer relay_k, relay_v;  // hop-1 receive buffers (hierarchical only)
  std::optional<comm::GroupCast> k_cast, v_cast;
  double started_us = Timeline::now_us();

  StageFetch(const DistAttnRuntime& runtime, int32_t stage_index, const TensorView& k_local, const TensorView& v_local)
      : rt(runtime),
        stage(stage_index),
        row_bytes(int64_t{rt.heads().heads_kv} * rt.heads().head_dim * dtype_size(k_local.dtype)),
        k(k_local.dtype, rows_of(rt.mine().stages[stage].buffer_rows)),
        v(k_local.dtype, rows_of(rt.mine().stages[stage].buffer_rows)),
        relay_k(k_local.dtype, rt.plan().hierarchical() ? rows_of(hop1().total_recv_rows()) : 0),
        relay_v(k_local.dtype, rt.plan().hierarchical() ? rows_of(hop1().total_recv_rows()) : 0) {
    const bool relayed = rt.plan().hierarchical();
    k_cast.emplace(rt.comm(), hop1(), k_local.data, row_bytes, relayed ? relay_k.bytes.data() : k.bytes.data());
    v_cast.emplace(rt.comm(), hop1(), v_local.data, row_bytes, relayed ? relay_v.bytes.data() : v.bytes.data());
  }
  void wait() {
    k_cast->wait();
    v_cast->wait();
    if (!rt.plan().hierarchical()) return;
    const auto& hop2 = rt.plan().relay_routes[rt.rank()][stage];
    k_cast.emplace(rt.comm(), hop2, relay_k.bytes.data(), row_bytes, k.bytes.data());
    v_cast.emplace(rt.comm(), hop2, relay_v.bytes.data(), row_bytes, v.bytes.data());
    k_cast->wait();
    v_cast->wait();
  }

 private:
  const comm::RowRoutes& hop1() const { return rt.plan().routes[rt.rank()][stage]; }
  int64_t rows_of(int64_t rows) const { return rows * rt.heads().heads_kv * rt.heads().head_dim; }
};

// Folds one stage's (out, lse) into the running result with the SPEC lse merge.
void merge_into(const Buffer& out, const Buffer& lse, int32_t head_dim, std::vector<double>& acc_out,
                std::vector<double>& acc_lse) {
  for (int64_t row_head = 0; row_head < static_cast<int64_t>(acc_lse.size()); ++row_head) {
    const auto w = merge_weights<double>(acc_lse[row_head], lse.at(row_head));
    double* o = acc_out.data() + row_head * head_dim;
    for (int32_t d = 0; d < head_dim; ++d) {
      const double part = out.at(row_head * head_dim + d);
      o[d] = (w.w1 == 0 ? 0.0 : w.w1 * o[d]) + (w.w2 == 0 ? 0.0 : w.w2 * part);
    }
    acc_lse[row_head] = w.lse;
  }
}

}  // namespace

std::string_view to_string(DispatchAlgorithm algorithm) {
  switch (algorithm) {
    case DispatchAlgorithm::Greedy: return "greedy";
    case DispatchAlgorithm::GreedySwap: return "greedy_swap";
    case DispatchAlgorithm::Locality: return "locality";
  }
  return "unknown";
}

DistAttnRuntime::DistAttnRuntime(const Mask& mask, const HeadShape& heads, std::shared_ptr<comm::Communicator> comm,
                                 const DistConfig& config, const RuntimeSwitches& switches, const Dispatch* fixed)
    : heads_(heads),
      comm_(std::move(comm)),
      config_(config),
      switches_(switches),
      rank_(comm_->rank()),
      dispatch_(fixed != nullptr ? redispatch(mask, *fixed)
                                 : make_dispatch(mask, comm_->size(), config.chunk_size, config.algorithm)),
      plan_(make_comm_plan(mask, dispatch_, config.overlap_degree, switches.ranks_per_node)) {}

PlanSummary DistAttnRuntime::summary() const {
  PlanSummary s;
  s.cp = dispatch_.q.cp();
  s.chunk_size = dispatch_.q.chunk_size;
  s.local_q_tokens = dispatch_.q.local_tokens();
  s.local_k_tokens = dispatch_.k.local_tokens();
  s.rank_area = dispatch_.rank_area;
  s.area_lower_bound = dispatch_.lower_bound();
  s.area_count_aware_bound = dispatch_.count_aware_lower_bound();
  for (const auto& rp : plan_.ranks) s.fetched_kv_rows.push_back(rp.fetched_rows());
  s.ring_kv_rows = int64_t{s.cp} * (s.cp - 1) * s.local_k_tokens;
  s.kv_row_elements = int64_t{heads_.heads_kv} * heads_.head_dim;
  if (plan_.hierarchical()) {
    s.ranks_per_node = switches_.ranks_per_node;
    for (int32_t src = 0; src < s.cp; ++src)
      for (const auto& stage_routes : plan_.routes[src])
        for (int32_t dst = 0; dst < s.cp; ++dst)
          if (src / s.ranks_per_node != dst / s.ranks_per_node)
            s.inter_node_kv_rows += static_cast<int64_t>(stage_routes.send_rows[dst].size());
  }
  return s;
}

#if MAGI_ATTN_WITH_NCCL
gpu::State& DistAttnRuntime::gpu_state() const {
  std::lock_guard lock(gpu_mutex_);
  if (!gpu_state_) gpu_state_ = gpu::make_state(*this);
  return *gpu_state_;
}
#endif

namespace {
// Device tensors go to the NCCL path (gpu_runtime.cpp) when it is built.
bool on_device(const TensorView& q) {
  if (q.device.type != DeviceType::CUDA) return false;
#if !MAGI_ATTN_WITH_NCCL
  throw NotAvailable("q: CUDA tensors given, but this build has no NCCL engine for distributed attention "
                     "(allowed: host tensors with a host communicator)");
#endif
  return true;
}
}  // namespace

void DistAttnRuntime::forward(const ForwardArgs& a, [[maybe_unused]] StreamHandle stream) const {
  if (on_device(a.q)) {
#if MAGI_ATTN_WITH_NCCL
    gpu::forward(*this, gpu_state(), a, static_cast<cudaStream_t>(stream));
#endif
    return;
  }
  const int64_t lq = dispatch_.q.local_tokens(), lk = dispatch_.k.local_tokens();
  const int32_t hq = heads_.heads_q, hkv = heads_.heads_kv, d = heads_.head_dim;
  require_rows(a.q, "q", lq, 3);
  require_rows(a.k, "k", lk, 3);
  require_rows(a.v, "v", lk, 3);
  require_rows(a.out, "out", lq, 3);
  require_rows(a.lse, "lse", lq, 2);
  if (a.q.shape[1] != hq || a.q.shape[2] != d || a.k.shape[1] != hkv || a.k.shape[2] != d)
    throw InvalidArgument("q, k: heads and head dim must match the runtime key (Hq=" + std::to_string(hq) +
                          ", Hkv=" + std::to_string(hkv) + ", D=" + std::to_string(d) + "), got q " +
                          shape_string(a.q) + ", k " + shape_string(a.k));
  if (a.k.dtype != a.q.dtype || a.v.dtype != a.q.dtype)
    throw InvalidArgument("k, v: dtype must equal q's (" + std::string(to_string(a.q.dtype)) + ")");
  const DType part = partial_dtype(a.q.dtype);
  const bool want_max = a.max_logits.ndim != 0;
  const bool with_sink = config_.attention.sink_layout != SinkLayout::None;
  const bool in_place = forward_inplace_correct();
  const int32_t num_stages = plan_.num_stages();

  // The calls with work, by index (-1: the local stage, which also carries the sink).
  const auto has_work = [&](int32_t index) {
    return index < 0 ? !mine().host_mask.slices.empty() || with_sink : !mine().stages[index].mask.slices.empty();
  };
  int32_t last_call = -2;  // none
  for (int32_t index = -1; index < num_stages; ++index)
    if (has_work(index)) last_call = index;

  // In place: each call merges into one running result (fp32; fp64 for fp64 inputs) through prev_out /
  // prev_lse, and the last call writes the caller's out / lse. Out of place: each call writes the stage
  // buffers, which are then merged into fp64 accumulators.
  const int64_t out_elems = lq * hq * d, lse_elems = lq * hq;
  Buffer running_out(part, in_place ? out_elems : 0), running_lse(part, in_place ? lse_elems : 0);
  Buffer stage_out(part, in_place ? 0 : out_elems), stage_lse(part, in_place ? 0 : lse_elems);
  std::vector<double> acc_out(static_cast<size_t>(in_place ? 0 : out_elems), 0.0),
      acc_lse(static_cast<size_t>(in_place ? 0 : lse_elems), kNegInf);
  std::vector<float> max_logits(static_cast<size_t>(hq), -std::numeric_limits<float>::infinity());
  Buffer stage_max(DType::F32, hq);
  bool merged_any = false;

  Timeline* const timeline = Timeline::of(rank_);
  const auto compute = [&](int32_t index, const Mask& mask, const TensorView& k, const TensorView& v,
                           const std::string& what) {
    if (!has_work(index)) return;
    const double start = Timeline::now_us();
    ForwardArgs s;
    s.q = a.q;
    s.k = k;
    s.v = v;
    if (index < 0 && with_sink) s.sink = a.sink;
    if (in_place) {
      const bool last = index == last_call;
      s.out = last ? a.out : running_out.view({lq, hq, d});
      s.lse = last ? a.lse : running_lse.view({lq, hq});
      if (merged_any) {
        s.prev_out = running_out.view({lq, hq, d});
        s.prev_lse = running_lse.view({lq, hq});
      }
    } else {
      s.out = stage_out.view({lq, hq, d});
      s.lse = stage_lse.view({lq, hq});
    }
    if (want_max) s.max_logits = stage_max.view({hq});
    AttentionOptions options = config_.attention;
    if (index >= 0) options.sink_layout = SinkLayout::None;
    magi::forward(mask, s, options);
    if (!in_place) merge_into(stage_out, stage_lse, d, acc_out, acc_lse);
    merged_any = true;
    if (want_max)
      for (int32_t h = 0; h < hq; ++h) max_logits[h] = std::max(max_logits[h], static_cast<float>(stage_max.at(h)));
    if (timeline != nullptr)
      timeline->add("forward " + what + (in_place ? " attention" : " attention + merge"), "compute", start,
                    Timeline::now_us());
  };
  const auto fetched = [&](const StageFetch& f) {
    if (timeline != nullptr)
      timeline->add("forward stage " + std::to_string(f.stage) + " k/v exchange", "comm", f.started_us,
                    Timeline::now_us());
  };

  auto next = std::make_unique<StageFetch>(*this, 0, a.k, a.v);
  bool first_waited = false;
  if (config_.overlap_degree == 0) {
    next->wait();
    fetched(*next);
    first_waited = true;
  }
  compute(-1, mine().host_mask, a.k, a.v, "local");
  for (int32_t stage = 0; stage < num_stages; ++stage) {
    const auto current = std::move(next);
    current->wait();
    if (stage > 0 || !first_waited) fetched(*current);
    if (stage + 1 < num_stages) next = std::make_unique<StageFetch>(*this, stage + 1, a.k, a.v);
    const int64_t rows = mine().stages[stage].buffer_rows;
    compute(stage, mine().stages[stage].mask, current->k.view({rows, hkv, d}), current->v.view({rows, hkv, d}),
            "stage " + std::to_string(stage));
  }

  // In place, the last call already wrote out / lse; only a rank without any work fills them (out 0, lse -inf).
  if (!in_place || last_call == -2) {
    const double store_start = Timeline::now_us();
    if (in_place) {
      acc_out.assign(static_cast<size_t>(out_elems), 0.0);
      acc_lse.assign(static_cast<size_t>(lse_elems), kNegInf);
    }
    store_all(acc_out, a.out);
    store_all(acc_lse, a.lse);
    if (timeline != nullptr) timeline->add("forward store out / lse", "compute", store_start, Timeline::now_us());
  }
  if (want_max) {
    const double gather_start = Timeline::now_us();
    std::vector<float> all(static_cast<size_t>(hq) * comm_->size());
    comm_->allgather(max_logits.data(), hq * int64_t{4}, all.data());
    for (int32_t h = 0; h < hq; ++h) {
      float m = -std::numeric_limits<float>::infinity();
      for (int32_t r = 0; r < comm_->size(); ++r) m = std::max(m, all[static_cast<size_t>(r) * hq + h]);
      a.max_logits.as<float>()[h] = m;
    }
    if (timeline != nullptr) timeline->add("forward max_logits allgather", "comm", gather_start, Timeline::now_us());
  }
  if (timeline != nullptr) timeline->write();
}

void DistAttnRuntime::backward(const BackwardArgs& a, [[maybe_unused]] StreamHandle stream) const {
  if (on_device(a.q)) {
#if MAGI_ATTN_WITH_NCCL
    gpu::backward(*this, gpu_state(), a, static_cast<cudaStream_t>(stream));
#endif
    return;
  }
  const int64_t lq = dispatch_.q.local_tokens(), lk = dispatch_.k.local_tokens();
  const int32_t hq = heads_.heads_q, hkv = heads_.heads_kv, d = heads_.head_dim;
  for (auto [t, name] : {std::pair{&a.q, "q"}, {&a.out, "out"}, {&a.dout, "dout"}, {&a.dq, "dq"}})
    require_rows(*t, name, lq, 3);
  for (auto [t, name] : {std::pair{&a.k, "k"}, {&a.v, "v"}, {&a.dk, "dk"}, {&a.dv, "dv"}}) require_rows(*t, name, lk, 3);
  require_rows(a.lse, "lse", lq, 2);
  if (a.q.shape[1] != hq || a.q.shape[2] != d || a.k.shape[1] != hkv || a.k.shape[2] != d)
    throw InvalidArgument("q, k: heads and head dim must match the runtime key");
  if (a.k.dtype != a.q.dtype || a.v.dtype != a.q.dtype)
    throw InvalidArgument("k, v: dtype must equal q's (" + std::string(to_string(a.q.dtype)) + ")");
  const DType part = partial_dtype(a.q.dtype);
  // Partial dk/dv cross the wire at the input precision unless high-precision reduce is on.
  const DType wire = a.q.dtype == DType::F64 || backward_high_precision() ? part : a.q.dtype;
  const bool with_sink = config_.attention.sink_layout != SinkLayout::None;
  const int32_t num_stages = plan_.num_stages();
  const int64_t kv_row = int64_t{hkv} * d;

  std::vector<double> acc_dq(static_cast<size_t>(lq * hq * d), 0.0);
  std::vector<double> acc_dk(static_cast<size_t>(lk * kv_row), 0.0), acc_dv(acc_dk.size(), 0.0);
  Buffer stage_dq(part, lq * hq * d);

  Timeline* const timeline = Timeline::of(rank_);
  const auto span = [&](std::string name, std::string_view lane, double start) {
    if (timeline != nullptr) timeline->add(std::move(name), lane, start, Timeline::now_us());
  };
  // The first fetch runs while the host stage computes (after it, with overlap degree 0).
  auto next = std::make_unique<StageFetch>(*this, 0, a.k, a.v);
  bool first_waited = false;
  if (config_.overlap_degree == 0) {
    next->wait();
    span("backward stage 0 k/v exchange", "comm", next->started_us);
    first_waited = true;
  }
  // Host stage: own kv, and the sink (whose gradient is computed exactly once, here). First, where it hides the
  // first fetch; with MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE last, where it hides the last remote reduction instead.
  const bool hide_tail = env::get_bool("MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE") && num_stages > 0;
  const auto host_stage = [&] {
    const double host_start = Timeline::now_us();
    if (mine().host_mask.slices.empty() && !with_sink) return;
    Buffer host_dk(part, lk * kv_row), host_dv(part, lk * kv_row);
    BackwardArgs s = a;
    s.dq = stage_dq.view({lq, hq, d});
    s.dk = host_dk.view({lk, hkv, d});
    s.dv = host_dv.view({lk, hkv, d});
    magi::backward(mine().host_mask, s, config_.attention);
    add_all(stage_dq, acc_dq);
    add_all(host_dk, acc_dk);
    add_all(host_dv, acc_dv);
    span("backward local attention", "compute", host_start);
  };
  if (!hide_tail) host_stage();
  AttentionOptions remote_options = config_.attention;
  remote_options.sink_layout = SinkLayout::None;

  // Remote stages: the fetch of stage i + 1 and the reductions of earlier stages run while stage i
  // computes. Partial dk/dv go back along the fetch routes in reverse: flat, one hop to the owners;
  // hierarchical, first to the node's relay (which sums them), then across nodes to the owners.
  // Reductions finish in stage order, a fixed summation order on every owner.
  struct Reduce {
    Buffer dk, dv;
    std::optional<comm::GroupReduce> k_reduce, v_reduce;
    int32_t stage = 0;
    double started_us = 0;
  };
  const bool relayed = plan_.hierarchical();
  std::list<Reduce> first_hop, second_hop;  // second_hop: hierarchical only (relay -> owner)
  const auto start_reduce = [&](std::list<Reduce>& queue, const comm::RowRoutes& routes, Reduce r) {
    Reduce& started = queue.emplace_back(std::move(r));
    started.started_us = Timeline::now_us();
    started.k_reduce.emplace(*comm_, routes, started.dk.bytes.data(), kv_row * dtype_size(wire));
    started.v_reduce.emplace(*comm_, routes, started.dv.bytes.data(), kv_row * dtype_size(wire));
  };
  const auto finish_to_owner = [&] {
    std::list<Reduce>& queue = relayed ? second_hop : first_hop;
    queue.front().k_reduce->finish_sum(wire, kv_row, acc_dk.data());
    queue.front().v_reduce->finish_sum(wire, kv_row, acc_dv.data());
    span("backward stage " + std::to_string(queue.front().stage) + " dk/dv reduce", "comm", queue.front().started_us);
    queue.pop_front();
  };
  const auto finish_at_relay = [&] {  // sum the node's partials, then send them across nodes
    Reduce& done = first_hop.front();
    const comm::RowRoutes& hop1 = plan_.routes[rank_][done.stage];
    const int64_t rows = hop1.total_recv_rows();
    std::vector<double> sum_k(static_cast<size_t>(rows * kv_row), 0.0), sum_v(sum_k.size(), 0.0);
    done.k_reduce->finish_sum(wire, kv_row, sum_k.data());
    done.v_reduce->finish_sum(wire, kv_row, sum_v.data());
    span("backward stage " + std::to_string(done.stage) + " dk/dv reduce (to the node's relay)", "comm",
         done.started_us);
    Reduce relay{Buffer(wire, rows * kv_row), Buffer(wire, rows * kv_row), {}, {}, done.stage};
    store_all(sum_k, relay.dk.view({rows * kv_row}));
    store_all(sum_v, relay.dv.view({rows * kv_row}));
    first_hop.pop_front();
    start_reduce(second_hop, hop1, std::move(relay));
  };
  for (int32_t stage = 0; stage < num_stages; ++stage) {
    const auto current = std::move(next);
    current->wait();
    if (stage > 0 || !first_waited) span("backward stage " + std::to_string(stage) + " k/v exchange", "comm",
                                         current->started_us);
    if (stage + 1 < num_stages) next = std::make_unique<StageFetch>(*this, stage + 1, a.k, a.v);
    const StagePlan& sp = mine().stages[stage];
    const double stage_start = Timeline::now_us();
    const int64_t rows = sp.buffer_rows;
    Reduce partial{Buffer(wire, rows * kv_row), Buffer(wire, rows * kv_row), {}, {}, stage};
    if (!sp.mask.slices.empty()) {
      BackwardArgs s = a;
      s.k = current->k.view({rows, hkv, d});
      s.v = current->v.view({rows, hkv, d});
      s.sink = {};
      s.dsink = {};
      s.dq = stage_dq.view({lq, hq, d});
      s.dk = partial.dk.view({rows, hkv, d});
      s.dv = partial.dv.view({rows, hkv, d});
      magi::backward(sp.mask, s, remote_options);
      add_all(stage_dq, acc_dq);
      span("backward stage " + std::to_string(stage) + " attention", "compute", stage_start);
    }
    start_reduce(first_hop, relayed ? plan_.relay_routes[rank_][stage] : plan_.routes[rank_][stage], std::move(partial));
    if (relayed) {
      if (first_hop.size() > 1) finish_at_relay();
      if (second_hop.size() > 1) finish_to_owner();
    } else if (first_hop.size() > 1) {
      finish_to_owner();
    }
  }
  if (hide_tail) host_stage();
  if (relayed)
    while (!first_hop.empty()) finish_at_relay();
  while (!(relayed ? second_hop : first_hop).empty()) finish_to_owner();

  const double store_start = Timeline::now_us();
  store_all(acc_dq, a.dq);
  store_all(acc_dk, a.dk);
  store_all(acc_dv, a.dv);
  span("backward store dq / dk / dv", "compute", store_start);

  // A shared (sh) sink is replicated on every rank, so its gradient is partial per rank.
  if (with_sink && config_.attention.sink_layout == SinkLayout::SH && dsink_op() != DsinkReduceOp::None) {
    const int64_t n = a.dsink.numel();
    std::vector<float> all(static_cast<size_t>(n * comm_->size()));
    comm_->allgather(a.dsink.data, n * 4, all.data());
    for (int64_t i = 0; i < n; ++i) {
      double sum = 0;
      for (int32_t r = 0; r < comm_->size(); ++r) sum += all[static_cast<size_t>(r * n + i)];
      if (dsink_op() == DsinkReduceOp::Avg) sum /= comm_->size();
      a.dsink.as<float>()[i] = static_cast<float>(sum);
    }
  }
  if (timeline != nullptr) timeline->write();
}

// ---- public API ----

namespace {

uint64_t fnv1a(uint64_t hash, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 1099511628211ull;
  return hash;
}
template <class T>
uint64_t mix(uint64_t hash, const T& value) {
  return fnv1a(hash, &value, sizeof(value));
}

// Everything that must agree between ranks and that identifies a cached runtime.
struct RuntimeId {
  std::vector<Slice> slices;
  int32_t total_q = 0, total_k = 0;
  int32_t heads_q = 0, heads_kv = 0, head_dim = 0;
  int32_t chunk_size = 0, overlap_degree = 0;
  DispatchAlgorithm algorithm{};
  double softmax_scale = 0, softcap = 0;
  SinkLayout sink_layout{};
  Backend backend{};
  int32_t deterministic = -1;
  bool backward_high_precision = false;
  DsinkReduceOp dsink_op{};
  int32_t ranks_per_node = 0;  // hierarchical comm; 0 = flat
  bool forward_inplace_correct = true;  // local to each rank: ranks may differ, so not in the fingerprint
  const comm::Communicator* comm = nullptr;
  int32_t cp = 0;
  std::vector<int32_t> fixed_q_owner, fixed_k_owner;  // a kept dispatch's chunk owners; empty: the solver's

  bool operator==(const RuntimeId&) const = default;

  // The communicator pointer differs between ranks by nature: left out of the fingerprint.
  uint64_t fingerprint() const {
    uint64_t h = 1469598103934665603ull;
    for (const Slice& s : slices) h = mix(mix(mix(mix(mix(h, s.q.start), s.q.end), s.k.start), s.k.end), s.type);
    for (int32_t v : {total_q, total_k, heads_q, heads_kv, head_dim, chunk_size, overlap_degree, cp, deterministic,
                      ranks_per_node})
      h = mix(h, v);
    h = mix(mix(mix(mix(h, algorithm), softmax_scale), softcap), sink_layout);
    for (const auto* owners : {&fixed_q_owner, &fixed_k_owner}) {
      h = mix(h, static_cast<int64_t>(owners->size()));
      for (int32_t o : *owners) h = mix(h, o);
    }
    return mix(mix(mix(h, backend), backward_high_precision), dsink_op);
  }
};

using RuntimeCache = LruCache<RuntimeId, const DistAttnRuntime>;

RuntimeCache& runtime_cache() {
  static RuntimeCache cache(1000);  // capacity: MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE, set on each use
  return cache;
}

DsinkReduceOp env_dsink_op() {
  const std::string op = env::get_string("MAGI_ATTENTION_DSINK_ALL_REDUCE_OP");
  if (op == "sum") return DsinkReduceOp::Sum;
  if (op == "avg") return DsinkReduceOp::Avg;
  return DsinkReduceOp::None;
}

const Partition& partition(const RuntimeKey& key, Axis axis) {
  return axis == Axis::Q ? key.runtime().dispatch().q : key.runtime().dispatch().k;
}

int64_t row_bytes_of(const TensorView& t, const char* name, int64_t rows) {
  if (t.ndim < 1 || t.shape[0] != rows)
    throw InvalidArgument(std::string(name) + ": expected " + std::to_string(rows) + " rows, got " + shape_string(t));
  if (t.device.type != DeviceType::CPU) throw InvalidArgument(std::string(name) + ": host tensors only (allowed: CPU)");
  if (t.data == nullptr && t.numel() > 0) throw InvalidArgument(std::string(name) + ": null data pointer");
  return rows == 0 ? 0 : t.nbytes() / rows;
}

void require_same_row_shape(const TensorView& a, const TensorView& b) {
  bool same = a.ndim == b.ndim && a.dtype == b.dtype;
  for (int i = 1; same && i < a.ndim; ++i) same = a.shape[i] == b.shape[i];
  if (!same)
    throw InvalidArgument("global and local tensors must share dtype and trailing dims, got " + shape_string(a) +
                          " " + std::string(to_string(a.dtype)) + " and " + shape_string(b) + " " +
                          std::string(to_string(b.dtype)));
}

}  // namespace

const DistAttnRuntime& RuntimeKey::runtime() const {
  if (!runtime_) throw InvalidArgument("runtime key is empty (create it with magi::dist::make_runtime_key)");
  return *runtime_;
}
int32_t RuntimeKey::local_q_tokens() const { return runtime().dispatch().q.local_tokens(); }
int32_t RuntimeKey::local_k_tokens() const { return runtime().dispatch().k.local_tokens(); }
PlanSummary RuntimeKey::summary() const { return runtime().summary(); }

namespace {
RuntimeKey runtime_key(const Mask& mask, const HeadShape& heads, std::shared_ptr<comm::Communicator> comm,
                       const DistConfig& config, const Dispatch* fixed);
}  // namespace

RuntimeKey make_runtime_key(const Mask& mask, const HeadShape& heads, std::shared_ptr<comm::Communicator> comm,
                            const DistConfig& config) {
  env::ensure_validated();
  if (!comm) throw InvalidArgument("make_runtime_key: comm is null");
  if (config.chunk_size < 1) throw InvalidArgument("chunk_size must be >= 1, got " + std::to_string(config.chunk_size));
  if (config.overlap_degree < 0)
    throw InvalidArgument("overlap_degree must be >= 0 (0 = no overlap), got " + std::to_string(config.overlap_degree));
  if (heads.heads_q < 1 || heads.heads_kv < 1 || heads.heads_q % heads.heads_kv != 0 || heads.head_dim < 8 ||
      heads.head_dim % 8 != 0)
    throw InvalidArgument("heads: need Hq % Hkv == 0 and D a positive multiple of 8, got Hq=" +
                          std::to_string(heads.heads_q) + " Hkv=" + std::to_string(heads.heads_kv) +
                          " D=" + std::to_string(heads.head_dim));
#if !MAGI_ATTN_WITH_NCCL
  if (config.attention.backend == Backend::Cuda)
    throw NotAvailable("distributed attention with backend cuda needs the NCCL engine (allowed here: cpu, reference, auto)");
#endif
  return runtime_key(mask, heads, std::move(comm), config, nullptr);
}

RuntimeKey make_runtime_key_for_new_mask(const RuntimeKey& dispatched, const Mask& mask) {
  env::ensure_validated();
  const DistAttnRuntime& base = dispatched.runtime();
  return runtime_key(mask, base.heads(), base.comm_ptr(), base.config(), &base.dispatch());
}

namespace {

// The key of (mask, heads, comm, config) on the solver's dispatch or on `fixed`: collective (every rank checks
// that all agree), cached.
RuntimeKey runtime_key(const Mask& mask, const HeadShape& heads, std::shared_ptr<comm::Communicator> comm,
                       const DistConfig& config, const Dispatch* fixed) {
  comm->set_timeout(config.comm_timeout_seconds);
  validate_bounds(mask);

  RuntimeId id;
  id.slices = mask.slices;
  id.total_q = mask.total_q;
  id.total_k = mask.total_k;
  id.heads_q = heads.heads_q;
  id.heads_kv = heads.heads_kv;
  id.head_dim = heads.head_dim;
  id.chunk_size = config.chunk_size;
  id.overlap_degree = config.overlap_degree;
  id.algorithm = config.algorithm;
  id.softmax_scale = config.attention.softmax_scale.value_or(0.0);
  id.softcap = config.attention.softcap;
  id.sink_layout = config.attention.sink_layout;
  id.backend = config.attention.backend;
  id.deterministic = config.attention.deterministic ? int32_t{*config.attention.deterministic} : -1;
  id.backward_high_precision = config.backward_high_precision_reduce.value_or(
      env::get_bool("MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE"));
  id.dsink_op = config.dsink_reduce_op.value_or(env_dsink_op());
  id.forward_inplace_correct = env::get_bool("MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT");
  id.comm = comm.get();
  id.cp = comm->size();
  if (fixed != nullptr) {
    id.fixed_q_owner = fixed->q.owner;
    id.fixed_k_owner = fixed->k.owner;
  }
  if (config.hierarchical_comm.value_or(env::get_bool("MAGI_ATTENTION_HIERARCHICAL_COMM"))) {
    id.ranks_per_node = config.ranks_per_node > 0 ? config.ranks_per_node : comm->ranks_per_node();
  }
  // Always checked, hit or miss: ranks whose caches differ must still call the same collectives.
  comm::require_same_on_all_ranks(*comm, id.fingerprint(), "distributed attention mask/shape/config");
  // After the agreement check, so that every rank throws alike.
  if (id.ranks_per_node < 0 || (id.ranks_per_node == 0 && config.hierarchical_comm.value_or(
                                                              env::get_bool("MAGI_ATTENTION_HIERARCHICAL_COMM"))) ||
      (id.ranks_per_node > 0 && id.cp % id.ranks_per_node != 0))
    throw InvalidArgument("hierarchical comm needs nodes of equal size made of consecutive ranks; ranks_per_node " +
                          std::to_string(id.ranks_per_node) + " does not divide cp " + std::to_string(id.cp) +
                          " (set DistConfig::ranks_per_node)");

  runtime_cache().set_capacity(static_cast<size_t>(env::get_int("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE")));
  return RuntimeKey(runtime_cache().get(id, [&] {
    const double start = Timeline::now_us();
    validate(mask);
    const RuntimeSwitches switches{.backward_high_precision = id.backward_high_precision,
                                   .dsink_op = id.dsink_op,
                                   .ranks_per_node = id.ranks_per_node,
                                   .forward_inplace_correct = id.forward_inplace_correct};
    auto runtime = std::make_shared<const DistAttnRuntime>(mask, heads, comm, config, switches, fixed);
    if (Timeline* timeline = Timeline::of(comm->rank()))
      timeline->add(fixed != nullptr ? "plan (new mask on a kept dispatch)" : "plan (dispatch + comm plan)", "host",
                    start, Timeline::now_us());
    return runtime;
  }));
}

}  // namespace

// Device tensors: a local one on the NCCL communicator's device (the global one on the device or host).
static bool device_rows(const RuntimeKey& key, const Partition& p, const TensorView& global, const TensorView& local) {
  if (global.device.type != DeviceType::CUDA && local.device.type != DeviceType::CUDA) return false;
#if MAGI_ATTN_WITH_NCCL
  require_same_row_shape(global, local);
  if (global.ndim < 1 || global.shape[0] != p.total)
    throw InvalidArgument("global: expected " + std::to_string(p.total) + " rows, got " + shape_string(global));
  if (local.ndim < 1 || local.shape[0] != p.local_tokens())
    throw InvalidArgument("local: expected " + std::to_string(p.local_tokens()) + " rows, got " + shape_string(local));
  if ((global.data == nullptr && global.numel() > 0) || (local.data == nullptr && local.numel() > 0))
    throw InvalidArgument("global, local: null data pointer");
  (void)key;
  return true;
#else
  (void)key;
  (void)p;
  throw NotAvailable("dispatch/undispatch: CUDA tensors given, but this build has no NCCL engine (allowed: CPU)");
#endif
}

void dispatch(const RuntimeKey& key, Axis axis, const TensorView& global, const TensorView& local,
              [[maybe_unused]] StreamHandle stream) {
  const Partition& p = partition(key, axis);
  if (device_rows(key, p, global, local)) {
#if MAGI_ATTN_WITH_NCCL
    gpu::dispatch(key.runtime(), p, global, local, static_cast<cudaStream_t>(stream));
#endif
    return;
  }
  require_same_row_shape(global, local);
  const int64_t row = row_bytes_of(global, "global", p.total);
  if (row_bytes_of(local, "local", p.local_tokens()) != row && p.total > 0)
    throw InvalidArgument("dispatch: global and local rows differ in size");
  const auto rows = p.global_rows(key.runtime().rank());
  auto* dst = static_cast<std::byte*>(local.data);
  const auto* src = static_cast<const std::byte*>(global.data);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < p.total) std::memcpy(dst + i * row, src + int64_t{rows[i]} * row, static_cast<size_t>(row));
    else std::memset(dst + i * row, 0, static_cast<size_t>(row));
  }
}

void undispatch(const RuntimeKey& key, Axis axis, const TensorView& local, const TensorView& global,
                [[maybe_unused]] StreamHandle stream) {
  const Partition& p = partition(key, axis);
  if (device_rows(key, p, global, local)) {
#if MAGI_ATTN_WITH_NCCL
    gpu::undispatch(key.runtime(), p, local, global, static_cast<cudaStream_t>(stream));
#endif
    return;
  }
  require_same_row_shape(global, local);
  const int64_t row = row_bytes_of(local, "local", p.local_tokens());
  row_bytes_of(global, "global", p.total);
  comm::Communicator& comm = key.runtime().comm();
  std::vector<std::byte> all(static_cast<size_t>(row * p.local_tokens() * comm.size()));
  comm.allgather(local.data, row * p.local_tokens(), all.data());
  auto* dst = static_cast<std::byte*>(global.data);
  for (int32_t r = 0; r < comm.size(); ++r) {
    const auto rows = p.global_rows(r);
    const std::byte* src = all.data() + static_cast<int64_t>(r) * row * p.local_tokens();
    for (size_t i = 0; i < rows.size(); ++i)
      if (rows[i] < p.total) std::memcpy(dst + int64_t{rows[i]} * row, src + i * row, static_cast<size_t>(row));
  }
}

std::vector<int32_t> position_ids(const RuntimeKey& key, Axis axis) {
  return partition(key, axis).global_rows(key.runtime().rank());
}

void roll(const RuntimeKey& key, Axis axis, const TensorView& local, const TensorView& out, int64_t shift,
          [[maybe_unused]] StreamHandle stream) {
  const Partition& p = partition(key, axis);
  if (local.device.type == DeviceType::CUDA || out.device.type == DeviceType::CUDA)
    throw NotAvailable("roll: device tensors are not supported yet (allowed: host tensors; on the GPU, undispatch, "
                       "torch.roll and dispatch again)");
  require_same_row_shape(local, out);
  const int64_t row = row_bytes_of(local, "local", p.local_tokens());
  row_bytes_of(out, "out", p.local_tokens());
  comm::Communicator& comm = key.runtime().comm();
  const int32_t cp = comm.size();
  const int64_t total = p.total;
  // out[global g] = local[global (g - shift) mod total]: this rank sends each real row to the owner of its position
  // plus the shift, in the receiver's row order; it receives, from each rank, its own rows in ascending order.
  const int64_t s = total == 0 ? 0 : ((shift % total) + total) % total;
  const std::vector<int32_t> mine = p.global_rows(comm.rank());
  std::vector<std::vector<std::pair<int32_t, int32_t>>> to(static_cast<size_t>(cp));  // (their row, my row)
  std::vector<std::vector<int32_t>> from(static_cast<size_t>(cp));                    // my rows, by source rank
  for (int32_t i = 0; i < static_cast<int32_t>(mine.size()); ++i) {
    if (mine[i] >= total) continue;
    const auto there = static_cast<int32_t>((mine[i] + s) % total);
    to[p.owner_of(there)].push_back({p.local_row(there), i});
    from[p.owner_of(static_cast<int32_t>((mine[i] - s + total) % total))].push_back(i);
  }
  std::vector<int64_t> send_counts(cp), send_displs(cp), recv_counts(cp), recv_displs(cp);
  int64_t sent = 0, received = 0;
  for (int32_t r = 0; r < cp; ++r) {
    std::sort(to[r].begin(), to[r].end());
    send_displs[r] = sent;
    send_counts[r] = static_cast<int64_t>(to[r].size()) * row;
    sent += send_counts[r];
    recv_displs[r] = received;
    recv_counts[r] = static_cast<int64_t>(from[r].size()) * row;
    received += recv_counts[r];
  }
  std::vector<std::byte> send(static_cast<size_t>(sent)), recv(static_cast<size_t>(received));
  const auto* src = static_cast<const std::byte*>(local.data);
  std::byte* at = send.data();
  for (const auto& rows : to)
    for (const auto& [theirs, i] : rows) at = std::copy_n(src + i * row, row, at);
  comm.all_to_all_v(send.data(), send_counts, send_displs, recv.data(), recv_counts, recv_displs);
  auto* dst = static_cast<std::byte*>(out.data);  // may be `local`: everything it holds was copied out above
  std::memset(dst, 0, static_cast<size_t>(row * p.local_tokens()));  // padding rows hold zeros
  const std::byte* got = recv.data();
  for (const auto& rows : from)
    for (int32_t i : rows) {
      std::copy_n(got, row, dst + int64_t{i} * row);
      got += row;
    }
}

void calc_attn(const RuntimeKey& key, const ForwardArgs& local, StreamHandle stream) {
  key.runtime().forward(local, stream);
}
void calc_attn_backward(const RuntimeKey& key, const BackwardArgs& local, StreamHandle stream) {
  key.runtime().backward(local, stream);
}

size_t runtime_cache_size() { return runtime_cache().size(); }
void clear_runtime_cache() { runtime_cache().clear(); }
void clear_runtime_cache(const comm::Communicator& comm) {
  runtime_cache().erase_if([&](const RuntimeId& id) { return id.comm == &comm; });
}

double PlanSummary::imbalance() const {
  if (rank_area.empty()) return 1.0;
  int64_t total = 0, largest = 0;
  for (int64_t a : rank_area) total += a, largest = std::max(largest, a);
  return total == 0 ? 1.0 : static_cast<double>(largest) * static_cast<double>(rank_area.size()) / total;
}

std::string PlanSummary::to_text() const {
  std::ostringstream out;
  int64_t largest = 0, fetched = 0;
  for (int64_t a : rank_area) largest = std::max(largest, a);
  for (int64_t f : fetched_kv_rows) fetched += f;
  out << "cp " << cp << ", chunk " << chunk_size << ", local q " << local_q_tokens << ", local kv " << local_k_tokens
      << "\n";
  for (int32_t r = 0; r < cp; ++r)
    out << "  rank " << r << ": area " << rank_area[r] << ", fetched kv rows " << fetched_kv_rows[r] << "\n";
  out << "max area " << largest << " vs lower bound " << area_lower_bound << " ("
      << (area_lower_bound ? static_cast<double>(largest) / area_lower_bound : 1.0) << "x; count-aware bound "
      << area_count_aware_bound << "), imbalance " << imbalance()
      << "\nkv rows moved " << fetched << " vs ring " << ring_kv_rows << " ("
      << (ring_kv_rows ? static_cast<double>(fetched) / ring_kv_rows : 0.0) << " of ring), "
      << kv_row_elements << " elements per k or v row\n";
  if (ranks_per_node > 0)
    out << "hierarchical comm, " << ranks_per_node << " ranks per node: " << inter_node_kv_rows
        << " kv rows cross nodes\n";
  return out.str();
}

}  // namespace magi::dist
