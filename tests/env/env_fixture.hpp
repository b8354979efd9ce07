// A clean environment for env-registry tests: every MAGI_ATTENTION_* and registered variable is removed
// for the test and restored afterwards; the registry's once-only state is reset around each test.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "magi/env.hpp"
#include "magi/error.hpp"

namespace magi::env::testing_support {

class CleanEnvironment : public ::testing::Test {
 protected:
  void SetUp() override {
    std::vector<std::string> doomed;
    for (char** entry = environ; *entry != nullptr; ++entry) {
      const std::string text(*entry);
      const std::size_t equals = text.find('=');
      if (equals == std::string::npos) continue;
      const std::string name = text.substr(0, equals);
      if (name.starts_with("MAGI_ATTENTION_") || find(name) != nullptr) {
        saved_.emplace_back(name, text.substr(equals + 1));
        doomed.push_back(name);
      }
    }
    for (const std::string& name : doomed) unsetenv(name.c_str());
    reset_for_testing();
  }

  void TearDown() override {
    for (const std::string& name : touched_) unsetenv(name.c_str());
    for (const auto& [name, value] : saved_) setenv(name.c_str(), value.c_str(), 1);
    reset_for_testing();
  }

  // Sets a variable for this test only; the registry re-reads the environment on its next use.
  void set(const std::string& name, const std::string& value) {
    setenv(name.c_str(), value.c_str(), 1);
    touched_.push_back(name);
    reset_for_testing();
  }
  void unset(const std::string& name) {
    unsetenv(name.c_str());
    reset_for_testing();
  }

  // The message of the InvalidArgument that validation throws, or "" if it passes.
  static std::string validation_error() {
    try {
      ensure_validated();
    } catch (const InvalidArgument& error) {
      return error.what();
    }
    return {};
  }

  // stderr printed while validating (validation errors are swallowed; see validation_error()).
  static std::string stderr_of_validation() {
    ::testing::internal::CaptureStderr();
    try {
      ensure_validated();
    } catch (const InvalidArgument&) {
    }
    return ::testing::internal::GetCapturedStderr();
  }

 private:
  std::vector<std::pair<std::string, std::string>> saved_;
  std::vector<std::string> touched_;
};

inline std::size_t count_occurrences(const std::string& haystack, const std::string& needle) {
  std::size_t count = 0;
  for (std::size_t at = haystack.find(needle); at != std::string::npos; at = haystack.find(needle, at + 1)) ++count;
  return count;
}

}  // namespace magi::env::testing_support
