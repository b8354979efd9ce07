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
  std::string_view default_value;          // as text; "" = unset / computed (see meaning)
  std::vector<std::string_view> allowed;   // Enum: the values; Bool: {"0","1"}; Int: {"min","max"} or {}
  std::string_view category;               // "correctness" | "performance" | "debug" | "build"
  std::string_view meaning;                // one line
  Status status;
  std::string_view status_reason;          // why NotYet / NotApplicable
  std::vector<std::string_view> aliases;   // older names (seed 000) that still work
};

// All variables, in documentation order.
std::span<const Variable> registry();
const Variable* find(std::string_view name);  // by name or alias; nullptr if unknown

// Validates every set MAGI_ATTENTION_* variable (and the other registered ones) once per process:
// throws InvalidArgument naming the variable and allowed values on a bad value; warns on stderr for
// unknown MAGI_ATTENTION_* names ("did you mean") and, once each, for set variables that are not
// implemented. Every library entry point calls this first.
void ensure_validated();
// Re-reads the environment (tests change it): clears the once-only state.
void reset_for_testing();

// Typed reads of registered variables (value of the name or its alias, else the default).
bool get_bool(std::string_view name);
int64_t get_int(std::string_view name);
std::string get_string(std::string_view name);
bool is_set(std::string_view name);

// Markdown table of the registry (docs/env.md is this text; a test checks it is current).
std::string markdown();
// Plain-text table with current values, for `magi-attn env`.
std::string table_with_values();

}  // namespace magi::env
