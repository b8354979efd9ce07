#include "distributed/dispatch.hpp"

#include <algorithm>
#include <bit>
#include <numeric>

#include "distributed/band.hpp"

namespace magi::dist {
namespace {

int32_t chunks_for(int32_t total, int32_t chunk_size, int32_t cp) {
  const int64_t chunks = (int64_t{total} + chunk_size - 1) / chunk_size;
  const int64_t rounded = std::max<int64_t>(cp, (chunks + cp - 1) / cp * cp);
  if (rounded * chunk_size > INT32_MAX) throw InvalidArgument("dispatch: padded length does not fit in int32");
  return static_cast<int32_t>(rounded);
}

Partition partition_of(std::vector<int32_t> owner, int32_t total, int32_t chunk_size, int32_t cp) {
  Partition p;
  p.total = total;
  p.chunk_size = chunk_size;
  p.num_chunks = static_cast<int32_t>(owner.size());
  p.chunks.assign(static_cast<size_t>(cp), {});
  p.position.resize(owner.size());
  for (int32_t c = 0; c < p.num_chunks; ++c) {
    auto& mine = p.chunks[static_cast<size_t>(owner[c])];
    p.position[c] = static_cast<int32_t>(mine.size());
    mine.push_back(c);
  }
  p.owner = std::move(owner);
  return p;
}

std::vector<int32_t> greedy(const std::vector<int64_t>& costs, int32_t cp) {
  const int32_t n = static_cast<int32_t>(costs.size()), per_rank = n / cp;
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return costs[a] > costs[b]; });
  std::vector<int64_t> load(static_cast<size_t>(cp), 0);
  std::vector<int32_t> count(static_cast<size_t>(cp), 0), owner(static_cast<size_t>(n), 0);
  for (int32_t item : order) {
    int32_t best = -1;
    for (int32_t r = 0; r < cp; ++r)
      if (count[r] < per_rank && (best < 0 || load[r] < load[best])) best = r;
    owner[item] = best;
    load[best] += costs[item];
    ++count[best];
  }
  return owner;
}

// Pairwise-swap local search: repeatedly swap one item of the most loaded rank with one item of another
// rank when that lowers the larger of the two loads. Each swap strictly lowers the sum of squared loads,
// so it ends; counts per rank never change.
void refine_by_swaps(const std::vector<int64_t>& costs, int32_t cp, std::vector<int32_t>& owner) {
  std::vector<std::vector<int32_t>> items(static_cast<size_t>(cp));
  std::vector<int64_t> load(static_cast<size_t>(cp), 0);
  for (size_t i = 0; i < owner.size(); ++i) {
    items[owner[i]].push_back(static_cast<int32_t>(i));
    load[owner[i]] += costs[i];
  }
  const auto by_cost = [&](int32_t a, int32_t b) { return costs[a] != costs[b] ? costs[a] < costs[b] : a < b; };
  for (auto& list : items) std::sort(list.begin(), list.end(), by_cost);
  for (int64_t iteration = 0; iteration < 1000000; ++iteration) {
    const int32_t top = static_cast<int32_t>(std::max_element(load.begin(), load.end()) - load.begin());
    // Best swap (a from top, b from r): moving delta = cost[a] - cost[b] in (0, gap) lowers max(top, r);
    // the closer delta is to gap / 2, the lower the new maximum.
    int64_t best_max = load[top];
    int32_t best_r = -1, best_a = -1, best_b = -1;
    for (int32_t r = 0; r < cp; ++r) {
      const int64_t gap = load[top] - load[r];
      if (r == top || gap <= 0) continue;
      const auto& theirs = items[r];
      for (int32_t a : items[top]) {
        // b with cost[b] near cost[a] - gap / 2 (two candidates around the insertion point).
        const int64_t want = costs[a] - gap / 2;
        auto it = std::lower_bound(theirs.begin(), theirs.end(), want,
                                   [&](int32_t b, int64_t value) { return costs[b] < value; });
        for (auto cand : {it, it == theirs.begin() ? theirs.end() : it - 1}) {
          if (cand == theirs.end()) continue;
          const int64_t delta = costs[a] - costs[*cand];
          if (delta <= 0 || delta >= gap) continue;
          const int64_t new_max = std::max(load[top] - delta, load[r] + delta);
          if (new_max < best_max) best_max = new_max, best_r = r, best_a = a, best_b = *cand;
        }
      }
    }
    if (best_r < 0) return;
    const int64_t delta = costs[best_a] - costs[best_b];
    load[top] -= delta;
    load[best_r] += delta;
    owner[best_a] = best_r;
    owner[best_b] = top;
    auto& mine = items[top];
    auto& theirs = items[best_r];
    mine.erase(std::find(mine.begin(), mine.end(), best_a));
    theirs.erase(std::find(theirs.begin(), theirs.end(), best_b));
    mine.insert(std::upper_bound(mine.begin(), mine.end(), best_b, by_cost), best_b);
    theirs.insert(std::upper_bound(theirs.begin(), theirs.end(), best_a, by_cost), best_a);
  }
}

// Exact re-split of the most loaded rank with another rank when the pair holds few items (<= 16):
// single swaps get stuck when each rank holds only a handful of chunks. Returns whether it improved.
bool resplit_top_pair(const std::vector<int64_t>& costs, int32_t cp, std::vector<int32_t>& owner) {
  std::vector<std::vector<int32_t>> items(static_cast<size_t>(cp));
  std::vector<int64_t> load(static_cast<size_t>(cp), 0);
  for (size_t i = 0; i < owner.size(); ++i) {
    items[owner[i]].push_back(static_cast<int32_t>(i));
    load[owner[i]] += costs[i];
  }
  const int32_t top = static_cast<int32_t>(std::max_element(load.begin(), load.end()) - load.begin());
  const auto n = static_cast<int32_t>(items[top].size());
  if (2 * n > 16 || n == 0) return false;
  int64_t best_max = load[top];
  int32_t best_r = -1;
  uint32_t best_subset = 0;
  for (int32_t r = 0; r < cp; ++r) {
    if (r == top || load[r] >= load[top]) continue;
    std::vector<int32_t> pool = items[top];
    pool.insert(pool.end(), items[r].begin(), items[r].end());
    const int64_t total = load[top] + load[r];
    // Subsets of size n that contain pool[0] (the complement covers the others).
    for (uint32_t subset = 1; subset < (1u << (2 * n)); subset += 2) {
      if (std::popcount(subset) != n) continue;
      int64_t sum = 0;
      for (int32_t i = 0; i < 2 * n; ++i)
        if (subset >> i & 1u) sum += costs[pool[i]];
      const int64_t new_max = std::max(sum, total - sum);
      if (new_max < best_max) best_max = new_max, best_r = r, best_subset = subset;
    }
  }
  if (best_r < 0) return false;
  std::vector<int32_t> pool = items[top];
  pool.insert(pool.end(), items[best_r].begin(), items[best_r].end());
  for (int32_t i = 0; i < 2 * n; ++i) owner[pool[i]] = (best_subset >> i & 1u) ? top : best_r;
  return true;
}

int64_t max_load(const std::vector<int64_t>& costs, const std::vector<int32_t>& owner, int32_t cp) {
  std::vector<int64_t> load(static_cast<size_t>(cp), 0);
  for (size_t i = 0; i < costs.size(); ++i) load[owner[i]] += costs[i];
  return *std::max_element(load.begin(), load.end());
}

// Largest rank area Locality accepts, relative to greedy_swap over single chunks: a little compute
// imbalance buys runs of consecutive chunks, whose documents then need few remote kv rows.
constexpr double kLocalityTolerance = 1.02;

std::vector<int32_t> balance_runs(const std::vector<int64_t>& costs, int32_t cp) {
  const int32_t n = static_cast<int32_t>(costs.size()), per_rank = n / cp;
  std::vector<int32_t> chunk_owner = balance(costs, cp, DispatchAlgorithm::GreedySwap);
  const auto limit = static_cast<int64_t>(static_cast<double>(max_load(costs, chunk_owner, cp)) * kLocalityTolerance);
  // Run lengths dividing per_rank (every rank then holds per_rank / run runs), longest first.
  for (int32_t run = per_rank; run >= 2; --run) {
    if (per_rank % run != 0) continue;
    std::vector<int64_t> run_costs(static_cast<size_t>(n / run), 0);
    for (int32_t c = 0; c < n; ++c) run_costs[c / run] += costs[c];
    const std::vector<int32_t> run_owner = balance(run_costs, cp, DispatchAlgorithm::GreedySwap);
    if (max_load(run_costs, run_owner, cp) > limit) continue;
    std::vector<int32_t> owner(static_cast<size_t>(n));
    for (int32_t c = 0; c < n; ++c) owner[c] = run_owner[c / run];
    return owner;
  }
  return chunk_owner;
}

}  // namespace

std::vector<int32_t> Partition::global_rows(int32_t rank) const {
  std::vector<int32_t> rows;
  rows.reserve(static_cast<size_t>(local_tokens()));
  for (int32_t c : chunks[static_cast<size_t>(rank)])
    for (int32_t t = 0; t < chunk_size; ++t) rows.push_back(c * chunk_size + t);
  return rows;
}

int64_t Dispatch::max_rank_area() const {
  return rank_area.empty() ? 0 : *std::max_element(rank_area.begin(), rank_area.end());
}

int64_t Dispatch::lower_bound() const {
  const int64_t total = std::accumulate(chunk_area.begin(), chunk_area.end(), int64_t{0});
  const int64_t cp = q.cp();
  const int64_t largest = chunk_area.empty() ? 0 : *std::max_element(chunk_area.begin(), chunk_area.end());
  return std::max((total + cp - 1) / cp, largest);
}

int64_t Dispatch::count_aware_lower_bound() const {
  if (chunk_area.empty()) return 0;
  std::vector<int64_t> sorted = chunk_area;
  std::sort(sorted.begin(), sorted.end());
  const size_t per_rank = sorted.size() / static_cast<size_t>(q.cp());
  int64_t with_largest = sorted.back();
  for (size_t i = 0; i + 1 < per_rank; ++i) with_largest += sorted[i];
  // The cp - 1 smallest chunks touch at most cp - 1 ranks: some rank holds none of them.
  int64_t without_smallest = 0;
  for (size_t i = static_cast<size_t>(q.cp()) - 1; i < static_cast<size_t>(q.cp()) - 1 + per_rank; ++i)
    without_smallest += sorted[i];
  return std::max({lower_bound(), with_largest, without_smallest});
}

std::vector<int64_t> chunk_areas(const Mask& mask, int32_t chunk_size, int32_t num_chunks) {
  std::vector<int64_t> areas(static_cast<size_t>(num_chunks), 0);
  for (const Slice& s : mask.slices) {
    if (s.q.empty() || s.k.empty()) continue;
    const Band band = band_of(s);
    for (int32_t c = s.q.start / chunk_size; c < num_chunks && c * chunk_size < s.q.end; ++c)
      areas[c] += area(clip_rows(band, {c * chunk_size, (c + 1) * chunk_size}));
  }
  return areas;
}

std::vector<int32_t> balance(const std::vector<int64_t>& costs, int32_t cp, DispatchAlgorithm algorithm) {
  if (cp < 1) throw InvalidArgument("balance: cp must be >= 1");
  if (costs.size() % static_cast<size_t>(cp) != 0)
    throw InvalidArgument("balance: the number of chunks must be a multiple of cp");
  if (algorithm == DispatchAlgorithm::Locality) return balance_runs(costs, cp);
  std::vector<int32_t> owner = greedy(costs, cp);
  if (algorithm == DispatchAlgorithm::GreedySwap) {
    // Each step lowers the sum of squared loads, so this ends.
    do refine_by_swaps(costs, cp, owner);
    while (resplit_top_pair(costs, cp, owner));
  }
  return owner;
}

Dispatch make_dispatch(const Mask& mask, int32_t cp, int32_t chunk_size, DispatchAlgorithm algorithm) {
  if (cp < 1) throw InvalidArgument("dispatch: cp must be >= 1, got " + std::to_string(cp));
  if (chunk_size < 1) throw InvalidArgument("dispatch: chunk_size must be >= 1, got " + std::to_string(chunk_size));
  Dispatch d;
  const int32_t q_chunks = chunks_for(mask.total_q, chunk_size, cp);
  d.chunk_area = chunk_areas(mask, chunk_size, q_chunks);
  d.q = partition_of(balance(d.chunk_area, cp, algorithm), mask.total_q, chunk_size, cp);
  d.self_attention = mask.total_q == mask.total_k;
  if (d.self_attention) {
    d.k = d.q;
  } else {
    const int32_t k_chunks = chunks_for(mask.total_k, chunk_size, cp);
    std::vector<int32_t> owner(static_cast<size_t>(k_chunks));
    for (int32_t c = 0; c < k_chunks; ++c) owner[c] = c / (k_chunks / cp);
    d.k = partition_of(std::move(owner), mask.total_k, chunk_size, cp);
  }
  d.rank_area.assign(static_cast<size_t>(cp), 0);
  for (int32_t c = 0; c < q_chunks; ++c) d.rank_area[d.q.owner[c]] += d.chunk_area[c];
  return d;
}

Dispatch redispatch(const Mask& mask, const Dispatch& fixed) {
  if (mask.total_q != fixed.q.total || mask.total_k != fixed.k.total)
    throw InvalidArgument("new mask after dispatch: its totals (q " + std::to_string(mask.total_q) + ", k " +
                          std::to_string(mask.total_k) + ") must equal the dispatched sequences' (q " +
                          std::to_string(fixed.q.total) + ", k " + std::to_string(fixed.k.total) + ")");
  Dispatch d = fixed;
  d.chunk_area = chunk_areas(mask, fixed.q.chunk_size, fixed.q.num_chunks);
  d.rank_area.assign(static_cast<size_t>(fixed.q.cp()), 0);
  for (int32_t c = 0; c < fixed.q.num_chunks; ++c) d.rank_area[d.q.owner[c]] += d.chunk_area[c];
  return d;
}

RollRoutes roll_routes(const Partition& p, int32_t rank, int64_t shift) {
  const int32_t cp = p.cp();
  const int64_t total = p.total;
  const int64_t s = total == 0 ? 0 : ((shift % total) + total) % total;
  const std::vector<int32_t> mine = p.global_rows(rank);
  std::vector<std::vector<std::pair<int32_t, int32_t>>> to(static_cast<size_t>(cp));  // (their row, my row)
  RollRoutes routes;
  routes.recv.resize(static_cast<size_t>(cp));
  for (int32_t i = 0; i < static_cast<int32_t>(mine.size()); ++i) {
    if (mine[i] >= total) continue;
    const auto there = static_cast<int32_t>((mine[i] + s) % total);
    to[p.owner_of(there)].push_back({p.local_row(there), i});
    routes.recv[p.owner_of(static_cast<int32_t>((mine[i] - s + total) % total))].push_back(i);
  }
  routes.send.resize(static_cast<size_t>(cp));
  for (int32_t r = 0; r < cp; ++r) {
    std::sort(to[r].begin(), to[r].end());
    for (const auto& [theirs, i] : to[r]) routes.send[r].push_back(i);
  }
  return routes;
}

}  // namespace magi::dist
