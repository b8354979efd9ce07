// The API edge: validate every argument (naming it), resolve options and backend, fetch the cached plan,
// dispatch. Engines behind this file trust their inputs.
#include "magi/attention.hpp"

#include <cmath>
#include <list>
#include <mutex>
#include <sstream>
#include <string>

#include "common/lru_cache.hpp"
#include "common/lse_merge.hpp"
#include "cpu/engine.hpp"
#include "cpu/pack.hpp"
#include "magi/env.hpp"
#include "magi/error.hpp"

#if MAGI_ATTN_CUDA_BACKEND  // defined by src/cuda when the kernels are part of the library
#include "cuda/backend.hpp"
#include "cuda/reference/reference_engine.hpp"
#endif

namespace magi {

std::string_view to_string(SinkLayout layout) {
  switch (layout) {
    case SinkLayout::None: return "none";
    case SinkLayout::SH: return "sh";
    case SinkLayout::SSH: return "ssh";
  }
  return "?";
}

SinkLayout parse_sink_layout(std::string_view text, std::string_view what) {
  if (text == "none") return SinkLayout::None;
  if (text == "sh") return SinkLayout::SH;
  if (text == "ssh") return SinkLayout::SSH;
  throw InvalidArgument(std::string(what) + ": unknown sink layout '" + std::string(text) +
                        "' (allowed: sh, ssh, none)");
}

std::string_view to_string(Backend backend) {
  switch (backend) {
    case Backend::Auto: return "auto";
    case Backend::Cpu: return "cpu";
    case Backend::Cuda: return "cuda";
    case Backend::Reference: return "reference";
  }
  return "?";
}

Backend parse_backend(std::string_view text, std::string_view what) {
  if (text == "auto") return Backend::Auto;
  if (text == "cpu") return Backend::Cpu;
  if (text == "cuda") return Backend::Cuda;
  if (text == "reference") return Backend::Reference;
  throw InvalidArgument(std::string(what) + ": unknown backend '" + std::string(text) +
                        "' (allowed: auto, cpu, cuda, reference)");
}

Backend resolve_backend(const AttentionOptions& options, Device device) {
  env::ensure_validated();
  Backend backend = options.backend;
  if (backend == Backend::Auto) {
    if (env::kernel_backend() == env::KernelBackend::Sdpa) backend = Backend::Reference;
    else backend = device.type == DeviceType::CUDA ? Backend::Cuda : Backend::Cpu;
  }
  if (backend == Backend::Cpu && device.type != DeviceType::CPU)
    throw InvalidArgument("backend cpu needs host tensors, but the tensors are on a CUDA device");
  if (backend == Backend::Cuda && device.type != DeviceType::CUDA)
    throw InvalidArgument("backend cuda needs CUDA device tensors, but the tensors are on the CPU");
#if !MAGI_ATTN_CUDA_BACKEND
  if (device.type == DeviceType::CUDA)
    throw NotAvailable("CUDA tensors given, but this build has no CUDA backend (allowed: CPU tensors)");
#endif
  return backend;
}

namespace {

// ---- argument validation ----

struct Shapes {
  int64_t tq = 0, tk = 0, hq = 0, hkv = 0, d = 0;
};

std::string describe(const TensorView& t) {
  return std::string(to_string(t.dtype)) + " " + shape_string(t);
}

void require_defined(const TensorView& t, const char* name) {
  if (t.ndim == 0) throw InvalidArgument(std::string(name) + " is required but was not given");
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] < 0) throw InvalidArgument(std::string(name) + ": negative dimension in " + shape_string(t));
  if (t.data == nullptr && t.numel() > 0) throw InvalidArgument(std::string(name) + ": null data pointer");
}

void require_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> dims,
                   const char* expected) {
  require_defined(t, name);
  bool ok = t.ndim == static_cast<int>(dims.size());
  int i = 0;
  for (int64_t d : dims) ok = ok && t.shape[i++] == d;
  if (!ok)
    throw InvalidArgument(std::string(name) + ": expected shape " + expected + " = " +
                          shape_string(TensorView(nullptr, t.dtype, dims)) + ", got " + shape_string(t));
}

void require_dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype == d) return;
  std::string list;
  for (DType d : allowed) list += (list.empty() ? "" : ", ") + std::string(to_string(d));
  throw InvalidArgument(std::string(name) + ": dtype " + std::string(to_string(t.dtype)) +
                        " is not allowed here (allowed: " + list + ")");
}

void require_device(const TensorView& t, const char* name, Device device) {
  if (!(t.device == device))
    throw InvalidArgument(std::string(name) + ": all tensors must be on the same device as q");
}

#if MAGI_ATTN_CUDA_BACKEND
// The GPU kernels read [T, H, D] rows in 16-byte pieces (D is a multiple of 8) and write outputs by element
// pairs: inputs (and out, which the backward reads) need 16-byte aligned addresses, as every CUDA allocation
// has; gradients need two elements' alignment.
void require_aligned(const TensorView& t, const char* name, size_t bytes) {
  const auto address = reinterpret_cast<uintptr_t>(t.data);
  if (address % bytes != 0)
    throw InvalidArgument(std::string(name) + ": the cuda backend needs an address aligned to " +
                          std::to_string(bytes) + " bytes, got one " + std::to_string(address % bytes) +
                          " bytes past a multiple of " + std::to_string(bytes));
}

bool deterministic_mode(const AttentionOptions& options) {
  return options.deterministic.value_or(env::get_bool("MAGI_ATTENTION_DETERMINISTIC_MODE"));
}

// A caller's workspace: enough bytes, aligned (the kernels store 16-byte vectors into it).
void check_workspace(const Workspace& w, int64_t needed) {
  if (w.data == nullptr) {
    if (w.bytes != 0) throw InvalidArgument("workspace: bytes given without data (allowed: both, or neither)");
    return;
  }
  if (w.bytes < needed)
    throw InvalidArgument("workspace: " + std::to_string(w.bytes) + " bytes given, the call needs " +
                          std::to_string(needed) + " (magi::workspace_bytes)");
  require_aligned(TensorView(w.data, DType::F32, {1}), "workspace", 16);
}
#endif

// Whether two tensors' bytes overlap (host or device addresses alike).
bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.data == nullptr || b.data == nullptr || a.nbytes() == 0 || b.nbytes() == 0) return false;
  const auto a0 = reinterpret_cast<uintptr_t>(a.data), b0 = reinterpret_cast<uintptr_t>(b.data);
  return a0 < b0 + static_cast<uintptr_t>(b.nbytes()) && b0 < a0 + static_cast<uintptr_t>(a.nbytes());
}

// prev_out / prev_lse: both or neither, fp32, the shapes of out / lse, each either the very tensor it is
// merged into or disjoint from every output.
void check_prev(const ForwardArgs& a, const Shapes& s) {
  const bool has_out = a.prev_out.ndim != 0, has_lse = a.prev_lse.ndim != 0;
  if (has_out != has_lse)
    throw InvalidArgument(std::string(has_out ? "prev_lse" : "prev_out") + " is required when " +
                          (has_out ? "prev_out" : "prev_lse") + " is given (a partial result is out and lse)");
  if (!has_out) return;
  require_shape(a.prev_out, "prev_out", {s.tq, s.hq, s.d}, "[Tq, Hq, D] (like out)");
  require_dtype(a.prev_out, "prev_out", {DType::F32});
  require_device(a.prev_out, "prev_out", a.q.device);
  require_shape(a.prev_lse, "prev_lse", {s.tq, s.hq}, "[Tq, Hq] (like lse)");
  require_dtype(a.prev_lse, "prev_lse", {DType::F32});
  require_device(a.prev_lse, "prev_lse", a.q.device);
  const bool out_in_place = a.prev_out.data == a.out.data;
  if (out_in_place && a.out.dtype != DType::F32)
    throw InvalidArgument("prev_out: may be out itself only when out is fp32 (out is " +
                          std::string(to_string(a.out.dtype)) + ")");
  if (!out_in_place && (overlaps(a.prev_out, a.out) || overlaps(a.prev_out, a.lse)))
    throw InvalidArgument("prev_out: overlaps out or lse without being out itself");
  const bool lse_in_place = a.prev_lse.data == a.lse.data;
  if (lse_in_place && a.lse.dtype != DType::F32)
    throw InvalidArgument("prev_lse: may be lse itself only when lse is fp32");
  if (!lse_in_place && (overlaps(a.prev_lse, a.lse) || overlaps(a.prev_lse, a.out)))
    throw InvalidArgument("prev_lse: overlaps out or lse without being lse itself");
}

// CPU engine with a partial result to merge: compute into scratch, then merge row by row (SPEC lse merge).
void cpu_forward_merged(const cpu::Plan& plan, const ForwardArgs& a, const cpu::EngineOptions& eo, const Shapes& s) {
  const int64_t rows = s.tq * s.hq;
  std::vector<unsigned char> out_bytes(static_cast<size_t>(a.out.nbytes())), lse_bytes(static_cast<size_t>(a.lse.nbytes()));
  ForwardArgs scratch = a;
  scratch.out = TensorView(out_bytes.data(), a.out.dtype, {s.tq, s.hq, s.d}, a.out.device);
  scratch.lse = TensorView(lse_bytes.data(), a.lse.dtype, {s.tq, s.hq}, a.lse.device);
  scratch.prev_out = scratch.prev_lse = TensorView();
  cpu::forward(plan, scratch, eo);
  const int d = static_cast<int>(s.d);
#pragma omp parallel for schedule(static)
  for (int64_t rh = 0; rh < rows; ++rh) {
    std::vector<double> mine(static_cast<size_t>(d)), prev(static_cast<size_t>(d));
    double lse_mine = 0, lse_prev = 0;
    cpu::load_row<double>(scratch.lse, rh, 1, 1.0, &lse_mine);
    cpu::load_row<double>(a.prev_lse, rh, 1, 1.0, &lse_prev);
    const MergeWeights<double> w = merge_weights(lse_mine, lse_prev);
    cpu::load_row<double>(scratch.out, rh * d, d, 1.0, mine.data());
    cpu::load_row<double>(a.prev_out, rh * d, d, 1.0, prev.data());
    for (int i = 0; i < d; ++i)
      mine[i] = (w.w1 == 0 ? 0.0 : w.w1 * mine[i]) + (w.w2 == 0 ? 0.0 : w.w2 * prev[i]);
    cpu::store_row<double>(mine.data(), 1.0, a.out, rh * d, d);
    cpu::store_row<double>(&w.lse, 1.0, a.lse, rh, 1);
  }
}

// CPU engine adding into dq: compute dq into scratch, then add (fp32 in, fp32 out; sums in double).
void cpu_backward_accumulating(const cpu::Plan& plan, const BackwardArgs& a, const cpu::EngineOptions& eo,
                               const Shapes& s) {
  const int64_t n = s.tq * s.hq * s.d;
  std::vector<float> part(static_cast<size_t>(n));
  BackwardArgs scratch = a;
  scratch.dq = TensorView(part.data(), DType::F32, {s.tq, s.hq, s.d}, a.dq.device);
  scratch.accumulate_dq = false;
  cpu::backward(plan, scratch, eo);
  float* dq = static_cast<float*>(a.dq.data);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dq[i] = static_cast<float>(double{dq[i]} + part[static_cast<size_t>(i)]);
}

Shapes check_qkv(const Mask& mask, const TensorView& q, const TensorView& k, const TensorView& v) {
  require_defined(q, "q");
  require_defined(k, "k");
  require_defined(v, "v");
  if (q.ndim != 3) throw InvalidArgument("q: expected shape [Tq, Hq, D], got " + shape_string(q));
  if (k.ndim != 3) throw InvalidArgument("k: expected shape [Tk, Hkv, D], got " + shape_string(k));
  Shapes s{q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2]};
  require_dtype(q, "q", {DType::BF16, DType::F16, DType::F32, DType::F64});
  if (k.dtype != q.dtype || v.dtype != q.dtype)
    throw InvalidArgument("k, v: dtype must equal q's (" + std::string(to_string(q.dtype)) + "), got k " +
                          describe(k) + ", v " + describe(v));
  require_shape(k, "k", {s.tk, s.hkv, s.d}, "[Tk, Hkv, D]");
  require_shape(v, "v", {s.tk, s.hkv, s.d}, "[Tk, Hkv, D] (same as k)");
  require_device(k, "k", q.device);
  require_device(v, "v", q.device);
  if (s.hq <= 0 || s.hkv <= 0) throw InvalidArgument("q, k: head counts must be positive, got Hq=" +
                                                     std::to_string(s.hq) + ", Hkv=" + std::to_string(s.hkv));
  if (s.hq % s.hkv != 0)
    throw InvalidArgument("q, k: Hq (" + std::to_string(s.hq) + ") must be a multiple of Hkv (" +
                          std::to_string(s.hkv) + ")");
  if (s.d <= 0 || s.d % 8 != 0)
    throw InvalidArgument("q: head dim D must be a positive multiple of 8, got " + std::to_string(s.d));
  if (s.tq > INT32_MAX || s.tk > INT32_MAX) throw InvalidArgument("q, k: token counts must fit in int32");
  if (mask.total_q != s.tq || mask.total_k != s.tk)
    throw InvalidArgument("mask: total_q x total_k is " + std::to_string(mask.total_q) + " x " +
                          std::to_string(mask.total_k) + " but q and k have " + std::to_string(s.tq) + " x " +
                          std::to_string(s.tk) + " tokens");
  return s;
}

void check_sink(const TensorView& sink, const char* name, SinkLayout layout, const Shapes& s, Device device) {
  if (layout == SinkLayout::None) {
    if (sink.ndim != 0) throw InvalidArgument(std::string(name) + " given but options.sink_layout is none (allowed: sh, ssh)");
    return;
  }
  require_defined(sink, name);
  require_dtype(sink, name, {DType::F32});
  require_device(sink, name, device);
  const int64_t n_sink = layout == SinkLayout::SH ? sink.shape[0] : sink.shape[1];
  if (layout == SinkLayout::SH) require_shape(sink, name, {n_sink, s.hq}, "[S, Hq] (layout sh)");
  else require_shape(sink, name, {s.tq, sink.ndim > 1 ? sink.shape[1] : 0, s.hq}, "[Tq, S, Hq] (layout ssh)");
  if (n_sink < 1) throw InvalidArgument(std::string(name) + ": the number of sink tokens S must be >= 1");
}

cpu::EngineOptions engine_options(const AttentionOptions& o, const Shapes& s, DType dtype, Backend backend) {
  if (o.softmax_scale && !std::isfinite(*o.softmax_scale))
    throw InvalidArgument("softmax_scale must be finite, got " + std::to_string(*o.softmax_scale));
  if (!std::isfinite(o.softcap) || o.softcap < 0)
    throw InvalidArgument("softcap must be finite and >= 0 (0 = off), got " + std::to_string(o.softcap));
  if (o.num_threads < 0) throw InvalidArgument("num_threads must be >= 0 (0 = all cores)");
  cpu::EngineOptions e;
  e.softmax_scale = o.softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(s.d)));
  e.softcap = o.softcap;
  e.sink_layout = o.sink_layout;
  e.accumulate_fp64 = backend == Backend::Reference || dtype == DType::F64;
  e.num_threads = o.num_threads;
  return e;
}

// ---- plan caches: plans are keyed by the full mask, shapes and place (compared exactly, not hashed) ----

struct PlanKey {
  std::vector<Slice> slices;
  int32_t total_q, total_k, hq, hkv, d;
  int32_t device;  // -1 for host plans
  bool operator==(const PlanKey&) const = default;
};
constexpr size_t kPlanCacheCapacity = 16;

PlanKey plan_key(const Mask& mask, const Shapes& s, int32_t device) {
  validate_bounds(mask);  // cheap; protects memory even when the overlap check is cached
  if (env::get_bool("MAGI_ATTENTION_SANITY_CHECK")) validate(mask);
  return {mask.slices, mask.total_q, mask.total_k, static_cast<int32_t>(s.hq), static_cast<int32_t>(s.hkv),
          static_cast<int32_t>(s.d), device};
}

// The plan for (mask, shapes, device) from `cache`, made by make() after the full check (incl. overlap) once
// per distinct mask.
template <class PlanT, class Make>
std::shared_ptr<PlanT> cached_plan(LruCache<PlanKey, PlanT>& cache, const Mask& mask, const Shapes& s, int32_t device,
                                   Make make) {
  return cache.get(plan_key(mask, s, device), [&] {
    validate(mask);
    return make();
  });
}

std::shared_ptr<const cpu::Plan> cpu_plan_for(const Mask& mask, const Shapes& s) {
  static LruCache<PlanKey, const cpu::Plan> cache(kPlanCacheCapacity);
  return cached_plan(cache, mask, s, -1, [&] { return cpu::make_plan(mask, s.hq, s.hkv, s.d); });
}

#if MAGI_ATTN_CUDA_BACKEND
std::shared_ptr<cuda::Plan> cuda_plan_for(const Mask& mask, const Shapes& s, int32_t device) {
  static LruCache<PlanKey, cuda::Plan> cache(kPlanCacheCapacity);
  return cached_plan(cache, mask, s, device, [&] { return cuda::make_plan(mask, s.hq, s.hkv, s.d, device); });
}

// The exact GPU engine (backend reference on device tensors): its own plans (device mask lists, fp64 rows).
// Its plans hold per-call scratch, so they are kept per stream.
std::shared_ptr<cuda::reference::Plan> reference_plan_for(const Mask& mask, const Shapes& s, int32_t device,
                                                          StreamHandle stream) {
  using Keyed = std::pair<PlanKey, StreamHandle>;
  static LruCache<Keyed, cuda::reference::Plan> cache(kPlanCacheCapacity);
  return cache.get(Keyed{plan_key(mask, s, device), stream}, [&] {
    validate(mask);
    return cuda::reference::make_plan(mask, s.hq, s.hkv, s.d, device);
  });
}

cuda::reference::Options reference_options(const cpu::EngineOptions& e) {
  return {e.softmax_scale, e.softcap, e.sink_layout};
}

cuda::Options cuda_options(const cpu::EngineOptions& e, const AttentionOptions& options, bool forward_pass) {
  cuda::Options o;
  o.deterministic = deterministic_mode(options);
  o.softmax_scale = e.softmax_scale;
  o.softcap = e.softcap;
  o.sink_layout = e.sink_layout;
  o.sm_margin = static_cast<int32_t>(env::get_int(forward_pass ? "MAGI_ATTENTION_FFA_FORWARD_SM_MARGIN"
                                                               : "MAGI_ATTENTION_FFA_BACKWARD_SM_MARGIN"));
  o.profile = env::get_bool("MAGI_ATTENTION_PROFILE_MODE");
  return o;
}
#endif

}  // namespace

void forward(const Mask& mask, const ForwardArgs& a, const AttentionOptions& options,
             [[maybe_unused]] StreamHandle stream) {
  env::ensure_validated();
  const Shapes s = check_qkv(mask, a.q, a.k, a.v);
  const Backend backend = resolve_backend(options, a.q.device);
  require_shape(a.out, "out", {s.tq, s.hq, s.d}, "[Tq, Hq, D]");
  require_dtype(a.out, "out", {a.q.dtype, DType::F32});
  require_device(a.out, "out", a.q.device);
  require_shape(a.lse, "lse", {s.tq, s.hq}, "[Tq, Hq]");
  if (a.q.dtype == DType::F64) require_dtype(a.lse, "lse", {DType::F32, DType::F64});
  else require_dtype(a.lse, "lse", {DType::F32});
  require_device(a.lse, "lse", a.q.device);
  check_sink(a.sink, "sink", options.sink_layout, s, a.q.device);
  if (a.max_logits.ndim != 0) {
    require_shape(a.max_logits, "max_logits", {s.hq}, "[Hq]");
    require_dtype(a.max_logits, "max_logits", {DType::F32});
    require_device(a.max_logits, "max_logits", a.q.device);
  }
  check_prev(a, s);
  const bool merge = a.prev_out.ndim != 0;
  const cpu::EngineOptions eo = engine_options(options, s, a.q.dtype, backend);
#if MAGI_ATTN_CUDA_BACKEND
  if (backend == Backend::Cuda) {
    require_dtype(a.q, "q", {DType::BF16, DType::F16});  // the GPU kernels take 16-bit inputs
    for (auto [t, name] : {std::pair{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.out, "out"}})
      require_aligned(*t, name, 16);
    if (merge) require_aligned(a.prev_out, "prev_out", 16);
    const cuda::Options co = cuda_options(eo, options, true);
    check_workspace(a.workspace, cuda::workspace_bytes(a, co));
    cuda::forward(*cuda_plan_for(mask, s, a.q.device.index), a, co, static_cast<cudaStream_t>(stream));
    return;
  }
  if (backend == Backend::Reference && a.q.device.type == DeviceType::CUDA) {
    if (merge) throw NotAvailable("prev_out / prev_lse: the GPU reference engine does not merge partial results "
                                  "(backends cpu and cuda do)");
    cuda::reference::forward(*reference_plan_for(mask, s, a.q.device.index, stream), a, reference_options(eo),
                             static_cast<cudaStream_t>(stream));
    return;
  }
#endif
  if (merge) cpu_forward_merged(*cpu_plan_for(mask, s), a, eo, s);
  else cpu::forward(*cpu_plan_for(mask, s), a, eo);
}

void backward(const Mask& mask, const BackwardArgs& a, const AttentionOptions& options,
              [[maybe_unused]] StreamHandle stream) {
  env::ensure_validated();
  const Shapes s = check_qkv(mask, a.q, a.k, a.v);
  const Backend backend = resolve_backend(options, a.q.device);
  const DType dt = a.q.dtype;
  require_shape(a.out, "out", {s.tq, s.hq, s.d}, "[Tq, Hq, D]");
  require_dtype(a.out, "out", {dt, DType::F32});
  require_shape(a.dout, "dout", {s.tq, s.hq, s.d}, "[Tq, Hq, D]");
  require_dtype(a.dout, "dout", {dt, DType::F32});
  require_shape(a.lse, "lse", {s.tq, s.hq}, "[Tq, Hq]");
  if (dt == DType::F64) require_dtype(a.lse, "lse", {DType::F32, DType::F64});
  else require_dtype(a.lse, "lse", {DType::F32});
  require_shape(a.dq, "dq", {s.tq, s.hq, s.d}, "[Tq, Hq, D] (like q)");
  require_dtype(a.dq, "dq", {dt, DType::F32});
  require_shape(a.dk, "dk", {s.tk, s.hkv, s.d}, "[Tk, Hkv, D] (like k)");
  require_dtype(a.dk, "dk", {dt, DType::F32});
  require_shape(a.dv, "dv", {s.tk, s.hkv, s.d}, "[Tk, Hkv, D] (like v)");
  require_dtype(a.dv, "dv", {dt, DType::F32});
  for (auto [t, name] : {std::pair{&a.out, "out"}, {&a.dout, "dout"}, {&a.lse, "lse"}, {&a.dq, "dq"},
                         {&a.dk, "dk"}, {&a.dv, "dv"}})
    require_device(*t, name, a.q.device);
  check_sink(a.sink, "sink", options.sink_layout, s, a.q.device);
  if (options.sink_layout != SinkLayout::None) {
    require_dtype(a.dsink, "dsink", {DType::F32});
    if (a.dsink.ndim != a.sink.ndim || a.dsink.shape != a.sink.shape)
      throw InvalidArgument("dsink: expected the shape of sink " + shape_string(a.sink) + ", got " +
                            shape_string(a.dsink));
    require_defined(a.dsink, "dsink");
    require_device(a.dsink, "dsink", a.q.device);
  } else if (a.dsink.ndim != 0) {
    throw InvalidArgument("dsink given but options.sink_layout is none (allowed: sh, ssh)");
  }
  if (a.accumulate_dq) {
    if (a.dq.dtype != DType::F32)
      throw InvalidArgument("dq: accumulate_dq needs an fp32 dq, got " + describe(a.dq));
    for (auto [t, name] : {std::pair{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.out, "out"}, {&a.dout, "dout"},
                           {&a.lse, "lse"}, {&a.dk, "dk"}, {&a.dv, "dv"}})
      if (overlaps(a.dq, *t)) throw InvalidArgument(std::string("dq: accumulate_dq needs a dq that does not overlap ") + name);
  }
  const cpu::EngineOptions eo = engine_options(options, s, dt, backend);
#if MAGI_ATTN_CUDA_BACKEND
  if (backend == Backend::Cuda) {
    require_dtype(a.q, "q", {DType::BF16, DType::F16});
    for (auto [t, name] : {std::pair{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.out, "out"}, {&a.dout, "dout"}})
      require_aligned(*t, name, 16);
    for (auto [t, name] : {std::pair{&a.dq, "dq"}, {&a.dk, "dk"}, {&a.dv, "dv"}})
      require_aligned(*t, name, static_cast<size_t>(2 * dtype_size(t->dtype)));
    const cuda::Options co = cuda_options(eo, options, false);
    check_workspace(a.workspace, cuda::workspace_bytes(a, co));
    cuda::backward(*cuda_plan_for(mask, s, a.q.device.index), a, co, static_cast<cudaStream_t>(stream));
    return;
  }
  if (backend == Backend::Reference && a.q.device.type == DeviceType::CUDA) {
    if (a.accumulate_dq)
      throw NotAvailable("accumulate_dq: the GPU reference engine does not accumulate (backends cpu and cuda do)");
    cuda::reference::backward(*reference_plan_for(mask, s, a.q.device.index, stream), a, reference_options(eo),
                              static_cast<cudaStream_t>(stream));
    return;
  }
#endif
  if (a.accumulate_dq) cpu_backward_accumulating(*cpu_plan_for(mask, s), a, eo, s);
  else cpu::backward(*cpu_plan_for(mask, s), a, eo);
}

int64_t workspace_bytes(const ForwardArgs& a, const AttentionOptions& options) {
  env::ensure_validated();
  require_defined(a.q, "q");
  if (resolve_backend(options, a.q.device) != Backend::Cuda) return 0;
#if MAGI_ATTN_CUDA_BACKEND
  return cuda::workspace_bytes(a, cuda::Options{});
#else
  return 0;
#endif
}

int64_t workspace_bytes(const BackwardArgs& a, const AttentionOptions& options) {
  env::ensure_validated();
  require_defined(a.q, "q");
  if (a.q.ndim != 3) throw InvalidArgument("q: expected shape [Tq, Hq, D], got " + shape_string(a.q));
  if (resolve_backend(options, a.q.device) != Backend::Cuda) return 0;
  require_defined(a.dout, "dout");
  require_defined(a.dq, "dq");
#if MAGI_ATTN_CUDA_BACKEND
  cuda::Options o;
  o.deterministic = deterministic_mode(options);
  return cuda::workspace_bytes(a, o);
#else
  return 0;
#endif
}

}  // namespace magi
