// Parsing and validation of the environment: every type's accepted and rejected values, exact error
// messages, aliases, warnings (did-you-mean, not implemented, once only), log levels, getters.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "env/log.hpp"
#include "env/scan.hpp"
#include "env_fixture.hpp"

namespace magi::env {
namespace {

using testing_support::count_occurrences;

class EnvParse : public testing_support::CleanEnvironment {
 protected:
  void SetUp() override {
    CleanEnvironment::SetUp();
    seed_ = std::random_device{}();
    rng_.seed(seed_);
  }
  std::string seed_note() const { return "seed " + std::to_string(seed_); }
  std::string random_case(std::string text) {
    for (char& c : text) {
      if (rng_() % 2) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    }
    return text;
  }

  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

// ---- Bool ----

TEST_F(EnvParse, BoolAcceptsEverySpellingInAnyCase) {
  const std::vector<std::pair<std::string, bool>> spellings = {
      {"1", true}, {"true", true}, {"on", true}, {"0", false}, {"false", false}, {"off", false}};
  for (int round = 0; round < 20; ++round) {
    for (const auto& [spelling, expected] : spellings) {
      const std::string written = random_case(spelling);
      set("MAGI_ATTENTION_SANITY_CHECK", written);
      EXPECT_EQ(validation_error(), "") << written << ", " << seed_note();
      EXPECT_EQ(get_bool("MAGI_ATTENTION_SANITY_CHECK"), expected) << written << ", " << seed_note();
      EXPECT_EQ(get_string("MAGI_ATTENTION_SANITY_CHECK"), expected ? "1" : "0") << written;
      EXPECT_TRUE(is_set("MAGI_ATTENTION_SANITY_CHECK"));
    }
  }
}

TEST_F(EnvParse, BoolRejectsAnythingElseWithTheAllowedValues) {
  for (const std::string bad : {"yes", "no", "2", "-1", "", " 1", "1 ", "truee", "o", "enable"}) {
    set("MAGI_ATTENTION_DETERMINISTIC_MODE", bad);
    EXPECT_EQ(validation_error(), "MAGI_ATTENTION_DETERMINISTIC_MODE=" + bad +
                                      " is invalid: allowed values are 0, 1, true, false, on, off");
    EXPECT_THROW(get_bool("MAGI_ATTENTION_DETERMINISTIC_MODE"), InvalidArgument) << bad;
  }
}

// ---- Int ----

TEST_F(EnvParse, IntAcceptsRandomValuesWithinBounds) {
  std::uniform_int_distribution<int64_t> size(1, int64_t{1} << 50);
  for (int round = 0; round < 50; ++round) {
    const int64_t value = size(rng_);
    const bool plus = rng_() % 2;
    set("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE", (plus ? "+" : "") + std::to_string(value));
    EXPECT_EQ(get_int("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE"), value) << seed_note();
    EXPECT_EQ(get_string("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE"), std::to_string(value)) << seed_note();
  }
  set("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE", "1");  // the minimum itself
  EXPECT_EQ(get_int("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE"), 1);
}

TEST_F(EnvParse, IntRejectsGarbageOverflowAndValuesBelowTheMinimum) {
  std::uniform_int_distribution<int64_t> below(-1000000, 0);
  std::vector<std::string> bad = {"0", "abc", "12abc", "1.5", "", "1e3", "--1", "+-1", "++1", " 5",
                                  "99999999999999999999", std::to_string(below(rng_))};
  for (const std::string& value : bad) {
    set("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE", value);
    EXPECT_EQ(validation_error(), "MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE=" + value +
                                      " is invalid: allowed values are integers >= 1")
        << seed_note();
  }
  set("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE", "-3");
  set("MAGI_ATTENTION_FFA_FORWARD_SM_MARGIN", "-1");
  EXPECT_EQ(validation_error(),
            "MAGI_ATTENTION_FFA_FORWARD_SM_MARGIN=-1 is invalid: allowed values are integers >= 0; "
            "MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE=-3 is invalid: allowed values are integers >= 1");
}

TEST_F(EnvParse, IntUnsetGivesTheFixedDefault) {
  EXPECT_EQ(get_int("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE"), 1000);
  EXPECT_EQ(get_int("CUDA_DEVICE_MAX_CONNECTIONS"), 8);
  EXPECT_EQ(get_int("NVCC_THREADS"), 4);
  EXPECT_FALSE(is_set("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE"));
}

TEST_F(EnvParse, SmMarginDefaultFollowsCudaDeviceMaxConnections) {
  for (const char* margin : {"MAGI_ATTENTION_FFA_FORWARD_SM_MARGIN", "MAGI_ATTENTION_FFA_BACKWARD_SM_MARGIN"}) {
    unset("CUDA_DEVICE_MAX_CONNECTIONS");
    EXPECT_EQ(get_int(margin), 4) << "unset connections default to 8";
    set("CUDA_DEVICE_MAX_CONNECTIONS", "1");
    EXPECT_EQ(get_int(margin), 0);
    EXPECT_EQ(get_string(margin), "0");
    std::uniform_int_distribution<int> connections(2, 32);
    const int value = connections(rng_);
    set("CUDA_DEVICE_MAX_CONNECTIONS", std::to_string(value));
    EXPECT_EQ(get_int(margin), 4) << value << ", " << seed_note();
    set(margin, "7");
    EXPECT_EQ(get_int(margin), 7);
    unset(margin);
  }
}

TEST_F(EnvParse, IntWithBothBoundsNamesTheRange) {
  const Variable& connections = *find("CUDA_DEVICE_MAX_CONNECTIONS");
  EXPECT_EQ(detail::invalid_value_message("CUDA_DEVICE_MAX_CONNECTIONS", "33", connections),
            "CUDA_DEVICE_MAX_CONNECTIONS=33 is invalid: allowed values are integers from 1 to 32");
  for (int value = -2; value <= 40; ++value) {
    const bool valid = value >= 1 && value <= 32;
    EXPECT_EQ(detail::parse_value(connections, std::to_string(value)).has_value(), valid) << value;
  }
}

// ---- Enum ----

TEST_F(EnvParse, EnumAcceptsAllowedValuesInAnyCaseAndReturnsTheCanonicalSpelling) {
  for (int round = 0; round < 10; ++round) {
    for (const std::string op : {"none", "sum", "avg"}) {
      const std::string written = random_case(op);
      set("MAGI_ATTENTION_DSINK_ALL_REDUCE_OP", written);
      EXPECT_EQ(get_string("MAGI_ATTENTION_DSINK_ALL_REDUCE_OP"), op) << written << ", " << seed_note();
    }
  }
}

TEST_F(EnvParse, EnumRejectsOtherValuesNamingTheAllowedOnes) {
  set("MAGI_ATTENTION_DSINK_ALL_REDUCE_OP", "max");
  EXPECT_EQ(validation_error(),
            "MAGI_ATTENTION_DSINK_ALL_REDUCE_OP=max is invalid: allowed values are none, sum, avg");
  set("MAGI_ATTENTION_DSINK_ALL_REDUCE_OP", "");
  EXPECT_EQ(validation_error(),
            "MAGI_ATTENTION_DSINK_ALL_REDUCE_OP= is invalid: allowed values are none, sum, avg");
  unset("MAGI_ATTENTION_DSINK_ALL_REDUCE_OP");
  set("MAGI_ATTENTION_KERNEL_BACKEND", "cuda");
  EXPECT_EQ(validation_error(),
            "MAGI_ATTENTION_KERNEL_BACKEND=cuda is invalid: allowed values are auto, ffa, ffa_sm80, ffa_sm90, sdpa");
  set("MAGI_ATTENTION_KERNEL_BACKEND", "auto");
  set("MAGI_ATTENTION_LOG_LEVEL", "verbose");
  EXPECT_EQ(validation_error(),
            "MAGI_ATTENTION_LOG_LEVEL=verbose is invalid: allowed values are error, warn, info, debug");
}

TEST_F(EnvParse, EnumUnsetGivesTheDefault) {
  EXPECT_EQ(get_string("MAGI_ATTENTION_DSINK_ALL_REDUCE_OP"), "none");
  EXPECT_EQ(get_string("MAGI_ATTENTION_KERNEL_BACKEND"), "auto");
  EXPECT_EQ(get_string("MAGI_ATTENTION_LOG_LEVEL"), "warn");
}

// ---- Path ----

TEST_F(EnvParse, PathAcceptsAnyNonEmptyTextAndRejectsEmpty) {
  set("MAGI_ATTENTION_WORKSPACE_BASE", "/tmp/some where/");
  EXPECT_EQ(get_string("MAGI_ATTENTION_WORKSPACE_BASE"), "/tmp/some where/");
  set("MAGI_ATTENTION_WORKSPACE_BASE", "");
  EXPECT_EQ(validation_error(), "MAGI_ATTENTION_WORKSPACE_BASE= is invalid: allowed values are non-empty paths");
  unset("MAGI_ATTENTION_WORKSPACE_BASE");
  EXPECT_EQ(get_string("MAGI_ATTENTION_WORKSPACE_BASE"), "") << "no fixed default";
}

// ---- validation lifecycle ----

TEST_F(EnvParse, AFailedValidationIsRememberedUntilReset) {
  set("MAGI_ATTENTION_SANITY_CHECK", "maybe");
  const std::string first = validation_error();
  ASSERT_FALSE(first.empty());
  unsetenv("MAGI_ATTENTION_SANITY_CHECK");  // without reset: the first verdict stands
  EXPECT_EQ(validation_error(), first);
  EXPECT_THROW(get_string("MAGI_ATTENTION_LOG_LEVEL"), InvalidArgument);
  reset_for_testing();
  EXPECT_EQ(validation_error(), "");
}

TEST_F(EnvParse, ValidationChecksVariablesTheCallDoesNotRead) {
  set("MAGI_ATTENTION_QO_COMM", "sometimes");
  EXPECT_THROW(get_bool("MAGI_ATTENTION_SANITY_CHECK"), InvalidArgument);
}

TEST_F(EnvParse, TheEnvironmentIsReadOncePerProcess) {
  EXPECT_FALSE(get_bool("MAGI_ATTENTION_SANITY_CHECK"));
  setenv("MAGI_ATTENTION_SANITY_CHECK", "1", 1);  // too late: already read
  EXPECT_FALSE(get_bool("MAGI_ATTENTION_SANITY_CHECK"));
  set("MAGI_ATTENTION_SANITY_CHECK", "1");  // resets
  EXPECT_TRUE(get_bool("MAGI_ATTENTION_SANITY_CHECK"));
}

// ---- aliases ----

TEST_F(EnvParse, TheOlderNameStillWorks) {
  set("MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUCE", "1");
  EXPECT_TRUE(get_bool("MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE"));
  EXPECT_TRUE(is_set("MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE"));
  EXPECT_TRUE(get_bool("MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUCE")) << "getters accept the alias";
  set("MAGI_ATTENTION_LOG_LEVEL", "info");
  const std::string printed = stderr_of_validation();
  EXPECT_NE(printed.find("magi-attn: info: MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUCE is the older name "
                         "of MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE; it still works"),
            std::string::npos)
      << printed;
  EXPECT_EQ(printed.find("warning"), std::string::npos) << "the variable is implemented: " << printed;
}

TEST_F(EnvParse, OldAndNewNameWithDifferentValuesIsAnError) {
  set("MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE", "1");
  set("MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUCE", "0");
  EXPECT_EQ(validation_error(),
            "MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE=1 and MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUCE=0 "
            "disagree: MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUCE is the older name of "
            "MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE; set only MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE");
}

TEST_F(EnvParse, OldAndNewNameWithTheSameMeaningAreAccepted) {
  set("MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE", random_case("true"));
  set("MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUCE", "1");
  EXPECT_EQ(validation_error(), "") << seed_note();
  EXPECT_TRUE(get_bool("MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE"));
}

TEST_F(EnvParse, ABadValueUnderTheOlderNameNamesTheOlderName) {
  set("MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUCE", "fp32");
  EXPECT_EQ(validation_error(), "MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUCE=fp32 is invalid: allowed "
                                "values are 0, 1, true, false, on, off");
}

// ---- warnings ----

TEST_F(EnvParse, UnknownNamesGetADidYouMeanWarning) {
  set("MAGI_ATTENTION_SANITY_CHEK", "1");
  set("MAGI_ATTENTION_DETERMINISTIC", "1");
  set("MAGI_ATTENTION_sdpa_backend", "1");
  set("MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUC", "1");  // near the older name
  set("MAGI_ATTENTION_TOTALLY_DIFFERENT_THING", "1");
  const std::string printed = stderr_of_validation();
  EXPECT_EQ(validation_error(), "") << "unknown names warn, they do not stop";
  for (const std::string expected : {
           "magi-attn: warning: unknown variable MAGI_ATTENTION_SANITY_CHEK is ignored; did you mean "
           "MAGI_ATTENTION_SANITY_CHECK?\n",
           "magi-attn: warning: unknown variable MAGI_ATTENTION_DETERMINISTIC is ignored; did you mean "
           "MAGI_ATTENTION_DETERMINISTIC_MODE?\n",
           "magi-attn: warning: unknown variable MAGI_ATTENTION_sdpa_backend is ignored; did you mean "
           "MAGI_ATTENTION_SDPA_BACKEND?\n",
           "magi-attn: warning: unknown variable MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUC is ignored; "
           "did you mean MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE?\n",
           "magi-attn: warning: unknown variable MAGI_ATTENTION_TOTALLY_DIFFERENT_THING is ignored (`magi-attn "
           "env` lists the known ones)\n"}) {
    EXPECT_EQ(count_occurrences(printed, expected), 1u) << expected << "\nin:\n" << printed;
  }
}

TEST_F(EnvParse, RandomSingleTyposSuggestTheRightName) {
  const auto variables = registry();
  for (int round = 0; round < 200; ++round) {
    const Variable& variable = variables[rng_() % variables.size()];
    if (!variable.name.starts_with("MAGI_ATTENTION_")) continue;
    std::string typo(variable.name);
    const std::size_t at = 15 + rng_() % (typo.size() - 15);  // keep the prefix
    switch (rng_() % 3) {
      case 0: typo.erase(at, 1); break;
      case 1: typo.insert(at, 1, 'X'); break;
      default: typo[at] = typo[at] == 'Q' ? 'Z' : 'Q'; break;
    }
    if (find(typo) != nullptr) continue;
    EXPECT_EQ(detail::closest_name(typo), variable.name) << typo << ", " << seed_note();
  }
}

TEST_F(EnvParse, EditDistanceIsAMetric) {
  std::uniform_int_distribution<int> length(0, 12);
  auto random_word = [&] {
    std::string word(length(rng_), 'A');
    for (char& c : word) c = static_cast<char>('A' + rng_() % 4);
    return word;
  };
  for (int round = 0; round < 300; ++round) {
    const std::string a = random_word(), b = random_word(), c = random_word();
    const std::size_t ab = detail::edit_distance(a, b);
    EXPECT_EQ(ab, detail::edit_distance(b, a)) << a << " " << b << ", " << seed_note();
    EXPECT_EQ(detail::edit_distance(a, a), 0u);
    EXPECT_LE(ab, std::max(a.size(), b.size()));
    EXPECT_GE(ab, a.size() > b.size() ? a.size() - b.size() : b.size() - a.size());
    EXPECT_LE(detail::edit_distance(a, c), ab + detail::edit_distance(b, c)) << seed_note();
  }
  EXPECT_EQ(detail::edit_distance("KITTEN", "SITTING"), 3u);
}

TEST_F(EnvParse, NotImplementedVariablesWarnOnceWithTheReason) {
  set("MAGI_ATTENTION_NATIVE_GRPCOLL", "1");
  set("MAGI_ATTENTION_FA4_BACKEND", "on");
  ::testing::internal::CaptureStderr();
  ensure_validated();
  ensure_validated();
  EXPECT_FALSE(get_bool("MAGI_ATTENTION_SANITY_CHECK"));
  EXPECT_TRUE(get_bool("MAGI_ATTENTION_NATIVE_GRPCOLL")) << "the value is still readable";
  const std::string printed = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count_occurrences(printed, "magi-attn: warning: MAGI_ATTENTION_NATIVE_GRPCOLL=1 has no effect: not "
                                       "implemented yet; planned: native group-collective communication kernels\n"),
            1u)
      << printed;
  EXPECT_EQ(count_occurrences(printed, "magi-attn: warning: MAGI_ATTENTION_FA4_BACKEND=on has no effect: not "
                                       "applicable to this build; FFA_FA4 is upstream's "),
            1u)
      << printed;
  EXPECT_EQ(count_occurrences(printed, "\n"), 2u) << printed;
}

TEST_F(EnvParse, NotImplementedVariableAtItsDefaultIsOnlyANote) {
  set("MAGI_ATTENTION_NATIVE_GRPCOLL", "0");
  EXPECT_EQ(stderr_of_validation(), "");
  set("MAGI_ATTENTION_LOG_LEVEL", "info");
  EXPECT_NE(stderr_of_validation().find("magi-attn: info: MAGI_ATTENTION_NATIVE_GRPCOLL=0 has no effect: not "
                                        "implemented yet; planned: "),
            std::string::npos);
}

TEST_F(EnvParse, ImplementedVariablesPrintNothingAtTheDefaultLevel) {
  set("MAGI_ATTENTION_SANITY_CHECK", "1");
  set("MAGI_ATTENTION_KERNEL_BACKEND", "sdpa");
  set("MAX_JOBS", "3");
  EXPECT_EQ(stderr_of_validation(), "");
  EXPECT_EQ(get_int("MAX_JOBS"), 3);
}

TEST_F(EnvParse, WarningsFromManyThreadsArePrintedOnce) {
  set("MAGI_ATTENTION_NATIVE_GRPCOLL", "1");
  set("MAGI_ATTENTION_SANITY_CHEK", "1");
  ::testing::internal::CaptureStderr();
  std::atomic<int> trues{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) trues += get_bool("MAGI_ATTENTION_NATIVE_GRPCOLL") ? 1 : 0;
    });
  }
  for (std::thread& thread : threads) thread.join();
  const std::string printed = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(trues.load(), 800);
  EXPECT_EQ(count_occurrences(printed, "MAGI_ATTENTION_NATIVE_GRPCOLL=1 has no effect: not implemented yet"), 1u)
      << printed;
  EXPECT_EQ(count_occurrences(printed, "did you mean MAGI_ATTENTION_SANITY_CHECK?"), 1u) << printed;
}

// ---- variables shared with other tools ----

TEST_F(EnvParse, ABadValueOfAnotherToolsVariableWarnsAndFallsBackToTheDefault) {
  set("MAX_JOBS", "lots");
  set("CUDA_DEVICE_MAX_CONNECTIONS", "64");
  const std::string printed = stderr_of_validation();
  EXPECT_EQ(validation_error(), "");
  EXPECT_NE(printed.find("magi-attn: warning: MAX_JOBS=lots is invalid: allowed values are integers >= 1; "
                         "magi-attn ignores it\n"),
            std::string::npos)
      << printed;
  EXPECT_NE(printed.find("magi-attn: warning: CUDA_DEVICE_MAX_CONNECTIONS=64 is invalid: allowed values are "
                         "integers from 1 to 32; magi-attn ignores it\n"),
            std::string::npos)
      << printed;
  EXPECT_FALSE(is_set("MAX_JOBS"));
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  EXPECT_EQ(get_int("MAX_JOBS"), static_cast<int64_t>(cores)) << "scripts/build.sh uses nproc";
  EXPECT_EQ(get_int("CUDA_DEVICE_MAX_CONNECTIONS"), 8);
}

TEST_F(EnvParse, AnotherToolsVariableThatWeDoNotUseIsOnlyANote) {
  set("NVCC_THREADS", "8");
  set("CUDA_DEVICE_MAX_CONNECTIONS", "1");
  EXPECT_EQ(stderr_of_validation(), "");
  set("MAGI_ATTENTION_LOG_LEVEL", "info");
  const std::string printed = stderr_of_validation();
  EXPECT_NE(printed.find("magi-attn: info: magi-attn does not use NVCC_THREADS=8: not applicable to this build; "),
            std::string::npos)
      << printed;
}

// ---- log levels ----

TEST_F(EnvParse, LogLevelFiltersMessages) {
  set("MAGI_ATTENTION_NATIVE_GRPCOLL", "1");
  set("MAGI_ATTENTION_SANITY_CHECK", "1");
  set("MAGI_ATTENTION_LOG_LEVEL", "error");
  EXPECT_EQ(stderr_of_validation(), "") << "error silences warnings";
  EXPECT_EQ(log::level(), log::Level::Error);

  set("MAGI_ATTENTION_LOG_LEVEL", "warn");
  std::string printed = stderr_of_validation();
  EXPECT_EQ(count_occurrences(printed, "magi-attn: warning: "), 1u) << printed;
  EXPECT_EQ(count_occurrences(printed, "magi-attn: debug: "), 0u) << printed;

  set("MAGI_ATTENTION_LOG_LEVEL", random_case("debug"));
  printed = stderr_of_validation();
  EXPECT_EQ(log::level(), log::Level::Debug) << seed_note();
  EXPECT_NE(printed.find("magi-attn: debug: MAGI_ATTENTION_SANITY_CHECK=1 is in effect\n"), std::string::npos)
      << printed;
}

// A warning quoting a value with a newline stays one stderr line (it was two).
TEST_F(EnvParse, WarningsAreOneLineWhateverTheValueHolds) {
  set("CUDA_DEVICE_MAX_CONNECTIONS", "a\nb\r");
  EXPECT_EQ(stderr_of_validation(),
            "magi-attn: warning: CUDA_DEVICE_MAX_CONNECTIONS=a b  is invalid: allowed values are integers from 1 to 32; "
            "magi-attn ignores it\n");
}

TEST_F(EnvParse, LogFunctionsPrefixAndFilter) {
  set("MAGI_ATTENTION_LOG_LEVEL", "info");
  ::testing::internal::CaptureStderr();
  log::warn("first");
  log::info("second");
  log::debug("third");
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "magi-attn: warning: first\nmagi-attn: info: second\n");
  unset("MAGI_ATTENTION_LOG_LEVEL");
  ::testing::internal::CaptureStderr();
  log::warn("w");
  log::info("i");
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "magi-attn: warning: w\n") << "default is warn";
}

TEST_F(EnvParse, LoggingWithABadEnvironmentDoesNotThrow) {
  set("MAGI_ATTENTION_LOG_LEVEL", "loud");
  ::testing::internal::CaptureStderr();
  EXPECT_NO_THROW(log::warn("still printed"));
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "magi-attn: warning: still printed\n");
  EXPECT_THROW(ensure_validated(), InvalidArgument);
}

// ---- engine choice ----

TEST_F(EnvParse, KernelBackendCombinesBothVariables) {
  EXPECT_EQ(kernel_backend(), KernelBackend::Auto);
  set("MAGI_ATTENTION_KERNEL_BACKEND", "ffa");
  EXPECT_EQ(kernel_backend(), KernelBackend::Ffa);
  set("MAGI_ATTENTION_KERNEL_BACKEND", "SDPA");
  EXPECT_EQ(kernel_backend(), KernelBackend::Sdpa);
  unset("MAGI_ATTENTION_KERNEL_BACKEND");
  set("MAGI_ATTENTION_SDPA_BACKEND", "1");
  EXPECT_EQ(kernel_backend(), KernelBackend::Sdpa);
  set("MAGI_ATTENTION_KERNEL_BACKEND", "auto");
  EXPECT_EQ(kernel_backend(), KernelBackend::Sdpa);
  set("MAGI_ATTENTION_KERNEL_BACKEND", "sdpa");
  EXPECT_EQ(kernel_backend(), KernelBackend::Sdpa);
  set("MAGI_ATTENTION_SDPA_BACKEND", "0");
  set("MAGI_ATTENTION_KERNEL_BACKEND", "ffa");
  EXPECT_EQ(kernel_backend(), KernelBackend::Ffa);
  EXPECT_EQ(kernel_family(), KernelFamily::Auto);
  set("MAGI_ATTENTION_KERNEL_BACKEND", "ffa_sm80");
  EXPECT_EQ(kernel_backend(), KernelBackend::Ffa);
  EXPECT_EQ(kernel_family(), KernelFamily::Sm80);
  set("MAGI_ATTENTION_KERNEL_BACKEND", "FFA_SM90");
  EXPECT_EQ(kernel_backend(), KernelBackend::Ffa);
  EXPECT_EQ(kernel_family(), KernelFamily::Sm90);
  set("MAGI_ATTENTION_SDPA_BACKEND", "1");
  EXPECT_THROW(ensure_validated(), InvalidArgument);
}

TEST_F(EnvParse, SdpaBackendWithKernelBackendFfaIsAnError) {
  set("MAGI_ATTENTION_SDPA_BACKEND", "true");
  set("MAGI_ATTENTION_KERNEL_BACKEND", "ffa");
  EXPECT_EQ(validation_error(), "MAGI_ATTENTION_SDPA_BACKEND=true selects the sdpa engine but "
                                "MAGI_ATTENTION_KERNEL_BACKEND=ffa selects ffa: set only one of them");
}

// ---- getters used wrongly are programming errors ----

TEST_F(EnvParse, GettersRejectUnknownNamesAndWrongTypes) {
  EXPECT_THROW(get_bool("MAGI_ATTENTION_NO_SUCH_THING"), std::logic_error);
  EXPECT_THROW(get_string("NOT_REGISTERED"), std::logic_error);
  EXPECT_THROW(is_set("MAGI_ATTENTION_SANITY_CHEK"), std::logic_error);
  EXPECT_THROW(get_bool("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE"), std::logic_error);
  EXPECT_THROW(get_int("MAGI_ATTENTION_SANITY_CHECK"), std::logic_error);
  EXPECT_THROW(get_int("MAGI_ATTENTION_BUILD_COMPUTE_CAPABILITY"), std::logic_error) << "a list, not an int";
  set("MAGI_ATTENTION_BUILD_COMPUTE_CAPABILITY", "80;hopper");
  EXPECT_EQ(get_string("MAGI_ATTENTION_BUILD_COMPUTE_CAPABILITY"), "80;hopper");
  // A logic_error is not an InvalidArgument: callers cannot confuse the two.
  try {
    get_bool("MAGI_ATTENTION_NO_SUCH_THING");
  } catch (const magi::Error&) {
    ADD_FAILURE() << "programming errors must not look like bad user input";
  } catch (const std::logic_error&) {
  }
}

}  // namespace
}  // namespace magi::env
