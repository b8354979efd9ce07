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
int trace_command(std::span<const std::string> args);  // merges MAGI_ATTENTION_PROFILE_DIR timelines
// Distributed (under mpirun); available when the program was built with MPI.
int dist_run_command(std::span<const std::string> args);
int dist_demo_command(std::span<const std::string> args);

// Thrown on the ranks of a distributed command whose error rank 0 reports: main exits with `exit_code`
// and prints nothing, so an error is one line whatever the number of ranks.
struct QuietExit {
  int exit_code = 2;
};

}  // namespace magi::cli
