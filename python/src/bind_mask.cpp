// magi::Mask for Python: construction from range arrays, the builders of magi/mask.hpp, JSON, description
// and pictures.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "magi/error.hpp"
#include "magi/mask.hpp"
#include "mask/png.hpp"

namespace magi::python {

namespace nb = nanobind;

namespace {

using IndexPairs = nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Indices = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

int32_t to_index(int64_t value, const std::string& name) {
  if (value < INT32_MIN || value > INT32_MAX)
    throw InvalidArgument(name + ": " + std::to_string(value) + " does not fit int32 (masks index tokens with int32)");
  return static_cast<int32_t>(value);
}

int32_t to_index(int64_t value, const char* ranges, size_t row) {
  return to_index(value, std::string(ranges) + "[" + std::to_string(row) + "]");
}

// q_ranges / k_ranges [n, 2], types [n] (ids 0..3), checked and validated (SPEC section 2). Totals default to
// the largest range end.
Mask from_arrays(const IndexPairs& q, const IndexPairs& k, const Indices& types, std::optional<int64_t> total_q,
                 std::optional<int64_t> total_k) {
  if (q.shape(1) != 2 || k.shape(1) != 2)
    throw InvalidArgument("q_ranges, k_ranges: expected shape [n, 2] (one [start, end) pair per slice)");
  const size_t n = q.shape(0);
  if (k.shape(0) != n || types.shape(0) != n)
    throw InvalidArgument("q_ranges, k_ranges, types: need one entry per slice each, got " + std::to_string(n) + ", " +
                          std::to_string(k.shape(0)) + " and " + std::to_string(types.shape(0)));
  Mask mask;
  mask.slices.resize(n);
  int64_t max_q = 0, max_k = 0;
  for (size_t i = 0; i < n; ++i) {
    Slice& s = mask.slices[i];
    s.q = {to_index(q(i, 0), "q_ranges", i), to_index(q(i, 1), "q_ranges", i)};
    s.k = {to_index(k(i, 0), "k_ranges", i), to_index(k(i, 1), "k_ranges", i)};
    const int64_t t = types(i);
    if (t < 0 || t > 3)
      throw InvalidArgument("types[" + std::to_string(i) + "]: unknown mask type " + std::to_string(t) +
                            " (allowed: 0 full, 1 causal, 2 inv_causal, 3 bi_causal)");
    s.type = static_cast<MaskType>(t);
    max_q = std::max<int64_t>(max_q, s.q.end);
    max_k = std::max<int64_t>(max_k, s.k.end);
  }
  mask.total_q = to_index(total_q.value_or(max_q), "total_q");
  mask.total_k = to_index(total_k.value_or(max_k), "total_k");
  validate(mask);
  return mask;
}

nb::ndarray<nb::numpy, int32_t> ranges_of(const Mask& m, bool q) {
  auto* data = new int32_t[std::max<size_t>(2 * m.slices.size(), 1)];
  for (size_t i = 0; i < m.slices.size(); ++i) {
    const Range& r = q ? m.slices[i].q : m.slices[i].k;
    data[2 * i] = r.start;
    data[2 * i + 1] = r.end;
  }
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
  return nb::ndarray<nb::numpy, int32_t>(data, {m.slices.size(), 2}, owner);
}

nb::ndarray<nb::numpy, int32_t> types_of(const Mask& m) {
  auto* data = new int32_t[std::max<size_t>(m.slices.size(), 1)];
  for (size_t i = 0; i < m.slices.size(); ++i) data[i] = static_cast<int32_t>(m.slices[i].type);
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
  return nb::ndarray<nb::numpy, int32_t>(data, {m.slices.size()}, owner);
}

// Window sides: negative = unbounded; beyond int32 is as good as unbounded too.
int32_t window_arg(int64_t value) { return value < 0 ? -1 : static_cast<int32_t>(std::min<int64_t>(value, INT32_MAX)); }

// A size that must fit int32 and be at least `least` (1 for a block: the message names the range that passes).
int32_t size_arg(int64_t value, const char* name, int64_t least = 0) {
  if (value < least || value > INT32_MAX)
    throw InvalidArgument(std::string(name) + ": " + std::to_string(value) + " is out of range (allowed: " +
                          std::to_string(least) + " .. 2^31-1)");
  return static_cast<int32_t>(value);
}

}  // namespace

void bind_mask(nb::module_& m) {
  nb::class_<Mask>(m, "Mask")
      .def_static("from_arrays", &from_arrays, nb::arg("q_ranges"), nb::arg("k_ranges"), nb::arg("types"),
                  nb::arg("total_q").none(), nb::arg("total_k").none())
      .def_static("from_json", &mask_from_json, nb::arg("text"))
      .def("to_json", &mask_to_json)
      .def("describe", [](const Mask& mask) { return describe(mask); })
      .def("to_png", [](const Mask& mask, const std::string& path) { picture::write_mask_png(mask, path); },
           nb::arg("path"))
      .def_prop_ro("total_q", [](const Mask& mask) { return mask.total_q; })
      .def_prop_ro("total_k", [](const Mask& mask) { return mask.total_k; })
      .def_prop_ro("area", &Mask::area)
      .def_prop_ro("density", &Mask::density)
      .def_prop_ro("q_ranges", [](const Mask& mask) { return ranges_of(mask, true); }, nb::rv_policy::move)
      .def_prop_ro("k_ranges", [](const Mask& mask) { return ranges_of(mask, false); }, nb::rv_policy::move)
      .def_prop_ro("attn_type_map", &types_of, nb::rv_policy::move)
      .def("__len__", [](const Mask& mask) { return mask.slices.size(); })
      .def("__eq__", [](const Mask& a, const Mask& b) {
        return a.slices == b.slices && a.total_q == b.total_q && a.total_k == b.total_k;
      });

  nb::module_ b = m.def_submodule("masks", "The builders of include/magi/mask.hpp");
  using Cu = std::vector<int32_t>;
  b.def("full", [](int64_t q, int64_t k) {
    const int32_t tq = size_arg(q, "total_q");
    return masks::full(tq, size_arg(k, "total_k"));
  });
  b.def("causal", [](int64_t q, int64_t k) {
    const int32_t tq = size_arg(q, "total_q");
    return masks::causal(tq, size_arg(k, "total_k"));
  });
  b.def("varlen_full", [](const Cu& q, const Cu& k) { return masks::varlen_full(q, k); });
  b.def("varlen_causal", [](const Cu& q, const Cu& k) { return masks::varlen_causal(q, k); });
  b.def("sliding_window", [](int64_t total, int64_t left, int64_t right) {
    return masks::sliding_window(size_arg(total, "total"), window_arg(left), window_arg(right));
  });
  b.def("varlen_sliding_window", [](const Cu& cu, int64_t left, int64_t right) {
    return masks::varlen_sliding_window(cu, window_arg(left), window_arg(right));
  });
  b.def("block_causal", [](int64_t total, int64_t block) {
    const int32_t t = size_arg(total, "total");
    return masks::block_causal(t, size_arg(block, "block", 1));
  });
  b.def("varlen_block_causal", [](const Cu& cu, int64_t block) {
    return masks::varlen_block_causal(cu, size_arg(block, "block", 1));
  });
  b.def("shared_question", [](int64_t question, const Cu& answers) {
    return masks::shared_question(size_arg(question, "question"), answers);
  });
  b.def("global_sliding_window", [](int64_t total, int64_t global, int64_t window) {
    const int32_t t = size_arg(total, "total"), g = size_arg(global, "global_tokens");
    return masks::global_sliding_window(t, g, size_arg(window, "window"));
  });
}

}  // namespace magi::python
