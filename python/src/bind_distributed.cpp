// Context parallelism for Python: communicators (NCCL from a unique id; a host engine whose collectives a
// Python object performs, e.g. through torch.distributed with gloo), runtime keys, dispatch / undispatch and
// distributed attention (magi/dist.hpp).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "magi/comm.hpp"
#include "magi/dist.hpp"
#include "magi/error.hpp"

namespace magi::python {

namespace {

using Bytes = nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>;

// A numpy view (no copy) of host bytes for the Python side of a collective; valid while the collective runs.
nb::object bytes_view(const void* data, int64_t bytes) {
  return nb::cast(Bytes(const_cast<void*>(data), {static_cast<size_t>(bytes)}, nb::handle()), nb::rv_policy::reference);
}

nb::list int_list(std::span<const int64_t> values) {
  nb::list out;
  for (int64_t v : values) out.append(v);
  return out;
}

// Runs a Python callable of the engine; a Python exception becomes CommError (the communicator's contract).
template <class F>
auto call_engine(const char* what, F&& f) {
  try {
    return f();
  } catch (nb::python_error& e) {
    throw comm::CommError(std::string("host communicator: ") + what + " failed: " + e.what());
  }
}

class PythonRequest final : public comm::Request {
 public:
  PythonRequest(nb::object work, double timeout, std::vector<std::byte> staging, void* recv,
                std::vector<int64_t> counts, std::vector<int64_t> displs)
      : work_(std::move(work)), timeout_(timeout), staging_(std::move(staging)), recv_(recv),
        counts_(std::move(counts)), displs_(std::move(displs)) {}
  ~PythonRequest() override {
    if (!nb::is_alive()) {  // interpreter gone (exit): nothing to wait for, nothing to release
      (void)work_.release();
      return;
    }
    if (work_.is_valid()) {
      try {
        wait();
      } catch (...) {
      }
    }
  }
  void wait() override {
    if (!work_.is_valid()) return;
    {
      nb::gil_scoped_acquire gil;
      nb::object work = std::move(work_);
      call_engine("all_to_all_v", [&] { return work.attr("wait")(timeout_); });
    }
    // Received packed (the engine's layout): spread to the caller's displacements.
    if (!staging_.empty()) {
      int64_t at = 0;
      for (size_t r = 0; r < counts_.size(); ++r) {
        std::memcpy(static_cast<std::byte*>(recv_) + displs_[r], staging_.data() + at, static_cast<size_t>(counts_[r]));
        at += counts_[r];
      }
    }
  }

 private:
  nb::object work_;
  double timeout_;
  std::vector<std::byte> staging_;
  void* recv_;
  std::vector<int64_t> counts_, displs_;
};

bool packed(std::span<const int64_t> counts, std::span<const int64_t> displs) {
  int64_t at = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    if (displs[r] != at) return false;
    at += counts[r];
  }
  return true;
}

// Host memory; the collectives are methods of a Python engine object:
//   all_to_all_v(send: uint8[n], send_counts: list, recv: uint8[m], recv_counts: list, ) -> work with wait(timeout)
//   allgather(send: uint8[b], recv: uint8[size * b]) (blocking), barrier()
// with packed buffers (rank r's part at the sum of the earlier counts).
class PythonCommunicator final : public comm::Communicator {
 public:
  PythonCommunicator(nb::object engine, int32_t rank, int32_t size, std::string name)
      : engine_(std::move(engine)), rank_(rank), size_(size), name_(std::move(name)) {}
  ~PythonCommunicator() override {
    if (!nb::is_alive()) {  // destroyed after the interpreter (a cached runtime at exit): leave the object be
      (void)engine_.release();
      return;
    }
    nb::gil_scoped_acquire gil;
    engine_.reset();
  }

  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  Device device() const override { return Device{DeviceType::CPU, 0}; }
  std::string describe() const override { return name_ + ":" + std::to_string(size_); }

  std::unique_ptr<comm::Request> start_all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                                    std::span<const int64_t> send_displs, void* recv,
                                                    std::span<const int64_t> recv_counts,
                                                    std::span<const int64_t> recv_displs) override {
    const int64_t send_total = std::accumulate(send_counts.begin(), send_counts.end(), int64_t{0});
    const int64_t recv_total = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});
    std::vector<std::byte> send_staging, recv_staging;
    const void* send_packed = send;
    void* recv_packed = recv;
    if (!packed(send_counts, send_displs)) {
      send_staging.resize(static_cast<size_t>(send_total));
      int64_t at = 0;
      for (size_t r = 0; r < send_counts.size(); ++r) {
        std::memcpy(send_staging.data() + at, static_cast<const std::byte*>(send) + send_displs[r],
                    static_cast<size_t>(send_counts[r]));
        at += send_counts[r];
      }
      send_packed = send_staging.data();
    }
    if (!packed(recv_counts, recv_displs)) {
      recv_staging.resize(static_cast<size_t>(recv_total));
      recv_packed = recv_staging.data();
    }
    nb::gil_scoped_acquire gil;
    nb::object work = call_engine("all_to_all_v", [&] {
      return engine_.attr("all_to_all_v")(bytes_view(send_packed, send_total), int_list(send_counts),
                                          bytes_view(recv_packed, recv_total), int_list(recv_counts));
    });
    // The send staging must outlive the exchange: the engine may read it until wait().
    auto request = std::make_unique<PythonRequest>(std::move(work), timeout(), std::move(recv_staging), recv,
                                                   std::vector<int64_t>(recv_counts.begin(), recv_counts.end()),
                                                   std::vector<int64_t>(recv_displs.begin(), recv_displs.end()));
    if (!send_staging.empty()) {
      request->wait();  // simple and rare (the library's own collectives send packed buffers)
    }
    return request;
  }

  void allgather(const void* send, int64_t bytes, void* recv) override {
    nb::gil_scoped_acquire gil;
    call_engine("allgather", [&] {
      return engine_.attr("allgather")(bytes_view(send, bytes), bytes_view(recv, bytes * size_));
    });
  }
  void barrier() override {
    nb::gil_scoped_acquire gil;
    call_engine("barrier", [&] { return engine_.attr("barrier")(); });
  }

 private:
  nb::object engine_;
  int32_t rank_, size_;
  std::string name_;
};

dist::DispatchAlgorithm parse_dispatch(const std::string& text) {
  if (text == "greedy") return dist::DispatchAlgorithm::Greedy;
  if (text == "greedy_swap") return dist::DispatchAlgorithm::GreedySwap;
  if (text == "locality") return dist::DispatchAlgorithm::Locality;
  throw InvalidArgument("dispatch: unknown algorithm '" + text + "' (allowed: greedy, greedy_swap, locality)");
}

dist::Axis parse_axis(const std::string& text) {
  if (text == "q") return dist::Axis::Q;
  if (text == "k") return dist::Axis::K;
  throw InvalidArgument("axis: unknown axis '" + text + "' (allowed: q, k)");
}

}  // namespace

void bind_distributed(nb::module_& m) {
  nb::class_<comm::Communicator>(m, "Communicator")
      .def_prop_ro("rank", &comm::Communicator::rank)
      .def_prop_ro("size", &comm::Communicator::size)
      .def("describe", &comm::Communicator::describe);

  m.def(
      "python_communicator",
      [](nb::object engine, int32_t rank, int32_t size, const std::string& name) -> std::shared_ptr<comm::Communicator> {
        if (size < 1 || rank < 0 || rank >= size)
          throw InvalidArgument("communicator: rank " + std::to_string(rank) + " of size " + std::to_string(size) +
                                " (allowed: 0 <= rank < size)");
        return std::make_shared<PythonCommunicator>(std::move(engine), rank, size, name);
      },
      nb::arg("engine"), nb::arg("rank"), nb::arg("size"), nb::arg("name"));
  m.def("nccl_unique_id", [] {
    const comm::NcclUniqueId id = comm::nccl_unique_id();
    return nb::bytes(id.bytes.data(), id.bytes.size());
  });
  m.def(
      "nccl_communicator",
      [](nb::bytes id_bytes, int32_t rank, int32_t size, int32_t device, double timeout) {
        comm::NcclUniqueId id;
        if (id_bytes.size() != id.bytes.size())
          throw InvalidArgument("nccl id: expected " + std::to_string(id.bytes.size()) + " bytes, got " +
                                std::to_string(id_bytes.size()));
        std::memcpy(id.bytes.data(), id_bytes.c_str(), id.bytes.size());
        nb::gil_scoped_release release;  // the initialisation waits for every rank
        return comm::nccl_communicator(id, rank, size, device, timeout);
      },
      nb::arg("id"), nb::arg("rank"), nb::arg("size"), nb::arg("device"), nb::arg("timeout"));

  nb::class_<dist::RuntimeKey>(m, "RuntimeKey")
      .def_prop_ro("local_q_tokens", &dist::RuntimeKey::local_q_tokens)
      .def_prop_ro("local_k_tokens", &dist::RuntimeKey::local_k_tokens)
      .def("summary", [](const dist::RuntimeKey& key) { return key.summary().to_text(); })
      .def(
          "position_ids",
          [](const dist::RuntimeKey& key, const std::string& axis) { return dist::position_ids(key, parse_axis(axis)); },
          nb::arg("axis"));

  m.def(
      "make_runtime_key",
      [](const Mask& mask, int32_t heads_q, int32_t heads_kv, int32_t head_dim,
         std::shared_ptr<comm::Communicator> comm, int32_t chunk_size, int32_t overlap_degree,
         const std::string& dispatch, std::optional<double> softmax_scale, double softcap,
         const std::string& sink_layout, const std::string& backend, std::optional<bool> deterministic,
         double timeout) {
        dist::DistConfig c;
        c.chunk_size = chunk_size;
        c.overlap_degree = overlap_degree;
        c.algorithm = parse_dispatch(dispatch);
        c.attention.softmax_scale = softmax_scale;
        c.attention.softcap = softcap;
        c.attention.sink_layout = parse_sink_layout(sink_layout, "sink_layout");
        c.attention.backend = parse_backend(backend, "backend");
        c.attention.deterministic = deterministic;
        c.comm_timeout_seconds = timeout;
        nb::gil_scoped_release release;  // collective: host engines call back into Python
        return dist::make_runtime_key(mask, {heads_q, heads_kv, head_dim}, std::move(comm), c);
      },
      nb::arg("mask"), nb::arg("heads_q"), nb::arg("heads_kv"), nb::arg("head_dim"), nb::arg("comm"),
      nb::arg("chunk_size"), nb::arg("overlap_degree"), nb::arg("dispatch"), nb::arg("softmax_scale").none(),
      nb::arg("softcap"), nb::arg("sink_layout"), nb::arg("backend"), nb::arg("deterministic").none(),
      nb::arg("timeout"));

  m.def(
      "roll",
      [](const dist::RuntimeKey& key, const std::string& axis, nb::handle local, nb::handle out, int64_t shift,
         uintptr_t stream) {
        const TensorView l = view_of(local, "x", false), o = view_of(out, "out", true);
        nb::gil_scoped_release release;
        dist::roll(key, parse_axis(axis), l, o, shift, reinterpret_cast<StreamHandle>(stream));
      },
      nb::arg("key"), nb::arg("axis"), nb::arg("x"), nb::arg("out"), nb::arg("shift"), nb::arg("stream"));

  m.def(
      "make_runtime_key_for_new_mask",
      [](const dist::RuntimeKey& key, const Mask& mask) {
        nb::gil_scoped_release release;  // collective: host engines call back into Python
        return dist::make_runtime_key_for_new_mask(key, mask);
      },
      nb::arg("key"), nb::arg("mask"));

  m.def(
      "dispatch",
      [](const dist::RuntimeKey& key, const std::string& axis, nb::handle global, nb::handle local,
         uintptr_t stream) {
        const TensorView g = view_of(global, "x", false), l = view_of(local, "local", true);
        nb::gil_scoped_release release;
        dist::dispatch(key, parse_axis(axis), g, l, reinterpret_cast<StreamHandle>(stream));
      },
      nb::arg("key"), nb::arg("axis"), nb::arg("x"), nb::arg("local"), nb::arg("stream"));
  m.def(
      "undispatch",
      [](const dist::RuntimeKey& key, const std::string& axis, nb::handle local, nb::handle global,
         uintptr_t stream) {
        const TensorView l = view_of(local, "x", false), g = view_of(global, "global", true);
        nb::gil_scoped_release release;
        dist::undispatch(key, parse_axis(axis), l, g, reinterpret_cast<StreamHandle>(stream));
      },
      nb::arg("key"), nb::arg("axis"), nb::arg("x"), nb::arg("global"), nb::arg("stream"));

  m.def(
      "calc_attn",
      [](const dist::RuntimeKey& key, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
         nb::handle lse, nb::handle max_logits, nb::handle sink,
         uintptr_t stream) {
        const ForwardArgs a = forward_args(q, k, v, out, lse, max_logits, sink);
        nb::gil_scoped_release release;
        dist::calc_attn(key, a, reinterpret_cast<StreamHandle>(stream));
      },
      nb::arg("key"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"),
      nb::arg("max_logits").none(), nb::arg("sink").none(), nb::arg("stream"));
  m.def(
      "calc_attn_backward",
      [](const dist::RuntimeKey& key, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
         nb::handle lse, nb::handle dout, nb::handle dq, nb::handle dk, nb::handle dv,
         nb::handle sink, nb::handle dsink, uintptr_t stream) {
        const BackwardArgs a = backward_args(q, k, v, out, lse, dout, dq, dk, dv, sink, dsink);
        nb::gil_scoped_release release;
        dist::calc_attn_backward(key, a, reinterpret_cast<StreamHandle>(stream));
      },
      nb::arg("key"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("dout"),
      nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::arg("sink").none(), nb::arg("dsink").none(),
      nb::arg("stream"));
  m.def("clear_runtime_cache", [](std::shared_ptr<comm::Communicator> comm) {
    if (comm) dist::clear_runtime_cache(*comm);
    else dist::clear_runtime_cache();
  }, nb::arg("comm").none());
  m.def("runtime_cache_size", &dist::runtime_cache_size);
}

}  // namespace magi::python
