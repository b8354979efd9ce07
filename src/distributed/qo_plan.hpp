// Query/output communication (MAGI_ATTENTION_QO_COMM) and head-group flattening
// (MAGI_ATTENTION_FLATTEN_HEAD_GROUPS), pure host code.
//
// Beside fetching k/v (comm_plan.hpp), rank r may hand the attention of its q rows against rank o's kv rows to o
// (the q/out route): r sends those q rows to o, o computes them against its own kv and sends back partial out and
// lse, which r lse-merges; the backward sends q, out, dout and lse, returns partial dq, and the dk/dv of that work
// stay on o, where they belong. The solver picks per rank pair (per pair and kv head group when flattened) the
// route that moves fewer bytes without raising the busiest rank's compute; flattened, it also moves head-group
// units off the busiest rank while that lowers it.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/group_collective.hpp"
#include "distributed/dispatch.hpp"
#include "magi/dist.hpp"
#include "magi/mask.hpp"

namespace magi::dist {

// The work of q owner r against kv owner o != r, in global rows.
struct PairWork {
  int64_t area = 0;            // kept cells
  std::vector<Range> q_rows;   // r's rows that keep a key of o's (merged, ascending)
  std::vector<Range> k_rows;   // o's rows that r's rows keep (merged, ascending)
  int64_t q_count() const;
  int64_t k_count() const;
};
// [r][o]; [r][r] is empty (local work needs no route).
std::vector<std::vector<PairWork>> pair_work(const Mask& mask, const Dispatch& dispatch);

struct RouteOptions {
  bool qo_comm = false;                  // may pick the q/out route where it moves fewer bytes
  bool flatten_head_groups = false;      // decide per kv head group; move units off the busiest rank
  bool forward_high_precision = false;   // partial out in fp32 on the wire
  bool backward_high_precision = false;  // partial dk/dv/dq in fp32 on the wire
  bool operator==(const RouteOptions&) const = default;
};

// Bytes of one pair's work per route, forward + backward, for 2-byte inputs (bf16 / fp16).
struct RouteBytes {
  int64_t kv_forward = 0, kv_backward = 0, qo_forward = 0, qo_backward = 0;
  int64_t kv() const { return kv_forward + kv_backward; }
  int64_t qo() const { return qo_forward + qo_backward; }
};
RouteBytes route_bytes(const PairWork& work, const HeadShape& heads, const RouteOptions& options);

struct RouteSolution {
  int32_t groups = 1;                          // units per pair: kv head groups when flattened, else 1
  std::vector<std::vector<int32_t>> qo_units;  // [r][o]: units [0, n) of the pair take the q/out route
  std::vector<int64_t> rank_area;              // cells each rank computes after the moves
  int64_t forward_bytes = 0, bytes = 0;        // this plan (bytes: forward + backward)
  int64_t kv_only_forward_bytes = 0, kv_only_bytes = 0;
  int64_t qo_units_total() const;
};
RouteSolution solve_routes(const Mask& mask, const Dispatch& dispatch, const HeadShape& heads,
                           const RouteOptions& options);

// Kv heads [kv_head_begin, kv_head_end) share one plan: `qo[r][o]` says which pairs take the q/out route.
struct HeadClass {
  int32_t kv_head_begin = 0, kv_head_end = 0;
  std::vector<std::vector<bool>> qo;
};
// Contiguous runs of kv heads with the same routes (one class covering every head when nothing is flattened).
std::vector<HeadClass> head_classes(const RouteSolution& solution, int32_t heads_kv);

struct QoPlan {
  // [rank], seen from the rank as q owner: send_rows[executor] are its local q rows the executor computes, in
  // global order; recv_rows[src] how many rows it computes for src. The executor's buffer holds sources
  // ascending, so one group-cast brings q (and out, dout, lse) and its transpose returns out/lse or dq.
  std::vector<comm::RowRoutes> routes;
  std::vector<Mask> masks;  // [rank as executor]: its buffer rows x its local kv rows
  bool any = false;         // some pair of some rank takes the route
};
QoPlan make_qo_plan(const Mask& mask, const Dispatch& dispatch, const std::vector<std::vector<bool>>& qo);

}  // namespace magi::dist
