// A cost model of distributed attention on GPUs: predicted time and TFLOP/s per GPU for a mask, cp and
// hardware, for the magi-attn runtime (src/distributed/gpu_runtime.cpp) and the zigzag ring baseline
// (bench/distributed/gpu_dist_attn_throughput.cpp). Pure host code; it builds the same dispatch and comm plan the
// runtime would, for every rank at once.
//
// Model (all inputs in HardwareModel, calibrated on the single-GPU kernel):
//  - Kernel call on mask M: launches * launch_overhead + cells(M) * flops_per_cell / rate + per-call
//    memory traffic / hbm. cells(M) = tiles visited by the CUDA kernel (tiling::by_q_tile at the forward
//    tile, by_k_tile at the backward tile) x tile area: a tile partly inside the mask costs a whole tile.
//    flops_per_cell = 4 Hq D forward, 2.5x that backward (magi/flops.hpp). rate = the dense single-GPU
//    rate (full mask, where cells = area), so the model predicts that kernel exactly at the calibration
//    point and charges other masks for tile waste; and at least the heaviest block's serial chain (a q
//    tile of one head forward, a k tile of one kv head over its q heads backward) at rate / blocks in
//    flight, which long documents among short ones hit.
//    The forward tile follows the CUDA planner (64-row tiles for fragmented masks, at their own rate).
//  - Elementwise kernels (dq add, dk/dv sums, conversions, row gathers): bytes / hbm. The forward's remote
//    stages merge into the accumulators inside the kernel (one more read of them); the last one writes out.
//  - A collective (all-to-all-v of one stage, one ring shift): latency + max over ranks of max(bytes sent,
//    bytes received) / link bandwidth (full-duplex links, the slowest rank finishes it for everyone);
//    it starts when every rank has reached it (lockstep).
//  - Schedule: the runtime's two streams per rank (compute, comm), ops in the order the runtime enqueues
//    them, each waiting for its stream and for the events the runtime waits on. Forward: all stage
//    fetches are enqueued up front, so stage i + 1's fetch runs while stage i (or the host stage)
//    computes; overlap degree 0 makes the host stage wait for the single fetch. Backward: the fetches
//    again, then stage i's dk/dv reduce after stage i computes (behind the fetches on the comm stream).
//    Hierarchical comm (ranks_per_node > 0) is modelled as hop 1 (inter-node bandwidth) then hop 2
//    (link bandwidth) per fetch, reversed per reduce; the GPU runtime does not implement it yet.
//  - Time = the slowest rank's end; TFLOP/s per GPU = flops(global area) / (time * cp).
//    comm_overlaps_compute = false puts comm and compute on one timeline per rank (no hiding).
// Not modelled: contention between concurrent comm and compute for SMs / HBM, NCCL protocol effects,
// kernel efficiency changing with problem size, host-side planning (plans are cached).
#pragma once

#include <cstdint>
#include <vector>

#include "magi/dist.hpp"
#include "magi/mask.hpp"

namespace magi::dist {

struct HardwareModel {
  double forward_flops_per_s = 322e12;   // single-GPU forward kernel, full mask (H200, bf16, D 128, 16k)
  double backward_flops_per_s = 233e12;  // single-GPU backward (backward FLOPs = 2.5x forward)
  double link_bytes_per_s = 350e9;       // per GPU per direction, all-to-all (H200 NVLink)
  double inter_node_bytes_per_s = 350e9; // per GPU, hierarchical hop 1 (default: same host)
  double collective_latency_s = 20e-6;   // per collective call (one stage's k+v group, one ring shift)
  double launch_overhead_s = 10e-6;      // per kernel launch on the compute stream
  double hbm_bytes_per_s = 4.0e12;       // elementwise kernels
  int32_t element_bytes = 2;             // q/k/v/out dtype (bf16)
  // CUDA kernel tiles (src/cuda/params.hpp, D <= 128): forward 128 q x 64 k, backward 128 k x 64 q.
  int32_t forward_tile_q = 128, forward_tile_k = 64;
  int32_t backward_tile_k = 128, backward_tile_q = 64;
  // Kernel launches per magi::forward / magi::backward call (backward: preprocess, dq zero, main, dq convert).
  int32_t forward_launches = 1, backward_launches = 4;
  // Blocks resident at once (H100/H200: 132 SMs x 2 forward blocks, x 1 fused dk/dv block): a kernel
  // takes at least its heaviest block's serial work at rate / blocks_in_flight (0 = ignore that bound).
  int32_t forward_blocks_in_flight = 264, backward_blocks_in_flight = 132;
  // false: comm never runs during a compute kernel (the persistent-grid kernels hold every SM, which
  // NCCL's kernels also need), i.e. one stream per rank; the cp=2 measurement (overlap 0 = 1) suggests so.
  bool comm_overlaps_compute = true;
};

// Throws InvalidArgument naming the first bad field (rates, bandwidths and tiles must be positive).
void validate(const HardwareModel& hw);

// Cells the CUDA kernel computes for `mask`: visited tiles x tile area.
int64_t forward_computed_cells(const Mask& mask, const HardwareModel& hw);
int64_t backward_computed_cells(const Mask& mask, const HardwareModel& hw);
// Forward cells in units of the 128-row tile's rate, following the CUDA planner's 64-row choice
// (src/cuda/params.hpp) when hw's forward tile is 128 rows.
double forward_effective_cells(const Mask& mask, const HardwareModel& hw);

// One magi::forward / magi::backward call on `mask`: launches + computed cells / rate (+ the backward's
// per-call memory traffic over mask.total_q rows: preprocess, fp32 dq accumulator).
double forward_call_seconds(const Mask& mask, const HeadShape& heads, const HardwareModel& hw);
double backward_call_seconds(const Mask& mask, const HeadShape& heads, const HardwareModel& hw);

struct RankCost {
  double forward_compute_s = 0, backward_compute_s = 0;  // kernel calls (incl. launches), elementwise excluded
  double forward_end_s = 0, backward_end_s = 0;          // when the rank's call returns
  int64_t forward_cells = 0, backward_cells = 0;         // computed tile cells over all its stages
  int64_t fetched_kv_rows = 0;                           // remote kv rows received (k and v each)
};

struct Prediction {
  int32_t cp = 1;
  double forward_s = 0, backward_s = 0;  // slowest rank
  double forward_tflops_per_gpu = 0, backward_tflops_per_gpu = 0;
  double comm_forward_s = 0, comm_backward_s = 0;  // sum of collective durations (what could be hidden)
  int64_t moved_kv_rows = 0;                       // kv rows received over all ranks (k and v each)
  double imbalance = 1;                            // max / mean computed forward cells over ranks
  std::vector<RankCost> ranks;
};

// The single-GPU kernel on the whole mask (one forward call, one backward call).
Prediction predict_single(const Mask& mask, const HeadShape& heads, const HardwareModel& hw);

// magi-attn's distributed attention over `cp` GPUs with config's chunk size, overlap degree, dispatch
// algorithm, backward_high_precision_reduce (unset = bf16 wire) and hierarchical comm (hierarchical_comm
// with ranks_per_node > 0 dividing cp; unset = flat).
Prediction predict_distributed(const Mask& mask, const HeadShape& heads, int32_t cp, const DistConfig& config,
                               const HardwareModel& hw);

// The zigzag ring baseline: 2cp equal chunks, rank r holds r and 2cp-1-r; total_q == total_k, divisible by 2cp.
Prediction predict_ring(const Mask& mask, const HeadShape& heads, int32_t cp, const HardwareModel& hw);

// Rank qr's zigzag q rows against rank kr's zigzag kv rows, in local coordinates (2 chunks each).
Mask zigzag_block_mask(const Mask& mask, int32_t cp, int32_t qr, int32_t kr);

}  // namespace magi::dist
