#include "distributed/comm_plan.hpp"

#include <algorithm>

#include "distributed/band.hpp"

namespace magi::dist {
namespace {

// A window of global kv rows and where it lives for this rank: the host stage (-1) or a remote stage,
// and the shift from global row to the row in that stage's buffer.
struct Piece {
  Range cols;
  int32_t stage = -1;
  int32_t shift = 0;
};


void append_rows(std::vector<int32_t>& out, const std::vector<Range>& ranges, const Partition& k) {
  for (Range r : ranges)
    for (int32_t row = r.start; row < r.end; ++row) out.push_back(k.local_row(row));
}

// One hop: every owner sends each rank what it fetches from it.
void add_flat_routes(CommPlan& plan, const Dispatch& d) {
  const int32_t cp = d.q.cp(), num_stages = plan.num_stages();
  plan.routes.assign(static_cast<size_t>(cp), std::vector<comm::RowRoutes>(static_cast<size_t>(num_stages)));
  for (int32_t owner = 0; owner < cp; ++owner)
    for (int32_t s = 0; s < num_stages; ++s) {
      comm::RowRoutes& routes = plan.routes[owner][s];
      routes.send_rows.assign(static_cast<size_t>(cp), {});
      routes.recv_rows.assign(static_cast<size_t>(cp), 0);
      for (int32_t peer = 0; peer < cp; ++peer) {
        append_rows(routes.send_rows[peer], plan.ranks[peer].stages[s].fetch[owner], d.k);
        for (Range r : plan.ranks[owner].stages[s].fetch[peer]) routes.recv_rows[peer] += r.size();
      }
    }
}

// Two hops. Hop 1: an owner sends to each node, once, the union of the rows that node's ranks fetch from
// it, to the node's rank with the owner's intra-node index (its relay). Hop 2: relays fan rows out inside
// their node. A relay's hop-1 buffer holds its owners in rank order, each owner's rows in global order.
void add_hierarchical_routes(CommPlan& plan, const Dispatch& d, int32_t ranks_per_node) {
  const int32_t cp = d.q.cp(), num_stages = plan.num_stages(), nodes = cp / ranks_per_node;
  plan.routes.assign(static_cast<size_t>(cp), std::vector<comm::RowRoutes>(static_cast<size_t>(num_stages)));
  plan.relay_routes = plan.routes;
  for (int32_t s = 0; s < num_stages; ++s) {
    // node_rows[node][owner]: rows the node's ranks fetch from owner, merged.
    std::vector<std::vector<std::vector<Range>>> node_rows(
        static_cast<size_t>(nodes), std::vector<std::vector<Range>>(static_cast<size_t>(cp)));
    for (int32_t node = 0; node < nodes; ++node)
      for (int32_t owner = 0; owner < cp; ++owner) {
        std::vector<Range> all;
        for (int32_t i = 0; i < ranks_per_node; ++i) {
          const auto& f = plan.ranks[node * ranks_per_node + i].stages[s].fetch[owner];
          all.insert(all.end(), f.begin(), f.end());
        }
        node_rows[node][owner] = merged(std::move(all));
      }
    for (auto* routes_of : {&plan.routes, &plan.relay_routes})
      for (int32_t r = 0; r < cp; ++r) {
        (*routes_of)[r][s].send_rows.assign(static_cast<size_t>(cp), {});
        (*routes_of)[r][s].recv_rows.assign(static_cast<size_t>(cp), 0);
      }
    for (int32_t owner = 0; owner < cp; ++owner)
      for (int32_t node = 0; node < nodes; ++node) {
        const int32_t relay = node * ranks_per_node + owner % ranks_per_node;
        append_rows(plan.routes[owner][s].send_rows[relay], node_rows[node][owner], d.k);
        for (Range r : node_rows[node][owner]) plan.routes[relay][s].recv_rows[owner] += r.size();
      }
    for (int32_t relay = 0; relay < cp; ++relay) {
      const int32_t node = relay / ranks_per_node;
      // Offset of each owner's block in the relay's hop-1 buffer.
      std::vector<int64_t> block(static_cast<size_t>(cp) + 1, 0);
      for (int32_t owner = 0; owner < cp; ++owner) block[owner + 1] = block[owner] + plan.routes[relay][s].recv_rows[owner];
      for (int32_t i = 0; i < ranks_per_node; ++i) {
        const int32_t dst = node * ranks_per_node + i;
        for (int32_t owner = relay % ranks_per_node; owner < cp; owner += ranks_per_node) {
          const auto& union_rows = node_rows[node][owner];
          std::vector<int64_t> before(union_rows.size() + 1, 0);  // rows of the union before range i
          for (size_t i = 0; i < union_rows.size(); ++i) before[i + 1] = before[i] + union_rows[i].size();
          for (Range r : plan.ranks[dst].stages[s].fetch[owner])
            for (int32_t row = r.start; row < r.end; ++row) {
              const auto it = std::upper_bound(union_rows.begin(), union_rows.end(), row,
                                               [](int32_t v, Range u) { return v < u.start; }) - 1;
              const int64_t pos = before[it - union_rows.begin()] + (row - it->start);
              plan.relay_routes[relay][s].send_rows[dst].push_back(static_cast<int32_t>(block[owner] + pos));
            }
          for (Range r : plan.ranks[dst].stages[s].fetch[owner]) plan.relay_routes[dst][s].recv_rows[relay] += r.size();
        }
      }
    }
  }
}

}  // namespace

std::vector<Range> merged(std::vector<Range> ranges) {
  std::sort(ranges.begin(), ranges.end(), [](Range a, Range b) { return a.start < b.start; });
  std::vector<Range> out;
  for (Range r : ranges) {
    if (r.empty()) continue;
    if (!out.empty() && r.start <= out.back().end) out.back().end = std::max(out.back().end, r.end);
    else out.push_back(r);
  }
  return out;
}

std::vector<WorkBand> work_bands(const Mask& mask, const Dispatch& d, int32_t rank) {
  const int32_t cs = d.q.chunk_size;
  std::vector<WorkBand> work;
  for (int32_t c : d.q.chunks[rank])
    for (const Slice& slice : mask.slices) {
      if (slice.q.empty() || slice.k.empty() || slice.q.end <= c * cs || slice.q.start >= (c + 1) * cs) continue;
      const Band band = clip_rows(band_of(slice), d.q.chunk_range(c));
      const Range cols = kept_cols(band);
      if (!cols.empty()) work.push_back({c, clip_cols(band, cols)});
    }
  return work;
}

int32_t relay_of(int32_t rank, int32_t owner, int32_t ranks_per_node) {
  return rank / ranks_per_node * ranks_per_node + owner % ranks_per_node;
}

int64_t RankPlan::fetched_rows() const {
  int64_t n = 0;
  for (const auto& stage : stages) n += stage.buffer_rows;
  return n;
}

CommPlan make_comm_plan(const Mask& mask, const Dispatch& d, int32_t overlap_degree, int32_t ranks_per_node,
                        const std::vector<std::vector<bool>>* qo) {
  if (overlap_degree < 0) throw InvalidArgument("overlap_degree must be >= 0, got " + std::to_string(overlap_degree));
  if (ranks_per_node < 0 || (ranks_per_node > 0 && d.q.cp() % ranks_per_node != 0))
    throw InvalidArgument("hierarchical comm: ranks_per_node (" + std::to_string(ranks_per_node) +
                          ") must divide the cp size (" + std::to_string(d.q.cp()) + ")");
  const int32_t cp = d.q.cp(), num_stages = std::max(1, overlap_degree);
  const int32_t cs = d.q.chunk_size;

  CommPlan plan;
  plan.ranks.resize(static_cast<size_t>(cp));
  for (int32_t rank = 0; rank < cp; ++rank) {
    RankPlan& rp = plan.ranks[rank];
    const std::vector<WorkBand> work = work_bands(mask, d, rank);
    const auto routed_away = [&](int32_t owner) { return qo != nullptr && (*qo)[rank][owner]; };

    // Remote rows needed: the union of kept keys, cut at kv chunk boundaries, minus own chunks and the chunks of
    // owners that compute this rank's work themselves (q/out route).
    std::vector<Range> needed;
    for (const WorkBand& w : work) needed.push_back(w.band.cols);
    std::vector<Range> remote;  // global order
    for (Range r : merged(std::move(needed)))
      for (int32_t start = r.start; start < r.end;) {
        const int32_t end = std::min(r.end, (start / d.k.chunk_size + 1) * d.k.chunk_size);
        if (d.k.owner_of(start) != rank && !routed_away(d.k.owner_of(start))) {
          if (!remote.empty() && remote.back().end == start && d.k.owner_of(remote.back().start) == d.k.owner_of(start))
            remote.back().end = end;
          else remote.push_back({start, end});
        }
        start = end;
      }

    // Stages: consecutive shares of the remote rows in global order, as equal in rows as possible.
    int64_t total_remote = 0;
    for (Range r : remote) total_remote += r.size();
    rp.stages.resize(static_cast<size_t>(num_stages));
    for (auto& stage : rp.stages) stage.fetch.assign(static_cast<size_t>(cp), {});
    const auto boundary = [&](int64_t s) { return total_remote * s / num_stages; };
    int64_t seen = 0;
    int32_t stage = 0;
    for (Range r : remote)
      for (int32_t start = r.start; start < r.end;) {
        while (seen >= boundary(stage + 1)) ++stage;
        const int32_t end = static_cast<int32_t>(std::min<int64_t>(r.end, start + (boundary(stage + 1) - seen)));
        rp.stages[stage].fetch[d.k.owner_of(start)].push_back({start, end});
        seen += end - start;
        start = end;
      }

    std::vector<Piece> pieces;
    for (int32_t c : d.k.chunks[rank]) pieces.push_back({d.k.chunk_range(c), -1, d.k.local_row(c * cs) - c * cs});
    // Buffer order of owners: by the rank that delivers their rows (the owner itself, or with hierarchical
    // comm the relay in this rank's node with the owner's intra-node index), then by owner.
    std::vector<int32_t> owner_order(static_cast<size_t>(cp));
    for (int32_t o = 0; o < cp; ++o) owner_order[o] = o;
    if (ranks_per_node > 0)
      std::stable_sort(owner_order.begin(), owner_order.end(), [&](int32_t a, int32_t b) {
        return relay_of(rank, a, ranks_per_node) < relay_of(rank, b, ranks_per_node);
      });
    for (int32_t s = 0; s < num_stages; ++s) {
      StagePlan& stage = rp.stages[s];
      stage.owner_order = owner_order;
      for (int32_t owner : owner_order)
        for (Range r : stage.fetch[owner]) {
          pieces.push_back({r, s, stage.buffer_rows - r.start});
          stage.buffer_rows += r.size();
        }
      stage.mask.total_q = d.q.local_tokens();
      stage.mask.total_k = stage.buffer_rows;
    }
    std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.cols.start < b.cols.start; });
    rp.host_mask.total_q = d.q.local_tokens();
    rp.host_mask.total_k = d.k.local_tokens();

    for (const WorkBand& w : work) {  // parts on rows of routed-away owners have no piece: they are dropped
      const int32_t dq = d.q.local_row(w.q_chunk * cs) - w.q_chunk * cs;
      auto it = std::upper_bound(pieces.begin(), pieces.end(), w.band.cols.start,
                                 [](int32_t col, const Piece& p) { return col < p.cols.start; });
      if (it != pieces.begin()) --it;
      for (; it != pieces.end() && it->cols.start < w.band.cols.end; ++it) {
        const Band part = clip_cols(w.band, it->cols);
        if (part.cols.empty()) continue;
        Mask& target = it->stage < 0 ? rp.host_mask : rp.stages[it->stage].mask;
        append_slices(shift(part, dq, it->shift), target.slices);
      }
    }
  }

  if (ranks_per_node > 0) add_hierarchical_routes(plan, d, ranks_per_node);
  else add_flat_routes(plan, d);
  return plan;
}

}  // namespace magi::dist
