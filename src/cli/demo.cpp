// `magi-attn demo`: the main job. Packed documents with long-tailed lengths, block-causal inside each
// document; forward and backward on the best available backend, timed, and checked against the fp64
// reference on sampled rows.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "cli/accuracy.hpp"
#include "cli/commands.hpp"
#include "cli/device_buffers.hpp"
#include "cli/documents.hpp"
#include "cli/host_tensor.hpp"
#include "cli/options.hpp"
#include "cli/progress.hpp"
#include "magi/attention.hpp"
#include "magi/error.hpp"
#include "magi/flops.hpp"
#include "magi/mask.hpp"

namespace magi::cli {
namespace {

void fill_normal(HostTensor& t, NormalSampler& normal) {
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, normal());
}

// Repeats `call` (up to 21 times while the total stays under ~2 s) and returns the median time (the lower one of an
// even count) and the number of calls it is the median of. The first call also builds the plan: it counts only where
// it is the only one (a call that takes seconds on the CPU is not run twice for a warm-up).
template <class Call>
std::pair<double, int> median_seconds(Call&& call) {
  std::vector<double> times;
  double total = 0.0;
  while (times.empty() || (times.size() < 21 && total < 2.0)) {
    const auto start = std::chrono::steady_clock::now();
    call();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    total += times.back();
  }
  if (times.size() > 1) times.erase(times.begin());  // the warm-up
  std::sort(times.begin(), times.end());
  return {times[(times.size() - 1) / 2], static_cast<int>(times.size())};
}

// The rows `rows` of `mask` as a small problem: sub-row i is original row rows[i], with the same kept keys.
Mask row_submask(const Mask& mask, const std::vector<int32_t>& rows) {
  Mask sub;
  sub.total_q = static_cast<int32_t>(rows.size());
  sub.total_k = mask.total_k;
  for (int32_t i = 0; i < sub.total_q; ++i)
    for (const Slice& s : mask.slices) {
      const Range keys = kept_keys(s, rows[i]);
      if (!keys.empty()) sub.slices.push_back(Slice{{i, i + 1}, keys, MaskType::Full});
    }
  return sub;
}

// Copies rows `rows` of a [T, H, D] (or [T, H]) tensor into doubles.
std::vector<double> gather_rows(const HostTensor& t, const std::vector<int32_t>& rows) {
  int64_t row_size = 1;
  for (size_t i = 1; i < t.shape().size(); ++i) row_size *= t.shape()[i];
  std::vector<double> out;
  out.reserve(rows.size() * row_size);
  for (int32_t r : rows)
    for (int64_t j = 0; j < row_size; ++j) out.push_back(t.get(int64_t{r} * row_size + j));
  return out;
}

}  // namespace

int demo_command(std::span<const std::string> args) {
  Options options(
      "demo",
      "magi-attn demo [--tokens N] [--heads-q H] [--heads-kv H] [--head-dim D] [--dtype DTYPE] [--backend NAME]\n"
      "                      [--seed S] [--threads N] [--block B] [--check-rows R]",
      "Packed-documents attention like LLM training: document lengths drawn from a long-tailed (lognormal)\n"
      "distribution, block-causal inside each document. Runs forward and backward on the best available\n"
      "backend, reports time and FLOP/s, and checks out, lse and dq of sampled rows against the fp64\n"
      "reference (SPEC accuracy rules). Exit status 1 if the check fails.\n"
      "`magi-attn mask --preset documents --tq N --seed S` shows the mask of a run with --tokens N --seed S.",
      {{"tokens", "N", "total tokens (default 8192)"},
       {"heads-q", "H", "query heads (default 8)"},
       {"heads-kv", "H", "key/value heads, divides --heads-q (default 2)"},
       {"head-dim", "D", "head dimension, a multiple of 8 (default 128)"},
       {"dtype", "DTYPE", "bf16|fp16|fp32|fp64 (default fp32 on the CPU, bf16 on CUDA)"},
       {"backend", "NAME", "auto|cpu|cuda|reference (default auto: GPU 0 when present, else cpu)"},
       {"seed", "S", "seed of documents and inputs (default: random, printed)"},
       {"threads", "N", "CPU threads (default 0 = all cores)"},
       {"block", "B", "block size of the block-causal mask inside documents (default 128)"},
       {"check-rows", "R", "rows sampled for the reference check (default 32)"}});
  options.parse(args);
  if (options.help_requested()) {
    std::cout << options.help_text();
    return 0;
  }
  const int32_t tokens = static_cast<int32_t>(options.get_int("tokens", 8192, 1, 1 << 26));
  const int32_t heads_q = static_cast<int32_t>(options.get_int("heads-q", 8, 1, 1024));
  const int32_t heads_kv = static_cast<int32_t>(options.get_int("heads-kv", std::min(2, heads_q), 1, 1024));
  const int32_t head_dim = static_cast<int32_t>(options.get_int("head-dim", 128, 8, 1024));
  if (head_dim % 8 != 0)  // checked before any work starts (the API would say so only at the first call)
    throw InvalidArgument("--head-dim " + std::to_string(head_dim) + ": must be a multiple of 8 (allowed: 8, 16, .., 1024)");
  const int32_t block = static_cast<int32_t>(options.get_int("block", 128, 1, 1 << 26));
  const int32_t check_rows = static_cast<int32_t>(options.get_int("check-rows", 32, 1, 4096));
  if (heads_q % heads_kv != 0)
    throw InvalidArgument("--heads-kv " + std::to_string(heads_kv) + " must divide --heads-q " +
                          std::to_string(heads_q));
  const uint64_t seed = options.has("seed") ? static_cast<uint64_t>(options.get_int("seed", 0, 0, INT64_MAX))
                                            : std::random_device{}() & 0xffffffffu;
  AttentionOptions attention;
  if (auto text = options.get("backend")) attention.backend = parse_backend(*text, "--backend");
  attention.num_threads = get_threads(options);
  const bool gpu = runs_on_gpu(attention.backend);  // --backend cuda without a GPU fails here
  const DType dtype = options.has("dtype") ? parse_dtype(*options.get("dtype"), "--dtype")
                      : gpu && attention.backend != Backend::Reference ? DType::BF16
                                                                      : DType::F32;
  if (gpu) attention.backend = gpu_backend(attention.backend, dtype);
  const Device device = gpu ? Device{DeviceType::CUDA, 0} : Device{};
  const Backend backend = resolve_backend(attention, device);
  const DType wide = dtype == DType::F64 ? DType::F64 : DType::F32;
  // The host tensors (q, k, v, dout in the dtype; out, dq, dk, dv in fp32 / fp64) must fit this machine's memory:
  // say so in one line up front rather than fail an allocation after the first progress line.
  const double q_elements = static_cast<double>(tokens) * heads_q * head_dim,
               kv_elements = static_cast<double>(tokens) * heads_kv * head_dim;
  const double need = (2 * q_elements + 2 * kv_elements) * (dtype_size(dtype) + dtype_size(wide));
  const double have = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  if (have > 0 && need > have) {
    char text[160];
    std::snprintf(text, sizeof text, "the inputs and outputs need %.1f GiB of host memory, this machine has %.1f GiB",
                  need / (1 << 30), have / (1 << 30));
    throw InvalidArgument("--tokens / --heads-q / --heads-kv / --head-dim: " + std::string(text) +
                          " (allowed: smaller sizes)");
  }

  Progress progress("magi-attn demo:");
  progress.begin("building mask and inputs");
  const std::vector<int32_t> cu_seqlens = draw_documents(tokens, seed);
  const Mask mask = masks::varlen_block_causal(cu_seqlens, block);
  const int64_t area = mask.area();
  NormalSampler normal(seed ^ 0x9e3779b97f4a7c15ull);  // inputs independent of the document draw
  HostTensor q(dtype, {tokens, heads_q, head_dim}), k(dtype, {tokens, heads_kv, head_dim}),
      v(dtype, {tokens, heads_kv, head_dim}), dout(wide, {tokens, heads_q, head_dim});
  for (HostTensor* t : {&q, &k, &v}) fill_normal(*t, normal);
  for (int64_t i = 0; i < dout.numel(); ++i) dout.set(i, round_to(dtype, normal()));
  const double nan = std::numeric_limits<double>::quiet_NaN();
  HostTensor out(wide, {tokens, heads_q, head_dim}), lse(wide, {tokens, heads_q});
  HostTensor dq(wide, q.shape()), dk(wide, k.shape()), dv(wide, v.shape());
  for (HostTensor* t : {&out, &lse, &dq, &dk, &dv}) t->fill(nan);
  progress.end();

  // On the GPU every tensor gets a device copy (uploaded once); the timed calls include a stream sync.
  std::optional<DeviceMirror> mirror;
  if (gpu) mirror.emplace();
  auto place = [&](HostTensor& t) { return mirror ? (*mirror)(t) : t.view(); };
  const StreamHandle stream = mirror ? mirror->stream() : nullptr;
  auto finish = [&] {
    if (mirror) mirror->synchronize();
  };
  ForwardArgs fwd;
  fwd.q = place(q);
  fwd.k = place(k);
  fwd.v = place(v);
  fwd.out = place(out);
  fwd.lse = place(lse);
  progress.begin("forward");
  const auto [fwd_seconds, fwd_runs] = median_seconds([&] {
    forward(mask, fwd, attention, stream);
    finish();
  });
  progress.end();

  BackwardArgs bwd;
  bwd.q = fwd.q;
  bwd.k = fwd.k;
  bwd.v = fwd.v;
  bwd.out = fwd.out;
  bwd.lse = fwd.lse;
  bwd.dout = place(dout);
  bwd.dq = place(dq);
  bwd.dk = place(dk);
  bwd.dv = place(dv);
  progress.begin("backward");
  const auto [bwd_seconds, bwd_runs] = median_seconds([&] {
    backward(mask, bwd, attention, stream);
    finish();
  });
  progress.end();
  if (mirror)
    for (HostTensor* t : {&out, &lse, &dq}) mirror->download(*t);

  // ---- check sampled rows against the fp64 reference on the same (rounded) inputs ----
  progress.begin("checking against the fp64 reference");
  std::mt19937_64 pick(seed + 1);
  // Selection sampling (Knuth's algorithm S): distinct sorted rows, uniform, without a list of all rows.
  std::vector<int32_t> rows;
  for (int32_t row = 0; row < tokens && static_cast<int32_t>(rows.size()) < check_rows; ++row) {
    const uint64_t needed = static_cast<uint64_t>(check_rows - static_cast<int32_t>(rows.size()));
    if (std::uniform_int_distribution<uint64_t>(0, static_cast<uint64_t>(tokens - row) - 1)(pick) < needed)
      rows.push_back(row);
  }
  const Mask sub = row_submask(mask, rows);
  const int64_t n = static_cast<int64_t>(rows.size());
  HostTensor q_ref = HostTensor::from_values(DType::F64, {n, heads_q, head_dim}, gather_rows(q, rows));
  HostTensor dout_ref = HostTensor::from_values(DType::F64, {n, heads_q, head_dim}, gather_rows(dout, rows));
  HostTensor k_ref = HostTensor::from_values(DType::F64, k.shape(), k.to_doubles());
  HostTensor v_ref = HostTensor::from_values(DType::F64, v.shape(), v.to_doubles());
  HostTensor out_ref(DType::F64, {n, heads_q, head_dim}), lse_ref(DType::F64, {n, heads_q});
  HostTensor dq_ref(DType::F64, q_ref.shape()), dk_ref(DType::F64, k.shape()), dv_ref(DType::F64, v.shape());
  for (HostTensor* t : {&out_ref, &lse_ref, &dq_ref}) t->fill(nan);
  AttentionOptions reference = attention;
  reference.backend = Backend::Reference;  // on host tensors: the CPU fp64 engine
  ForwardArgs ref_fwd;
  ref_fwd.q = q_ref.view();
  ref_fwd.k = k_ref.view();
  ref_fwd.v = v_ref.view();
  ref_fwd.out = out_ref.view();
  ref_fwd.lse = lse_ref.view();
  forward(sub, ref_fwd, reference);
  // dq of a row depends only on that row (its keys, lse and dout . out), so the sub-problem gives it exactly.
  BackwardArgs ref_bwd;
  ref_bwd.q = q_ref.view();
  ref_bwd.k = k_ref.view();
  ref_bwd.v = v_ref.view();
  ref_bwd.out = out_ref.view();
  ref_bwd.lse = lse_ref.view();
  ref_bwd.dout = dout_ref.view();
  ref_bwd.dq = dq_ref.view();
  ref_bwd.dk = dk_ref.view();
  ref_bwd.dv = dv_ref.view();
  backward(sub, ref_bwd, reference);
  const Tolerance tol = tolerance_for(dtype);
  const double out_err = relative_error(gather_rows(out, rows), out_ref.to_doubles(), tol.max_relative);
  const double lse_err = lse_error(gather_rows(lse, rows), lse_ref.to_doubles());
  const double dq_err = relative_error(gather_rows(dq, rows), dq_ref.to_doubles(), tol.max_relative);
  progress.end();

  // ---- summary ----
  int32_t shortest = tokens, longest = 0;
  for (size_t i = 1; i < cu_seqlens.size(); ++i) {
    shortest = std::min(shortest, cu_seqlens[i] - cu_seqlens[i - 1]);
    longest = std::max(longest, cu_seqlens[i] - cu_seqlens[i - 1]);
  }
  const int threads = attention.num_threads > 0 ? attention.num_threads
                                                : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const bool pass_out = out_err <= tol.out, pass_lse = lse_err <= tol.lse, pass_dq = dq_err <= tol.grad;
  const bool pass = pass_out && pass_lse && pass_dq;
  const char* metric = tol.max_relative ? "max rel" : "rel L2";
  char line[256];
  std::ostringstream os;
  os << "magi-attn demo: packed documents, forward + backward on " << to_string(backend)
     << (gpu ? " (GPU: " + gpu_name() + ")" : " (" + std::to_string(threads) + " threads)") << ", " << to_string(dtype)
     << ", seed " << seed << "\n";
  os << "  mask      " << cu_seqlens.size() - 1 << " documents of " << shortest << " .. " << longest
     << " tokens (lognormal), block-causal inside (block " << block << "): " << mask.slices.size() << " slices\n";
  std::snprintf(line, sizeof line, "%.2f%%", 100.0 * mask.density());
  os << "            area " << with_commas(area) << " of " << with_commas(int64_t{tokens} * tokens) << " cells (density "
     << line << ")\n";
  os << "  shapes    q [" << tokens << ", " << heads_q << ", " << head_dim << "], k/v [" << tokens << ", " << heads_kv
     << ", " << head_dim << "]\n";
  auto timing = [&](const char* name, double seconds, int runs, double flops) {
    const std::string runs_text =
        runs == 1 ? "1 run" : "median of " + std::to_string(runs) + " runs after a warm-up";
    // GPU calls take well under a second: milliseconds keep their digits.
    std::snprintf(line, sizeof line, "  %-9s %8.3f %s  %s  (%s)\n", name, seconds < 1.0 ? seconds * 1e3 : seconds,
                  seconds < 1.0 ? "ms" : "s ", rate_text(flops, seconds).c_str(),
                  runs_text.c_str());
    os << line;
  };
  timing("forward", fwd_seconds, fwd_runs, flops_forward(area, heads_q, head_dim));
  timing("backward", bwd_seconds, bwd_runs, flops_backward(area, heads_q, head_dim));
  os << "  check     " << n << " sampled rows against the fp64 reference (" << sub.slices.size() << " row slices)\n";
  auto verdict = [&](const char* name, const char* how, double err, double limit, bool ok) {
    std::snprintf(line, sizeof line, "            %-4s %-8s %.3e  (limit %.0e)  %s\n", name, how, err, limit,
                  ok ? "PASS" : "FAIL");
    os << line;
  };
  verdict("out", metric, out_err, tol.out, pass_out);
  verdict("lse", "max abs", lse_err, tol.lse, pass_lse);
  verdict("dq", metric, dq_err, tol.grad, pass_dq);
  os << "  result    " << (pass ? "PASS" : "FAIL") << "\n";
  std::cout << os.str() << std::flush;
  return pass ? 0 : 1;
}

}  // namespace magi::cli
