// `magi-attn run`: attention on .npy files. The file contract (names, shapes, fp32 outputs) is stable;
// other programs depend on it.
#include <chrono>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "cli/commands.hpp"
#include "cli/host_tensor.hpp"
#include "cli/options.hpp"
#include "cli/run_files.hpp"
#include "magi/attention.hpp"
#include "magi/error.hpp"

namespace magi::cli {
namespace {

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
      std::string("Runs attention forward (and backward with --do) on .npy inputs (float32 or float64, C order):\n") +
          kRunFilesDescription,
      run_file_options());
  options.parse(args);
  if (options.help_requested()) {
    std::cout << options.help_text();
    return 0;
  }

  const RunSettings settings = parse_run_settings(options);  // cheap checks first
  RunInputs in = load_run_inputs(options, settings);
  const AttentionOptions& attention = settings.attention;
  const Mask& mask = in.mask;
  const DType dtype = in.dtype, wide = wide_dtype(dtype);
  HostTensor out_t(wide, {in.q.shape()[0], in.q.shape()[1], in.q.shape()[2]}), lse_t(wide, {in.q.shape()[0], in.q.shape()[1]});

  ForwardArgs fwd;
  fwd.q = in.q.view();
  fwd.k = in.k.view();
  fwd.v = in.v.view();
  fwd.sink = in.sink.view();
  fwd.out = out_t.view();
  fwd.lse = lse_t.view();
  const auto fwd_start = std::chrono::steady_clock::now();
  forward(mask, fwd, attention);
  const double fwd_ms = milliseconds_since(fwd_start);

  OutputFiles files;
  files.emplace_back("out.npy", as_fp32_npy(out_t));
  files.emplace_back("lse.npy", as_fp32_npy(lse_t));
  double bwd_ms = 0.0;
  if (in.has_dout()) {
    HostTensor dq_t(wide, in.q.shape()), dk_t(wide, in.k.shape()), dv_t(wide, in.v.shape()), dsink_t;
    if (in.has_sink()) dsink_t = HostTensor(DType::F32, in.sink.shape());
    BackwardArgs bwd;
    bwd.q = in.q.view();
    bwd.k = in.k.view();
    bwd.v = in.v.view();
    bwd.out = out_t.view();
    bwd.lse = lse_t.view();
    bwd.dout = in.dout.view();
    bwd.sink = in.sink.view();
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
    if (in.has_sink()) files.emplace_back("dsink.npy", as_fp32_npy(dsink_t));
  }

  write_outputs(settings.out_dir, files);
  std::ostringstream summary;
  summary << std::fixed << std::setprecision(3) << "magi-attn run: " << mask.slices.size() << " slices, area "
          << mask.area() << ", " << to_string(dtype) << " on " << to_string(resolve_backend(attention, Device{}))
          << "; forward " << fwd_ms << " ms";
  if (in.has_dout()) summary << ", backward " << bwd_ms << " ms";
  summary << "; wrote";
  for (const auto& file : files) summary << ' ' << file.first;
  std::cout << summary.str() << " to " << settings.out_dir.string() << "\n";
  return 0;
}

}  // namespace magi::cli
