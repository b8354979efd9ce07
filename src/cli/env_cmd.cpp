#include <iostream>

#include "cli/commands.hpp"
#include "cli/options.hpp"
#include "magi/env.hpp"

namespace magi::cli {

int env_command(std::span<const std::string> args) {
  Options options("env", "magi-attn env [--markdown]",
                  "Lists every configuration variable the library knows (MAGI_ATTENTION_* and build knobs):\n"
                  "type, default, allowed values, status, and the value set in this environment.",
                  {{"markdown", "", "print the registry as the Markdown table of docs/env.md (no current values)"}});
  options.parse(args);
  if (options.help_requested()) {
    std::cout << options.help_text();
    return 0;
  }
  std::cout << (options.has("markdown") ? env::markdown() : env::table_with_values());
  return 0;
}

}  // namespace magi::cli
