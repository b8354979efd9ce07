// Invariants of the registry table, and its coverage of the upstream documents (seeds 000, 001, 004).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "env/scan.hpp"
#include "magi/env.hpp"

namespace magi::env {
namespace {

// Variables outside the MAGI_ATTENTION_ namespace that the seeds document.
const std::set<std::string> kForeignNames = {"CUDA_DEVICE_MAX_CONNECTIONS", "NVCC_THREADS", "MAX_JOBS",
                                              "NVSHMEM_DIR"};

// Every variable name in seeds 000, 001 and 004, for checkouts without ../shared/seeds. When the seeds
// are present, a test checks that this list is exactly what they mention.
const std::set<std::string> kSeedNames = {
    "MAGI_ATTENTION_AUTO_RANGE_MERGE", "MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE",
    "MAGI_ATTENTION_BUILD_COMPUTE_CAPABILITY", "MAGI_ATTENTION_BUILD_DEBUG", "MAGI_ATTENTION_BUILD_VERBOSE",
    "MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE", "MAGI_ATTENTION_CATGQA", "MAGI_ATTENTION_CPP_BACKEND",
    "MAGI_ATTENTION_DETERMINISTIC_MODE", "MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE",
    "MAGI_ATTENTION_DSINK_ALL_REDUCE_OP", "MAGI_ATTENTION_FA4_BACKEND",
    "MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUCE", "MAGI_ATTENTION_FFA_BACKWARD_SM_MARGIN",
    "MAGI_ATTENTION_FFA_FA4_CACHE_DIR", "MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT",
    "MAGI_ATTENTION_FFA_FORWARD_SM_MARGIN", "MAGI_ATTENTION_FLATTEN_HEAD_GROUPS", "MAGI_ATTENTION_FORCE_JIT_BUILD",
    "MAGI_ATTENTION_FORWARD_HIGH_PRECISION_REDUCE", "MAGI_ATTENTION_HIERARCHICAL_COMM",
    "MAGI_ATTENTION_NATIVE_GRPCOLL", "MAGI_ATTENTION_NO_BUILD_CACHE", "MAGI_ATTENTION_PREBUILD_FFA",
    "MAGI_ATTENTION_PREBUILD_FFA_JOBS", "MAGI_ATTENTION_PROFILE_MODE", "MAGI_ATTENTION_QO_COMM",
    "MAGI_ATTENTION_SANITY_CHECK", "MAGI_ATTENTION_SDPA_BACKEND", "MAGI_ATTENTION_SKIP_FFA_UTILS_BUILD",
    "MAGI_ATTENTION_SKIP_MAGI_ATTN_COMM_BUILD", "MAGI_ATTENTION_SKIP_MAGI_ATTN_EXT_BUILD",
    "MAGI_ATTENTION_WORKSPACE_BASE", "CUDA_DEVICE_MAX_CONNECTIONS", "MAX_JOBS", "NVCC_THREADS", "NVSHMEM_DIR",
};

std::vector<std::string_view> all_names() {
  std::vector<std::string_view> names;
  for (const Variable& variable : registry()) {
    names.push_back(variable.name);
    names.insert(names.end(), variable.aliases.begin(), variable.aliases.end());
  }
  return names;
}

TEST(EnvRegistry, NamesAndAliasesAreUnique) {
  const std::vector<std::string_view> names = all_names();
  const std::set<std::string_view> unique(names.begin(), names.end());
  EXPECT_EQ(unique.size(), names.size());
}

TEST(EnvRegistry, NamesAreFarEnoughApartForUnambiguousSuggestions) {
  // A one-character typo then stays closest to the intended name.
  const std::vector<std::string_view> names = all_names();
  for (std::size_t i = 0; i < names.size(); ++i) {
    for (std::size_t j = i + 1; j < names.size(); ++j) {
      if (find(names[i]) == find(names[j])) continue;  // a name and its alias
      EXPECT_GE(detail::edit_distance(names[i], names[j]), 3u) << names[i] << " vs " << names[j];
    }
  }
}

TEST(EnvRegistry, FindResolvesNamesAndAliases) {
  for (const Variable& variable : registry()) {
    EXPECT_EQ(find(variable.name), &variable);
    for (std::string_view alias : variable.aliases) EXPECT_EQ(find(alias), &variable) << alias;
  }
  EXPECT_EQ(find("MAGI_ATTENTION_NOPE"), nullptr);
  EXPECT_EQ(find(""), nullptr);
  EXPECT_EQ(find("magi_attention_sanity_check"), nullptr) << "names are case-sensitive";
}

TEST(EnvRegistry, NamesHaveOurPrefixOrAreTheDocumentedForeignOnes) {
  for (std::string_view name : all_names()) {
    EXPECT_TRUE(name.starts_with("MAGI_ATTENTION_") || kForeignNames.contains(std::string(name))) << name;
  }
  for (const Variable& variable : registry()) {
    for (std::string_view alias : variable.aliases) EXPECT_TRUE(alias.starts_with("MAGI_ATTENTION_")) << alias;
  }
}

TEST(EnvRegistry, DefaultsAreValidUnderTheirOwnType) {
  for (const Variable& variable : registry()) {
    SCOPED_TRACE(std::string(variable.name));
    if (!variable.default_value.empty()) {
      EXPECT_TRUE(variable.default_rule.empty()) << "a fixed default and a rule contradict";
      const auto parsed = detail::parse_value(variable, variable.default_value);
      ASSERT_TRUE(parsed.has_value()) << variable.default_value;
      EXPECT_EQ(*parsed, variable.default_value) << "defaults are written in canonical form";
    } else {
      EXPECT_FALSE(variable.default_rule.empty()) << "without a fixed default, say how it is decided";
    }
    if (variable.computed_default != nullptr) {
      ASSERT_EQ(variable.type, VarType::Int);
      EXPECT_TRUE(detail::parse_value(variable, std::to_string(variable.computed_default())).has_value());
    }
  }
}

TEST(EnvRegistry, AllowedValuesFitTheType) {
  for (const Variable& variable : registry()) {
    SCOPED_TRACE(std::string(variable.name));
    switch (variable.type) {
      case VarType::Bool:
        EXPECT_EQ(variable.allowed, (std::vector<std::string_view>{"0", "1"}));
        break;
      case VarType::Enum: {
        EXPECT_GE(variable.allowed.size(), 2u);
        std::set<std::string> lowered;
        for (std::string_view value : variable.allowed) {
          std::string lower(value);
          std::ranges::transform(lower, lower.begin(), [](unsigned char c) { return std::tolower(c); });
          EXPECT_EQ(lower, value) << "canonical spellings are lower case";
          lowered.insert(lower);
        }
        EXPECT_EQ(lowered.size(), variable.allowed.size()) << "allowed values are unique";
        break;
      }
      case VarType::Int: {
        ASSERT_EQ(variable.allowed.size(), 2u) << "{min, max}, empty = unbounded";
        std::optional<int64_t> min, max;
        if (!variable.allowed[0].empty()) min = std::stoll(std::string(variable.allowed[0]));
        if (!variable.allowed[1].empty()) max = std::stoll(std::string(variable.allowed[1]));
        if (min && max) {
          EXPECT_LE(*min, *max);
        }
        break;
      }
      case VarType::Path:
        EXPECT_TRUE(variable.allowed.empty());
        break;
      case VarType::String:  // at most one entry: the accepted form in words, for the docs
        EXPECT_LE(variable.allowed.size(), 1u);
        break;
    }
  }
}

TEST(EnvRegistry, EveryEntryIsDocumented) {
  const std::set<std::string_view> categories = {"correctness", "performance", "debug", "build"};
  for (const Variable& variable : registry()) {
    SCOPED_TRACE(std::string(variable.name));
    EXPECT_TRUE(categories.contains(variable.category)) << variable.category;
    EXPECT_FALSE(variable.meaning.empty());
    EXPECT_EQ(variable.meaning.find('\n'), std::string_view::npos) << "one line";
    EXPECT_TRUE(variable.meaning.ends_with(".")) << variable.meaning;
    switch (variable.status) {
      case Status::Implemented: EXPECT_TRUE(variable.status_reason.empty()); break;
      case Status::NotYet: EXPECT_TRUE(variable.status_reason.starts_with("planned: ")) << variable.status_reason; break;
      case Status::NotApplicable: EXPECT_GE(variable.status_reason.size(), 20u) << "give the reason"; break;
    }
  }
}

TEST(EnvRegistry, ImplementedAreExactlyWhatThisBuildHonours) {
  std::set<std::string_view> implemented;
  for (const Variable& variable : registry()) {
    if (variable.status == Status::Implemented) implemented.insert(variable.name);
  }
  EXPECT_EQ(implemented, (std::set<std::string_view>{"MAGI_ATTENTION_SANITY_CHECK", "MAGI_ATTENTION_SDPA_BACKEND",
                                                     "MAGI_ATTENTION_KERNEL_BACKEND",
                                                     "MAGI_ATTENTION_DETERMINISTIC_MODE",
                                                     "MAGI_ATTENTION_LOG_LEVEL", "MAX_JOBS",
                                                     // distributed attention
                                                     "MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE",
                                                     "MAGI_ATTENTION_DSINK_ALL_REDUCE_OP",
                                                     "MAGI_ATTENTION_HIERARCHICAL_COMM",
                                                     "MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE",
                                                     "MAGI_ATTENTION_PROFILE_DIR",
                                                     "MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE",
                                                     "MAGI_ATTENTION_QO_COMM",
                                                     "MAGI_ATTENTION_FLATTEN_HEAD_GROUPS",
                                                     "MAGI_ATTENTION_FORWARD_HIGH_PRECISION_REDUCE",
                                                     "MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT",
                                                     // every backend's plans and the distributed runtime key
                                                     "MAGI_ATTENTION_AUTO_RANGE_MERGE",
                                                     // GPU kernels
                                                     "MAGI_ATTENTION_FFA_FORWARD_SM_MARGIN",
                                                     "MAGI_ATTENTION_FFA_BACKWARD_SM_MARGIN",
                                                     "MAGI_ATTENTION_PROFILE_MODE", "CUDA_DEVICE_MAX_CONNECTIONS",
                                                     "MAGI_ATTENTION_CUDA_IGNORE_TUNED_CONFIGS",
                                                     "MAGI_ATTENTION_CATGQA",  // the Hopper backward
                                                     // the build (cmake/build_env.cmake; tests/env/build_env_test.cmake)
                                                     "MAGI_ATTENTION_BUILD_COMPUTE_CAPABILITY",
                                                     "MAGI_ATTENTION_PREBUILD_FFA",
                                                     "MAGI_ATTENTION_SKIP_MAGI_ATTN_COMM_BUILD"}));
}

TEST(EnvRegistry, TheNewerSeedWinsWhereTheSeedsDiffer) {
  const Variable* dict = find("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE");
  ASSERT_NE(dict, nullptr);
  EXPECT_EQ(dict->default_value, "1000") << "seed 000 said 100, seed 001 says 1000";
  const Variable* reduce = find("MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUCE");
  ASSERT_NE(reduce, nullptr);
  EXPECT_EQ(reduce->name, "MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE");
  const Variable* inplace = find("MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT");
  ASSERT_NE(inplace, nullptr) << "variables only in seed 000 stay";
  EXPECT_EQ(inplace->status, Status::Implemented);
  EXPECT_EQ(inplace->default_value, "1") << "on by default here (upstream: 0); the description says so";
  EXPECT_NE(inplace->meaning.find("upstream's default is 0"), std::string_view::npos);
}

TEST(EnvRegistry, SpecificEntries) {
  const Variable& dsink = *find("MAGI_ATTENTION_DSINK_ALL_REDUCE_OP");
  EXPECT_EQ(dsink.type, VarType::Enum);
  EXPECT_EQ(dsink.default_value, "none");
  EXPECT_EQ(dsink.allowed, (std::vector<std::string_view>{"none", "sum", "avg"}));
  const Variable& backend = *find("MAGI_ATTENTION_KERNEL_BACKEND");
  EXPECT_EQ(backend.default_value, "auto");
  EXPECT_EQ(backend.allowed, (std::vector<std::string_view>{"auto", "ffa", "ffa_sm80", "ffa_sm90", "sdpa"}));
  const Variable& level = *find("MAGI_ATTENTION_LOG_LEVEL");
  EXPECT_EQ(level.default_value, "warn");
  EXPECT_EQ(level.allowed, (std::vector<std::string_view>{"error", "warn", "info", "debug"}));
  for (const char* margin : {"MAGI_ATTENTION_FFA_FORWARD_SM_MARGIN", "MAGI_ATTENTION_FFA_BACKWARD_SM_MARGIN"}) {
    const Variable& variable = *find(margin);
    EXPECT_EQ(variable.default_value, "") << "computed, not fixed";
    EXPECT_NE(variable.default_rule.find("CUDA_DEVICE_MAX_CONNECTIONS"), std::string_view::npos);
    EXPECT_NE(variable.computed_default, nullptr);
    EXPECT_EQ(variable.status, Status::Implemented);
  }
  for (const char* python_only : {"MAGI_ATTENTION_FA4_BACKEND", "MAGI_ATTENTION_FFA_FA4_CACHE_DIR",
                                  "MAGI_ATTENTION_CPP_BACKEND", "MAGI_ATTENTION_SKIP_MAGI_ATTN_EXT_BUILD",
                                  "MAGI_ATTENTION_SKIP_FFA_UTILS_BUILD", "MAGI_ATTENTION_FORCE_JIT_BUILD"}) {
    EXPECT_EQ(find(python_only)->status, Status::NotApplicable) << python_only;
  }
  EXPECT_EQ(find("MAGI_ATTENTION_NATIVE_GRPCOLL")->status, Status::NotYet) << "needs several GPUs to test";
}

TEST(EnvRegistry, EverySeedNameIsRegistered) {
  for (const std::string& name : kSeedNames) EXPECT_NE(find(name), nullptr) << name;
}

// The seeds themselves, where this checkout sits next to them.
TEST(EnvRegistry, TheSeedDocumentsMentionExactlyTheListedNames) {
  const std::filesystem::path seeds = std::filesystem::path(MAGI_SOURCE_DIR) / ".." / "shared" / "seeds";
  if (!std::filesystem::is_directory(seeds)) GTEST_SKIP() << seeds << " is absent; the list above stands in";
  const std::regex variable(R"(\b(MAGI_ATTENTION_[A-Z0-9_]*[A-Z0-9]|CUDA_DEVICE_MAX_CONNECTIONS|NVCC_THREADS|MAX_JOBS|NVSHMEM_DIR)\b)");
  std::set<std::string> mentioned;
  int documents = 0;
  for (const auto& entry : std::filesystem::directory_iterator(seeds)) {
    const std::string file = entry.path().filename().string();
    if (!(file.starts_with("000_") || file.starts_with("001_") || file.starts_with("004_"))) continue;
    ++documents;
    std::ifstream in(entry.path());
    std::stringstream text;
    text << in.rdbuf();
    const std::string content = text.str();
    for (std::sregex_iterator it(content.begin(), content.end(), variable), end; it != end; ++it) {
      mentioned.insert((*it)[1].str());
    }
  }
  ASSERT_EQ(documents, 3) << "expected seeds 000, 001 and 004 in " << seeds;
  EXPECT_EQ(mentioned, kSeedNames);
  for (const std::string& name : mentioned) EXPECT_NE(find(name), nullptr) << name;
}

}  // namespace
}  // namespace magi::env
