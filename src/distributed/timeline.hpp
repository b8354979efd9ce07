// Per-rank timelines of distributed attention (MAGI_ATTENTION_PROFILE_DIR=DIR): every rank records spans of its
// calls (planning, each k/v exchange, each stage's attention, the dk/dv reductions, the final merges) in lanes
// ("compute", "comm", "host") and rewrites DIR/rank_N.json, a Chrome trace (chrome://tracing, Perfetto), after each
// call. Wall-clock microseconds since the epoch, one time base for the ranks of a host. The host runtime times
// its spans on the host; the device runtime (gpu_runtime.cpp) records CUDA events on its streams and converts them
// to this time base after the call. `magi-attn trace DIR` merges the ranks and reports overlap.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace magi::dist {

struct Span {
  std::string name, lane;
  double start_us = 0, end_us = 0;
};

class Timeline {
 public:
  // This process's timeline of `rank` when MAGI_ATTENTION_PROFILE_DIR is set, else nullptr (nothing recorded).
  static Timeline* of(int32_t rank);
  static double now_us();

  void add(std::string name, std::string_view lane, double start_us, double end_us);
  // DIR/rank_N.json with every span so far (the oldest dropped past kMaxSpans); throws Error if it cannot write.
  void write() const;
  const std::vector<Span>& spans() const { return spans_; }

  static constexpr size_t kMaxSpans = 200000;

 private:
  Timeline(std::string dir, int32_t rank) : dir_(std::move(dir)), rank_(rank) {}
  std::string dir_;
  int32_t rank_;
  std::vector<Span> spans_;
};

// One rank's spans summarised: busy time of the compute and comm lanes (overlapping spans of a lane counted once),
// and how much of the comm time ran while the rank computed.
struct Overlap {
  double compute_us = 0, comm_us = 0, hidden_us = 0;
  double hidden_fraction() const { return comm_us > 0 ? hidden_us / comm_us : 1.0; }
};
Overlap overlap_of(const std::vector<Span>& spans);

// The spans of a rank file written by Timeline::write (InvalidArgument naming the file if it is not one).
std::vector<Span> read_spans(const std::string& path, int32_t* rank = nullptr);

}  // namespace magi::dist
