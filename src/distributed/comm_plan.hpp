// The per-rank execution plan of distributed attention (SPEC section 4), pure host code.
//
// A rank computes its q rows against: the host stage (kv rows it owns) and `overlap_degree` remote stages
// (kv rows fetched from other ranks). A rank fetches exactly the union of the keys its slices keep, minus
// its own rows; each fetched row belongs to one stage. A stage's buffer holds its rows grouped by source
// rank (ascending), each source's rows in global order, so one all-to-all-v lands them in place.
// Each stage's work is a Mask in local coordinates: q = local q rows, k = the stage's kv rows.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/group_collective.hpp"
#include "distributed/band.hpp"
#include "distributed/dispatch.hpp"
#include "magi/mask.hpp"

namespace magi::dist {

struct StagePlan {
  std::vector<std::vector<Range>> fetch;  // [owner] global kv rows fetched from owner, ascending, disjoint
  std::vector<int32_t> owner_order;       // owners in buffer order (rank order unless hierarchical)
  int32_t buffer_rows = 0;
  Mask mask;                              // local q x stage buffer
};

struct RankPlan {
  Mask host_mask;                 // local q x local kv
  std::vector<StagePlan> stages;  // max(1, overlap_degree) remote stages (possibly empty)
  int64_t fetched_rows() const;
};

struct CommPlan {
  std::vector<RankPlan> ranks;
  // [rank][stage]: the stage's kv group-cast seen from that rank as owner (local rows it sends to each
  // rank, rows it receives from each rank). The backward dk/dv group-reduce runs it in reverse.
  // Hierarchical: this is hop 1 (owner -> relay, across nodes once per node) and relay_routes is hop 2
  // (relay -> ranks of its node; its rows index the relay's hop-1 receive buffer). Flat: relay_routes empty.
  std::vector<std::vector<comm::RowRoutes>> routes;
  std::vector<std::vector<comm::RowRoutes>> relay_routes;
  bool hierarchical() const { return !relay_routes.empty(); }
  int32_t num_stages() const { return ranks.empty() ? 0 : static_cast<int32_t>(ranks[0].stages.size()); }
};

// ranks_per_node > 0 plans hierarchical comm over cp / ranks_per_node nodes of consecutive ranks. `qo` ([r][o],
// optional): pairs whose work takes the q/out route (qo_plan.hpp): r fetches nothing of o's for it.
CommPlan make_comm_plan(const Mask& mask, const Dispatch& dispatch, int32_t overlap_degree, int32_t ranks_per_node = 0,
                        const std::vector<std::vector<bool>>* qo = nullptr);

// Sorted, merged union of ranges (empty ones dropped).
std::vector<Range> merged(std::vector<Range> ranges);

// The non-empty (q chunk x slice) bands of `rank`'s q rows, in chunk then slice order: global coordinates,
// columns tightened to the kept keys.
struct WorkBand {
  int32_t q_chunk;
  Band band;
};
std::vector<WorkBand> work_bands(const Mask& mask, const Dispatch& dispatch, int32_t rank);
// The rank in `rank`'s node that relays rows of `owner` (same intra-node index as the owner).
int32_t relay_of(int32_t rank, int32_t owner, int32_t ranks_per_node);

}  // namespace magi::dist
