// The file contract of `magi-attn run` and `magi-attn dist-run`: the options that name the inputs, reading
// and checking the .npy files and the mask, and writing the fp32 outputs (all or nothing). Other programs
// depend on the names, shapes and dtypes here.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cli/host_tensor.hpp"
#include "cli/options.hpp"
#include "magi/attention.hpp"
#include "magi/mask.hpp"

namespace magi::cli {

// --mask --q --k --v --do --sink --sink-layout --dtype --softmax-scale --softcap --backend --threads --out-dir
std::vector<OptionSpec> run_file_options();
// The help paragraph describing those files.
extern const char* const kRunFilesDescription;

struct RunSettings {
  AttentionOptions attention;
  std::optional<DType> dtype;  // unset = the dtype of q.npy
  std::filesystem::path out_dir;
};
// Cheap checks of the options above (no file is read).
RunSettings parse_run_settings(const Options& options);

struct RunInputs {
  Mask mask;
  DType dtype = DType::F32;  // compute dtype
  HostTensor q, k, v;        // in the compute dtype
  HostTensor dout;           // in wide_dtype(dtype), rounded to dtype; empty without --do
  HostTensor sink;           // fp32; empty without --sink
  bool has_dout() const { return !dout.shape().empty(); }
  bool has_sink() const { return !sink.shape().empty(); }
};
// Reads and checks every input file; errors name the option and the file.
RunInputs load_run_inputs(const Options& options, const RunSettings& settings);

// Outputs and gradients are kept at fp64 for fp64 inputs and fp32 otherwise (files are fp32 either way).
inline DType wide_dtype(DType dtype) { return dtype == DType::F64 ? DType::F64 : DType::F32; }

using OutputFiles = std::vector<std::pair<std::string, std::vector<unsigned char>>>;
std::vector<unsigned char> as_fp32_npy(const HostTensor& t);
// Writes every file under a temporary name, then renames them: an error leaves DIR as it was (and removes
// DIR if this call created it).
void write_outputs(const std::filesystem::path& dir, const OutputFiles& files);

}  // namespace magi::cli
