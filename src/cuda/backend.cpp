#include "cuda/backend.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/check.hpp"
#include "cuda/launch.hpp"
#include "cuda/params.hpp"
#include "cuda/sm90/launch.hpp"
#include "cuda/sm90/tiles.hpp"
#include "magi/error.hpp"
#include "mask/tiling.hpp"

namespace magi::cuda {

using detail::DeviceList;
using detail::WorkItem;

namespace {

constexpr int kCompiledTiles[] = {
#if MAGI_CUDA_HEAD_DIM_64
    64,
#endif
#if MAGI_CUDA_HEAD_DIM_128
    128,
#endif
#if MAGI_CUDA_HEAD_DIM_256
    256,
#endif
    0};

int padded_head_dim(int32_t d) {
  for (int tile : kCompiledTiles)
    if (tile != 0 && d <= tile) return tile;
  return 0;
}

// Host form of one list before upload.
struct HostList {
  std::vector<detail::TileInfo> tiles;  // heaviest first, then grouped (group_tiles_sharing_data)
  std::vector<WorkItem> items;
};

// The test groups of a masked item of a k-major list (WorkFlags; the dk/dv kernels read them): each 16-key
// group of its k tile is tested against the item's q chunk [q_chunk0, q_chunk0 + chunk) with the mask's own
// kept_queries; the bit is set unless the group keeps every cell of the chunk.
int32_t test_groups(const Slice& s, const tiling::TileWork& w, int64_t k_tile0, int32_t tile, int64_t q_chunk0,
                    int32_t chunk) {
  int32_t bits = 0;
  for (int32_t g = 0; g < tile / 16; ++g) {
    for (int64_t k = k_tile0 + g * 16; k < k_tile0 + (g + 1) * 16; ++k) {
      Range kept{0, 0};
      if (k >= w.k.start && k < w.k.end) kept = kept_queries(s, static_cast<int32_t>(k));
      if (std::max(kept.start, w.q.start) > q_chunk0 || std::min(kept.end, w.q.end) < q_chunk0 + chunk) {
        bits |= 1 << g;
        break;
      }
    }
  }
  return bits;
}

// Tiles whose items all start at one minor index (or all end at one) read that data from the same place on:
// the q tiles of a causal document all read keys from the document's first one. Blocks running together share
// it in L2 only if such tiles are taken together, which heaviest-first scatters (their item counts differ):
// groups in the order of their heaviest tile, heaviest first inside a group. Whichever of the two endpoints
// makes fewer groups is used; a tile whose ends are shared with no other stays where it was.
void group_tiles_sharing_data(HostList& list, bool q_major) {
  const size_t n = list.tiles.size();
  std::vector<std::pair<int32_t, int32_t>> ends(n, {-1, -1});  // (smallest minor start, largest minor end)
  for (size_t i = 0; i < n; ++i) {
    const detail::TileInfo& t = list.tiles[i];
    if (t.count == 0) continue;
    int32_t lo = INT32_MAX, hi = INT32_MIN;
    for (int32_t j = t.first; j < t.first + t.count; ++j) {
      const WorkItem& w = list.items[static_cast<size_t>(j)];
      lo = std::min(lo, q_major ? w.k0 : w.q0);
      hi = std::max(hi, q_major ? w.k1 : w.q1);
    }
    ends[i] = {lo, hi};
  }
  auto group_order = [&](bool by_start) {
    std::map<int32_t, size_t> first_of;  // endpoint -> position of its heaviest tile (the first in the list)
    std::vector<size_t> key(n);
    for (size_t i = 0; i < n; ++i) {
      if (list.tiles[i].count == 0) { key[i] = i; continue; }
      key[i] = first_of.try_emplace(by_start ? ends[i].first : ends[i].second, i).first->second;
    }
    return std::make_pair(first_of.size(), key);
  };
  auto [starts, by_start] = group_order(true);
  auto [finishes, by_end] = group_order(false);
  const std::vector<size_t>& key = starts <= finishes ? by_start : by_end;
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key[a] < key[b]; });
  std::vector<detail::TileInfo> grouped;
  grouped.reserve(n);
  for (size_t i : order) grouped.push_back(list.tiles[i]);
  list.tiles = std::move(grouped);
}

// Converts a tiling list; `q_major` says whether the major axis is q. A rectangle is unmasked only when
// it covers its whole tile x tile block and every cell is kept.
HostList convert(const Mask& mask, const tiling::TileLists& lists, bool q_major) {
  if (!q_major && (lists.tile_major % 16 != 0 || lists.tile_major / 16 > 31 - detail::kWorkTestGroupShift))
    throw Error("cuda plan: major tile " + std::to_string(lists.tile_major) + " is not whole 16-row groups");
  HostList out;
  const int64_t tiles = lists.num_tiles();
  out.items.reserve(lists.items.size());
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t i = lists.offsets[t]; i < lists.offsets[t + 1]; ++i) {
      const tiling::TileWork& w = lists.items[static_cast<size_t>(i)];
      const Slice& s = mask.slices[static_cast<size_t>(w.slice)];
      WorkItem item{};
      item.q0 = w.q.start;
      item.q1 = w.q.end;
      item.k0 = w.k.start;
      item.k1 = w.k.end;
      item.causal_offset = s.k.end - s.q.end;
      item.inv_offset = s.k.start - s.q.start;
      if (s.type == MaskType::Causal || s.type == MaskType::BiCausal) item.flags |= detail::kWorkCausal;
      if (s.type == MaskType::InvCausal || s.type == MaskType::BiCausal) item.flags |= detail::kWorkInv;
      const int32_t major = lists.tile_major;
      const int32_t minor = lists.tile_minor;
      const Range mj = q_major ? w.q : w.k;
      const Range mn = q_major ? w.k : w.q;
      const int64_t mj0 = t * major;
      const int64_t mn0 = int64_t{mn.start} / minor * minor;
      const bool covers = mj.start == mj0 && mj.end == mj0 + major && mn.start == mn0 && mn.end == mn0 + minor;
      if (w.needs_mask || !covers) {
        item.flags |= detail::kWorkMasked;
        if (!q_major) item.flags |= test_groups(s, w, mj0, major, mn0, minor) << detail::kWorkTestGroupShift;
      }
      out.items.push_back(item);
    }
  }
  for (int64_t t = 0; t < tiles; ++t) {
    const auto first = static_cast<int32_t>(lists.offsets[t]);
    const auto count = static_cast<int32_t>(lists.offsets[t + 1] - lists.offsets[t]);
    const WorkItem* item = count > 0 ? &out.items[static_cast<size_t>(first)] : nullptr;
    out.tiles.push_back({static_cast<int32_t>(t), first, count, item == nullptr ? 0 : q_major ? item->k0 : item->q0});
  }
  // Heaviest tiles first so that the long ones start early; ties keep index order (deterministic).
  std::stable_sort(out.tiles.begin(), out.tiles.end(),
                   [](const detail::TileInfo& a, const detail::TileInfo& b) { return a.count > b.count; });
  group_tiles_sharing_data(out, q_major);
  return out;
}

size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

// MAGI_ATTENTION_PROFILE_MODE: CUDA events around a stage of one call, printed after a sync of the stream.
class StageTimer {
 public:
  StageTimer(bool enabled, cudaStream_t stream) : enabled_(enabled), stream_(stream) {}
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;
  ~StageTimer() {
    for (auto& s : stages_) {
      cudaEventDestroy(s.start);
      cudaEventDestroy(s.stop);
    }
  }
  void begin(const char* name) {
    if (!enabled_) return;
    Stage s{name, nullptr, nullptr};
    check(cudaEventCreate(&s.start), "cudaEventCreate");
    check(cudaEventCreate(&s.stop), "cudaEventCreate");
    check(cudaEventRecord(s.start, stream_), "cudaEventRecord");
    stages_.push_back(s);
  }
  void end() {
    if (enabled_) check(cudaEventRecord(stages_.back().stop, stream_), "cudaEventRecord");
  }
  void report(const std::string& what) {
    if (!enabled_) return;
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (profile mode)");
    std::string line = "magi-attn profile: " + what;
    for (const Stage& s : stages_) {
      float ms = 0.0f;
      check(cudaEventElapsedTime(&ms, s.start, s.stop), "cudaEventElapsedTime");
      line += std::string(", ") + s.name + " " + std::to_string(ms) + " ms";
    }
    std::fprintf(stderr, "%s\n", line.c_str());
  }

 private:
  struct Stage {
    const char* name;
    cudaEvent_t start, stop;
  };
  bool enabled_;
  cudaStream_t stream_;
  std::vector<Stage> stages_;
};

// Passes for a list's blocks (work_coords): as many heads per pass as fit their `head_bytes` each in half the
// L2 (a divisor of `heads`); heavy tiles first, those that could end after everything else if they started in
// the last pass (more items than a pass gives each of the `slots` resident blocks), moved to the front in the
// list's order.
struct PassOrder {
  int32_t heads_per_pass, heavy_tiles;
};
PassOrder order_in_passes(HostList& list, int32_t heads, double head_bytes, int64_t l2_bytes, int64_t slots) {
  int32_t per_pass = 1;
  for (int32_t h = 1; h <= heads; ++h)
    if (heads % h == 0 && h * head_bytes <= 0.5 * static_cast<double>(l2_bytes)) per_pass = h;
  int64_t items = 0;
  for (const detail::TileInfo& t : list.tiles) items += t.count;
  const double pass_share = static_cast<double>(items) * per_pass / static_cast<double>(slots);
  const auto rest = std::stable_partition(list.tiles.begin(), list.tiles.end(),
                                          [&](const detail::TileInfo& t) { return t.count > pass_share; });
  return {per_pass, static_cast<int32_t>(rest - list.tiles.begin())};
}

}  // namespace

struct Plan {
  int32_t tq = 0, tk = 0, hq = 0, hkv = 0, d = 0, padded_d = 0, device = 0;
  int32_t fwd_tile_q = 0;  // rows per forward block (the fwd list's major tile)
  int32_t fwd_tile_k = 0;
  KernelFamily fwd_family = KernelFamily::Sm80;
  int32_t fwd_itemless_tiles = 0;  // q tiles without items: the last ones of the fwd order
  int32_t smem_optin = 0;  // the device's per-block shared-memory limit (opt-in)
  DeviceList fwd, dkdv, dq;
  int64_t fwd_items = 0, dkdv_items = 0, dq_items = 0;
  void* arena = nullptr;  // the lists, read-only after upload
  size_t arena_bytes = 0;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (arena != nullptr) {
      int previous = 0;
      cudaGetDevice(&previous);
      cudaSetDevice(device);
      cudaFree(arena);
      cudaSetDevice(previous);
    }
  }
};

namespace {

// ---- per-call scratch: one layout function for both the size query and the carving ----

constexpr size_t kCounterBytes = 256;  // persistent-grid work counters: forward, dk/dv, dq

// The backward's row statistics hold whole 64-row chunks past the last row.
int32_t stats_rows(int32_t tq) { return (tq + 63) / 64 * 64 + 64; }

struct BackwardLayout {
  int32_t tq_pad = 0;
  bool fused_dq = false;  // dq by fp32 atomics inside the dk/dv kernel (default mode)
  bool dq_in_place = false;  // ... straight into the caller's fp32, 16-byte aligned dq
  size_t delta = 0, lse2 = 0, counters = 0, dout16 = 0, dq_accum = 0, total = 0;  // byte offsets; 0 = unused
};

BackwardLayout backward_layout(const BackwardArgs& a, int32_t padded_d, int32_t smem_optin, bool deterministic) {
  const auto tq = static_cast<int32_t>(a.q.shape[0]), hq = static_cast<int32_t>(a.q.shape[1]);
  const auto rows_x_d = static_cast<size_t>(a.q.numel());
  BackwardLayout l;
  l.tq_pad = stats_rows(tq);
  l.fused_dq = !deterministic && detail::dkdv_smem_bytes(padded_d, true) <= smem_optin;
  l.dq_in_place = a.dq.dtype == DType::F32 && reinterpret_cast<uintptr_t>(a.dq.data) % 16 == 0;
  const size_t stats_bytes = align_up(static_cast<size_t>(l.tq_pad) * hq * sizeof(float));
  l.delta = 0;
  l.lse2 = stats_bytes;
  l.counters = 2 * stats_bytes;
  size_t at = l.counters + kCounterBytes;
  if (a.dout.dtype == DType::F32) {
    l.dout16 = at;
    at += align_up(rows_x_d * 2);
  }
  if (l.fused_dq && !l.dq_in_place) {
    l.dq_accum = at;
    at += align_up(rows_x_d * 4);
  }
  l.total = at;
  return l;
}

int32_t device_smem_optin(int32_t device) {
  int value = 0;
  check(cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute");
  return value;
}

// The backend's own scratch for callers without a workspace: one buffer per (device, stream), grown as needed.
// Growing frees the old buffer; cudaFree waits for the device, so no call still in flight can read it.
class ScratchBuffers {
 public:
  unsigned char* get(int32_t device, cudaStream_t stream, size_t bytes) {
    std::lock_guard lock(mutex_);
    Entry& e = entries_[{device, stream}];
    if (e.bytes < bytes) {
      if (e.data != nullptr) check(cudaFree(e.data), "cudaFree (scratch)");
      e.data = nullptr;
      e.bytes = 0;
      check(cudaMalloc(&e.data, bytes), "cudaMalloc (scratch)");
      e.bytes = bytes;
    }
    return static_cast<unsigned char*>(e.data);
  }

 private:
  struct Entry {
    void* data = nullptr;
    size_t bytes = 0;
  };
  std::mutex mutex_;
  std::map<std::pair<int32_t, cudaStream_t>, Entry> entries_;
};

unsigned char* scratch_for(const Workspace& given, int32_t device, cudaStream_t stream, size_t bytes) {
  if (given.data != nullptr) return static_cast<unsigned char*>(given.data);
  static ScratchBuffers buffers;  // process-wide, like the device's primary context it belongs to
  return buffers.get(device, stream, bytes);
}

}  // namespace

int64_t workspace_bytes(const ForwardArgs&, const Options&) { return static_cast<int64_t>(kCounterBytes); }

int64_t workspace_bytes(const BackwardArgs& a, const Options& o) {
  const int32_t padded = padded_head_dim(static_cast<int32_t>(a.q.shape[2]));
  return static_cast<int64_t>(backward_layout(a, padded, device_smem_optin(a.q.device.index), o.deterministic).total);
}

bool head_dim_supported(int32_t head_dim) {
  return head_dim > 0 && head_dim % 8 == 0 && padded_head_dim(head_dim) != 0;
}

bool sm90_forward_available(int32_t head_dim, int32_t device) {
#if MAGI_CUDA_SM90
  if (!head_dim_supported(head_dim)) return false;
  int major = 0, minor = 0, smem = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute");
  return major == 9 && minor == 0 && sm90::forward_smem_bytes(padded_head_dim(head_dim)) <= smem;
#else
  (void)head_dim;
  (void)device;
  return false;
#endif
}


std::shared_ptr<Plan> make_plan(const Mask& mask, int32_t heads_q, int32_t heads_kv, int32_t head_dim,
                                int32_t device, const PlanTuning& tuning) {
  if (!head_dim_supported(head_dim)) {
    std::string tiles;
    for (int t : kCompiledTiles)
      if (t != 0) tiles += (tiles.empty() ? "" : ", ") + std::to_string(t);
    throw NotAvailable("cuda backend: head dim " + std::to_string(head_dim) +
                       " has no compiled kernel (this build: multiples of 8 up to the tiles " + tiles +
                       "; see MAGI_ATTN_CUDA_HEAD_DIMS)");
  }
  // The backward addresses a 64-row chunk of dq with 32-bit offsets.
  constexpr int64_t kMaxRowElements = (int64_t{1} << 31) / detail::kDkdvTileQ;
  if (int64_t{heads_q} * head_dim >= kMaxRowElements)
    throw InvalidArgument("cuda plan: heads_q * head_dim = " + std::to_string(int64_t{heads_q} * head_dim) +
                          " is too large (allowed: < " + std::to_string(kMaxRowElements) + ")");
  auto plan = std::make_shared<Plan>();
  plan->tq = mask.total_q;
  plan->tk = mask.total_k;
  plan->hq = heads_q;
  plan->hkv = heads_kv;
  plan->d = head_dim;
  plan->padded_d = padded_head_dim(head_dim);
  plan->device = device;

  DeviceGuard guard(device);
  check(cudaDeviceGetAttribute(&plan->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        "cudaDeviceGetAttribute");
  int l2_bytes = 0, sms = 0;
  check(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");

  const bool sm90 = tuning.forward_family != KernelFamily::Sm80 && sm90_forward_available(head_dim, device);
  if (tuning.forward_family == KernelFamily::Sm90 && !sm90)
    throw NotAvailable("cuda plan: the Hopper (sm_90a) forward is not available here (it needs a build for 90a "
                       "with the CUTLASS headers and a device of compute capability 9.0; allowed families "
                       "here: auto, sm80)");
  plan->fwd_family = sm90 ? KernelFamily::Sm90 : KernelFamily::Sm80;
  const int small_q = sm90 ? sm90::kForwardTileQ : detail::kFwdSmallTileQ;
  const int large_q = sm90 ? sm90::kForwardTileQ
                      : detail::fwd_smem_bytes(plan->padded_d, detail::kFwdTileQ) <= plan->smem_optin
                          ? detail::kFwdTileQ
                          : small_q;
  if (tuning.forward_tile_q != 0 && tuning.forward_tile_q != large_q && tuning.forward_tile_q != small_q)
    throw InvalidArgument("cuda plan: forward_tile_q " + std::to_string(tuning.forward_tile_q) +
                          " is not available at head dim " + std::to_string(head_dim) +
                          " on this device (allowed: 0, " +
                          std::to_string(small_q) + (large_q != small_q ? ", " + std::to_string(large_q) : "") +
                          ")");
  auto forward_tiles = [&](int q) {
    return tiling::by_q_tile(mask, q, sm90 ? sm90::forward_tile_k(plan->padded_d) : detail::fwd_tile_k(plan->padded_d, q));
  };
  int fwd_q = tuning.forward_tile_q != 0 ? tuning.forward_tile_q : large_q;
  tiling::TileLists fwd_tiles = forward_tiles(fwd_q);
  if (tuning.forward_tile_q == 0 && large_q != small_q) {
    tiling::TileLists small = forward_tiles(small_q);
    if (detail::prefer_small_forward_tile(static_cast<double>(fwd_tiles.computed_cells()),
                                          static_cast<double>(small.computed_cells()))) {
      fwd_q = small_q;
      fwd_tiles = std::move(small);
    }
  }
  const int fwd_k = fwd_tiles.tile_minor;
  plan->fwd_tile_q = fwd_q;
  plan->fwd_tile_k = fwd_k;
  const HostList fwd = convert(mask, fwd_tiles, true);
  for (const detail::TileInfo& t : fwd.tiles) plan->fwd_itemless_tiles += t.count == 0;
  HostList dkdv =
      convert(mask, tiling::by_k_tile(mask, detail::dkdv_tile_k(plan->padded_d), detail::kDkdvTileQ), false);
  // The dk/dv kernel (one block per SM) in passes of kv heads sharing their group's Q, dO and fp32 dq accumulator
  // in L2: varlen causal backward +7% (H100). The forward lost 2-5% in passes (causal, sliding window, shared
  // question) and keeps one.
  const double group_bytes = 8.0 * (plan->hq / plan->hkv) * plan->tq * plan->padded_d;
  const PassOrder dkdv_passes = order_in_passes(dkdv, plan->hkv, group_bytes, l2_bytes, sms);
  const int dq_k = detail::dq_tile_k(plan->padded_d);
  const int dq_q = detail::dq_tile_q(plan->padded_d);
  const bool dq_shared = dq_k == fwd_k && dq_q == fwd_q;
  HostList dq_own;
  if (!dq_shared) dq_own = convert(mask, tiling::by_q_tile(mask, dq_q, dq_k), true);
  const HostList& dq = dq_shared ? fwd : dq_own;

  // One upload: [lists...].
  std::vector<unsigned char> staging;
  auto append = [&](const void* data, size_t bytes) {
    const size_t at = align_up(staging.size());
    staging.resize(at + bytes);
    if (bytes) std::memcpy(staging.data() + at, data, bytes);
    return at;
  };
  struct Offsets {
    size_t tiles, items;
  };
  auto append_list = [&](const HostList& l) {
    return Offsets{append(l.tiles.data(), l.tiles.size() * sizeof(detail::TileInfo)),
                   append(l.items.data(), l.items.size() * sizeof(WorkItem))};
  };
  const Offsets o_fwd = append_list(fwd);
  const Offsets o_dkdv = append_list(dkdv);
  const Offsets o_dq = dq_shared ? o_fwd : append_list(dq_own);
  const size_t total = std::max<size_t>(staging.size(), 1);

  check(cudaMalloc(&plan->arena, total), "cudaMalloc (plan)");
  plan->arena_bytes = total;
  if (!staging.empty())
    check(cudaMemcpy(plan->arena, staging.data(), staging.size(), cudaMemcpyHostToDevice), "cudaMemcpy (plan)");
  auto* base = static_cast<unsigned char*>(plan->arena);
  auto make_list = [&](const HostList& l, const Offsets& o, PassOrder passes) {
    DeviceList d;
    d.tiles = reinterpret_cast<const detail::TileInfo*>(base + o.tiles);
    d.items = reinterpret_cast<const WorkItem*>(base + o.items);
    d.num_tiles = static_cast<int32_t>(l.tiles.size());
    d.heads_per_pass = passes.heads_per_pass;
    d.heavy_tiles = passes.heavy_tiles;
    return d;
  };
  // The forward and dq lists run as one pass: every head of a tile in turn, in the list's order.
  plan->fwd = make_list(fwd, o_fwd, {plan->hq, 0});
  plan->dkdv = make_list(dkdv, o_dkdv, dkdv_passes);
  plan->dq = make_list(dq, o_dq, {plan->hq, 0});
  plan->fwd_items = static_cast<int64_t>(fwd.items.size());
  plan->dkdv_items = static_cast<int64_t>(dkdv.items.size());
  plan->dq_items = static_cast<int64_t>(dq.items.size());
  return plan;
}

PlanStats stats(const Plan& plan) {
  PlanStats s;
  s.padded_head_dim = plan.padded_d;
  s.forward_tile_q = plan.fwd_tile_q;
  s.forward_tile_k = plan.fwd_tile_k;
  s.forward_family = plan.fwd_family;
  s.forward_items = plan.fwd_items;
  s.dkdv_items = plan.dkdv_items;
  s.dq_items = plan.dq_items;
  s.forward_tiles = plan.fwd.num_tiles;
  s.dkdv_tiles = plan.dkdv.num_tiles;
  s.dq_tiles = plan.dq.num_tiles;
  s.device_bytes = static_cast<int64_t>(plan.arena_bytes);
  return s;
}

namespace {

int dtype_tag(DType dtype) {
  if (dtype == DType::BF16) return detail::kBf16;
  if (dtype == DType::F16) return detail::kFp16;
  throw NotAvailable("cuda backend: dtype " + std::string(to_string(dtype)) +
                     " is not supported by the portable kernels (allowed: bf16, fp16)");
}

template <int kDtype>
void run_forward(int padded, const detail::FwdParams& p, int tile_q, int itemless, int margin, cudaStream_t stream) {
  switch (padded) {
#if MAGI_CUDA_HEAD_DIM_64
    case 64: return detail::launch_forward<kDtype, 64>(p, tile_q, itemless, margin, stream);
#endif
#if MAGI_CUDA_HEAD_DIM_128
    case 128: return detail::launch_forward<kDtype, 128>(p, tile_q, itemless, margin, stream);
#endif
#if MAGI_CUDA_HEAD_DIM_256
    case 256: return detail::launch_forward<kDtype, 256>(p, tile_q, itemless, margin, stream);
#endif
    default: throw NotAvailable("cuda backend: no forward kernel for head-dim tile " + std::to_string(padded));
  }
}

template <int kDtype>
void run_forward_sm90(int padded, const detail::FwdParams& p, int margin, cudaStream_t stream) {
  switch (padded) {
#if MAGI_CUDA_SM90 && MAGI_CUDA_HEAD_DIM_64
    case 64: return sm90::launch_forward<kDtype, 64>(p, margin, stream);
#endif
#if MAGI_CUDA_SM90 && MAGI_CUDA_HEAD_DIM_128
    case 128: return sm90::launch_forward<kDtype, 128>(p, margin, stream);
#endif
#if MAGI_CUDA_SM90 && MAGI_CUDA_HEAD_DIM_256
    case 256: return sm90::launch_forward<kDtype, 256>(p, margin, stream);
#endif
    default: throw NotAvailable("cuda backend: no sm_90a forward kernel for head-dim tile " + std::to_string(padded));
  }
}

template <int kDtype>
void run_forward_itemless(int padded, const detail::FwdParams& p, int tile_q, int itemless, cudaStream_t stream) {
  switch (padded) {
#if MAGI_CUDA_HEAD_DIM_64
    case 64: return detail::launch_forward_itemless<kDtype, 64>(p, tile_q, itemless, stream);
#endif
#if MAGI_CUDA_HEAD_DIM_128
    case 128: return detail::launch_forward_itemless<kDtype, 128>(p, tile_q, itemless, stream);
#endif
#if MAGI_CUDA_HEAD_DIM_256
    case 256: return detail::launch_forward_itemless<kDtype, 256>(p, tile_q, itemless, stream);
#endif
    default: throw NotAvailable("cuda backend: no forward kernel for head-dim tile " + std::to_string(padded));
  }
}

template <int kDtype>
void run_backward(int padded, const detail::BwdParams& dkdv, int dkdv_blocks, const detail::BwdParams& dq,
                  int dq_blocks, int margin, cudaStream_t stream) {
  switch (padded) {
#if MAGI_CUDA_HEAD_DIM_64
    case 64: return detail::launch_backward<kDtype, 64>(dkdv, dkdv_blocks, dq, dq_blocks, margin, stream);
#endif
#if MAGI_CUDA_HEAD_DIM_128
    case 128: return detail::launch_backward<kDtype, 128>(dkdv, dkdv_blocks, dq, dq_blocks, margin, stream);
#endif
#if MAGI_CUDA_HEAD_DIM_256
    case 256: return detail::launch_backward<kDtype, 256>(dkdv, dkdv_blocks, dq, dq_blocks, margin, stream);
#endif
    default: throw NotAvailable("cuda backend: no backward kernel for head-dim tile " + std::to_string(padded));
  }
}

int32_t sink_kind(SinkLayout layout) {
  switch (layout) {
    case SinkLayout::SH: return detail::kSinkSH;
    case SinkLayout::SSH: return detail::kSinkSSH;
    default: return detail::kSinkNone;
  }
}

int32_t sink_len(const TensorView& sink, SinkLayout layout) {
  if (layout == SinkLayout::SH) return static_cast<int32_t>(sink.shape[0]);
  if (layout == SinkLayout::SSH) return static_cast<int32_t>(sink.shape[1]);
  return 0;
}

struct ScaleTerms {
  float scale_log2, softmax_scale, softcap, softcap_pre, softcap_post;
};
ScaleTerms scale_terms(const Options& o) {
  constexpr double kLog2e = 1.4426950408889634;
  ScaleTerms t{};
  t.softmax_scale = static_cast<float>(o.softmax_scale);
  t.scale_log2 = static_cast<float>(o.softmax_scale * kLog2e);
  if (o.softcap > 0.0) {
    t.softcap = static_cast<float>(o.softcap);
    t.softcap_pre = static_cast<float>(o.softmax_scale / o.softcap);
    t.softcap_post = static_cast<float>(o.softcap * kLog2e);
  }
  return t;
}

}  // namespace

void forward(const Plan& plan, const ForwardArgs& a, const Options& o, cudaStream_t stream) {
  DeviceGuard guard(plan.device);
  const int tag = dtype_tag(a.q.dtype);
  const ScaleTerms t = scale_terms(o);
  detail::FwdParams p{};
  p.q = a.q.data;
  p.k = a.k.data;
  p.v = a.v.data;
  p.out = a.out.data;
  p.lse = static_cast<float*>(a.lse.data);
  p.max_logits = a.max_logits.ndim != 0 ? static_cast<float*>(a.max_logits.data) : nullptr;
  p.sink = o.sink_layout != SinkLayout::None ? static_cast<const float*>(a.sink.data) : nullptr;
  p.tq = plan.tq;
  p.tk = plan.tk;
  p.hq = plan.hq;
  p.hkv = plan.hkv;
  p.d = plan.d;
  p.sink_kind = sink_kind(o.sink_layout);
  p.sink_len = sink_len(a.sink, o.sink_layout);
  p.scale_log2 = t.scale_log2;
  p.softcap = t.softcap;
  p.softcap_pre = t.softcap_pre;
  p.softcap_post = t.softcap_post;
  p.out_fp32 = a.out.dtype == DType::F32;
  p.prev_out = a.prev_out.ndim != 0 ? static_cast<const float*>(a.prev_out.data) : nullptr;
  p.prev_lse = a.prev_out.ndim != 0 ? static_cast<const float*>(a.prev_lse.data) : nullptr;
  p.list = plan.fwd;
  p.work_counter = reinterpret_cast<int32_t*>(
      scratch_for(a.workspace, plan.device, stream, static_cast<size_t>(workspace_bytes(a, o))));
  StageTimer timer(o.profile, stream);
  timer.begin("forward_kernel");
  if (p.max_logits != nullptr) detail::launch_fill(p.max_logits, plan.hq, -INFINITY, stream);
  // Item-less tiles take their own copy kernel unless a sink joins their (otherwise empty) rows.
  const int itemless = p.sink_kind == detail::kSinkNone ? plan.fwd_itemless_tiles : 0;
  if (plan.fwd_family == KernelFamily::Sm90) {
    // The Hopper kernel walks the tiles with items; the item-less ones (the last of the order) take the copy kernel.
    detail::FwdParams with_items = p;
    with_items.list.num_tiles -= itemless;
    if (tag == detail::kBf16) run_forward_sm90<detail::kBf16>(plan.padded_d, with_items, o.sm_margin, stream);
    else run_forward_sm90<detail::kFp16>(plan.padded_d, with_items, o.sm_margin, stream);
    if (itemless > 0) {
      if (tag == detail::kBf16) run_forward_itemless<detail::kBf16>(plan.padded_d, p, plan.fwd_tile_q, itemless, stream);
      else run_forward_itemless<detail::kFp16>(plan.padded_d, p, plan.fwd_tile_q, itemless, stream);
    }
  } else if (tag == detail::kBf16) {
    run_forward<detail::kBf16>(plan.padded_d, p, plan.fwd_tile_q, itemless, o.sm_margin, stream);
  } else {
    run_forward<detail::kFp16>(plan.padded_d, p, plan.fwd_tile_q, itemless, o.sm_margin, stream);
  }
  timer.end();
  timer.report(std::string(plan.fwd_family == KernelFamily::Sm90 ? "cuda forward (sm90)" : "cuda forward (sm80)") +
               ", " + std::to_string(plan.fwd_items) + " work items, " + std::to_string(plan.fwd_tile_q) + " x " +
               std::to_string(plan.fwd_tile_k) + " tiles, head-dim tile " + std::to_string(plan.padded_d));
}

void backward(const Plan& plan, const BackwardArgs& a, const Options& o, cudaStream_t stream) {
  DeviceGuard guard(plan.device);
  // Checked before anything is launched: parts with ~100 KB per block (sm_86, sm_89) have no D 128 backward.
  const int dkdv_smem = detail::dkdv_smem_bytes(plan.padded_d, false);
  if (dkdv_smem > plan.smem_optin)
    throw Error("cuda backward: head dim " + std::to_string(plan.d) + " needs " + std::to_string(dkdv_smem) +
                " bytes of shared memory per block; this device allows " + std::to_string(plan.smem_optin) +
                " (use the CPU backend or a GPU with more shared memory, e.g. A100 / H100)");
  const int tag = dtype_tag(a.q.dtype);
  const ScaleTerms t = scale_terms(o);
  const bool dout_fp32 = a.dout.dtype == DType::F32;
  const BackwardLayout layout = backward_layout(a, plan.padded_d, plan.smem_optin, o.deterministic);
  unsigned char* scratch = scratch_for(a.workspace, plan.device, stream, layout.total);
  auto* const delta = reinterpret_cast<float*>(scratch + layout.delta);
  auto* const lse2 = reinterpret_cast<float*>(scratch + layout.lse2);
  auto* const counters = reinterpret_cast<int32_t*>(scratch + layout.counters);

  detail::PreprocessArgs pre{};
  pre.out = a.out.data;
  pre.out_fp32 = a.out.dtype == DType::F32;
  pre.dout = a.dout.data;
  pre.dout_fp32 = dout_fp32;
  pre.dout16 = dout_fp32 ? scratch + layout.dout16 : nullptr;
  pre.lse = static_cast<const float*>(a.lse.data);
  pre.delta = delta;
  pre.lse2 = lse2;
  pre.tq_pad = layout.tq_pad;
  pre.sink = o.sink_layout != SinkLayout::None ? static_cast<const float*>(a.sink.data) : nullptr;
  pre.dsink = o.sink_layout != SinkLayout::None ? static_cast<float*>(a.dsink.data) : nullptr;
  pre.sink_kind = sink_kind(o.sink_layout);
  pre.sink_len = sink_len(a.sink, o.sink_layout);
  pre.tq = plan.tq;
  pre.hq = plan.hq;
  pre.d = plan.d;
  detail::BwdParams p{};
  p.q = a.q.data;
  p.k = a.k.data;
  p.v = a.v.data;
  p.dout = dout_fp32 ? pre.dout16 : a.dout.data;
  p.lse2 = lse2;
  p.delta = delta;
  p.tq_pad = layout.tq_pad;
  p.dq = a.dq.data;
  p.dk = a.dk.data;
  p.dv = a.dv.data;
  p.tq = plan.tq;
  p.tk = plan.tk;
  p.hq = plan.hq;
  p.hkv = plan.hkv;
  p.d = plan.d;
  p.scale_log2 = t.scale_log2;
  p.softmax_scale = t.softmax_scale;
  p.softcap = t.softcap;
  p.softcap_pre = t.softcap_pre;
  p.softcap_post = t.softcap_post;
  p.grad_fp32 = a.dq.dtype == DType::F32;
  detail::BwdParams dkdv = p;
  dkdv.work_counter = counters + 1;
  dkdv.grad_fp32 = a.dk.dtype == DType::F32;
  dkdv.dv_fp32 = a.dv.dtype == DType::F32;
  dkdv.vector_stores = (reinterpret_cast<uintptr_t>(a.dk.data) | reinterpret_cast<uintptr_t>(a.dv.data)) % 16 == 0;
  detail::BwdParams dq = p;
  dq.list = plan.dq;
  dq.work_counter = counters + 2;
  const int dq_blocks = plan.dq.num_tiles * plan.hq;
  // Default: dq by fp32 atomics inside the dk/dv kernel, straight into an fp32 dq (the atomics add 4
  // floats: 16-byte alignment), else into the scratch accumulator and converted after. Deterministic: the
  // separate dq kernel.
  const bool fused_dq = layout.fused_dq;
  const size_t dq_elements = static_cast<size_t>(plan.tq) * plan.hq * plan.d;
  const bool dq_in_place = layout.dq_in_place;
  dkdv.list = plan.dkdv;
  const int dkdv_blocks = dkdv.list.num_tiles * plan.hkv;
  dq.accumulate_dq = a.accumulate_dq;
  if (fused_dq) {
    dkdv.dq_accum = dq_in_place ? static_cast<float*>(a.dq.data) : reinterpret_cast<float*>(scratch + layout.dq_accum);
    // The preprocess zeroes the atomics' target, unless they add to the caller's sum in place.
    if (!(a.accumulate_dq && dq_in_place)) pre.dq_zero = dkdv.dq_accum;
  }
  StageTimer timer(o.profile, stream);
  timer.begin("preprocess");
  detail::launch_preprocess(tag, pre, stream);
  if (o.sink_layout == SinkLayout::SH)
    detail::launch_dsink_sh(pre.sink, pre.lse, delta, layout.tq_pad, pre.dsink, pre.sink_len, plan.tq, plan.hq,
                            stream);
  timer.end();
  timer.begin(fused_dq ? "dkdv_kernel (dq by atomics)" : "dkdv_kernel + dq_kernel");
  if (tag == detail::kBf16)
    run_backward<detail::kBf16>(plan.padded_d, dkdv, dkdv_blocks, dq, dq_blocks, o.sm_margin, stream);
  else run_backward<detail::kFp16>(plan.padded_d, dkdv, dkdv_blocks, dq, dq_blocks, o.sm_margin, stream);
  timer.end();
  if (fused_dq && !dq_in_place) {
    timer.begin("dq conversion");
    if (a.accumulate_dq)
      detail::launch_add(static_cast<float*>(a.dq.data), dkdv.dq_accum, static_cast<int64_t>(dq_elements), stream);
    else if (dq.grad_fp32)
      check(cudaMemcpyAsync(a.dq.data, dkdv.dq_accum, dq_elements * 4, cudaMemcpyDeviceToDevice, stream),
            "cudaMemcpyAsync (dq)");
    else detail::launch_convert(tag, dkdv.dq_accum, a.dq.data, static_cast<int64_t>(dq_elements), stream);
    timer.end();
  }
  timer.report("cuda backward, " + std::to_string(plan.dkdv_items) + " dk/dv items" +
               (fused_dq ? " (dq by atomics)" : ", " + std::to_string(plan.dq_items) + " dq items"));
}

}  // namespace magi::cuda
