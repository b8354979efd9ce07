// Planning cost, balance and communication of context-parallel plans for SPEC section 7's distributed
// cases at full size (no MPI needed: plans are pure host code).
// Counters: max_area_over_bound (max per-rank area / max(total / cp, largest chunk)) for the greedy
// baseline and the greedy + swap solver, the latter also over Dispatch::count_aware_lower_bound, and kv_rows_over_ring (rows fetched / rows ring attention moves).
// dist_routes/*: the route solver (qo_plan.hpp) on document masks at cp 4-32, 16 heads of D 128 (MHA, and GQA 16/4):
// bytes moved forward + backward (2-byte inputs) by kv-only plans, ring attention, and the q/out route per rank pair
// and per kv head group, and the largest rank area against kv-only's.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "../common/long_tailed_documents.hpp"
#include "distributed/comm_plan.hpp"
#include "distributed/dispatch.hpp"
#include "distributed/qo_plan.hpp"
#include "magi/mask.hpp"

namespace {

using magi::Mask;
using magi::MaskType;
using magi::Slice;

std::vector<int32_t> cu_seqlens(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> cu{0};
  for (int32_t len : lengths) cu.push_back(cu.back() + len);
  return cu;
}

// Document lengths with a long tail (fixed seed: the same masks every run).
std::vector<int32_t> documents(int32_t total, int32_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> tail(0.0, 1.0);
  std::vector<double> w(static_cast<size_t>(count));
  double sum = 0;
  for (auto& x : w) sum += (x = tail(rng));
  std::vector<int32_t> lengths;
  int32_t used = 0;
  for (int32_t i = 0; i < count; ++i) {
    const int32_t len = i + 1 == count ? total - used : std::max(1, static_cast<int32_t>(w[i] / sum * total));
    lengths.push_back(len);
    used += len;
  }
  return lengths;
}

Slice slice(int32_t qs, int32_t qe, int32_t ks, int32_t ke, MaskType t) { return Slice{{qs, qe}, {ks, ke}, t}; }

struct Case {
  std::string name;
  Mask mask;
  int32_t chunk_size;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  out.push_back({"full_14k", magi::masks::full(14336, 14336), 512});
  out.push_back({"varlen_full_12k", magi::masks::varlen_full(cu_seqlens(documents(12288, 10, 1))), 512});
  out.push_back({"varlen_block_causal_15k",
                 magi::masks::varlen_block_causal(cu_seqlens(documents(15360, 6, 2)), 1024), 512});
  {
    Mask m{{}, 12288, 12288};  // q-overlap: every q block reads a full prefix part and a causal part
    for (int32_t b = 0; b < 12; ++b) {
      const int32_t qs = b * 1024, qe = qs + 1024;
      if (qs > 0) m.slices.push_back(slice(qs, qe, 0, qs / 2, MaskType::Full));
      m.slices.push_back(slice(qs, qe, qs / 2, qe, MaskType::Causal));
    }
    out.push_back({"q_overlap_12k", m, 512});
  }
  {
    Mask m{{}, 10240, 10240};  // mixed types
    m.slices = {slice(0, 2560, 0, 2560, MaskType::Causal), slice(2560, 5120, 0, 2560, MaskType::Full),
                slice(2560, 5120, 2560, 5120, MaskType::InvCausal), slice(5120, 7680, 1024, 6144, MaskType::BiCausal),
                slice(7680, 10240, 0, 10240, MaskType::Causal)};
    out.push_back({"mixed_types_10k", m, 512});
  }
  {
    Mask m{{}, 8192, 8192};  // 128 small slices forming a full mask
    for (int32_t i = 0; i < 16; ++i)
      for (int32_t j = 0; j < 8; ++j) m.slices.push_back(slice(i * 512, i * 512 + 512, j * 1024, j * 1024 + 1024, MaskType::Full));
    out.push_back({"128_slices_full_8k", m, 512});
  }
  for (int32_t chunk : {1111, 253, 63}) {
    out.push_back({"uneven_varlen_causal_10k_chunk" + std::to_string(chunk),
                   magi::masks::varlen_causal(cu_seqlens(documents(10000, 7, 3))), chunk});
    out.push_back({"uneven_causal_11k_chunk" + std::to_string(chunk), magi::masks::causal(11000, 11000), chunk});
  }
  return out;
}

void plan_case(benchmark::State& state, const Case& c) {
  const auto cp = static_cast<int32_t>(state.range(0));
  for (auto _ : state) {
    const auto d = magi::dist::make_dispatch(c.mask, cp, c.chunk_size, magi::dist::DispatchAlgorithm::GreedySwap);
    const auto plan = magi::dist::make_comm_plan(c.mask, d, 2);
    benchmark::DoNotOptimize(plan.ranks.data());
  }
  const auto greedy = magi::dist::make_dispatch(c.mask, cp, c.chunk_size, magi::dist::DispatchAlgorithm::Greedy);
  const auto swap = magi::dist::make_dispatch(c.mask, cp, c.chunk_size, magi::dist::DispatchAlgorithm::GreedySwap);
  const auto plan = magi::dist::make_comm_plan(c.mask, swap, 2);
  int64_t fetched = 0;
  for (const auto& rp : plan.ranks) fetched += rp.fetched_rows();
  const double ring = static_cast<double>(cp) * (cp - 1) * swap.k.local_tokens();
  state.counters["greedy_max_area_over_bound"] = static_cast<double>(greedy.max_rank_area()) / greedy.lower_bound();
  state.counters["swap_max_area_over_bound"] = static_cast<double>(swap.max_rank_area()) / swap.lower_bound();
  state.counters["swap_over_count_aware_bound"] =
      static_cast<double>(swap.max_rank_area()) / swap.count_aware_lower_bound();
  state.counters["kv_rows_over_ring"] = ring > 0 ? fetched / ring : 0.0;
  const auto local = magi::dist::make_dispatch(c.mask, cp, c.chunk_size, magi::dist::DispatchAlgorithm::Locality);
  const auto local_plan = magi::dist::make_comm_plan(c.mask, local, 2);
  int64_t local_fetched = 0;
  for (const auto& rp : local_plan.ranks) local_fetched += rp.fetched_rows();
  state.counters["locality_max_area_over_bound"] = static_cast<double>(local.max_rank_area()) / local.lower_bound();
  state.counters["locality_kv_rows_over_ring"] = ring > 0 ? local_fetched / ring : 0.0;
}

void routes_case(benchmark::State& state, const Mask& mask, magi::dist::HeadShape heads) {
  using magi::dist::RouteOptions;
  const auto cp = static_cast<int32_t>(state.range(0));
  const auto d = magi::dist::make_dispatch(mask, cp, 512, magi::dist::DispatchAlgorithm::Locality);
  magi::dist::RouteSolution whole, flat;
  for (auto _ : state) {
    whole = magi::dist::solve_routes(mask, d, heads, RouteOptions{.qo_comm = true});
    flat = magi::dist::solve_routes(mask, d, heads, RouteOptions{.qo_comm = true, .flatten_head_groups = true});
  }
  const auto max_of = [](const std::vector<int64_t>& v) { return static_cast<double>(*std::max_element(v.begin(), v.end())); };
  // Ring attention moves every rank's k/v to every other rank forward, again backward, and partial dk/dv back.
  const double ring = static_cast<double>(cp) * (cp - 1) * d.k.local_tokens() * heads.heads_kv * heads.head_dim * 2 * 6;
  state.counters["kv_only_MiB"] = whole.kv_only_bytes / 1048576.0;
  state.counters["kv_only_over_ring"] = whole.kv_only_bytes / ring;
  state.counters["qo_over_kv_only"] = static_cast<double>(whole.bytes) / whole.kv_only_bytes;
  state.counters["qo_flat_over_kv_only"] = static_cast<double>(flat.bytes) / flat.kv_only_bytes;
  state.counters["qo_flat_max_area_over_kv_only"] = max_of(flat.rank_area) / max_of(d.rank_area);
  // Each head class costs the device runtime its own exchanges and kernel launches.
  state.counters["qo_flat_head_classes"] = static_cast<double>(magi::dist::head_classes(flat, heads.heads_kv).size());
}

const bool registered = [] {
  for (const auto& [name, mask] : {std::pair{std::string("varlen_causal_64k"),
                                             magi::masks::varlen_causal(magi::bench::long_tailed_cu_seqlens(65536, 7))},
                                   std::pair{std::string("varlen_full_64k"),
                                             magi::masks::varlen_full(magi::bench::long_tailed_cu_seqlens(65536, 7))},
                                   std::pair{std::string("one_document_causal_64k"), magi::masks::causal(65536, 65536)}})
    for (const auto& [heads_name, heads] : {std::pair{"mha16", magi::dist::HeadShape{16, 16, 128}},
                                            std::pair{"gqa16_4", magi::dist::HeadShape{16, 4, 128}}})
      benchmark::RegisterBenchmark(("dist_routes/" + name + "/" + heads_name).c_str(),
                                   [mask, heads](benchmark::State& s) { routes_case(s, mask, heads); })
          ->Arg(4)
          ->Arg(8)
          ->Arg(16)
          ->Arg(32)
          ->Iterations(1)
          ->Unit(benchmark::kMillisecond);
  for (const Case& c : cases())
    benchmark::RegisterBenchmark(("dist_plan/" + c.name).c_str(), [c](benchmark::State& s) { plan_case(s, c); })
        ->Arg(2)
        ->Arg(4)
        ->Arg(8)
        ->Unit(benchmark::kMillisecond);
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
