// Reading the environment against the registry: parsing, checks and the messages they produce.
// Pure functions over a given list of (name, value) pairs, so validation and `magi-attn env` share them.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "env/log.hpp"
#include "magi/env.hpp"

namespace magi::env::detail {

using Environment = std::vector<std::pair<std::string, std::string>>;

// The process environment (`environ`), in its order.
Environment read_environment();

// True for names the library owns and therefore checks strictly.
bool has_own_prefix(std::string_view name);

// `text` parsed as `variable`'s type, in canonical form: Bool "0"/"1", Int decimal, Enum the allowed
// spelling; nullopt if invalid.
std::optional<std::string> parse_value(const Variable& variable, std::string_view text);
// "<NAME>=<text> is invalid: allowed values are ..." for a value parse_value rejected.
std::string invalid_value_message(std::string_view name, std::string_view text, const Variable& variable);
// "0, 1, true, false, on, off", "none, sum, avg", "integers >= 0", ...
std::string allowed_values(const Variable& variable);

// Levenshtein distance.
std::size_t edit_distance(std::string_view a, std::string_view b);
// The registered name or alias closest to `unknown` if it is close enough to be a typo, else "".
std::string_view closest_name(std::string_view unknown);

struct SetValue {
  std::string value;   // canonical
  std::string set_as;  // the name found in the environment (the variable's name or an alias)
  std::string raw;     // as written
};

struct Message {
  log::Level level;
  std::string text;
};

struct ScanResult {
  std::map<std::string_view, SetValue> values;  // by Variable::name; valid values only
  std::vector<std::string> errors;               // stop the library
  std::vector<Message> messages;                 // registered variables in registry order, then
                                                 // unknown names in name order
  log::Level log_level = log::Level::Warn;       // MAGI_ATTENTION_LOG_LEVEL, if valid
};

ScanResult scan(const Environment& environment);

}  // namespace magi::env::detail
