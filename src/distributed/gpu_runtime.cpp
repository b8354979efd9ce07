// Distributed attention on device tensors. Two streams per runtime: the communicator's comm stream runs
// row gathers, NCCL group-casts / group-reduces and the dk/dv sums; a compute stream runs the per-stage
// kernels (magi::forward / magi::backward, backend cuda) and the lse merges. CUDA events order them:
// all stage fetches are enqueued up front, so stage i + 1's fetch runs while stage i computes, and
// stage i's dk/dv reduction runs while stage i + 1 computes. Forward stages merge their out / lse in place
// (MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT=1) or through a partial buffer and lse_merge (0). Every
// partial is combined in a fixed order (host stage, then stages in order, sources ascending), so results
// are bitwise reproducible whenever the per-stage kernels are. Staging buffers are allocated on a runtime's
// first device call (per input dtype) and reused: later calls allocate nothing. With
// MAGI_ATTENTION_PROFILE_DIR, timing events around each span write the rank's timeline (Tracer), at the cost
// of one host synchronisation at the end of each call.
#include "distributed/gpu_runtime.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "comm/nccl_communicator.hpp"
#include "env/log.hpp"
#include "magi/env.hpp"
#include "cuda/check.hpp"
#include "cuda/elementwise.hpp"
#include "distributed/gpu_kernels.hpp"
#include "distributed/timeline.hpp"

namespace magi::dist::gpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using cuda::check;
using cuda::DeviceGuard;

class DeviceMemory {
 public:
  DeviceMemory() = default;
  explicit DeviceMemory(size_t bytes) {
    if (bytes > 0) check(cudaMalloc(&ptr_, bytes), "cudaMalloc (distributed attention staging)");
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  DeviceMemory(DeviceMemory&& other) noexcept : ptr_(other.ptr_) { other.ptr_ = nullptr; }
  DeviceMemory& operator=(DeviceMemory&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    return *this;
  }
  ~DeviceMemory() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  void* get() const { return ptr_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

DeviceMemory upload(const std::vector<int32_t>& values) {
  DeviceMemory memory(values.size() * sizeof(int32_t));
  if (!values.empty())
    check(cudaMemcpy(memory.get(), values.data(), values.size() * sizeof(int32_t), cudaMemcpyHostToDevice),
          "cudaMemcpy");
  return memory;
}

comm::NcclCommunicator& nccl_of(const DistAttnRuntime& runtime) {
  auto* nccl = dynamic_cast<comm::NcclCommunicator*>(&runtime.comm());
  if (nccl == nullptr)
    throw InvalidArgument("device tensors need a runtime key made with an NCCL communicator, got " +
                          runtime.comm().describe() + " (allowed: nccl; or pass host tensors)");
  return *nccl;
}

std::vector<int64_t> displacements(const std::vector<int64_t>& counts) {
  std::vector<int64_t> displs(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) displs[i] = displs[i - 1] + counts[i - 1];
  return displs;
}

std::vector<int64_t> times(std::vector<int64_t> rows, int64_t row_bytes) {
  for (auto& r : rows) r *= row_bytes;
  return rows;
}

class Event {
 public:
  // Ordering events skip timing (cheaper); the profiling events pass cudaEventDefault.
  explicit Event(unsigned flags = cudaEventDisableTiming) {
    check(cudaEventCreateWithFlags(&event_, flags), "cudaEventCreate");
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { cudaEventDestroy(event_); }
  operator cudaEvent_t() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

Element element(DType dtype) {
  switch (dtype) {
    case DType::F32: return Element::F32;
    case DType::BF16: return Element::BF16;
    case DType::F16: return Element::F16;
    default: throw InvalidArgument("distributed attention on device tensors: dtype must be fp32, bf16 or fp16, got " +
                                   std::string(to_string(dtype)));
  }
}

TensorView device_view(void* data, DType dtype, std::initializer_list<int64_t> shape, int32_t device) {
  return TensorView(data, dtype, shape, Device{DeviceType::CUDA, device});
}

void require_device_rows(const TensorView& t, const char* name, int64_t rows, int32_t ndim, int32_t device) {
  if (t.ndim != ndim || t.shape[0] != rows)
    throw InvalidArgument(std::string(name) + ": expected " + std::to_string(ndim) + " dims with " +
                          std::to_string(rows) + " local rows (the runtime key's local length), got " +
                          shape_string(t));
  if (t.device.type != DeviceType::CUDA || t.device.index != device)
    throw InvalidArgument(std::string(name) + ": must be on CUDA device " + std::to_string(device) +
                          " (the NCCL communicator's device); mixing host and device tensors is not allowed");
}

}  // namespace

// The kv group-cast of one stage, seen from this rank, with the transposed routes of the dk/dv reduce.
struct StageRoutes {
  std::vector<int64_t> send_rows, recv_rows;  // per rank
  int64_t total_send = 0, total_recv = 0;
  DeviceMemory send_index;      // [total_send] local kv rows, destinations ascending
  DeviceMemory reduce_offsets;  // [local kv rows + 1] CSR: partial rows coming back to each local row
  DeviceMemory reduce_index;    // [total_send] positions in the reduce receive buffer, ascending per row
};

struct State {
  int32_t device = 0;
  comm::NcclCommunicator* nccl = nullptr;
  cudaStream_t compute = nullptr;
  std::vector<StageRoutes> stages;
  Event start, host_done, done, reduced;
  std::vector<std::unique_ptr<Event>> fetched, computed;
  std::mutex mutex;  // one call at a time per runtime: the buffers are shared

  // Staging buffers for one input dtype.
  bool allocated = false;
  DType dtype = DType::BF16, wire = DType::BF16;
  std::vector<DeviceMemory> send_k, send_v, k, v, part_dk, part_dv, reduce_k, reduce_v;
  DeviceMemory acc_out, acc_lse, acc_max, part_max, acc_dq, acc_dk, acc_dv;
  DeviceMemory host_dk, host_dv;  // MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE: the local stage's dk/dv, added last
  // MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT=0 only: one remote stage's out / lse (fp32), reused by every
  // stage (the compute stream merges it before the next stage writes it).
  DeviceMemory part_out, part_lse;

  // MAGI_ATTENTION_PROFILE_DIR only: timing events, a start and an end per span of one call (at most 3 per
  // stage + 2: exchanges, stage kernels, reductions, the local stage, the stores) and the anchor that ties
  // them to wall-clock time. Created on the first profiled call, reused by later ones.
  std::vector<std::unique_ptr<Event>> span_events;
  std::unique_ptr<Event> anchor;

  ~State() {
    if (compute != nullptr) {
      cudaStreamSynchronize(compute);
      cudaStreamDestroy(compute);
    }
  }
};

std::shared_ptr<State> make_state(const DistAttnRuntime& rt) {
  comm::NcclCommunicator& nccl = nccl_of(rt);
  if (rt.plan().hierarchical())
    throw NotAvailable("hierarchical comm is not built for device tensors (allowed: flat comm; unset "
                       "MAGI_ATTENTION_HIERARCHICAL_COMM)");
  const double plan_start = Timeline::now_us();
  DeviceGuard scope(nccl.cuda_device());
  auto state = std::make_shared<State>();
  state->device = nccl.cuda_device();
  state->nccl = &nccl;
  check(cudaStreamCreateWithFlags(&state->compute, cudaStreamNonBlocking), "cudaStreamCreate");
  const int32_t cp = nccl.size();
  const int32_t local_k = rt.dispatch().k.local_tokens();
  for (int32_t s = 0; s < rt.plan().num_stages(); ++s) {
    const comm::RowRoutes& routes = rt.plan().routes[rt.rank()][s];
    StageRoutes stage;
    std::vector<int32_t> send_index;
    std::vector<std::vector<int32_t>> contributions(static_cast<size_t>(local_k));
    for (int32_t dst = 0; dst < cp; ++dst) {
      stage.send_rows.push_back(static_cast<int64_t>(routes.send_rows[dst].size()));
      for (int32_t row : routes.send_rows[dst]) {
        contributions[row].push_back(static_cast<int32_t>(send_index.size()));
        send_index.push_back(row);
      }
    }
    stage.recv_rows = routes.recv_rows;
    stage.total_send = routes.total_send_rows();
    stage.total_recv = routes.total_recv_rows();
    std::vector<int32_t> offsets{0}, index;
    for (const auto& rows : contributions) {
      index.insert(index.end(), rows.begin(), rows.end());
      offsets.push_back(static_cast<int32_t>(index.size()));
    }
    stage.send_index = upload(send_index);
    stage.reduce_offsets = upload(offsets);
    stage.reduce_index = upload(index);
    state->stages.push_back(std::move(stage));
    state->fetched.push_back(std::make_unique<Event>());
    state->computed.push_back(std::make_unique<Event>());
  }
  // Host work with synchronous uploads: wall time measures it exactly.
  if (Timeline* timeline = Timeline::of(rt.rank()))
    timeline->add("plan (device routes and streams)", "host", plan_start, Timeline::now_us());
  return state;
}

namespace {

// One call's spans on the device timeline (MAGI_ATTENTION_PROFILE_DIR): open / close record timing events on
// the span's stream; finish() converts them to the timeline's wall-clock microseconds once the call's last
// event has completed, and writes rank_N.json. Without the variable every method returns at once. Names are
// "<phase>[ stage N] <what>", as the host runtime's.
class Tracer {
 public:
  Tracer(const DistAttnRuntime& rt, State& st, std::string_view phase)
      : timeline_(Timeline::of(rt.rank())), st_(st), phase_(phase) {
    if (timeline_ == nullptr || !st.span_events.empty()) return;
    const size_t pairs = 3 * st.stages.size() + 2;
    for (size_t i = 0; i < 2 * pairs; ++i) st.span_events.push_back(std::make_unique<Event>(cudaEventDefault));
    st.anchor = std::make_unique<Event>(cudaEventDefault);
  }

  // `what` is a literal; `stage` < 0 for spans outside the stages. Returns the span's handle (-1 when off).
  int open(std::string_view what, int64_t stage, std::string_view lane, cudaStream_t stream) {
    if (timeline_ == nullptr) return -1;
    if (2 * (spans_.size() + 1) > st_.span_events.size())
      throw Error("distributed attention profiling: more spans than events (internal)");
    spans_.push_back({what, stage, lane});
    const int span = static_cast<int>(spans_.size()) - 1;
    check(cudaEventRecord(*st_.span_events[2 * span], stream), "cudaEventRecord (profiling)");
    return span;
  }
  void close(int span, cudaStream_t stream) {
    if (span < 0) return;
    check(cudaEventRecord(*st_.span_events[2 * span + 1], stream), "cudaEventRecord (profiling)");
  }

  // `done`: the call's last event. Profiling mode's one extra host sync: an anchor recorded on the then idle
  // compute stream runs at once, so its wall time (read as soon as it completes) dates every other event.
  void finish(cudaEvent_t done) {
    if (timeline_ == nullptr) return;
    check(cudaEventSynchronize(done), "cudaEventSynchronize (profiling)");
    check(cudaEventRecord(*st_.anchor, st_.compute), "cudaEventRecord (profiling)");
    check(cudaEventSynchronize(*st_.anchor), "cudaEventSynchronize (profiling)");
    const double anchor_us = Timeline::now_us();
    const auto at = [&](const Event& event) {
      float before_anchor_ms = 0;
      check(cudaEventElapsedTime(&before_anchor_ms, event, *st_.anchor), "cudaEventElapsedTime (profiling)");
      return anchor_us - 1e3 * static_cast<double>(before_anchor_ms);
    };
    for (size_t i = 0; i < spans_.size(); ++i) {
      const Pending& s = spans_[i];
      std::string name(phase_);
      if (s.stage >= 0) name += " stage " + std::to_string(s.stage);
      (name += ' ') += s.what;
      timeline_->add(std::move(name), s.lane, at(*st_.span_events[2 * i]), at(*st_.span_events[2 * i + 1]));
    }
    timeline_->write();
  }

  // A span timed on the host (synchronous host work), added as it is.
  void host_span(std::string_view what, std::string_view lane, double start_us) {
    if (timeline_ != nullptr)
      timeline_->add(std::string(phase_) + " " + std::string(what), lane, start_us, Timeline::now_us());
  }

 private:
  struct Pending {
    std::string_view what;
    int64_t stage;
    std::string_view lane;
  };
  Timeline* timeline_;
  State& st_;
  std::string_view phase_;
  std::vector<Pending> spans_;
};

void ensure_buffers(const DistAttnRuntime& rt, State& st, DType dtype, DType wire) {
  if (st.allocated && st.dtype == dtype && st.wire == wire) return;
  const double start = Timeline::now_us();
  const HeadShape& h = rt.heads();
  const int64_t lq = rt.dispatch().q.local_tokens(), lk = rt.dispatch().k.local_tokens();
  const int64_t kv_row = int64_t{h.heads_kv} * h.head_dim, q_elems = lq * h.heads_q * h.head_dim;
  const auto bytes = [](int64_t n, DType t) { return static_cast<size_t>(n * dtype_size(t)); };
  st.allocated = false;
  for (auto* list : {&st.send_k, &st.send_v, &st.k, &st.v, &st.part_dk, &st.part_dv, &st.reduce_k, &st.reduce_v})
    list->clear();
  for (const StageRoutes& stage : st.stages) {
    st.send_k.emplace_back(bytes(stage.total_send * kv_row, dtype));
    st.send_v.emplace_back(bytes(stage.total_send * kv_row, dtype));
    st.k.emplace_back(bytes(stage.total_recv * kv_row, dtype));
    st.v.emplace_back(bytes(stage.total_recv * kv_row, dtype));
    st.part_dk.emplace_back(bytes(stage.total_recv * kv_row, wire));
    st.part_dv.emplace_back(bytes(stage.total_recv * kv_row, wire));
    st.reduce_k.emplace_back(bytes(stage.total_send * kv_row, wire));
    st.reduce_v.emplace_back(bytes(stage.total_send * kv_row, wire));
  }
  st.acc_out = DeviceMemory(bytes(q_elems, DType::F32));
  st.acc_lse = DeviceMemory(bytes(lq * h.heads_q, DType::F32));
  st.acc_max = DeviceMemory(bytes(h.heads_q, DType::F32));
  st.part_max = DeviceMemory(bytes(h.heads_q, DType::F32));
  const bool partials = !rt.forward_inplace_correct();
  st.part_out = DeviceMemory(partials ? bytes(q_elems, DType::F32) : 0);
  st.part_lse = DeviceMemory(partials ? bytes(lq * h.heads_q, DType::F32) : 0);
  st.acc_dq = DeviceMemory(bytes(q_elems, DType::F32));
  st.acc_dk = DeviceMemory(bytes(lk * kv_row, DType::F32));
  st.acc_dv = DeviceMemory(bytes(lk * kv_row, DType::F32));
  st.dtype = dtype;
  st.wire = wire;
  st.allocated = true;
  if (Timeline* timeline = Timeline::of(rt.rank()))
    timeline->add("plan (device staging buffers)", "host", start, Timeline::now_us());
}

void check_inputs(const DistAttnRuntime& rt, const State& st, const TensorView& q, const TensorView& k,
                  const TensorView& v) {
  const HeadShape& h = rt.heads();
  require_device_rows(q, "q", rt.dispatch().q.local_tokens(), 3, st.device);
  require_device_rows(k, "k", rt.dispatch().k.local_tokens(), 3, st.device);
  require_device_rows(v, "v", rt.dispatch().k.local_tokens(), 3, st.device);
  if (q.shape[1] != h.heads_q || q.shape[2] != h.head_dim || k.shape[1] != h.heads_kv || k.shape[2] != h.head_dim ||
      v.shape[1] != h.heads_kv || v.shape[2] != h.head_dim)
    throw InvalidArgument("q, k, v: heads and head dim must match the runtime key (Hq=" + std::to_string(h.heads_q) +
                          ", Hkv=" + std::to_string(h.heads_kv) + ", D=" + std::to_string(h.head_dim) + "), got q " +
                          shape_string(q) + ", k " + shape_string(k) + ", v " + shape_string(v));
  if (q.dtype != DType::BF16 && q.dtype != DType::F16)
    throw InvalidArgument("q: distributed attention on device tensors takes bf16 or fp16, got " +
                          std::string(to_string(q.dtype)));
  if (k.dtype != q.dtype || v.dtype != q.dtype)
    throw InvalidArgument("k, v: dtype must equal q's (" + std::string(to_string(q.dtype)) + ")");
}

// Enqueues every stage's kv fetch on the comm stream (gather the rows each peer needs, then one NCCL
// group per stage for k and v); stage s's completion is st.fetched[s].
void enqueue_fetches(const DistAttnRuntime& rt, State& st, const TensorView& k, const TensorView& v, Tracer& trace) {
  const cudaStream_t comm = st.nccl->comm_stream();
  const int64_t row_bytes = int64_t{rt.heads().heads_kv} * rt.heads().head_dim * dtype_size(k.dtype);
  for (size_t s = 0; s < st.stages.size(); ++s) {
    const int span = trace.open("k/v exchange", static_cast<int64_t>(s), "comm", comm);
    const StageRoutes& stage = st.stages[s];
    gather_rows(k.data, stage.send_index.as<int32_t>(), stage.total_send, row_bytes, st.send_k[s].get(), comm);
    gather_rows(v.data, stage.send_index.as<int32_t>(), stage.total_send, row_bytes, st.send_v[s].get(), comm);
    const auto send = times(stage.send_rows, row_bytes), recv = times(stage.recv_rows, row_bytes);
    const auto send_displs = displacements(send), recv_displs = displacements(recv);
    if (ncclGroupStart() != ncclSuccess) throw comm::CommError("ncclGroupStart failed");
    st.nccl->enqueue_all_to_all_v(st.send_k[s].get(), send, send_displs, st.k[s].get(), recv, recv_displs, comm);
    st.nccl->enqueue_all_to_all_v(st.send_v[s].get(), send, send_displs, st.v[s].get(), recv, recv_displs, comm);
    st.nccl->await_launch(ncclGroupEnd(), "kv group-cast");  // non-blocking: enqueued only after this
    trace.close(span, comm);
    check(cudaEventRecord(*st.fetched[s], comm), "cudaEventRecord");
  }
}

// The caller's pending work on its stream precedes ours.
void begin(State& st, cudaStream_t caller) {
  check(cudaEventRecord(st.start, caller), "cudaEventRecord");
  check(cudaStreamWaitEvent(st.compute, st.start, 0), "cudaStreamWaitEvent");
  check(cudaStreamWaitEvent(st.nccl->comm_stream(), st.start, 0), "cudaStreamWaitEvent");
}

// Global max of max_logits over ranks (host round trip: [Hq] floats).
void reduce_max_logits(State& st, const TensorView& max_logits, int32_t heads) {
  std::vector<float> mine(static_cast<size_t>(heads)), all(static_cast<size_t>(heads) * st.nccl->size());
  check(cudaMemcpy(mine.data(), st.acc_max.get(), heads * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
  st.nccl->allgather(mine.data(), heads * int64_t{4}, all.data());
  for (int32_t hd = 0; hd < heads; ++hd)
    for (int32_t r = 0; r < st.nccl->size(); ++r) mine[hd] = std::max(mine[hd], all[static_cast<size_t>(r) * heads + hd]);
  check(cudaMemcpy(max_logits.data, mine.data(), heads * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
}

}  // namespace

void forward(const DistAttnRuntime& rt, State& st, const ForwardArgs& a, cudaStream_t caller) {
  check_inputs(rt, st, a.q, a.k, a.v);
  const HeadShape& h = rt.heads();
  const int64_t lq = rt.dispatch().q.local_tokens();
  const int32_t hq = h.heads_q, hkv = h.heads_kv, d = h.head_dim, dev = st.device;
  require_device_rows(a.out, "out", lq, 3, dev);
  require_device_rows(a.lse, "lse", lq, 2, dev);
  if (a.lse.dtype != DType::F32) throw InvalidArgument("lse: must be fp32 for device tensors");
  if (a.out.dtype != a.q.dtype && a.out.dtype != DType::F32)
    throw InvalidArgument("out: dtype must be q's or fp32");
  const bool want_max = a.max_logits.ndim != 0;
  const bool with_sink = rt.config().attention.sink_layout != SinkLayout::None;

  std::lock_guard lock(st.mutex);
  DeviceGuard scope(dev);
  ensure_buffers(rt, st, a.q.dtype, rt.backward_high_precision() ? DType::F32 : a.q.dtype);
  Tracer trace(rt, st, "forward");
  begin(st, caller);
  enqueue_fetches(rt, st, a.k, a.v, trace);
  if (rt.config().overlap_degree == 0) check(cudaStreamWaitEvent(st.compute, *st.fetched[0], 0), "cudaStreamWaitEvent");

  const RankPlan& mine = rt.mine();
  AttentionOptions options = rt.config().attention;
  // Host stage: own kv (and the sink, counted exactly once) straight into the accumulators.
  if (!mine.host_mask.slices.empty() || with_sink) {
    const int span = trace.open("local attention", -1, "compute", st.compute);
    ForwardArgs s;
    s.q = a.q;
    s.k = a.k;
    s.v = a.v;
    if (with_sink) s.sink = a.sink;
    s.out = device_view(st.acc_out.get(), DType::F32, {lq, hq, d}, dev);
    s.lse = device_view(st.acc_lse.get(), DType::F32, {lq, hq}, dev);
    if (want_max) s.max_logits = device_view(st.acc_max.get(), DType::F32, {hq}, dev);
    magi::forward(mine.host_mask, s, options, st.compute);
    trace.close(span, st.compute);
  } else {
    cuda::fill(st.acc_out.as<float>(), lq * hq * d, 0.f, st.compute);
    cuda::fill(st.acc_lse.as<float>(), lq * hq, kNegInf, st.compute);
    cuda::fill(st.acc_max.as<float>(), hq, kNegInf, st.compute);
  }
  options.sink_layout = SinkLayout::None;
  // In place (MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT=1): each remote stage's kernel merges its result into
  // the fp32 accumulators itself (prev_out / prev_lse); the last one writes the caller's out and lse, so no
  // separate merge or conversion pass. Out of place: each stage writes part_out / part_lse, which lse_merge
  // folds into the accumulators on the same stream; a final conversion writes out and lse.
  const bool in_place = rt.forward_inplace_correct();
  int64_t last = -1;
  for (size_t stage = 0; stage < st.stages.size(); ++stage)
    if (in_place && !mine.stages[stage].mask.slices.empty()) last = static_cast<int64_t>(stage);
  const TensorView acc_out = device_view(st.acc_out.get(), DType::F32, {lq, hq, d}, dev);
  const TensorView acc_lse = device_view(st.acc_lse.get(), DType::F32, {lq, hq}, dev);
  for (size_t stage = 0; stage < st.stages.size(); ++stage) {
    check(cudaStreamWaitEvent(st.compute, *st.fetched[stage], 0), "cudaStreamWaitEvent");
    const StagePlan& sp = mine.stages[stage];
    if (sp.mask.slices.empty()) continue;
    const int64_t rows = sp.buffer_rows;
    const bool final_stage = static_cast<int64_t>(stage) == last;
    const int span = trace.open(in_place ? "attention" : "attention + merge", static_cast<int64_t>(stage), "compute",
                                st.compute);
    ForwardArgs s;
    s.q = a.q;
    s.k = device_view(st.k[stage].get(), a.q.dtype, {rows, hkv, d}, dev);
    s.v = device_view(st.v[stage].get(), a.q.dtype, {rows, hkv, d}, dev);
    if (in_place) {
      s.out = final_stage ? a.out : acc_out;
      s.lse = final_stage ? a.lse : acc_lse;
      s.prev_out = acc_out;
      s.prev_lse = acc_lse;
    } else {
      s.out = device_view(st.part_out.get(), DType::F32, {lq, hq, d}, dev);
      s.lse = device_view(st.part_lse.get(), DType::F32, {lq, hq}, dev);
    }
    if (want_max) s.max_logits = device_view(st.part_max.get(), DType::F32, {hq}, dev);
    magi::forward(sp.mask, s, options, st.compute);
    if (!in_place)
      lse_merge(st.acc_out.as<float>(), st.acc_lse.as<float>(), st.part_out.as<float>(), st.part_lse.as<float>(),
                lq * hq, d, st.compute);
    if (want_max) max_into(st.acc_max.as<float>(), st.part_max.as<float>(), hq, st.compute);
    trace.close(span, st.compute);
  }
  if (last < 0) {
    const int span = trace.open("store out / lse", -1, "compute", st.compute);
    convert(st.acc_out.as<float>(), a.out.data, element(a.out.dtype), lq * hq * d, st.compute);
    convert(st.acc_lse.as<float>(), a.lse.data, element(DType::F32), lq * hq, st.compute);
    trace.close(span, st.compute);
  }
  check(cudaEventRecord(st.done, st.compute), "cudaEventRecord");
  check(cudaStreamWaitEvent(caller, st.done, 0), "cudaStreamWaitEvent");
  st.nccl->wait_event(st.done, "distributed attention forward");
  if (want_max) {
    const double start = Timeline::now_us();
    reduce_max_logits(st, a.max_logits, hq);
    trace.host_span("max_logits allgather", "comm", start);
  }
  trace.finish(st.done);
}

void backward(const DistAttnRuntime& rt, State& st, const BackwardArgs& a, cudaStream_t caller) {
  check_inputs(rt, st, a.q, a.k, a.v);
  const HeadShape& h = rt.heads();
  const int64_t lq = rt.dispatch().q.local_tokens(), lk = rt.dispatch().k.local_tokens();
  const int32_t hq = h.heads_q, hkv = h.heads_kv, d = h.head_dim, dev = st.device;
  for (auto [t, name] : {std::pair{&a.out, "out"}, {&a.dout, "dout"}, {&a.dq, "dq"}}) require_device_rows(*t, name, lq, 3, dev);
  for (auto [t, name] : {std::pair{&a.dk, "dk"}, {&a.dv, "dv"}}) require_device_rows(*t, name, lk, 3, dev);
  require_device_rows(a.lse, "lse", lq, 2, dev);
  for (auto [t, name] : {std::pair{&a.dq, "dq"}, {&a.dk, "dk"}, {&a.dv, "dv"}})
    if (t->dtype != a.q.dtype && t->dtype != DType::F32)
      throw InvalidArgument(std::string(name) + ": dtype must be q's or fp32");
  const bool with_sink = rt.config().attention.sink_layout != SinkLayout::None;
  const DType wire = rt.backward_high_precision() ? DType::F32 : a.q.dtype;
  const int64_t kv_row = int64_t{hkv} * d;

  std::lock_guard lock(st.mutex);
  DeviceGuard scope(dev);
  ensure_buffers(rt, st, a.q.dtype, wire);
  Tracer trace(rt, st, "backward");
  begin(st, caller);
  enqueue_fetches(rt, st, a.k, a.v, trace);
  if (rt.config().overlap_degree == 0) check(cudaStreamWaitEvent(st.compute, *st.fetched[0], 0), "cudaStreamWaitEvent");

  const RankPlan& mine = rt.mine();
  const AttentionOptions local_options = rt.config().attention;
  // The local stage (own kv, and the sink) runs first, hiding the first fetch; with
  // MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE last, hiding the last dk/dv reduction instead: then it adds its dq into the
  // running sum and writes dk/dv to buffers of its own, added once the reductions are done (they write acc_dk/dv
  // on the comm stream meanwhile).
  const bool hide_tail = env::get_bool("MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE") && !st.stages.empty();
  const bool host_work = !mine.host_mask.slices.empty() || with_sink;
  if (hide_tail && host_work && st.host_dk.get() == nullptr && lk * kv_row > 0) {
    st.host_dk = DeviceMemory(static_cast<size_t>(lk * kv_row) * sizeof(float));
    st.host_dv = DeviceMemory(static_cast<size_t>(lk * kv_row) * sizeof(float));
  }
  const auto local_stage = [&](bool last) {
    const int span = trace.open("local attention", -1, "compute", st.compute);
    BackwardArgs s = a;
    s.dq = device_view(st.acc_dq.get(), DType::F32, {lq, hq, d}, dev);
    s.accumulate_dq = last;
    s.dk = device_view((last ? st.host_dk : st.acc_dk).get(), DType::F32, {lk, hkv, d}, dev);
    s.dv = device_view((last ? st.host_dv : st.acc_dv).get(), DType::F32, {lk, hkv, d}, dev);
    magi::backward(mine.host_mask, s, local_options, st.compute);
    trace.close(span, st.compute);
  };
  if (host_work && !hide_tail) {
    local_stage(false);
  } else {
    cuda::fill(st.acc_dq.as<float>(), lq * hq * d, 0.f, st.compute);
    cuda::fill(st.acc_dk.as<float>(), lk * kv_row, 0.f, st.compute);
    cuda::fill(st.acc_dv.as<float>(), lk * kv_row, 0.f, st.compute);
  }
  check(cudaEventRecord(st.host_done, st.compute), "cudaEventRecord");
  AttentionOptions options = local_options;
  options.sink_layout = SinkLayout::None;

  const cudaStream_t comm = st.nccl->comm_stream();
  const int64_t wire_row = kv_row * dtype_size(wire);
  for (size_t stage = 0; stage < st.stages.size(); ++stage) {
    check(cudaStreamWaitEvent(st.compute, *st.fetched[stage], 0), "cudaStreamWaitEvent");
    const StagePlan& sp = mine.stages[stage];
    const int64_t rows = sp.buffer_rows;
    if (!sp.mask.slices.empty()) {
      const int span = trace.open("attention", static_cast<int64_t>(stage), "compute", st.compute);
      BackwardArgs s = a;
      s.k = device_view(st.k[stage].get(), a.q.dtype, {rows, hkv, d}, dev);
      s.v = device_view(st.v[stage].get(), a.q.dtype, {rows, hkv, d}, dev);
      s.sink = {};
      s.dsink = {};
      s.dq = device_view(st.acc_dq.get(), DType::F32, {lq, hq, d}, dev);
      s.accumulate_dq = true;  // the kernels add into the running sum (no partial buffer, no add pass)
      s.dk = device_view(st.part_dk[stage].get(), wire, {rows, hkv, d}, dev);
      s.dv = device_view(st.part_dv[stage].get(), wire, {rows, hkv, d}, dev);
      magi::backward(sp.mask, s, options, st.compute);
      trace.close(span, st.compute);
    } else if (rows > 0) {
      check(cudaMemsetAsync(st.part_dk[stage].get(), 0, static_cast<size_t>(rows * wire_row), st.compute), "cudaMemsetAsync");
      check(cudaMemsetAsync(st.part_dv[stage].get(), 0, static_cast<size_t>(rows * wire_row), st.compute), "cudaMemsetAsync");
    }
    check(cudaEventRecord(*st.computed[stage], st.compute), "cudaEventRecord");

    // Partial dk/dv back to their owners: the stage's cast in reverse, then a fixed-order sum.
    const StageRoutes& routes = st.stages[stage];
    check(cudaStreamWaitEvent(comm, *st.computed[stage], 0), "cudaStreamWaitEvent");
    const int reduce_span = trace.open("dk/dv reduce", static_cast<int64_t>(stage), "comm", comm);
    const auto send = times(routes.recv_rows, wire_row), recv = times(routes.send_rows, wire_row);
    const auto send_displs = displacements(send), recv_displs = displacements(recv);
    if (ncclGroupStart() != ncclSuccess) throw comm::CommError("ncclGroupStart failed");
    st.nccl->enqueue_all_to_all_v(st.part_dk[stage].get(), send, send_displs, st.reduce_k[stage].get(), recv,
                                  recv_displs, comm);
    st.nccl->enqueue_all_to_all_v(st.part_dv[stage].get(), send, send_displs, st.reduce_v[stage].get(), recv,
                                  recv_displs, comm);
    st.nccl->await_launch(ncclGroupEnd(), "dk/dv group-reduce");  // non-blocking: enqueued only after this
    if (stage == 0) check(cudaStreamWaitEvent(comm, st.host_done, 0), "cudaStreamWaitEvent");
    sum_rows(st.acc_dk.as<float>(), lk, kv_row, routes.reduce_offsets.as<int32_t>(), routes.reduce_index.as<int32_t>(),
             st.reduce_k[stage].get(), element(wire), comm);
    sum_rows(st.acc_dv.as<float>(), lk, kv_row, routes.reduce_offsets.as<int32_t>(), routes.reduce_index.as<int32_t>(),
             st.reduce_v[stage].get(), element(wire), comm);
    trace.close(reduce_span, comm);
  }
  check(cudaEventRecord(st.reduced, comm), "cudaEventRecord");
  if (hide_tail && host_work) local_stage(true);
  // dq is complete once the last stage has computed: its conversion runs while the dk/dv reduce is on the wire.
  const int store_span = trace.open("store dq / dk / dv", -1, "compute", st.compute);
  convert(st.acc_dq.as<float>(), a.dq.data, element(a.dq.dtype), lq * hq * d, st.compute);
  check(cudaStreamWaitEvent(st.compute, st.reduced, 0), "cudaStreamWaitEvent");
  if (hide_tail && host_work) {
    add_into(st.acc_dk.as<float>(), st.host_dk.as<float>(), lk * kv_row, st.compute);
    add_into(st.acc_dv.as<float>(), st.host_dv.as<float>(), lk * kv_row, st.compute);
  }
  convert(st.acc_dk.as<float>(), a.dk.data, element(a.dk.dtype), lk * kv_row, st.compute);
  convert(st.acc_dv.as<float>(), a.dv.data, element(a.dv.dtype), lk * kv_row, st.compute);
  trace.close(store_span, st.compute);
  check(cudaEventRecord(st.done, st.compute), "cudaEventRecord");
  check(cudaStreamWaitEvent(caller, st.done, 0), "cudaStreamWaitEvent");
  st.nccl->wait_event(st.done, "distributed attention backward");

  // A shared (sh) sink is replicated on every rank, so its gradient is partial per rank.
  if (with_sink && rt.config().attention.sink_layout == SinkLayout::SH && rt.dsink_op() != DsinkReduceOp::None) {
    const int64_t n = a.dsink.numel();
    std::vector<float> mine_dsink(static_cast<size_t>(n)), all(static_cast<size_t>(n) * st.nccl->size());
    check(cudaMemcpy(mine_dsink.data(), a.dsink.data, n * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
    st.nccl->allgather(mine_dsink.data(), n * 4, all.data());
    for (int64_t i = 0; i < n; ++i) {
      double sum = 0;
      for (int32_t r = 0; r < st.nccl->size(); ++r) sum += all[static_cast<size_t>(r * n + i)];
      if (rt.dsink_op() == DsinkReduceOp::Avg) sum /= st.nccl->size();
      mine_dsink[i] = static_cast<float>(sum);
    }
    check(cudaMemcpy(a.dsink.data, mine_dsink.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  trace.finish(st.done);
}

void dispatch(const DistAttnRuntime& rt, const Partition& p, const TensorView& global, const TensorView& local,
              cudaStream_t caller) {
  comm::NcclCommunicator& nccl = nccl_of(rt);
  if (local.device.type != DeviceType::CUDA || local.device.index != nccl.cuda_device())
    throw InvalidArgument("local: must be on CUDA device " + std::to_string(nccl.cuda_device()) +
                          " (the NCCL communicator's device)");
  const int64_t row = p.total == 0 ? 0 : global.nbytes() / p.total;
  DeviceGuard scope(nccl.cuda_device());
  auto* dst = static_cast<char*>(local.data);
  const auto* src = static_cast<const char*>(global.data);
  const auto& chunks = p.chunks[static_cast<size_t>(rt.rank())];
  const cudaStream_t stream = nccl.comm_stream();
  Event start;  // after the caller's pending work on its stream
  check(cudaEventRecord(start, caller), "cudaEventRecord");
  check(cudaStreamWaitEvent(stream, start, 0), "cudaStreamWaitEvent");
  for (size_t i = 0; i < chunks.size(); ++i) {
    const int64_t first = int64_t{chunks[i]} * p.chunk_size;
    const int64_t real = std::max<int64_t>(0, std::min<int64_t>(p.chunk_size, p.total - first));
    char* out = dst + static_cast<int64_t>(i) * p.chunk_size * row;
    if (real > 0)
      check(cudaMemcpyAsync(out, src + first * row, static_cast<size_t>(real * row), cudaMemcpyDefault, stream),
            "cudaMemcpyAsync");
    if (real < p.chunk_size)  // padding rows attend to nothing and hold zeros
      check(cudaMemsetAsync(out + real * row, 0, static_cast<size_t>((p.chunk_size - real) * row), stream),
            "cudaMemsetAsync");
  }
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

void undispatch(const DistAttnRuntime& rt, const Partition& p, const TensorView& local, const TensorView& global,
                cudaStream_t caller) {
  comm::NcclCommunicator& nccl = nccl_of(rt);
  if (local.device.type != DeviceType::CUDA || local.device.index != nccl.cuda_device())
    throw InvalidArgument("local: must be on CUDA device " + std::to_string(nccl.cuda_device()) +
                          " (the NCCL communicator's device)");
  const int64_t local_bytes = local.nbytes();
  const int64_t row = p.local_tokens() == 0 ? 0 : local_bytes / p.local_tokens();
  DeviceGuard scope(nccl.cuda_device());
  DeviceMemory all(static_cast<size_t>(local_bytes) * nccl.size());
  const cudaStream_t stream = nccl.comm_stream();
  Event start, gathered;
  check(cudaEventRecord(start, caller), "cudaEventRecord");
  check(cudaStreamWaitEvent(stream, start, 0), "cudaStreamWaitEvent");
  nccl.enqueue_allgather(local.data, local_bytes, all.get(), stream);
  auto* dst = static_cast<char*>(global.data);
  for (int32_t r = 0; r < nccl.size(); ++r) {
    const auto& chunks = p.chunks[static_cast<size_t>(r)];
    const char* src = all.as<char>() + static_cast<int64_t>(r) * local_bytes;
    for (size_t i = 0; i < chunks.size(); ++i) {
      const int64_t first = int64_t{chunks[i]} * p.chunk_size;
      const int64_t real = std::max<int64_t>(0, std::min<int64_t>(p.chunk_size, p.total - first));
      if (real > 0)
        check(cudaMemcpyAsync(dst + first * row, src + static_cast<int64_t>(i) * p.chunk_size * row,
                              static_cast<size_t>(real * row), cudaMemcpyDefault, stream),
              "cudaMemcpyAsync");
    }
  }
  check(cudaEventRecord(gathered, stream), "cudaEventRecord");
  nccl.wait_event(gathered, "undispatch");
}

namespace {

// Row lists as (first row, rows) runs of consecutive rows, in list order.
std::vector<std::pair<int64_t, int64_t>> runs_of(const std::vector<int32_t>& rows) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int32_t row : rows) {
    if (!runs.empty() && runs.back().first + runs.back().second == row) ++runs.back().second;
    else runs.emplace_back(row, 1);
  }
  return runs;
}

}  // namespace

void roll(const DistAttnRuntime& rt, const Partition& p, const TensorView& local, const TensorView& out, int64_t shift,
          cudaStream_t caller) {
  comm::NcclCommunicator& nccl = nccl_of(rt);
  for (const TensorView* t : {&local, &out})
    if (t->device.type != DeviceType::CUDA || t->device.index != nccl.cuda_device())
      throw InvalidArgument(std::string(t == &local ? "local" : "out") + ": must be on CUDA device " +
                            std::to_string(nccl.cuda_device()) + " (the NCCL communicator's device)");
  const int32_t cp = nccl.size();
  const int64_t row = p.local_tokens() == 0 ? 0 : local.nbytes() / p.local_tokens();
  const RollRoutes routes = roll_routes(p, rt.rank(), shift);
  std::vector<int64_t> send_counts(static_cast<size_t>(cp)), recv_counts(static_cast<size_t>(cp));
  int64_t sent = 0, received = 0;
  for (int32_t r = 0; r < cp; ++r) {
    send_counts[r] = static_cast<int64_t>(routes.send[r].size()) * row;
    recv_counts[r] = static_cast<int64_t>(routes.recv[r].size()) * row;
    sent += send_counts[r];
    received += recv_counts[r];
  }
  DeviceGuard scope(nccl.cuda_device());
  DeviceMemory send(static_cast<size_t>(sent)), recv(static_cast<size_t>(received));
  const cudaStream_t stream = nccl.comm_stream();
  Event start, moved;
  check(cudaEventRecord(start, caller), "cudaEventRecord");
  check(cudaStreamWaitEvent(stream, start, 0), "cudaStreamWaitEvent");
  const auto* src = static_cast<const char*>(local.data);
  char* at = send.as<char>();
  for (const auto& rows : routes.send)
    for (const auto& [first, count] : runs_of(rows)) {
      check(cudaMemcpyAsync(at, src + first * row, static_cast<size_t>(count * row), cudaMemcpyDeviceToDevice, stream),
            "cudaMemcpyAsync");
      at += count * row;
    }
  nccl.enqueue_all_to_all_v(send.get(), send_counts, displacements(send_counts), recv.get(), recv_counts,
                            displacements(recv_counts), stream);
  auto* dst = static_cast<char*>(out.data);  // may be `local`: its rows were copied out before the exchange
  check(cudaMemsetAsync(dst, 0, static_cast<size_t>(row * p.local_tokens()), stream), "cudaMemsetAsync");
  const char* got = recv.as<char>();
  for (const auto& rows : routes.recv)
    for (const auto& [first, count] : runs_of(rows)) {
      check(cudaMemcpyAsync(dst + first * row, got, static_cast<size_t>(count * row), cudaMemcpyDeviceToDevice, stream),
            "cudaMemcpyAsync");
      got += count * row;
    }
  check(cudaEventRecord(moved, stream), "cudaEventRecord");
  nccl.wait_event(moved, "roll");  // the staging buffers are freed on return
}

}  // namespace magi::dist::gpu
