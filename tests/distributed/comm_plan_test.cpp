// The comm plan against brute force: each rank fetches exactly the remote keys its rows keep, every kept
// cell is computed exactly once in exactly one stage, and the routes agree with the fetch lists.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <set>

#include "distributed/comm_plan.hpp"
#include "reference/random_inputs.hpp"

namespace magi::dist {
namespace {

using Cell = std::pair<int32_t, int32_t>;

int32_t uniform(std::mt19937_64& rng, int32_t lo, int32_t hi) {
  return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
}

// Global cells kept by `mask` in the rows owned by `rank`.
std::set<Cell> rank_cells(const Mask& mask, const Dispatch& d, int32_t rank) {
  std::set<Cell> cells;
  for (int32_t q : d.q.global_rows(rank))
    for (const Slice& s : mask.slices) {
      const Range keys = kept_keys(s, q);
      for (int32_t k = keys.start; k < keys.end; ++k) cells.insert({q, k});
    }
  return cells;
}

// Maps a stage mask's cells back to global cells; `global_k` maps the stage's k rows to global rows.
void add_cells(const Mask& stage, const std::vector<int32_t>& global_q, const std::vector<int32_t>& global_k,
               std::multiset<Cell>& out) {
  for (const Slice& s : stage.slices)
    for (int32_t q = s.q.start; q < s.q.end; ++q) {
      const Range keys = kept_keys(s, q);
      for (int32_t k = keys.start; k < keys.end; ++k) out.insert({global_q[q], global_k[k]});
    }
}

// Buffer `receiver` gets from one all-to-all-v over `routes`: each source's listed rows, sources in rank
// order; `value(src, row)` is what the source holds in that row.
template <class Value>
std::vector<int32_t> deliver(const std::vector<std::vector<comm::RowRoutes>>& routes, int32_t s, int32_t receiver,
                             Value value) {
  std::vector<int32_t> buffer;
  for (int32_t src = 0; src < static_cast<int32_t>(routes.size()); ++src) {
    const auto& rows = routes[src][s].send_rows[receiver];
    EXPECT_EQ(routes[receiver][s].recv_rows[src], static_cast<int64_t>(rows.size())) << "recv count " << src;
    for (int32_t row : rows) buffer.push_back(value(src, row));
  }
  return buffer;
}

// The global kv rows that land in `rank`'s buffer of stage `s` (one hop, or two through relays).
std::vector<int32_t> simulate(const CommPlan& plan, const Dispatch& d, int32_t rank, int32_t s) {
  const auto owned = [&](int32_t src, int32_t row) { return d.k.global_rows(src)[row]; };
  if (!plan.hierarchical()) return deliver(plan.routes, s, rank, owned);
  std::vector<std::vector<int32_t>> relayed;
  for (int32_t relay = 0; relay < d.k.cp(); ++relay) relayed.push_back(deliver(plan.routes, s, relay, owned));
  return deliver(plan.relay_routes, s, rank, [&](int32_t src, int32_t row) { return relayed[src][row]; });
}

void check_plan(const Mask& mask, int32_t cp, int32_t chunk, int32_t degree, uint64_t seed, int32_t ranks_per_node = 0) {
  const Dispatch d = make_dispatch(mask, cp, chunk, DispatchAlgorithm::GreedySwap);
  const CommPlan plan = make_comm_plan(mask, d, degree, ranks_per_node);
  const std::string where = "seed " + std::to_string(seed) + " cp " + std::to_string(cp) + " chunk " +
                            std::to_string(chunk) + " degree " + std::to_string(degree) + " ranks/node " +
                            std::to_string(ranks_per_node);
  ASSERT_EQ(plan.hierarchical(), ranks_per_node > 0);
  ASSERT_EQ(plan.num_stages(), std::max(1, degree)) << where;
  for (int32_t rank = 0; rank < cp; ++rank) {
    const RankPlan& rp = plan.ranks[rank];
    const std::set<Cell> expected = rank_cells(mask, d, rank);

    // Fetched rows == kept keys of this rank's rows that it does not own (brute force), no duplicates.
    std::set<int32_t> needed;
    for (const Cell& c : expected)
      if (d.k.owner_of(c.second) != rank) needed.insert(c.second);
    std::multiset<int32_t> fetched;
    for (const StagePlan& stage : rp.stages)
      for (int32_t src = 0; src < cp; ++src)
        for (Range r : stage.fetch[src])
          for (int32_t k = r.start; k < r.end; ++k) {
            fetched.insert(k);
            ASSERT_EQ(d.k.owner_of(k), src) << where;
          }
    ASSERT_EQ(std::set<int32_t>(fetched.begin(), fetched.end()), needed) << where << " rank " << rank;
    ASSERT_EQ(fetched.size(), needed.size()) << "a row is fetched twice, " << where;

    // Every kept cell computed exactly once across host and remote stages.
    const std::vector<int32_t> global_q = d.q.global_rows(rank);
    std::multiset<Cell> computed;
    validate(rp.host_mask);
    add_cells(rp.host_mask, global_q, d.k.global_rows(rank), computed);
    int64_t stage_area = rp.host_mask.area();
    for (const StagePlan& stage : rp.stages) {
      std::vector<int32_t> global_k;
      for (int32_t src : stage.owner_order)
        for (Range r : stage.fetch[src])
          for (int32_t k = r.start; k < r.end; ++k) global_k.push_back(k);
      ASSERT_EQ(static_cast<int32_t>(global_k.size()), stage.buffer_rows) << where;
      ASSERT_EQ(stage.mask.total_k, stage.buffer_rows);
      ASSERT_EQ(stage.mask.total_q, d.q.local_tokens());
      validate(stage.mask);
      add_cells(stage.mask, global_q, global_k, computed);
      stage_area += stage.mask.area();
    }
    ASSERT_EQ(computed.size(), expected.size()) << where << " rank " << rank;
    ASSERT_EQ(std::set<Cell>(computed.begin(), computed.end()), expected) << where << " rank " << rank;
    ASSERT_EQ(stage_area, d.rank_area[rank]) << where;
  }
  // Routes: moving global row ids along them fills every stage buffer exactly in the plan's order.
  for (int32_t rank = 0; rank < cp; ++rank)
    for (int32_t s = 0; s < plan.num_stages(); ++s) {
      std::vector<int32_t> expected_rows;
      const StagePlan& stage = plan.ranks[rank].stages[s];
      for (int32_t owner : stage.owner_order)
        for (Range r : stage.fetch[owner])
          for (int32_t k = r.start; k < r.end; ++k) expected_rows.push_back(k);
      ASSERT_EQ(simulate(plan, d, rank, s), expected_rows) << where << " rank " << rank << " stage " << s;
    }
}

TEST(CommPlan, RandomMasksFetchExactlyWhatIsNeededAndComputeEveryCellOnce) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 40; ++trial) {
    const int32_t tq = uniform(rng, 20, 300);
    const int32_t tk = uniform(rng, 0, 2) ? tq : uniform(rng, 20, 300);
    const Mask mask = test::random_rectangles(rng, tq, tk, uniform(rng, 1, 40));
    const int32_t cp = uniform(rng, 1, 4), chunk = uniform(rng, 1, 63), degree = std::vector<int32_t>{0, 1, 2, 4}[trial % 4];
    check_plan(mask, cp, chunk, degree, seed);
    if (HasFatalFailure()) return;
    for (int32_t per_node = 1; per_node <= cp; ++per_node)
      if (cp % per_node == 0) {
        check_plan(mask, cp, chunk, degree, seed, per_node);
        if (HasFatalFailure()) return;
      }
  }
}

TEST(CommPlan, StructuredMasks) {
  const uint64_t seed = test::fresh_seed();
  for (const auto& named : test::cases::all()) {
    SCOPED_TRACE(named.name);
    for (int32_t cp : {1, 2, 3, 4})
      for (int32_t degree : {0, 2}) {
        check_plan(named.mask, cp, 37, degree, seed);
        if (HasFatalFailure()) return;
      }
  }
  check_plan(masks::sliding_window(500, 40, 10), 3, 29, 4, seed);
  check_plan(masks::shared_question(100, {80, 120, 60}), 4, 31, 1, seed);
  check_plan(masks::varlen_causal(test::cu_seqlens_of({300, 20, 500, 180})), 8, 33, 2, seed, 2);
  check_plan(masks::varlen_causal(test::cu_seqlens_of({300, 20, 500, 180})), 8, 33, 2, seed, 4);
}

// Ring attention moves every rank's kv shard to every other rank; the plan only what slices keep.
TEST(CommPlan, ReportsFetchedRowsAgainstRing) {
  struct Named {
    const char* name;
    Mask mask;
  };
  const std::vector<int32_t> docs = test::cu_seqlens_of({1500, 300, 700, 2000, 96, 1500, 400, 1696});
  const std::vector<Named> cases = {
      {"full 8k", masks::full(8192, 8192)},
      {"causal 8k", masks::causal(8192, 8192)},
      {"varlen full 8 docs", masks::varlen_full(docs)},
      {"varlen causal 8 docs", masks::varlen_causal(docs)},
      {"sliding window 8k (512)", masks::sliding_window(8192, 512, 0)},
  };
  for (const auto& c : cases)
    for (int32_t cp : {2, 4, 8}) {
      const Dispatch d = make_dispatch(c.mask, cp, 256, DispatchAlgorithm::GreedySwap);
      const CommPlan plan = make_comm_plan(c.mask, d, 2);
      int64_t fetched = 0;
      for (const auto& rp : plan.ranks) fetched += rp.fetched_rows();
      const int64_t ring = int64_t{cp} * (cp - 1) * d.k.local_tokens();
      std::printf("%-26s cp %d: fetched kv rows %9lld, ring %9lld (%.3f of ring); max area / bound %.4f\n", c.name,
                  cp, static_cast<long long>(fetched), static_cast<long long>(ring),
                  static_cast<double>(fetched) / ring, static_cast<double>(d.max_rank_area()) / d.lower_bound());
      EXPECT_LE(fetched, ring) << c.name;
      if (cp == 8) {  // 2 nodes x 4 ranks: rows crossing nodes, flat vs hierarchical
        const CommPlan hier = make_comm_plan(c.mask, d, 2, 4);
        const auto crossing = [&](const CommPlan& p) {
          int64_t n = 0;
          for (int32_t src = 0; src < cp; ++src)
            for (const auto& stage_routes : p.routes[src])
              for (int32_t dst = 0; dst < cp; ++dst)
                if (src / 4 != dst / 4) n += static_cast<int64_t>(stage_routes.send_rows[dst].size());
          return n;
        };
        std::printf("%-26s cp 8 as 2 nodes x 4: kv rows crossing nodes: flat %lld, hierarchical %lld\n", c.name,
                    static_cast<long long>(crossing(plan)), static_cast<long long>(crossing(hier)));
        EXPECT_LE(crossing(hier), crossing(plan)) << c.name;
      }
    }
}

TEST(CommPlan, RejectsRanksPerNodeThatDoNotDivideCp) {
  const Mask mask = masks::causal(100, 100);
  const Dispatch d = make_dispatch(mask, 4, 10, DispatchAlgorithm::Greedy);
  EXPECT_THROW(make_comm_plan(mask, d, 1, 3), InvalidArgument);
  EXPECT_THROW(make_comm_plan(mask, d, -1, 0), InvalidArgument);
}

}  // namespace
}  // namespace magi::dist
