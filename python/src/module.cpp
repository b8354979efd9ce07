// The extension module magi_attn._C: the C++ API (include/magi/) for the Python package. Errors keep their
// meaning: InvalidArgument -> ValueError, NotAvailable -> NotImplementedError, CommError -> RuntimeError
// (magi_attn.CommError), other library errors -> RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "arrays.hpp"
#include "magi/comm.hpp"
#include "magi/env.hpp"
#include "magi/error.hpp"

#if MAGI_ATTN_CUDA_BACKEND
#include "cuda/check.hpp"
#endif

namespace magi::python {

void bind_mask(nb::module_& m);
void bind_attention(nb::module_& m);
void bind_distributed(nb::module_& m);

namespace {

// Text from the library, which may quote bytes that are not UTF-8 (an environment value, a cut JSON fragment):
// invalid bytes shown as \xNN rather than a UnicodeDecodeError in place of the real message.
nb::str lenient_str(const std::string& text) {
  return nb::steal<nb::str>(PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "backslashreplace"));
}

void set_error(PyObject* type, const char* what) {
  const nb::str message = lenient_str(what);
  PyErr_SetObject(type, message.ptr());
}

void bind_env(nb::module_& m) {
  m.def("env_table", [] { return lenient_str(env::table_with_values()); },
        "Every MAGI_ATTENTION_* variable with its value (magi-attn env).");
  m.def("env_validate", &env::ensure_validated, "Checks the environment now (raises ValueError on a bad value).");
  m.def("env_reset", &env::reset_for_testing, "Re-reads the environment on the next call (tests).");
  m.def("env_get", [](const std::string& name) { return lenient_str(env::get_string(name)); }, nb::arg("name"),
        "A registered variable's value as text.");
}

}  // namespace

}  // namespace magi::python

NB_MODULE(_C, m) {
  namespace nb = nanobind;
  using namespace magi::python;
  m.doc() = "magi-attn: flexible-mask attention (C++ core)";
  // Plans, keys and communicators cached by the Python layer live until interpreter exit: not leaks.
  nb::set_leak_warnings(false);
  nb::exception<magi::comm::CommError>(m, "CommError", PyExc_RuntimeError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const magi::InvalidArgument& e) {
      set_error(PyExc_ValueError, e.what());
    } catch (const magi::NotAvailable& e) {
      set_error(PyExc_NotImplementedError, e.what());
    }
  });
#if MAGI_ATTN_CUDA_BACKEND
  m.attr("cuda_backend") = true;
#else
  m.attr("cuda_backend") = false;
#endif
#if MAGI_ATTN_WITH_NCCL
  m.attr("nccl_engine") = true;
#else
  m.attr("nccl_engine") = false;
#endif
  bind_arrays(m);
  m.def("cuda_synchronize", [](int32_t device, uintptr_t stream) {
#if MAGI_ATTN_CUDA_BACKEND
    nb::gil_scoped_release release;
    magi::cuda::DeviceGuard guard(device);
    magi::cuda::check(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
#else
    (void)device;
    (void)stream;
#endif
  }, nb::arg("device"), nb::arg("stream"));
  bind_env(m);
  bind_mask(m);
  bind_attention(m);
  bind_distributed(m);
}
