#include "cpu/plan.hpp"

#include <algorithm>
#include <memory>
#include <numeric>

#include "cpu/engine.hpp"

namespace magi::cpu {
namespace {

// Tile indices sorted by decreasing work; ties keep index order (the order never affects results).
std::vector<int32_t> heaviest_first(const tiling::TileLists& lists) {
  const int64_t tiles = lists.num_tiles();
  std::vector<int64_t> cells(static_cast<size_t>(tiles), 0);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t i = lists.offsets[t]; i < lists.offsets[t + 1]; ++i)
      cells[t] += int64_t{lists.items[i].q.size()} * lists.items[i].k.size();
  std::vector<int32_t> order(static_cast<size_t>(tiles));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return cells[a] > cells[b]; });
  return order;
}

}  // namespace

std::shared_ptr<const Plan> make_plan(const Mask& mask, int32_t heads_q, int32_t heads_kv, int32_t head_dim) {
  auto plan = std::make_shared<Plan>();
  plan->mask = mask;
  plan->heads_q = heads_q;
  plan->heads_kv = heads_kv;
  plan->head_dim = head_dim;
  plan->tiles = tile_config(head_dim);
  plan->by_q = tiling::by_q_tile(mask, plan->tiles.tile_q, plan->tiles.tile_k);
  plan->by_k = tiling::by_k_tile(mask, plan->tiles.tile_k, plan->tiles.tile_q);
  plan->q_tile_order = heaviest_first(plan->by_q);
  plan->k_tile_order = heaviest_first(plan->by_k);
  return plan;
}

}  // namespace magi::cpu
