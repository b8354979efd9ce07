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

#include <algorithm>
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
// Row routes of one exchange seen from this rank, on the device: the rows it sends (gathered by send_index,
// destinations ascending) and, for the transposed exchange that brings results back, which returned rows belong
// to each local row (CSR, in send order: a fixed summation / merge order). Used for each kv stage (local kv rows:
// the fetch, then the dk/dv reduce) and for the q/out route (local q rows: q out, partial out/lse or dq back).
struct StageRoutes {
  std::vector<int64_t> send_rows, recv_rows;  // per rank
  int64_t total_send = 0, total_recv = 0;
  DeviceMemory send_index;      // [total_send] local rows, destinations ascending
  DeviceMemory reduce_offsets;  // [local rows + 1] CSR: returned rows of each local row
  DeviceMemory reduce_index;    // [total_send] positions in the return buffer, ascending per row
};

StageRoutes device_routes(const comm::RowRoutes& routes, int32_t cp, int64_t local_rows) {
  StageRoutes stage;
  std::vector<int32_t> send_index;
  std::vector<std::vector<int32_t>> contributions(static_cast<size_t>(local_rows));
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
  return stage;
}

// One head class of the runtime (ClassPlan): kv heads [kv0, kv0 + hkc) and their q heads [h0, h0 + hc). A class
// that is not every head works on contiguous copies of its heads (q, k, v; out, dout, lse) and accumulators of its
// own, copied in from and back into the whole ones.
struct HeadClassState {
  int32_t kv0 = 0, hkc = 0, h0 = 0, hc = 0;
  bool whole = true;
  std::vector<StageRoutes> stages;
  std::vector<std::unique_ptr<Event>> fetched, computed;
  bool qo = false;  // some rank pair of this class takes the q/out route (the same on every rank)
  bool qo_ran = false;  // this backward call: this rank computed q/out route work (its dk/dv are to be added)
  StageRoutes qo_routes;
  const Mask* qo_mask = nullptr;  // this rank as executor: its buffer rows x its kv rows
  Event inputs_ready, qo_cast, qo_computed, qo_returned, accumulators_ready, reduced;

  // Staging for one input dtype.
  std::vector<DeviceMemory> send_k, send_v, k, v, part_dk, part_dv, reduce_k, reduce_v;
  DeviceMemory heads[6];        // not whole: q, k, v, out, dout, lse of the class's heads
  DeviceMemory acc[5];          // not whole: out, lse (forward) / dq, dk, dv (backward) accumulators; see kAcc*
  DeviceMemory qo_send[4], qo_recv[4];  // q/out route: q, out, dout, lse rows sent / received
  DeviceMemory qo_part_out, qo_part_lse, qo_ret_out, qo_ret_lse;  // forward partials computed / returned
  DeviceMemory qo_part_dq, qo_ret_dq, qo_dk, qo_dv;               // backward
};
enum ClassInput { kInQ, kInK, kInV, kInOut, kInDout, kInLse };
enum ClassAcc { kAccOut, kAccLse, kAccDq = 0, kAccDk = 1, kAccDv = 2 };

struct State {
  int32_t device = 0;
  comm::NcclCommunicator* nccl = nullptr;
  cudaStream_t compute = nullptr;
  std::vector<std::unique_ptr<HeadClassState>> classes;
  Event start, host_done, done;
  std::mutex mutex;  // one call at a time per runtime: the buffers are shared

  // Staging buffers for one input dtype.
  bool allocated = false;
  DType dtype = DType::BF16, wire = DType::BF16, fwd_wire = DType::BF16;
  DeviceMemory acc_out, acc_lse, acc_max, part_max, acc_dq, acc_dk, acc_dv;
  DeviceMemory host_dk, host_dv;  // MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE: the local stage's dk/dv, added last
  // MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT=0 only: one remote stage's out / lse (fp32), reused by every
  // stage (the compute stream merges it before the next stage writes it).
  DeviceMemory part_out, part_lse;

  // MAGI_ATTENTION_PROFILE_DIR only: timing events, a start and an end per span of one call and the anchor that
  // ties them to wall-clock time. Created on the first profiled call, reused by later ones.
  std::vector<std::unique_ptr<Event>> span_events;
  std::unique_ptr<Event> anchor;

  size_t max_spans() const {
    size_t n = 4;
    for (const auto& c : classes) n += 3 * c->stages.size() + 4;
    return n;
  }

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
  const int32_t cp = nccl.size(), group = rt.heads().heads_q / rt.heads().heads_kv;
  const int64_t local_q = rt.dispatch().q.local_tokens(), local_k = rt.dispatch().k.local_tokens();
  for (const ClassPlan& plan : rt.classes()) {
    auto& c = *state->classes.emplace_back(std::make_unique<HeadClassState>());
    c.kv0 = plan.kv_head_begin;
    c.hkc = plan.kv_head_end - plan.kv_head_begin;
    c.h0 = c.kv0 * group;
    c.hc = c.hkc * group;
    c.whole = c.hkc == rt.heads().heads_kv;
    for (int32_t s = 0; s < plan.plan.num_stages(); ++s) {
      c.stages.push_back(device_routes(plan.plan.routes[rt.rank()][s], cp, local_k));
      c.fetched.push_back(std::make_unique<Event>());
      c.computed.push_back(std::make_unique<Event>());
    }
    c.qo = plan.qo.any;
    if (c.qo) {
      c.qo_routes = device_routes(plan.qo.routes[rt.rank()], cp, local_q);
      c.qo_mask = &plan.qo.masks[rt.rank()];
    }
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
    for (size_t i = 0; i < 2 * st.max_spans(); ++i) st.span_events.push_back(std::make_unique<Event>(cudaEventDefault));
    st.anchor = std::make_unique<Event>(cudaEventDefault);
  }

  // `what` is a literal; `stage` < 0 for spans outside the stages. Returns the span's handle (-1 when off).
  int open(std::string_view what, int64_t stage, std::string_view lane, cudaStream_t stream) {
    if (timeline_ == nullptr) return -1;
    if (2 * (spans_.size() + 1) > st_.span_events.size())
      throw Error("distributed attention profiling: more spans than events (internal)");
    spans_.push_back({what, stage, lane, {}});
    const int span = static_cast<int>(spans_.size()) - 1;
    check(cudaEventRecord(*st_.span_events[2 * span], stream), "cudaEventRecord (profiling)");
    return span;
  }
  // A span of one head class's work: named with its kv heads unless the class is every head.
  int open(std::string_view what, int64_t stage, std::string_view lane, cudaStream_t stream, const HeadClassState& c) {
    const int span = open(what, stage, lane, stream);
    if (span >= 0 && !c.whole)
      spans_.back().heads = " (kv heads " + std::to_string(c.kv0) + "-" + std::to_string(c.kv0 + c.hkc - 1) + ")";
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
      name += s.heads;
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
    std::string heads;
  };
  Timeline* timeline_;
  State& st_;
  std::string_view phase_;
  std::vector<Pending> spans_;
};


// wire / fwd_wire: partial_wire_dtype of the backward / the forward. A call passes its own and the other's as last
// allocated (or the input's), so that alternating forward and backward calls do not reallocate.
void ensure_buffers(const DistAttnRuntime& rt, State& st, DType dtype, DType wire, DType fwd_wire) {
  if (st.allocated && st.dtype == dtype && st.wire == wire && st.fwd_wire == fwd_wire) return;
  const double start = Timeline::now_us();
  const HeadShape& h = rt.heads();
  const int64_t lq = rt.dispatch().q.local_tokens(), lk = rt.dispatch().k.local_tokens();
  const int64_t d = h.head_dim, q_elems = lq * h.heads_q * d, kv_elems = lk * h.heads_kv * d;
  const auto bytes = [](int64_t n, DType t) { return static_cast<size_t>(n * dtype_size(t)); };
  st.allocated = false;
  for (auto& cp : st.classes) {
    HeadClassState& c = *cp;
    const int64_t kv_row = int64_t{c.hkc} * d, q_row = int64_t{c.hc} * d;
    for (auto* list : {&c.send_k, &c.send_v, &c.k, &c.v, &c.part_dk, &c.part_dv, &c.reduce_k, &c.reduce_v})
      list->clear();
    for (const StageRoutes& stage : c.stages) {
      c.send_k.emplace_back(bytes(stage.total_send * kv_row, dtype));
      c.send_v.emplace_back(bytes(stage.total_send * kv_row, dtype));
      c.k.emplace_back(bytes(stage.total_recv * kv_row, dtype));
      c.v.emplace_back(bytes(stage.total_recv * kv_row, dtype));
      c.part_dk.emplace_back(bytes(stage.total_recv * kv_row, wire));
      c.part_dv.emplace_back(bytes(stage.total_recv * kv_row, wire));
      c.reduce_k.emplace_back(bytes(stage.total_send * kv_row, wire));
      c.reduce_v.emplace_back(bytes(stage.total_send * kv_row, wire));
    }
    for (auto& m : c.heads) m = DeviceMemory();
    for (auto& m : c.acc) m = DeviceMemory();
    if (!c.whole) {
      c.heads[kInQ] = DeviceMemory(bytes(lq * q_row, dtype));
      c.heads[kInK] = DeviceMemory(bytes(lk * kv_row, dtype));
      c.heads[kInV] = DeviceMemory(bytes(lk * kv_row, dtype));
      c.heads[kInOut] = DeviceMemory(bytes(lq * q_row, DType::F32));  // out and dout: q's dtype or fp32
      c.heads[kInDout] = DeviceMemory(bytes(lq * q_row, DType::F32));
      c.heads[kInLse] = DeviceMemory(bytes(lq * c.hc, DType::F32));
      // forward out / lse and backward dq share acc[0]; lse and dk share acc[1] (a call is one or the other)
      c.acc[0] = DeviceMemory(bytes(lq * q_row, DType::F32));
      c.acc[1] = DeviceMemory(bytes(std::max(lq * c.hc, lk * kv_row), DType::F32));
      c.acc[2] = DeviceMemory(bytes(lk * kv_row, DType::F32));
    }
    for (DeviceMemory* m : {&c.qo_send[0], &c.qo_send[1], &c.qo_send[2], &c.qo_send[3], &c.qo_recv[0], &c.qo_recv[1],
                            &c.qo_recv[2], &c.qo_recv[3], &c.qo_part_out, &c.qo_part_lse, &c.qo_ret_out, &c.qo_ret_lse,
                            &c.qo_part_dq, &c.qo_ret_dq, &c.qo_dk, &c.qo_dv})
      *m = DeviceMemory();
    if (c.qo) {
      const int64_t sent = c.qo_routes.total_send, got = c.qo_routes.total_recv;
      for (int i = 0; i < 3; ++i) {  // q; out and dout (q's dtype or fp32)
        c.qo_send[i] = DeviceMemory(bytes(sent * q_row, i == 0 ? dtype : DType::F32));
        c.qo_recv[i] = DeviceMemory(bytes(got * q_row, i == 0 ? dtype : DType::F32));
      }
      c.qo_send[3] = DeviceMemory(bytes(sent * c.hc, DType::F32));
      c.qo_recv[3] = DeviceMemory(bytes(got * c.hc, DType::F32));
      c.qo_part_out = DeviceMemory(bytes(got * q_row, fwd_wire));
      c.qo_part_lse = DeviceMemory(bytes(got * c.hc, DType::F32));
      c.qo_ret_out = DeviceMemory(bytes(sent * q_row, fwd_wire));
      c.qo_ret_lse = DeviceMemory(bytes(sent * c.hc, DType::F32));
      c.qo_part_dq = DeviceMemory(bytes(got * q_row, wire));
      c.qo_ret_dq = DeviceMemory(bytes(sent * q_row, wire));
      c.qo_dk = DeviceMemory(bytes(lk * kv_row, DType::F32));
      c.qo_dv = DeviceMemory(bytes(lk * kv_row, DType::F32));
    }
  }
  st.acc_out = DeviceMemory(bytes(q_elems, DType::F32));
  st.acc_lse = DeviceMemory(bytes(lq * h.heads_q, DType::F32));
  st.acc_max = DeviceMemory(bytes(h.heads_q, DType::F32));
  st.part_max = DeviceMemory(bytes(h.heads_q, DType::F32));
  const bool partials = !rt.forward_inplace_correct();
  st.part_out = DeviceMemory(partials ? bytes(q_elems, DType::F32) : 0);
  st.part_lse = DeviceMemory(partials ? bytes(lq * h.heads_q, DType::F32) : 0);
  st.acc_dq = DeviceMemory(bytes(q_elems, DType::F32));
  st.acc_dk = DeviceMemory(bytes(kv_elems, DType::F32));
  st.acc_dv = DeviceMemory(bytes(kv_elems, DType::F32));
  st.dtype = dtype;
  st.wire = wire;
  st.fwd_wire = fwd_wire;
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

// Heads [first, first + count) of `whole` ([rows, heads, elems_per_head] of esize bytes) to or from the contiguous
// `part` ([rows, count, elems_per_head]).
void copy_heads(const void* whole, void* part, int64_t rows, int32_t heads, int32_t first, int32_t count,
                int64_t head_bytes, bool into_whole, cudaStream_t stream) {
  if (rows == 0 || count == 0) return;
  const size_t whole_pitch = static_cast<size_t>(heads * head_bytes), part_pitch = static_cast<size_t>(count * head_bytes);
  auto* slice = static_cast<char*>(const_cast<void*>(whole)) + first * head_bytes;
  if (into_whole)
    check(cudaMemcpy2DAsync(slice, whole_pitch, part, part_pitch, part_pitch, static_cast<size_t>(rows),
                            cudaMemcpyDeviceToDevice, stream), "cudaMemcpy2DAsync (head class)");
  else
    check(cudaMemcpy2DAsync(part, part_pitch, slice, whole_pitch, part_pitch, static_cast<size_t>(rows),
                            cudaMemcpyDeviceToDevice, stream), "cudaMemcpy2DAsync (head class)");
}

// One NCCL group of all-to-all-v's with the same row counts per rank: (send, recv, row bytes) each.
struct RowExchange {
  const void* send;
  void* recv;
  int64_t row_bytes;
};
void exchange_rows(State& st, const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                   std::initializer_list<RowExchange> buffers, const char* what) {
  const cudaStream_t comm = st.nccl->comm_stream();
  if (ncclGroupStart() != ncclSuccess) throw comm::CommError("ncclGroupStart failed");
  for (const RowExchange& b : buffers) {
    const auto send = times(send_rows, b.row_bytes), recv = times(recv_rows, b.row_bytes);
    st.nccl->enqueue_all_to_all_v(b.send, send, displacements(send), b.recv, recv, displacements(recv), comm);
  }
  st.nccl->await_launch(ncclGroupEnd(), what);  // non-blocking: enqueued only after this
}

// The class's tensors: the caller's when the class is every head, else its contiguous head copies.
struct ClassTensors {
  TensorView q, k, v, out, dout, lse;
};

// On the comm stream, for every class in order: its head copies, the q/out route's cast (q, and with `backward`
// out, dout and lse) and its kv fetches (gather the rows each peer needs, one NCCL group per stage for k and v).
// Class c's inputs are ready at c.inputs_ready, its cast at c.qo_cast, stage s's kv at c.fetched[s].
std::vector<ClassTensors> enqueue_inputs(const DistAttnRuntime& rt, State& st, const TensorView& q, const TensorView& k,
                                         const TensorView& v, const TensorView* out, const TensorView* dout,
                                         const TensorView* lse, Tracer& trace) {
  const cudaStream_t comm = st.nccl->comm_stream();
  const int64_t lq = rt.dispatch().q.local_tokens(), lk = rt.dispatch().k.local_tokens();
  const int32_t d = rt.heads().head_dim, hq = rt.heads().heads_q, hkv = rt.heads().heads_kv;
  const int64_t esize = dtype_size(q.dtype);
  std::vector<ClassTensors> tensors;
  for (auto& cp : st.classes) {
    HeadClassState& c = *cp;
    ClassTensors& t = tensors.emplace_back();
    const bool backward = out != nullptr;
    if (c.whole) {
      t = {q, k, v, backward ? *out : TensorView{}, backward ? *dout : TensorView{}, backward ? *lse : TensorView{}};
    } else {
      const auto take = [&](ClassInput i, const TensorView& whole, int64_t rows, int32_t heads, int32_t first,
                            int32_t count, int64_t head_bytes) {
        copy_heads(whole.data, c.heads[i].get(), rows, heads, first, count, head_bytes, false, comm);
        return whole.ndim == 3 ? device_view(c.heads[i].get(), whole.dtype, {rows, count, d}, st.device)
                               : device_view(c.heads[i].get(), whole.dtype, {rows, count}, st.device);
      };
      t.q = take(kInQ, q, lq, hq, c.h0, c.hc, d * esize);
      t.k = take(kInK, k, lk, hkv, c.kv0, c.hkc, d * esize);
      t.v = take(kInV, v, lk, hkv, c.kv0, c.hkc, d * esize);
      if (backward) {
        t.out = take(kInOut, *out, lq, hq, c.h0, c.hc, d * dtype_size(out->dtype));
        t.dout = take(kInDout, *dout, lq, hq, c.h0, c.hc, d * dtype_size(dout->dtype));
        t.lse = take(kInLse, *lse, lq, hq, c.h0, c.hc, 4);
      }
    }
    check(cudaEventRecord(c.inputs_ready, comm), "cudaEventRecord");
    if (c.qo) {
      const int span = trace.open("q/out route: exchange of q rows", -1, "comm", comm, c);
      const StageRoutes& r = c.qo_routes;
      const int64_t q_row = int64_t{c.hc} * d * esize;
      const int32_t* index = r.send_index.as<int32_t>();
      gather_rows(t.q.data, index, r.total_send, q_row, c.qo_send[0].get(), comm);
      if (backward) {
        const int64_t out_row = int64_t{c.hc} * d * dtype_size(out->dtype);
        const int64_t dout_row = int64_t{c.hc} * d * dtype_size(dout->dtype);
        gather_rows(t.out.data, index, r.total_send, out_row, c.qo_send[1].get(), comm);
        gather_rows(t.dout.data, index, r.total_send, dout_row, c.qo_send[2].get(), comm);
        gather_rows(t.lse.data, index, r.total_send, int64_t{c.hc} * 4, c.qo_send[3].get(), comm);
        exchange_rows(st, r.send_rows, r.recv_rows,
                      {{c.qo_send[0].get(), c.qo_recv[0].get(), q_row},
                       {c.qo_send[1].get(), c.qo_recv[1].get(), out_row},
                       {c.qo_send[2].get(), c.qo_recv[2].get(), dout_row},
                       {c.qo_send[3].get(), c.qo_recv[3].get(), int64_t{c.hc} * 4}},
                      "q/out route cast");
      } else {
        exchange_rows(st, r.send_rows, r.recv_rows, {{c.qo_send[0].get(), c.qo_recv[0].get(), q_row}},
                      "q/out route cast");
      }
      trace.close(span, comm);
      check(cudaEventRecord(c.qo_cast, comm), "cudaEventRecord");
    }
    const int64_t row_bytes = int64_t{c.hkc} * d * esize;
    for (size_t s = 0; s < c.stages.size(); ++s) {
      const int span = trace.open("k/v exchange", static_cast<int64_t>(s), "comm", comm, c);
      const StageRoutes& stage = c.stages[s];
      gather_rows(t.k.data, stage.send_index.as<int32_t>(), stage.total_send, row_bytes, c.send_k[s].get(), comm);
      gather_rows(t.v.data, stage.send_index.as<int32_t>(), stage.total_send, row_bytes, c.send_v[s].get(), comm);
      exchange_rows(st, stage.send_rows, stage.recv_rows,
                    {{c.send_k[s].get(), c.k[s].get(), row_bytes}, {c.send_v[s].get(), c.v[s].get(), row_bytes}},
                    "kv group-cast");
      trace.close(span, comm);
      check(cudaEventRecord(*c.fetched[s], comm), "cudaEventRecord");
    }
  }
  return tensors;
}

// The caller's pending work on its stream precedes ours.
void begin(State& st, cudaStream_t caller) {
  check(cudaEventRecord(st.start, caller), "cudaEventRecord");
  check(cudaStreamWaitEvent(st.compute, st.start, 0), "cudaStreamWaitEvent");
  check(cudaStreamWaitEvent(st.nccl->comm_stream(), st.start, 0), "cudaStreamWaitEvent");
}

void wait(cudaStream_t stream, cudaEvent_t event) { check(cudaStreamWaitEvent(stream, event, 0), "cudaStreamWaitEvent"); }
void record(cudaEvent_t event, cudaStream_t stream) { check(cudaEventRecord(event, stream), "cudaEventRecord"); }

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
  const int32_t hq = h.heads_q, d = h.head_dim, dev = st.device;
  require_device_rows(a.out, "out", lq, 3, dev);
  require_device_rows(a.lse, "lse", lq, 2, dev);
  if (a.lse.dtype != DType::F32) throw InvalidArgument("lse: must be fp32 for device tensors");
  if (a.out.dtype != a.q.dtype && a.out.dtype != DType::F32)
    throw InvalidArgument("out: dtype must be q's or fp32");
  const bool want_max = a.max_logits.ndim != 0;
  const bool with_sink = rt.config().attention.sink_layout != SinkLayout::None;
  const DType fwd_wire = partial_wire_dtype(a.q.dtype, rt.route_options().forward_high_precision, {a.out.dtype});

  std::lock_guard lock(st.mutex);
  DeviceGuard scope(dev);
  const bool kept = st.allocated && st.dtype == a.q.dtype;
  ensure_buffers(rt, st, a.q.dtype, kept ? st.wire : partial_wire_dtype(a.q.dtype, rt.backward_high_precision(), {}),
                 fwd_wire);
  Tracer trace(rt, st, "forward");
  begin(st, caller);
  const cudaStream_t comm = st.nccl->comm_stream(), compute = st.compute;
  const std::vector<ClassTensors> tensors = enqueue_inputs(rt, st, a.q, a.k, a.v, nullptr, nullptr, nullptr, trace);
  if (rt.config().overlap_degree == 0 && !st.classes.front()->stages.empty())
    wait(compute, *st.classes.front()->fetched[0]);

  const RankPlan& mine = rt.mine();
  AttentionOptions options = rt.config().attention;
  // Host stage: own kv, every head (and the sink, counted exactly once) straight into the accumulators.
  if (!mine.host_mask.slices.empty() || with_sink) {
    const int span = trace.open("local attention", -1, "compute", compute);
    ForwardArgs s;
    s.q = a.q;
    s.k = a.k;
    s.v = a.v;
    if (with_sink) s.sink = a.sink;
    s.out = device_view(st.acc_out.get(), DType::F32, {lq, hq, d}, dev);
    s.lse = device_view(st.acc_lse.get(), DType::F32, {lq, hq}, dev);
    if (want_max) s.max_logits = device_view(st.acc_max.get(), DType::F32, {hq}, dev);
    magi::forward(mine.host_mask, s, options, compute);
    trace.close(span, compute);
  } else {
    cuda::fill(st.acc_out.as<float>(), lq * hq * d, 0.f, compute);
    cuda::fill(st.acc_lse.as<float>(), lq * hq, kNegInf, compute);
    cuda::fill(st.acc_max.as<float>(), hq, kNegInf, compute);
  }
  options.sink_layout = SinkLayout::None;
  // In place (MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT=1): each remote stage's kernel merges its result into
  // the fp32 accumulators itself (prev_out / prev_lse); with one class of every head and no q/out route the last
  // one writes the caller's out and lse, so no separate merge or conversion pass. Out of place: each stage writes
  // part_out / part_lse, which lse_merge folds into the accumulators on the same stream; a final conversion writes
  // out and lse. The q/out route's partials come back to their owners and are merged after the class's stages.
  const bool in_place = rt.forward_inplace_correct();
  bool stored = false;
  for (size_t ci = 0; ci < st.classes.size(); ++ci) {
    HeadClassState& c = *st.classes[ci];
    const ClassTensors& t = tensors[ci];
    const std::vector<StagePlan>& stages = rt.classes()[ci].plan.ranks[rt.rank()].stages;
    wait(compute, c.inputs_ready);
    float* acc_out = c.whole ? st.acc_out.as<float>() : c.acc[kAccOut].as<float>();
    float* acc_lse = c.whole ? st.acc_lse.as<float>() : c.acc[kAccLse].as<float>();
    if (!c.whole) {
      copy_heads(st.acc_out.get(), acc_out, lq, hq, c.h0, c.hc, int64_t{d} * 4, false, compute);
      copy_heads(st.acc_lse.get(), acc_lse, lq, hq, c.h0, c.hc, 4, false, compute);
    }
    const TensorView acc_out_view = device_view(acc_out, DType::F32, {lq, c.hc, d}, dev);
    const TensorView acc_lse_view = device_view(acc_lse, DType::F32, {lq, c.hc}, dev);
    const auto stage_max = [&](ForwardArgs& s) {
      if (want_max) s.max_logits = device_view(st.part_max.get(), DType::F32, {c.hc}, dev);
    };
    const auto fold_max = [&] {
      if (want_max) max_into(st.acc_max.as<float>() + c.h0, st.part_max.as<float>(), c.hc, compute);
    };

    // The q/out route: the q rows other ranks sent, against this rank's kv; partial out / lse go back.
    if (c.qo) {
      const int64_t rows = c.qo_routes.total_recv;
      const int span = trace.open("q/out route attention", -1, "compute", compute, c);
      wait(compute, c.qo_cast);
      if (rows > 0 && c.qo_mask->slices.empty()) {  // rows sent for nothing: empty partials (weight 0)
        check(cudaMemsetAsync(c.qo_part_out.get(), 0, static_cast<size_t>(rows * c.hc * d * dtype_size(fwd_wire)), compute),
              "cudaMemsetAsync");
        cuda::fill(c.qo_part_lse.as<float>(), rows * c.hc, kNegInf, compute);
      } else if (rows > 0) {
        ForwardArgs s;
        s.q = device_view(c.qo_recv[0].get(), a.q.dtype, {rows, c.hc, d}, dev);
        s.k = t.k;
        s.v = t.v;
        s.out = device_view(c.qo_part_out.get(), fwd_wire, {rows, c.hc, d}, dev);
        s.lse = device_view(c.qo_part_lse.get(), DType::F32, {rows, c.hc}, dev);
        stage_max(s);
        magi::forward(*c.qo_mask, s, options, compute);
        fold_max();
      }
      trace.close(span, compute);
      record(c.qo_computed, compute);
      wait(comm, c.qo_computed);
      const int back = trace.open("q/out route: partial out / lse back", -1, "comm", comm, c);
      const int64_t out_row = int64_t{c.hc} * d * dtype_size(fwd_wire);
      exchange_rows(st, c.qo_routes.recv_rows, c.qo_routes.send_rows,
                    {{c.qo_part_out.get(), c.qo_ret_out.get(), out_row},
                     {c.qo_part_lse.get(), c.qo_ret_lse.get(), int64_t{c.hc} * 4}},
                    "q/out route reduce");
      trace.close(back, comm);
      record(c.qo_returned, comm);
    }

    const bool direct = c.whole && !c.qo && in_place;  // the last stage may write the caller's out / lse
    int64_t last = -1;
    for (size_t stage = 0; stage < stages.size(); ++stage)
      if (direct && !stages[stage].mask.slices.empty()) last = static_cast<int64_t>(stage);
    for (size_t stage = 0; stage < stages.size(); ++stage) {
      wait(compute, *c.fetched[stage]);
      const StagePlan& sp = stages[stage];
      if (sp.mask.slices.empty()) continue;
      const int64_t rows = sp.buffer_rows;
      const bool final_stage = static_cast<int64_t>(stage) == last;
      const int span = trace.open(in_place ? "attention" : "attention + merge", static_cast<int64_t>(stage), "compute",
                                  compute, c);
      ForwardArgs s;
      s.q = t.q;
      s.k = device_view(c.k[stage].get(), a.q.dtype, {rows, c.hkc, d}, dev);
      s.v = device_view(c.v[stage].get(), a.q.dtype, {rows, c.hkc, d}, dev);
      if (in_place) {
        s.out = final_stage ? a.out : acc_out_view;
        s.lse = final_stage ? a.lse : acc_lse_view;
        s.prev_out = acc_out_view;
        s.prev_lse = acc_lse_view;
      } else {
        s.out = device_view(st.part_out.get(), DType::F32, {lq, c.hc, d}, dev);
        s.lse = device_view(st.part_lse.get(), DType::F32, {lq, c.hc}, dev);
      }
      stage_max(s);
      magi::forward(sp.mask, s, options, compute);
      if (!in_place)
        lse_merge(acc_out, acc_lse, st.part_out.as<float>(), st.part_lse.as<float>(), lq * c.hc, d, compute);
      fold_max();
      trace.close(span, compute);
    }
    stored = stored || last >= 0;
    if (c.qo) {
      wait(compute, c.qo_returned);
      const int span = trace.open("q/out route: merge of returned partials", -1, "compute", compute, c);
      merge_rows(acc_out, acc_lse, lq, c.hc, d, c.qo_routes.reduce_offsets.as<int32_t>(),
                 c.qo_routes.reduce_index.as<int32_t>(), c.qo_ret_out.get(), element(fwd_wire),
                 c.qo_ret_lse.as<float>(), compute);
      trace.close(span, compute);
    }
    if (!c.whole) {
      copy_heads(st.acc_out.get(), acc_out, lq, hq, c.h0, c.hc, int64_t{d} * 4, true, compute);
      copy_heads(st.acc_lse.get(), acc_lse, lq, hq, c.h0, c.hc, 4, true, compute);
    }
  }
  if (!stored) {
    const int span = trace.open("store out / lse", -1, "compute", compute);
    convert(st.acc_out.as<float>(), a.out.data, element(a.out.dtype), lq * hq * d, compute);
    convert(st.acc_lse.as<float>(), a.lse.data, element(DType::F32), lq * hq, compute);
    trace.close(span, compute);
  }
  record(st.done, compute);
  wait(caller, st.done);
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
  if (a.lse.dtype != DType::F32) throw InvalidArgument("lse: must be fp32 for device tensors");
  for (auto [t, name] : {std::pair{&a.out, "out"}, {&a.dout, "dout"}})
    if (t->dtype != a.q.dtype && t->dtype != DType::F32)
      throw InvalidArgument(std::string(name) + ": dtype must be q's or fp32");
  for (auto [t, name] : {std::pair{&a.dq, "dq"}, {&a.dk, "dk"}, {&a.dv, "dv"}})
    if (t->dtype != a.q.dtype && t->dtype != DType::F32)
      throw InvalidArgument(std::string(name) + ": dtype must be q's or fp32");
  const bool with_sink = rt.config().attention.sink_layout != SinkLayout::None;
  const DType wire = partial_wire_dtype(a.q.dtype, rt.backward_high_precision(), {a.dq.dtype, a.dk.dtype, a.dv.dtype});
  const int64_t kv_row = int64_t{hkv} * d;

  std::lock_guard lock(st.mutex);
  DeviceGuard scope(dev);
  const bool kept = st.allocated && st.dtype == a.q.dtype;
  ensure_buffers(rt, st, a.q.dtype, wire,
                 kept ? st.fwd_wire : partial_wire_dtype(a.q.dtype, rt.route_options().forward_high_precision, {}));
  Tracer trace(rt, st, "backward");
  begin(st, caller);
  const cudaStream_t comm = st.nccl->comm_stream(), compute = st.compute;
  const std::vector<ClassTensors> tensors = enqueue_inputs(rt, st, a.q, a.k, a.v, &a.out, &a.dout, &a.lse, trace);
  if (rt.config().overlap_degree == 0 && !st.classes.front()->stages.empty())
    wait(compute, *st.classes.front()->fetched[0]);

  const RankPlan& mine = rt.mine();
  const AttentionOptions local_options = rt.config().attention;
  // The local stage (own kv, every head, and the sink) runs first, hiding the first fetch; with
  // MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE last, hiding the last dk/dv reduction instead: then it adds its dq into the
  // running sum and writes dk/dv to buffers of its own, added once the reductions are done (they write the dk/dv
  // accumulators on the comm stream meanwhile).
  const bool any_stage = std::any_of(st.classes.begin(), st.classes.end(), [](const auto& c) { return !c->stages.empty(); });
  const bool hide_tail = env::get_bool("MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE") && any_stage;
  const bool host_work = !mine.host_mask.slices.empty() || with_sink;
  if (hide_tail && host_work && st.host_dk.get() == nullptr && lk * kv_row > 0) {
    st.host_dk = DeviceMemory(static_cast<size_t>(lk * kv_row) * sizeof(float));
    st.host_dv = DeviceMemory(static_cast<size_t>(lk * kv_row) * sizeof(float));
  }
  const auto local_stage = [&](bool last) {
    const int span = trace.open("local attention", -1, "compute", compute);
    BackwardArgs s = a;
    s.dq = device_view(st.acc_dq.get(), DType::F32, {lq, hq, d}, dev);
    s.accumulate_dq = last;
    s.dk = device_view((last ? st.host_dk : st.acc_dk).get(), DType::F32, {lk, hkv, d}, dev);
    s.dv = device_view((last ? st.host_dv : st.acc_dv).get(), DType::F32, {lk, hkv, d}, dev);
    magi::backward(mine.host_mask, s, local_options, compute);
    trace.close(span, compute);
  };
  if (host_work && !hide_tail) {
    local_stage(false);
  } else {
    cuda::fill(st.acc_dq.as<float>(), lq * hq * d, 0.f, compute);
    cuda::fill(st.acc_dk.as<float>(), lk * kv_row, 0.f, compute);
    cuda::fill(st.acc_dv.as<float>(), lk * kv_row, 0.f, compute);
  }
  record(st.host_done, compute);
  AttentionOptions options = local_options;
  options.sink_layout = SinkLayout::None;

  // Per class: the q/out route's work (its partial dq goes back to the q owners; its dk/dv are this rank's own),
  // then the kv stages, each stage's partial dk/dv going back to their owners while the next one computes.
  for (size_t ci = 0; ci < st.classes.size(); ++ci) {
    HeadClassState& c = *st.classes[ci];
    const ClassTensors& t = tensors[ci];
    const std::vector<StagePlan>& stages = rt.classes()[ci].plan.ranks[rt.rank()].stages;
    const int64_t c_kv_row = int64_t{c.hkc} * d, wire_row = c_kv_row * dtype_size(wire);
    wait(compute, c.inputs_ready);
    float* acc_dq = c.whole ? st.acc_dq.as<float>() : c.acc[kAccDq].as<float>();
    float* acc_dk = c.whole ? st.acc_dk.as<float>() : c.acc[kAccDk].as<float>();
    float* acc_dv = c.whole ? st.acc_dv.as<float>() : c.acc[kAccDv].as<float>();
    if (!c.whole) {
      copy_heads(st.acc_dq.get(), acc_dq, lq, hq, c.h0, c.hc, int64_t{d} * 4, false, compute);
      copy_heads(st.acc_dk.get(), acc_dk, lk, hkv, c.kv0, c.hkc, int64_t{d} * 4, false, compute);
      copy_heads(st.acc_dv.get(), acc_dv, lk, hkv, c.kv0, c.hkc, int64_t{d} * 4, false, compute);
    }
    record(c.accumulators_ready, compute);

    if (c.qo) {
      const int64_t rows = c.qo_routes.total_recv;
      const int span = trace.open("q/out route attention", -1, "compute", compute, c);
      wait(compute, c.qo_cast);
      c.qo_ran = rows > 0 && !c.qo_mask->slices.empty();
      if (c.qo_ran) {
      BackwardArgs s = a;
      s.sink = {};
      s.dsink = {};
      s.accumulate_dq = false;
      s.q = device_view(c.qo_recv[0].get(), a.q.dtype, {rows, c.hc, d}, dev);
      s.out = device_view(c.qo_recv[1].get(), a.out.dtype, {rows, c.hc, d}, dev);
      s.dout = device_view(c.qo_recv[2].get(), a.dout.dtype, {rows, c.hc, d}, dev);
      s.lse = device_view(c.qo_recv[3].get(), DType::F32, {rows, c.hc}, dev);
      s.k = t.k;
      s.v = t.v;
      s.dq = device_view(c.qo_part_dq.get(), wire, {rows, c.hc, d}, dev);
      s.dk = device_view(c.qo_dk.get(), DType::F32, {lk, c.hkc, d}, dev);
      s.dv = device_view(c.qo_dv.get(), DType::F32, {lk, c.hkc, d}, dev);
      magi::backward(*c.qo_mask, s, options, compute);
      } else if (rows > 0) {  // rows sent for nothing: zero partial dq
        check(cudaMemsetAsync(c.qo_part_dq.get(), 0, static_cast<size_t>(rows * c.hc * d * dtype_size(wire)), compute),
              "cudaMemsetAsync");
      }
      trace.close(span, compute);
      record(c.qo_computed, compute);
      wait(comm, c.qo_computed);
      const int back = trace.open("q/out route: partial dq back", -1, "comm", comm, c);
      exchange_rows(st, c.qo_routes.recv_rows, c.qo_routes.send_rows,
                    {{c.qo_part_dq.get(), c.qo_ret_dq.get(), int64_t{c.hc} * d * dtype_size(wire)}},
                    "q/out route reduce");
      trace.close(back, comm);
      record(c.qo_returned, comm);
    }

    for (size_t stage = 0; stage < stages.size(); ++stage) {
      wait(compute, *c.fetched[stage]);
      const StagePlan& sp = stages[stage];
      const int64_t rows = sp.buffer_rows;
      if (!sp.mask.slices.empty()) {
        const int span = trace.open("attention", static_cast<int64_t>(stage), "compute", compute, c);
        BackwardArgs s = a;
        s.sink = {};
        s.dsink = {};
        s.q = t.q;
        s.out = t.out;
        s.dout = t.dout;
        s.lse = t.lse;
        s.k = device_view(c.k[stage].get(), a.q.dtype, {rows, c.hkc, d}, dev);
        s.v = device_view(c.v[stage].get(), a.q.dtype, {rows, c.hkc, d}, dev);
        s.dq = device_view(acc_dq, DType::F32, {lq, c.hc, d}, dev);
        s.accumulate_dq = true;  // the kernels add into the running sum (no partial buffer, no add pass)
        s.dk = device_view(c.part_dk[stage].get(), wire, {rows, c.hkc, d}, dev);
        s.dv = device_view(c.part_dv[stage].get(), wire, {rows, c.hkc, d}, dev);
        magi::backward(sp.mask, s, options, compute);
        trace.close(span, compute);
      } else if (rows > 0) {
        check(cudaMemsetAsync(c.part_dk[stage].get(), 0, static_cast<size_t>(rows * wire_row), compute), "cudaMemsetAsync");
        check(cudaMemsetAsync(c.part_dv[stage].get(), 0, static_cast<size_t>(rows * wire_row), compute), "cudaMemsetAsync");
      }
      record(*c.computed[stage], compute);

      // Partial dk/dv back to their owners: the stage's cast in reverse, then a fixed-order sum.
      const StageRoutes& routes = c.stages[stage];
      wait(comm, *c.computed[stage]);
      const int reduce_span = trace.open("dk/dv reduce", static_cast<int64_t>(stage), "comm", comm, c);
      exchange_rows(st, routes.recv_rows, routes.send_rows,
                    {{c.part_dk[stage].get(), c.reduce_k[stage].get(), wire_row},
                     {c.part_dv[stage].get(), c.reduce_v[stage].get(), wire_row}},
                    "dk/dv group-reduce");
      if (stage == 0) wait(comm, c.accumulators_ready);  // after the local stage and the class's copies
      sum_rows(acc_dk, lk, c_kv_row, routes.reduce_offsets.as<int32_t>(), routes.reduce_index.as<int32_t>(),
               c.reduce_k[stage].get(), element(wire), comm);
      sum_rows(acc_dv, lk, c_kv_row, routes.reduce_offsets.as<int32_t>(), routes.reduce_index.as<int32_t>(),
               c.reduce_v[stage].get(), element(wire), comm);
      trace.close(reduce_span, comm);
    }
    record(c.reduced, comm);
    if (c.qo) {  // the partial dq of this rank's rows computed elsewhere, in source order
      wait(compute, c.qo_returned);
      sum_rows(acc_dq, lq, int64_t{c.hc} * d, c.qo_routes.reduce_offsets.as<int32_t>(),
               c.qo_routes.reduce_index.as<int32_t>(), c.qo_ret_dq.get(), element(wire), compute);
    }
    if (!c.whole) copy_heads(st.acc_dq.get(), acc_dq, lq, hq, c.h0, c.hc, int64_t{d} * 4, true, compute);
  }
  if (hide_tail && host_work) local_stage(true);
  // dq is complete once the last stage has computed: its conversion runs while the dk/dv reduce is on the wire.
  const int store_span = trace.open("store dq / dk / dv", -1, "compute", compute);
  convert(st.acc_dq.as<float>(), a.dq.data, element(a.dq.dtype), lq * hq * d, compute);
  for (auto& cp : st.classes) {  // the classes' dk / dv: reductions done, the q/out route's own part, back in place
    HeadClassState& c = *cp;
    wait(compute, c.reduced);
    float* acc_dk = c.whole ? st.acc_dk.as<float>() : c.acc[kAccDk].as<float>();
    float* acc_dv = c.whole ? st.acc_dv.as<float>() : c.acc[kAccDv].as<float>();
    if (c.qo && c.qo_ran) {
      add_into(acc_dk, c.qo_dk.as<float>(), lk * c.hkc * d, compute);
      add_into(acc_dv, c.qo_dv.as<float>(), lk * c.hkc * d, compute);
    }
    if (!c.whole) {
      copy_heads(st.acc_dk.get(), acc_dk, lk, hkv, c.kv0, c.hkc, int64_t{d} * 4, true, compute);
      copy_heads(st.acc_dv.get(), acc_dv, lk, hkv, c.kv0, c.hkc, int64_t{d} * 4, true, compute);
    }
  }
  if (hide_tail && host_work) {
    add_into(st.acc_dk.as<float>(), st.host_dk.as<float>(), lk * kv_row, compute);
    add_into(st.acc_dv.as<float>(), st.host_dv.as<float>(), lk * kv_row, compute);
  }
  convert(st.acc_dk.as<float>(), a.dk.data, element(a.dk.dtype), lk * kv_row, compute);
  convert(st.acc_dv.as<float>(), a.dv.data, element(a.dv.dtype), lk * kv_row, compute);
  trace.close(store_span, compute);
  record(st.done, compute);
  wait(caller, st.done);
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
