#include "cli/options.hpp"

#include <charconv>
#include <cmath>
#include <sstream>

#include "magi/attention.hpp"
#include "magi/error.hpp"

namespace magi::cli {

Options::Options(std::string command, std::string synopsis, std::string description,
                 std::vector<OptionSpec> specs)
    : command_(std::move(command)),
      synopsis_(std::move(synopsis)),
      description_(std::move(description)),
      specs_(std::move(specs)) {}

const OptionSpec* Options::find(std::string_view name) const {
  for (const OptionSpec& spec : specs_)
    if (spec.name == name) return &spec;
  return nullptr;
}

std::string Options::allowed_list() const {
  std::string list;
  for (const OptionSpec& spec : specs_) list += (list.empty() ? "--" : ", --") + spec.name;
  return list + (list.empty() ? "--help" : ", --help");
}

void Options::parse(std::span<const std::string> args) {
  for (const std::string& arg : args)
    if (arg == "--help" || arg == "-h") {
      help_requested_ = true;
      return;
    }
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0)
      throw InvalidArgument(command_ + ": unexpected argument '" + arg + "' (options are --name value; allowed: " +
                            allowed_list() + ")");
    std::string name = arg.substr(2);
    std::optional<std::string> inline_value;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name.resize(eq);
    }
    const OptionSpec* spec = find(name);
    if (!spec)
      throw InvalidArgument(command_ + ": unknown option '--" + name + "' (allowed: " + allowed_list() + ")");
    if (values_.count(name)) throw InvalidArgument(command_ + ": option --" + name + " given twice");
    if (spec->value_name.empty()) {
      if (inline_value) throw InvalidArgument(command_ + ": option --" + name + " takes no value");
      values_.emplace(name, std::string(1, '1'));
      continue;
    }
    if (inline_value) {
      values_[name] = *inline_value;
      continue;
    }
    // A following "--x" is taken as a missing value, except negative numbers like "--softcap -1".
    const bool next_is_value = i + 1 < args.size() &&
                               (args[i + 1].compare(0, 2, "--") != 0 || args[i + 1].size() == 2);
    if (!next_is_value)
      throw InvalidArgument(command_ + ": option --" + name + " needs a value (" + spec->value_name + ")");
    values_[name] = args[++i];
  }
}

std::string Options::help_text() const {
  std::ostringstream os;
  os << "usage: " << synopsis_ << "\n\n" << description_ << "\n\noptions:\n";
  size_t width = 6;  // "--help"
  for (const OptionSpec& spec : specs_)
    width = std::max(width, spec.name.size() + 2 + (spec.value_name.empty() ? 0 : spec.value_name.size() + 1));
  auto line = [&](const std::string& left, const std::string& help) {
    os << "  " << left << std::string(width - left.size() + 2, ' ') << help << "\n";
  };
  for (const OptionSpec& spec : specs_)
    line("--" + spec.name + (spec.value_name.empty() ? "" : " " + spec.value_name), spec.help);
  line("--help", "show this help and exit");
  return os.str();
}

bool Options::has(std::string_view name) const { return values_.find(name) != values_.end(); }

std::optional<std::string> Options::get(std::string_view name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

std::string Options::require(std::string_view name) const {
  auto value = get(name);
  if (!value) throw InvalidArgument(command_ + ": missing required option --" + std::string(name) + " (see --help)");
  return *value;
}

std::optional<int64_t> Options::get_int(std::string_view name, int64_t min_value, int64_t max_value) const {
  auto text = get(name);
  if (!text) return std::nullopt;
  const std::string what = "--" + std::string(name);
  const int64_t value = parse_int(*text, what);
  if (value < min_value || value > max_value)
    throw InvalidArgument(what + ": " + std::to_string(value) + " is out of range [" + std::to_string(min_value) +
                          ", " + std::to_string(max_value) + "]");
  return value;
}

int64_t Options::get_int(std::string_view name, int64_t fallback, int64_t min_value, int64_t max_value) const {
  return get_int(name, min_value, max_value).value_or(fallback);
}

std::optional<double> Options::get_double(std::string_view name) const {
  auto text = get(name);
  if (!text) return std::nullopt;
  return parse_double(*text, "--" + std::string(name));
}

std::optional<std::vector<int64_t>> Options::get_int_list(std::string_view name) const {
  auto text = get(name);
  if (!text) return std::nullopt;
  std::vector<int64_t> values;
  const std::string what = "--" + std::string(name);
  size_t pos = 0;
  while (pos <= text->size()) {
    const size_t comma = std::min(text->find(',', pos), text->size());
    values.push_back(parse_int(std::string_view(*text).substr(pos, comma - pos), what));
    pos = comma + 1;
  }
  return values;
}

void Options::reject_unless_used(std::span<const std::string> names, std::string_view context) const {
  for (const std::string& name : names)
    if (has(name)) throw InvalidArgument(command_ + ": --" + name + " is not used by " + std::string(context));
}

int32_t get_threads(const Options& options) {
  auto text = options.get("threads");
  if (!text) return 0;
  const int64_t value = parse_int(*text, "--threads");
  if (value < 0 || value > kMaxThreads)
    throw InvalidArgument("--threads: " + *text + " (allowed: 0 = all cores, 1 .. " + std::to_string(kMaxThreads) + ")");
  return static_cast<int32_t>(value);
}

int64_t parse_int(std::string_view text, std::string_view what) {
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size())
    throw InvalidArgument(std::string(what) + ": '" + std::string(text) + "' is not an integer");
  return value;
}

double parse_double(std::string_view text, std::string_view what) {
  double value = 0.0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || !std::isfinite(value))
    throw InvalidArgument(std::string(what) + ": '" + std::string(text) + "' is not a finite number");
  return value;
}

}  // namespace magi::cli
