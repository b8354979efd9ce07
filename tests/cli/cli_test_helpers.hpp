// Helpers for the magi-attn end-to-end tests: run the program, temporary folders, .npy inputs.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli/npy.hpp"

#ifndef MAGI_CLI_PATH
#error "MAGI_CLI_PATH (path of the magi-attn program) must be defined by the build"
#endif

namespace magi::cli::test {

namespace fs = std::filesystem;

struct CliResult {
  int exit_code = -1;
  std::string out, err;

  // stderr split into lines (without the newline).
  std::vector<std::string> err_lines() const {
    std::vector<std::string> lines;
    std::istringstream in(err);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
  }
};

inline std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// A fresh folder under the system temp dir, removed with its contents at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = fs::temp_directory_path() /
            ("magi_cli_test_" + std::to_string(::getpid()) + "_" + std::to_string(rd()) + "_" + std::to_string(rd()));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const fs::path& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

inline std::string shell_quote(const std::string& text) {
  std::string quoted = "'";
  for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// Runs `magi-attn <args>` with `env` assignments (e.g. "MAGI_ATTENTION_X=1") in front; captures both streams.
inline CliResult run_cli(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  TempDir capture;
  std::string command = "env";
  for (const std::string& assignment : env) command += " " + shell_quote(assignment);
  command += " " + shell_quote(MAGI_CLI_PATH);
  for (const std::string& arg : args) command += " " + shell_quote(arg);
  command += " >" + shell_quote(capture / "stdout") + " 2>" + shell_quote(capture / "stderr") + " </dev/null";
  const int status = std::system(command.c_str());
  CliResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.out = slurp(capture / "stdout");
  result.err = slurp(capture / "stderr");
  return result;
}

inline std::string describe(const CliResult& r) {
  return "exit " + std::to_string(r.exit_code) + "\n--- stdout:\n" + r.out + "--- stderr:\n" + r.err;
}

// Asserts the error contract: exit 2 and exactly one stderr line "magi-attn: error: ..." holding every
// fragment in `expected`.
inline void expect_one_line_error(const CliResult& r, const std::vector<std::string>& expected) {
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  const auto lines = r.err_lines();
  ASSERT_EQ(lines.size(), 1u) << describe(r);
  EXPECT_EQ(lines[0].rfind("magi-attn: error: ", 0), 0u) << describe(r);
  for (const std::string& fragment : expected)
    EXPECT_NE(lines[0].find(fragment), std::string::npos) << "missing '" << fragment << "' in: " << lines[0];
}

inline void write_npy_file(const std::string& path, DType dtype, std::vector<int64_t> shape,
                           const std::vector<double>& values) {
  write_file(path, encode_npy(dtype, shape, values));
}

inline std::vector<double> normal_values(std::mt19937_64& rng, size_t n) {
  std::normal_distribution<double> normal;
  std::vector<double> values(n);
  for (double& x : values) x = normal(rng);
  return values;
}

// Relative L2 distance, NaN-safe (NaN compares as failing).
inline double rel_l2(const std::vector<double>& got, const std::vector<double>& ref) {
  if (got.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace magi::cli::test
