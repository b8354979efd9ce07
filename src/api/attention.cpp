// The API edge: validate every argument (naming it), resolve options and backend, hand the call to the
// backend's engine (src/api/engine.hpp), which checks only what is its own.
#include "magi/attention.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "api/checks.hpp"
#include "api/engine.hpp"
#include "magi/env.hpp"
#include "magi/error.hpp"

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
  if (backend != Backend::Auto && backend != Backend::Cpu && backend != Backend::Cuda && backend != Backend::Reference)
    throw InvalidArgument("options.backend: unknown value " + std::to_string(static_cast<int>(backend)) +
                          " (allowed: auto, cpu, cuda, reference)");
  if (backend == Backend::Auto) {
    if (env::kernel_backend() == env::KernelBackend::Sdpa) backend = Backend::Reference;
    else backend = device.type == DeviceType::CUDA ? Backend::Cuda : Backend::Cpu;
  }
  if (backend == Backend::Cpu && device.type != DeviceType::CPU)
    throw InvalidArgument("backend cpu needs host tensors, but the tensors are on a CUDA device");
  if (backend == Backend::Cuda && device.type != DeviceType::CUDA)
    throw InvalidArgument("backend cuda needs CUDA device tensors, but the tensors are on the CPU");
  (void)api::engine(backend, device);  // NotAvailable where this build lacks it
  return backend;
}

namespace {

using api::require_defined;
using api::require_device;
using api::require_dtype;
using api::require_shape;
using api::Shapes;

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
                          api::describe(k) + ", v " + api::describe(v));
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
                          std::to_string(s.tk) + " tokens (a mask's totals default to its largest range ends: give "
                          "total_q / total_k where rows or keys past them are uncovered)");
  return s;
}

void check_sink(const TensorView& sink, const char* name, SinkLayout layout, const Shapes& s, Device device) {
  if (layout != SinkLayout::None && layout != SinkLayout::SH && layout != SinkLayout::SSH)
    throw InvalidArgument("options.sink_layout: unknown value " + std::to_string(static_cast<int>(layout)) +
                          " (allowed: none, sh, ssh)");
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

// prev_out / prev_lse: both or neither, fp32 (fp64 too for fp64 inputs, as lse), the shapes of out / lse, each
// either the very tensor it is merged into or disjoint from every output.
void check_prev(const ForwardArgs& a, const Shapes& s) {
  const bool has_out = a.prev_out.ndim != 0, has_lse = a.prev_lse.ndim != 0;
  if (has_out != has_lse)
    throw InvalidArgument(std::string(has_out ? "prev_lse" : "prev_out") + " is required when " +
                          (has_out ? "prev_out" : "prev_lse") + " is given (a partial result is out and lse)");
  if (!has_out) return;
  // fp64 partials keep the merge of fp64 inputs (CPU engine only) at fp64.
  const auto require_partial_dtype = [&](const TensorView& t, const char* name) {
    if (a.q.dtype == DType::F64) require_dtype(t, name, {DType::F32, DType::F64});
    else require_dtype(t, name, {DType::F32});
  };
  require_shape(a.prev_out, "prev_out", {s.tq, s.hq, s.d}, "[Tq, Hq, D] (like out)");
  require_partial_dtype(a.prev_out, "prev_out");
  require_device(a.prev_out, "prev_out", a.q.device);
  require_shape(a.prev_lse, "prev_lse", {s.tq, s.hq}, "[Tq, Hq] (like lse)");
  require_partial_dtype(a.prev_lse, "prev_lse");
  require_device(a.prev_lse, "prev_lse", a.q.device);
  const bool out_in_place = a.prev_out.data == a.out.data;
  if (out_in_place && a.out.dtype != a.prev_out.dtype)
    throw InvalidArgument("prev_out: may be out itself only when out has its dtype (out is " +
                          std::string(to_string(a.out.dtype)) + ", prev_out " +
                          std::string(to_string(a.prev_out.dtype)) + ")");
  if (!out_in_place && (api::overlaps(a.prev_out, a.out) || api::overlaps(a.prev_out, a.lse)))
    throw InvalidArgument("prev_out: overlaps out or lse without being out itself");
  const bool lse_in_place = a.prev_lse.data == a.lse.data;
  if (lse_in_place && a.lse.dtype != a.prev_lse.dtype)
    throw InvalidArgument("prev_lse: may be lse itself only when lse has its dtype");
  if (!lse_in_place && (api::overlaps(a.prev_lse, a.lse) || api::overlaps(a.prev_lse, a.out)))
    throw InvalidArgument("prev_lse: overlaps out or lse without being lse itself");
  if (api::overlaps(a.prev_out, a.max_logits) || api::overlaps(a.prev_lse, a.max_logits))
    throw InvalidArgument("max_logits: overlaps prev_out or prev_lse");
}

// The options of one call, defaults and environment applied.
api::Call make_call(const AttentionOptions& o, const Shapes& s, DType dtype, Backend backend,
                    const api::Engine& engine, StreamHandle stream) {
  api::require_valid_scalars(o);
  if (o.num_threads < 0 || o.num_threads > kMaxThreads)
    throw InvalidArgument("num_threads: " + std::to_string(o.num_threads) + " (allowed: 0 = all cores, 1 .. " +
                          std::to_string(kMaxThreads) + ")");
  api::Call c;
  c.shapes = s;
  c.softmax_scale = o.softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(s.d)));
  c.softcap = o.softcap;
  c.sink_layout = o.sink_layout;
  c.deterministic = o.deterministic.value_or(env::get_bool("MAGI_ATTENTION_DETERMINISTIC_MODE"));
  c.range_merge = api::range_merge_for(env::get_bool("MAGI_ATTENTION_AUTO_RANGE_MERGE"), c.deterministic, engine);
  c.exact = backend == Backend::Reference || dtype == DType::F64;
  c.num_threads = o.num_threads;
  c.stream = stream;
  return c;
}

}  // namespace

void forward(const Mask& mask, const ForwardArgs& a, const AttentionOptions& options, StreamHandle stream) {
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
  api::require_disjoint({{&a.out, "out"}, {&a.lse, "lse"}, {&a.max_logits, "max_logits"}},
                        {{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.sink, "sink"}});
  const api::Engine& engine = api::engine(backend, a.q.device);
  engine.forward(mask, a, make_call(options, s, a.q.dtype, backend, engine, stream));
}

void backward(const Mask& mask, const BackwardArgs& a, const AttentionOptions& options, StreamHandle stream) {
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
    if (a.dsink.ndim != a.sink.ndim ||
        !std::equal(a.dsink.shape.begin(), a.dsink.shape.begin() + a.dsink.ndim, a.sink.shape.begin()))
      throw InvalidArgument("dsink: expected the shape of sink " + shape_string(a.sink) + ", got " +
                            shape_string(a.dsink));
    require_defined(a.dsink, "dsink");
    require_device(a.dsink, "dsink", a.q.device);
  } else if (a.dsink.ndim != 0) {
    throw InvalidArgument("dsink given but options.sink_layout is none (allowed: sh, ssh)");
  }
  if (a.accumulate_dq && a.dq.dtype != DType::F32)
    throw InvalidArgument("dq: accumulate_dq needs an fp32 dq, got " + api::describe(a.dq));
  api::require_disjoint({{&a.dq, "dq"}, {&a.dk, "dk"}, {&a.dv, "dv"}, {&a.dsink, "dsink"}},
                        {{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.out, "out"}, {&a.dout, "dout"}, {&a.lse, "lse"},
                         {&a.sink, "sink"}});
  const api::Engine& engine = api::engine(backend, a.q.device);
  engine.backward(mask, a, make_call(options, s, dt, backend, engine, stream));
}

// Scratch sizes read the shapes, dtypes and device only: no mask, so the call's plan-independent options.
int64_t workspace_bytes(const ForwardArgs& a, const AttentionOptions& options) {
  env::ensure_validated();
  require_defined(a.q, "q");
  if (a.q.ndim != 3) throw InvalidArgument("q: expected shape [Tq, Hq, D], got " + shape_string(a.q));
  const Backend backend = resolve_backend(options, a.q.device);
  const Shapes s{a.q.shape[0], 0, a.q.shape[1], 0, a.q.shape[2]};
  const api::Engine& engine = api::engine(backend, a.q.device);
  return engine.workspace_bytes(a, make_call(options, s, a.q.dtype, backend, engine, nullptr));
}

int64_t workspace_bytes(const BackwardArgs& a, const AttentionOptions& options) {
  env::ensure_validated();
  require_defined(a.q, "q");
  if (a.q.ndim != 3) throw InvalidArgument("q: expected shape [Tq, Hq, D], got " + shape_string(a.q));
  const Backend backend = resolve_backend(options, a.q.device);
  if (backend == Backend::Cuda) {
    require_defined(a.dout, "dout");
    require_defined(a.dq, "dq");
  }
  const Shapes s{a.q.shape[0], 0, a.q.shape[1], 0, a.q.shape[2]};
  const api::Engine& engine = api::engine(backend, a.q.device);
  return engine.workspace_bytes(a, make_call(options, s, a.q.dtype, backend, engine, nullptr));
}

Mask planned_mask(const Mask& mask, const AttentionOptions& options, Device device) {
  env::ensure_validated();
  validate(mask);
  const api::Engine& engine = api::engine(resolve_backend(options, device), device);
  const bool deterministic = options.deterministic.value_or(env::get_bool("MAGI_ATTENTION_DETERMINISTIC_MODE"));
  const auto merge = api::range_merge_for(env::get_bool("MAGI_ATTENTION_AUTO_RANGE_MERGE"), deterministic, engine);
  return merge ? merge_slices(mask, *merge) : mask;
}

}  // namespace magi
