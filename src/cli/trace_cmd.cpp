#include <algorithm>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <vector>

#include "cli/commands.hpp"
#include "cli/npy.hpp"
#include "cli/options.hpp"
#include "distributed/timeline.hpp"
#include "magi/error.hpp"

namespace magi::cli {
namespace {

namespace fs = std::filesystem;

// Timelines nest a few levels; a deeper file is not one, and dumping it would recurse off the stack.
constexpr int kMaxJsonDepth = 64;

// A rank file, parsed with bounded nesting and checked field by field, so that the timeline reader and the
// merged dump see only the shapes they handle. Errors name the file (and the field).
nlohmann::json read_rank_file(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) throw InvalidArgument("trace: " + path + ": not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument("trace: " + path + ": cannot be read");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw InvalidArgument("trace: " + path + ": read error");
  bool too_deep = false;
  const nlohmann::json::parser_callback_t limit = [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
    if (depth > kMaxJsonDepth) too_deep = true;
    return !too_deep;  // stop keeping values once too deep (the parse still ends)
  };
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text.str(), limit);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument("trace: " + path + ": not JSON (" + e.what() + ")");
  }
  if (too_deep)
    throw InvalidArgument("trace: " + path + ": JSON nested deeper than " + std::to_string(kMaxJsonDepth) +
                          " levels (not a magi-attn rank timeline)");
  if (!doc.is_object() || !doc.contains("traceEvents") || !doc["traceEvents"].is_array() ||
      !doc.contains("magi_rank") || !doc["magi_rank"].is_number_integer())
    throw InvalidArgument("trace: " + path + ": not a magi-attn rank timeline (needs traceEvents, magi_rank)");
  const auto& events = doc["traceEvents"];
  for (size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    if (!e.is_object()) continue;
    const auto expect = [&](const char* field, bool ok, const char* type) {
      if (!ok)
        throw InvalidArgument("trace: " + path + ": traceEvents[" + std::to_string(i) + "]." + field + " is " +
                              e[field].type_name() + " (allowed: " + type + ")");
    };
    for (const char* field : {"ph", "name", "cat"})
      if (e.contains(field)) expect(field, e[field].is_string(), "string");
    for (const char* field : {"ts", "dur"})
      if (e.contains(field)) expect(field, e[field].is_number(), "number");
  }
  return doc;
}

}  // namespace

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
  if (!fs::is_directory(dir)) throw InvalidArgument("trace: " + dir + " is not a directory");

  struct Rank {
    int32_t rank;
    std::string path;
  };
  std::vector<Rank> files;
  const std::regex name(R"(rank_([0-9]+)\.json)");
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string file = entry.path().filename().string();
    if (!std::regex_match(file, m, name)) continue;
    const std::string digits = m[1].str();
    int32_t rank = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), rank);
    if (ec != std::errc() || end != digits.data() + digits.size())
      throw InvalidArgument("trace: " + entry.path().string() + ": rank number out of range (allowed: 0 .. " +
                            std::to_string(INT32_MAX) + ")");
    files.push_back({rank, entry.path().string()});
  }
  if (files.empty()) throw InvalidArgument("trace: no rank_N.json in " + dir + " (run with MAGI_ATTENTION_PROFILE_DIR=" + dir + ")");
  std::sort(files.begin(), files.end(), [](const Rank& a, const Rank& b) { return a.rank < b.rank; });
  // rank_1.json and rank_01.json are one rank twice: merged, its time would count twice.
  for (size_t i = 1; i < files.size(); ++i)
    if (files[i].rank == files[i - 1].rank)
      throw InvalidArgument("trace: " + files[i - 1].path + " and " + files[i].path + " are both rank " +
                            std::to_string(files[i].rank) + " (allowed: one rank_N.json per rank)");

  const std::string out = options.get("out").value_or((fs::path(dir) / "trace.json").string());
  for (const Rank& f : files)
    if (same_file(out, f.path)) throw InvalidArgument("--out " + out + ": is the input " + f.path + " (choose another file)");

  // Everything is read and checked before anything is written or printed.
  nlohmann::json merged = nlohmann::json::array();
  dist::Overlap total;
  std::string report;
  char line[160];
  std::snprintf(line, sizeof line, "%-6s %12s %12s %12s %8s\n", "rank", "compute ms", "comm ms", "hidden ms", "hidden");
  report += line;
  for (const Rank& f : files) {
    nlohmann::json doc = read_rank_file(f.path);
    int32_t rank = -1;
    std::vector<dist::Span> spans;
    try {
      spans = dist::read_spans(f.path, &rank);
    } catch (const std::exception& e) {
      throw InvalidArgument("trace: " + f.path + ": " + e.what());
    }
    // A file renamed or copied from another run's rank would be reported under the wrong rank.
    if (rank != f.rank)
      throw InvalidArgument("trace: " + f.path + ": magi_rank " + std::to_string(rank) +
                            " does not match the rank in its name (" + std::to_string(f.rank) + ")");
    for (auto& event : doc["traceEvents"]) merged.push_back(std::move(event));
    const dist::Overlap o = dist::overlap_of(spans);
    total.compute_us += o.compute_us;
    total.comm_us += o.comm_us;
    total.hidden_us += o.hidden_us;
    std::snprintf(line, sizeof line, "%-6d %12.3f %12.3f %12.3f %7.1f%%\n", rank, o.compute_us / 1e3,
                  o.comm_us / 1e3, o.hidden_us / 1e3, 100.0 * o.hidden_fraction());
    report += line;
  }
  std::snprintf(line, sizeof line, "%-6s %12.3f %12.3f %12.3f %7.1f%%\n", "all", total.compute_us / 1e3,
                total.comm_us / 1e3, total.hidden_us / 1e3, 100.0 * total.hidden_fraction());
  report += line;
  // Invalid UTF-8 in a name must not stop the merge.
  const std::string text = nlohmann::json{{"traceEvents", merged}, {"displayTimeUnit", "ms"}}.dump(
      -1, ' ', false, nlohmann::json::error_handler_t::replace);
  try {
    replace_file(out, std::span(reinterpret_cast<const unsigned char*>(text.data()), text.size()));
  } catch (const Error& e) {
    throw InvalidArgument(std::string("--out ") + e.what());
  }
  std::printf("%smerged %zu ranks into %s\n", report.c_str(), files.size(), out.c_str());
  return 0;
}

}  // namespace magi::cli
