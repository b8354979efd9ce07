// `magi-attn run`: attention on .npy files. The file contract (names, shapes, fp32 outputs) is stable;
// other programs depend on it.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>
#include <utility>

#include "cli/commands.hpp"
#include "cli/host_tensor.hpp"
#include "cli/mask_file.hpp"
#include "cli/npy.hpp"
#include "cli/options.hpp"
#include "magi/attention.hpp"
#include "magi/error.hpp"

namespace magi::cli {
namespace {

namespace fs = std::filesystem;

NpyArray read_input(const Options& options, const char* name) {
  const std::string path = options.require(name);
  try {
    return read_npy(path);
  } catch (const Error& e) {
    throw InvalidArgument(std::string("--") + name + " " + e.what());
  }
}

void expect_rank(const NpyArray& a, size_t rank, const char* name, const std::string& path, const char* layout) {
  if (a.shape.size() != rank)
    throw InvalidArgument(std::string("--") + name + " " + path + ": expected shape " + layout + ", got " +
                          a.shape_string());
}

void expect_shape(const NpyArray& a, const std::vector<int64_t>& shape, const char* name, const std::string& path,
                  const std::string& meaning) {
  if (a.shape != shape) {
    NpyArray want;
    want.shape = shape;
    throw InvalidArgument(std::string("--") + name + " " + path + ": expected shape " + want.shape_string() + " (" +
                          meaning + "), got " + a.shape_string());
  }
}

// Everything is encoded in memory first; then files are written under temporary names and renamed, so
// an error leaves DIR as it was (and removes DIR if this call created it).
void write_outputs(const fs::path& dir, const std::vector<std::pair<std::string, std::vector<unsigned char>>>& files) {
  std::error_code ec;
  const bool existed = fs::exists(dir, ec);
  if (!existed && !fs::create_directories(dir, ec) && ec)
    throw InvalidArgument("--out-dir " + dir.string() + ": cannot create: " + ec.message());
  std::vector<fs::path> temporaries;
  const std::string suffix = ".tmp." + std::to_string(::getpid());
  try {
    for (const auto& [name, bytes] : files) {
      temporaries.push_back(dir / ("." + name + suffix));
      write_file(temporaries.back().string(), bytes);
    }
    for (size_t i = 0; i < files.size(); ++i) {
      fs::rename(temporaries[i], dir / files[i].first, ec);
      if (ec) throw InvalidArgument((dir / files[i].first).string() + ": cannot write: " + ec.message());
    }
  } catch (...) {
    for (const fs::path& t : temporaries) fs::remove(t, ec);
    if (!existed) fs::remove(dir, ec);
    throw;
  }
}

std::vector<unsigned char> as_fp32_npy(const HostTensor& t) {
  const std::vector<float> values = t.to_floats();
  return encode_npy(t.shape(), values);
}

double milliseconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int run_command(std::span<const std::string> args) {
  Options options(
      "run",
      "magi-attn run --mask MASK.json --q q.npy --k k.npy --v v.npy [--do do.npy] [--sink sink.npy --sink-layout sh|ssh]\n"
      "                     [--dtype bf16|fp16|fp32|fp64] [--softmax-scale X] [--softcap X]\n"
      "                     [--backend auto|cpu|cuda|reference] [--threads N] --out-dir DIR",
      "Runs attention forward (and backward with --do) on .npy inputs (float32 or float64, C order):\n"
      "q [Tq, Hq, D], k and v [Tk, Hkv, D], do like q. Writes DIR/out.npy [Tq, Hq, D] and DIR/lse.npy [Tq, Hq],\n"
      "and with --do also dq.npy, dk.npy, dv.npy (and dsink.npy with a sink), all float32. A mask JSON\n"
      "without total_q / total_k takes them from q and k. On any error nothing is written.",
      {{"mask", "MASK.json", "mask slices: {\"q_ranges\": [[s,e],...], \"k_ranges\": [...], \"attn_type_map\": [...]}"},
       {"q", "q.npy", "queries [Tq, Hq, D]"},
       {"k", "k.npy", "keys [Tk, Hkv, D] (Hq % Hkv == 0)"},
       {"v", "v.npy", "values [Tk, Hkv, D]"},
       {"do", "do.npy", "output gradient [Tq, Hq, D]: also run backward"},
       {"sink", "sink.npy", "attention sink logits: [S, Hq] (sh) or [Tq, S, Hq] (ssh)"},
       {"sink-layout", "sh|ssh", "layout of --sink"},
       {"dtype", "DTYPE", "compute dtype bf16|fp16|fp32|fp64 (default: the dtype of q.npy); inputs are rounded to it"},
       {"softmax-scale", "X", "scale of q.k (default D^-0.5)"},
       {"softcap", "X", "> 0: s = softcap * tanh(s / softcap) (default 0 = off)"},
       {"backend", "NAME", "auto|cpu|cuda|reference (default auto)"},
       {"threads", "N", "CPU threads (default 0 = all cores)"},
       {"out-dir", "DIR", "output folder, created if missing"}});
  options.parse(args);
  if (options.help_requested()) {
    std::cout << options.help_text();
    return 0;
  }

  // ---- options (cheap checks first) ----
  for (const char* name : {"mask", "q", "k", "v", "out-dir"}) options.require(name);
  const fs::path out_dir = options.require("out-dir");
  if (std::error_code ec; fs::exists(out_dir, ec) && !fs::is_directory(out_dir, ec))
    throw InvalidArgument("--out-dir " + out_dir.string() + ": exists and is not a directory");
  AttentionOptions attention;
  const bool has_sink = options.has("sink");
  if (has_sink != options.has("sink-layout"))
    throw InvalidArgument(has_sink ? "--sink needs --sink-layout sh|ssh" : "--sink-layout given without --sink");
  if (has_sink) {
    attention.sink_layout = parse_sink_layout(*options.get("sink-layout"), "--sink-layout");
    if (attention.sink_layout == SinkLayout::None)
      throw InvalidArgument("--sink-layout: '" + *options.get("sink-layout") + "' (allowed: sh, ssh)");
  }
  std::optional<DType> dtype_option;
  if (auto text = options.get("dtype")) dtype_option = parse_dtype(*text, "--dtype");
  attention.softmax_scale = options.get_double("softmax-scale");
  if (attention.softmax_scale && *attention.softmax_scale <= 0.0)
    throw InvalidArgument("--softmax-scale: must be > 0, got " + *options.get("softmax-scale"));
  attention.softcap = options.get_double("softcap").value_or(0.0);
  if (attention.softcap < 0.0) throw InvalidArgument("--softcap: must be >= 0, got " + *options.get("softcap"));
  if (auto text = options.get("backend")) attention.backend = parse_backend(*text, "--backend");
  attention.num_threads = static_cast<int32_t>(options.get_int("threads", 0, 0, 4096));

  // ---- inputs ----
  const NpyArray q = read_input(options, "q");
  const NpyArray k = read_input(options, "k");
  const NpyArray v = read_input(options, "v");
  expect_rank(q, 3, "q", *options.get("q"), "[Tq, Hq, D]");
  expect_rank(k, 3, "k", *options.get("k"), "[Tk, Hkv, D]");
  const int64_t tq = q.shape[0], hq = q.shape[1], d = q.shape[2], tk = k.shape[0], hkv = k.shape[1];
  expect_shape(k, {tk, hkv, d}, "k", *options.get("k"), "[Tk, Hkv, D] with D = " + std::to_string(d) + " from q");
  expect_shape(v, {tk, hkv, d}, "v", *options.get("v"), "like k");
  constexpr int64_t kMaxTokens = 0x7fffffff;
  if (tq > kMaxTokens || tk > kMaxTokens) throw InvalidArgument("--q/--k: token counts must fit in int32");
  std::optional<NpyArray> dout, sink;
  if (options.has("do")) {
    dout = read_input(options, "do");
    expect_shape(*dout, {tq, hq, d}, "do", *options.get("do"), "like q");
  }
  if (has_sink) {
    sink = read_input(options, "sink");
    const std::string path = *options.get("sink");
    if (attention.sink_layout == SinkLayout::SH) {
      expect_rank(*sink, 2, "sink", path, "[S, Hq] for layout sh");
      expect_shape(*sink, {sink->shape[0], hq}, "sink", path, "[S, Hq] for layout sh, Hq = " + std::to_string(hq));
    } else {
      expect_rank(*sink, 3, "sink", path, "[Tq, S, Hq] for layout ssh");
      expect_shape(*sink, {tq, sink->shape[1], hq}, "sink", path,
                   "[Tq, S, Hq] for layout ssh, Tq = " + std::to_string(tq) + ", Hq = " + std::to_string(hq));
    }
  }
  if (!dtype_option && (k.dtype != q.dtype || v.dtype != q.dtype))
    throw InvalidArgument("--q, --k, --v: mixed dtypes (q " + std::string(to_string(q.dtype)) + ", k " +
                          std::string(to_string(k.dtype)) + ", v " + std::string(to_string(v.dtype)) +
                          "); pass --dtype to choose the compute dtype");
  const DType dtype = dtype_option.value_or(q.dtype);
  Mask mask;
  try {
    mask = load_mask_file(*options.get("mask"), static_cast<int32_t>(tq), static_cast<int32_t>(tk));
  } catch (const Error& e) {
    throw InvalidArgument(std::string("--mask ") + e.what());
  }

  // ---- compute: fp64 keeps fp64 intermediates; every other dtype gets fp32 outputs and gradients ----
  const DType wide = dtype == DType::F64 ? DType::F64 : DType::F32;
  HostTensor q_t = HostTensor::from_values(dtype, q.shape, q.values);
  HostTensor k_t = HostTensor::from_values(dtype, k.shape, k.values);
  HostTensor v_t = HostTensor::from_values(dtype, v.shape, v.values);
  HostTensor out_t(wide, {tq, hq, d}), lse_t(wide, {tq, hq});
  HostTensor sink_t;
  if (sink) sink_t = HostTensor::from_values(DType::F32, sink->shape, sink->values);

  ForwardArgs fwd;
  fwd.q = q_t.view();
  fwd.k = k_t.view();
  fwd.v = v_t.view();
  fwd.sink = sink_t.view();
  fwd.out = out_t.view();
  fwd.lse = lse_t.view();
  const auto fwd_start = std::chrono::steady_clock::now();
  forward(mask, fwd, attention);
  const double fwd_ms = milliseconds_since(fwd_start);

  std::vector<std::pair<std::string, std::vector<unsigned char>>> files;
  files.emplace_back("out.npy", as_fp32_npy(out_t));
  files.emplace_back("lse.npy", as_fp32_npy(lse_t));
  double bwd_ms = 0.0;
  if (dout) {
    std::vector<double> rounded(dout->values.size());
    for (size_t i = 0; i < rounded.size(); ++i) rounded[i] = round_to(dtype, dout->values[i]);
    HostTensor dout_t = HostTensor::from_values(wide, dout->shape, rounded);
    HostTensor dq_t(wide, q.shape), dk_t(wide, k.shape), dv_t(wide, v.shape), dsink_t;
    if (sink) dsink_t = HostTensor(DType::F32, sink->shape);
    BackwardArgs bwd;
    bwd.q = q_t.view();
    bwd.k = k_t.view();
    bwd.v = v_t.view();
    bwd.out = out_t.view();
    bwd.lse = lse_t.view();
    bwd.dout = dout_t.view();
    bwd.sink = sink_t.view();
    bwd.dq = dq_t.view();
    bwd.dk = dk_t.view();
    bwd.dv = dv_t.view();
    bwd.dsink = dsink_t.view();
    const auto bwd_start = std::chrono::steady_clock::now();
    backward(mask, bwd, attention);
    bwd_ms = milliseconds_since(bwd_start);
    files.emplace_back("dq.npy", as_fp32_npy(dq_t));
    files.emplace_back("dk.npy", as_fp32_npy(dk_t));
    files.emplace_back("dv.npy", as_fp32_npy(dv_t));
    if (sink) files.emplace_back("dsink.npy", as_fp32_npy(dsink_t));
  }

  write_outputs(out_dir, files);
  std::ostringstream summary;
  summary << std::fixed << std::setprecision(3) << "magi-attn run: " << mask.slices.size() << " slices, area "
          << mask.area() << ", " << to_string(dtype) << " on " << to_string(resolve_backend(attention, Device{}))
          << "; forward " << fwd_ms << " ms";
  if (dout) summary << ", backward " << bwd_ms << " ms";
  summary << "; wrote";
  for (const auto& file : files) summary << ' ' << file.first;
  std::cout << summary.str() << " to " << out_dir.string() << "\n";
  return 0;
}

}  // namespace magi::cli
