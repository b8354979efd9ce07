// Human-readable views of the registry: docs/env.md (markdown) and `magi-attn env` (table_with_values).
#include <algorithm>
#include <array>
#include <cctype>
#include <map>

#include "env/scan.hpp"
#include "magi/env.hpp"

namespace magi::env {
namespace {

constexpr std::array<std::string_view, 4> kCategories = {"correctness", "performance", "debug", "build"};

std::string title_case(std::string_view word) {
  std::string out(word);
  if (!out.empty()) out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
  return out;
}

// Table cells must not contain the column separator.
std::string cell(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out;
}

// A value as one printable line: control characters escaped (\n, \t, \xHH), so that one set to several lines cannot
// break the table's rows.
std::string printable(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else if (u < 0x20 || u == 0x7f) out.append("\\x").append(1, kHex[u >> 4]).append(1, kHex[u & 15]);
    else out += c;
  }
  return out;
}

// Appending (not "`" + std::string) sidesteps a GCC 12 -Wrestrict false positive.
std::string enclosed(std::string_view open, std::string_view text, std::string_view close) {
  std::string out(open);
  out.append(text).append(close);
  return out;
}

std::string code(std::string_view text) { return enclosed("`", text, "`"); }

std::string code_list(const std::vector<std::string_view>& items) {
  std::string out;
  for (std::string_view item : items) {
    if (!out.empty()) out += ", ";
    out += code(item);
  }
  return out;
}

std::string markdown_default(const Variable& variable) {
  if (!variable.default_value.empty()) return code(variable.default_value);
  if (!variable.default_rule.empty()) return cell(variable.default_rule);
  return "unset";
}

std::string markdown_allowed(const Variable& variable) {
  switch (variable.type) {
    case VarType::Bool:
    case VarType::Enum: return code_list(variable.allowed);
    case VarType::Int:
    case VarType::Path:
    case VarType::String: return cell(detail::allowed_values(variable));
  }
  return {};
}

std::string status_text(const Variable& variable) {
  switch (variable.status) {
    case Status::Implemented: return "implemented";
    case Status::NotYet: return "not yet; " + std::string(variable.status_reason);
    case Status::NotApplicable: return "not applicable; " + std::string(variable.status_reason);
  }
  return {};
}

std::string meaning_text(const Variable& variable) {
  std::string out(variable.meaning);
  if (!variable.aliases.empty()) {
    out += variable.aliases.size() == 1 ? " Older name: " : " Older names: ";
    out += code_list(variable.aliases);
    out += ".";
  }
  return out;
}

// Plain-text columns padded to the widest entry.
std::string aligned(const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> widths;
  for (const auto& row : rows) {
    if (row.size() < 2) continue;  // section lines do not set widths
    widths.resize(std::max(widths.size(), row.size()), 0);
    for (std::size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line;
    for (std::size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line.append(widths[i] - row[i].size() + 2, ' ');
    }
    out += line + "\n";
  }
  return out;
}

}  // namespace

std::string markdown() {
  std::string out;
  out += "# Environment variables\n\n";
  out += "<!-- Generated from src/env/registry.cpp by magi::env::markdown(); do not edit by hand.\n"
         "     Refresh: MAGI_ATTN_UPDATE_DOCS=1 <build>/tests/env/env_docs_test -->\n\n";
  out += "magi-attn reads its configuration from the environment variables below, once, when the "
         "library is first used. `magi-attn env` prints this table with the current values.\n\n";
  out += "- Every set `MAGI_ATTENTION_*` variable is checked then, whether or not the call uses it: a bad "
         "value stops with an error naming the variable and its allowed values, and an unknown "
         "`MAGI_ATTENTION_*` name gets a warning with the closest known name.\n";
  out += "- Status: **implemented** variables are honoured by this build; **not yet** ones belong to a "
         "planned capability, and **not applicable** ones have no meaning for this build (the reason is "
         "given). Setting either of the last two prints one warning on stderr saying it has no effect "
         "(only a note at `MAGI_ATTENTION_LOG_LEVEL=info` when the value is the default anyway).\n";
  out += "- Booleans accept `0`, `1`, `true`, `false`, `on`, `off`; booleans and enums ignore case.\n";
  out += "- Older names still work. Setting an older name and the current one to different values is an "
         "error.\n";
  out += "- Variables without the `MAGI_ATTENTION_` prefix are shared with other tools: a bad value there "
         "is a warning, and magi-attn ignores it.\n";
  out += "- A default given as a rule is decided at run time.\n";

  for (std::string_view category : kCategories) {
    out += "\n## " + title_case(category) + "\n\n";
    out += "| Variable | Type | Default | Allowed | Status | Meaning |\n";
    out += "|---|---|---|---|---|---|\n";
    for (const Variable& variable : registry()) {
      if (variable.category != category) continue;
      out += "| " + code(variable.name) + " | " + std::string(to_string(variable.type)) + " | " +
             markdown_default(variable) + " | " + markdown_allowed(variable) + " | " +
             cell(status_text(variable)) + " | " + cell(meaning_text(variable)) + " |\n";
    }
  }
  return out;
}

std::string table_with_values() {
  const detail::Environment environment = detail::read_environment();
  const detail::ScanResult result = detail::scan(environment);
  std::map<std::string_view, std::string_view> set;
  for (const auto& [name, value] : environment) set.emplace(name, value);

  std::vector<std::vector<std::string>> rows;
  rows.push_back({"VARIABLE", "VALUE", "STATUS", "DEFAULT", "OLDER NAMES"});
  for (std::string_view category : kCategories) {
    rows.push_back({enclosed("[", category, "]")});
    for (const Variable& variable : registry()) {
      if (variable.category != category) continue;
      std::string value = "-";
      std::vector<std::string_view> names{variable.name};
      names.insert(names.end(), variable.aliases.begin(), variable.aliases.end());
      for (std::string_view name : names) {
        const auto found = set.find(name);
        if (found == set.end()) continue;
        value = found->second.empty() ? "\"\"" : printable(found->second);
        if (name != variable.name) value += " (as " + std::string(name) + ")";
        if (!detail::parse_value(variable, found->second)) value += " (invalid)";
        break;
      }
      std::string default_text(variable.default_value);
      if (default_text.empty() && variable.computed_default != nullptr) {
        default_text = std::to_string(variable.computed_default()) + " (" + std::string(variable.default_rule) + ")";
      } else if (default_text.empty()) {
        default_text = variable.default_rule.empty() ? "unset" : std::string(variable.default_rule);
      }
      std::string older = variable.aliases.empty() ? "-" : "";
      for (std::string_view alias : variable.aliases) older += (older.empty() ? "" : ", ") + std::string(alias);
      rows.push_back(
          {std::string(variable.name), value, std::string(to_string(variable.status)), default_text, older});
    }
  }
  std::string out = aligned(rows);

  std::vector<std::string> problems;
  for (const std::string& error : result.errors) problems.push_back("error: " + error);
  for (const detail::Message& message : result.messages) {
    if (message.level <= log::Level::Warn) problems.push_back("warning: " + message.text);
  }
  if (!problems.empty()) {
    out += "\nProblems:\n";
    for (const std::string& problem : problems) out += "  " + printable(problem) + "\n";
  }
  return out;
}

}  // namespace magi::env
