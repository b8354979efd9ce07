// magi::forward / magi::backward for Python: the caller (python/magi_attn) allocates the outputs in its
// framework and passes every array; this layer only turns them into TensorViews and options. Validation is the
// C++ API's. The GIL is released while the call runs.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>

#include "arrays.hpp"
#include "magi/attention.hpp"
#include "magi/error.hpp"

namespace magi::python {

namespace {

AttentionOptions options_of(std::optional<double> softmax_scale, double softcap, const std::string& sink_layout,
                            bool has_sink, const std::string& backend, std::optional<bool> deterministic) {
  AttentionOptions o;
  o.softmax_scale = softmax_scale;
  o.softcap = softcap;
  o.sink_layout = has_sink ? parse_sink_layout(sink_layout, "sink_layout") : SinkLayout::None;
  if (has_sink && o.sink_layout == SinkLayout::None)
    throw InvalidArgument("sink_layout: 'none' given with a sink (allowed: sh, ssh)");
  o.backend = parse_backend(backend, "backend");
  o.deterministic = deterministic;
  return o;
}

// Scratch from the caller's allocator (any float array; its bytes count).
Workspace workspace_of(nb::handle w) {
  if (w.is_none()) return {};
  const TensorView v = view_of(w, "workspace", true);
  return {v.data, v.nbytes()};
}

void forward(const Mask& mask, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
             nb::handle lse, nb::handle max_logits, nb::handle sink,
             nb::handle prev_out, nb::handle prev_lse,
             std::optional<double> softmax_scale, double softcap, const std::string& sink_layout,
             const std::string& backend, std::optional<bool> deterministic, nb::handle workspace,
             uintptr_t stream) {
  ForwardArgs a = forward_args(q, k, v, out, lse, max_logits, sink);
  a.prev_out = optional_view(prev_out, "prev_out", false);
  a.prev_lse = optional_view(prev_lse, "prev_lse", false);
  a.workspace = workspace_of(workspace);
  const AttentionOptions o = options_of(softmax_scale, softcap, sink_layout, !sink.is_none(), backend, deterministic);
  nb::gil_scoped_release release;
  magi::forward(mask, a, o, reinterpret_cast<StreamHandle>(stream));
}

void backward(const Mask& mask, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
              nb::handle lse, nb::handle dout, nb::handle dq, nb::handle dk, nb::handle dv,
              nb::handle sink, nb::handle dsink,
              std::optional<double> softmax_scale, double softcap, const std::string& sink_layout,
              const std::string& backend, std::optional<bool> deterministic, bool accumulate_dq,
              nb::handle workspace, uintptr_t stream) {
  BackwardArgs a = backward_args(q, k, v, out, lse, dout, dq, dk, dv, sink, dsink);
  a.accumulate_dq = accumulate_dq;
  a.workspace = workspace_of(workspace);
  const AttentionOptions o = options_of(softmax_scale, softcap, sink_layout, !sink.is_none(), backend, deterministic);
  nb::gil_scoped_release release;
  magi::backward(mask, a, o, reinterpret_cast<StreamHandle>(stream));
}

}  // namespace

void bind_attention(nb::module_& m) {
  m.def("forward", &forward, nb::arg("mask"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("lse"), nb::arg("max_logits").none(), nb::arg("sink").none(), nb::arg("prev_out").none(),
        nb::arg("prev_lse").none(), nb::arg("softmax_scale").none(), nb::arg("softcap"), nb::arg("sink_layout"),
        nb::arg("backend"), nb::arg("deterministic").none(), nb::arg("workspace").none(), nb::arg("stream"));
  m.def("backward", &backward, nb::arg("mask"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("lse"), nb::arg("dout"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::arg("sink").none(),
        nb::arg("dsink").none(), nb::arg("softmax_scale").none(), nb::arg("softcap"), nb::arg("sink_layout"),
        nb::arg("backend"), nb::arg("deterministic").none(), nb::arg("accumulate_dq"), nb::arg("workspace").none(),
        nb::arg("stream"));
  // Scratch bytes the GPU call needs from the caller's allocator (0 on the CPU).
  m.def(
      "forward_workspace_bytes",
      [](nb::handle q, const std::string& backend) {
        ForwardArgs a;
        a.q = view_of(q, "q", false);
        AttentionOptions o;
        o.backend = parse_backend(backend, "backend");
        return workspace_bytes(a, o);
      },
      nb::arg("q"), nb::arg("backend"));
  m.def(
      "backward_workspace_bytes",
      [](nb::handle q, nb::handle dout, nb::handle dq, const std::string& backend,
         std::optional<bool> deterministic) {
        BackwardArgs a;
        a.q = view_of(q, "q", false);
        a.dout = view_of(dout, "do", false);
        a.dq = view_of(dq, "dq", true);
        AttentionOptions o;
        o.backend = parse_backend(backend, "backend");
        o.deterministic = deterministic;
        return workspace_bytes(a, o);
      },
      nb::arg("q"), nb::arg("dout"), nb::arg("dq"), nb::arg("backend"), nb::arg("deterministic").none());
  m.def(
      "resolve_backend",
      [](const std::string& backend, const std::string& device) {
        const Device d = device == "cuda" ? Device{DeviceType::CUDA, 0} : Device{DeviceType::CPU, 0};
        AttentionOptions o;
        o.backend = parse_backend(backend, "backend");
        return std::string(to_string(resolve_backend(o, d)));
      },
      nb::arg("backend"), nb::arg("device"));
}

}  // namespace magi::python
