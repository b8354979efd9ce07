// A small command-line option parser: `--name value`, `--name=value` and value-less flags.
// Errors are magi::InvalidArgument naming the option and, for unknown ones, the allowed set.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace magi::cli {

struct OptionSpec {
  std::string name;        // without the leading "--"
  std::string value_name;  // "" = a flag that takes no value
  std::string help;
};

class Options {
 public:
  // `command` is used in messages ("magi-attn run"); `synopsis` and `description` head the help text.
  Options(std::string command, std::string synopsis, std::string description, std::vector<OptionSpec> specs);

  // Parses the arguments that follow the subcommand name. `--help` / `-h` anywhere sets
  // help_requested() and nothing else is parsed, so help is honoured even next to a bad option.
  void parse(std::span<const std::string> args);

  bool help_requested() const { return help_requested_; }
  std::string help_text() const;

  bool has(std::string_view name) const;
  std::optional<std::string> get(std::string_view name) const;
  std::string require(std::string_view name) const;  // throws "missing required option --name"

  // Typed values; the message names the option. Defaults apply when the option is absent.
  int64_t get_int(std::string_view name, int64_t fallback, int64_t min_value, int64_t max_value) const;
  std::optional<int64_t> get_int(std::string_view name, int64_t min_value, int64_t max_value) const;
  std::optional<double> get_double(std::string_view name) const;
  // A comma-separated list of integers, e.g. "0,100,350".
  std::optional<std::vector<int64_t>> get_int_list(std::string_view name) const;

  // Throws when any of `names` was given: "--block is not used by preset 'full'".
  void reject_unless_used(std::span<const std::string> names, std::string_view context) const;

 private:
  const OptionSpec* find(std::string_view name) const;
  std::string allowed_list() const;

  std::string command_;
  std::string synopsis_;
  std::string description_;
  std::vector<OptionSpec> specs_;
  std::map<std::string, std::string, std::less<>> values_;
  bool help_requested_ = false;
};

// --threads N, checked against the library's limit before any work starts (the library checks only at the
// first attention call, after progress output or on one rank only). 0 = all cores when absent.
int32_t get_threads(const Options& options);

// Strict number parsing (the whole text must be consumed); `what` names the value in errors.
int64_t parse_int(std::string_view text, std::string_view what);
double parse_double(std::string_view text, std::string_view what);

}  // namespace magi::cli
