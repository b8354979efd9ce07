#include "cli/run_files.hpp"

#include <unistd.h>

#include <cstdint>
#include <limits>

#include "cli/mask_file.hpp"
#include "cli/npy.hpp"
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

}  // namespace

const char* const kRunFilesDescription =
    "q [Tq, Hq, D], k and v [Tk, Hkv, D], do like q. Writes DIR/out.npy [Tq, Hq, D] and DIR/lse.npy [Tq, Hq],\n"
    "and with --do also dq.npy, dk.npy, dv.npy (and dsink.npy with a sink), all float32. A mask JSON\n"
    "without total_q / total_k takes them from q and k. On any error nothing is written.";

std::vector<OptionSpec> run_file_options() {
  return {{"mask", "MASK.json", "mask slices: {\"q_ranges\": [[s,e],...], \"k_ranges\": [...], \"attn_type_map\": [...]}"},
          {"q", "q.npy", "queries [Tq, Hq, D]"},
          {"k", "k.npy", "keys [Tk, Hkv, D] (Hq % Hkv == 0)"},
          {"v", "v.npy", "values [Tk, Hkv, D]"},
          {"do", "do.npy", "output gradient [Tq, Hq, D]: also run backward"},
          {"sink", "sink.npy", "attention sink logits: [S, Hq] (sh) or [Tq, S, Hq] (ssh)"},
          {"sink-layout", "sh|ssh", "layout of --sink"},
          {"dtype", "DTYPE", "compute dtype bf16|fp16|fp32|fp64 (default: the dtype of q.npy); inputs are rounded to it"},
          {"softmax-scale", "X", "scale of q.k (default D^-0.5)"},
          {"softcap", "X", "> 0: s = softcap * tanh(s / softcap) (default 0 = off)"},
          {"backend", "NAME", "auto|cpu|cuda|reference (default auto: GPU 0 when present, else cpu; on the GPU, fp32/fp64\n"
           "                        run on the exact reference engine, bf16/fp16 on the cuda kernels)"},
          {"threads", "N", "CPU threads (default 0 = all cores)"},
          {"out-dir", "DIR", "output folder, created if missing"}};
}

RunSettings parse_run_settings(const Options& options) {
  for (const char* name : {"mask", "q", "k", "v", "out-dir"}) options.require(name);
  RunSettings s;
  s.out_dir = options.require("out-dir");
  if (s.out_dir.empty()) throw InvalidArgument("--out-dir: empty path (allowed: a folder, created if missing)");
  if (std::error_code ec; fs::exists(s.out_dir, ec) && !fs::is_directory(s.out_dir, ec))
    throw InvalidArgument("--out-dir " + s.out_dir.string() + ": exists and is not a directory");
  AttentionOptions& attention = s.attention;
  const bool has_sink = options.has("sink");
  if (has_sink != options.has("sink-layout"))
    throw InvalidArgument(has_sink ? "--sink needs --sink-layout sh|ssh" : "--sink-layout given without --sink");
  if (has_sink) {
    const std::string layout = *options.get("sink-layout");
    if (layout != "sh" && layout != "ssh") throw InvalidArgument("--sink-layout: '" + layout + "' (allowed: sh, ssh)");
    attention.sink_layout = parse_sink_layout(layout, "--sink-layout");
  }
  // An output must not replace an input: which outputs are written depends on --do and --sink.
  std::vector<std::string> outputs = {"out.npy", "lse.npy"};
  if (options.has("do")) outputs.insert(outputs.end(), {"dq.npy", "dk.npy", "dv.npy"});
  if (options.has("do") && has_sink) outputs.push_back("dsink.npy");
  for (const char* input : {"mask", "q", "k", "v", "do", "sink"})
    if (auto path = options.get(input))
      for (const std::string& name : outputs)
        if (same_file(*path, s.out_dir / name))
          throw InvalidArgument("--out-dir " + s.out_dir.string() + ": its " + name + " is the --" + input +
                                " input " + *path + " (outputs must not overwrite inputs; choose another --out-dir)");
  if (auto text = options.get("dtype")) s.dtype = parse_dtype(*text, "--dtype");
  // The kernels compute in fp32: the library refuses what fp32 cannot hold; say so naming the option, before any file
  // is read.
  constexpr double kFp32Max = std::numeric_limits<float>::max(), kFp32MinNormal = std::numeric_limits<float>::min();
  attention.softmax_scale = options.get_double("softmax-scale");
  if (attention.softmax_scale && (*attention.softmax_scale <= 0.0 || *attention.softmax_scale > kFp32Max))
    throw InvalidArgument("--softmax-scale: must be > 0 and at most 3.4e38 (fp32's largest), got " +
                          *options.get("softmax-scale"));
  attention.softcap = options.get_double("softcap").value_or(0.0);
  if (attention.softcap < 0.0 || attention.softcap > kFp32Max ||
      (attention.softcap > 0.0 && attention.softcap < kFp32MinNormal))
    throw InvalidArgument("--softcap: must be 0 (off) or in [1.2e-38, 3.4e38] (fp32's normal range), got " +
                          *options.get("softcap"));
  if (auto text = options.get("backend")) attention.backend = parse_backend(*text, "--backend");
  attention.num_threads = get_threads(options);
  return s;
}

RunInputs load_run_inputs(const Options& options, const RunSettings& settings) {
  const NpyArray q = read_input(options, "q");
  const NpyArray k = read_input(options, "k");
  const NpyArray v = read_input(options, "v");
  expect_rank(q, 3, "q", *options.get("q"), "[Tq, Hq, D]");
  expect_rank(k, 3, "k", *options.get("k"), "[Tk, Hkv, D]");
  const int64_t tq = q.shape[0], hq = q.shape[1], d = q.shape[2], tk = k.shape[0], hkv = k.shape[1];
  expect_shape(k, {tk, hkv, d}, "k", *options.get("k"), "[Tk, Hkv, D] with D = " + std::to_string(d) + " from q");
  expect_shape(v, {tk, hkv, d}, "v", *options.get("v"), "like k");
  // Tokens, heads and head size are int32 in the library (and in dist-run's header).
  for (const auto& [a, name] : {std::pair{&q, "q"}, std::pair{&k, "k"}})
    for (const int64_t extent : a->shape)
      if (extent > INT32_MAX)
        throw InvalidArgument(std::string("--") + name + " " + *options.get(name) + ": shape " + a->shape_string() +
                              ": each extent must be at most " + std::to_string(INT32_MAX));
  std::optional<NpyArray> dout, sink;
  if (options.has("do")) {
    dout = read_input(options, "do");
    expect_shape(*dout, {tq, hq, d}, "do", *options.get("do"), "like q");
  }
  const SinkLayout layout = settings.attention.sink_layout;
  if (layout != SinkLayout::None) {
    sink = read_input(options, "sink");
    const std::string path = *options.get("sink");
    if (layout == SinkLayout::SH) {
      expect_rank(*sink, 2, "sink", path, "[S, Hq] for layout sh");
      if (sink->shape[0] > INT32_MAX) throw InvalidArgument("--sink " + path + ": S above " + std::to_string(INT32_MAX));
      expect_shape(*sink, {sink->shape[0], hq}, "sink", path, "[S, Hq] for layout sh, Hq = " + std::to_string(hq));
    } else {
      expect_rank(*sink, 3, "sink", path, "[Tq, S, Hq] for layout ssh");
      if (sink->shape[1] > INT32_MAX) throw InvalidArgument("--sink " + path + ": S above " + std::to_string(INT32_MAX));
      expect_shape(*sink, {tq, sink->shape[1], hq}, "sink", path,
                   "[Tq, S, Hq] for layout ssh, Tq = " + std::to_string(tq) + ", Hq = " + std::to_string(hq));
    }
  }
  if (!settings.dtype && (k.dtype != q.dtype || v.dtype != q.dtype))
    throw InvalidArgument("--q, --k, --v: mixed dtypes (q " + std::string(to_string(q.dtype)) + ", k " +
                          std::string(to_string(k.dtype)) + ", v " + std::string(to_string(v.dtype)) +
                          "); pass --dtype to choose the compute dtype");
  RunInputs in;
  in.dtype = settings.dtype.value_or(q.dtype);
  try {
    in.mask = load_mask_file(*options.get("mask"), static_cast<int32_t>(tq), static_cast<int32_t>(tk));
  } catch (const Error& e) {
    throw InvalidArgument(std::string("--mask ") + e.what());
  }
  in.q = HostTensor::from_values(in.dtype, q.shape, q.values);
  in.k = HostTensor::from_values(in.dtype, k.shape, k.values);
  in.v = HostTensor::from_values(in.dtype, v.shape, v.values);
  if (dout) {
    std::vector<double> rounded(dout->values.size());
    for (size_t i = 0; i < rounded.size(); ++i) rounded[i] = round_to(in.dtype, dout->values[i]);
    in.dout = HostTensor::from_values(wide_dtype(in.dtype), dout->shape, rounded);
  }
  if (sink) in.sink = HostTensor::from_values(DType::F32, sink->shape, sink->values);
  return in;
}

std::vector<unsigned char> as_fp32_npy(const HostTensor& t) {
  const std::vector<float> values = t.to_floats();
  return encode_npy(t.shape(), values);
}

void write_outputs(const fs::path& dir, const OutputFiles& files) {
  std::error_code ec;
  const bool existed = fs::exists(dir, ec);
  // A rename that must fail (a folder in the way) fails here, before the first rename could leave a partial set.
  for (const auto& [name, bytes] : files)
    if (fs::is_directory(dir / name, ec))
      throw InvalidArgument("--out-dir " + dir.string() + ": cannot write " + name + ": " + (dir / name).string() +
                            " is a directory");
  // The folders this call creates (DIR and any missing parents), innermost first, so that an error removes them all.
  std::vector<fs::path> created;
  if (!existed) {
    for (fs::path p = dir; !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
      created.push_back(p);
      if (p == p.parent_path()) break;
    }
    if (!fs::create_directories(dir, ec) && ec)
      throw InvalidArgument("--out-dir " + dir.string() + ": cannot create: " + ec.message());
  }
  std::vector<fs::path> temporaries;
  const std::string suffix = ".tmp." + std::to_string(::getpid());
  try {
    for (const auto& [name, bytes] : files) {
      temporaries.push_back(dir / ("." + name + suffix));
      try {
        write_file(temporaries.back().string(), bytes);
      } catch (const Error& e) {
        // write_file names the temporary; the user knows the option and the output's name.
        const std::string what = e.what(), temporary = temporaries.back().string();
        const std::string problem = what.starts_with(temporary + ": ") ? what.substr(temporary.size() + 2) : what;
        throw InvalidArgument("--out-dir " + dir.string() + ": cannot write " + name + ": " + problem);
      }
    }
    for (size_t i = 0; i < files.size(); ++i) {
      fs::rename(temporaries[i], dir / files[i].first, ec);
      if (ec) throw InvalidArgument((dir / files[i].first).string() + ": cannot write: " + ec.message());
    }
  } catch (...) {
    for (const fs::path& t : temporaries) fs::remove(t, ec);
    for (const fs::path& p : created) fs::remove(p, ec);  // only empty folders go
    throw;
  }
}

}  // namespace magi::cli
