// Predicted TFLOP/s per GPU of distributed attention (src/distributed/cost_model.hpp) for the masks and sizes
// that dist_attn_gpu_bench (gpu_dist_attn_throughput.cpp) measures, including cp values no lent machine
// has: magi-attn, the single-GPU kernel on one GPU's share, and the zigzag ring baseline. Prints a
// markdown table. Every calibration input is a flag (defaults: H200, bf16, D 128, docs/performance.md).
//   dist_cost_model [--tokens-per-gpu 16384] [--heads 16] [--kv-heads 16] [--head-dim 128] [--chunk-size 512]
//                   [--overlap 1] [--cps 1,2,4,8] [--hierarchical 2x4|none] [--fwd-tflops 322] [--bwd-tflops 233]
//                   [--link-gbps 350] [--inter-node-gbps 350] [--latency-us 20] [--launch-us 10]
//                   [--blocks-in-flight 264,132]
//                   [--hbm-gbps 4000] [--comm-overlaps-compute 1|0] [--wire bf16|fp32] [--fwd-tile 128x64] [--bwd-tile 128x64]
#include <cstdio>
#include <stdexcept>
#include <tuple>
#include <string>
#include <vector>

#include "distributed/cost_model.hpp"
#include "common/arguments.hpp"
#include "common/long_tailed_documents.hpp"
#include "magi/error.hpp"

namespace {

struct Options {
  int32_t tokens_per_gpu = 16384;
  int32_t heads = 16, kv_heads = 16, head_dim = 128;
  int32_t chunk_size = 512, overlap = 1;
  std::vector<int32_t> cps{1, 2, 4, 8};
  int32_t nodes = 2, ranks_per_node = 4;  // hierarchical row; nodes = 0: none
  bool fp32_wire = false;
  magi::dist::HardwareModel hw;
};


std::pair<int32_t, int32_t> parse_pair(const std::string& text, const std::string& flag) {
  const size_t x = text.find('x');
  if (x == std::string::npos) throw std::invalid_argument(flag + " takes AxB, got " + text);
  return {std::stoi(text.substr(0, x)), std::stoi(text.substr(x + 1))};
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const std::string value = argv[i + 1];
    if (flag == "--tokens-per-gpu") o.tokens_per_gpu = std::stoi(value);
    else if (flag == "--heads") o.heads = std::stoi(value);
    else if (flag == "--kv-heads") o.kv_heads = std::stoi(value);
    else if (flag == "--head-dim") o.head_dim = std::stoi(value);
    else if (flag == "--chunk-size") o.chunk_size = std::stoi(value);
    else if (flag == "--overlap") o.overlap = std::stoi(value);
    else if (flag == "--cps") o.cps = magi::bench::parse_int_list(value);
    else if (flag == "--hierarchical") {
      if (value == "none") o.nodes = 0;
      else std::tie(o.nodes, o.ranks_per_node) = parse_pair(value, flag);
    } else if (flag == "--fwd-tflops") o.hw.forward_flops_per_s = std::stod(value) * 1e12;
    else if (flag == "--bwd-tflops") o.hw.backward_flops_per_s = std::stod(value) * 1e12;
    else if (flag == "--link-gbps") o.hw.link_bytes_per_s = std::stod(value) * 1e9;
    else if (flag == "--inter-node-gbps") o.hw.inter_node_bytes_per_s = std::stod(value) * 1e9;
    else if (flag == "--latency-us") o.hw.collective_latency_s = std::stod(value) * 1e-6;
    else if (flag == "--launch-us") o.hw.launch_overhead_s = std::stod(value) * 1e-6;
    else if (flag == "--blocks-in-flight") {  // forward,backward (0,0 = no heaviest-block bound)
      const auto comma = value.find(',');
      o.hw.forward_blocks_in_flight = std::stoi(value.substr(0, comma));
      o.hw.backward_blocks_in_flight = comma == std::string::npos ? o.hw.forward_blocks_in_flight : std::stoi(value.substr(comma + 1));
    }
    else if (flag == "--hbm-gbps") o.hw.hbm_bytes_per_s = std::stod(value) * 1e9;
    else if (flag == "--comm-overlaps-compute") o.hw.comm_overlaps_compute = value != "0";
    else if (flag == "--wire") {
      if (value != "bf16" && value != "fp32") throw std::invalid_argument("--wire takes bf16 or fp32, got " + value);
      o.fp32_wire = value == "fp32";
    } else if (flag == "--fwd-tile") std::tie(o.hw.forward_tile_q, o.hw.forward_tile_k) = parse_pair(value, flag);
    else if (flag == "--bwd-tile") std::tie(o.hw.backward_tile_k, o.hw.backward_tile_q) = parse_pair(value, flag);
    else
      throw std::invalid_argument("unknown option " + flag +
                                  " (allowed: --tokens-per-gpu --heads --kv-heads --head-dim --chunk-size --overlap "
                                  "--cps --hierarchical --fwd-tflops --bwd-tflops --link-gbps --inter-node-gbps "
                                  "--latency-us --launch-us --blocks-in-flight --hbm-gbps --comm-overlaps-compute --wire --fwd-tile --bwd-tile)");
  }
  return o;
}

int run(const Options& o) {
  using namespace magi::dist;
  const HeadShape heads{o.heads, o.kv_heads, o.head_dim};
  const HardwareModel& hw = o.hw;
  std::printf("cost model: %d tokens per GPU, heads %d/%d, D %d, chunk %d, overlap degree %d, %s dk/dv wire; "
              "fwd %.0f / bwd %.0f TFLOP/s dense, link %.0f GB/s, inter-node %.0f GB/s, latency %.0f us, "
              "launch %.0f us, HBM %.0f GB/s, comm %s compute, tiles fwd %dx%d bwd %dx%d (k x q)\n",
              o.tokens_per_gpu, o.heads, o.kv_heads, o.head_dim, o.chunk_size, o.overlap, o.fp32_wire ? "fp32" : "bf16",
              hw.forward_flops_per_s / 1e12, hw.backward_flops_per_s / 1e12, hw.link_bytes_per_s / 1e9,
              hw.inter_node_bytes_per_s / 1e9, hw.collective_latency_s * 1e6, hw.launch_overhead_s * 1e6,
              hw.hbm_bytes_per_s / 1e9, hw.comm_overlaps_compute ? "overlaps" : "serialised with", hw.forward_tile_q, hw.forward_tile_k, hw.backward_tile_k, hw.backward_tile_q);
  std::printf("| mask | cp | dist fwd | dist bwd | single fwd | single bwd | ring fwd | ring bwd | fwd vs single | "
              "bwd vs single | fwd+bwd vs ring | imbalance | kv rows vs ring | fwd ms | bwd ms |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  struct Layout {
    int32_t cp, ranks_per_node;
  };
  std::vector<Layout> layouts;
  for (int32_t cp : o.cps) layouts.push_back({cp, 0});
  if (o.nodes > 0) layouts.push_back({o.nodes * o.ranks_per_node, o.ranks_per_node});
  for (const std::string kind : {"full", "causal", "varlen_full", "varlen_causal"}) {
    const Prediction single = predict_single(magi::bench::distributed_bench_mask(kind, o.tokens_per_gpu), heads, hw);
    for (const Layout& layout : layouts) {
      const magi::Mask mask = magi::bench::distributed_bench_mask(kind, o.tokens_per_gpu * layout.cp);
      DistConfig config;
      config.chunk_size = o.chunk_size;
      config.overlap_degree = o.overlap;
      config.backward_high_precision_reduce = o.fp32_wire;
      config.hierarchical_comm = layout.ranks_per_node > 0;
      config.ranks_per_node = layout.ranks_per_node;
      const Prediction dist = predict_distributed(mask, heads, layout.cp, config, hw);
      const Prediction ring = predict_ring(mask, heads, layout.cp, hw);
      const std::string cp_name = layout.ranks_per_node > 0
                                      ? std::to_string(layout.cp / layout.ranks_per_node) + "x" +
                                            std::to_string(layout.ranks_per_node) + " (hier.)"
                                      : std::to_string(layout.cp);
      std::printf("| %s | %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f%% | %.0f%% | %.2fx | %.3f | %.2f | %.2f | %.2f |\n",
                  kind.c_str(), cp_name.c_str(), dist.forward_tflops_per_gpu, dist.backward_tflops_per_gpu,
                  single.forward_tflops_per_gpu, single.backward_tflops_per_gpu, ring.forward_tflops_per_gpu,
                  ring.backward_tflops_per_gpu, 100 * dist.forward_tflops_per_gpu / single.forward_tflops_per_gpu,
                  100 * dist.backward_tflops_per_gpu / single.backward_tflops_per_gpu,
                  (ring.forward_s + ring.backward_s) / (dist.forward_s + dist.backward_s), dist.imbalance,
                  ring.moved_kv_rows > 0 ? static_cast<double>(dist.moved_kv_rows) / ring.moved_kv_rows : 0.0,
                  dist.forward_s * 1e3, dist.backward_s * 1e3);
      std::fflush(stdout);
    }
  }
  std::printf("Predicted TFLOP/s per GPU = FLOPs / (slowest rank's time x cp); single = the single-GPU kernel on "
              "%d tokens; ring = zigzag ring attention through the same kernel; imbalance = max / mean computed "
              "tile cells over ranks; kv rows vs ring = rows fetched / cp (cp - 1) local kv.\n",
              o.tokens_per_gpu);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dist_cost_model: %s\n", e.what());
    return 2;
  }
}
