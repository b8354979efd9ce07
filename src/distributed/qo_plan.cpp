#include "distributed/qo_plan.hpp"

#include <algorithm>
#include <tuple>

#include "distributed/band.hpp"
#include "distributed/comm_plan.hpp"

namespace magi::dist {
namespace {

// The bytes pass may let the busiest rank's compute grow by this share: on a balanced dispatch no route can
// move compute otherwise, and a few percent of compute buys back more in exchanged rows on long documents.
constexpr double kBalanceSlack = 0.02;


int64_t count(const std::vector<Range>& ranges) {
  int64_t n = 0;
  for (Range r : ranges) n += r.size();
  return n;
}

// Calls fn(owner, part) for each piece of `band` on one kv chunk of an owner other than `rank`.
template <class Fn>
void for_each_remote_part(const Band& band, const Dispatch& d, int32_t rank, Fn&& fn) {
  const int32_t cs = d.k.chunk_size;
  for (int32_t c = band.cols.start / cs; c * cs < band.cols.end; ++c) {
    const int32_t owner = d.k.owner[c];
    if (owner == rank) continue;
    const Band part = clip_cols(band, d.k.chunk_range(c));
    if (area(part) > 0) fn(owner, part);
  }
}

}  // namespace

int64_t PairWork::q_count() const { return count(q_rows); }
int64_t PairWork::k_count() const { return count(k_rows); }

std::vector<std::vector<PairWork>> pair_work(const Mask& mask, const Dispatch& d) {
  const int32_t cp = d.q.cp();
  std::vector<std::vector<PairWork>> work(static_cast<size_t>(cp), std::vector<PairWork>(static_cast<size_t>(cp)));
  for (int32_t r = 0; r < cp; ++r) {
    for (const WorkBand& w : work_bands(mask, d, r))
      for_each_remote_part(w.band, d, r, [&](int32_t o, const Band& part) {
        PairWork& pw = work[r][o];
        pw.area += area(part);
        pw.q_rows.push_back(kept_rows(part));
        pw.k_rows.push_back(kept_cols(part));
      });
    for (PairWork& pw : work[r]) {
      pw.q_rows = merged(std::move(pw.q_rows));
      pw.k_rows = merged(std::move(pw.k_rows));
    }
  }
  return work;
}

RouteBytes route_bytes(const PairWork& w, const HeadShape& heads, const RouteOptions& options) {
  constexpr int64_t e = 2;  // input element bytes assumed by the planner (bf16 / fp16)
  const int64_t d = heads.head_dim, hq = heads.heads_q, hkv = heads.heads_kv;
  const int64_t grad = options.backward_high_precision ? 4 : e, out = options.forward_high_precision ? 4 : e;
  const int64_t nk = w.k_count(), nq = w.q_count();
  RouteBytes b;
  b.kv_forward = nk * hkv * d * 2 * e;                    // k, v
  b.kv_backward = nk * hkv * d * (2 * e + 2 * grad);      // k, v again; partial dk, dv back
  b.qo_forward = nq * hq * (d * e + d * out + 4);         // q; partial out and lse back
  b.qo_backward = nq * hq * (3 * d * e + 4 + d * grad);   // q, out, dout, lse; partial dq back
  return b;
}

int64_t RouteSolution::qo_units_total() const {
  int64_t n = 0;
  for (const auto& row : qo_units)
    for (int32_t u : row) n += u;
  return n;
}

// Flattened units: kv head groups, at most kMaxHeadGroups of them (the largest divisor of the kv heads up to it):
// each distinct route of a group is a head class, which costs the device runtime its own exchanges and kernel
// launches (4 H200s, varlen causal: 16 one-head classes ran 3x slower than one class).
constexpr int32_t kMaxHeadGroups = 4;
int32_t head_groups(int32_t heads_kv) {
  for (int32_t g = std::min(heads_kv, kMaxHeadGroups); g > 1; --g)
    if (heads_kv % g == 0) return g;
  return 1;
}

RouteSolution solve_routes(const Mask& mask, const Dispatch& d, const HeadShape& heads, const RouteOptions& options) {
  const int32_t cp = d.q.cp();
  const std::vector<std::vector<PairWork>> work = pair_work(mask, d);
  RouteSolution s;
  s.groups = options.flatten_head_groups ? head_groups(heads.heads_kv) : 1;
  s.qo_units.assign(static_cast<size_t>(cp), std::vector<int32_t>(static_cast<size_t>(cp), 0));
  // Areas in cells x units so that a unit's share stays an integer.
  const int64_t g = s.groups;
  std::vector<int64_t> load(static_cast<size_t>(cp));
  for (int32_t r = 0; r < cp; ++r) load[r] = d.rank_area[r] * g;
  std::vector<std::vector<RouteBytes>> bytes(static_cast<size_t>(cp), std::vector<RouteBytes>(static_cast<size_t>(cp)));
  for (int32_t r = 0; r < cp; ++r)
    for (int32_t o = 0; o < cp; ++o) bytes[r][o] = route_bytes(work[r][o], heads, options);
  const auto move = [&](int32_t r, int32_t o, int32_t units) {
    s.qo_units[r][o] += units;
    load[r] -= work[r][o].area * units;
    load[o] += work[r][o].area * units;
  };
  const auto movable = [&](int32_t r, int32_t o) { return r != o && work[r][o].area > 0 && s.qo_units[r][o] < g; };

  // Balance (flattened): units of the busiest rank's work go to the kv owner while that lowers the maximum; of
  // the candidates, the one that adds the fewest bytes per unit.
  if (options.flatten_head_groups) {
    for (int64_t iter = 0; iter < int64_t{cp} * cp * g; ++iter) {
      const int32_t r = static_cast<int32_t>(std::max_element(load.begin(), load.end()) - load.begin());
      int32_t best = -1, best_units = 0;
      int64_t best_cost = 0;
      for (int32_t o = 0; o < cp; ++o) {
        if (!movable(r, o)) continue;
        const int64_t unit = work[r][o].area;  // one unit's load (cells x units / units)
        const int32_t units = static_cast<int32_t>(std::min<int64_t>(g - s.qo_units[r][o], (load[r] - load[o]) / (2 * unit)));
        if (units < 1) continue;
        const int64_t cost = bytes[r][o].qo() - bytes[r][o].kv();
        if (best < 0 || cost < best_cost) std::tie(best, best_units, best_cost) = std::tuple{o, units, cost};
      }
      if (best < 0) break;
      move(r, best, best_units);
    }
  }
  // Bytes: units whose q/out route moves fewer bytes take it, largest saving first, while no rank's load passes
  // the busiest one's by more than kBalanceSlack. A pair's route moves its compute to the kv owner; taking it in
  // both directions of a rank pair at once moves compute both ways, which keeps a balanced dispatch balanced.
  if (options.qo_comm || options.flatten_head_groups) {
    const int64_t busiest = *std::max_element(load.begin(), load.end());
    const int64_t limit = busiest + static_cast<int64_t>(kBalanceSlack * static_cast<double>(busiest));
    const auto saving = [&](int32_t r, int32_t o) { return bytes[r][o].kv() - bytes[r][o].qo(); };
    for (int64_t iter = 0; iter < 4 * int64_t{cp} * cp * g; ++iter) {
      int64_t best_saving = 0;
      int32_t best_r = -1, best_o = -1;
      bool best_both = false;
      for (int32_t r = 0; r < cp; ++r)
        for (int32_t o = 0; o < cp; ++o) {
          if (!movable(r, o)) continue;
          const int64_t a = work[r][o].area;
          if (load[o] + a <= limit && saving(r, o) > best_saving)
            std::tie(best_saving, best_r, best_o, best_both) = std::tuple{saving(r, o), r, o, false};
          if (r < o && movable(o, r) && saving(r, o) + saving(o, r) > 0) {
            const int64_t back = work[o][r].area;
            if (load[o] + a - back <= limit && load[r] - a + back <= limit && saving(r, o) + saving(o, r) > best_saving)
              std::tie(best_saving, best_r, best_o, best_both) = std::tuple{saving(r, o) + saving(o, r), r, o, true};
          }
        }
      if (best_r < 0) break;
      // Every remaining unit of the pair at once where that stays within the limit: the same bytes as one at a
      // time, but pairs stay whole, so flattening makes few head classes (each costs the device runtime its own
      // exchanges and kernel launches: 16 classes ran varlen causal 3x slower on 4 H200s).
      const int64_t a = work[best_r][best_o].area;
      int32_t units = g - s.qo_units[best_r][best_o];
      if (best_both) {
        units = std::min(units, static_cast<int32_t>(g - s.qo_units[best_o][best_r]));
        const int64_t net = a - work[best_o][best_r].area;  // load moved from best_r to best_o per unit
        if (load[best_o] + net * units > limit || load[best_r] - net * units > limit) units = 1;
      } else if (load[best_o] + a * units > limit) {
        units = 1;
      }
      move(best_r, best_o, units);
      if (best_both) move(best_o, best_r, units);
    }
  }

  s.rank_area.resize(static_cast<size_t>(cp));
  for (int32_t r = 0; r < cp; ++r) s.rank_area[r] = load[r] / g;  // a unit is 1/g of a pair's cells: rounded
  for (int32_t r = 0; r < cp; ++r)
    for (int32_t o = 0; o < cp; ++o) {
      const RouteBytes& b = bytes[r][o];
      const int64_t qo_units = s.qo_units[r][o], kv_units = g - qo_units;
      s.kv_only_forward_bytes += b.kv_forward;
      s.kv_only_bytes += b.kv();
      // Per unit each route moves 1/g of the pair's bytes (a unit is one kv head group).
      s.forward_bytes += (b.kv_forward * kv_units + b.qo_forward * qo_units) / g;
      s.bytes += (b.kv() * kv_units + b.qo() * qo_units) / g;
    }
  return s;
}

std::vector<HeadClass> head_classes(const RouteSolution& s, int32_t heads_kv) {
  const int32_t cp = static_cast<int32_t>(s.qo_units.size());
  const int32_t heads_per_unit = heads_kv / s.groups;
  std::vector<HeadClass> classes;
  for (int32_t unit = 0; unit < s.groups; ++unit) {
    std::vector<std::vector<bool>> qo(static_cast<size_t>(cp), std::vector<bool>(static_cast<size_t>(cp), false));
    for (int32_t r = 0; r < cp; ++r)
      for (int32_t o = 0; o < cp; ++o) qo[r][o] = unit < s.qo_units[r][o];
    if (!classes.empty() && classes.back().qo == qo) classes.back().kv_head_end += heads_per_unit;
    else classes.push_back({unit * heads_per_unit, (unit + 1) * heads_per_unit, std::move(qo)});
  }
  return classes;
}

QoPlan make_qo_plan(const Mask& mask, const Dispatch& d, const std::vector<std::vector<bool>>& qo) {
  const int32_t cp = d.q.cp();
  const std::vector<std::vector<PairWork>> work = pair_work(mask, d);
  QoPlan plan;
  plan.routes.resize(static_cast<size_t>(cp));
  plan.masks.resize(static_cast<size_t>(cp));
  for (auto& routes : plan.routes) {
    routes.send_rows.assign(static_cast<size_t>(cp), {});
    routes.recv_rows.assign(static_cast<size_t>(cp), 0);
  }
  // base[o][r]: where r's rows start in executor o's buffer (sources ascending).
  std::vector<std::vector<int64_t>> base(static_cast<size_t>(cp), std::vector<int64_t>(static_cast<size_t>(cp), 0));
  for (int32_t o = 0; o < cp; ++o) {
    int64_t rows = 0;
    for (int32_t r = 0; r < cp; ++r) {
      base[o][r] = rows;
      if (!qo[r][o]) continue;
      plan.any = true;
      for (Range q : work[r][o].q_rows)
        for (int32_t row = q.start; row < q.end; ++row) plan.routes[r].send_rows[o].push_back(d.q.local_row(row));
      plan.routes[o].recv_rows[r] = work[r][o].q_count();
      rows += work[r][o].q_count();
    }
    plan.masks[o].total_q = static_cast<int32_t>(rows);
    plan.masks[o].total_k = d.k.local_tokens();
  }
  for (int32_t r = 0; r < cp; ++r)
    for (const WorkBand& w : work_bands(mask, d, r))
      for_each_remote_part(w.band, d, r, [&](int32_t o, const Band& part) {
        if (!qo[r][o]) return;
        const Band rows_kept = clip_rows(part, kept_rows(part));
        // The part's rows lie in one of the pair's merged row ranges: their place in o's buffer follows.
        const std::vector<Range>& q_rows = work[r][o].q_rows;
        int64_t before = 0;
        size_t i = 0;
        while (q_rows[i].end <= rows_kept.rows.start) before += q_rows[i++].size();
        const int64_t dq = base[o][r] + before - q_rows[i].start;
        const int32_t chunk = rows_kept.cols.start / d.k.chunk_size;
        const int32_t dk = d.k.local_row(chunk * d.k.chunk_size) - chunk * d.k.chunk_size;
        append_slices(shift(rows_kept, static_cast<int32_t>(dq), dk), plan.masks[o].slices);
      });
  return plan;
}

}  // namespace magi::dist
