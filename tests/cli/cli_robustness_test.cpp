// `magi-attn` on hostile input found by fuzzing: limits checked before any work, deep JSON, outputs that would
// replace inputs, failed writes. Each error must be one stderr line, exit 2, nothing written or changed.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstring>

#include "cli/npy.hpp"
#include "cli_test_helpers.hpp"
#include "magi/attention.hpp"

namespace magi::cli::test {
namespace {

constexpr int64_t kT = 32, kHq = 2, kHkv = 1, kD = 8;

void write_text(const std::string& path, const std::string& text) {
  write_file(path, std::vector<unsigned char>(text.begin(), text.end()));
}

// Runs magi-attn in a shell whose file-size limit is `blocks` KiB (SIGXFSZ ignored, so writes fail with EFBIG).
CliResult run_cli_with_file_limit(int blocks, const std::vector<std::string>& args) {
  TempDir capture;
  std::string command = "(trap '' XFSZ; ulimit -f " + std::to_string(blocks) + "; exec " + shell_quote(MAGI_CLI_PATH);
  for (const std::string& arg : args) command += " " + shell_quote(arg);
  command += ") >" + shell_quote(capture / "stdout") + " 2>" + shell_quote(capture / "stderr") + " </dev/null";
  const int status = std::system(command.c_str());
  CliResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.out = slurp(capture / "stdout");
  result.err = slurp(capture / "stderr");
  return result;
}

// Runs magi-attn in a shell whose address space is limited to `kib` KiB (ulimit -v): a read without bound fails fast.
CliResult run_cli_with_memory_limit(long kib, const std::vector<std::string>& args) {
  TempDir capture;
  std::string command = "(ulimit -v " + std::to_string(kib) + "; exec " + shell_quote(MAGI_CLI_PATH);
  for (const std::string& arg : args) command += " " + shell_quote(arg);
  command += ") >" + shell_quote(capture / "stdout") + " 2>" + shell_quote(capture / "stderr") + " </dev/null";
  const int status = std::system(command.c_str());
  CliResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.out = slurp(capture / "stdout");
  result.err = slurp(capture / "stderr");
  return result;
}

// A rank timeline with `spans` compute spans (about 60 bytes each in the merged trace).
std::string rank_timeline(int rank, int spans) {
  std::string events;
  for (int i = 0; i < spans; ++i)
    events += std::string(i ? "," : "") + "{\"name\": \"s" + std::to_string(i) +
              "\", \"cat\": \"compute\", \"ph\": \"X\", \"ts\": " + std::to_string(10 * i) + ", \"dur\": 5}";
  return "{\"magi_rank\": " + std::to_string(rank) + ", \"traceEvents\": [" + events + "]}";
}

class CliRobustness : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(7);
    write_text(dir_ / "mask.json", R"({"q_ranges": [[0, 32]], "k_ranges": [[0, 32]], "attn_type_map": [0]})");
    write_npy_file(dir_ / "q.npy", DType::F32, {kT, kHq, kD}, normal_values(rng, kT * kHq * kD));
    write_npy_file(dir_ / "k.npy", DType::F32, {kT, kHkv, kD}, normal_values(rng, kT * kHkv * kD));
    write_npy_file(dir_ / "v.npy", DType::F32, {kT, kHkv, kD}, normal_values(rng, kT * kHkv * kD));
  }
  std::vector<std::string> run_args(const std::string& q, const std::string& out_dir) const {
    return {"run", "--mask", dir_ / "mask.json", "--q", q, "--k", dir_ / "k.npy", "--v", dir_ / "v.npy",
            "--out-dir", out_dir};
  }
  static void expect_error(const CliResult& r, const std::vector<std::string>& fragments) {
    expect_one_line_error(r, fragments);
    EXPECT_TRUE(r.out.empty()) << describe(r);
  }
  TempDir dir_;
};

// ---- 1: --threads and --chunk-size against the library's limits, before any progress output ----

TEST_F(CliRobustness, ThreadsAboveTheLibraryLimitAreRefusedUpFront) {
  const std::string too_many = std::to_string(kMaxThreads + 1), limit = "1 .. " + std::to_string(kMaxThreads);
  auto args = run_args(dir_ / "q.npy", dir_ / "out");
  args.insert(args.end(), {"--threads", too_many});
  expect_error(run_cli(args), {"--threads", too_many, limit});
  EXPECT_FALSE(fs::exists(dir_ / "out"));
  // demo printed progress lines before the library refused the value.
  expect_error(run_cli({"demo", "--tokens", "64", "--heads-q", "2", "--heads-kv", "1", "--head-dim", "8", "--threads",
                        too_many}),
               {"--threads", limit});
  // dist-demo reads its options before any rank starts, so this needs no mpirun.
  expect_error(run_cli({"dist-demo", "--device", "cpu", "--tokens", "64", "--threads", too_many}),
               {"--threads", limit});
}

TEST_F(CliRobustness, DistDemoChunkSizeAboveTheLibraryLimitIsRefusedUpFront) {
  expect_error(run_cli({"dist-demo", "--device", "cpu", "--tokens", "256", "--chunk-size", "20000"}),
               {"--chunk-size", "20000", "1 .. 16384"});
}

// ---- 2: deeply nested JSON in a rank file ----

TEST_F(CliRobustness, TraceRefusesDeeplyNestedRankFile) {
  const std::string depth = std::string(100000, '[') + std::string(100000, ']');
  write_text(dir_ / "rank_0.json", "{\"magi_rank\":0,\"traceEvents\":[{\"ph\":\"M\",\"args\":" + depth + "}]}");
  expect_error(run_cli({"trace", dir_.path().string()}), {"rank_0.json", "nested deeper"});
  EXPECT_FALSE(fs::exists(dir_ / "trace.json"));
}

// ---- 3: outputs that are inputs ----

TEST_F(CliRobustness, RunRefusesAnOutputThatIsAnInput) {
  fs::create_directories(dir_ / "o2");
  fs::copy_file(dir_ / "q.npy", dir_ / "o2/out.npy");
  const std::string before = slurp(dir_ / "o2/out.npy");
  expect_error(run_cli(run_args(dir_ / "o2/out.npy", dir_ / "o2")), {"--out-dir", "--q", "out.npy"});
  EXPECT_EQ(slurp(dir_ / "o2/out.npy"), before);
  EXPECT_FALSE(fs::exists(dir_ / "o2/lse.npy"));
  // The same file under another spelling.
  expect_error(run_cli(run_args(dir_ / "o2/../o2/out.npy", dir_ / "o2/.")), {"--out-dir", "--q"});
  EXPECT_EQ(slurp(dir_ / "o2/out.npy"), before);
}

TEST_F(CliRobustness, MaskRefusesPngOverItsInput) {
  const std::string before = slurp(dir_ / "mask.json");
  expect_error(run_cli({"mask", "--mask", dir_ / "mask.json", "--png", dir_ / "mask.json"}), {"--png", "mask.json"});
  EXPECT_EQ(slurp(dir_ / "mask.json"), before);
}

TEST_F(CliRobustness, TraceRefusesOutputOverARankFile) {
  write_text(dir_ / "rank_0.json", rank_timeline(0, 3));
  const std::string before = slurp(dir_ / "rank_0.json");
  expect_error(run_cli({"trace", dir_.path().string(), "--out", dir_ / "rank_0.json"}), {"--out", "rank_0.json"});
  EXPECT_EQ(slurp(dir_ / "rank_0.json"), before);
}

// ---- 4: no partial set of outputs ----

TEST_F(CliRobustness, RunChecksEveryDestinationBeforeTheFirstRename) {
  fs::create_directories(dir_ / "o1/lse.npy");
  expect_error(run_cli(run_args(dir_ / "q.npy", dir_ / "o1")), {"--out-dir", "lse.npy", "is a directory"});
  EXPECT_FALSE(fs::exists(dir_ / "o1/out.npy"));
  size_t entries = 0;
  for (const auto& entry : fs::directory_iterator(dir_ / "o1")) entries += entry.path().filename() != "lse.npy";
  EXPECT_EQ(entries, 0u) << "temporaries or outputs left in the output folder";
}

// A failed write names --out-dir and the output (not the temporary), and removes every folder the run created.
TEST_F(CliRobustness, RunFailedWriteRemovesTheFoldersItCreated) {
  const std::string nested = dir_ / "new/a/b";
  auto args = run_args(dir_ / "q.npy", nested);
  args.insert(args.end(), {"--do", dir_ / "q.npy"});  // dq.npy etc.: past the 1 KiB limit
  const CliResult r = run_cli_with_file_limit(1, args);
  expect_error(r, {"--out-dir", "new/a/b", "out.npy"});
  EXPECT_EQ(r.err.find(".tmp."), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "new")) << "folders created for the outputs were left behind";
}

// ---- 5: a failed write keeps the old file and leaves no temporary ----

TEST_F(CliRobustness, TraceFailedWriteKeepsTheOldFile) {
  write_text(dir_ / "rank_0.json", rank_timeline(0, 100));  // the merge is ~6 KB, over the 1 KiB limit
  write_text(dir_ / "part.json", "old");
  expect_error(run_cli_with_file_limit(1, {"trace", dir_.path().string(), "--out", dir_ / "part.json"}),
               {"--out", "part.json"});
  EXPECT_EQ(slurp(dir_ / "part.json"), "old");
  for (const auto& entry : fs::directory_iterator(dir_.path()))
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos) << entry.path();
}

TEST_F(CliRobustness, MaskPngFailedWriteKeepsTheOldFile) {
  write_text(dir_ / "x.png", "old");
  // A 1000 x 1000 band: several KiB of PNG, over the 1 KiB limit.
  expect_error(run_cli_with_file_limit(
                   1, {"mask", "--preset", "sliding_window", "--tq", "1000", "--window", "37", "--png", dir_ / "x.png"}),
               {"--png", "x.png"});
  EXPECT_EQ(slurp(dir_ / "x.png"), "old");
  for (const auto& entry : fs::directory_iterator(dir_.path()))
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos) << entry.path();
  // Success still replaces it.
  const CliResult ok = run_cli({"mask", "--preset", "causal", "--tq", "16", "--png", dir_ / "x.png"});
  ASSERT_EQ(ok.exit_code, 0) << describe(ok);
  EXPECT_EQ(slurp(dir_ / "x.png").substr(1, 3), "PNG");
}

// An output that exists but is not a regular file (a FIFO here; /dev/null as root) is refused, not renamed over.
TEST_F(CliRobustness, OutputsRefuseSpecialFiles) {
  const std::string fifo = dir_ / "pipe";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error(run_cli({"mask", "--preset", "causal", "--tq", "16", "--png", fifo}),
               {"--png", "pipe", "not a regular file"});
  EXPECT_TRUE(fs::is_fifo(fifo)) << "the FIFO was replaced by a regular file";
  write_text(dir_ / "rank_0.json", rank_timeline(0, 2));
  expect_error(run_cli({"trace", dir_.path().string(), "--out", fifo}), {"--out", "pipe", "not a regular file"});
  EXPECT_TRUE(fs::is_fifo(fifo)) << "the FIFO was replaced by a regular file";
}

// ---- 6: .npy shapes beyond int64 / int32 ----

// .npy bytes with a hand-written header and raw data.
std::string handmade_npy(const std::string& dict, const std::string& data) {
  std::string header = dict;
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string bytes = "\x93NUMPY\x01";
  bytes += '\0';
  bytes += static_cast<char>(header.size() & 0xff);
  bytes += static_cast<char>(header.size() >> 8);
  return bytes + header + data;
}

TEST_F(CliRobustness, NpyElementCountOverflowIsRefused) {
  // 256 * (2^53 + 2) * 8 wraps to 4096 elements: exactly these 16384 bytes.
  write_text(dir_ / "big.npy", handmade_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (256, 9007199254740994, 8), }",
                                            std::string(16384, '\0')));
  expect_error(run_cli(run_args(dir_ / "big.npy", dir_ / "out")), {"--q", "big.npy", "64 bits"});
  EXPECT_FALSE(fs::exists(dir_ / "out"));
}

TEST_F(CliRobustness, NpyExtentAboveInt32IsRefused) {
  // No elements, so the file is valid, but 2^32 heads do not fit the library's int32.
  write_text(dir_ / "wide.npy",
             handmade_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (32, 4294967296, 0), }", ""));
  write_text(dir_ / "k0.npy", handmade_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (32, 1, 0), }", ""));
  auto args = run_args(dir_ / "wide.npy", dir_ / "out");
  args[6] = dir_ / "k0.npy";  // --k
  args[8] = dir_ / "k0.npy";  // --v
  expect_error(run_cli(args), {"--q", "wide.npy", "2147483647"});
  EXPECT_FALSE(fs::exists(dir_ / "out"));
}

// A device that never ends (/dev/zero) is read only as far as the header (it was read until memory ran out), and a
// valid file is still read whole.
TEST_F(CliRobustness, NpyFromAnEndlessDeviceIsRefusedAtOnce) {
  expect_error(run_cli_with_memory_limit(1 << 21, run_args("/dev/zero", dir_ / "out")), {"--q", "/dev/zero", "bad magic"});
  EXPECT_FALSE(fs::exists(dir_ / "out"));
  // On the CPU: a CUDA context reserves more address space than the limit leaves.
  auto on_cpu = run_args(dir_ / "q.npy", dir_ / "out");
  on_cpu.insert(on_cpu.end(), {"--backend", "cpu"});
  const CliResult ok = run_cli_with_memory_limit(1 << 21, on_cpu);
  EXPECT_EQ(ok.exit_code, 0) << describe(ok);
}

// Values that fp32 (the kernels' arithmetic) cannot hold are refused naming the option, before any file is read: a
// softcap below fp32's smallest normal was silently off (rounded to 0), a scale past fp32's largest named the
// library's softmax_scale with 40 digits.
// A demo larger than the machine's memory is one line naming the sizes, before any progress line (it was "out of
// memory" after one).
TEST_F(CliRobustness, DemoLargerThanMemoryIsOneLineUpFront) {
  expect_error(run_cli({"demo", "--tokens", "67108864", "--heads-q", "1024", "--heads-kv", "1024", "--head-dim", "1024"}),
               {"--tokens / --heads-q / --heads-kv / --head-dim", "GiB of host memory"});
}

TEST_F(CliRobustness, RunRefusesScalarsOutsideFp32UpFront) {
  auto args = run_args(dir_ / "missing.npy", dir_ / "out");
  for (const char* softcap : {"1e-320", "1e-39", "1e39"}) {
    auto with = args;
    with.insert(with.end(), {"--softcap", softcap});
    expect_error(run_cli(with), {"--softcap", softcap, "fp32"});
  }
  auto with = args;
  with.insert(with.end(), {"--softmax-scale", "1e39"});
  expect_error(run_cli(with), {"--softmax-scale", "1e39", "3.4e38"});
  EXPECT_FALSE(fs::exists(dir_ / "out"));
}

TEST_F(CliRobustness, RunRefusesAnEmptyOutDir) {
  expect_error(run_cli(run_args(dir_ / "q.npy", "")), {"--out-dir", "empty path"});
}

// ---- 7: trace errors name the file and the field ----

TEST_F(CliRobustness, TraceErrorsNameTheFileAndField) {
  write_text(dir_ / "rank_0.json", rank_timeline(0, 2));  // valid: nothing on stdout still
  write_text(dir_ / "rank_99999999999.json", rank_timeline(1, 2));
  expect_error(run_cli({"trace", dir_.path().string()}), {"rank_99999999999.json", "rank number"});
  fs::remove(dir_ / "rank_99999999999.json");

  for (const auto& [field, value] : std::vector<std::pair<std::string, std::string>>{
           {"ph", "1"}, {"ts", "\"0\""}, {"dur", "null"}, {"name", "5"}, {"cat", "{}"}}) {
    std::string event = "{\"name\": \"a\", \"cat\": \"compute\", \"ph\": \"X\", \"ts\": 0, \"dur\": 5}";
    const size_t at = event.find("\"" + field + "\": ") + field.size() + 4;
    event.replace(at, event.find_first_of(",}", at) - at, value);
    write_text(dir_ / "rank_1.json", "{\"magi_rank\": 1, \"traceEvents\": [" + event + "]}");
    expect_error(run_cli({"trace", dir_.path().string()}), {"rank_1.json", "]." + field + " is"});
  }
  fs::remove(dir_ / "rank_1.json");
  // One rank twice (its time counted twice), and a file whose magi_rank is not the rank in its name.
  write_text(dir_ / "rank_00.json", rank_timeline(0, 2));
  expect_error(run_cli({"trace", dir_.path().string()}), {"rank_0.json", "rank_00.json", "both rank 0"});
  fs::remove(dir_ / "rank_00.json");
  write_text(dir_ / "rank_1.json", rank_timeline(3, 2));
  expect_error(run_cli({"trace", dir_.path().string()}), {"rank_1.json", "magi_rank 3", "(1)"});
  fs::remove(dir_ / "rank_1.json");
  fs::create_directories(dir_ / "rank_2.json");
  expect_error(run_cli({"trace", dir_.path().string()}), {"rank_2.json", "not a regular file"});
  EXPECT_FALSE(fs::exists(dir_ / "trace.json"));
}

}  // namespace
}  // namespace magi::cli::test
