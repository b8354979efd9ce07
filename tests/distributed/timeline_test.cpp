// Per-rank timelines (MAGI_ATTENTION_PROFILE_DIR): the overlap summary and the rank file round trip.
#include "distributed/timeline.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <random>

#include "magi/env.hpp"
#include "magi/error.hpp"

namespace magi::dist {
namespace {

TEST(Timeline, OverlapCountsEachLaneOnceAndTheCommunicationDuringCompute) {
  const std::vector<Span> spans = {{"a", "compute", 0, 10},  {"b", "compute", 5, 12}, {"c", "compute", 20, 30},
                                   {"x", "comm", 8, 25},     {"y", "comm", 9, 11},     {"plan", "host", 0, 100}};
  const Overlap o = overlap_of(spans);
  EXPECT_DOUBLE_EQ(o.compute_us, 22.0);  // [0, 12) and [20, 30)
  EXPECT_DOUBLE_EQ(o.comm_us, 17.0);     // [8, 25)
  EXPECT_DOUBLE_EQ(o.hidden_us, 9.0);    // [8, 12) and [20, 25)
  EXPECT_DOUBLE_EQ(o.hidden_fraction(), 9.0 / 17.0);
  EXPECT_DOUBLE_EQ(overlap_of({}).hidden_fraction(), 1.0) << "no communication: nothing exposed";

  // Random spans against a brute-force count on a fine grid.
  std::mt19937 rng(std::random_device{}());
  std::vector<Span> random;
  for (int i = 0; i < 40; ++i) {
    const int a = static_cast<int>(rng() % 1000), b = a + static_cast<int>(rng() % 100);
    random.push_back({"s", i % 2 ? "comm" : "compute", static_cast<double>(a), static_cast<double>(b)});
  }
  double hidden = 0, comm = 0;
  for (int t = 0; t < 1100; ++t) {
    bool in_comm = false, in_compute = false;
    for (const Span& s : random) {
      const bool in = s.start_us <= t && t < s.end_us;
      (s.lane == "comm" ? in_comm : in_compute) |= in;
    }
    comm += in_comm;
    hidden += in_comm && in_compute;
  }
  const Overlap r = overlap_of(random);
  EXPECT_DOUBLE_EQ(r.comm_us, comm);
  EXPECT_DOUBLE_EQ(r.hidden_us, hidden);
}

TEST(Timeline, WritesAChromeTraceThatReadsBack) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("magi_timeline_" + std::to_string(getpid()));
  setenv("MAGI_ATTENTION_PROFILE_DIR", dir.c_str(), 1);
  env::reset_for_testing();
  Timeline* t = Timeline::of(3);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(Timeline::of(3), t) << "one timeline per rank";
  const double now = Timeline::now_us();
  t->add("stage 0 k/v exchange", "comm", now, now + 50);
  t->add("stage 0 attention", "compute", now + 10, now + 90);
  t->write();
  int32_t rank = -1;
  const std::vector<Span> spans = read_spans((dir / "rank_3.json").string(), &rank);
  EXPECT_EQ(rank, 3);
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].name, "stage 0 k/v exchange");
  EXPECT_EQ(spans[1].lane, "compute");
  EXPECT_NEAR(spans[1].end_us - spans[1].start_us, 80.0, 1e-3);
  EXPECT_THROW(read_spans((dir / "rank_4.json").string()), InvalidArgument);
  std::filesystem::remove_all(dir);
  unsetenv("MAGI_ATTENTION_PROFILE_DIR");
  env::reset_for_testing();
  EXPECT_EQ(Timeline::of(3), nullptr) << "unset: nothing recorded";
}

}  // namespace
}  // namespace magi::dist
