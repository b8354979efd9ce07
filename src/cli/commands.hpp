// The subcommands of magi-attn. Each takes the arguments after its name, prints to stdout, and returns
// the exit code; errors are thrown (main prints them as one line and exits 2).
#pragma once

#include <span>
#include <string>

namespace magi::cli {

int run_command(std::span<const std::string> args);
int mask_command(std::span<const std::string> args);
int demo_command(std::span<const std::string> args);
int env_command(std::span<const std::string> args);

}  // namespace magi::cli
