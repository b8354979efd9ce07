// `magi-attn` help, version, env and the demo (the main job) end to end.
#include <gtest/gtest.h>

#include <fstream>

#include "cli/npy.hpp"
#include "cli_test_helpers.hpp"
#include "magi/env.hpp"

namespace magi::cli::test {
namespace {

TEST(CliMisc, EveryCommandHasHelp) {
  for (const std::string command : {"run", "mask", "demo", "env", "trace"}) {
    const CliResult r = run_cli({command, "--help"});
    EXPECT_EQ(r.exit_code, 0) << command << describe(r);
    EXPECT_EQ(r.out.rfind("usage: magi-attn " + command, 0), 0u) << command << describe(r);
    EXPECT_NE(r.out.find("--help"), std::string::npos) << command;
    EXPECT_TRUE(r.err.empty()) << command << describe(r);
  }
  const CliResult top = run_cli({"--help"});
  EXPECT_EQ(top.exit_code, 0) << describe(top);
  for (const char* command : {"demo", "run", "mask", "env", "trace"}) EXPECT_NE(top.out.find(command), std::string::npos);
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

// `magi-attn trace DIR` merges rank timelines and reports how much communication ran during computation.
TEST(CliMisc, TraceMergesRankTimelinesAndReportsTheOverlap) {
  auto write_text = [](const std::string& path, const std::string& text) { std::ofstream(path) << text; };
  TempDir dir;
  auto rank_file = [&](int rank, const std::string& events) {
    write_text(dir / ("rank_" + std::to_string(rank) + ".json"),
               "{\"magi_rank\": " + std::to_string(rank) + ", \"traceEvents\": [" + events + "]}");
  };
  auto span = [](const char* name, const char* lane, double ts, double dur) {
    return std::string("{\"name\": \"") + name + "\", \"cat\": \"" + lane + "\", \"ph\": \"X\", \"ts\": " +
           std::to_string(ts) + ", \"dur\": " + std::to_string(dur) + "}";
  };
  // rank 0: comm [5, 25) ms against compute [0, 10) and [20, 30): half hidden. rank 1: comm inside compute.
  rank_file(0, span("a", "compute", 0, 10000) + "," + span("x", "comm", 5000, 20000) + "," +
                   span("b", "compute", 20000, 10000));
  rank_file(1, span("a", "compute", 0, 30000) + "," + span("x", "comm", 5000, 10000));
  const CliResult r = run_cli({"trace", dir.path().string(), "--out", dir / "merged.json"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("50.0%"), std::string::npos) << r.out;   // rank 0
  EXPECT_NE(r.out.find("100.0%"), std::string::npos) << r.out;  // rank 1
  EXPECT_NE(r.out.find("66.7%"), std::string::npos) << r.out;   // all: 20 of 30 ms hidden
  const std::string merged = slurp(dir / "merged.json");
  EXPECT_NE(merged.find("traceEvents"), std::string::npos);
  size_t spans = 0;
  for (size_t at = merged.find("\"ph\":\"X\""); at != std::string::npos; at = merged.find("\"ph\":\"X\"", at + 1)) ++spans;
  EXPECT_EQ(spans, 5u) << merged;

  expect_one_line_error(run_cli({"trace", (dir / "missing")}), {"trace:", "is not a directory"});
  TempDir empty;
  expect_one_line_error(run_cli({"trace", empty.path().string()}), {"no rank_N.json"});
  write_text(empty / "rank_3.json", "{not json");
  expect_one_line_error(run_cli({"trace", empty.path().string()}), {"rank_3.json", "not JSON"});
  expect_one_line_error(run_cli({"trace"}), {"missing DIR"});
}

}  // namespace
}  // namespace magi::cli::test
