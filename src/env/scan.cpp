#include "env/scan.hpp"

#include <unistd.h>  // environ

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <numeric>

namespace magi::env::detail {
namespace {

constexpr std::string_view kOwnPrefix = "MAGI_ATTENTION_";

bool equals_ignoring_case(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

std::optional<int64_t> parse_int64(std::string_view text) {
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  if (text.empty() || text.front() == '+') return std::nullopt;
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// Int bounds from Variable::allowed ({min, max}, "" = unbounded).
std::optional<int64_t> int_bound(const Variable& variable, std::size_t index) {
  if (variable.allowed.size() <= index || variable.allowed[index].empty()) return std::nullopt;
  return parse_int64(variable.allowed[index]);
}

std::string join(const std::vector<std::string_view>& items) {
  std::string out;
  for (std::string_view item : items) {
    if (!out.empty()) out += ", ";
    out += item;
  }
  return out;
}

std::string assignment(std::string_view name, std::string_view value) {
  std::string out(name);
  out += '=';
  out += value;
  return out;
}

// Setting a variable to the value that is in force anyway does what was asked, so it is only a note.
bool is_fixed_default(const Variable& variable, std::string_view canonical) {
  return !variable.default_value.empty() && canonical == variable.default_value;
}

std::string not_in_effect_message(const Variable& variable, std::string_view set_as, std::string_view raw) {
  std::string text = has_own_prefix(set_as) ? assignment(set_as, raw) + " has no effect: "
                                            : "magi-attn does not use " + assignment(set_as, raw) + ": ";
  text += variable.status == Status::NotYet ? "not implemented yet; " : "not applicable to this build; ";
  text += variable.status_reason;
  return text;
}

void check_engine_choice(ScanResult& result) {
  const auto sdpa = result.values.find("MAGI_ATTENTION_SDPA_BACKEND");
  const auto engine = result.values.find("MAGI_ATTENTION_KERNEL_BACKEND");
  if (sdpa == result.values.end() || engine == result.values.end()) return;
  if (sdpa->second.value == "1" && engine->second.value.starts_with("ffa")) {
    result.errors.push_back(assignment(sdpa->second.set_as, sdpa->second.raw) +
                            " selects the sdpa engine but " +
                            assignment(engine->second.set_as, engine->second.raw) +
                            " selects ffa: set only one of them");
  }
}

}  // namespace

Environment read_environment() {
  Environment environment;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    const std::size_t equals = text.find('=');
    if (equals == std::string_view::npos) continue;
    environment.emplace_back(std::string(text.substr(0, equals)), std::string(text.substr(equals + 1)));
  }
  return environment;
}

bool has_own_prefix(std::string_view name) { return name.starts_with(kOwnPrefix); }

std::optional<std::string> parse_value(const Variable& variable, std::string_view text) {
  switch (variable.type) {
    case VarType::Bool:
      for (std::string_view yes : {"1", "true", "on"})
        if (equals_ignoring_case(text, yes)) return "1";
      for (std::string_view no : {"0", "false", "off"})
        if (equals_ignoring_case(text, no)) return "0";
      return std::nullopt;
    case VarType::Int: {
      const std::optional<int64_t> value = parse_int64(text);
      if (!value) return std::nullopt;
      if (const auto min = int_bound(variable, 0); min && *value < *min) return std::nullopt;
      if (const auto max = int_bound(variable, 1); max && *value > *max) return std::nullopt;
      return std::to_string(*value);
    }
    case VarType::Enum:
      for (std::string_view allowed : variable.allowed)
        if (equals_ignoring_case(text, allowed)) return std::string(allowed);
      return std::nullopt;
    case VarType::Path:
      if (text.empty()) return std::nullopt;
      return std::string(text);
    case VarType::String:
      return std::string(text);
  }
  return std::nullopt;
}

std::string allowed_values(const Variable& variable) {
  switch (variable.type) {
    case VarType::Bool: return "0, 1, true, false, on, off";
    case VarType::Int: {
      const auto min = int_bound(variable, 0);
      const auto max = int_bound(variable, 1);
      if (min && max) return "integers from " + std::to_string(*min) + " to " + std::to_string(*max);
      if (min) return "integers >= " + std::to_string(*min);
      if (max) return "integers <= " + std::to_string(*max);
      return "integers";
    }
    case VarType::Enum: return join(variable.allowed);
    case VarType::Path: return "non-empty paths";
    case VarType::String: return variable.allowed.empty() ? "any text" : std::string(variable.allowed[0]);
  }
  return {};
}

std::string invalid_value_message(std::string_view name, std::string_view text, const Variable& variable) {
  return assignment(name, text) + " is invalid: allowed values are " + allowed_values(variable);
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> previous(b.size() + 1), current(b.size() + 1);
  std::iota(previous.begin(), previous.end(), std::size_t{0});
  for (std::size_t i = 1; i <= a.size(); ++i) {
    current[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t substitution = previous[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      current[j] = std::min({previous[j] + 1, current[j - 1] + 1, substitution});
    }
    std::swap(previous, current);
  }
  return previous[b.size()];
}

std::string_view closest_name(std::string_view unknown) {
  std::string upper(unknown);
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const std::size_t suffix_length = upper.size() - (has_own_prefix(upper) ? kOwnPrefix.size() : 0);
  // A typo changes a few characters; longer names tolerate a few more.
  const std::size_t tolerance = std::max<std::size_t>(2, suffix_length * 2 / 5);

  std::string_view best;
  std::size_t best_distance = tolerance + 1;
  for (const Variable& variable : registry()) {
    std::size_t distance = edit_distance(upper, variable.name);
    for (std::string_view alias : variable.aliases) distance = std::min(distance, edit_distance(upper, alias));
    if (distance < best_distance) {
      best_distance = distance;
      best = variable.name;  // suggest the current name even when an old one is closer
    }
  }
  return best;
}

ScanResult scan(const Environment& environment) {
  // First occurrence wins, as with getenv.
  std::map<std::string_view, std::string_view> set;
  for (const auto& [name, value] : environment) set.emplace(name, value);

  ScanResult result;
  for (const Variable& variable : registry()) {
    struct Seen {
      std::string_view name, raw;
      std::string canonical;
    };
    std::vector<Seen> seen;
    bool any_invalid = false;
    std::vector<std::string_view> names{variable.name};
    names.insert(names.end(), variable.aliases.begin(), variable.aliases.end());
    for (std::string_view name : names) {
      const auto found = set.find(name);
      if (found == set.end()) continue;
      const std::string_view raw = found->second;
      std::optional<std::string> canonical = parse_value(variable, raw);
      if (!canonical) {
        any_invalid = true;
        std::string message = invalid_value_message(name, raw, variable);
        if (has_own_prefix(name)) {
          result.errors.push_back(std::move(message));
        } else {
          // Other tools read these too: do not stop the library over them.
          result.messages.push_back({log::Level::Warn, message + "; magi-attn ignores it"});
        }
        continue;
      }
      seen.push_back({name, raw, std::move(*canonical)});
    }
    if (any_invalid || seen.empty()) continue;

    const Seen& chosen = seen.front();  // the current name comes first
    bool conflict = false;
    for (const Seen& other : seen) {
      if (other.canonical == chosen.canonical) continue;
      conflict = true;
      result.errors.push_back(assignment(chosen.name, chosen.raw) + " and " + assignment(other.name, other.raw) +
                              " disagree: " + std::string(other.name) + " is the older name of " +
                              std::string(variable.name) + "; set only " + std::string(variable.name));
    }
    if (conflict) continue;

    for (const Seen& each : seen) {
      if (each.name == variable.name) continue;
      result.messages.push_back({log::Level::Info, std::string(each.name) + " is the older name of " +
                                                       std::string(variable.name) + "; it still works"});
    }
    result.values.emplace(variable.name, SetValue{chosen.canonical, std::string(chosen.name), std::string(chosen.raw)});

    if (variable.status == Status::Implemented) {
      result.messages.push_back({log::Level::Debug, assignment(chosen.name, chosen.raw) + " is in effect"});
    } else {
      const bool matters = has_own_prefix(chosen.name) && !is_fixed_default(variable, chosen.canonical);
      result.messages.push_back({matters ? log::Level::Warn : log::Level::Info,
                                 not_in_effect_message(variable, chosen.name, chosen.raw)});
    }
  }

  for (const auto& [name, value] : set) {
    if (!has_own_prefix(name) || find(name) != nullptr) continue;
    std::string text = "unknown variable " + std::string(name) + " is ignored";
    if (const std::string_view suggestion = closest_name(name); !suggestion.empty()) {
      text += "; did you mean " + std::string(suggestion) + "?";
    } else {
      text += " (`magi-attn env` lists the known ones)";
    }
    result.messages.push_back({log::Level::Warn, std::move(text)});
  }

  check_engine_choice(result);

  if (const auto level = result.values.find("MAGI_ATTENTION_LOG_LEVEL"); level != result.values.end()) {
    result.log_level = log::parse_level(level->second.value).value_or(log::Level::Warn);
  }
  return result;
}

}  // namespace magi::env::detail
