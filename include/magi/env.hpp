// The environment-variable registry: every variable the project knows, declared once (src/env/registry.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace magi::env {

enum class VarType { Bool, Int, String, Enum, Path };
enum class Status {
  Implemented,    // honoured by this build
  NotYet,         // part of the surface, feature not built yet: setting it warns once
  NotApplicable,  // meaningless here (e.g. Python JIT build knobs): setting it warns once with the reason
};

struct Variable {
  std::string_view name;
  VarType type;
  std::string_view default_value;          // as text; "" = unset or computed (see default_rule)
  std::vector<std::string_view> allowed;   // Enum: the values; Bool: {"0","1"};
                                           // Int: {"min","max"} ("" = unbounded side) or {};
                                           // String: {} or {the accepted form in words} (not enforced here)
  std::string_view category;               // "correctness" | "performance" | "debug" | "build"
  std::string_view meaning;                // one line
  Status status;
  std::string_view status_reason;          // why NotYet ("planned: <capability>") / NotApplicable
  std::vector<std::string_view> aliases;   // older names (seed 000) that still work
  std::string_view default_rule = {};      // a default decided at run time, in words (default_value is "")
  int64_t (*computed_default)() = nullptr; // Int only: evaluates default_rule where this build can
};

std::string_view to_string(VarType type);     // "bool", "int", "string", "enum", "path"
std::string_view to_string(Status status);    // "implemented", "not yet", "not applicable"

// All variables, in documentation order.
std::span<const Variable> registry();
const Variable* find(std::string_view name);  // by name or alias; nullptr if unknown

// Validates every set MAGI_ATTENTION_* variable (and the other registered ones) once per process:
// throws InvalidArgument naming the variable and allowed values on a bad value; warns on stderr for
// unknown MAGI_ATTENTION_* names ("did you mean") and, once each, for set variables that are not
// implemented. Every library entry point calls this first. A failed validation is remembered: every
// later call throws the same error. Registered variables without the MAGI_ATTENTION_ prefix (MAX_JOBS,
// CUDA_DEVICE_MAX_CONNECTIONS, ...) belong to other tools too: a bad value there warns and is ignored.
void ensure_validated();
// Re-reads the environment (tests change it): clears the once-only state.
void reset_for_testing();

// Typed reads of registered variables (value of the name or its alias, else the default). Unknown
// names, a getter that does not match the variable's type, and get_int of a variable without any
// default that is unset throw std::logic_error (programming errors).
bool get_bool(std::string_view name);
int64_t get_int(std::string_view name);      // Int
std::string get_string(std::string_view name);  // any type, as canonical text ("" if unset, no default)
bool is_set(std::string_view name);

// The engine chosen by MAGI_ATTENTION_KERNEL_BACKEND, where MAGI_ATTENTION_SDPA_BACKEND=1 means Sdpa
// (validation rejects SDPA_BACKEND=1 together with KERNEL_BACKEND=ffa).
enum class KernelBackend { Auto, Ffa, Sdpa };
KernelBackend kernel_backend();
// The GPU kernel family MAGI_ATTENTION_KERNEL_BACKEND forces (ffa_sm80, ffa_sm90), else Auto (the device's best).
enum class KernelFamily { Auto, Sm80, Sm90 };
KernelFamily kernel_family();

// Markdown table of the registry (docs/env.md is this text; a test checks it is current).
std::string markdown();
// Plain-text table with current values, for `magi-attn env`. Never throws on a bad environment: it
// lists the problems below the table instead.
std::string table_with_values();

}  // namespace magi::env
