// `magi-attn dist-demo`: the packed-documents job of `demo`, distributed over ranks (context parallelism).
// On GPUs (--device cuda; the default where GPUs are visible and the library has the NCCL engine) there is
// one rank per GPU computing on device tensors through NCCL: mpirun's ranks, or, without mpirun, one
// process per GPU forked here. On the CPU (--device cpu) the ranks are mpirun's, on host tensors through MPI.
// Every rank runs dispatch, forward and backward on its share; rank 0 gathers the results and checks them
// against one device computing the whole problem.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include <omp.h>

#include "cli/accuracy.hpp"
#include "cli/commands.hpp"
#include "cli/device_buffers.hpp"
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

#if MAGI_ATTN_WITH_NCCL
#include "cuda/check.hpp"

#include "comm/nccl_local_launch.hpp"
#endif

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

enum class Site { Cpu, Cuda };

// Everything the options decide; read before any rank starts (every rank reads the same arguments).
struct Settings {
  Site site = Site::Cpu;
  int32_t tokens = 0, heads_q = 0, heads_kv = 0, head_dim = 0, block = 0, runs = 0;
  int32_t threads = 0;  // --threads; 0 = the default of threads_per_rank
  DType dtype = DType::F32;
  dist::DistConfig config;  // config.attention: the ranks' kernel options
  std::optional<uint64_t> seed;
};

constexpr bool kGpuRanksBuilt =
#if MAGI_ATTN_WITH_NCCL
    true;
#else
    false;
#endif

Options demo_options() {
  std::vector<OptionSpec> specs = {
      {"device", "NAME",
       "cpu|cuda: where the ranks compute (default cuda when GPUs are visible and this build has the NCCL "
       "engine, else cpu)"},
      {"tokens", "N", "total tokens (default 8192)"},
      {"heads-q", "H", "query heads (default 8)"},
      {"heads-kv", "H", "key/value heads, divides --heads-q (default 2)"},
      {"head-dim", "D", "head dimension, a multiple of 8 (default 128)"},
      {"dtype", "DTYPE", "bf16|fp16|fp32|fp64 on the CPU (default fp32); bf16|fp16 on GPUs (default bf16)"},
      {"backend", "NAME", "the ranks' kernels: auto|cpu|reference on the CPU, auto|cuda|reference on GPUs "
                          "(default auto)"},
      {"seed", "S", "seed of documents and inputs (default: random, printed)"},
      {"threads", "N", "CPU threads per rank (default: OMP_NUM_THREADS, else the cores shared by the node's ranks)"},
      {"block", "B", "block size of the block-causal mask inside documents (default 128)"},
      {"runs", "R", "timed repetitions of forward and backward; the median is reported (default 3)"}};
  for (OptionSpec& spec : dist_option_specs())
    if (spec.name != "chunk-size") specs.push_back(std::move(spec));
  specs.push_back({"chunk-size", "N", "dispatch chunk in tokens (default 256)"});
  return Options(
      "dist-demo",
      "magi-attn dist-demo [--device cpu|cuda] [--tokens N] [--heads-q H] [--heads-kv H] [--head-dim D]\n"
      "                     [--dtype DTYPE] [--chunk-size N] [--overlap-degree N] [--seed S] [--runs R] ...\n"
      "  on GPUs:  magi-attn dist-demo ...  (one rank per GPU, forked; MAGI_LOCAL_RANKS=N for fewer),\n"
      "            or mpirun -np GPUS magi-attn dist-demo ...\n"
      "  on CPUs:  mpirun -np CP magi-attn dist-demo --device cpu ...",
      "The `demo` job over CP ranks (context parallelism): packed documents with long-tailed lengths,\n"
      "block-causal inside each document. Every rank computes its share of forward and backward; rank 0\n"
      "checks out, lse, dq, dk and dv against one device computing the whole problem (the CPU engine, or the\n"
      "CUDA kernel on rank 0's GPU; SPEC section 5 bounds of the dtype), and reports the plan, the time of\n"
      "each phase (slowest rank) and FLOP/s per rank = FLOPs / (time * CP). On GPUs the ranks use the NCCL\n"
      "engine on device tensors; on the CPU the MPI engine on host tensors. Exit status 1 if the check fails.\n" +
          std::string(kGpuRanksBuilt ? "This magi-attn: --device cuda available (NCCL engine built)."
                                     : "This magi-attn: --device cpu only (built without the CUDA backend or NCCL)."),
      std::move(specs));
}

// Under mpirun (the launcher says so); without it the GPU ranks are forked here.
bool under_mpirun() {
#if MAGI_ATTN_WITH_NCCL
  return comm::launched_by_mpirun();
#else
  return launcher_local_ranks() > 0;
#endif
}

Site choose_site(const Options& options) {
  const int32_t gpus = kGpuRanksBuilt ? visible_gpu_count() : 0;
  const std::optional<std::string> text = options.get("device");
  if (!text) return gpus > 0 ? Site::Cuda : Site::Cpu;
  if (*text == "cpu") return Site::Cpu;
  if (*text != "cuda") throw InvalidArgument("--device: '" + *text + "' (allowed: cpu, cuda)");
  if (!kGpuRanksBuilt)
    throw InvalidArgument("--device cuda: this magi-attn has no GPU distributed runtime (built without the CUDA "
                          "backend or NCCL; allowed: cpu)");
  if (gpus == 0) throw InvalidArgument("--device cuda: no GPU is visible on this machine (allowed here: cpu)");
  return Site::Cuda;
}

// One rank per GPU: more ranks than GPUs would put two NCCL ranks on one device, which NCCL refuses.
void check_gpu_ranks() {
  const int32_t gpus = visible_gpu_count();
  if (under_mpirun()) {
    const int32_t here = launcher_local_ranks();
    if (here > gpus)
      throw InvalidArgument("--device cuda: mpirun put " + std::to_string(here) + " ranks on this node, which has " +
                            std::to_string(gpus) + " GPU(s) (one rank per GPU; or --device cpu)");
    return;
  }
  if (const char* text = std::getenv("MAGI_LOCAL_RANKS"); text != nullptr && *text != '\0') {
    const int64_t ranks = parse_int(text, "MAGI_LOCAL_RANKS");
    if (ranks < 1 || ranks > gpus)
      throw InvalidArgument("MAGI_LOCAL_RANKS=" + std::string(text) + ": must be 1.." + std::to_string(gpus) +
                            " (one rank per visible GPU)");
  }
}

Settings read_settings(const Options& options) {
  env::ensure_validated();
  Settings s;
  s.site = choose_site(options);
  const bool gpu = s.site == Site::Cuda;
  s.tokens = static_cast<int32_t>(options.get_int("tokens", 8192, 1, 1 << 26));
  s.heads_q = static_cast<int32_t>(options.get_int("heads-q", 8, 1, 1024));
  s.heads_kv = static_cast<int32_t>(options.get_int("heads-kv", std::min(2, s.heads_q), 1, 1024));
  s.head_dim = static_cast<int32_t>(options.get_int("head-dim", 128, 8, 1024));
  if (s.head_dim % 8 != 0)  // checked before any work starts (the API would say so only at the first call)
    throw InvalidArgument("--head-dim " + std::to_string(s.head_dim) + ": must be a multiple of 8 (allowed: 8, 16, .., 1024)");
  s.block = static_cast<int32_t>(options.get_int("block", 128, 1, 1 << 26));
  s.runs = static_cast<int32_t>(options.get_int("runs", 3, 1, 1000));
  s.threads = get_threads(options);
  if (s.heads_q % s.heads_kv != 0)
    throw InvalidArgument("--heads-kv " + std::to_string(s.heads_kv) + " must divide --heads-q " +
                          std::to_string(s.heads_q));
  s.dtype = gpu ? DType::BF16 : DType::F32;
  if (auto text = options.get("dtype")) s.dtype = parse_dtype(*text, "--dtype");
  if (gpu && s.dtype != DType::BF16 && s.dtype != DType::F16)
    throw InvalidArgument("--dtype " + std::string(to_string(s.dtype)) +
                          ": the ranks on GPUs take bf16 or fp16 (allowed: bf16, fp16; or --device cpu)");
  AttentionOptions attention;
  if (auto text = options.get("backend")) attention.backend = parse_backend(*text, "--backend");
  if (gpu && attention.backend == Backend::Cpu)
    throw InvalidArgument("--backend cpu: the ranks compute on GPUs (allowed with --device cuda: auto, cuda, "
                          "reference; or --device cpu)");
  if (!gpu && attention.backend == Backend::Cuda)
    throw InvalidArgument("--backend cuda: the ranks compute on the CPU (allowed with --device cpu: auto, cpu, "
                          "reference; or --device cuda)");
  s.config = parse_dist_config(options, attention);
  if (!options.has("chunk-size")) s.config.chunk_size = 256;
  check_chunk_size(s.config, s.tokens, s.tokens);
  if (options.has("seed")) s.seed = static_cast<uint64_t>(options.get_int("seed", 0, 0, INT64_MAX));
  if (gpu) check_gpu_ranks();
  return s;
}

// Rank 0's seed (or a fresh one) on every rank.
uint64_t shared_seed(DistWorld& world, const Settings& s) {
  uint64_t seed = s.seed.value_or(std::random_device{}() & 0xffffffffu);
  std::vector<std::byte> bytes(sizeof seed);
  std::memcpy(bytes.data(), &seed, sizeof seed);
  bytes = world.broadcast(std::move(bytes));
  std::memcpy(&seed, bytes.data(), sizeof seed);
  return seed;
}

// The documents and mask (every rank) and, where asked, the global inputs.
struct Problem {
  std::vector<int32_t> cu_seqlens;
  Mask mask;
  HostTensor q, k, v, dout;  // dout in the wide dtype, rounded to the input dtype
};

Problem draw_problem(const Settings& s, uint64_t seed, bool with_inputs) {
  Problem p;
  p.cu_seqlens = draw_documents(s.tokens, seed);
  p.mask = masks::varlen_block_causal(p.cu_seqlens, s.block);
  if (!with_inputs) return p;
  NormalSampler normal(seed ^ 0x9e3779b97f4a7c15ull);  // inputs independent of the document draw
  p.q = HostTensor(s.dtype, {s.tokens, s.heads_q, s.head_dim});
  p.k = HostTensor(s.dtype, {s.tokens, s.heads_kv, s.head_dim});
  p.v = HostTensor(s.dtype, {s.tokens, s.heads_kv, s.head_dim});
  p.dout = HostTensor(wide_dtype(s.dtype), {s.tokens, s.heads_q, s.head_dim});
  for (HostTensor* t : {&p.q, &p.k, &p.v})
    for (int64_t i = 0; i < t->numel(); ++i) t->set(i, normal());
  for (int64_t i = 0; i < p.dout.numel(); ++i) p.dout.set(i, round_to(s.dtype, normal()));
  return p;
}

struct Outputs {
  HostTensor out, lse, dq, dk, dv;
};

// Whole-problem outputs in the wide dtype, poisoned with NaN.
Outputs global_outputs(const Settings& s) {
  const DType wide = wide_dtype(s.dtype);
  Outputs o{HostTensor(wide, {s.tokens, s.heads_q, s.head_dim}), HostTensor(wide, {s.tokens, s.heads_q}),
            HostTensor(wide, {s.tokens, s.heads_q, s.head_dim}), HostTensor(wide, {s.tokens, s.heads_kv, s.head_dim}),
            HostTensor(wide, {s.tokens, s.heads_kv, s.head_dim})};
  for (HostTensor* t : {&o.out, &o.lse, &o.dq, &o.dk, &o.dv}) t->fill(std::numeric_limits<double>::quiet_NaN());
  return o;
}

struct Timings {
  double plan = 0, dispatch = 0, fwd = 0, bwd = 0, undispatch = 0;  // slowest rank
  double single_fwd = 0, single_bwd = 0;                            // rank 0, whole problem
};

struct Verdict {
  const char* name;
  const char* how;
  double error, limit;
  bool pass() const { return error <= limit; }  // NaN fails
};

std::vector<Verdict> judge(const Outputs& got, const Outputs& ref, DType dtype) {
  const Tolerance tol = tolerance_for(dtype);
  const char* metric = tol.max_relative ? "max rel" : "rel L2";
  const auto rel = [&](const HostTensor& a, const HostTensor& b) {
    return relative_error(a.to_doubles(), b.to_doubles(), tol.max_relative);
  };
  return {{"out", metric, rel(got.out, ref.out), tol.out},
          {"lse", "max abs", lse_error(got.lse.to_doubles(), ref.lse.to_doubles()), tol.lse},
          {"dq", metric, rel(got.dq, ref.dq), tol.grad},
          {"dk", metric, rel(got.dk, ref.dk), tol.grad},
          {"dv", metric, rel(got.dv, ref.dv), tol.grad}};
}

// How one run was set up, for the summary.
struct RunFacts {
  int32_t cp = 1;
  uint64_t seed = 0;
  std::string ranks;        // "cpu with 4 threads per rank", "cuda, one NVIDIA H200 per rank"
  std::string per;          // "rank" or "GPU": the unit of the per-rank rates
  std::string note;         // an extra line under the time header, or ""
  std::string single;       // what computed the whole problem: "rank 0, cpu, 1 run"
  std::string check;        // "one device (cpu)"
};

std::string summary(const Settings& s, const RunFacts& facts, const Problem& p, const dist::PlanSummary& plan,
                    const Timings& t, const std::vector<Verdict>& verdicts, bool pass, const std::string& comm_name) {
  std::ostringstream report;
  int32_t shortest = s.tokens, longest = 0;
  for (size_t i = 1; i < p.cu_seqlens.size(); ++i) {
    shortest = std::min(shortest, p.cu_seqlens[i] - p.cu_seqlens[i - 1]);
    longest = std::max(longest, p.cu_seqlens[i] - p.cu_seqlens[i - 1]);
  }
  const int64_t area = p.mask.area();
  const double fwd_flops = flops_forward(area, s.heads_q, s.head_dim),
               bwd_flops = flops_backward(area, s.heads_q, s.head_dim);
  char line[256];
  report << "magi-attn dist-demo: packed documents over " << facts.cp << " ranks (" << comm_name << "), "
         << facts.ranks << ", " << to_string(s.dtype) << ", seed " << facts.seed << "\n";
  report << "  mask      " << p.cu_seqlens.size() - 1 << " documents of " << shortest << " .. " << longest
         << " tokens (lognormal), block-causal inside (block " << s.block << "): " << p.mask.slices.size()
         << " slices\n";
  std::snprintf(line, sizeof line, "%.2f%%", 100.0 * p.mask.density());
  report << "            area " << with_commas(area) << " of " << with_commas(int64_t{s.tokens} * s.tokens)
         << " cells (density " << line << ")\n";
  report << "  shapes    q [" << s.tokens << ", " << s.heads_q << ", " << s.head_dim << "], k/v [" << s.tokens << ", "
         << s.heads_kv << ", " << s.head_dim << "]; chunk " << s.config.chunk_size << ", overlap degree "
         << s.config.overlap_degree << ", dispatch " << to_string(s.config.algorithm) << "\n";
  std::istringstream plan_lines(plan_text(plan, s.dtype));
  const char* label = "  plan      ";
  for (std::string text; std::getline(plan_lines, text); label = "            ") report << label << text << "\n";
  report << "  time      slowest rank; FLOP/s per " << facts.per << " = FLOPs / (time * " << facts.cp << ")\n";
  if (!facts.note.empty()) report << "            " << facts.note << "\n";
  const auto timing = [&](const char* name, double seconds, const std::string& rate) {
    // GPU phases take well under a second: milliseconds keep their digits.
    std::snprintf(line, sizeof line, "    %-22s %8.3f %s  %s\n", name, seconds < 1.0 ? seconds * 1e3 : seconds,
                  seconds < 1.0 ? "ms" : "s ", rate.c_str());
    report << line;
  };
  const std::string of_runs = " (median of " + std::to_string(s.runs) + ")";
  timing("plan (runtime key)", t.plan, "");
  timing("dispatch", t.dispatch, "");
  timing("forward", t.fwd, rate_text(fwd_flops, t.fwd * facts.cp) + " per " + facts.per + of_runs);
  timing("backward", t.bwd, rate_text(bwd_flops, t.bwd * facts.cp) + " per " + facts.per + of_runs);
  timing("undispatch (gather)", t.undispatch, "");
  timing("one device: forward", t.single_fwd, rate_text(fwd_flops, t.single_fwd) + " (" + facts.single + ")");
  timing("one device: backward", t.single_bwd, rate_text(bwd_flops, t.single_bwd) + " (" + facts.single + ")");
  report << "  check     distributed vs " << facts.check << ", SPEC section 5 bounds for " << to_string(s.dtype) << "\n";
  for (const Verdict& v : verdicts) {
    std::snprintf(line, sizeof line, "            %-4s %-8s %.3e  (limit %.0e)  %s\n", v.name, v.how, v.error,
                  v.limit, v.pass() ? "PASS" : "FAIL");
    report << line;
  }
  report << "  result    " << (pass ? "PASS" : "FAIL") << "\n";
  return report.str();
}

// ---- the CPU ranks: MPI engine, host tensors; rank 0 draws the inputs and scatters them ----

int dist_demo_cpu(DistWorld& world, Settings s) {
  s.config.attention.num_threads = world.threads_per_rank(s.threads);
  const uint64_t seed = shared_seed(world, s);
  const bool root = world.root();
  const int32_t cp = world.size();
  const DType wide = wide_dtype(s.dtype);

  Problem p;
  std::optional<Progress> progress;
  world.agree([&] {
    p = draw_problem(s, seed, root);
    if (!root) return;
    progress.emplace("magi-attn dist-demo:");
    progress->begin("distributed forward and backward");
  });

  const dist::HeadShape heads{s.heads_q, s.heads_kv, s.head_dim};
  dist::RuntimeKey key;
  Timings t;
  world.agree([&] {
    world.comm().barrier();
    const auto start = Clock::now();
    key = dist::make_runtime_key(p.mask, heads, world.comm_ptr(), s.config);
    t.plan = seconds_since(start);
  });
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Outputs dist_out;  // rank 0
  world.agree([&] {
    world.comm().barrier();
    auto start = Clock::now();
    const Shards q_rows(key, dist::Axis::Q, world.comm(), s.tokens), k_rows(key, dist::Axis::K, world.comm(), s.tokens);
    const int64_t lq = q_rows.local_rows(), lk = k_rows.local_rows();
    HostTensor q(s.dtype, {lq, s.heads_q, s.head_dim}), k(s.dtype, {lk, s.heads_kv, s.head_dim}),
        v(s.dtype, {lk, s.heads_kv, s.head_dim}), dout(wide, {lq, s.heads_q, s.head_dim});
    q_rows.scatter(root ? &p.q : nullptr, q);
    k_rows.scatter(root ? &p.k : nullptr, k);
    k_rows.scatter(root ? &p.v : nullptr, v);
    q_rows.scatter(root ? &p.dout : nullptr, dout);
    t.dispatch = seconds_since(start);

    HostTensor out(wide, q.shape()), lse(wide, {lq, s.heads_q}), dq(wide, q.shape()), dk(wide, k.shape()),
        dv(wide, v.shape());
    for (HostTensor* x : {&out, &lse, &dq, &dk, &dv}) x->fill(nan);
    t.fwd = median_seconds(world, s.runs, [&] {
      dist::calc_attn(key, {q.view(), k.view(), v.view(), {}, out.view(), lse.view(), {}, {}, {}});
    });
    t.bwd = median_seconds(world, s.runs, [&] {
      dist::calc_attn_backward(key, {q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), {}, dq.view(),
                                     dk.view(), dv.view(), {}});
    });

    world.comm().barrier();
    start = Clock::now();
    if (root) dist_out = global_outputs(s);
    q_rows.gather(out, root ? &dist_out.out : nullptr);
    q_rows.gather(lse, root ? &dist_out.lse : nullptr);
    q_rows.gather(dq, root ? &dist_out.dq : nullptr);
    k_rows.gather(dk, root ? &dist_out.dk : nullptr);
    k_rows.gather(dv, root ? &dist_out.dv : nullptr);
    t.undispatch = seconds_since(start);
  });
  for (double* phase : {&t.plan, &t.dispatch, &t.fwd, &t.bwd, &t.undispatch}) *phase = world.max_over_ranks(*phase);
  const dist::PlanSummary plan = key.summary();

  // ---- rank 0: the whole problem on one device, and the comparison ----
  // The other ranks wait for it in the next collective, for as long as one device needs (a rank that dies
  // ends the whole job under mpirun, so this cannot hang).
  world.comm().set_timeout(std::max(s.config.comm_timeout_seconds, 24 * 3600.0));
  bool pass = false;
  std::string report;
  world.agree([&] {
    if (!root) return;
    progress->begin("single-device forward and backward (check)");
    AttentionOptions single = s.config.attention;
    single.backend = Backend::Cpu;
    Outputs one = global_outputs(s);
    auto start = Clock::now();
    forward(p.mask, {p.q.view(), p.k.view(), p.v.view(), {}, one.out.view(), one.lse.view(), {}, {}, {}}, single);
    t.single_fwd = seconds_since(start);
    start = Clock::now();
    backward(p.mask, {p.q.view(), p.k.view(), p.v.view(), one.out.view(), one.lse.view(), p.dout.view(), {},
                      one.dq.view(), one.dk.view(), one.dv.view(), {}},
             single);
    t.single_bwd = seconds_since(start);
    progress.reset();

    const std::vector<Verdict> verdicts = judge(dist_out, one, s.dtype);
    pass = std::all_of(verdicts.begin(), verdicts.end(), [](const Verdict& v) { return v.pass(); });
    const AttentionOptions& a = s.config.attention;
    const int threads = a.num_threads > 0 ? a.num_threads : omp_get_max_threads();
    RunFacts facts;
    facts.cp = cp;
    facts.seed = seed;
    facts.ranks = std::string(to_string(resolve_backend(a, Device{}))) + " with " + std::to_string(threads) +
                  (threads == 1 ? " thread" : " threads") + " per rank";
    facts.per = "rank";
    const int32_t ranks_here = world.comm().ranks_per_node() > 0 ? world.comm().ranks_per_node() : 1;
    const auto cores = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
    if (int64_t{ranks_here} * threads > cores)
      facts.note = "(" + std::to_string(ranks_here) + " ranks x " + std::to_string(threads) +
                   (threads == 1 ? " thread" : " threads") + " share " + std::to_string(cores) +
                   " cores here: per-rank rates are below those of dedicated cores)";
    facts.single = "rank 0, cpu, 1 run";
    facts.check = "one device (cpu)";
    report = summary(s, facts, p, plan, t, verdicts, pass, world.comm().describe());
  });
  pass = world.broadcast(std::vector<std::byte>{pass ? std::byte{1} : std::byte{0}})[0] == std::byte{1};
  if (root) std::cout << report << std::flush;
  return pass ? 0 : 1;
}

#if MAGI_ATTN_WITH_NCCL
// ---- the GPU ranks: NCCL engine, device tensors; every rank draws the inputs (dispatch is a local copy) ----

using cuda::check;

// An owning buffer on one GPU, viewed as a tensor; new ones hold NaN (all bits set, in every float dtype).
class DeviceTensor {
 public:
  DeviceTensor(DType dtype, std::vector<int64_t> shape, int32_t device) {
    view_.dtype = dtype;
    view_.ndim = static_cast<int32_t>(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) view_.shape[i] = shape[i];
    view_.device = Device{DeviceType::CUDA, device};
    check(cudaMalloc(&view_.data, std::max<size_t>(1, bytes())), "cudaMalloc");
    check(cudaMemset(view_.data, 0xFF, bytes()), "cudaMemset");
  }
  DeviceTensor(HostTensor& host, int32_t device) : DeviceTensor(host.dtype(), host.shape(), device) {
    check(cudaMemcpy(view_.data, host.view().data, bytes(), cudaMemcpyHostToDevice), "cudaMemcpy to the GPU");
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor() { cudaFree(view_.data); }

  const TensorView& view() const { return view_; }
  void download(HostTensor& host) const {
    check(cudaMemcpy(host.view().data, view_.data, bytes(), cudaMemcpyDeviceToHost), "cudaMemcpy from the GPU");
  }

 private:
  size_t bytes() const { return static_cast<size_t>(view_.nbytes()); }
  TensorView view_;
};

int dist_demo_gpu(DistWorld& world, Settings s) {
  const int32_t device = world.comm().device().index;  // the NCCL communicator's GPU
  check(cudaSetDevice(device), "cudaSetDevice");
  const uint64_t seed = shared_seed(world, s);
  const bool root = world.root();
  const int32_t cp = world.size();
  const DType wide = wide_dtype(s.dtype);
  const int32_t hq = s.heads_q, hkv = s.heads_kv, d = s.head_dim;

  Problem p;
  std::optional<Progress> progress;
  world.agree([&] {
    if (root) {
      progress.emplace("magi-attn dist-demo:");
      progress->begin("building inputs");
    }
    p = draw_problem(s, seed, true);
    if (root) progress->begin("distributed forward and backward");
  });

  dist::RuntimeKey key;
  Timings t;
  world.agree([&] {
    world.comm().barrier();
    const auto start = Clock::now();
    key = dist::make_runtime_key(p.mask, {hq, hkv, d}, world.comm_ptr(), s.config);
    t.plan = seconds_since(start);
  });
  Outputs dist_out = global_outputs(s);  // every rank: undispatch is an allgather
  world.agree([&] {
    const int64_t lq = key.local_q_tokens(), lk = key.local_k_tokens();
    world.comm().barrier();
    auto start = Clock::now();
    DeviceTensor q(s.dtype, {lq, hq, d}, device), k(s.dtype, {lk, hkv, d}, device), v(s.dtype, {lk, hkv, d}, device),
        dout(wide, {lq, hq, d}, device);
    dist::dispatch(key, dist::Axis::Q, p.q.view(), q.view());
    dist::dispatch(key, dist::Axis::K, p.k.view(), k.view());
    dist::dispatch(key, dist::Axis::K, p.v.view(), v.view());
    dist::dispatch(key, dist::Axis::Q, p.dout.view(), dout.view());
    t.dispatch = seconds_since(start);

    DeviceTensor out(wide, {lq, hq, d}, device), lse(DType::F32, {lq, hq}, device), dq(wide, {lq, hq, d}, device),
        dk(wide, {lk, hkv, d}, device), dv(wide, {lk, hkv, d}, device);
    // calc_attn and calc_attn_backward return once the GPU work is done: wall time is GPU time.
    t.fwd = median_seconds(world, s.runs, [&] {
      dist::calc_attn(key, {q.view(), k.view(), v.view(), {}, out.view(), lse.view(), {}, {}, {}});
    });
    t.bwd = median_seconds(world, s.runs, [&] {
      dist::calc_attn_backward(key, {q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), {}, dq.view(),
                                     dk.view(), dv.view(), {}});
    });

    world.comm().barrier();
    start = Clock::now();
    dist::undispatch(key, dist::Axis::Q, out.view(), dist_out.out.view());
    dist::undispatch(key, dist::Axis::Q, lse.view(), dist_out.lse.view());
    dist::undispatch(key, dist::Axis::Q, dq.view(), dist_out.dq.view());
    dist::undispatch(key, dist::Axis::K, dk.view(), dist_out.dk.view());
    dist::undispatch(key, dist::Axis::K, dv.view(), dist_out.dv.view());
    t.undispatch = seconds_since(start);
  });
  for (double* phase : {&t.plan, &t.dispatch, &t.fwd, &t.bwd, &t.undispatch}) *phase = world.max_over_ranks(*phase);
  const dist::PlanSummary plan = key.summary();

  // ---- rank 0: the whole problem on its GPU with the single-GPU kernel, and the comparison ----
  world.comm().set_timeout(std::max(s.config.comm_timeout_seconds, 3600.0));
  bool pass = false;
  std::string report;
  world.agree([&] {
    if (!root) return;
    progress->begin("single-GPU forward and backward (check)");
    AttentionOptions single = s.config.attention;
    single.backend = Backend::Cuda;
    Outputs one = global_outputs(s);
    DeviceTensor q(p.q, device), k(p.k, device), v(p.v, device), dout(p.dout, device);
    DeviceTensor out(wide, one.out.shape(), device), lse(DType::F32, one.lse.shape(), device),
        dq(wide, one.dq.shape(), device), dk(wide, one.dk.shape(), device), dv(wide, one.dv.shape(), device);
    const auto timed = [&](auto&& call) {
      std::vector<double> times;
      for (int i = 0; i < s.runs; ++i) {
        const auto start = Clock::now();
        call();
        check(cudaDeviceSynchronize(), "the single-GPU kernel");
        times.push_back(seconds_since(start));
      }
      std::sort(times.begin(), times.end());
      return times[times.size() / 2];
    };
    t.single_fwd = timed([&] { forward(p.mask, {q.view(), k.view(), v.view(), {}, out.view(), lse.view(), {}, {}, {}}, single); });
    t.single_bwd = timed([&] {
      backward(p.mask, {q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), {}, dq.view(), dk.view(),
                        dv.view(), {}},
               single);
    });
    out.download(one.out);
    lse.download(one.lse);
    dq.download(one.dq);
    dk.download(one.dk);
    dv.download(one.dv);
    progress.reset();

    const std::vector<Verdict> verdicts = judge(dist_out, one, s.dtype);
    pass = std::all_of(verdicts.begin(), verdicts.end(), [](const Verdict& v) { return v.pass(); });
    RunFacts facts;
    facts.cp = cp;
    facts.seed = seed;
    const std::string name = gpu_name();
    facts.ranks = std::string(to_string(resolve_backend(s.config.attention, Device{DeviceType::CUDA, device}))) +
                  " on device tensors, one " + (name.empty() ? "GPU" : name) + " per rank";
    facts.per = "GPU";
    facts.single = "GPU " + std::to_string(device) + ", cuda kernel, median of " + std::to_string(s.runs);
    facts.check = "one GPU (the cuda kernel on the whole problem)";
    report = summary(s, facts, p, plan, t, verdicts, pass, world.comm().describe());
  });
  pass = world.broadcast(std::vector<std::byte>{pass ? std::byte{1} : std::byte{0}})[0] == std::byte{1};
  if (root) std::cout << report << std::flush;
  return pass ? 0 : 1;
}
#endif

#if MAGI_ATTN_WITH_NCCL
// This process is one GPU rank of a torchrun / ATOM launch: the NCCL id travels over the TCP bootstrap.
int run_launched_gpu_rank(const comm::LaunchInfo& launch, const Settings& s) {
  try {
    const double timeout = s.config.comm_timeout_seconds;
    std::shared_ptr<comm::Communicator> bootstrap = comm::tcp_communicator(launch, timeout);
    comm::NcclUniqueId id{};
    if (launch.rank == 0) id = comm::nccl_unique_id();
    std::vector<comm::NcclUniqueId> ids(static_cast<size_t>(launch.size));
    bootstrap->allgather(&id, sizeof id, ids.data());
    const int32_t gpus = std::max(1, visible_gpu_count());
    DistWorld world(comm::nccl_communicator(ids[0], launch.rank, launch.size, launch.local_rank % gpus, timeout));
    return run_on_every_rank(world, [&] { return dist_demo_gpu(world, s); });
  } catch (const QuietExit& quiet) {
    return quiet.exit_code;
  } catch (const std::exception& e) {
    print_error_line(e.what());
    return 2;
  }
}
#endif

// One rank per GPU (mpirun's, a torchrun / ATOM launch's, or forked here), each ending as main would: one error
// line, exit 2.
int run_gpu_ranks(const Settings& s) {
#if MAGI_ATTN_WITH_NCCL
  if (!under_mpirun())
    if (const std::optional<comm::LaunchInfo> launch = comm::launch_from_env())
      return run_launched_gpu_rank(*launch, s);
  if (!under_mpirun() && std::getenv("MAGI_LOCAL_RANKS") == nullptr)  // the launcher's count ignores CUDA_VISIBLE_DEVICES
    ::setenv("MAGI_LOCAL_RANKS", std::to_string(visible_gpu_count()).c_str(), 1);
  return comm::run_on_local_gpus([&](auto nccl) {  // the world's NCCL communicator
    try {
      DistWorld world(std::move(nccl));
      return run_on_every_rank(world, [&] { return dist_demo_gpu(world, s); });
    } catch (const QuietExit& quiet) {
      return quiet.exit_code;
    } catch (const std::exception& e) {
      print_error_line(e.what());
      return 2;
    }
  });
#else
  (void)s;
  throw NotAvailable("dist-demo: this build has no GPU distributed runtime (allowed: --device cpu)");
#endif
}

}  // namespace

int dist_demo_command(std::span<const std::string> args) {
  // The options decide between MPI and GPU ranks, so they are read before any rank starts. Every rank
  // reads the same arguments; the launcher's rank 0 alone reports an error or prints the help.
  Options options = demo_options();
  Settings settings;
  try {
    options.parse(args);
    if (!options.help_requested()) settings = read_settings(options);
  } catch (const std::exception&) {
    if (launcher_rank() != 0) throw QuietExit{2};
    throw;
  }
  if (options.help_requested()) {
    if (launcher_rank() == 0) std::cout << options.help_text();
    return 0;
  }
  if (settings.site == Site::Cuda) return run_gpu_ranks(settings);
  DistWorld world(settings.config.comm_timeout_seconds);
  return run_on_every_rank(world, [&] { return dist_demo_cpu(world, settings); });
}

}  // namespace magi::cli
