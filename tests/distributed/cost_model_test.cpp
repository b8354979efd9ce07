// The distributed-attention cost model: tile accounting, limits where the prediction has a closed form,
// and orderings that must hold (overlap, bandwidth, bytes).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "cuda/sm80/tiles.hpp"
#include "distributed/cost_model.hpp"
#include "magi/error.hpp"
#include "magi/flops.hpp"
#include "reference/random_inputs.hpp"

namespace magi::dist {
namespace {

using test::fresh_seed;
constexpr double kInf = std::numeric_limits<double>::infinity();

int32_t uniform(std::mt19937_64& rng, int32_t lo, int32_t hi) {  // inclusive
  return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
}

// Full, causal, varlen full or varlen causal over `total` tokens with random document lengths.
Mask random_mask(std::mt19937_64& rng, int32_t total) {
  const int kind = uniform(rng, 0, 3);
  if (kind == 0) return masks::full(total, total);
  if (kind == 1) return masks::causal(total, total);
  std::vector<int32_t> cu{0};
  while (cu.back() < total) cu.push_back(std::min(total, cu.back() + uniform(rng, 1, total / 2 + 1)));
  return kind == 2 ? masks::varlen_full(cu) : masks::varlen_causal(cu);
}

// Communication and elementwise work free: only the kernels' tile work remains.
HardwareModel compute_only() {
  HardwareModel hw;
  hw.link_bytes_per_s = hw.inter_node_bytes_per_s = hw.hbm_bytes_per_s = kInf;
  hw.collective_latency_s = hw.launch_overhead_s = 0;
  hw.forward_blocks_in_flight = hw.backward_blocks_in_flight = 0;  // tile work only
  return hw;
}

DistConfig config_with(int32_t overlap, int32_t chunk = 256) {
  DistConfig c;
  c.chunk_size = chunk;
  c.overlap_degree = overlap;
  return c;
}

TEST(CostModel, FullMaskComputesExactlyItsAreaAtTileMultiples) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const HardwareModel hw;
  for (int trial = 0; trial < 20; ++trial) {
    const int32_t tq = 128 * uniform(rng, 1, 24), tk = 128 * uniform(rng, 1, 24);
    const Mask m = masks::full(tq, tk);
    EXPECT_EQ(forward_computed_cells(m, hw), m.area()) << "seed " << seed << " " << tq << "x" << tk;
    EXPECT_EQ(backward_computed_cells(m, hw), m.area()) << "seed " << seed << " " << tq << "x" << tk;
    // One row more: a whole extra row of 128 x 64 tiles (forward), 64-row chunks (backward).
    const Mask ragged = masks::full(tq + 1, tk);
    EXPECT_EQ(forward_computed_cells(ragged, hw), int64_t{tq + 128} * tk) << "seed " << seed;
    EXPECT_EQ(backward_computed_cells(ragged, hw), int64_t{tq + 64} * tk) << "seed " << seed;
  }
}

TEST(CostModel, CausalPaysForWholeDiagonalTiles) {
  const HardwareModel hw;
  for (int32_t n : {1, 3, 16, 40}) {
    const Mask m = masks::causal(128 * n, 128 * n);
    // q tile t visits k tiles 0 .. 2t + 1 (64 keys each).
    EXPECT_EQ(forward_computed_cells(m, hw), int64_t{n} * (n + 1) * 128 * 64) << n;
    EXPECT_GT(forward_computed_cells(m, hw), m.area()) << n;
  }
}

TEST(CostModel, ComputedCellsCoverTheArea) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const HardwareModel hw;
  for (int trial = 0; trial < 50; ++trial) {
    const Mask m = random_mask(rng, uniform(rng, 1, 3000));
    EXPECT_GE(forward_computed_cells(m, hw), m.area()) << "seed " << seed;
    EXPECT_GE(backward_computed_cells(m, hw), m.area()) << "seed " << seed;
  }
}

// With free communication the forward (whose fetches wait on nothing) takes exactly the slowest rank's
// tile work. The backward's reduces and the ring's shifts wait on compute and are collective, which
// couples the ranks stage by stage: at least the slowest rank's work, at most the sum over stages of the
// slowest rank's stage.
TEST(CostModel, FreeCommunicationLeavesTheSlowestRanksTileWork) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  HardwareModel hw = compute_only();
  hw.forward_tile_q = 64;  // exact tile cells: the planner's 128-or-64-row choice only applies at 128
  const HeadShape heads{8, 2, 64};
  const auto fwd_seconds = [&](int64_t cells) { return flops_forward(cells, heads.heads_q, heads.head_dim) / hw.forward_flops_per_s; };
  const auto bwd_seconds = [&](int64_t cells) { return flops_backward(cells, heads.heads_q, heads.head_dim) / hw.backward_flops_per_s; };
  for (int trial = 0; trial < 12; ++trial) {
    const int32_t cp = uniform(rng, 2, 4), overlap = uniform(rng, 0, 2);
    const Mask m = random_mask(rng, 2 * cp * 64 * uniform(rng, 4, 12));
    const Prediction dist = predict_distributed(m, heads, cp, config_with(overlap), hw);
    const Prediction ring = predict_ring(m, heads, cp, hw);
    for (const Prediction* p : {&dist, &ring}) {
      int64_t max_fwd = 0, max_bwd = 0, sum_bwd = 0;
      for (const RankCost& r : p->ranks)
        max_fwd = std::max(max_fwd, r.forward_cells), max_bwd = std::max(max_bwd, r.backward_cells), sum_bwd += r.backward_cells;
      ASSERT_GT(max_fwd, 0) << "seed " << seed;
      const double lower = bwd_seconds(max_bwd);
      EXPECT_GE(p->backward_s, lower * (1 - 1e-12)) << "seed " << seed << " cp " << cp << " overlap " << overlap;
      EXPECT_LE(p->backward_s, bwd_seconds(sum_bwd) * (1 + 1e-12)) << "seed " << seed << " cp " << cp;
      if (p == &dist)
        EXPECT_NEAR(p->forward_s, fwd_seconds(max_fwd), 1e-12 * fwd_seconds(max_fwd))
            << "seed " << seed << " cp " << cp << " overlap " << overlap;
    }
    // Ring forward: between the slowest rank's work and the sum over steps of the slowest rank's step.
    double steps = 0;
    int64_t max_fwd = 0;
    for (const RankCost& r : ring.ranks) max_fwd = std::max(max_fwd, r.forward_cells);
    for (int32_t s = 0; s < cp; ++s) {
      int64_t worst = 0;
      for (int32_t r = 0; r < cp; ++r)
        worst = std::max(worst, forward_computed_cells(zigzag_block_mask(m, cp, r, (r - s + cp) % cp), hw));
      steps += fwd_seconds(worst);
    }
    EXPECT_GE(ring.forward_s, fwd_seconds(max_fwd) * (1 - 1e-12)) << "seed " << seed << " cp " << cp;
    EXPECT_LE(ring.forward_s, steps * (1 + 1e-12)) << "seed " << seed << " cp " << cp;
  }
}

// The forward follows the CUDA planner: 128-row tiles, or 64-row tiles at their own rate when 128-row tiles
// would compute more than kSmallForwardTileGain times the cells.
TEST(CostModel, ForwardTileFollowsThePlanner) {
  const HardwareModel hw = compute_only();
  EXPECT_EQ(forward_effective_cells(masks::full(1024, 1024), hw), 1024.0 * 1024.0);
  std::vector<int32_t> cu{0};
  while (cu.back() < 4096) cu.push_back(cu.back() + 96);  // 96-token documents: 128-row tiles waste a lot
  const Mask docs = masks::varlen_causal(cu);
  HardwareModel small = hw;
  small.forward_tile_q = 64;
  const auto cells64 = static_cast<double>(forward_computed_cells(docs, small));
  ASSERT_GT(static_cast<double>(forward_computed_cells(docs, hw)), cuda::detail::kSmallForwardTileGain * cells64);
  EXPECT_DOUBLE_EQ(forward_effective_cells(docs, hw), cells64 / cuda::detail::kSmallForwardTileRate);
}

// cp=1 runs the whole mask as the host stage. The comm plan re-slices it per chunk, which can only add
// visited tiles (none for a full mask).
TEST(CostModel, OneRankPredictsTheSingleGpuKernel) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const HeadShape heads{16, 16, 128};
  HardwareModel hw = compute_only();
  for (int trial = 0; trial < 10; ++trial) {
    const int32_t total = uniform(rng, 1, 4096);
    const Mask full = masks::full(total, total);
    const DistConfig config = config_with(uniform(rng, 0, 2));
    const Prediction single = predict_single(full, heads, hw);
    const Prediction dist = predict_distributed(full, heads, 1, config, hw);
    EXPECT_DOUBLE_EQ(dist.forward_s, single.forward_s) << "seed " << seed << " total " << total;
    EXPECT_DOUBLE_EQ(dist.backward_s, single.backward_s) << "seed " << seed << " total " << total;
    EXPECT_EQ(dist.moved_kv_rows, 0) << "seed " << seed;
    const Mask m = random_mask(rng, total);
    EXPECT_GE(predict_distributed(m, heads, 1, config, hw).forward_s, predict_single(m, heads, hw).forward_s)
        << "seed " << seed;
  }
  // With every overhead at its default, cp=1 differs only by the accumulators' conversions (a few %).
  const Mask full = masks::full(16384, 16384);
  const Prediction single = predict_single(full, heads, HardwareModel{});
  const Prediction dist = predict_distributed(full, heads, 1, config_with(1, 512), HardwareModel{});
  EXPECT_GT(dist.forward_s, single.forward_s);
  EXPECT_LT(dist.forward_s, 1.03 * single.forward_s);
  EXPECT_NEAR(single.forward_tflops_per_gpu, 322, 1.0);  // the calibration point
  EXPECT_NEAR(single.backward_tflops_per_gpu, 233, 233 * 0.03);
}

TEST(CostModel, FetchTimeIsLatencyPlusBytesOverBandwidth) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  HardwareModel hw;
  hw.link_bytes_per_s = 1e9 * uniform(rng, 10, 900);
  hw.collective_latency_s = 1e-6 * uniform(rng, 0, 50);
  const int32_t kv_heads = 1 << uniform(rng, 0, 3);
  const HeadShape heads{16, kv_heads, 128};
  const int32_t local = 512 * uniform(rng, 1, 8);
  // Full mask, cp=2, one remote stage: each rank fetches all of the other's kv (k and v, bf16).
  const Prediction p = predict_distributed(masks::full(2 * local, 2 * local), heads, 2, config_with(1, 512), hw);
  const double bytes = static_cast<double>(local) * kv_heads * 128 * 2 * 2;
  EXPECT_NEAR(p.comm_forward_s, hw.collective_latency_s + bytes / hw.link_bytes_per_s, 1e-15) << "seed " << seed;
  EXPECT_EQ(p.moved_kv_rows, 2 * local) << "seed " << seed;
  // More kv heads: more bytes, more comm time.
  const Prediction more = predict_distributed(masks::full(2 * local, 2 * local), HeadShape{16, 2 * kv_heads, 128}, 2,
                                              config_with(1, 512), hw);
  EXPECT_GT(more.comm_forward_s, p.comm_forward_s) << "seed " << seed;
  EXPECT_GT(more.comm_backward_s, p.comm_backward_s) << "seed " << seed;
  // The fp32 dk/dv wire doubles the reduce's bytes.
  DistConfig fp32 = config_with(1, 512);
  fp32.backward_high_precision_reduce = true;
  EXPECT_GT(predict_distributed(masks::full(2 * local, 2 * local), heads, 2, fp32, hw).comm_backward_s, p.comm_backward_s)
      << "seed " << seed;
}

TEST(CostModel, OverlapNeverPredictsSlowerThanNoOverlap) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const HeadShape heads{16, 16, 128};
  for (int trial = 0; trial < 12; ++trial) {
    HardwareModel hw;
    hw.link_bytes_per_s = 1e9 * uniform(rng, 5, 500);
    const int32_t cp = uniform(rng, 2, 4);
    const Mask m = random_mask(rng, cp * 512 * uniform(rng, 2, 6));
    const Prediction none = predict_distributed(m, heads, cp, config_with(0, 512), hw);
    const Prediction one = predict_distributed(m, heads, cp, config_with(1, 512), hw);
    ASSERT_GT(none.comm_forward_s, 0) << "seed " << seed;
    EXPECT_LE(one.forward_s, none.forward_s) << "seed " << seed << " cp " << cp;
    EXPECT_LE(one.backward_s, none.backward_s) << "seed " << seed << " cp " << cp;
  }
  // Where the fetch is long and the host stage has work, overlap hides it.
  HardwareModel slow;
  slow.link_bytes_per_s = 20e9;
  const Mask full = masks::full(8192, 8192);
  EXPECT_LT(predict_distributed(full, heads, 4, config_with(1, 512), slow).forward_s,
            predict_distributed(full, heads, 4, config_with(0, 512), slow).forward_s);
}

// Without concurrent comm and compute nothing is hidden: overlap degree 1 predicts what 0 does, and no
// schedule beats the concurrent one.
TEST(CostModel, SerialisedCommHidesNothing) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const HeadShape heads{16, 8, 128};
  HardwareModel serial;
  serial.comm_overlaps_compute = false;
  serial.link_bytes_per_s = 1e9 * uniform(rng, 20, 500);
  HardwareModel concurrent = serial;
  concurrent.comm_overlaps_compute = true;
  for (int trial = 0; trial < 8; ++trial) {
    const int32_t cp = uniform(rng, 2, 4);
    const Mask m = random_mask(rng, 2 * cp * 512 * uniform(rng, 1, 4));
    const Prediction none = predict_distributed(m, heads, cp, config_with(0, 512), serial);
    const Prediction one = predict_distributed(m, heads, cp, config_with(1, 512), serial);
    EXPECT_NEAR(one.forward_s, none.forward_s, 1e-12 * none.forward_s) << "seed " << seed << " cp " << cp;
    for (int32_t overlap : {0, 1, 2}) {
      const Prediction s = predict_distributed(m, heads, cp, config_with(overlap, 512), serial);
      const Prediction c = predict_distributed(m, heads, cp, config_with(overlap, 512), concurrent);
      EXPECT_GE(s.forward_s, c.forward_s) << "seed " << seed << " overlap " << overlap;
      EXPECT_GE(s.backward_s, c.backward_s) << "seed " << seed << " overlap " << overlap;
    }
    EXPECT_GE(predict_ring(m, heads, cp, serial).backward_s, predict_ring(m, heads, cp, concurrent).backward_s)
        << "seed " << seed;
  }
}

TEST(CostModel, SlowerLinksNeverPredictFaster) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const HeadShape heads{8, 8, 64};
  for (int trial = 0; trial < 10; ++trial) {
    const int32_t cp = 2 * uniform(rng, 1, 2), overlap = uniform(rng, 0, 2);
    const Mask m = random_mask(rng, cp * 256 * uniform(rng, 2, 8));
    HardwareModel fast, slow;
    fast.link_bytes_per_s = 1e9 * uniform(rng, 100, 900);
    slow.link_bytes_per_s = fast.link_bytes_per_s / 4;
    for (bool ring : {false, true}) {
      const Prediction f = ring ? predict_ring(m, heads, cp, fast) : predict_distributed(m, heads, cp, config_with(overlap), fast);
      const Prediction s = ring ? predict_ring(m, heads, cp, slow) : predict_distributed(m, heads, cp, config_with(overlap), slow);
      EXPECT_GE(s.forward_s, f.forward_s) << "seed " << seed << " ring " << ring;
      EXPECT_GE(s.backward_s, f.backward_s) << "seed " << seed << " ring " << ring;
    }
    // Hierarchical comm: hop 1 runs at the inter-node bandwidth, which flat comm never uses.
    DistConfig hier = config_with(overlap);
    hier.hierarchical_comm = true;
    hier.ranks_per_node = 2;
    HardwareModel slow_inter = fast;
    slow_inter.inter_node_bytes_per_s = fast.link_bytes_per_s / 10;
    EXPECT_GE(predict_distributed(m, heads, cp, hier, slow_inter).forward_s,
              predict_distributed(m, heads, cp, hier, fast).forward_s) << "seed " << seed;
    EXPECT_EQ(predict_distributed(m, heads, cp, config_with(overlap), slow_inter).forward_s,
              predict_distributed(m, heads, cp, config_with(overlap), fast).forward_s) << "seed " << seed;
  }
}

TEST(CostModel, RingMovesEveryKvBlockToEveryOtherRank) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const HeadShape heads{4, 2, 64};
  const HardwareModel hw;
  for (int32_t cp : {1, 2, 3, 4, 8}) {
    const int32_t local = 2 * 64 * uniform(rng, 1, 8);
    const Mask m = random_mask(rng, cp * local);
    const Prediction ring = predict_ring(m, heads, cp, hw);
    EXPECT_EQ(ring.moved_kv_rows, int64_t{cp} * (cp - 1) * local) << "seed " << seed << " cp " << cp;
    const double shift = hw.collective_latency_s + static_cast<double>(local) * 2 * 64 * 2 * 2 / hw.link_bytes_per_s;
    EXPECT_NEAR(ring.comm_forward_s, (cp - 1) * shift, 1e-15) << "seed " << seed << " cp " << cp;
  }
  // A full mask needs every kv row everywhere: magi-attn moves as much as the ring.
  const Mask full = masks::full(8192, 8192);
  EXPECT_EQ(predict_distributed(full, heads, 4, config_with(1, 512), hw).moved_kv_rows,
            predict_ring(full, heads, 4, hw).moved_kv_rows);
}

TEST(CostModel, ZigzagBlocksTileTheMaskOnce) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 20; ++trial) {
    const int32_t cp = uniform(rng, 1, 5);
    const Mask m = random_mask(rng, 2 * cp * uniform(rng, 1, 40));
    int64_t total = 0;
    for (int32_t q = 0; q < cp; ++q)
      for (int32_t k = 0; k < cp; ++k) total += zigzag_block_mask(m, cp, q, k).area();
    EXPECT_EQ(total, m.area()) << "seed " << seed << " cp " << cp;
  }
}

TEST(CostModel, RejectsBadInputsNamingThem) {
  const HeadShape heads{4, 4, 64};
  const Mask m = masks::causal(1024, 1024);
  HardwareModel hw;
  hw.forward_flops_per_s = 0;
  try {
    predict_single(m, heads, hw);
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("forward_flops_per_s"), std::string::npos) << e.what();
  }
  HardwareModel negative;
  negative.collective_latency_s = -1;
  EXPECT_THROW(predict_distributed(m, heads, 2, config_with(1), negative), InvalidArgument);
  EXPECT_THROW(predict_distributed(m, heads, 0, config_with(1), HardwareModel{}), InvalidArgument);
  EXPECT_THROW(predict_ring(masks::causal(1000, 1000), heads, 3, HardwareModel{}), InvalidArgument);
  DistConfig hier = config_with(1);
  hier.hierarchical_comm = true;
  hier.ranks_per_node = 3;
  EXPECT_THROW(predict_distributed(m, heads, 4, hier, HardwareModel{}), InvalidArgument);
}

}  // namespace
}  // namespace magi::dist
