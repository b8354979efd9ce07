// `magi-attn dist-run`: `run`'s file contract under mpirun. Rank 0 reads the global inputs, every rank
// computes its share with magi::dist (dispatch, calc_attn, backward), rank 0 gathers and writes the
// global outputs. Any error: one line from rank 0, exit 2 on every rank, nothing written.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/dist_support.hpp"
#include "cli/options.hpp"
#include "cli/run_files.hpp"
#include "magi/dist.hpp"
#include "magi/env.hpp"
#include "magi/error.hpp"

namespace magi::cli {
namespace {

// What every rank needs to know about rank 0's inputs.
struct Problem {
  Mask mask;
  DType dtype = DType::F32;
  dist::HeadShape heads;
  int64_t sink_len = 0;  // S; 0 = no sink
  bool has_dout = false;
};

std::vector<std::byte> encode(const Problem& p) {
  const nlohmann::json j = {{"mask", mask_to_json(p.mask)},
                            {"dtype", static_cast<int>(p.dtype)},
                            {"heads", {p.heads.heads_q, p.heads.heads_kv, p.heads.head_dim}},
                            {"sink_len", p.sink_len},
                            {"has_dout", p.has_dout}};
  const std::string text = j.dump();
  std::vector<std::byte> bytes(text.size());
  std::memcpy(bytes.data(), text.data(), text.size());
  return bytes;
}

Problem decode(const std::vector<std::byte>& bytes) {
  const auto j = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  Problem p;
  p.mask = mask_from_json(j.at("mask").get<std::string>());
  p.dtype = static_cast<DType>(j.at("dtype").get<int>());
  p.heads = {j.at("heads")[0].get<int32_t>(), j.at("heads")[1].get<int32_t>(), j.at("heads")[2].get<int32_t>()};
  p.sink_len = j.at("sink_len").get<int64_t>();
  p.has_dout = j.at("has_dout").get<bool>();
  return p;
}

double milliseconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

int dist_run(DistWorld& world, std::span<const std::string> args) {
  std::vector<OptionSpec> specs = run_file_options();
  for (OptionSpec& spec : specs)
    if (spec.name == "threads")
      spec.help = "CPU threads per rank (default: OMP_NUM_THREADS, else the node's cores / its ranks)";
  for (OptionSpec& spec : dist_option_specs()) specs.push_back(std::move(spec));
  Options options(
      "dist-run",
      "mpirun -np CP magi-attn dist-run --mask MASK.json --q q.npy --k k.npy --v v.npy [--do do.npy]\n"
      "                     [--sink sink.npy --sink-layout sh|ssh] [--dtype bf16|fp16|fp32|fp64]\n"
      "                     [--softmax-scale X] [--softcap X] [--backend auto|cpu|reference] [--threads N]\n"
      "                     [--chunk-size N] [--overlap-degree N] [--dispatch greedy|greedy_swap|locality]\n"
      "                     [--hierarchical [--ranks-per-node N]] [--comm-timeout S] --out-dir DIR",
      std::string("`run` distributed over the ranks of mpirun (context parallelism): rank 0 reads the inputs\n"
                  "and writes the outputs, every rank computes its share. Prints the plan: per-rank mask area\n"
                  "against the lower bound, and kv bytes moved against ring attention. Inputs are .npy (float32\n"
                  "or float64): ") +
          kRunFilesDescription,
      std::move(specs));

  RunSettings settings;
  dist::DistConfig config;
  world.agree([&] {
    options.parse(args);
    if (options.help_requested()) return;
    env::ensure_validated();
    settings = parse_run_settings(options);
    settings.attention.num_threads = world.threads_per_rank(settings.attention.num_threads);
    config = parse_dist_config(options, settings.attention);
  });
  if (options.help_requested()) {
    if (world.root()) std::cout << options.help_text();
    return 0;
  }

  // ---- rank 0 reads; the others learn the mask and shapes ----
  RunInputs in;
  std::vector<std::byte> header;
  world.agree([&] {
    if (!world.root()) return;
    in = load_run_inputs(options, settings);
    Problem p;
    p.mask = in.mask;
    p.dtype = in.dtype;
    p.heads = {static_cast<int32_t>(in.q.shape()[1]), static_cast<int32_t>(in.k.shape()[1]),
               static_cast<int32_t>(in.q.shape()[2])};
    p.sink_len = !in.has_sink() ? 0 : settings.attention.sink_layout == SinkLayout::SH ? in.sink.shape()[0]
                                                                                       : in.sink.shape()[1];
    p.has_dout = in.has_dout();
    header = encode(p);
  });
  const Problem p = decode(world.broadcast(std::move(header)));
  const int64_t tq = p.mask.total_q, tk = p.mask.total_k, hq = p.heads.heads_q, hkv = p.heads.heads_kv,
                d = p.heads.head_dim, s = p.sink_len;
  const SinkLayout layout = settings.attention.sink_layout;
  const DType wide = wide_dtype(p.dtype);

  dist::RuntimeKey key;
  world.agree([&] {
    check_chunk_size(config, tq, tk);
    key = dist::make_runtime_key(p.mask, p.heads, world.comm_ptr(), config);
  });

  // ---- every rank computes its share ----
  const bool root = world.root();
  HostTensor out_g, lse_g, dq_g, dk_g, dv_g, dsink_g;  // rank 0
  double fwd_ms = 0.0, bwd_ms = 0.0;
  world.agree([&] {
    const Shards q_rows(key, dist::Axis::Q, world.comm(), tq), k_rows(key, dist::Axis::K, world.comm(), tk);
    const int64_t lq = q_rows.local_rows(), lk = k_rows.local_rows();
    HostTensor q(p.dtype, {lq, hq, d}), k(p.dtype, {lk, hkv, d}), v(p.dtype, {lk, hkv, d});
    q_rows.scatter(root ? &in.q : nullptr, q);
    k_rows.scatter(root ? &in.k : nullptr, k);
    k_rows.scatter(root ? &in.v : nullptr, v);
    HostTensor sink, dsink;
    if (layout == SinkLayout::SH) {  // the same on every rank
      sink = HostTensor(DType::F32, {s, hq});
      std::vector<std::byte> bytes;
      if (root) {
        const TensorView all = in.sink.view();
        const auto* first = static_cast<const std::byte*>(all.data);
        bytes.assign(first, first + all.nbytes());
      }
      bytes = world.broadcast(std::move(bytes));
      std::memcpy(sink.view().data, bytes.data(), bytes.size());
    } else if (layout == SinkLayout::SSH) {
      sink = HostTensor(DType::F32, {lq, s, hq});
      q_rows.scatter(root ? &in.sink : nullptr, sink);
    }
    HostTensor out(wide, {lq, hq, d}), lse(wide, {lq, hq});
    world.comm().barrier();  // time the computation, not the scatter's stragglers
    const auto fwd_start = std::chrono::steady_clock::now();
    ForwardArgs fa;
    fa.q = q.view(), fa.k = k.view(), fa.v = v.view(), fa.sink = sink.view();
    fa.out = out.view(), fa.lse = lse.view();
    dist::calc_attn(key, fa);
    fwd_ms = milliseconds_since(fwd_start);
    if (root) {
      out_g = HostTensor(wide, {tq, hq, d});
      lse_g = HostTensor(wide, {tq, hq});
    }
    q_rows.gather(out, root ? &out_g : nullptr);
    q_rows.gather(lse, root ? &lse_g : nullptr);
    if (!p.has_dout) return;

    HostTensor dout(wide, {lq, hq, d}), dq(wide, {lq, hq, d}), dk(wide, {lk, hkv, d}), dv(wide, {lk, hkv, d});
    q_rows.scatter(root ? &in.dout : nullptr, dout);
    if (layout != SinkLayout::None) dsink = HostTensor(DType::F32, sink.shape());
    world.comm().barrier();
    const auto bwd_start = std::chrono::steady_clock::now();
    dist::calc_attn_backward(key, {q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), sink.view(),
                                   dq.view(), dk.view(), dv.view(), dsink.view()});
    bwd_ms = milliseconds_since(bwd_start);
    if (root) {
      dq_g = HostTensor(wide, {tq, hq, d});
      dk_g = HostTensor(wide, {tk, hkv, d});
      dv_g = HostTensor(wide, {tk, hkv, d});
    }
    q_rows.gather(dq, root ? &dq_g : nullptr);
    k_rows.gather(dk, root ? &dk_g : nullptr);
    k_rows.gather(dv, root ? &dv_g : nullptr);
    if (layout == SinkLayout::SH && root) dsink_g = dsink;  // summed over ranks by the runtime (config)
    if (layout == SinkLayout::SSH) {
      if (root) dsink_g = HostTensor(DType::F32, {tq, s, hq});
      q_rows.gather(dsink, root ? &dsink_g : nullptr);
    }
  });
  fwd_ms = world.max_over_ranks(fwd_ms);
  bwd_ms = world.max_over_ranks(bwd_ms);
  const dist::PlanSummary plan = key.summary();

  // ---- rank 0 writes (an error there still stops every rank with exit 2) ----
  OutputFiles files;
  world.agree([&] {
    if (!root) return;
    files.emplace_back("out.npy", as_fp32_npy(out_g));
    files.emplace_back("lse.npy", as_fp32_npy(lse_g));
    if (p.has_dout) {
      files.emplace_back("dq.npy", as_fp32_npy(dq_g));
      files.emplace_back("dk.npy", as_fp32_npy(dk_g));
      files.emplace_back("dv.npy", as_fp32_npy(dv_g));
      if (layout != SinkLayout::None) files.emplace_back("dsink.npy", as_fp32_npy(dsink_g));
    }
    write_outputs(settings.out_dir, files);
  });
  if (!root) return 0;
  std::ostringstream summary;
  char times[128];
  std::snprintf(times, sizeof times, "forward %.3f ms", fwd_ms);
  summary << "magi-attn dist-run: cp " << world.size() << " (" << world.comm().describe() << "), "
          << p.mask.slices.size() << " slices"
          << (plan.planned_slices != static_cast<int64_t>(p.mask.slices.size())
                  ? " (" + std::to_string(plan.planned_slices) + " after range merge)"
                  : "")
          << ", area " << p.mask.area() << ", " << to_string(p.dtype) << " on "
          << to_string(resolve_backend(settings.attention, Device{})) << "; " << times;
  if (p.has_dout) {
    std::snprintf(times, sizeof times, ", backward %.3f ms", bwd_ms);
    summary << times;
  }
  summary << " (slowest rank); wrote";
  for (const auto& file : files) summary << ' ' << file.first;
  summary << " to " << settings.out_dir.string() << "\n";
  std::istringstream plan_lines(plan_text(plan, p.dtype));
  summary << "plan:\n";
  for (std::string line; std::getline(plan_lines, line);) summary << "  " << line << "\n";
  std::cout << summary.str() << std::flush;
  return 0;
}

}  // namespace

int dist_run_command(std::span<const std::string> args) {
  DistWorld world(bootstrap_timeout(args));
  return run_on_every_rank(world, [&] { return dist_run(world, args); });
}

}  // namespace magi::cli
