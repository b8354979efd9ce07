// `magi-attn` help, version, env and the demo (the main job) end to end.
#include <gtest/gtest.h>

#include "cli/npy.hpp"
#include "cli_test_helpers.hpp"
#include "magi/env.hpp"

namespace magi::cli::test {
namespace {

TEST(CliMisc, EveryCommandHasHelp) {
  for (const std::string command : {"run", "mask", "demo", "env"}) {
    const CliResult r = run_cli({command, "--help"});
    EXPECT_EQ(r.exit_code, 0) << command << describe(r);
    EXPECT_EQ(r.out.rfind("usage: magi-attn " + command, 0), 0u) << command << describe(r);
    EXPECT_NE(r.out.find("--help"), std::string::npos) << command;
    EXPECT_TRUE(r.err.empty()) << command << describe(r);
  }
  const CliResult top = run_cli({"--help"});
  EXPECT_EQ(top.exit_code, 0) << describe(top);
  for (const char* command : {"demo", "run", "mask", "env"}) EXPECT_NE(top.out.find(command), std::string::npos);
}

TEST(CliMisc, HelpWinsOverBadOptionsAndBadEnvironment) {
  const CliResult r = run_cli({"run", "--bogus", "--help"}, {"MAGI_ATTENTION_DSINK_ALL_REDUCE_OP=max"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("--out-dir"), std::string::npos);
}

TEST(CliMisc, Version) {
  const CliResult r = run_cli({"--version"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out.rfind("magi-attn ", 0), 0u) << r.out;
  EXPECT_NE(r.out.find('.'), std::string::npos) << r.out;
}

TEST(CliMisc, EnvListsEveryRegisteredVariableWithItsValue) {
  const CliResult r = run_cli({"env"}, {"MAGI_ATTENTION_DETERMINISTIC_MODE=1"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  for (const env::Variable& v : env::registry()) EXPECT_NE(r.out.find(std::string(v.name)), std::string::npos) << v.name;
  // The set value shows on the variable's line.
  const size_t at = r.out.find("MAGI_ATTENTION_DETERMINISTIC_MODE");
  ASSERT_NE(at, std::string::npos);
  const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
  EXPECT_NE(line.find(" 1 "), std::string::npos) << line;
}

TEST(CliMisc, EnvMarkdownIsTheRegistryTable) {
  const CliResult r = run_cli({"env", "--markdown"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out, env::markdown());
}

TEST(CliMisc, DemoPassesOnASmallProblem) {
  const CliResult r = run_cli({"demo", "--tokens", "1024", "--heads-q", "4", "--heads-kv", "2", "--head-dim", "64"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  for (const char* fragment : {"documents", "area", "forward", "backward", "FLOP/s", "out ", "lse ", "dq ", "result    PASS"})
    EXPECT_NE(r.out.find(fragment), std::string::npos) << fragment << "\n" << r.out;
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
  // Progress on stderr (not a terminal here: one line per finished phase).
  EXPECT_NE(r.err.find("forward:"), std::string::npos) << r.err;
}

TEST(CliMisc, DemoWithSeedIsReproducibleAndChecksEveryDtype) {
  for (const char* dtype : {"fp64", "fp16", "bf16"}) {
    const std::vector<std::string> args = {"demo", "--tokens", "512", "--heads-q", "2", "--heads-kv", "1",
                                           "--head-dim", "32", "--dtype", dtype, "--seed", "11"};
    const CliResult r = run_cli(args);
    ASSERT_EQ(r.exit_code, 0) << dtype << describe(r);
    EXPECT_NE(r.out.find("result    PASS"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(std::string(dtype) + ", seed 11"), std::string::npos) << r.out;
    // The mask line depends only on the seed.
    const CliResult again = run_cli(args);
    auto mask_line = [](const std::string& out) { return out.substr(out.find("  mask"), out.find("  shapes") - out.find("  mask")); };
    EXPECT_EQ(mask_line(r.out), mask_line(again.out));
  }
}

TEST(CliMisc, EnvReportsABadValueInsteadOfStopping) {
  const CliResult r = run_cli({"env"}, {"MAGI_ATTENTION_DSINK_ALL_REDUCE_OP=max"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const std::string all = r.out + r.err;
  EXPECT_NE(all.find("MAGI_ATTENTION_DSINK_ALL_REDUCE_OP=max"), std::string::npos) << all;
  EXPECT_NE(all.find("none, sum, avg"), std::string::npos) << all;
}

}  // namespace
}  // namespace magi::cli::test
