#include "distributed/cost_model.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <string>

#include "comm/group_collective.hpp"
#include "cuda/sm80/tiles.hpp"
#include "distributed/band.hpp"
#include "distributed/comm_plan.hpp"
#include "distributed/dispatch.hpp"
#include "magi/error.hpp"
#include "magi/flops.hpp"
#include "mask/tiling.hpp"

namespace magi::dist {
namespace {

constexpr int32_t kCompute = 0, kComm = 1;  // the two streams of a rank

// Ops of every rank in the order the runtime enqueues them; each starts when its stream is free and the
// ops it waits on have ended. A collective starts when every rank is ready and ends together, after the
// slowest rank's share.
class Schedule {
 public:
  Schedule(int32_t cp, bool concurrent_streams) : cp_(cp), concurrent_(concurrent_streams), free_(static_cast<size_t>(cp), {0.0, 0.0}), finish_(static_cast<size_t>(cp), 0.0) {}

  // Returns the op's id, for later waits.
  int32_t add(int32_t stream, const std::vector<double>& seconds, const std::vector<int32_t>& waits = {},
              bool collective = false) {
    if (!concurrent_) stream = kCompute;
    std::vector<double> ready(static_cast<size_t>(cp_));
    for (int32_t r = 0; r < cp_; ++r) {
      double t = free_[r][stream];
      for (int32_t w : waits)
        if (w >= 0) t = std::max(t, end_[w][r]);
      ready[r] = t;
    }
    std::vector<double> end(static_cast<size_t>(cp_));
    if (collective) {
      const double start = *std::max_element(ready.begin(), ready.end());
      const double span = *std::max_element(seconds.begin(), seconds.end());
      std::fill(end.begin(), end.end(), start + span);
      collective_seconds_ += span;
    } else {
      for (int32_t r = 0; r < cp_; ++r) end[r] = ready[r] + seconds[r];
    }
    for (int32_t r = 0; r < cp_; ++r) {
      free_[r][stream] = end[r];
      finish_[r] = std::max(finish_[r], end[r]);
    }
    end_.push_back(std::move(end));
    return static_cast<int32_t>(end_.size()) - 1;
  }

  const std::vector<double>& finish() const { return finish_; }
  double makespan() const { return *std::max_element(finish_.begin(), finish_.end()); }
  double collective_seconds() const { return collective_seconds_; }

 private:
  int32_t cp_;
  bool concurrent_;
  std::vector<std::array<double, 2>> free_;
  std::vector<double> finish_;
  std::vector<std::vector<double>> end_;
  double collective_seconds_ = 0;
};

// Cells of the major tile with the most items: one block's serial work (per head).
int64_t heaviest_tile_cells(const tiling::TileLists& lists) {
  int64_t most = 0;
  for (int64_t t = 0; t < lists.num_tiles(); ++t) most = std::max(most, lists.offsets[t + 1] - lists.offsets[t]);
  return most * lists.tile_major * lists.tile_minor;
}

// Seconds of one kernel: its tile work at the dense rate, or, when one block's serial chain is longer, that
// block at its share of the rate (blocks_in_flight blocks run at once; 0 = no such limit).
double kernel_seconds(double flops, double heaviest_block_flops, double rate, int32_t blocks_in_flight) {
  const double bulk = flops / rate;
  return blocks_in_flight > 0 ? std::max(bulk, heaviest_block_flops * blocks_in_flight / rate) : bulk;
}

// One elementwise kernel (or a few, `launches`) moving `bytes` through HBM.
double elementwise_seconds(double bytes, int32_t launches, const HardwareModel& hw) {
  return launches * hw.launch_overhead_s + bytes / hw.hbm_bytes_per_s;
}

double collective_seconds(double bytes, double bytes_per_s, const HardwareModel& hw) {
  return hw.collective_latency_s + bytes / bytes_per_s;
}

// Per rank: latency + max(sent, received) bytes / bandwidth of one all-to-all-v (k and v together).
std::vector<double> exchange_seconds(const std::vector<int64_t>& sent_rows, const std::vector<int64_t>& received_rows,
                                     double row_bytes, double bytes_per_s, const HardwareModel& hw) {
  std::vector<double> out(sent_rows.size());
  for (size_t r = 0; r < out.size(); ++r)
    out[r] = collective_seconds(static_cast<double>(std::max(sent_rows[r], received_rows[r])) * row_bytes, bytes_per_s, hw);
  return out;
}

template <class F>
std::vector<double> per_rank(int32_t cp, F&& f) {
  std::vector<double> out(static_cast<size_t>(cp));
  for (int32_t r = 0; r < cp; ++r) out[r] = f(r);
  return out;
}

double backward_call_bytes(int64_t q_rows, const HeadShape& heads, const HardwareModel& hw) {
  // Preprocess reads out and dout; the fp32 dq accumulator is zeroed, then read and written once more.
  return static_cast<double>(q_rows) * heads.heads_q * heads.head_dim * (2.0 * hw.element_bytes + 12.0);
}

void finish(Prediction& p, const Mask& mask, const HeadShape& heads) {
  const double fwd = flops_forward(mask.area(), heads.heads_q, heads.head_dim);
  p.forward_tflops_per_gpu = p.forward_s > 0 ? fwd / (p.forward_s * p.cp) / 1e12 : 0;
  p.backward_tflops_per_gpu = p.backward_s > 0 ? 2.5 * fwd / (p.backward_s * p.cp) / 1e12 : 0;
  double max_cells = 0, sum_cells = 0;
  for (const RankCost& r : p.ranks) {
    max_cells = std::max(max_cells, static_cast<double>(r.forward_cells));
    sum_cells += static_cast<double>(r.forward_cells);
    p.moved_kv_rows += r.fetched_kv_rows;
  }
  p.imbalance = sum_cells > 0 ? max_cells / (sum_cells / p.cp) : 1.0;
}

void require_heads(const HeadShape& heads) {
  if (heads.heads_q < 1 || heads.heads_kv < 1 || heads.head_dim < 1 || heads.heads_q % heads.heads_kv != 0)
    throw InvalidArgument("heads: heads_q, heads_kv, head_dim must be >= 1 with heads_kv dividing heads_q, got " +
                          std::to_string(heads.heads_q) + "/" + std::to_string(heads.heads_kv) + "/" +
                          std::to_string(heads.head_dim));
}

}  // namespace

void validate(const HardwareModel& hw) {
  const std::pair<const char*, double> positive[] = {
      {"forward_flops_per_s", hw.forward_flops_per_s}, {"backward_flops_per_s", hw.backward_flops_per_s},
      {"link_bytes_per_s", hw.link_bytes_per_s},       {"inter_node_bytes_per_s", hw.inter_node_bytes_per_s},
      {"hbm_bytes_per_s", hw.hbm_bytes_per_s},         {"element_bytes", hw.element_bytes},
      {"forward_tile_q", hw.forward_tile_q},           {"forward_tile_k", hw.forward_tile_k},
      {"backward_tile_k", hw.backward_tile_k},         {"backward_tile_q", hw.backward_tile_q}};
  for (const auto& [name, value] : positive)
    if (!(value > 0))
      throw InvalidArgument(std::string("hardware model: ") + name + " must be > 0 (infinity allowed), got " +
                            std::to_string(value));
  const std::pair<const char*, double> non_negative[] = {{"collective_latency_s", hw.collective_latency_s},
                                                         {"launch_overhead_s", hw.launch_overhead_s},
                                                         {"forward_launches", hw.forward_launches},
                                                         {"forward_blocks_in_flight", hw.forward_blocks_in_flight},
                                                         {"backward_blocks_in_flight", hw.backward_blocks_in_flight},
                                                         {"backward_launches", hw.backward_launches}};
  for (const auto& [name, value] : non_negative)
    if (!(value >= 0) || std::isinf(value))
      throw InvalidArgument(std::string("hardware model: ") + name + " must be finite and >= 0, got " +
                            std::to_string(value));
}

namespace {

// The forward work lists at the tile the CUDA planner takes (hw's tile, or 64 rows for fragmented masks when
// hw's is 128 rows) and that tile's rate relative to hw's dense rate.
struct ForwardTiles {
  tiling::TileLists lists;
  double rate = 1.0;
};
ForwardTiles forward_tiles(const Mask& mask, const HardwareModel& hw) {
  ForwardTiles t{tiling::by_q_tile(mask, hw.forward_tile_q, hw.forward_tile_k)};
  if (hw.forward_tile_q != cuda::detail::kFwdTileQ) return t;
  tiling::TileLists small = tiling::by_q_tile(mask, cuda::detail::kFwdSmallTileQ, hw.forward_tile_k);
  if (cuda::detail::prefer_small_forward_tile(static_cast<double>(t.lists.computed_cells()),
                                              static_cast<double>(small.computed_cells())))
    t = {std::move(small), cuda::detail::kSmallForwardTileRate};
  return t;
}

}  // namespace

int64_t forward_computed_cells(const Mask& mask, const HardwareModel& hw) {
  return tiling::by_q_tile(mask, hw.forward_tile_q, hw.forward_tile_k).computed_cells();
}

int64_t backward_computed_cells(const Mask& mask, const HardwareModel& hw) {
  return tiling::by_k_tile(mask, hw.backward_tile_k, hw.backward_tile_q).computed_cells();
}

double forward_effective_cells(const Mask& mask, const HardwareModel& hw) {
  const ForwardTiles t = forward_tiles(mask, hw);
  return static_cast<double>(t.lists.computed_cells()) / t.rate;
}

double forward_call_seconds(const Mask& mask, const HeadShape& heads, const HardwareModel& hw) {
  const ForwardTiles t = forward_tiles(mask, hw);
  const double per_cell = 4.0 * heads.head_dim / t.rate;  // one head, at the chosen tile's rate
  return hw.forward_launches * hw.launch_overhead_s +
         kernel_seconds(static_cast<double>(t.lists.computed_cells()) * per_cell * heads.heads_q,
                        static_cast<double>(heaviest_tile_cells(t.lists)) * per_cell, hw.forward_flops_per_s,
                        hw.forward_blocks_in_flight);
}

double backward_call_seconds(const Mask& mask, const HeadShape& heads, const HardwareModel& hw) {
  const tiling::TileLists lists = tiling::by_k_tile(mask, hw.backward_tile_k, hw.backward_tile_q);
  const double per_cell = 2.5 * 4.0 * heads.head_dim;
  // A dk/dv block is one k tile of one kv head and walks every q head of its group.
  const double heaviest = static_cast<double>(heaviest_tile_cells(lists)) * (heads.heads_q / heads.heads_kv);
  return hw.backward_launches * hw.launch_overhead_s +
         kernel_seconds(static_cast<double>(lists.computed_cells()) * per_cell * heads.heads_q, heaviest * per_cell,
                        hw.backward_flops_per_s, hw.backward_blocks_in_flight) +
         backward_call_bytes(mask.total_q, heads, hw) / hw.hbm_bytes_per_s;
}

Prediction predict_single(const Mask& mask, const HeadShape& heads, const HardwareModel& hw) {
  validate(hw);
  require_heads(heads);
  Prediction p;
  RankCost r;
  r.forward_cells = forward_computed_cells(mask, hw);
  r.backward_cells = backward_computed_cells(mask, hw);
  r.forward_compute_s = r.forward_end_s = p.forward_s = forward_call_seconds(mask, heads, hw);
  r.backward_compute_s = r.backward_end_s = p.backward_s = backward_call_seconds(mask, heads, hw);
  p.ranks.push_back(r);
  finish(p, mask, heads);
  return p;
}

Prediction predict_distributed(const Mask& mask, const HeadShape& heads, int32_t cp, const DistConfig& config,
                               const HardwareModel& hw) {
  validate(hw);
  require_heads(heads);
  if (cp < 1) throw InvalidArgument("cp must be >= 1, got " + std::to_string(cp));
  if (config.overlap_degree < 0)
    throw InvalidArgument("overlap_degree must be >= 0, got " + std::to_string(config.overlap_degree));
  const int32_t ranks_per_node = config.hierarchical_comm.value_or(false) ? config.ranks_per_node : 0;
  if (config.hierarchical_comm.value_or(false) && (ranks_per_node < 1 || cp % ranks_per_node != 0))
    throw InvalidArgument("hierarchical comm needs ranks_per_node >= 1 dividing cp " + std::to_string(cp) + ", got " +
                          std::to_string(config.ranks_per_node));
  const Dispatch dispatch = make_dispatch(mask, cp, config.chunk_size, config.algorithm);
  const CommPlan plan = make_comm_plan(mask, dispatch, config.overlap_degree, ranks_per_node);
  const int32_t stages = plan.num_stages();
  const bool relayed = plan.hierarchical();

  const int64_t lq = dispatch.q.local_tokens(), lk = dispatch.k.local_tokens();
  const double q_elems = static_cast<double>(lq) * heads.heads_q * heads.head_dim;
  const double kv_row = static_cast<double>(heads.heads_kv) * heads.head_dim;
  const double elt = hw.element_bytes;
  const double wire = config.backward_high_precision_reduce.value_or(false) ? 4.0 : elt;
  const double kv_pair_bytes = 2 * kv_row * elt;    // one k row and one v row
  const double grad_pair_bytes = 2 * kv_row * wire;  // one dk row and one dv row on the wire

  // Rows each rank sends / receives per stage and hop (hop 1 = routes, hop 2 = relay routes).
  const auto rows = [&](const std::vector<std::vector<comm::RowRoutes>>& routes, int32_t s, bool sent) {
    std::vector<int64_t> out(static_cast<size_t>(cp));
    for (int32_t r = 0; r < cp; ++r)
      out[r] = sent ? routes[r][s].total_send_rows() : routes[r][s].total_recv_rows();
    return out;
  };

  Prediction p;
  p.cp = cp;
  p.ranks.resize(static_cast<size_t>(cp));
  std::vector<double> host_fwd(static_cast<size_t>(cp)), host_bwd(static_cast<size_t>(cp));
  std::vector<std::vector<double>> stage_fwd(static_cast<size_t>(stages), std::vector<double>(static_cast<size_t>(cp))),
      stage_bwd = stage_fwd;
  std::vector<bool> has_remote(static_cast<size_t>(cp), false);  // the last remote stage writes out / lse
  for (int32_t r = 0; r < cp; ++r) {
    const RankPlan& rp = plan.ranks[r];
    RankCost& rc = p.ranks[r];
    rc.fetched_kv_rows = rp.fetched_rows();
    if (!rp.host_mask.slices.empty()) {
      host_fwd[r] = forward_call_seconds(rp.host_mask, heads, hw);
      host_bwd[r] = backward_call_seconds(rp.host_mask, heads, hw);
      rc.forward_cells += forward_computed_cells(rp.host_mask, hw);
      rc.backward_cells += backward_computed_cells(rp.host_mask, hw);
    } else {  // zero-filled accumulators
      host_fwd[r] = elementwise_seconds(q_elems * 4 + lq * heads.heads_q * 4.0, 2, hw);
      host_bwd[r] = elementwise_seconds(q_elems * 4 + 2 * lk * kv_row * 4, 3, hw);
    }
    rc.forward_compute_s += host_fwd[r];
    rc.backward_compute_s += host_bwd[r];
    for (int32_t s = 0; s < stages; ++s) {
      const StagePlan& sp = rp.stages[s];
      if (sp.mask.slices.empty()) {  // backward still zeroes the partial dk/dv it sends back
        stage_bwd[s][r] = sp.buffer_rows > 0 ? elementwise_seconds(sp.buffer_rows * grad_pair_bytes, 2, hw) : 0.0;
        continue;
      }
      const double f = forward_call_seconds(sp.mask, heads, hw), b = backward_call_seconds(sp.mask, heads, hw);
      rc.forward_compute_s += f;
      rc.backward_compute_s += b;
      rc.forward_cells += forward_computed_cells(sp.mask, hw);
      rc.backward_cells += backward_computed_cells(sp.mask, hw);
      // Forward: the kernel merges into the fp32 accumulators itself (reads them once more); backward: the
      // kernel adds into the running fp32 dq (accumulate_dq: no zeroing of its accumulator, no add pass).
      stage_fwd[s][r] = f + 4 * (q_elems + lq * heads.heads_q) / hw.hbm_bytes_per_s;
      has_remote[r] = true;
      stage_bwd[s][r] = b - 4.0 * q_elems / hw.hbm_bytes_per_s;
    }
  }

  // The kv fetch of every stage, enqueued up front on the comm stream; returns the ops that end them.
  const auto enqueue_fetches = [&](Schedule& sched) {
    std::vector<int32_t> fetched;
    for (int32_t s = 0; s < stages; ++s) {
      const auto sent = rows(plan.routes, s, true), received = rows(plan.routes, s, false);
      // Row gather into the send buffers (read + write, k and v).
      sched.add(kComm, per_rank(cp, [&](int32_t r) { return elementwise_seconds(2.0 * sent[r] * kv_pair_bytes, 2, hw); }));
      const double hop1_bw = relayed ? hw.inter_node_bytes_per_s : hw.link_bytes_per_s;
      int32_t op = sched.add(kComm, exchange_seconds(sent, received, kv_pair_bytes, hop1_bw, hw), {}, true);
      if (relayed)
        op = sched.add(kComm,
                       exchange_seconds(rows(plan.relay_routes, s, true), rows(plan.relay_routes, s, false),
                                        kv_pair_bytes, hw.link_bytes_per_s, hw),
                       {}, true);
      fetched.push_back(op);
    }
    return fetched;
  };

  {  // forward
    Schedule sched(cp, hw.comm_overlaps_compute);
    const std::vector<int32_t> fetched = enqueue_fetches(sched);
    sched.add(kCompute, host_fwd, {config.overlap_degree == 0 ? fetched[0] : -1});
    for (int32_t s = 0; s < stages; ++s) sched.add(kCompute, stage_fwd[s], {fetched[s]});
    // Output and lse from the fp32 accumulators, where no remote stage wrote them.
    sched.add(kCompute, per_rank(cp, [&](int32_t r) {
                return has_remote[r] ? 0.0 : elementwise_seconds(q_elems * (4 + elt) + lq * heads.heads_q * 8.0, 2, hw);
              }));
    p.forward_s = sched.makespan();
    p.comm_forward_s = sched.collective_seconds();
    for (int32_t r = 0; r < cp; ++r) p.ranks[r].forward_end_s = sched.finish()[r];
  }
  {  // backward
    Schedule sched(cp, hw.comm_overlaps_compute);
    const std::vector<int32_t> fetched = enqueue_fetches(sched);
    const int32_t host_done = sched.add(kCompute, host_bwd, {config.overlap_degree == 0 ? fetched[0] : -1});
    int32_t last_reduce = host_done;
    for (int32_t s = 0; s < stages; ++s) {
      const int32_t computed = sched.add(kCompute, stage_bwd[s], {fetched[s]});
      // Partial dk/dv go back the way the kv came: rows received are sent, rows sent are received.
      const auto back = rows(plan.routes, s, false), home = rows(plan.routes, s, true);
      int32_t op = computed;
      if (relayed) {
        op = sched.add(kComm,
                       exchange_seconds(rows(plan.relay_routes, s, false), rows(plan.relay_routes, s, true),
                                        grad_pair_bytes, hw.link_bytes_per_s, hw),
                       {op}, true);
        // The relay sums its node's partials before they cross nodes.
        op = sched.add(kComm, per_rank(cp, [&](int32_t r) { return elementwise_seconds(2.0 * back[r] * grad_pair_bytes, 2, hw); }),
                       {op});
      }
      op = sched.add(kComm, exchange_seconds(back, home, grad_pair_bytes, relayed ? hw.inter_node_bytes_per_s : hw.link_bytes_per_s, hw),
                     {op}, true);
      // Fixed-order sums into the fp32 dk/dv accumulators (after the host stage wrote them).
      last_reduce = sched.add(kComm, per_rank(cp, [&](int32_t r) {
                                return elementwise_seconds(home[r] * (grad_pair_bytes + 2 * kv_row * 8.0), 2, hw);
                              }),
                              {s == 0 ? host_done : -1});
    }
    sched.add(kCompute, per_rank(cp, [&](int32_t) {
                return elementwise_seconds((q_elems + 2.0 * lk * kv_row) * (4 + elt), 3, hw);
              }),
              {last_reduce});
    p.backward_s = sched.makespan();
    p.comm_backward_s = sched.collective_seconds();
    for (int32_t r = 0; r < cp; ++r) p.ranks[r].backward_end_s = sched.finish()[r];
  }
  finish(p, mask, heads);
  return p;
}

Mask zigzag_block_mask(const Mask& mask, int32_t cp, int32_t qr, int32_t kr) {
  const int32_t c = mask.total_q / (2 * cp);
  const int32_t q_chunks[2] = {qr, 2 * cp - 1 - qr}, k_chunks[2] = {kr, 2 * cp - 1 - kr};
  Mask out;
  out.total_q = 2 * c;
  out.total_k = 2 * c;
  for (const Slice& slice : mask.slices)
    for (int32_t a = 0; a < 2; ++a)
      for (int32_t b = 0; b < 2; ++b) {
        const Range rows{q_chunks[a] * c, (q_chunks[a] + 1) * c}, cols{k_chunks[b] * c, (k_chunks[b] + 1) * c};
        const Band band = clip(band_of(slice), rows, cols);
        if (area(band) == 0) continue;
        append_slices(shift(band, a * c - rows.start, b * c - cols.start), out.slices);
      }
  return out;
}

Prediction predict_ring(const Mask& mask, const HeadShape& heads, int32_t cp, const HardwareModel& hw) {
  validate(hw);
  require_heads(heads);
  if (cp < 1) throw InvalidArgument("cp must be >= 1, got " + std::to_string(cp));
  if (mask.total_q != mask.total_k || mask.total_q % (2 * cp) != 0)
    throw InvalidArgument("ring baseline: total_q must equal total_k and be divisible by 2 * cp = " +
                          std::to_string(2 * cp) + ", got " + std::to_string(mask.total_q) + " x " +
                          std::to_string(mask.total_k));
  const int64_t l = mask.total_q / cp;
  const double q_elems = static_cast<double>(l) * heads.heads_q * heads.head_dim;
  const double kv_elems = static_cast<double>(l) * heads.heads_kv * heads.head_dim;
  const double elt = hw.element_bytes;
  Prediction p;
  p.cp = cp;
  p.ranks.resize(static_cast<size_t>(cp));
  // [step][rank]: rank r computes its q against the kv of rank r - s.
  std::vector<std::vector<double>> fwd(static_cast<size_t>(cp), std::vector<double>(static_cast<size_t>(cp))), bwd = fwd;
  for (int32_t r = 0; r < cp; ++r) {
    for (int32_t s = 0; s < cp; ++s) {
      const Mask m = zigzag_block_mask(mask, cp, r, (r - s + cp) % cp);
      RankCost& rc = p.ranks[r];
      if (m.slices.empty()) {
        bwd[s][r] = elementwise_seconds(2 * kv_elems * 4 + (s == 0 ? q_elems * 4 : 0.0), 2, hw);
        continue;
      }
      const double f = forward_call_seconds(m, heads, hw), b = backward_call_seconds(m, heads, hw);
      rc.forward_compute_s += f;
      rc.backward_compute_s += b;
      rc.forward_cells += forward_computed_cells(m, hw);
      rc.backward_cells += backward_computed_cells(m, hw);
      fwd[s][r] = f + elementwise_seconds(3 * 4 * (q_elems + l * heads.heads_q), 1, hw);
      bwd[s][r] = b + (s > 0 ? elementwise_seconds(3 * 4 * q_elems, 1, hw) : 0.0);
    }
    p.ranks[r].fetched_kv_rows = (cp - 1) * l;
  }
  const std::vector<double> kv_shift(static_cast<size_t>(cp),
                                     collective_seconds(2 * kv_elems * elt, hw.link_bytes_per_s, hw));
  const std::vector<double> grad_shift(static_cast<size_t>(cp),
                                       collective_seconds(2 * kv_elems * 4, hw.link_bytes_per_s, hw));
  {  // forward: step s + 1's kv travels while step s computes (double buffer: after step s - 1 computed)
    Schedule sched(cp, hw.comm_overlaps_compute);
    std::vector<int32_t> arrived(static_cast<size_t>(cp + 1), -1), computed(static_cast<size_t>(cp), -1);
    sched.add(kCompute, per_rank(cp, [&](int32_t) { return elementwise_seconds(4 * (q_elems + l * heads.heads_q), 2, hw); }));
    for (int32_t s = 0; s < cp; ++s) {
      if (s + 1 < cp) arrived[s + 1] = sched.add(kComm, kv_shift, {s > 0 ? computed[s - 1] : -1}, true);
      computed[s] = sched.add(kCompute, fwd[s], {arrived[s]});
    }
    sched.add(kCompute, per_rank(cp, [&](int32_t) {
                return elementwise_seconds(q_elems * (4 + elt) + l * heads.heads_q * 8.0, 2, hw);
              }));
    p.forward_s = sched.makespan();
    p.comm_forward_s = sched.collective_seconds();
    for (int32_t r = 0; r < cp; ++r) p.ranks[r].forward_end_s = sched.finish()[r];
  }
  {  // backward: kv as forward; each step's dk/dv join an fp32 accumulator that travels one hop per step
    Schedule sched(cp, hw.comm_overlaps_compute);
    std::vector<int32_t> arrived(static_cast<size_t>(cp + 1), -1), grads(static_cast<size_t>(cp + 1), -1),
        computed(static_cast<size_t>(cp), -1);
    sched.add(kCompute, per_rank(cp, [&](int32_t) { return elementwise_seconds(2 * kv_elems * 4, 2, hw); }));
    for (int32_t s = 0; s < cp; ++s) {
      if (s + 1 < cp) arrived[s + 1] = sched.add(kComm, kv_shift, {s > 0 ? computed[s - 1] : -1}, true);
      sched.add(kCompute, bwd[s], {arrived[s]});
      computed[s] = sched.add(kCompute, per_rank(cp, [&](int32_t) { return elementwise_seconds(2 * 3 * 4 * kv_elems, 2, hw); }),
                              {grads[s]});
      grads[s + 1] = sched.add(kComm, grad_shift, {computed[s]}, true);
    }
    sched.add(kCompute, per_rank(cp, [&](int32_t) { return elementwise_seconds((q_elems + 2 * kv_elems) * (4 + elt), 3, hw); }),
              {grads[cp]});
    p.backward_s = sched.makespan();
    p.comm_backward_s = sched.collective_seconds();
    for (int32_t r = 0; r < cp; ++r) p.ranks[r].backward_end_s = sched.finish()[r];
  }
  finish(p, mask, heads);
  return p;
}

}  // namespace magi::dist
