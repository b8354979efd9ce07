// The CPU flex-attention engine: blocked online-softmax forward and backward over slice masks.
// Called by src/api after argument validation; trusts its inputs.
#pragma once

#include <cstdint>
#include <memory>

#include "magi/attention.hpp"
#include "magi/mask.hpp"

namespace magi::cpu {

// Options after defaults and env overrides were applied by the API layer.
struct EngineOptions {
  double softmax_scale = 0.0;  // already resolved (D^-0.5 by default)
  double softcap = 0.0;
  SinkLayout sink_layout = SinkLayout::None;
  bool accumulate_fp64 = false;  // Reference backend / fp64 inputs: accumulate in double
  int32_t num_threads = 0;       // 0 = all cores
};

// Planning result for (mask, shapes): tile work lists. Immutable; cached by the API layer.
struct Plan;
std::shared_ptr<const Plan> make_plan(const Mask& mask, int32_t heads_q, int32_t heads_kv, int32_t head_dim);

// Shapes are taken from args (validated). Inputs may be fp64/fp32/bf16/fp16; outputs in their own dtype
// (bf16/fp16 outputs are rounded to nearest even). Results are bitwise identical for any thread count.
void forward(const Plan& plan, const ForwardArgs& args, const EngineOptions& options);
void backward(const Plan& plan, const BackwardArgs& args, const EngineOptions& options);

}  // namespace magi::cpu
