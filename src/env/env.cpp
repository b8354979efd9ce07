// Process-wide state of the registry: the environment is read and checked once, then served to getters.
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>

#include "env/log.hpp"
#include "env/scan.hpp"
#include "magi/env.hpp"
#include "magi/error.hpp"

namespace magi::env {
namespace {

struct State {
  std::mutex mutex;
  bool validated = false;
  std::exception_ptr failure;                           // a bad environment fails every call alike
  std::map<std::string_view, detail::SetValue> values;  // by Variable::name
};

State& state() {
  static State instance;  // the registry's one piece of global state
  return instance;
}

std::string join_errors(const std::vector<std::string>& errors) {
  std::string out;
  for (const std::string& error : errors) {
    if (!out.empty()) out += "; ";
    out += error;
  }
  return out;
}

const Variable& registered(std::string_view name) {
  const Variable* variable = find(name);
  if (variable == nullptr) {
    throw std::logic_error("magi::env: '" + std::string(name) +
                           "' is not in the registry (src/env/registry.cpp)");
  }
  return *variable;
}

void expect_type(const Variable& variable, VarType type, std::string_view getter) {
  if (variable.type != type) {
    throw std::logic_error("magi::env::" + std::string(getter) + ": " + std::string(variable.name) + " is " +
                           std::string(to_string(variable.type)) + ", not " + std::string(to_string(type)));
  }
}

// The validated canonical value, if the variable (or an alias) is set.
std::optional<std::string> set_value(const Variable& variable) {
  ensure_validated();
  State& s = state();
  std::lock_guard lock(s.mutex);
  const auto found = s.values.find(variable.name);
  if (found == s.values.end()) return std::nullopt;
  return found->second.value;
}

}  // namespace

void ensure_validated() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (!s.validated) {
    detail::ScanResult result = detail::scan(detail::read_environment());
    // The threshold first: the messages below (and log::level() on other threads) depend on it.
    log::set_level(result.log_level);
    for (const detail::Message& message : result.messages) log::write(message.level, message.text);
    s.values = std::move(result.values);
    s.failure = result.errors.empty() ? nullptr
                                      : std::make_exception_ptr(InvalidArgument(join_errors(result.errors)));
    s.validated = true;
  }
  if (s.failure) std::rethrow_exception(s.failure);
}

void reset_for_testing() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.validated = false;
  s.failure = nullptr;
  s.values.clear();
  log::clear_level();
}

bool get_bool(std::string_view name) {
  const Variable& variable = registered(name);
  expect_type(variable, VarType::Bool, "get_bool");
  return set_value(variable).value_or(std::string(variable.default_value)) == "1";
}

int64_t get_int(std::string_view name) {
  const Variable& variable = registered(name);
  expect_type(variable, VarType::Int, "get_int");
  if (const std::optional<std::string> value = set_value(variable)) return std::stoll(*value);
  if (!variable.default_value.empty()) return std::stoll(std::string(variable.default_value));
  if (variable.computed_default != nullptr) return variable.computed_default();
  throw std::logic_error("magi::env::get_int: " + std::string(variable.name) +
                         " is unset and has no default (" + std::string(variable.default_rule) +
                         "); check is_set first");
}

std::string get_string(std::string_view name) {
  const Variable& variable = registered(name);
  if (std::optional<std::string> value = set_value(variable)) return std::move(*value);
  if (!variable.default_value.empty()) return std::string(variable.default_value);
  if (variable.computed_default != nullptr) return std::to_string(variable.computed_default());
  return {};
}

bool is_set(std::string_view name) { return set_value(registered(name)).has_value(); }

KernelBackend kernel_backend() {
  const std::string engine = get_string("MAGI_ATTENTION_KERNEL_BACKEND");
  if (engine == "sdpa" || get_bool("MAGI_ATTENTION_SDPA_BACKEND")) return KernelBackend::Sdpa;
  if (engine.starts_with("ffa")) return KernelBackend::Ffa;
  return KernelBackend::Auto;
}

KernelFamily kernel_family() {
  const std::string engine = get_string("MAGI_ATTENTION_KERNEL_BACKEND");
  if (engine == "ffa_sm80") return KernelFamily::Sm80;
  if (engine == "ffa_sm90") return KernelFamily::Sm90;
  return KernelFamily::Auto;
}

}  // namespace magi::env
