// `magi-attn dist-demo`: the packed-documents job of `demo`, distributed over the ranks of mpirun.
// Rank 0 draws the documents and inputs; every rank runs dispatch, forward and backward on its share;
// rank 0 gathers the results and checks them against one device computing the whole problem.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include <omp.h>

#include "cli/accuracy.hpp"
#include "cli/commands.hpp"
#include "cli/dist_support.hpp"
#include "cli/documents.hpp"
#include "cli/host_tensor.hpp"
#include "cli/options.hpp"
#include "cli/progress.hpp"
#include "cli/run_files.hpp"
#include "magi/attention.hpp"
#include "magi/dist.hpp"
#include "magi/env.hpp"
#include "magi/error.hpp"
#include "magi/flops.hpp"
#include "magi/mask.hpp"

namespace magi::cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Median over `runs` repetitions of this rank's time; ranks start each repetition together.
template <class Call>
double median_seconds(DistWorld& world, int runs, Call&& call) {
  std::vector<double> times;
  for (int i = 0; i < runs; ++i) {
    world.comm().barrier();
    const auto start = Clock::now();
    call();
    times.push_back(seconds_since(start));
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

int dist_demo(DistWorld& world, std::span<const std::string> args) {
  std::vector<OptionSpec> specs = {
      {"tokens", "N", "total tokens (default 8192)"},
      {"heads-q", "H", "query heads (default 8)"},
      {"heads-kv", "H", "key/value heads, divides --heads-q (default 2)"},
      {"head-dim", "D", "head dimension, a multiple of 8 (default 128)"},
      {"dtype", "DTYPE", "bf16|fp16|fp32|fp64 (default fp32)"},
      {"backend", "NAME", "auto|cpu|reference for the ranks (default auto)"},
      {"seed", "S", "seed of documents and inputs (default: random, printed)"},
      {"threads", "N", "CPU threads per rank (default: OMP_NUM_THREADS, else the cores shared by the node's ranks)"},
      {"block", "B", "block size of the block-causal mask inside documents (default 128)"},
      {"runs", "R", "timed repetitions of forward and backward; the median is reported (default 3)"}};
  for (OptionSpec& spec : dist_option_specs())
    if (spec.name != "chunk-size") specs.push_back(std::move(spec));
  specs.push_back({"chunk-size", "N", "dispatch chunk in tokens (default 256)"});
  Options options(
      "dist-demo",
      "mpirun -np CP magi-attn dist-demo [--tokens N] [--heads-q H] [--heads-kv H] [--head-dim D] [--dtype DTYPE]\n"
      "                     [--chunk-size N] [--overlap-degree N] [--seed S] [--runs R] [--threads N] ...",
      "The `demo` job over the ranks of mpirun (context parallelism): packed documents with long-tailed\n"
      "lengths, block-causal inside each document. Every rank computes its share of forward and backward;\n"
      "rank 0 checks out, lse, dq, dk and dv against one device computing the whole problem (CPU engine,\n"
      "SPEC section 5 bounds of the dtype), and reports the plan, the time of each phase (slowest rank) and\n"
      "FLOP/s per rank = FLOPs / (time * CP). Exit status 1 if the check fails.",
      std::move(specs));

  int32_t tokens = 0, heads_q = 0, heads_kv = 0, head_dim = 0, block = 0, runs = 0;
  DType dtype = DType::F32;
  AttentionOptions attention;
  dist::DistConfig config;
  uint64_t seed = 0;
  world.agree([&] {
    options.parse(args);
    if (options.help_requested()) return;
    env::ensure_validated();
    tokens = static_cast<int32_t>(options.get_int("tokens", 8192, 1, 1 << 26));
    heads_q = static_cast<int32_t>(options.get_int("heads-q", 8, 1, 1024));
    heads_kv = static_cast<int32_t>(options.get_int("heads-kv", std::min(2, heads_q), 1, 1024));
    head_dim = static_cast<int32_t>(options.get_int("head-dim", 128, 8, 1024));
    block = static_cast<int32_t>(options.get_int("block", 128, 1, 1 << 26));
    runs = static_cast<int32_t>(options.get_int("runs", 3, 1, 1000));
    if (heads_q % heads_kv != 0)
      throw InvalidArgument("--heads-kv " + std::to_string(heads_kv) + " must divide --heads-q " +
                            std::to_string(heads_q));
    if (auto text = options.get("dtype")) dtype = parse_dtype(*text, "--dtype");
    if (auto text = options.get("backend")) attention.backend = parse_backend(*text, "--backend");
    attention.num_threads = world.threads_per_rank(static_cast<int32_t>(options.get_int("threads", 0, 0, 4096)));
    config = parse_dist_config(options, attention);
    if (!options.has("chunk-size")) config.chunk_size = 256;
    seed = options.has("seed") ? static_cast<uint64_t>(options.get_int("seed", 0, 0, INT64_MAX))
                               : std::random_device{}() & 0xffffffffu;
  });
  if (options.help_requested()) {
    if (world.root()) std::cout << options.help_text();
    return 0;
  }
  {  // rank 0's seed for everyone (a random one differs per rank)
    std::vector<std::byte> bytes(sizeof seed);
    std::memcpy(bytes.data(), &seed, sizeof seed);
    bytes = world.broadcast(std::move(bytes));
    std::memcpy(&seed, bytes.data(), sizeof seed);
  }
  const bool root = world.root();
  const int32_t cp = world.size();
  const DType wide = wide_dtype(dtype);

  // Every rank draws the same mask from the seed; rank 0 alone draws the inputs.
  std::vector<int32_t> cu_seqlens;
  Mask mask;
  HostTensor q_g, k_g, v_g, dout_g;
  std::optional<Progress> progress;
  world.agree([&] {
    cu_seqlens = draw_documents(tokens, seed);
    mask = masks::varlen_block_causal(cu_seqlens, block);
    if (!root) return;
    progress.emplace("magi-attn dist-demo:");
    progress->begin("building inputs");
    NormalSampler normal(seed ^ 0x9e3779b97f4a7c15ull);  // inputs independent of the document draw
    q_g = HostTensor(dtype, {tokens, heads_q, head_dim});
    k_g = HostTensor(dtype, {tokens, heads_kv, head_dim});
    v_g = HostTensor(dtype, {tokens, heads_kv, head_dim});
    dout_g = HostTensor(wide, {tokens, heads_q, head_dim});
    for (HostTensor* t : {&q_g, &k_g, &v_g})
      for (int64_t i = 0; i < t->numel(); ++i) t->set(i, normal());
    for (int64_t i = 0; i < dout_g.numel(); ++i) dout_g.set(i, round_to(dtype, normal()));
    progress->begin("distributed forward and backward");
  });
  const int64_t area = mask.area();

  // ---- distributed: plan, dispatch, forward, backward, undispatch ----
  const dist::HeadShape heads{heads_q, heads_kv, head_dim};
  dist::RuntimeKey key;
  double plan_s = 0, dispatch_s = 0, fwd_s = 0, bwd_s = 0, undispatch_s = 0;
  world.agree([&] {
    world.comm().barrier();
    auto start = Clock::now();
    key = dist::make_runtime_key(mask, heads, world.comm_ptr(), config);
    plan_s = seconds_since(start);
  });
  const double nan = std::numeric_limits<double>::quiet_NaN();
  HostTensor out_g, lse_g, dq_g, dk_g, dv_g;  // rank 0
  world.agree([&] {
    world.comm().barrier();
    auto start = Clock::now();
    const Shards q_rows(key, dist::Axis::Q, world.comm(), tokens), k_rows(key, dist::Axis::K, world.comm(), tokens);
    const int64_t lq = q_rows.local_rows(), lk = k_rows.local_rows();
    HostTensor q(dtype, {lq, heads_q, head_dim}), k(dtype, {lk, heads_kv, head_dim}),
        v(dtype, {lk, heads_kv, head_dim}), dout(wide, {lq, heads_q, head_dim});
    q_rows.scatter(root ? &q_g : nullptr, q);
    k_rows.scatter(root ? &k_g : nullptr, k);
    k_rows.scatter(root ? &v_g : nullptr, v);
    q_rows.scatter(root ? &dout_g : nullptr, dout);
    dispatch_s = seconds_since(start);

    HostTensor out(wide, q.shape()), lse(wide, {lq, heads_q}), dq(wide, q.shape()), dk(wide, k.shape()),
        dv(wide, v.shape());
    for (HostTensor* t : {&out, &lse, &dq, &dk, &dv}) t->fill(nan);
    fwd_s = median_seconds(world, runs, [&] {
      dist::calc_attn(key, {q.view(), k.view(), v.view(), {}, out.view(), lse.view(), {}});
    });
    bwd_s = median_seconds(world, runs, [&] {
      dist::calc_attn_backward(key, {q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), {}, dq.view(),
                                     dk.view(), dv.view(), {}});
    });

    world.comm().barrier();
    start = Clock::now();
    if (root) {
      out_g = HostTensor(wide, {tokens, heads_q, head_dim});
      lse_g = HostTensor(wide, {tokens, heads_q});
      dq_g = HostTensor(wide, {tokens, heads_q, head_dim});
      dk_g = HostTensor(wide, {tokens, heads_kv, head_dim});
      dv_g = HostTensor(wide, {tokens, heads_kv, head_dim});
      for (HostTensor* t : {&out_g, &lse_g, &dq_g, &dk_g, &dv_g}) t->fill(nan);
    }
    q_rows.gather(out, root ? &out_g : nullptr);
    q_rows.gather(lse, root ? &lse_g : nullptr);
    q_rows.gather(dq, root ? &dq_g : nullptr);
    k_rows.gather(dk, root ? &dk_g : nullptr);
    k_rows.gather(dv, root ? &dv_g : nullptr);
    undispatch_s = seconds_since(start);
  });
  plan_s = world.max_over_ranks(plan_s);
  dispatch_s = world.max_over_ranks(dispatch_s);
  fwd_s = world.max_over_ranks(fwd_s);
  bwd_s = world.max_over_ranks(bwd_s);
  undispatch_s = world.max_over_ranks(undispatch_s);
  const dist::PlanSummary plan = key.summary();

  // ---- rank 0: the whole problem on one device, and the comparison ----
  // The other ranks wait for it in the next collective, for as long as one device needs (a rank that dies
  // ends the whole job under mpirun, so this cannot hang).
  world.comm().set_timeout(std::max(config.comm_timeout_seconds, 24 * 3600.0));
  bool pass = false;
  std::ostringstream report;
  world.agree([&] {
    if (!root) return;
    progress->begin("single-device forward and backward (check)");
    AttentionOptions single = attention;
    single.backend = Backend::Cpu;
    HostTensor out(wide, out_g.shape()), lse(wide, lse_g.shape()), dq(wide, dq_g.shape()), dk(wide, dk_g.shape()),
        dv(wide, dv_g.shape());
    for (HostTensor* t : {&out, &lse, &dq, &dk, &dv}) t->fill(nan);
    auto start = Clock::now();
    forward(mask, {q_g.view(), k_g.view(), v_g.view(), {}, out.view(), lse.view(), {}}, single);
    const double single_fwd_s = seconds_since(start);
    start = Clock::now();
    backward(mask, {q_g.view(), k_g.view(), v_g.view(), out.view(), lse.view(), dout_g.view(), {}, dq.view(), dk.view(),
                    dv.view(), {}},
             single);
    const double single_bwd_s = seconds_since(start);
    progress.reset();

    const Tolerance tol = tolerance_for(dtype);
    const char* metric = tol.max_relative ? "max rel" : "rel L2";
    struct Verdict {
      const char* name;
      const char* how;
      double error, limit;
    };
    const Verdict verdicts[] = {
        {"out", metric, relative_error(out_g.to_doubles(), out.to_doubles(), tol.max_relative), tol.out},
        {"lse", "max abs", lse_error(lse_g.to_doubles(), lse.to_doubles()), tol.lse},
        {"dq", metric, relative_error(dq_g.to_doubles(), dq.to_doubles(), tol.max_relative), tol.grad},
        {"dk", metric, relative_error(dk_g.to_doubles(), dk.to_doubles(), tol.max_relative), tol.grad},
        {"dv", metric, relative_error(dv_g.to_doubles(), dv.to_doubles(), tol.max_relative), tol.grad}};
    pass = true;
    for (const Verdict& v : verdicts) pass = pass && v.error <= v.limit;  // NaN fails

    int32_t shortest = tokens, longest = 0;
    for (size_t i = 1; i < cu_seqlens.size(); ++i) {
      shortest = std::min(shortest, cu_seqlens[i] - cu_seqlens[i - 1]);
      longest = std::max(longest, cu_seqlens[i] - cu_seqlens[i - 1]);
    }
    const Backend backend = resolve_backend(attention, Device{});
    const int threads = attention.num_threads > 0 ? attention.num_threads : omp_get_max_threads();
    const double fwd_flops = flops_forward(area, heads_q, head_dim),
                 bwd_flops = flops_backward(area, heads_q, head_dim);
    char line[256];
    report << "magi-attn dist-demo: packed documents over " << cp << " ranks (" << world.comm().describe() << "), "
           << to_string(backend) << " with " << threads << " thread" << (threads == 1 ? "" : "s") << " per rank, "
           << to_string(dtype) << ", seed " << seed << "\n";
    report << "  mask      " << cu_seqlens.size() - 1 << " documents of " << shortest << " .. " << longest
           << " tokens (lognormal), block-causal inside (block " << block << "): " << mask.slices.size() << " slices\n";
    std::snprintf(line, sizeof line, "%.2f%%", 100.0 * mask.density());
    report << "            area " << with_commas(area) << " of " << with_commas(int64_t{tokens} * tokens)
           << " cells (density " << line << ")\n";
    report << "  shapes    q [" << tokens << ", " << heads_q << ", " << head_dim << "], k/v [" << tokens << ", "
           << heads_kv << ", " << head_dim << "]; chunk " << config.chunk_size << ", overlap degree "
           << config.overlap_degree << ", dispatch " << to_string(config.algorithm) << "\n";
    std::istringstream plan_lines(plan_text(plan, dtype));
    const char* label = "  plan      ";
    for (std::string text; std::getline(plan_lines, text); label = "            ") report << label << text << "\n";
    report << "  time      slowest rank; FLOP/s per rank = FLOPs / (time * " << cp << ")\n";
    const int32_t ranks_here = world.comm().ranks_per_node() > 0 ? world.comm().ranks_per_node() : 1;
    const auto cores = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
    if (int64_t{ranks_here} * threads > cores)
      report << "            (" << ranks_here << " ranks x " << threads << (threads == 1 ? " thread" : " threads")
             << " share " << cores
             << " cores here: per-rank rates are below those of dedicated cores)\n";
    const auto timing = [&](const char* name, double seconds, const std::string& rate) {
      std::snprintf(line, sizeof line, "    %-22s %8.3f s  %s\n", name, seconds, rate.c_str());
      report << line;
    };
    const std::string of_runs = " (median of " + std::to_string(runs) + ")";
    timing("plan (runtime key)", plan_s, "");
    timing("dispatch (scatter)", dispatch_s, "");
    timing("forward", fwd_s, rate_text(fwd_flops, fwd_s * cp) + " per rank" + of_runs);
    timing("backward", bwd_s, rate_text(bwd_flops, bwd_s * cp) + " per rank" + of_runs);
    timing("undispatch (gather)", undispatch_s, "");
    timing("one device: forward", single_fwd_s, rate_text(fwd_flops, single_fwd_s) + " (rank 0, cpu, 1 run)");
    timing("one device: backward", single_bwd_s, rate_text(bwd_flops, single_bwd_s) + " (rank 0, cpu, 1 run)");
    report << "  check     distributed vs one device (cpu), SPEC section 5 bounds for " << to_string(dtype) << "\n";
    for (const Verdict& v : verdicts) {
      std::snprintf(line, sizeof line, "            %-4s %-8s %.3e  (limit %.0e)  %s\n", v.name, v.how, v.error,
                    v.limit, v.error <= v.limit ? "PASS" : "FAIL");
      report << line;
    }
    report << "  result    " << (pass ? "PASS" : "FAIL") << "\n";
  });
  pass = world.broadcast(std::vector<std::byte>{pass ? std::byte{1} : std::byte{0}})[0] == std::byte{1};
  if (root) std::cout << report.str() << std::flush;
  return pass ? 0 : 1;
}

}  // namespace

int dist_demo_command(std::span<const std::string> args) {
  DistWorld world;
  return run_on_every_rank(world, [&] { return dist_demo(world, args); });
}

}  // namespace magi::cli
