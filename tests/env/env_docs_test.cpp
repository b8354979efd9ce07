// docs/env.md is markdown() exactly; the markdown and the `magi-attn env` table cover the whole registry.
// Refresh the document with: MAGI_ATTN_UPDATE_DOCS=1 <build>/tests/env/env_docs_test
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "env_fixture.hpp"

namespace magi::env {
namespace {

using testing_support::count_occurrences;

const std::filesystem::path kDocument = std::filesystem::path(MAGI_SOURCE_DIR) / "docs" / "env.md";

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(EnvDocs, DocsEnvMdIsCurrent) {
  const std::string expected = markdown();
  const char* update = std::getenv("MAGI_ATTN_UPDATE_DOCS");
  if (update != nullptr && std::string(update) == "1") {
    std::ofstream(kDocument, std::ios::binary | std::ios::trunc) << expected;
  }
  ASSERT_TRUE(std::filesystem::exists(kDocument)) << kDocument << " is missing";
  EXPECT_TRUE(read_file(kDocument) == expected)
      << kDocument << " is stale: regenerate it with MAGI_ATTN_UPDATE_DOCS=1 and this test program";
}

class EnvViews : public testing_support::CleanEnvironment {};

TEST_F(EnvViews, MarkdownHasOneTablePerCategoryAndEveryVariableOnce) {
  const std::string text = markdown();
  for (const char* heading : {"\n## Correctness\n", "\n## Performance\n", "\n## Debug\n", "\n## Build\n"}) {
    EXPECT_EQ(count_occurrences(text, heading), 1u) << heading;
  }
  EXPECT_EQ(count_occurrences(text, "| Variable | Type | Default | Allowed | Status | Meaning |"), 4u);
  for (const Variable& variable : registry()) {
    const std::string row = "| `" + std::string(variable.name) + "` | " + std::string(to_string(variable.type)) + " | ";
    EXPECT_EQ(count_occurrences(text, row), 1u) << variable.name;
    for (std::string_view alias : variable.aliases) {
      EXPECT_NE(text.find("Older name: `" + std::string(alias) + "`"), std::string::npos) << alias;
    }
  }
  EXPECT_NE(text.find("| `MAGI_ATTENTION_DSINK_ALL_REDUCE_OP` | enum | `none` | `none`, `sum`, `avg` | implemented "),
            std::string::npos);
  EXPECT_NE(text.find("| `MAGI_ATTENTION_FFA_FORWARD_SM_MARGIN` | int | 4 if CUDA_DEVICE_MAX_CONNECTIONS > 1, else 0 | "
                      "integers >= 0 | "),
            std::string::npos);
}

TEST_F(EnvViews, MarkdownDoesNotDependOnTheEnvironmentOrTheMachine) {
  const std::string clean = markdown();
  set("MAX_JOBS", "3");
  set("CUDA_DEVICE_MAX_CONNECTIONS", "1");
  set("MAGI_ATTENTION_SANITY_CHECK", "1");
  EXPECT_TRUE(markdown() == clean);
}

TEST_F(EnvViews, TableShowsCurrentValuesAndProblemsWithoutThrowing) {
  set("MAGI_ATTENTION_SANITY_CHECK", "1");
  set("MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUCE", "1");
  set("MAGI_ATTENTION_DSINK_ALL_REDUCE_OP", "max");
  set("MAGI_ATTENTION_SANITY_CHEK", "1");
  set("CUDA_DEVICE_MAX_CONNECTIONS", "1");
  std::string table;
  ::testing::internal::CaptureStderr();
  ASSERT_NO_THROW(table = table_with_values());
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "") << "the table reports problems itself";

  for (const Variable& variable : registry()) {
    EXPECT_EQ(count_occurrences(table, "\n" + std::string(variable.name) + " "), 1u) << variable.name;
  }
  auto line_of = [&](const std::string& name) {
    const std::size_t start = table.find("\n" + name + " ");
    return start == std::string::npos ? std::string() : table.substr(start + 1, table.find('\n', start + 1) - start - 1);
  };
  EXPECT_NE(line_of("MAGI_ATTENTION_SANITY_CHECK").find(" 1 "), std::string::npos) << table;
  EXPECT_NE(line_of("MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE")
                .find("1 (as MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUCE)"),
            std::string::npos)
      << table;
  EXPECT_NE(line_of("MAGI_ATTENTION_DSINK_ALL_REDUCE_OP").find("max (invalid)"), std::string::npos) << table;
  // Older names beside each variable (the last column), "-" where there are none.
  for (const Variable& variable : registry()) {
    const std::string line = line_of(std::string(variable.name));
    if (variable.aliases.empty()) {
      EXPECT_EQ(line.substr(line.size() - 2), " -") << line;
    }
    for (std::string_view alias : variable.aliases) EXPECT_NE(line.find(std::string(alias)), std::string::npos) << line;
  }
  EXPECT_NE(table.find("VARIABLE"), std::string::npos);
  EXPECT_NE(table.find("OLDER NAMES"), std::string::npos);
  EXPECT_NE(line_of("MAGI_ATTENTION_DETERMINISTIC_MODE").find(" - "), std::string::npos) << "unset shows -";
  EXPECT_NE(line_of("MAGI_ATTENTION_FFA_FORWARD_SM_MARGIN").find("0 (4 if CUDA_DEVICE_MAX_CONNECTIONS > 1, else 0)"),
            std::string::npos)
      << "computed default evaluated: " << table;
  EXPECT_NE(table.find("\nProblems:\n"), std::string::npos);
  EXPECT_NE(table.find("  error: MAGI_ATTENTION_DSINK_ALL_REDUCE_OP=max is invalid: allowed values are none, sum, avg\n"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("did you mean MAGI_ATTENTION_SANITY_CHECK?"), std::string::npos) << table;

  // Columns line up: every value starts in the same column as the header's VALUE.
  const std::size_t value_column = table.find("VALUE");
  ASSERT_NE(value_column, std::string::npos);
  const std::string sanity = line_of("MAGI_ATTENTION_SANITY_CHECK");
  EXPECT_EQ(sanity.find_first_not_of(' ', std::string("MAGI_ATTENTION_SANITY_CHECK").size()), value_column) << table;
}

// A value with control characters (several lines) stays on its row, escaped, in the table and in its problem line.
TEST_F(EnvViews, TableEscapesControlCharactersInValues) {
  set("MAGI_ATTENTION_DSINK_ALL_REDUCE_OP", "sum\nMAGI_ATTENTION_FAKE\t\x01");
  const std::string table = table_with_values();
  EXPECT_EQ(table.find("\nMAGI_ATTENTION_FAKE"), std::string::npos) << table;
  EXPECT_NE(table.find("sum\\nMAGI_ATTENTION_FAKE\\t\\x01 (invalid)"), std::string::npos) << table;
  EXPECT_TRUE(std::all_of(table.begin(), table.end(),
                          [](char c) { return c == '\n' || static_cast<unsigned char>(c) >= 0x20; }))
      << table;
}

TEST_F(EnvViews, TableOfACleanEnvironmentHasNoProblems) {
  const std::string table = table_with_values();
  EXPECT_EQ(table.find("Problems:"), std::string::npos) << table;
  EXPECT_TRUE(table.starts_with("VARIABLE")) << table;
}

}  // namespace
}  // namespace magi::env
