// The comm plan against brute force: each rank fetches exactly the remote keys its rows keep, every kept
// cell is computed exactly once in exactly one stage, and the routes agree with the fetch lists; with the
// query/output route (qo_plan.hpp) on some rank pairs, the executors compute exactly the cells those pairs no
// longer fetch for, on the q rows the routes deliver. The route solver against its promises.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <set>

#include "distributed/comm_plan.hpp"
#include "distributed/qo_plan.hpp"
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

// `qo_share` > 0: that share of the rank pairs (random) takes the q/out route.
void check_plan(const Mask& mask, int32_t cp, int32_t chunk, int32_t degree, uint64_t seed, int32_t ranks_per_node = 0,
                double qo_share = 0) {
  const Dispatch d = make_dispatch(mask, cp, chunk, DispatchAlgorithm::GreedySwap);
  std::mt19937_64 pick(seed ^ 0x9e3779b97f4a7c15ull);
  std::vector<std::vector<bool>> qo(static_cast<size_t>(cp), std::vector<bool>(static_cast<size_t>(cp), false));
  for (int32_t r = 0; r < cp; ++r)
    for (int32_t o = 0; o < cp; ++o) qo[r][o] = r != o && std::uniform_real_distribution<double>()(pick) < qo_share;
  const CommPlan plan = make_comm_plan(mask, d, degree, ranks_per_node, qo_share > 0 ? &qo : nullptr);
  const QoPlan qo_plan = make_qo_plan(mask, d, qo);
  // Cells of q owner r computed by executors (global), from the executors' masks and the delivered rows.
  std::vector<std::multiset<Cell>> routed(static_cast<size_t>(cp));
  for (int32_t o = 0; o < cp; ++o) {
    std::vector<int32_t> global_q, source;  // the executor's buffer rows: global q row and its owner
    for (int32_t r = 0; r < cp; ++r) {
      const auto& rows = qo_plan.routes[r].send_rows[o];
      ASSERT_EQ(qo_plan.routes[o].recv_rows[r], static_cast<int64_t>(rows.size()));
      for (int32_t row : rows) {
        global_q.push_back(d.q.global_rows(r)[row]);
        source.push_back(r);
      }
    }
    const Mask& m = qo_plan.masks[o];
    ASSERT_EQ(m.total_q, static_cast<int32_t>(global_q.size()));
    ASSERT_EQ(m.total_k, d.k.local_tokens());
    validate(m);
    std::multiset<Cell> cells;
    add_cells(m, global_q, d.k.global_rows(o), cells);
    for (const Cell& c : cells) {
      const int32_t owner = d.q.owner_of(c.first);
      ASSERT_TRUE(qo[owner][o]) << "executor " << o << " computes a row of " << owner << ", which keeps the k/v route";
      routed[owner].insert(c);
    }
  }
  const std::string where = "seed " + std::to_string(seed) + " cp " + std::to_string(cp) + " chunk " +
                            std::to_string(chunk) + " degree " + std::to_string(degree) + " ranks/node " +
                            std::to_string(ranks_per_node) + " qo share " + std::to_string(qo_share);
  ASSERT_EQ(plan.hierarchical(), ranks_per_node > 0);
  ASSERT_EQ(plan.num_stages(), std::max(1, degree)) << where;
  for (int32_t rank = 0; rank < cp; ++rank) {
    const RankPlan& rp = plan.ranks[rank];
    std::set<Cell> expected = rank_cells(mask, d, rank);
    // The q/out route: the executors compute exactly the cells this rank no longer fetches keys for.
    std::set<Cell> handed;
    for (const Cell& c : expected)
      if (qo[rank][d.k.owner_of(c.second)]) handed.insert(c);
    ASSERT_EQ(routed[rank].size(), handed.size()) << where << " rank " << rank << " (cells computed twice?)";
    ASSERT_EQ(std::set<Cell>(routed[rank].begin(), routed[rank].end()), handed) << where << " rank " << rank;
    for (const Cell& c : handed) expected.erase(c);

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
    ASSERT_EQ(stage_area + static_cast<int64_t>(handed.size()), d.rank_area[rank]) << where;
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
    for (double share : {0.5, 1.0}) {
      check_plan(mask, cp + 1, chunk, degree, seed + trial, 0, share);
      if (HasFatalFailure()) return;
    }
    for (int32_t per_node = 1; per_node <= cp; ++per_node)
      if (cp % per_node == 0) {
        check_plan(mask, cp, chunk, degree, seed, per_node);
        if (HasFatalFailure()) return;
        check_plan(mask, cp, chunk, degree, seed + 1, per_node, 0.5);
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
  for (const auto& named : test::cases::all()) {
    SCOPED_TRACE(named.name + " with q/out routes");
    check_plan(named.mask, 4, 37, 2, seed, 0, 0.6);
    if (HasFatalFailure()) return;
  }
}

int64_t max_of(const std::vector<int64_t>& v) { return *std::max_element(v.begin(), v.end()); }
// The busiest rank may grow by 2% (qo_plan.cpp's kBalanceSlack), plus a unit's rounding.
int64_t within_slack(int64_t busiest) { return busiest + busiest / 50 + 8; }

// The solver's promises: kv-only when off; with the q/out route, never more bytes than kv-only and the busiest rank
// within the slack; flattened as well, and lighter where whole chunks cannot balance the dispatch.
TEST(RouteSolver, KeepsItsPromises) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 30; ++trial) {
    const int32_t t = uniform(rng, 100, 600);
    const Mask mask = trial % 2 ? test::random_rectangles(rng, t, t, uniform(rng, 1, 30))
                                : masks::varlen_causal(test::cu_seqlens_of({t, t / 3 + 1, 2 * t}));
    const int32_t cp = uniform(rng, 2, 8), chunk = uniform(rng, 8, 64);
    // Flattened units: kv head groups, at most 4 (the largest divisor of the kv heads up to 4).
    const HeadShape heads = std::vector<HeadShape>{{4, 4, 64}, {8, 2, 128}, {4, 1, 64}, {12, 6, 64}}[trial % 4];
    const int32_t flat_groups = std::vector<int32_t>{4, 2, 1, 3}[trial % 4];
    const Dispatch d = make_dispatch(mask, cp, chunk, DispatchAlgorithm::GreedySwap);
    const std::string where = "seed " + std::to_string(seed) + " trial " + std::to_string(trial);
    const RouteSolution off = solve_routes(mask, d, heads, {});
    EXPECT_EQ(off.qo_units_total(), 0) << where;
    EXPECT_EQ(off.bytes, off.kv_only_bytes) << where;
    EXPECT_EQ(off.rank_area, d.rank_area) << where;
    for (bool flatten : {false, true}) {
      const RouteSolution s = solve_routes(mask, d, heads, {.qo_comm = true, .flatten_head_groups = flatten});
      EXPECT_EQ(s.groups, flatten ? flat_groups : 1);
      EXPECT_LE(max_of(s.rank_area), within_slack(max_of(d.rank_area))) << where;
      if (!flatten) EXPECT_LE(s.bytes, s.kv_only_bytes) << where;
      const auto work = pair_work(mask, d);
      for (int32_t r = 0; r < cp; ++r)
        for (int32_t o = 0; o < cp; ++o) {
          const RouteBytes b = route_bytes(work[r][o], heads, {.qo_comm = true});
          const RouteBytes back = route_bytes(work[o][r], heads, {.qo_comm = true});
          EXPECT_TRUE(s.qo_units[r][o] == 0 || flatten || b.qo() < b.kv() ||
                      (s.qo_units[o][r] > 0 && b.qo() + back.qo() < b.kv() + back.kv()))
              << where << " pair " << r << "," << o << ": its route (or the pair's both ways) must save bytes";
          EXPECT_TRUE(r != o || s.qo_units[r][o] == 0);
        }
      int64_t total = 0, before = 0;
      for (int32_t r = 0; r < cp; ++r) total += s.rank_area[r], before += d.rank_area[r];
      EXPECT_NEAR(static_cast<double>(total), static_cast<double>(before), cp) << where << " (rounding per rank only)";
    }
  }
}

// Long documents at high cp, one kv head per q head: a rank's rows of a document need most of the other ranks'
// rows of it. Per kv head group (flattened), the q/out route takes units both ways between rank pairs where that
// moves fewer bytes, keeping the balance within the slack; whole pairs are too coarse for that.
TEST(RouteSolver, QueryRoutesMoveFewerBytesOnLongDocuments) {
  const Mask mask = masks::varlen_causal(test::cu_seqlens_of({6000, 1500, 500}));
  for (int32_t cp : {4, 8}) {
    const Dispatch d = make_dispatch(mask, cp, 64, DispatchAlgorithm::Locality);
    const RouteSolution whole = solve_routes(mask, d, {8, 8, 128}, {.qo_comm = true});
    const RouteSolution s = solve_routes(mask, d, {8, 8, 128}, {.qo_comm = true, .flatten_head_groups = true});
    std::printf("varlen causal 6000/1500/500 cp %d: %lld of %d units per pair take the q/out route, fwd+bwd bytes "
                "%.1f MiB vs kv-only %.1f MiB (whole pairs: %.1f MiB); max area %lld vs %lld\n", cp,
                static_cast<long long>(s.qo_units_total()), s.groups, s.bytes / 1048576.0, s.kv_only_bytes / 1048576.0,
                whole.bytes / 1048576.0, static_cast<long long>(max_of(s.rank_area)),
                static_cast<long long>(max_of(d.rank_area)));
    EXPECT_GT(s.qo_units_total(), 0);
    EXPECT_LT(s.bytes, s.kv_only_bytes);
    EXPECT_LE(whole.bytes, whole.kv_only_bytes);
    EXPECT_LE(max_of(s.rank_area), within_slack(max_of(d.rank_area)));
  }
}

// One q chunk holds most of the work: whole chunks cannot balance it, head-group units can.
TEST(RouteSolver, FlattenedHeadGroupsLightenTheBusiestRank) {
  using test::make_slice;
  Mask mask = masks::varlen_causal(test::cu_seqlens_of(std::vector<int32_t>(32, 64)));
  mask.slices.push_back(make_slice(0, 64, 64, 2048, MaskType::Full));  // the first 64 rows also see every key
  const Dispatch d = make_dispatch(mask, 4, 64, DispatchAlgorithm::GreedySwap);
  const RouteSolution whole = solve_routes(mask, d, {8, 4, 64}, {.qo_comm = true});
  const RouteSolution flat = solve_routes(mask, d, {8, 4, 64}, {.flatten_head_groups = true});
  std::printf("heavy first chunk, cp 4: max rank area %lld (dispatch), %lld (qo comm), %lld (flattened), bound %lld\n",
              static_cast<long long>(max_of(d.rank_area)), static_cast<long long>(max_of(whole.rank_area)),
              static_cast<long long>(max_of(flat.rank_area)), static_cast<long long>(d.lower_bound()));
  EXPECT_LT(max_of(flat.rank_area), max_of(d.rank_area));
  EXPECT_GT(flat.qo_units_total(), 0);
  // Head classes: contiguous kv heads per distinct route set, covering every head once.
  const auto classes = head_classes(flat, 4);
  ASSERT_FALSE(classes.empty());
  EXPECT_EQ(classes.front().kv_head_begin, 0);
  EXPECT_EQ(classes.back().kv_head_end, 4);
  for (size_t i = 1; i < classes.size(); ++i) {
    EXPECT_EQ(classes[i].kv_head_begin, classes[i - 1].kv_head_end);
    EXPECT_NE(classes[i].qo, classes[i - 1].qo);
  }
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
