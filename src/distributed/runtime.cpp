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
#include <tuple>

#include "api/checks.hpp"
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

}  // namespace

DType partial_wire_dtype(DType input, bool high_precision, std::initializer_list<DType> results) {
  const bool wider = std::any_of(results.begin(), results.end(), [&](DType r) { return dtype_size(r) > dtype_size(input); });
  return input == DType::F64 || high_precision || wider ? partial_dtype(input) : input;
}

namespace {

void require_rows(const TensorView& t, const char* name, int64_t rows, int32_t ndim) {
  if (t.ndim != ndim || t.shape[0] != rows)
    throw InvalidArgument(std::string(name) + ": expected " + std::to_string(ndim) + " dims with " +
                          std::to_string(rows) + " local rows (the runtime key's local length), got " +
                          shape_string(t));
  if (t.device.type != DeviceType::CPU)
    throw InvalidArgument(std::string(name) + ": host communicators need host tensors (allowed: CPU)");
}

// Host exchanges assume that every rank's tensors have the same dtypes and row shapes (and a roll the same shift):
// where they differ the collective breaks (gloo aborts the process). One small allgather first, so that every rank
// throws alike.
void require_same_tensors_on_all_ranks(comm::Communicator& comm, std::initializer_list<const TensorView*> tensors,
                                       int64_t extra, std::string_view what) {
  uint64_t h = 1469598103934665603ull;
  const auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  for (const TensorView* t : tensors) {
    mix(static_cast<uint64_t>(t->dtype));
    mix(static_cast<uint64_t>(t->ndim));
    for (int i = 1; i < t->ndim; ++i) mix(static_cast<uint64_t>(t->shape[i]));
  }
  mix(static_cast<uint64_t>(extra));
  comm::require_same_on_all_ranks(comm, h, what);
}

void store_all(const std::vector<double>& values, const TensorView& dst) {
  for (int64_t i = 0; i < static_cast<int64_t>(values.size()); ++i) comm::store_element(dst.dtype, dst.data, i, values[i]);
}

void add_all(const Buffer& part, double* accum, int64_t n) {
  for (int64_t i = 0; i < n; ++i) accum[i] += part.at(i);
}

// Heads [h0, h1) of a [rows, heads, inner] tensor (inner 1 for [rows, heads]) as a contiguous host copy.
Buffer copy_heads(const TensorView& t, int32_t h0, int32_t h1) {
  const int64_t rows = t.shape[0], heads = t.shape[1], inner = t.ndim == 3 ? t.shape[2] : 1;
  const int64_t width = (h1 - h0) * inner, esize = dtype_size(t.dtype);
  Buffer b(t.dtype, rows * width);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(b.bytes.data() + r * width * esize, static_cast<const std::byte*>(t.data) + (r * heads + h0) * inner * esize,
                static_cast<size_t>(width * esize));
  return b;
}

// The accumulators of one head class: the whole arrays when it holds every head, else a copy of its heads that
// goes back (or is added back) when the class is done.
class HeadSlice {
 public:
  HeadSlice(std::vector<double>& all, int64_t rows, int32_t heads, int32_t inner, int32_t h0, int32_t h1, bool copy_in)
      : all_(all), rows_(rows), heads_(heads), inner_(inner), h0_(h0), h1_(h1) {
    if (whole()) return;
    part_.assign(static_cast<size_t>(rows * (h1 - h0) * inner), 0.0);
    if (copy_in)
      for (int64_t r = 0; r < rows; ++r)
        std::copy_n(all.data() + (r * heads + h0) * inner, (h1 - h0) * inner, part_.data() + r * (h1 - h0) * inner);
  }
  double* data() { return whole() ? all_.data() : part_.data(); }
  void store_back(bool add) {
    if (whole()) return;
    const int64_t width = int64_t{h1_ - h0_} * inner_;
    for (int64_t r = 0; r < rows_; ++r)
      for (int64_t i = 0; i < width; ++i) {
        double& dst = all_[static_cast<size_t>((r * heads_ + h0_) * inner_ + i)];
        dst = add ? dst + part_[static_cast<size_t>(r * width + i)] : part_[static_cast<size_t>(r * width + i)];
      }
  }

 private:
  bool whole() const { return h0_ == 0 && h1_ == heads_; }
  std::vector<double>& all_;
  std::vector<double> part_;
  int64_t rows_;
  int32_t heads_, inner_, h0_, h1_;
};

// The kv fetch of one stage: k and v travel as two group-casts. With hierarchical comm, hop 1 (across
// nodes, overlapped with compute) fills the relay buffers and wait() fans them out inside the node.
struct StageFetch {
  const DistAttnRuntime& rt;
  const CommPlan& plan;
  int32_t stage;
  int32_t heads_kv;  // of the head class: k_local's heads
  int64_t row_bytes;
  Buffer k, v;              // the stage buffers: [buffer_rows, heads_kv, D]
  Buffer relay_k, relay_v;  // hop-1 receive buffers (hierarchical only)
  std::optional<comm::GroupCast> k_cast, v_cast;
  double started_us = Timeline::now_us();

  StageFetch(const DistAttnRuntime& runtime, const CommPlan& class_plan, int32_t stage_index, const TensorView& k_local,
             const TensorView& v_local)
      : rt(runtime),
        plan(class_plan),
        stage(stage_index),
        heads_kv(static_cast<int32_t>(k_local.shape[1])),
        row_bytes(int64_t{heads_kv} * rt.heads().head_dim * dtype_size(k_local.dtype)),
        k(k_local.dtype, rows_of(mine().stages[stage].buffer_rows)),
        v(k_local.dtype, rows_of(mine().stages[stage].buffer_rows)),
        relay_k(k_local.dtype, plan.hierarchical() ? rows_of(hop1().total_recv_rows()) : 0),
        relay_v(k_local.dtype, plan.hierarchical() ? rows_of(hop1().total_recv_rows()) : 0) {
    const bool relayed = plan.hierarchical();
    k_cast.emplace(rt.comm(), hop1(), k_local.data, row_bytes, relayed ? relay_k.bytes.data() : k.bytes.data());
    v_cast.emplace(rt.comm(), hop1(), v_local.data, row_bytes, relayed ? relay_v.bytes.data() : v.bytes.data());
  }
  void wait() {
    k_cast->wait();
    v_cast->wait();
    if (!plan.hierarchical()) return;
    const auto& hop2 = plan.relay_routes[rt.rank()][stage];
    k_cast.emplace(rt.comm(), hop2, relay_k.bytes.data(), row_bytes, k.bytes.data());
    v_cast.emplace(rt.comm(), hop2, relay_v.bytes.data(), row_bytes, v.bytes.data());
    k_cast->wait();
    v_cast->wait();
  }
  const RankPlan& mine() const { return plan.ranks[static_cast<size_t>(rt.rank())]; }
  int64_t rows() const { return mine().stages[stage].buffer_rows; }

 private:
  const comm::RowRoutes& hop1() const { return plan.routes[rt.rank()][stage]; }
  int64_t rows_of(int64_t rows) const { return rows * heads_kv * rt.heads().head_dim; }
};

// Folds one stage's (out, lse) into the running result with the SPEC lse merge.
void merge_into(const Buffer& out, const Buffer& lse, int64_t row_heads, int32_t head_dim, double* acc_out,
                double* acc_lse) {
  for (int64_t row_head = 0; row_head < row_heads; ++row_head) {
    const auto w = merge_weights<double>(acc_lse[row_head], lse.at(row_head));
    double* o = acc_out + row_head * head_dim;
    for (int32_t d = 0; d < head_dim; ++d) {
      const double part = out.at(row_head * head_dim + d);
      o[d] = (w.w1 == 0 ? 0.0 : w.w1 * o[d]) + (w.w2 == 0 ? 0.0 : w.w2 * part);
    }
    acc_lse[row_head] = w.lse;
  }
}

// Rows of the q/out route's buffers ([rows, heads, inner] of `dtype`) cast from their owners to the executor.
struct QoCast {
  Buffer buffer;
  std::optional<comm::GroupCast> cast;
  QoCast(comm::Communicator& comm, const comm::RowRoutes& routes, const TensorView& table, int64_t row_elements)
      : buffer(table.dtype, routes.total_recv_rows() * row_elements) {
    cast.emplace(comm, routes, table.data, row_elements * dtype_size(table.dtype), buffer.bytes.data());
  }
};

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
      planned_slices_(static_cast<int64_t>(mask.slices.size())),
      dispatch_(fixed != nullptr ? redispatch(mask, *fixed)
                                 : make_dispatch(mask, comm_->size(), config.chunk_size, config.algorithm)),
      routes_(solve_routes(mask, dispatch_, heads, switches.routes)) {
  for (HeadClass& c : head_classes(routes_, heads.heads_kv)) {
    const bool any = std::any_of(c.qo.begin(), c.qo.end(), [](const auto& row) {
      return std::find(row.begin(), row.end(), true) != row.end();
    });
    ClassPlan& plan = classes_.emplace_back();
    plan.kv_head_begin = c.kv_head_begin;
    plan.kv_head_end = c.kv_head_end;
    plan.plan = make_comm_plan(mask, dispatch_, config.overlap_degree, switches.ranks_per_node, any ? &c.qo : nullptr);
    if (any) plan.qo = make_qo_plan(mask, dispatch_, c.qo);
  }
}

PlanSummary DistAttnRuntime::summary() const {
  PlanSummary s;
  s.cp = dispatch_.q.cp();
  s.chunk_size = dispatch_.q.chunk_size;
  s.local_q_tokens = dispatch_.q.local_tokens();
  s.local_k_tokens = dispatch_.k.local_tokens();
  s.planned_slices = planned_slices_;
  s.rank_area = routes_.rank_area;
  s.area_lower_bound = dispatch_.lower_bound();
  s.area_count_aware_bound = dispatch_.count_aware_lower_bound();
  // Rows per head class, weighted by its share of the kv heads: kv rows of every head.
  s.fetched_kv_rows.assign(static_cast<size_t>(s.cp), 0);
  for (const ClassPlan& c : classes_)
    for (int32_t r = 0; r < s.cp; ++r)
      s.fetched_kv_rows[r] += c.plan.ranks[r].fetched_rows() * (c.kv_head_end - c.kv_head_begin) / heads_.heads_kv;
  s.ring_kv_rows = int64_t{s.cp} * (s.cp - 1) * s.local_k_tokens;
  s.kv_row_elements = int64_t{heads_.heads_kv} * heads_.head_dim;
  if (plan().hierarchical()) {
    s.ranks_per_node = switches_.ranks_per_node;
    for (int32_t src = 0; src < s.cp; ++src)
      for (const auto& stage_routes : plan().routes[src])
        for (int32_t dst = 0; dst < s.cp; ++dst)
          if (src / s.ranks_per_node != dst / s.ranks_per_node)
            s.inter_node_kv_rows += static_cast<int64_t>(stage_routes.send_rows[dst].size());
  }
  s.qo_comm = switches_.routes.qo_comm;
  s.flatten_head_groups = switches_.routes.flatten_head_groups;
  s.qo_units = routes_.qo_units_total();
  s.route_units = routes_.groups;
  s.forward_bytes = routes_.forward_bytes;
  s.bytes = routes_.bytes;
  s.kv_only_forward_bytes = routes_.kv_only_forward_bytes;
  s.kv_only_bytes = routes_.kv_only_bytes;
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

using api::require_dtype;
using api::require_shape;

// The sink of a distributed call: [S, Hq] (sh) or [local rows, S, Hq] (ssh), fp32; none without a layout.
void check_dist_sink(const TensorView& sink, const char* name, SinkLayout layout, int64_t lq, int32_t hq) {
  if (layout == SinkLayout::None) {
    if (sink.ndim != 0)
      throw InvalidArgument(std::string(name) + " given but the runtime key's sink_layout is none (allowed: sh, ssh)");
    return;
  }
  require_dtype(sink, name, {DType::F32});
  if (layout == SinkLayout::SH) require_shape(sink, name, {sink.ndim > 0 ? sink.shape[0] : 0, hq}, "[S, Hq] (sh)");
  else require_shape(sink, name, {lq, sink.ndim > 1 ? sink.shape[1] : 0, hq}, "[local rows, S, Hq] (ssh)");
  if (sink.shape[sink.ndim == 2 ? 0 : 1] < 1)
    throw InvalidArgument(std::string(name) + ": the number of sink tokens S must be >= 1");
}

// Both engines' checks of the caller's tensors against the runtime key (each engine adds its rows and devices):
// whole shapes and the single-device API's dtypes, the options a distributed call does not take, and outputs that
// share memory with anything.
void check_forward_args(const ForwardArgs& a, int64_t lq, int64_t lk, const HeadShape& h, SinkLayout layout) {
  const DType dt = a.q.dtype;
  require_shape(a.q, "q", {lq, h.heads_q, h.head_dim}, "[local rows of q, Hq, D] (the runtime key's)");
  require_shape(a.k, "k", {lk, h.heads_kv, h.head_dim}, "[local rows of k, Hkv, D] (the runtime key's)");
  require_shape(a.v, "v", {lk, h.heads_kv, h.head_dim}, "[local rows of k, Hkv, D] (the runtime key's)");
  require_dtype(a.q, "q", {DType::BF16, DType::F16, DType::F32, DType::F64});
  require_shape(a.out, "out", {lq, h.heads_q, h.head_dim}, "[local rows of q, Hq, D]");
  require_dtype(a.out, "out", {dt, DType::F32});
  require_shape(a.lse, "lse", {lq, h.heads_q}, "[local rows of q, Hq]");
  if (dt == DType::F64) require_dtype(a.lse, "lse", {DType::F32, DType::F64});
  else require_dtype(a.lse, "lse", {DType::F32});
  if (a.max_logits.ndim != 0) {
    require_shape(a.max_logits, "max_logits", {h.heads_q}, "[Hq]");
    require_dtype(a.max_logits, "max_logits", {DType::F32});
  }
  check_dist_sink(a.sink, "sink", layout, lq, h.heads_q);
  if (a.prev_out.ndim != 0 || a.prev_lse.ndim != 0)
    throw InvalidArgument("prev_out / prev_lse: a distributed forward merges the key parts itself and takes no partial "
                          "result (allowed: none)");
  api::require_disjoint({{&a.out, "out"}, {&a.lse, "lse"}, {&a.max_logits, "max_logits"}},
                        {{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.sink, "sink"}});
}

void check_backward_args(const BackwardArgs& a, int64_t lq, int64_t lk, const HeadShape& h, SinkLayout layout) {
  const DType dt = a.q.dtype;
  require_shape(a.q, "q", {lq, h.heads_q, h.head_dim}, "[local rows of q, Hq, D] (the runtime key's)");
  require_shape(a.k, "k", {lk, h.heads_kv, h.head_dim}, "[local rows of k, Hkv, D] (the runtime key's)");
  require_shape(a.v, "v", {lk, h.heads_kv, h.head_dim}, "[local rows of k, Hkv, D] (the runtime key's)");
  require_dtype(a.q, "q", {DType::BF16, DType::F16, DType::F32, DType::F64});
  for (auto [t, name] : {std::pair{&a.out, "out"}, {&a.dout, "dout"}, {&a.dq, "dq"}}) {
    require_shape(*t, name, {lq, h.heads_q, h.head_dim}, "[local rows of q, Hq, D]");
    require_dtype(*t, name, {dt, DType::F32});
  }
  for (auto [t, name] : {std::pair{&a.dk, "dk"}, {&a.dv, "dv"}}) {
    require_shape(*t, name, {lk, h.heads_kv, h.head_dim}, "[local rows of k, Hkv, D]");
    require_dtype(*t, name, {dt, DType::F32});
  }
  require_shape(a.lse, "lse", {lq, h.heads_q}, "[local rows of q, Hq]");
  if (dt == DType::F64) require_dtype(a.lse, "lse", {DType::F32, DType::F64});
  else require_dtype(a.lse, "lse", {DType::F32});
  check_dist_sink(a.sink, "sink", layout, lq, h.heads_q);
  if (layout != SinkLayout::None) {
    require_dtype(a.dsink, "dsink", {DType::F32});
    if (a.dsink.ndim != a.sink.ndim ||
        !std::equal(a.dsink.shape.begin(), a.dsink.shape.begin() + a.dsink.ndim, a.sink.shape.begin()))
      throw InvalidArgument("dsink: expected the shape of sink " + shape_string(a.sink) + ", got " +
                            shape_string(a.dsink));
    api::require_defined(a.dsink, "dsink");
  } else if (a.dsink.ndim != 0) {
    throw InvalidArgument("dsink given but the runtime key's sink_layout is none (allowed: sh, ssh)");
  }
  if (a.accumulate_dq)
    throw InvalidArgument("accumulate_dq: a distributed backward adds the key parts itself and overwrites dq "
                          "(allowed: false)");
  api::require_disjoint({{&a.dq, "dq"}, {&a.dk, "dk"}, {&a.dv, "dv"}, {&a.dsink, "dsink"}},
                        {{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.out, "out"}, {&a.dout, "dout"}, {&a.lse, "lse"},
                         {&a.sink, "sink"}});
}

bool on_device(const TensorView& q) {
#if MAGI_ATTN_WITH_NCCL
  return q.device.type == DeviceType::CUDA;
#else
  if (q.device.type == DeviceType::CUDA)
    throw NotAvailable("distributed attention on CUDA tensors needs the NCCL engine (this build has none)");
  return false;
#endif
}

}  // namespace

void DistAttnRuntime::forward(const ForwardArgs& a, [[maybe_unused]] StreamHandle stream) const {
  check_forward_args(a, dispatch_.q.local_tokens(), dispatch_.k.local_tokens(), heads_, config_.attention.sink_layout);
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
  require_same_tensors_on_all_ranks(*comm_, {&a.q, &a.out, &a.lse, &a.max_logits, &a.sink}, 0,
                                    "calc_attn: the dtypes of q, out, lse (and which of max_logits, sink are given)");
  const DType part = partial_dtype(a.q.dtype);
  const DType wire = partial_wire_dtype(a.q.dtype, switches_.routes.forward_high_precision, {a.out.dtype});
  const bool want_max = a.max_logits.ndim != 0;
  const bool with_sink = config_.attention.sink_layout != SinkLayout::None;
  const bool in_place = forward_inplace_correct();
  const int32_t num_stages = plan().num_stages();
  const int32_t group = hq / hkv;

  // The running result of all heads. In place: one fp32 (fp64 for fp64 inputs) out / lse that each call merges
  // into itself (prev_out / prev_lse are its own out / lse). Out of place: fp64 accumulators, and each call
  // writes partials that merge_into folds in.
  Buffer running_out(part, in_place ? lq * hq * d : 0), running_lse(part, in_place ? lq * hq : 0);
  if (in_place) store_all(std::vector<double>(static_cast<size_t>(lq * hq), kNegInf), running_lse.view({lq * hq}));
  std::vector<double> acc_out(static_cast<size_t>(in_place ? 0 : lq * hq * d), 0.0),
      acc_lse(static_cast<size_t>(in_place ? 0 : lq * hq), kNegInf);
  std::vector<float> max_logits(static_cast<size_t>(hq), -std::numeric_limits<float>::infinity());

  // The running result of heads [h0, h0 + heads) of `rows` rows, contiguous (one of the above, or a head class's).
  struct Running {
    int64_t rows;
    int32_t heads;
    Buffer* out = nullptr;   // in place
    Buffer* lse = nullptr;
    double* out_acc = nullptr;  // out of place
    double* lse_acc = nullptr;
  };
  Timeline* const timeline = Timeline::of(rank_);
  // One attention call of `q` rows against `k`, `v`; its result joins `into` (heads [h0, ...) for max_logits).
  const auto compute = [&](const Mask& mask, const TensorView& q, const TensorView& k, const TensorView& v,
                           bool sink, int32_t h0, const Running& into, const std::string& what) {
    if (mask.slices.empty() && !sink) return;
    const double start = Timeline::now_us();
    const int64_t rows = into.rows;
    const int32_t heads = into.heads;
    std::optional<Buffer> stage_out, stage_lse;
    Buffer stage_max(DType::F32, heads);
    ForwardArgs s;
    s.q = q;
    s.k = k;
    s.v = v;
    if (sink) s.sink = a.sink;
    if (into.out != nullptr) {
      s.out = s.prev_out = into.out->view({rows, heads, d});
      s.lse = s.prev_lse = into.lse->view({rows, heads});
    } else {
      s.out = stage_out.emplace(part, rows * heads * d).view({rows, heads, d});
      s.lse = stage_lse.emplace(part, rows * heads).view({rows, heads});
    }
    if (want_max) s.max_logits = stage_max.view({heads});
    AttentionOptions options = config_.attention;
    if (!sink) options.sink_layout = SinkLayout::None;
    magi::forward(mask, s, options);
    if (into.out == nullptr) merge_into(*stage_out, *stage_lse, rows * heads, d, into.out_acc, into.lse_acc);
    if (want_max)
      for (int32_t h = 0; h < heads; ++h)
        max_logits[h0 + h] = std::max(max_logits[h0 + h], static_cast<float>(stage_max.at(h)));
    if (timeline != nullptr)
      timeline->add("forward " + what + (into.out != nullptr ? " attention" : " attention + merge"), "compute", start,
                    Timeline::now_us());
  };
  const auto fetched = [&](const StageFetch& f) {
    if (timeline != nullptr)
      timeline->add("forward stage " + std::to_string(f.stage) + " k/v exchange", "comm", f.started_us,
                    Timeline::now_us());
  };
  const Running all_heads{lq, hq, in_place ? &running_out : nullptr, in_place ? &running_lse : nullptr,
                          acc_out.data(), acc_lse.data()};

  // Per head class (one, of every head, unless flattened): the q/out route's q cast and the first kv fetch start,
  // the local stage (every head, once) hides them, the q/out route's work runs and its reduction travels while
  // the kv stages compute.
  for (size_t ci = 0; ci < classes_.size(); ++ci) {
    const ClassPlan& cls = classes_[ci];
    const int32_t kv0 = cls.kv_head_begin, hkc = cls.kv_head_end - kv0, h0 = kv0 * group, hc = hkc * group;
    const bool whole = hkc == hkv;
    std::optional<Buffer> q_copy, k_copy, v_copy;
    if (!whole) {
      q_copy.emplace(copy_heads(a.q, h0, h0 + hc));
      k_copy.emplace(copy_heads(a.k, kv0, kv0 + hkc));
      v_copy.emplace(copy_heads(a.v, kv0, kv0 + hkc));
    }
    const TensorView q = whole ? a.q : q_copy->view({lq, hc, d});
    const TensorView k = whole ? a.k : k_copy->view({lk, hkc, d});
    const TensorView v = whole ? a.v : v_copy->view({lk, hkc, d});

    const double qo_start = Timeline::now_us();
    std::optional<QoCast> q_cast;
    if (cls.qo.any) q_cast.emplace(*comm_, cls.qo.routes[rank_], q, int64_t{hc} * d);
    auto next = std::make_unique<StageFetch>(*this, cls.plan, 0, k, v);
    bool first_waited = false;
    if (config_.overlap_degree == 0) {
      next->wait();
      fetched(*next);
      first_waited = true;
    }
    if (ci == 0) compute(mine().host_mask, a.q, a.k, a.v, with_sink, 0, all_heads, "local");
    // This class's heads of the running result: the whole arrays, or copies that go back at the end.
    std::optional<Buffer> class_out, class_lse;
    if (in_place && !whole) {
      class_out.emplace(copy_heads(running_out.view({lq, hq, d}), h0, h0 + hc));
      class_lse.emplace(copy_heads(running_lse.view({lq, hq}), h0, h0 + hc));
    }
    std::optional<HeadSlice> out_acc, lse_acc;  // out of place
    if (!in_place) {
      out_acc.emplace(acc_out, lq, hq, d, h0, h0 + hc, true);
      lse_acc.emplace(acc_lse, lq, hq, 1, h0, h0 + hc, true);
    }
    const Running mine_class{lq, hc, in_place ? (whole ? &running_out : &*class_out) : nullptr,
                             in_place ? (whole ? &running_lse : &*class_lse) : nullptr,
                             in_place ? nullptr : out_acc->data(), in_place ? nullptr : lse_acc->data()};

    // The q/out route: this rank computes the q rows other ranks sent against its own kv; partial (out, lse) go
    // back to their owners, who merge them after the kv stages.
    std::optional<comm::GroupReduce> out_reduce;
    std::vector<std::byte> packed;
    if (cls.qo.any) {
      q_cast->cast->wait();
      if (timeline != nullptr) timeline->add("forward q/out route: q exchange", "comm", qo_start, Timeline::now_us());
      const int64_t rows = cls.qo.routes[rank_].total_recv_rows();
      const int64_t out_bytes = int64_t{hc} * d * dtype_size(wire), row_bytes = out_bytes + hc * dtype_size(part);
      std::vector<double> part_out(static_cast<size_t>(rows * hc * d), 0.0), part_lse(static_cast<size_t>(rows * hc), kNegInf);
      compute(cls.qo.masks[rank_], q_cast->buffer.view({rows, hc, d}), k, v, false, h0,
              Running{rows, hc, nullptr, nullptr, part_out.data(), part_lse.data()}, "q/out route");
      packed.resize(static_cast<size_t>(rows * row_bytes));
      for (int64_t r = 0; r < rows; ++r) {
        std::byte* row = packed.data() + r * row_bytes;
        for (int64_t i = 0; i < int64_t{hc} * d; ++i) comm::store_element(wire, row, i, part_out[r * hc * d + i]);
        for (int32_t h = 0; h < hc; ++h) comm::store_element(part, row + out_bytes, h, part_lse[r * hc + h]);
      }
      out_reduce.emplace(*comm_, cls.qo.routes[rank_], packed.data(), row_bytes);
    }
    const double reduce_start = Timeline::now_us();

    for (int32_t stage = 0; stage < num_stages; ++stage) {
      const auto current = std::move(next);
      current->wait();
      if (stage > 0 || !first_waited) fetched(*current);
      if (stage + 1 < num_stages) next = std::make_unique<StageFetch>(*this, cls.plan, stage + 1, k, v);
      const int64_t rows = current->rows();
      compute(current->mine().stages[stage].mask, q, current->k.view({rows, hkc, d}), current->v.view({rows, hkc, d}),
              false, h0, mine_class, "stage " + std::to_string(stage));
    }
    if (out_reduce) {  // a merge of remote partials: on fp64 accumulators, also when the stages merge in place
      std::vector<double> out_d, lse_d;
      double *o = mine_class.out_acc, *l = mine_class.lse_acc;
      if (in_place) {
        out_d.resize(static_cast<size_t>(lq * hc * d));
        lse_d.resize(static_cast<size_t>(lq * hc));
        for (size_t i = 0; i < out_d.size(); ++i) out_d[i] = mine_class.out->at(static_cast<int64_t>(i));
        for (size_t i = 0; i < lse_d.size(); ++i) lse_d[i] = mine_class.lse->at(static_cast<int64_t>(i));
        o = out_d.data();
        l = lse_d.data();
      }
      out_reduce->finish_lse_merge(wire, part, hc, d, o, l);
      if (in_place) {
        store_all(out_d, mine_class.out->view({lq * hc * d}));
        store_all(lse_d, mine_class.lse->view({lq * hc}));
      }
      if (timeline != nullptr)
        timeline->add("forward q/out route: partial out / lse reduce", "comm", reduce_start, Timeline::now_us());
    }
    if (in_place && !whole) {  // the class's heads back into the running result
      const int64_t esize = dtype_size(part);
      for (int64_t r = 0; r < lq; ++r) {
        std::memcpy(running_out.bytes.data() + (r * hq + h0) * d * esize, class_out->bytes.data() + r * hc * d * esize,
                    static_cast<size_t>(hc * d * esize));
        std::memcpy(running_lse.bytes.data() + (r * hq + h0) * esize, class_lse->bytes.data() + r * hc * esize,
                    static_cast<size_t>(hc * esize));
      }
    }
    if (!in_place) {
      out_acc->store_back(false);
      lse_acc->store_back(false);
    }
  }

  const double store_start = Timeline::now_us();
  if (in_place) {
    for (int64_t i = 0; i < lq * hq * d; ++i) comm::store_element(a.out.dtype, a.out.data, i, running_out.at(i));
    for (int64_t i = 0; i < lq * hq; ++i) comm::store_element(a.lse.dtype, a.lse.data, i, running_lse.at(i));
  } else {
    store_all(acc_out, a.out);
    store_all(acc_lse, a.lse);
  }
  if (timeline != nullptr) timeline->add("forward store out / lse", "compute", store_start, Timeline::now_us());
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
  check_backward_args(a, dispatch_.q.local_tokens(), dispatch_.k.local_tokens(), heads_, config_.attention.sink_layout);
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
  require_same_tensors_on_all_ranks(*comm_, {&a.q, &a.out, &a.dout, &a.lse, &a.dq, &a.dk, &a.dv, &a.dsink}, 0,
                                    "calc_attn_backward: the dtypes of q, out, dout, lse, dq, dk, dv, dsink");
  const DType part = partial_dtype(a.q.dtype);
  const DType wire = partial_wire_dtype(a.q.dtype, backward_high_precision(), {a.dq.dtype, a.dk.dtype, a.dv.dtype});
  const bool with_sink = config_.attention.sink_layout != SinkLayout::None;
  const int32_t num_stages = plan().num_stages();
  const int32_t group = hq / hkv;

  std::vector<double> acc_dq(static_cast<size_t>(lq * hq * d), 0.0);
  std::vector<double> acc_dk(static_cast<size_t>(lk * hkv * d), 0.0), acc_dv(acc_dk.size(), 0.0);

  Timeline* const timeline = Timeline::of(rank_);
  const auto span = [&](std::string name, std::string_view lane, double start) {
    if (timeline != nullptr) timeline->add(std::move(name), lane, start, Timeline::now_us());
  };
  // Host stage: own kv, every head, and the sink (whose gradient is computed exactly once, here). First, where it
  // hides the first fetch; with MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE last, where it hides the last remote reduction
  // instead.
  const bool hide_tail = env::get_bool("MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE") && num_stages > 0;
  const auto host_stage = [&] {
    const double host_start = Timeline::now_us();
    if (mine().host_mask.slices.empty() && !with_sink) return;
    Buffer host_dq(part, lq * hq * d), host_dk(part, lk * hkv * d), host_dv(part, lk * hkv * d);
    BackwardArgs s = a;
    s.dq = host_dq.view({lq, hq, d});
    s.dk = host_dk.view({lk, hkv, d});
    s.dv = host_dv.view({lk, hkv, d});
    magi::backward(mine().host_mask, s, config_.attention);
    add_all(host_dq, acc_dq.data(), lq * hq * d);
    add_all(host_dk, acc_dk.data(), lk * hkv * d);
    add_all(host_dv, acc_dv.data(), lk * hkv * d);
    span("backward local attention", "compute", host_start);
  };
  AttentionOptions remote_options = config_.attention;
  remote_options.sink_layout = SinkLayout::None;

  for (size_t ci = 0; ci < classes_.size(); ++ci) {
    const ClassPlan& cls = classes_[ci];
    const CommPlan& plan = cls.plan;
    const int32_t kv0 = cls.kv_head_begin, hkc = cls.kv_head_end - kv0, h0 = kv0 * group, hc = hkc * group;
    const int64_t kv_row = int64_t{hkc} * d;
    const bool whole = hkc == hkv;
    std::optional<Buffer> copies[6];
    const auto heads_of = [&](int i, const TensorView& t, int32_t first, int32_t count) {
      if (whole) return t;
      copies[i].emplace(copy_heads(t, first, first + count));
      return t.ndim == 3 ? copies[i]->view({t.shape[0], count, d}) : copies[i]->view({t.shape[0], count});
    };
    const TensorView q = heads_of(0, a.q, h0, hc), out = heads_of(1, a.out, h0, hc), dout = heads_of(2, a.dout, h0, hc);
    const TensorView lse = heads_of(3, a.lse, h0, hc), k = heads_of(4, a.k, kv0, hkc), v = heads_of(5, a.v, kv0, hkc);

    // The q/out route: q, out, dout and lse of the rows other ranks hand to this one.
    const double qo_start = Timeline::now_us();
    std::optional<QoCast> qo_casts[4];
    if (cls.qo.any) {
      const comm::RowRoutes& routes = cls.qo.routes[rank_];
      qo_casts[0].emplace(*comm_, routes, q, int64_t{hc} * d);
      qo_casts[1].emplace(*comm_, routes, out, int64_t{hc} * d);
      qo_casts[2].emplace(*comm_, routes, dout, int64_t{hc} * d);
      qo_casts[3].emplace(*comm_, routes, lse, hc);
    }
    // The first fetch runs while the host stage computes (after it, with overlap degree 0).
    auto next = std::make_unique<StageFetch>(*this, plan, 0, k, v);
    bool first_waited = false;
    if (config_.overlap_degree == 0) {
      next->wait();
      span("backward stage 0 k/v exchange", "comm", next->started_us);
      first_waited = true;
    }
    if (ci == 0 && !hide_tail) host_stage();
    HeadSlice dq_acc(acc_dq, lq, hq, d, h0, h0 + hc, false), dk_acc(acc_dk, lk, hkv, d, kv0, kv0 + hkc, false),
        dv_acc(acc_dv, lk, hkv, d, kv0, kv0 + hkc, false);

    std::optional<comm::GroupReduce> dq_reduce;
    std::optional<Buffer> qo_dq;
    if (cls.qo.any) {
      for (auto& c : qo_casts) c->cast->wait();
      span("backward q/out route: q, out, dout, lse exchange", "comm", qo_start);
      const double start = Timeline::now_us();
      const int64_t rows = cls.qo.routes[rank_].total_recv_rows();
      Buffer part_dq(part, rows * hc * d), part_dk(part, lk * kv_row), part_dv(part, lk * kv_row);
      const Mask& mask = cls.qo.masks[rank_];
      if (!mask.slices.empty()) {
        BackwardArgs s;
        s.q = qo_casts[0]->buffer.view({rows, hc, d});
        s.out = qo_casts[1]->buffer.view({rows, hc, d});
        s.dout = qo_casts[2]->buffer.view({rows, hc, d});
        s.lse = qo_casts[3]->buffer.view({rows, hc});
        s.k = k;
        s.v = v;
        s.dq = part_dq.view({rows, hc, d});
        s.dk = part_dk.view({lk, hkc, d});
        s.dv = part_dv.view({lk, hkc, d});
        magi::backward(mask, s, remote_options);
        add_all(part_dk, dk_acc.data(), lk * kv_row);  // this rank's own kv: no reduction
        add_all(part_dv, dv_acc.data(), lk * kv_row);
      }
      qo_dq.emplace(wire, rows * hc * d);
      for (int64_t i = 0; i < rows * hc * d; ++i)
        comm::store_element(wire, qo_dq->bytes.data(), i, mask.slices.empty() ? 0.0 : part_dq.at(i));
      span("backward q/out route attention", "compute", start);
      dq_reduce.emplace(*comm_, cls.qo.routes[rank_], qo_dq->bytes.data(), int64_t{hc} * d * dtype_size(wire));
    }
    const double dq_reduce_start = Timeline::now_us();

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
    const bool relayed = plan.hierarchical();
    std::list<Reduce> first_hop, second_hop;  // second_hop: hierarchical only (relay -> owner)
    const auto start_reduce = [&](std::list<Reduce>& queue, const comm::RowRoutes& routes, Reduce r) {
      Reduce& started = queue.emplace_back(std::move(r));
      started.started_us = Timeline::now_us();
      started.k_reduce.emplace(*comm_, routes, started.dk.bytes.data(), kv_row * dtype_size(wire));
      started.v_reduce.emplace(*comm_, routes, started.dv.bytes.data(), kv_row * dtype_size(wire));
    };
    const auto finish_to_owner = [&] {
      std::list<Reduce>& queue = relayed ? second_hop : first_hop;
      queue.front().k_reduce->finish_sum(wire, kv_row, dk_acc.data());
      queue.front().v_reduce->finish_sum(wire, kv_row, dv_acc.data());
      span("backward stage " + std::to_string(queue.front().stage) + " dk/dv reduce", "comm", queue.front().started_us);
      queue.pop_front();
    };
    const auto finish_at_relay = [&] {  // sum the node's partials, then send them across nodes
      Reduce& done = first_hop.front();
      const comm::RowRoutes& hop1 = plan.routes[rank_][done.stage];
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
    Buffer stage_dq(part, lq * hc * d);
    for (int32_t stage = 0; stage < num_stages; ++stage) {
      const auto current = std::move(next);
      current->wait();
      if (stage > 0 || !first_waited) span("backward stage " + std::to_string(stage) + " k/v exchange", "comm",
                                           current->started_us);
      if (stage + 1 < num_stages) next = std::make_unique<StageFetch>(*this, plan, stage + 1, k, v);
      const StagePlan& sp = current->mine().stages[stage];
      const double stage_start = Timeline::now_us();
      const int64_t rows = sp.buffer_rows;
      Reduce partial{Buffer(wire, rows * kv_row), Buffer(wire, rows * kv_row), {}, {}, stage};
      if (!sp.mask.slices.empty()) {
        BackwardArgs s;
        s.q = q;
        s.out = out;
        s.dout = dout;
        s.lse = lse;
        s.k = current->k.view({rows, hkc, d});
        s.v = current->v.view({rows, hkc, d});
        s.dq = stage_dq.view({lq, hc, d});
        s.dk = partial.dk.view({rows, hkc, d});
        s.dv = partial.dv.view({rows, hkc, d});
        magi::backward(sp.mask, s, remote_options);
        add_all(stage_dq, dq_acc.data(), lq * hc * d);
        span("backward stage " + std::to_string(stage) + " attention", "compute", stage_start);
      }
      start_reduce(first_hop, relayed ? plan.relay_routes[rank_][stage] : plan.routes[rank_][stage], std::move(partial));
      if (relayed) {
        if (first_hop.size() > 1) finish_at_relay();
        if (second_hop.size() > 1) finish_to_owner();
      } else if (first_hop.size() > 1) {
        finish_to_owner();
      }
    }
    if (ci + 1 == classes_.size() && hide_tail) host_stage();
    if (relayed)
      while (!first_hop.empty()) finish_at_relay();
    while (!(relayed ? second_hop : first_hop).empty()) finish_to_owner();
    if (dq_reduce) {
      dq_reduce->finish_sum(wire, int64_t{hc} * d, dq_acc.data());
      span("backward q/out route: partial dq reduce", "comm", dq_reduce_start);
    }
    dq_acc.store_back(true);
    dk_acc.store_back(true);
    dv_acc.store_back(true);
  }

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
  RouteOptions routes;
  bool forward_inplace_correct = true;  // local to each rank: ranks may differ, so not in the fingerprint
  bool merge_global = false;   // MAGI_ATTENTION_AUTO_RANGE_MERGE outside deterministic mode (runtime_key)
  const comm::Communicator* comm = nullptr;
  int32_t cp = 0;
  std::vector<int32_t> fixed_q_owner, fixed_k_owner;  // a kept dispatch's chunk owners; empty: the solver's

  bool operator==(const RuntimeId&) const = default;
  int32_t route_flags() const {
    return routes.qo_comm | routes.flatten_head_groups << 1 | routes.forward_high_precision << 2 |
           routes.backward_high_precision << 3;
  }

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
    return mix(mix(mix(mix(mix(h, backend), backward_high_precision), dsink_op), route_flags()), merge_global);
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
  const int64_t longest = max_chunk_size(mask.total_q, mask.total_k);
  if (config.chunk_size < 1 || config.chunk_size > longest)
    throw InvalidArgument("chunk_size: " + std::to_string(config.chunk_size) + " (allowed: 1 .. " +
                          std::to_string(longest) + ", the longer of total_q, total_k and 16384)");
  const AttentionOptions& o = config.attention;
  api::require_valid_scalars(o);
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
  id.routes.qo_comm = config.qo_comm.value_or(env::get_bool("MAGI_ATTENTION_QO_COMM"));
  id.routes.flatten_head_groups = config.flatten_head_groups.value_or(env::get_bool("MAGI_ATTENTION_FLATTEN_HEAD_GROUPS"));
  id.routes.forward_high_precision =
      config.forward_high_precision_reduce.value_or(env::get_bool("MAGI_ATTENTION_FORWARD_HIGH_PRECISION_REDUCE"));
  id.routes.backward_high_precision = id.backward_high_precision;
  id.forward_inplace_correct = env::get_bool("MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT");
  id.comm = comm.get();
  id.cp = comm->size();
  if (fixed != nullptr) {
    id.fixed_q_owner = fixed->q.owner;
    id.fixed_k_owner = fixed->k.owner;
  }
  if (config.ranks_per_node < 0) {
    id.ranks_per_node = config.ranks_per_node;  // refused below, after the ranks agree
  } else if (config.hierarchical_comm.value_or(env::get_bool("MAGI_ATTENTION_HIERARCHICAL_COMM"))) {
    id.ranks_per_node = config.ranks_per_node > 0 ? config.ranks_per_node : comm->ranks_per_node();
  }
  // MAGI_ATTENTION_AUTO_RANGE_MERGE: the global mask is merged before dispatch, except in deterministic mode, where
  // fewer global slices would cut each rank's stage masks differently; there only the stage calls merge (the
  // single-device rule, which keeps their bits), so results stay bitwise those of the mask as given.
  id.merge_global = env::get_bool("MAGI_ATTENTION_AUTO_RANGE_MERGE") &&
                    !config.attention.deterministic.value_or(env::get_bool("MAGI_ATTENTION_DETERMINISTIC_MODE"));
  // Always checked, hit or miss: ranks whose caches differ must still call the same collectives.
  comm::require_same_on_all_ranks(*comm, id.fingerprint(), "distributed attention mask/shape/config");
  // After the agreement check, so that every rank throws alike.
  if (id.ranks_per_node < 0 || (id.ranks_per_node == 0 && config.hierarchical_comm.value_or(
                                                              env::get_bool("MAGI_ATTENTION_HIERARCHICAL_COMM"))) ||
      (id.ranks_per_node > 0 && id.cp % id.ranks_per_node != 0))
    throw InvalidArgument("DistConfig::ranks_per_node: hierarchical comm needs nodes of equal size made of "
                          "consecutive ranks; ranks_per_node " + std::to_string(id.ranks_per_node) +
                          " does not divide cp " + std::to_string(id.cp) +
                          " (allowed: 0 = the communicator's, or a positive divisor of cp)");

  runtime_cache().set_capacity(static_cast<size_t>(env::get_int("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE")));
  return RuntimeKey(runtime_cache().get(id, [&] {
    const double start = Timeline::now_us();
    validate(mask);
    const RuntimeSwitches switches{.backward_high_precision = id.backward_high_precision,
                                   .dsink_op = id.dsink_op,
                                   .ranks_per_node = id.ranks_per_node,
                                   .forward_inplace_correct = id.forward_inplace_correct,
                                   .routes = id.routes};
    auto runtime = std::make_shared<const DistAttnRuntime>(id.merge_global ? merge_slices(mask) : mask, heads, comm,
                                                           config, switches, fixed);
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
  if (api::overlaps(global, local)) throw InvalidArgument("dispatch: local overlaps global (allowed: separate buffers)");
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
  require_same_tensors_on_all_ranks(comm, {&local}, 0, "undispatch: the dtype and row shape of local");
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
  require_same_row_shape(local, out);
  if (local.device.type == DeviceType::CUDA || out.device.type == DeviceType::CUDA) {
#if MAGI_ATTN_WITH_NCCL
    for (auto [t, name] : {std::pair{&local, "local"}, {&out, "out"}}) {
      if (t->ndim < 1 || t->shape[0] != p.local_tokens())
        throw InvalidArgument(std::string(name) + ": expected " + std::to_string(p.local_tokens()) + " rows, got " +
                              shape_string(*t));
      if (t->data == nullptr && t->numel() > 0) throw InvalidArgument(std::string(name) + ": null data pointer");
    }
    gpu::roll(key.runtime(), p, local, out, shift, static_cast<cudaStream_t>(stream));
    return;
#else
    throw NotAvailable("roll: CUDA tensors given, but this build has no NCCL engine (allowed: CPU)");
#endif
  }
  const int64_t row = row_bytes_of(local, "local", p.local_tokens());
  row_bytes_of(out, "out", p.local_tokens());
  comm::Communicator& comm = key.runtime().comm();
  require_same_tensors_on_all_ranks(comm, {&local}, shift, "roll: the shift, and the dtype and row shape of local");
  const int32_t cp = comm.size();
  const RollRoutes routes = roll_routes(p, comm.rank(), shift);
  std::vector<int64_t> send_counts(cp), send_displs(cp), recv_counts(cp), recv_displs(cp);
  int64_t sent = 0, received = 0;
  for (int32_t r = 0; r < cp; ++r) {
    send_displs[r] = sent;
    send_counts[r] = static_cast<int64_t>(routes.send[r].size()) * row;
    sent += send_counts[r];
    recv_displs[r] = received;
    recv_counts[r] = static_cast<int64_t>(routes.recv[r].size()) * row;
    received += recv_counts[r];
  }
  std::vector<std::byte> send(static_cast<size_t>(sent)), recv(static_cast<size_t>(received));
  const auto* src = static_cast<const std::byte*>(local.data);
  std::byte* at = send.data();
  for (const auto& rows : routes.send)
    for (int32_t i : rows) at = std::copy_n(src + i * row, row, at);
  comm.all_to_all_v(send.data(), send_counts, send_displs, recv.data(), recv_counts, recv_displs);
  auto* dst = static_cast<std::byte*>(out.data);  // may be `local`: everything it holds was copied out above
  std::memset(dst, 0, static_cast<size_t>(row * p.local_tokens()));  // padding rows hold zeros
  const std::byte* got = recv.data();
  for (const auto& rows : routes.recv)
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
  if (qo_comm || flatten_head_groups) {
    const auto mib = [](int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); };
    out << "routes (" << (qo_comm ? "qo comm" : "") << (qo_comm && flatten_head_groups ? ", " : "")
        << (flatten_head_groups ? "flattened head groups" : "") << "): " << qo_units << " of "
        << route_units << " unit(s) per rank pair take the q/out route; MiB moved (2-byte inputs) forward "
        << mib(forward_bytes) << " vs kv-only " << mib(kv_only_forward_bytes) << ", forward + backward "
        << mib(bytes) << " vs kv-only " << mib(kv_only_bytes) << "\n";
  }
  return out.str();
}

}  // namespace magi::dist
