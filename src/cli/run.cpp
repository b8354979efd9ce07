// `magi-attn run`: attention on .npy files. The file contract (names, shapes, fp32 outputs) is stable;
// other programs depend on it.
#include <chrono>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>

#include "cli/commands.hpp"
#include "cli/device_buffers.hpp"
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
  const bool gpu = runs_on_gpu(settings.attention.backend);  // --backend cuda without a GPU fails here
  RunInputs in = load_run_inputs(options, settings);
  AttentionOptions attention = settings.attention;
  const Mask& mask = in.mask;
  const DType dtype = in.dtype, wide = wide_dtype(dtype);
  if (gpu) attention.backend = gpu_backend(attention.backend, dtype);
  HostTensor out_t(wide, {in.q.shape()[0], in.q.shape()[1], in.q.shape()[2]}), lse_t(wide, {in.q.shape()[0], in.q.shape()[1]});
  HostTensor dq_t, dk_t, dv_t, dsink_t;
  if (in.has_dout()) {
    dq_t = HostTensor(wide, in.q.shape());
    dk_t = HostTensor(wide, in.k.shape());
    dv_t = HostTensor(wide, in.v.shape());
    if (in.has_sink()) dsink_t = HostTensor(DType::F32, in.sink.shape());
  }

  // On the GPU every tensor gets a device copy; results come back before the files are written.
  std::optional<DeviceMirror> mirror;
  if (gpu) mirror.emplace();
  auto place = [&](HostTensor& t) { return mirror ? (*mirror)(t) : t.view(); };
  const StreamHandle stream = mirror ? mirror->stream() : nullptr;
  auto finish = [&] {
    if (mirror) mirror->synchronize();
  };

  ForwardArgs fwd;
  fwd.q = place(in.q);
  fwd.k = place(in.k);
  fwd.v = place(in.v);
  fwd.sink = place(in.sink);
  fwd.out = place(out_t);
  fwd.lse = place(lse_t);
  const auto fwd_start = std::chrono::steady_clock::now();
  forward(mask, fwd, attention, stream);
  finish();
  const double fwd_ms = milliseconds_since(fwd_start);

  double bwd_ms = 0.0;
  if (in.has_dout()) {
    BackwardArgs bwd;
    bwd.q = fwd.q;
    bwd.k = fwd.k;
    bwd.v = fwd.v;
    bwd.out = fwd.out;
    bwd.lse = fwd.lse;
    bwd.dout = place(in.dout);
    bwd.sink = fwd.sink;
    bwd.dq = place(dq_t);
    bwd.dk = place(dk_t);
    bwd.dv = place(dv_t);
    bwd.dsink = place(dsink_t);
    const auto bwd_start = std::chrono::steady_clock::now();
    backward(mask, bwd, attention, stream);
    finish();
    bwd_ms = milliseconds_since(bwd_start);
  }
  if (mirror)
    for (HostTensor* t : {&out_t, &lse_t, &dq_t, &dk_t, &dv_t, &dsink_t})
      if (!t->shape().empty()) mirror->download(*t);

  OutputFiles files;
  files.emplace_back("out.npy", as_fp32_npy(out_t));
  files.emplace_back("lse.npy", as_fp32_npy(lse_t));
  if (in.has_dout()) {
    files.emplace_back("dq.npy", as_fp32_npy(dq_t));
    files.emplace_back("dk.npy", as_fp32_npy(dk_t));
    files.emplace_back("dv.npy", as_fp32_npy(dv_t));
    if (in.has_sink()) files.emplace_back("dsink.npy", as_fp32_npy(dsink_t));
  }

  write_outputs(settings.out_dir, files);
  std::ostringstream summary;
  const Device device = gpu ? Device{DeviceType::CUDA, 0} : Device{};
  const size_t planned = planned_mask(mask, attention, device).slices.size();
  summary << std::fixed << std::setprecision(3) << "magi-attn run: " << mask.slices.size() << " slices"
          << (planned != mask.slices.size() ? " (" + std::to_string(planned) + " after range merge)" : "")
          << ", area " << mask.area() << ", " << to_string(dtype) << " on "
          << to_string(resolve_backend(attention, device))
          << (gpu ? " (GPU: " + gpu_name() + ")" : std::string())
          << "; forward " << fwd_ms << " ms";
  if (in.has_dout()) summary << ", backward " << bwd_ms << " ms";
  summary << "; wrote";
  for (const auto& file : files) summary << ' ' << file.first;
  std::cout << summary.str() << " to " << settings.out_dir.string() << "\n";
  return 0;
}

}  // namespace magi::cli
