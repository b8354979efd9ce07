#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <regex>
#include <vector>

#include "cli/commands.hpp"
#include "cli/options.hpp"
#include "distributed/timeline.hpp"
#include "magi/error.hpp"

namespace magi::cli {

int trace_command(std::span<const std::string> args) {
  Options options("trace", "magi-attn trace DIR [--out FILE]",
                  "Merges the per-rank timelines that distributed attention wrote with MAGI_ATTENTION_PROFILE_DIR=DIR\n"
                  "(DIR/rank_N.json) into one Chrome trace (default DIR/trace.json; open it in chrome://tracing or\n"
                  "Perfetto) and prints, per rank, compute and communication time and how much of the\n"
                  "communication ran while the rank computed.",
                  {{"out", "FILE", "the merged trace (default DIR/trace.json)"}});
  std::vector<std::string> rest(args.begin(), args.end());
  std::string dir;
  if (!rest.empty() && !rest.front().starts_with("-")) {
    dir = rest.front();
    rest.erase(rest.begin());
  }
  options.parse(rest);
  if (options.help_requested()) {
    std::cout << options.help_text();
    return 0;
  }
  if (dir.empty()) throw InvalidArgument("trace: missing DIR (the MAGI_ATTENTION_PROFILE_DIR of the run)");
  if (!std::filesystem::is_directory(dir)) throw InvalidArgument("trace: " + dir + " is not a directory");

  struct Rank {
    int32_t rank;
    std::string path;
  };
  std::vector<Rank> files;
  const std::regex name(R"(rank_([0-9]+)\.json)");
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::smatch m;
    const std::string file = entry.path().filename().string();
    if (std::regex_match(file, m, name)) files.push_back({std::stoi(m[1].str()), entry.path().string()});
  }
  if (files.empty()) throw InvalidArgument("trace: no rank_N.json in " + dir + " (run with MAGI_ATTENTION_PROFILE_DIR=" + dir + ")");
  std::sort(files.begin(), files.end(), [](const Rank& a, const Rank& b) { return a.rank < b.rank; });

  nlohmann::json merged = nlohmann::json::array();
  dist::Overlap total;
  std::printf("%-6s %12s %12s %12s %8s\n", "rank", "compute ms", "comm ms", "hidden ms", "hidden");
  for (const Rank& f : files) {
    int32_t rank = -1;
    const std::vector<dist::Span> spans = dist::read_spans(f.path, &rank);
    std::ifstream in(f.path);
    nlohmann::json doc = nlohmann::json::parse(in);
    for (auto& event : doc["traceEvents"]) merged.push_back(std::move(event));
    const dist::Overlap o = dist::overlap_of(spans);
    total.compute_us += o.compute_us;
    total.comm_us += o.comm_us;
    total.hidden_us += o.hidden_us;
    std::printf("%-6d %12.3f %12.3f %12.3f %7.1f%%\n", rank, o.compute_us / 1e3, o.comm_us / 1e3, o.hidden_us / 1e3,
                100.0 * o.hidden_fraction());
  }
  std::printf("%-6s %12.3f %12.3f %12.3f %7.1f%%\n", "all", total.compute_us / 1e3, total.comm_us / 1e3,
              total.hidden_us / 1e3, 100.0 * total.hidden_fraction());
  const std::string out = options.get("out").value_or((std::filesystem::path(dir) / "trace.json").string());
  std::ofstream file(out);
  file << nlohmann::json{{"traceEvents", merged}, {"displayTimeUnit", "ms"}}.dump();
  if (!file) throw InvalidArgument("trace: cannot write " + out);
  std::printf("merged %zu ranks into %s\n", files.size(), out.c_str());
  return 0;
}

}  // namespace magi::cli
