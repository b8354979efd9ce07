#include "distributed/timeline.hpp"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <utility>

#include "magi/env.hpp"
#include "magi/error.hpp"

namespace magi::dist {

Timeline* Timeline::of(int32_t rank) {
  const std::string dir = env::get_string("MAGI_ATTENTION_PROFILE_DIR");
  if (dir.empty()) return nullptr;
  static std::mutex mutex;
  static std::map<std::pair<std::string, int32_t>, std::unique_ptr<Timeline>> timelines;
  std::lock_guard lock(mutex);
  auto& timeline = timelines[{dir, rank}];
  if (!timeline) timeline.reset(new Timeline(dir, rank));
  return timeline.get();
}

double Timeline::now_us() {
  const auto since_epoch = std::chrono::system_clock::now().time_since_epoch();
  return std::chrono::duration<double, std::micro>(since_epoch).count();
}

void Timeline::add(std::string name, std::string_view lane, double start_us, double end_us) {
  if (spans_.size() == kMaxSpans) spans_.erase(spans_.begin(), spans_.begin() + kMaxSpans / 10);
  spans_.push_back({std::move(name), std::string(lane), start_us, end_us});
}

void Timeline::write() const {
  nlohmann::json events = nlohmann::json::array();
  // Lanes as threads of the rank's process, named once.
  std::map<std::string, int> lanes{{"host", 0}, {"compute", 1}, {"comm", 2}};
  for (const auto& [lane, tid] : lanes)
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", tid}, {"args", {{"name", lane}}}});
  events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", rank_}, {"args", {{"name", "rank " + std::to_string(rank_)}}}});
  for (const Span& s : spans_) {
    const auto lane = lanes.emplace(s.lane, static_cast<int>(lanes.size())).first->second;
    events.push_back({{"name", s.name},
                      {"cat", s.lane},
                      {"ph", "X"},
                      {"pid", rank_},
                      {"tid", lane},
                      {"ts", s.start_us},
                      {"dur", std::max(0.0, s.end_us - s.start_us)}});
  }
  std::error_code error;
  std::filesystem::create_directories(dir_, error);
  const std::filesystem::path path = std::filesystem::path(dir_) / ("rank_" + std::to_string(rank_) + ".json");
  const std::filesystem::path partial = path.string() + ".partial";
  {
    std::ofstream out(partial);
    out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}, {"magi_rank", rank_}}.dump();
    if (!out) throw Error("MAGI_ATTENTION_PROFILE_DIR: cannot write " + partial.string());
  }
  std::filesystem::rename(partial, path, error);  // readers never see a half-written file
  if (error) throw Error("MAGI_ATTENTION_PROFILE_DIR: cannot write " + path.string() + ": " + error.message());
}

namespace {
// Sorted, merged intervals.
std::vector<std::pair<double, double>> busy(const std::vector<Span>& spans, std::string_view lane) {
  std::vector<std::pair<double, double>> in;
  for (const Span& s : spans)
    if (s.lane == lane && s.end_us > s.start_us) in.emplace_back(s.start_us, s.end_us);
  std::sort(in.begin(), in.end());
  std::vector<std::pair<double, double>> out;
  for (const auto& iv : in) {
    if (!out.empty() && iv.first <= out.back().second) out.back().second = std::max(out.back().second, iv.second);
    else out.push_back(iv);
  }
  return out;
}
double length(const std::vector<std::pair<double, double>>& intervals) {
  double total = 0;
  for (const auto& [a, b] : intervals) total += b - a;
  return total;
}
}  // namespace

Overlap overlap_of(const std::vector<Span>& spans) {
  const auto compute = busy(spans, "compute"), comm = busy(spans, "comm");
  Overlap o;
  o.compute_us = length(compute);
  o.comm_us = length(comm);
  size_t j = 0;
  for (const auto& [a, b] : comm) {
    while (j < compute.size() && compute[j].second <= a) ++j;
    for (size_t k = j; k < compute.size() && compute[k].first < b; ++k)
      o.hidden_us += std::min(b, compute[k].second) - std::max(a, compute[k].first);
  }
  return o;
}

std::vector<Span> read_spans(const std::string& path, int32_t* rank) {
  std::ifstream in(path);
  if (!in) throw InvalidArgument("trace file " + path + ": cannot be read");
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument("trace file " + path + ": not JSON (" + e.what() + ")");
  }
  if (!doc.is_object() || !doc.contains("traceEvents") || !doc["traceEvents"].is_array() ||
      !doc.contains("magi_rank") || !doc["magi_rank"].is_number_integer())
    throw InvalidArgument("trace file " + path + ": not a magi-attn rank timeline (traceEvents, magi_rank)");
  if (rank != nullptr) *rank = doc["magi_rank"].get<int32_t>();
  std::vector<Span> spans;
  for (const auto& e : doc["traceEvents"]) {
    if (!e.is_object() || e.value("ph", "") != "X") continue;
    const double ts = e.value("ts", 0.0), dur = e.value("dur", 0.0);
    spans.push_back({e.value("name", ""), e.value("cat", ""), ts, ts + dur});
  }
  return spans;
}

}  // namespace magi::dist
