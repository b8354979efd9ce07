// `magi-attn dist-demo` / `dist-run` launched without mpirun, as torchrun and ATOM launch ranks: each process gets
// its rank, the world size and the master's address from the environment and bootstraps over TCP. Also what a
// bad or missing variable and a rank that never joins do: one error line per rank, exit 2, within the timeout.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <limits>
#include <string>
#include <vector>

#include "cli_test_helpers.hpp"
#include "magi/comm.hpp"
#include "magi/error.hpp"

namespace magi::cli::test {
namespace {

// A port nothing listens on now (the kernel's choice for an ephemeral bind, released again).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  ::close(fd);
  return ntohs(address.sin_port);
}

// Starts one `magi-attn <args>` per entry of `env_of_rank` at once (each with its variables), waits for all.
std::vector<CliResult> launch(const std::vector<std::vector<std::string>>& env_of_rank, const std::vector<std::string>& args) {
  TempDir capture;
  std::string script;
  for (size_t r = 0; r < env_of_rank.size(); ++r) {
    const std::string d = capture.path().string() + "/";
    std::string line = "(env OMP_NUM_THREADS=1";
    for (const std::string& assignment : env_of_rank[r]) line += " " + shell_quote(assignment);
    line += " " + shell_quote(MAGI_CLI_PATH);
    for (const std::string& arg : args) line += " " + shell_quote(arg);
    line += " >" + shell_quote(d + "out." + std::to_string(r)) + " 2>" + shell_quote(d + "err." + std::to_string(r)) +
            " </dev/null; echo $? >" + shell_quote(d + "exit." + std::to_string(r)) + ") &\n";
    script += line;
  }
  script += "wait\n";
  const std::string path = capture / "launch.sh";
  write_file(path, std::vector<unsigned char>(script.begin(), script.end()));
  EXPECT_EQ(std::system(("sh " + shell_quote(path)).c_str()), 0);
  std::vector<CliResult> ranks(env_of_rank.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    const std::string suffix = "." + std::to_string(r);
    const std::string code = slurp(capture.path() / ("exit" + suffix));
    ranks[r].exit_code = code.empty() ? -1 : std::atoi(code.c_str());
    ranks[r].out = slurp(capture.path() / ("out" + suffix));
    ranks[r].err = slurp(capture.path() / ("err" + suffix));
  }
  return ranks;
}

std::vector<std::string> torchrun_env(int rank, int size, int port) {
  return {"RANK=" + std::to_string(rank), "WORLD_SIZE=" + std::to_string(size), "LOCAL_RANK=" + std::to_string(rank),
          "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port)};
}

const std::vector<std::string> kDemo = {"dist-demo", "--device",  "cpu", "--tokens", "1024", "--heads-q",
                                        "2",         "--heads-kv", "1",   "--head-dim", "32"};

TEST(DistLaunch, TorchrunStyleRanksRunTheDemo) {
  for (int cp : {2, 3}) {
    const int port = free_port();
    std::vector<std::vector<std::string>> envs;
    for (int r = 0; r < cp; ++r) envs.push_back(torchrun_env(r, cp, port));
    const auto ranks = launch(envs, kDemo);
    for (int r = 0; r < cp; ++r) EXPECT_EQ(ranks[r].exit_code, 0) << "rank " << r << ": " << describe(ranks[r]);
    EXPECT_NE(ranks[0].out.find("over " + std::to_string(cp) + " ranks (tcp:" + std::to_string(cp) + ")"),
              std::string::npos)
        << ranks[0].out;
    EXPECT_NE(ranks[0].out.find("result    PASS"), std::string::npos) << ranks[0].out;
    for (int r = 1; r < cp; ++r) EXPECT_EQ(ranks[r].out, "") << "only rank 0 reports";
  }
}

TEST(DistLaunch, AtomStyleRanksRunTheDemo) {
  const int port = free_port();
  std::vector<std::vector<std::string>> envs;
  for (int r = 0; r < 2; ++r)
    envs.push_back({"ATOM_DP_RANK=" + std::to_string(r), "ATOM_DP_SIZE=2", "ATOM_DP_RANK_LOCAL=" + std::to_string(r),
                    "ATOM_DP_MASTER_PORT=" + std::to_string(port)});  // ATOM_DP_MASTER_IP defaults to 127.0.0.1
  const auto ranks = launch(envs, kDemo);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(ranks[r].exit_code, 0) << "rank " << r << ": " << describe(ranks[r]);
  EXPECT_NE(ranks[0].out.find("result    PASS"), std::string::npos) << ranks[0].out;
}

// A timeout beyond the clocks' range counts as the longest (~32 years): as given (1e300 s), the TCP communicator's
// deadlines, converted to the steady clock's 64-bit nanoseconds, overflowed (undefined behaviour).
TEST(DistLaunch, TimeoutsBeyondTheClocksRangeCountAsTheLongest) {
  magi::comm::LaunchInfo one;  // a single rank: nothing to wait for
  one.master_addr = "127.0.0.1";
  one.master_port = free_port();
  one.convention = "torchrun";
  const auto comm = magi::comm::tcp_communicator(one, 1e300);
  EXPECT_EQ(comm->timeout(), magi::comm::Communicator::kLongestTimeoutSeconds);
  comm->barrier();
  comm->set_timeout(5.0);
  EXPECT_EQ(comm->timeout(), 5.0);
  EXPECT_THROW(comm->set_timeout(0.0), magi::InvalidArgument);
  EXPECT_THROW(comm->set_timeout(std::numeric_limits<double>::infinity()), magi::InvalidArgument);
}

TEST(DistLaunch, BadOrMissingVariablesAreOneLineErrors) {
  auto with = [&](std::vector<std::string> env) { return launch({std::move(env)}, kDemo)[0]; };
  expect_one_line_error(with({"RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=abc"}),
                        {"MASTER_PORT=abc", "1..65535"});
  expect_one_line_error(with({"RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=70000"}),
                        {"MASTER_PORT=70000"});
  expect_one_line_error(with({"RANK=0", "WORLD_SIZE=2", "MASTER_PORT=29500"}), {"MASTER_ADDR is not set"});
  expect_one_line_error(with({"RANK=2", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=29500"}),
                        {"RANK=2", "0..1"});
  expect_one_line_error(with({"WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=29500"}), {"RANK is not set"});
  expect_one_line_error(with({"ATOM_DP_RANK=0", "ATOM_DP_SIZE=x"}), {"ATOM_DP_SIZE=x"});
}

// A rank that never joins: the ranks that did (rank 0 waiting for it, rank 1 waiting for the start) and a rank
// whose master never listens all fail within the timeout, each with one line.
TEST(DistLaunch, ARankThatNeverJoinsFailsEveryRankWithinTheTimeout) {
  const int port = free_port();
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> args = kDemo;
  args.insert(args.end(), {"--comm-timeout", "3"});
  const auto ranks = launch({torchrun_env(0, 3, port), torchrun_env(1, 3, port)}, args);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 30.0);
  expect_one_line_error(ranks[0], {"rank(s) 2 did not join within 3 s"});
  // Rank 1 waits for rank 0 with its own 3 s: it times out, or (a loaded machine starting it late) sees rank 0 give
  // up first and close the connection. Either is one clear error within the timeout.
  expect_one_line_error(ranks[1], {"rank 1 of 3"});
  const std::string rank1 = ranks[1].err_lines().empty() ? "" : ranks[1].err_lines()[0];
  EXPECT_TRUE(rank1.find("timed out after 3 s") != std::string::npos ||
              rank1.find("connection closed by the peer (peer rank 0)") != std::string::npos)
      << rank1;
  const auto lonely = launch({torchrun_env(1, 2, free_port())}, args);
  expect_one_line_error(lonely[0], {"rank 0 at 127.0.0.1", "did not accept within 3 s"});
}

TEST(DistLaunch, DistRunUnderTorchrunStyleLaunch) {
  const int port = free_port();
  TempDir dir;
  // A mask file and inputs are rank 0's; a missing input is one error from rank 0, exit 2 on every rank.
  const std::string mask = dir / "mask.json";
  const std::string text = R"({"q_ranges": [[0, 64]], "k_ranges": [[0, 64]], "attn_type_map": ["causal"]})";
  write_file(mask, std::vector<unsigned char>(text.begin(), text.end()));
  const auto ranks = launch({torchrun_env(0, 2, port), torchrun_env(1, 2, port)},
                            {"dist-run", "--mask", mask, "--q", dir / "missing.npy", "--k", dir / "missing.npy", "--v",
                             dir / "missing.npy", "--out-dir", dir / "out"});
  expect_one_line_error(ranks[0], {"missing.npy"});
  EXPECT_EQ(ranks[1].exit_code, 2) << describe(ranks[1]);
  EXPECT_EQ(ranks[1].err, "") << "rank 0 alone reports";
}

}  // namespace
}  // namespace magi::cli::test
