// The one table of environment variables. Sources: the upstream user guide (seed 001, newer, wins),
// its older edition (seed 000: old names kept as aliases, variables only there kept) and the install
// guide (seed 004); plus MAGI_ATTENTION_LOG_LEVEL, MAGI_ATTENTION_KERNEL_BACKEND and MAGI_ATTENTION_PROFILE_DIR of
// our own.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "env/scan.hpp"
#include "magi/env.hpp"

namespace magi::env {
namespace {

constexpr std::string_view kCorrectness = "correctness";
constexpr std::string_view kPerformance = "performance";
constexpr std::string_view kDebug = "debug";
constexpr std::string_view kBuild = "build";

struct Support {
  Status status;
  std::string_view reason;
};
constexpr Support kImplemented{Status::Implemented, {}};
constexpr Support not_yet(std::string_view planned_capability) { return {Status::NotYet, planned_capability}; }
constexpr Support not_applicable(std::string_view why) { return {Status::NotApplicable, why}; }

// Reasons shared by several variables.
constexpr std::string_view kNoJit = "no JIT compilation here (kernels are compiled ahead of time by CMake)";
constexpr std::string_view kFa4 =
    "FFA_FA4 is upstream's Python/CuteDSL workaround for Blackwell GPUs, with no counterpart here";

Variable boolean(std::string_view name, std::string_view default_value, std::string_view category,
                 Support support, std::string_view meaning, std::vector<std::string_view> aliases = {}) {
  return Variable{.name = name, .type = VarType::Bool, .default_value = default_value,
                  .allowed = {"0", "1"}, .category = category, .meaning = meaning,
                  .status = support.status, .status_reason = support.reason,
                  .aliases = std::move(aliases)};
}

struct IntDefault {
  std::string_view value = {};            // fixed default, or
  std::string_view rule = {};             // a run-time default in words,
  int64_t (*compute)() = nullptr;         // and how to evaluate it (if this build can)
};

Variable integer(std::string_view name, IntDefault default_spec, std::string_view min,
                 std::string_view max, std::string_view category, Support support,
                 std::string_view meaning) {
  return Variable{.name = name, .type = VarType::Int, .default_value = default_spec.value,
                  .allowed = {min, max}, .category = category, .meaning = meaning,
                  .status = support.status, .status_reason = support.reason, .aliases = {},
                  .default_rule = default_spec.rule, .computed_default = default_spec.compute};
}

Variable choice(std::string_view name, std::string_view default_value,
                std::vector<std::string_view> allowed, std::string_view category, Support support,
                std::string_view meaning) {
  return Variable{.name = name, .type = VarType::Enum, .default_value = default_value,
                  .allowed = std::move(allowed), .category = category, .meaning = meaning,
                  .status = support.status, .status_reason = support.reason, .aliases = {}};
}

// Free text; `allowed_text` says what the consumer (e.g. the CMake build) accepts, for the docs.
Variable text(std::string_view name, std::string_view default_rule, std::string_view allowed_text,
              std::string_view category, Support support, std::string_view meaning) {
  return Variable{.name = name, .type = VarType::String, .default_value = {}, .allowed = {allowed_text},
                  .category = category, .meaning = meaning, .status = support.status,
                  .status_reason = support.reason, .aliases = {}, .default_rule = default_rule};
}

Variable path(std::string_view name, std::string_view default_rule, std::string_view category,
              Support support, std::string_view meaning) {
  return Variable{.name = name, .type = VarType::Path, .default_value = {}, .allowed = {},
                  .category = category, .meaning = meaning, .status = support.status,
                  .status_reason = support.reason, .aliases = {}, .default_rule = default_rule};
}

int64_t all_cores() { return std::max(1u, std::thread::hardware_concurrency()); }

// Upstream's default for its kernel prebuild parallelism: ceil(0.9 * cores), at least 1.
int64_t ninety_percent_of_cores() {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(0.9 * cores)));
}

// Upstream default for the SM margins: leave 4 SMs to communication kernels when CUDA streams can
// run concurrently (more than one hardware queue).
// Reads the environment directly rather than through get_int, so that `magi-attn env` can show it
// without validating (and possibly rejecting) the whole environment; a bad value counts as unset,
// as validation treats it for this variable.
int64_t sm_margin_default() {
  const Variable& connections = *find("CUDA_DEVICE_MAX_CONNECTIONS");
  const char* raw = std::getenv(std::string(connections.name).c_str());
  const std::optional<std::string> value = raw != nullptr ? detail::parse_value(connections, raw) : std::nullopt;
  return std::stoll(value.value_or(std::string(connections.default_value))) > 1 ? 4 : 0;
}

constexpr std::string_view kSmMarginRule = "4 if CUDA_DEVICE_MAX_CONNECTIONS > 1, else 0";
constexpr std::string_view kUpstreamJobsRule = "ceil(0.9 x CPU cores)";

std::vector<Variable> make_registry() {
  return {
      // ---- correctness ----
      boolean("MAGI_ATTENTION_FORWARD_HIGH_PRECISION_REDUCE", "0", kCorrectness, kImplemented,
              "Send the partial outputs of distributed attention's query/output route (MAGI_ATTENTION_QO_COMM) "
              "back to their owners in fp32 instead of the input dtype (twice those bytes, one rounding fewer); "
              "k/v-only plans merge partial outputs locally in fp32 anyway. A call asking for an fp32 out of "
              "16-bit inputs sends fp32 whatever this says."),
      boolean("MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE", "0", kCorrectness,
              kImplemented,
              "Reduce partial dk/dv (and dq with query/output communication) across ranks in fp32 "
              "instead of the input dtype, trading twice the traffic for precision. A call asking for fp32 "
              "gradients of 16-bit inputs reduces in fp32 whatever this says.",
              {"MAGI_ATTENTION_FFA_BACKWARD_HIGH_PRECISION_REDUCE"}),
      choice("MAGI_ATTENTION_DSINK_ALL_REDUCE_OP", "none", {"none", "sum", "avg"}, kCorrectness,
             kImplemented,
             "How distributed attention combines the per-rank partial sink gradients: none leaves "
             "it to the training framework, sum adds them, avg also divides by the cp size."),

      // ---- performance ----
      boolean("MAGI_ATTENTION_FA4_BACKEND", "0", kPerformance, not_applicable(kFa4),
              "Use the Flash-Attention-4-based FFA_FA4 kernels (upstream's stopgap for arbitrary "
              "masks on Blackwell GPUs) instead of FFA."),
      boolean("MAGI_ATTENTION_NATIVE_GRPCOLL", "0", kPerformance,
              not_yet("planned: native group-collective communication kernels"),
              "Use the native group-collective kernels (NVSHMEM-based) for distributed communication "
              "instead of the NCCL-based ones; experimental."),
      boolean("MAGI_ATTENTION_QO_COMM", "0", kPerformance, kImplemented,
              "Let distributed attention move q, out, lse, do and dq between ranks, not only k/v: per rank pair "
              "the planner picks the route that moves fewer bytes (q rows to the kv owner, partial out / lse and "
              "dq back) while the busiest rank's compute grows by 2% at most, and reports both (magi-attn "
              "dist-run); host and device tensors; experimental (on NVLink at cp 2-4 it did not pay: "
              "docs/performance.md)."),
      boolean("MAGI_ATTENTION_FLATTEN_HEAD_GROUPS", "0", kPerformance, kImplemented,
              "Decide distributed attention's routes per (rank pair, kv head group; at most 4 groups) and move "
              "head-group units of the busiest rank's work to the kv owners (query/output route) while that "
              "lowers the busiest rank's compute; host and device tensors; experimental."),
      boolean("MAGI_ATTENTION_AUTO_RANGE_MERGE", "0", kPerformance, kImplemented,
              "Before planning, merge slices whose union is exactly one slice (side by side on the same rows, or "
              "stacked on the same edges; zero-area ones dropped: magi::merge_slices) so that the kernels handle "
              "fewer, longer slices with the same kept cells; every backend, and in distributed attention also the "
              "global mask before dispatch. In deterministic mode only merges that cannot change a bit: neighbours "
              "in the slice list (the earlier left of or above the later) meeting at a multiple of 384 on cuda, 96 "
              "on the CPU engine, none on the GPU reference engine; the distributed global mask stays as given."),
      boolean("MAGI_ATTENTION_CATGQA", "0", kPerformance, kImplemented,
              "In the GPU backward kernel, process the query heads that share one kv head together "
              "(GQA/MQA): the Hopper backward at head dims up to 128, where the q heads per kv head divide 64, "
              "walks each kv head's q heads as one sequence of concatenated rows (a 64-row chunk holds 64 / group "
              "tokens of every head) instead of one head after another; the planner keeps the plain walk where "
              "the concatenated one would push the first wave's rows out of L2 (a long sliding window). Elsewhere "
              "no effect. Experimental: with 8 q heads per kv head the causal masks gained 10-26% (H100, D 128), "
              "with 4 the masks ranged from -11% to +4% (docs/performance.md)."),
      boolean("MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE", "0", kPerformance, kImplemented,
              "Reorder the backward overlap stages so that the last remote gradient reduction "
              "overlaps local compute (the local stage runs last instead of first, so the first k/v "
              "exchange is no longer hidden behind it); host and device runtime (on the GPU the local "
              "stage's dk/dv go to buffers of their own, added after the reductions)."),
      integer("MAGI_ATTENTION_FFA_FORWARD_SM_MARGIN",
              {.rule = kSmMarginRule, .compute = sm_margin_default}, "0", "", kPerformance,
              kImplemented,
              "Number of GPU SMs the forward attention kernel leaves free for concurrent "
              "communication kernels. Where the kernel runs several blocks an SM (the Hopper forward's "
              "64-row tiles at D 64 / 128) it launches that many fewer blocks per SM of margin: the same "
              "room, which the hardware may spread over several SMs."),
      integer("MAGI_ATTENTION_FFA_BACKWARD_SM_MARGIN",
              {.rule = kSmMarginRule, .compute = sm_margin_default}, "0", "", kPerformance,
              kImplemented,
              "Number of GPU SMs the backward attention kernel leaves free for concurrent "
              "communication kernels."),
      boolean("MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT", "1", kPerformance, kImplemented,
              "Distributed forward: each stage's attention call merges its result into the running out/lse "
              "in place (ForwardArgs::prev_out / prev_lse) instead of storing the stage's partial out/lse "
              "and merging it in a separate pass. Default 1 here (the tested, faster path; upstream's default "
              "is 0); 0 selects the out-of-place merge for A/B. Both meet SPEC section 5; fp64 results are "
              "bitwise equal, lower precisions may differ in the last bits (the running result is fp32)."),
      boolean("MAGI_ATTENTION_CPP_BACKEND", "0", kPerformance,
              not_applicable("it swaps upstream's Python data structures for C++ ones; this library "
                             "is C++ throughout"),
              "Use C++ implementations of the core range/mask data structures instead of Python."),
      boolean("MAGI_ATTENTION_HIERARCHICAL_COMM", "0", kPerformance,
              kImplemented,
              "Split the context-parallel group into an inter-node and an intra-node group so that "
              "data crosses node boundaries once."),
      integer("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE", {.value = "1000"}, "1", "", kPerformance,
              kImplemented,
              "Capacity of the least-recently-used cache of distributed-attention runtime plans."),
      integer("CUDA_DEVICE_MAX_CONNECTIONS", {.value = "8"}, "1", "32", kPerformance,
              kImplemented,
              "CUDA driver setting: hardware work queues shared by all streams; more queues let "
              "communication and compute overlap."),

      // ---- debug ----
      boolean("MAGI_ATTENTION_SANITY_CHECK", "0", kDebug, kImplemented,
              "Validate every call fully, including that no two mask slices overlap; costs time, "
              "meant for tests and debugging."),
      boolean("MAGI_ATTENTION_SDPA_BACKEND", "0", kDebug, kImplemented,
              "Run the exact reference engine (fp64 accumulation) instead of the fast one; same as "
              "MAGI_ATTENTION_KERNEL_BACKEND=sdpa. Slow: for tests and debugging."),
      choice("MAGI_ATTENTION_KERNEL_BACKEND", "auto", {"auto", "ffa", "ffa_sm80", "ffa_sm90", "sdpa"}, kDebug,
             kImplemented,
             "Attention engine: auto and ffa pick the fast engine for the tensors' device (on the GPU the "
             "kernel family for its architecture), ffa_sm80 / ffa_sm90 force the portable (mma.sync) or the "
             "Hopper (wgmma + TMA; forward and backward at every head-dim tile) GPU kernels for A/B runs, sdpa the exact reference engine (as MAGI_ATTENTION_SDPA_BACKEND=1)."),
      boolean("MAGI_ATTENTION_DETERMINISTIC_MODE", "0", kDebug, kImplemented,
              "Use only deterministic algorithms, so repeated runs give bitwise-identical results "
              "(the CPU engine always is)."),
      boolean("MAGI_ATTENTION_CUDA_IGNORE_TUNED_CONFIGS", "0", kDebug, kImplemented,
              "Ignore the table of measured per-device launch configurations shipped with the library "
              "(src/cuda/plan/tuned_configs.cpp: the large head-dim forward's variant per compute capability "
              "and head-dim tile) and take the safe choice that fits the device's shared memory instead; for "
              "A/B runs. Read when a plan is made (plans are cached)."),
      boolean("MAGI_ATTENTION_PROFILE_MODE", "0", kDebug,
              kImplemented,
              "Print per-kernel GPU timings (CUDA events; synchronises) for every call; for development only."),
      path("MAGI_ATTENTION_PROFILE_DIR", "unset (no timelines)", kDebug, kImplemented,
           "Directory where every rank of distributed attention writes a Chrome-trace timeline of its calls "
           "(rank_N.json: planning, each k/v exchange, each stage's attention, the reductions, the final "
           "stores; the host runtime's wall times, the device runtime's CUDA-event times on its streams, at "
           "the cost of one host synchronisation per call); `magi-attn trace DIR` merges the ranks and reports "
           "how much communication computation hid."),
      choice("MAGI_ATTENTION_LOG_LEVEL", "warn", {"error", "warn", "info", "debug"}, kDebug,
             kImplemented,
             "Which diagnostics reach stderr: error silences warnings, info and debug add detail."),

      // ---- build ----
      path("MAGI_ATTENTION_WORKSPACE_BASE", "the home directory (~)", kBuild, not_applicable(kNoJit),
           "Base directory for the JIT workspace: build cache and generated sources."),
      boolean("MAGI_ATTENTION_BUILD_VERBOSE", "0", kBuild, not_applicable(kNoJit),
              "Print the full compiler commands of JIT builds (cmake --build -v does this here)."),
      boolean("MAGI_ATTENTION_BUILD_DEBUG", "0", kBuild, not_applicable(kNoJit),
              "Compile JIT kernels with debug information and resource reports "
              "(-DCMAKE_BUILD_TYPE=Debug here)."),
      boolean("MAGI_ATTENTION_NO_BUILD_CACHE", "0", kBuild, not_applicable(kNoJit),
              "Do not reuse previously JIT-built kernels."),
      boolean("MAGI_ATTENTION_FORCE_JIT_BUILD", "0", kBuild, not_applicable(kNoJit),
              "Build kernels just in time even when ahead-of-time builds exist."),
      integer("NVCC_THREADS", {.value = "4"}, "1", "", kBuild, not_applicable(kNoJit),
              "Threads for nvcc --split-compile in JIT builds (pass it in CMAKE_CUDA_FLAGS here)."),
      integer("MAGI_ATTENTION_PREBUILD_FFA_JOBS",
              {.rule = kUpstreamJobsRule, .compute = ninety_percent_of_cores}, "1", "", kBuild,
              not_applicable("there is no separate kernel prebuild step; MAX_JOBS sets build parallelism"),
              "Parallel compile jobs for prebuilding the FFA kernels."),
      integer("MAX_JOBS", {.rule = "all CPU cores (nproc)", .compute = all_cores}, "1", "", kBuild,
              kImplemented,
              "Parallel build jobs: of scripts/build.sh and scripts/test.sh (cmake --build -j, ctest -j) and of "
              "pip install . (Ninja job pools); the library itself never reads it."),
      boolean("MAGI_ATTENTION_PREBUILD_FFA", "1", kBuild, kImplemented,
              "Build the CUDA kernels ahead of time (when nvcc is found); 0 builds without them, a CPU-only "
              "library or Python package (there is no JIT to build them later)."),
      boolean("MAGI_ATTENTION_SKIP_FFA_UTILS_BUILD", "0", kBuild,
              not_applicable("the FFA utilities (range merging and sorting, sparse-load metadata) are part of the "
                             "C++ library inside the one extension module"),
              "Skip building the flexible_flash_attention_utils_cuda extension module."),
      boolean("MAGI_ATTENTION_SKIP_MAGI_ATTN_EXT_BUILD", "0", kBuild,
              not_applicable("the Python package is one extension module (magi_attn._C); without it there is no "
                             "package"),
              "Skip building the magi_attn_ext extension module."),
      boolean("MAGI_ATTENTION_SKIP_MAGI_ATTN_COMM_BUILD", "0", kBuild, kImplemented,
              "Build without the NCCL communication engine (GPU context parallelism left out; host "
              "communicators stay)."),
      path("MAGI_ATTENTION_FFA_FA4_CACHE_DIR", "magi_attention/lib/ffa_fa4_cache/ in the Python package",
           kBuild, not_applicable(kFa4), "Directory of precompiled FFA_FA4 kernels."),
      text("MAGI_ATTENTION_BUILD_COMPUTE_CAPABILITY", "the visible GPUs (nvidia-smi), else 80;90a",
           "numbers (80, 8.6, 90a, sm_90) or aliases (ampere, ada, hopper, blackwell), separated by ; , or spaces",
           kBuild, kImplemented,
           "GPU architectures the CUDA kernels are built for (every build: scripts, CMake, pip install .)."),
      path("NVSHMEM_DIR", "the nvidia-nvshmem-cu12 Python package, if installed", kBuild,
           not_yet("planned: native group-collective communication kernels (NVSHMEM)"),
           "Installation directory of NVSHMEM; without one the native group-collective kernels "
           "are left out."),
  };
}

}  // namespace

std::string_view to_string(VarType type) {
  switch (type) {
    case VarType::Bool: return "bool";
    case VarType::Int: return "int";
    case VarType::String: return "string";
    case VarType::Enum: return "enum";
    case VarType::Path: return "path";
  }
  return "?";
}

std::string_view to_string(Status status) {
  switch (status) {
    case Status::Implemented: return "implemented";
    case Status::NotYet: return "not yet";
    case Status::NotApplicable: return "not applicable";
  }
  return "?";
}

std::span<const Variable> registry() {
  static const std::vector<Variable> variables = make_registry();  // immutable after first use
  return variables;
}

const Variable* find(std::string_view name) {
  for (const Variable& variable : registry()) {
    if (variable.name == name) return &variable;
    if (std::ranges::find(variable.aliases, name) != variable.aliases.end()) return &variable;
  }
  return nullptr;
}

}  // namespace magi::env
