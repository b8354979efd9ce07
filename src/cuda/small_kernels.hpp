// Launchers of the small kernels every family uses (src/cuda/small_kernels.cu). Host-only header.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace magi::cuda::detail {

void launch_fill(float* data, int64_t n, float value, cudaStream_t stream);
void launch_add(float* dst, const float* src, int64_t n, cudaStream_t stream);  // dst += src
// Delta = dout . out per (row, head); converts fp32 dout to 16-bit into dout16 when given; per-row dsink
// for the ssh layout.
struct PreprocessArgs {
  const void* out;
  int out_fp32;
  const void* dout;
  int dout_fp32;
  void* dout16;  // null unless dout is fp32
  float* dq_zero;  // dq_zero_floats fp32 set to 0 (the dq atomics' target), or null; 16-byte aligned
  int64_t dq_zero_floats;  // a multiple of 4
  const float* lse;  // [Tq, Hq], natural log
  float* delta;      // out: [Hq][tq_pad] (stats_index)
  float* lse2;       // out: [Hq][tq_pad] (stats_index), log2 units, empty rows 0
  int tq_pad;
  int cat_group;     // BwdParams::cat_group (1: one head at a time)
  const float* sink;
  float* dsink;
  int sink_kind, sink_len;
  int tq, hq, d;
};
void launch_preprocess(int dtype, const PreprocessArgs& args, cudaStream_t stream);
// dst (16-bit, dtype tag) = src (fp32), n elements: 16-byte loads where n and the pointers allow, else one
// element per thread.
void launch_convert(int dtype, const float* src, void* dst, int64_t n, cudaStream_t stream);
// dq (16-bit, dtype tag; or fp32 with out_fp32, added to with accumulate) from the Hopper backward's dq_accum in
// fragment order (cuda/params.hpp: dq_fragment_base) of a tile_d-column tile; d <= tile_d, a multiple of 8.
void launch_convert_fragments(int dtype, bool out_fp32, bool accumulate, const float* fragments, void* dq, int tq,
                              int hq, int d, int tile_d, cudaStream_t stream);
// dsink for the sh layout: a fixed-order reduction over rows per (s, head).
void launch_dsink_sh(const float* sink, const float* lse, const float* delta, int tq_pad, int cat_group, float* dsink,
                     int sink_len, int tq, int hq, cudaStream_t stream);

void check_launch(const char* what);  // throws magi::Error with the CUDA error string

}  // namespace magi::cuda::detail
