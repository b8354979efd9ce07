// magi-attn: flexible-mask attention from the command line.
#include <chrono>
#include <cstdio>
#include <exception>
#include <iostream>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.hpp"
#include "magi/env.hpp"
#include "magi/error.hpp"

namespace {

constexpr const char* kUsage =
    "usage: magi-attn <command> [options]   (magi-attn <command> --help for details)\n"
    "\n"
    "Flexible-mask attention: masks are lists of (q_range, k_range, type) slices.\n"
    "\n"
    "commands:\n"
    "  demo   packed-documents attention, forward + backward, timed and checked against the reference\n"
    "  run    forward (and backward with --do) on .npy inputs and a mask JSON; writes .npy outputs\n"
    "  mask   validate and describe a mask (JSON file or preset): slices, area, density, picture, PNG\n"
    "  env    the MAGI_ATTENTION_* configuration variables with their current values\n"
    "  trace  merge the per-rank timelines of MAGI_ATTENTION_PROFILE_DIR into one trace; report the overlap\n"
    "\n"
    "distributed (context parallel; under mpirun -np CP, or CP processes launched torchrun- or ATOM-style):\n"
    "  dist-demo   the packed-documents demo over CP ranks, checked against one device, with the plan\n"
    "  dist-run    `run` over CP ranks: rank 0 reads the inputs and writes the outputs\n"
    "\n"
    "  --version   print the version\n"
    "  --help      show this help\n"
    "\n"
    "Errors print one line 'magi-attn: error: ...' and exit with status 2.\n";

// Exactly one line on stderr, whatever the message contains.
void print_error(const std::string& message) {
  std::string line = message;
  for (char& c : line)
    if (c == '\n' || c == '\r') c = ' ';
  std::cerr << "magi-attn: error: " << line << std::endl;
}

int dispatch(const std::vector<std::string>& args) {
  if (args.empty())
    throw magi::InvalidArgument(
        "missing command (allowed: demo, run, mask, env, trace, dist-demo, dist-run; see magi-attn --help)");
  const std::string& command = args[0];
  if (command == "--help" || command == "-h" || command == "help") {
    std::cout << kUsage;
    return 0;
  }
  if (command == "--version") {
    std::cout << "magi-attn " << MAGI_ATTN_VERSION << "\n";
    return 0;
  }
  const std::span<const std::string> rest(args.data() + 1, args.size() - 1);
  using Command = int (*)(std::span<const std::string>);
  Command run = nullptr;
  if (command == "run") run = magi::cli::run_command;
  else if (command == "mask") run = magi::cli::mask_command;
  else if (command == "demo") run = magi::cli::demo_command;
  else if (command == "env") run = magi::cli::env_command;
  else if (command == "trace") run = magi::cli::trace_command;
  else if (command == "dist-run" || command == "dist-demo") {
#ifdef MAGI_CLI_WITH_MPI
    run = command == "dist-run" ? magi::cli::dist_run_command : magi::cli::dist_demo_command;
#else
    throw magi::NotAvailable(command + " needs MPI, and this magi-attn was built without it (install libopenmpi-dev "
                             "and rebuild; magi-attn run and demo work on one device)");
#endif
  } else {
    throw magi::InvalidArgument("unknown command '" + command +
                                "' (allowed: demo, run, mask, env, trace, dist-demo, dist-run, --help, --version)");
  }

  bool help_only = false;
  for (const std::string& arg : rest) help_only = help_only || arg == "--help" || arg == "-h";
  // A bad MAGI_ATTENTION_* value stops every command before it does anything. Help still works, and so
  // does `env`, whose table shows each problem next to the variable. Distributed commands check it
  // themselves, so that only rank 0 reports it.
  const bool distributed = command.starts_with("dist-");
  if (!help_only && command != "env" && !distributed) magi::env::ensure_validated();
  return run(rest);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return dispatch(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const magi::cli::QuietExit& quiet) {
    // Rank 0 reports the error; a launcher (mpirun) that sees this rank exit first may kill rank 0 before it has
    // printed (1 run in ~30), so this rank leaves a little later.
    std::this_thread::sleep_for(std::chrono::seconds(2));
    return quiet.exit_code;
  } catch (const std::bad_alloc&) {
    // what() is only "std::bad_alloc": say what it means.
    print_error("out of memory: the inputs or options (tokens, heads, head dim) need more memory than is available");
  } catch (const std::exception& e) {
    print_error(e.what());
  } catch (...) {
    print_error("unknown exception");
  }
  return 2;
}
