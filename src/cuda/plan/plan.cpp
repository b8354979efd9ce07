#include "cuda/plan/plan.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "cuda/check.hpp"
#include "cuda/sm80/tiles.hpp"
#include "cuda/sm90/launch_backward.hpp"
#include "cuda/sm90/tiles.hpp"
#include "cuda/tile_list.hpp"
#include "cuda/plan/tuned_configs.hpp"
#include "magi/error.hpp"
#include "mask/tiling.hpp"

namespace magi::cuda {

using detail::DeviceList;
using detail::WorkItem;

namespace {

constexpr const int (&kCompiledTiles)[sizeof(detail::CompiledTiles::kValues) / sizeof(int)] =
    detail::CompiledTiles::kValues;

// kTileMultiple (backend.hpp) against every tile shape a plan may use.
constexpr bool every_tile_divides(int length) {
  for (int d : {64, 128, 256, 320, 384, 512, 576, 768, 1024}) {
    if (detail::is_large_head_dim(d)) {
      if (length % detail::large_fwd_tile_q(d) != 0 || length % detail::kLargeFwdTileK != 0) return false;
    } else {
      for (int q : {detail::kFwdTileQ, detail::kFwdSmallTileQ})
        if (length % q != 0 || length % detail::fwd_tile_k(d, q) != 0) return false;
    }
    if (sm90::sm90_forward_tile(d))
      for (int i = 0; i < sm90::forward_tile_q_choices(d); ++i) {
        const int q = sm90::forward_tile_q_choice(d, i);
        if (length % q != 0 || length % sm90::forward_tile_k(d, q) != 0) return false;
      }
    if (length % detail::kDkdvTileQ != 0 || length % detail::dkdv_tile_k(d) != 0) return false;
    if (sm90::sm90_backward_tile(d) && length % sm90::backward_tile_k(d) != 0) return false;
    if (length % detail::dq_tile_q(d) != 0 || length % detail::dq_tile_k(d) != 0) return false;
  }
  return true;
}
static_assert(every_tile_divides(kTileMultiple), "a tile shape no longer divides cuda::kTileMultiple");

// The large-D forward's variants against the parts' per-block shared memory: the resident one fits the A100
// (163 KB) and the streamed one sm_86 / sm_89 (99 KB) at every tile; the deep one fits Hopper (227 KB).
constexpr bool large_variants_fit() {
  for (int d : {320, 384, 512, 576, 768, 1024}) {
    if (detail::large_fwd_smem_bytes(d, detail::kLargeFwdResident) > 163 * 1024) return false;
    if (detail::large_fwd_smem_bytes(d, detail::kLargeFwdStreamed) > 99 * 1024) return false;
    if (detail::large_fwd_smem_bytes(d, detail::kLargeFwdDeep) > 227 * 1024) return false;
    if (detail::large_fwd_col_warps(d) == 0) return false;
  }
  // the tuned table's Hopper D 320 entries
  return detail::large_fwd_paired_fits(320) && detail::bwd_split_paired_fits(320);
}
static_assert(large_variants_fit(), "a large-D forward variant no longer fits the shared memory it is meant for");

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
      const int32_t unit = lists.starts.empty() ? minor : lists.unit;
      const Range mj = q_major ? w.q : w.k;
      const Range mn = q_major ? w.k : w.q;
      const int64_t mj0 = lists.tile(t).start;
      const int64_t mn0 = int64_t{mn.start} / unit * unit;
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
    int32_t tile = static_cast<int32_t>(t);
    if (!lists.starts.empty()) {  // DeviceList::tile_unit's encoding: a tile of `unit` rows is short
      const Range r = lists.tile(t);
      const bool last = t + 1 == tiles, whole = r.size() == lists.tile_major;
      if (r.start % lists.unit != 0 || (!last && !whole && r.size() != lists.unit))
        throw Error("cuda plan: aligned tile [" + std::to_string(r.start) + ", " + std::to_string(r.end) +
                    ") is not " + std::to_string(lists.tile_major) + " or " + std::to_string(lists.unit) + " rows");
      tile = r.start / lists.unit * 2 + (!whole && r.size() <= lists.unit ? 1 : 0);
    }
    out.tiles.push_back({tile, first, count, item == nullptr ? 0 : q_major ? item->k0 : item->q0});
  }
  // Heaviest tiles first so that the long ones start early; ties keep index order (deterministic).
  std::stable_sort(out.tiles.begin(), out.tiles.end(),
                   [](const detail::TileInfo& a, const detail::TileInfo& b) { return a.count > b.count; });
  group_tiles_sharing_data(out, q_major);
  return out;
}



// Heads per pass of a q-major list whose Hopper kernel streams K and V per item: where its works stream min_keys keys
// or more on average (sm90/tiles.hpp), about 32 blocks per head at a time (the largest divisor of the heads up to
// SMs / 32), so that the blocks running together share each head's K and V in L2; else one pass. (The forward's
// measurements: below and in tiles.hpp.)
int32_t streaming_heads_per_pass(const HostList& list, int32_t tile_k, int32_t heads, int32_t sms, int32_t min_keys) {
  int64_t keys = 0, busy_tiles = 0;
  for (const detail::TileInfo& t : list.tiles) {
    keys += int64_t{t.count} * tile_k;
    busy_tiles += t.count > 0;
  }
  int32_t per_pass = heads;
  if (keys >= int64_t{min_keys} * busy_tiles)
    for (int32_t h = 1; h <= std::max(1, sms / 32); ++h)
      if (heads % h == 0) per_pass = h;
  return per_pass;
}

// Passes for a list's blocks (work_coords): as many heads per pass as fit their `head_bytes` each in half the
// L2 (a divisor of `heads`), or `per_pass` where given; heavy tiles first, those that could end after everything
// else if they started in the last pass (more items than a pass gives each of the `slots` resident blocks), moved
// to the front in the list's order.
struct PassOrder {
  int32_t heads_per_pass, heavy_tiles;
};
PassOrder order_in_passes(HostList& list, int32_t heads, double head_bytes, int64_t l2_bytes, int64_t slots,
                          int32_t per_pass = 0) {
  if (per_pass == 0)
    for (int32_t h = 1; h <= heads; ++h)
      if (heads % h == 0 && (h == 1 || h * head_bytes <= 0.5 * static_cast<double>(l2_bytes))) per_pass = h;
  int64_t items = 0;
  for (const detail::TileInfo& t : list.tiles) items += t.count;
  const double pass_share = static_cast<double>(items) * per_pass / static_cast<double>(slots);
  const auto rest = std::stable_partition(list.tiles.begin(), list.tiles.end(),
                                          [&](const detail::TileInfo& t) { return t.count > pass_share; });
  return {per_pass, static_cast<int32_t>(rest - list.tiles.begin())};
}

// Whether a q-major list's tiles with items stream sm90::forward_pair_min_keys keys or more on average (the forward's
// pairs pay there).
bool streams_long_keys(const HostList& list, int32_t tile_k) {
  int64_t items = 0, busy = 0;
  for (const detail::TileInfo& t : list.tiles) {
    items += t.count;
    busy += t.count > 0;
  }
  return items * tile_k >= int64_t{sm90::forward_pair_min_keys} * busy;
}

// The forward's tiles with items in pairs that read the same K / V tiles in the same order (FwdParams::pairs), for
// the Hopper forward's clusters of two blocks; a tile without a partner is its own (both blocks compute it: the same
// bits). Pairs keep the list's order of their first tile, then go in passes as `order` puts the pairs' first tiles
// (the list's rule, with the resident clusters as slots). Returns no tiles where more than an eighth of the pairs would
// be a tile alone or the works are short (streams_long_keys), unless `always`.
template <class Order>
HostList pair_tiles(const HostList& list, int32_t tile_k, bool always, Order&& order, PassOrder& passes) {
  std::map<std::vector<int32_t>, size_t> waiting;  // k tiles read, in order -> the pair still missing its second
  std::vector<detail::TileInfo> second;             // per pair (by its first tile's position in `first.tiles`)
  HostList first;
  for (const detail::TileInfo& t : list.tiles) {
    if (t.count == 0) continue;
    std::vector<int32_t> reads(static_cast<size_t>(t.count));
    for (int32_t j = 0; j < t.count; ++j)
      reads[static_cast<size_t>(j)] = list.items[static_cast<size_t>(t.first + j)].k0 / tile_k;
    auto [at, fresh] = waiting.try_emplace(std::move(reads), first.tiles.size());
    if (fresh) {
      first.tiles.push_back(t);
      second.push_back(t);
    } else {
      second[at->second] = t;
      waiting.erase(at);
    }
  }
  if (first.tiles.empty() || (!always && (waiting.size() * 8 > first.tiles.size() || !streams_long_keys(list, tile_k))))
    return {};
  // A pair's q tile index says where its second is (tile indices are unique).
  std::map<int32_t, detail::TileInfo> partner;
  for (size_t i = 0; i < first.tiles.size(); ++i) partner[first.tiles[i].tile] = second[i];
  passes = order(first);
  HostList out;
  for (const detail::TileInfo& t : first.tiles) {
    out.tiles.push_back(t);
    out.tiles.push_back(partner[t.tile]);
  }
  passes.heavy_tiles *= 2;
  return out;
}

// WorkItem::rank of a k-major list in its final order: a head's works run in the order of their tiles in the list
// (work_coords), so an item's dQ add waits only on works taken before it (no deadlock on a persistent grid). The
// Hopper dk/dv kernel walks a tile's items last first: under causal, sliding-window and document masks every k
// tile then starts at the chunks the heavier tiles before it reach first (their last ones), and waits at most a
// chunk's time on each (first to last, the k tiles of one causal head waited in a chain: 3.5x slower).
// chunk_rows: the list's q chunk (64 rows; 64 / group tokens with concatenated heads).
void rank_dq_adds(HostList& list, int32_t chunk_rows) {
  std::vector<int32_t> adds;
  for (const detail::TileInfo& t : list.tiles)
    for (int32_t i = t.first + t.count - 1; i >= t.first; --i) {
      WorkItem& w = list.items[static_cast<size_t>(i)];
      const auto chunk = static_cast<size_t>(w.q0 / chunk_rows);
      if (chunk >= adds.size()) adds.resize(chunk + 1, 0);
      w.rank = adds[chunk]++;
    }
}

// Whether concatenated heads would push the dk/dv kernel's first wave out of L2. Walking a kv head's q heads one
// after another, blocks whose tiles hold alike item counts move through the heads in step: about one q head per kv
// head is in flight. Concatenated, every block reads all `group` of them at once. Where the first wave's rows (Q, dO
// and dQ: 8 D bytes a row and head) fit half the L2 one head at a time but not `group` at a time, the plain walk
// keeps its L2 hits (H100, D 128, sliding window 1024 over 2 x 8k tokens, group 4: L2 hit rate 82% -> 32%, bwd
// TFLOP/s 366 -> 220). Elsewhere (causal, documents: tiles of unlike lengths, no such step) it gained up to 25%.
bool concatenation_leaves_l2(const HostList& plain, PassOrder passes, int32_t kv_heads, int32_t group, int32_t tq,
                             int32_t padded_d, int64_t l2_bytes, int64_t slots) {
  DeviceList order;
  order.num_tiles = static_cast<int32_t>(plain.tiles.size());
  order.heavy_tiles = passes.heavy_tiles;
  order.heads_per_pass = passes.heads_per_pass;
  const size_t chunks = static_cast<size_t>(tq) / detail::kDkdvTileQ + 1;
  std::vector<bool> chunk_used(chunks * static_cast<size_t>(kv_heads), false);  // [kv head][64-row chunk]
  std::vector<int32_t> counts;
  const int64_t works = std::min<int64_t>(slots, int64_t{order.num_tiles} * kv_heads);
  for (int64_t n = 0; n < works; ++n) {
    const detail::WorkCoords at = detail::work_coords(static_cast<int32_t>(n), kv_heads, order);
    const detail::TileInfo& t = plain.tiles[static_cast<size_t>(at.tile_index)];
    if (t.count == 0) continue;
    counts.push_back(t.count);
    for (int32_t i = t.first; i < t.first + t.count; ++i)
      chunk_used[static_cast<size_t>(at.head) * chunks +
                 static_cast<size_t>(plain.items[static_cast<size_t>(i)].q0 / detail::kDkdvTileQ)] = true;
  }
  // In step: three in four tiles within 75% of the longest (a window's tiles, but for those at a document's end).
  const int32_t most = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  const auto alike = std::count_if(counts.begin(), counts.end(), [&](int32_t c) { return 4 * c >= 3 * most; });
  if (counts.empty() || 4 * alike < 3 * static_cast<int64_t>(counts.size())) return false;
  const double one_head =
      static_cast<double>(std::count(chunk_used.begin(), chunk_used.end(), true)) * detail::kDkdvTileQ * 8.0 * padded_d;
  const double half_l2 = 0.5 * static_cast<double>(l2_bytes);
  return one_head <= half_l2 && one_head * group > half_l2;
}

}  // namespace

int32_t padded_head_dim(int32_t d) {
  for (int tile : kCompiledTiles)
    if (tile != 0 && d <= tile) return tile;
  return 0;
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
  const int32_t padded = padded_head_dim(head_dim);
  return major == 9 && minor == 0 && sm90::sm90_forward_tile(padded) &&
         sm90::forward_smem_bytes(padded, sm90::forward_tile_q(padded)) <= smem;
#else
  (void)head_dim;
  (void)device;
  return false;
#endif
}

bool sm90_backward_available(int32_t head_dim, int32_t device) {
#if MAGI_CUDA_SM90
  if (!sm90_forward_available(head_dim, device)) return false;
  return sm90::sm90_backward_tile(padded_head_dim(head_dim));
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

  // A forward_variant names one of the portable D-split forward's variants: Auto then means the portable family.
  const bool sm90 = tuning.forward_family != KernelFamily::Sm80 &&
                    !(tuning.forward_family == KernelFamily::Auto && tuning.forward_variant >= 0) &&
                    sm90_forward_available(head_dim, device);
  if (tuning.forward_family == KernelFamily::Sm90 && tuning.forward_variant >= 0)
    throw InvalidArgument("cuda plan: forward_variant " + std::to_string(tuning.forward_variant) +
                          " is a variant of the portable family's large-D forward (allowed with forward family "
                          "sm90: -1)");
  if (tuning.forward_family == KernelFamily::Sm90 && !sm90)
    throw NotAvailable("cuda plan: the Hopper (sm_90a) forward is not available here (it needs a build for 90a "
                       "with the CUTLASS headers and a device of compute capability 9.0; allowed families "
                       "here: auto, sm80)");
  plan->fwd_family = sm90 ? KernelFamily::Sm90 : KernelFamily::Sm80;
  // A backward_variant names one of the portable D-split backward's variants: Auto then means the portable family.
  const bool portable_bwd_variant = tuning.backward_variant >= 0 && detail::is_large_head_dim(plan->padded_d);
  if (tuning.backward_family == KernelFamily::Sm90 && portable_bwd_variant && sm90_backward_available(head_dim, device))
    throw InvalidArgument("cuda plan: backward_variant " + std::to_string(tuning.backward_variant) +
                          " is a variant of the portable family's large-D backward (allowed with backward family "
                          "sm90: -1)");
  plan->bwd_family = tuning.backward_family != KernelFamily::Sm80 && !portable_bwd_variant &&
                             sm90_backward_available(head_dim, device)
                         ? KernelFamily::Sm90
                         : KernelFamily::Sm80;
  // Large head dims: one q tile, and the D-split kernel's variant for this device (plan/tuned_configs.cpp).
  const bool large_d = detail::is_large_head_dim(plan->padded_d);
  int major = 0, minor = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  const int32_t compute_capability = major * 10 + minor;
  if (large_d) {
    if (!sm90)
      plan->fwd_variant =
          large_forward_variant(compute_capability, plan->smem_optin, plan->padded_d, tuning.forward_variant);
    plan->bwd_variant =
        large_backward_variant(compute_capability, plan->smem_optin, plan->padded_d, tuning.backward_variant);
    // The Hopper backward adds dQ itself (vector reductions) in the default mode.
    plan->bwd_fuse_dq = plan->bwd_family == KernelFamily::Sm90 ||
                        large_backward_fuses_dq(compute_capability, plan->smem_optin, plan->padded_d);
  }
  // The forward's row tiles this plan may take, largest first.
  std::vector<int> tile_qs;
  if (sm90) {
    for (int i = 0; i < sm90::forward_tile_q_choices(plan->padded_d); ++i)
      tile_qs.push_back(sm90::forward_tile_q_choice(plan->padded_d, i));
  } else if (large_d) {
    tile_qs = {detail::large_fwd_tile_q(plan->padded_d)};
  } else {
    if (detail::fwd_smem_bytes(plan->padded_d, detail::kFwdTileQ) <= plan->smem_optin)
      tile_qs.push_back(detail::kFwdTileQ);
    tile_qs.push_back(detail::kFwdSmallTileQ);
  }
  if (tuning.forward_tile_q != 0 &&
      std::find(tile_qs.begin(), tile_qs.end(), tuning.forward_tile_q) == tile_qs.end()) {
    std::string allowed = "0";
    for (int q : tile_qs) allowed += ", " + std::to_string(q);
    throw InvalidArgument("cuda plan: forward_tile_q " + std::to_string(tuning.forward_tile_q) +
                          " is not available at head dim " + std::to_string(head_dim) + " on this device (allowed: " +
                          allowed + ")");
  }
  auto forward_tiles = [&](int q) {
    return tiling::by_q_tile(mask, q, sm90      ? sm90::forward_tile_k(plan->padded_d, q)
                                      : large_d ? detail::kLargeFwdTileK
                                                : detail::fwd_tile_k(plan->padded_d, q));
  };
  int fwd_q = tuning.forward_tile_q != 0 ? tuning.forward_tile_q : tile_qs.front();
  tiling::TileLists fwd_tiles = forward_tiles(fwd_q);
  if (tuning.forward_aligned_tiles < -1 || tuning.forward_aligned_tiles > 1)
    throw InvalidArgument("cuda plan: forward_aligned_tiles " + std::to_string(tuning.forward_aligned_tiles) +
                          " is not one of -1 (the planner's choice), 0 (never), 1 (wherever the tile takes them)");
  // Tiles that follow the slices (documents) where they compute fewer cells than the global grid's.
  if (sm90 && tuning.forward_aligned_tiles != 0 && sm90::forward_takes_aligned_tiles(plan->padded_d, fwd_q)) {
    tiling::TileLists aligned = tiling::by_q_tile_aligned(mask, fwd_q, fwd_tiles.tile_minor, sm90::forward_tile_unit);
    if (tuning.forward_aligned_tiles == 1 ||
        sm90::prefer_aligned_tiles(static_cast<double>(fwd_tiles.computed_cells()),
                                           static_cast<double>(aligned.computed_cells())))
      fwd_tiles = std::move(aligned);
  }
  // Each smaller tile against the largest's cells.
  const auto large_cells = static_cast<double>(fwd_tiles.computed_cells());
  for (size_t i = 1; tuning.forward_tile_q == 0 && i < tile_qs.size(); ++i) {
    tiling::TileLists small = forward_tiles(tile_qs[i]);
    const auto small_cells = static_cast<double>(small.computed_cells());
    if (sm90 ? sm90::prefer_small_forward_tile(plan->padded_d, tile_qs[i], large_cells, small_cells)
             : detail::prefer_small_forward_tile(large_cells, small_cells)) {
      fwd_q = tile_qs[i];
      fwd_tiles = std::move(small);
    }
  }
  // A plan without items runs the portable forward (backend.cpp): below the large head dims the Hopper's second tile
  // (its only one at D 256) is one that family has; at them it takes that family's tile and variant.
  if (sm90 && fwd_tiles.items.empty()) {
    if (large_d) {
      fwd_q = detail::large_fwd_tile_q(plan->padded_d);
      fwd_tiles = tiling::by_q_tile(mask, fwd_q, detail::kLargeFwdTileK);
      plan->fwd_variant = large_forward_variant(compute_capability, plan->smem_optin, plan->padded_d, -1);
    } else if (fwd_q != tile_qs[1 % tile_qs.size()]) {
      fwd_q = tile_qs[1 % tile_qs.size()];
      fwd_tiles = forward_tiles(fwd_q);
    }
  }
  const int fwd_k = fwd_tiles.tile_minor;
  plan->fwd_tile_unit = fwd_tiles.starts.empty() ? 0 : fwd_tiles.unit;
  plan->fwd_tile_q = fwd_q;
  plan->fwd_tile_k = fwd_k;
  HostList fwd = convert(mask, fwd_tiles, true);
  for (const detail::TileInfo& t : fwd.tiles) plan->fwd_itemless_tiles += t.count == 0;
  if (tuning.forward_heads_per_pass != 0 &&
      (tuning.forward_heads_per_pass < 0 || heads_q % tuning.forward_heads_per_pass != 0))
    throw InvalidArgument("cuda plan: forward_heads_per_pass " + std::to_string(tuning.forward_heads_per_pass) +
                          " must divide the " + std::to_string(heads_q) + " q heads (allowed: 0 = the planner's "
                          "choice, or a divisor of the q heads)");
  // The Hopper forward in passes of q heads where its works stream long key ranges (forward_pass_min_keys),
  // about 32 blocks per head at a time: the blocks running together then share each head's K and V in L2. In one
  // pass every wave of q tiles re-read them from DRAM (ncu, H100, 2 x 8k full mask, D 256: L2 hit rate 67%
  // against cuDNN's 99.97%, the consumers' top stall the wait for K). A/B of 1, 2, 4, 8 and 16 heads per pass
  // (H100, 16 heads): 4 gained 2-5% on the full, causal, shared-question and varlen-full masks at D 128 / 256;
  // 16 x 1k causal lost 4-7% in any pass, and the portable forward 2-5% (causal, sliding window, shared question):
  // those keep one.
  int32_t fwd_per_pass = tuning.forward_heads_per_pass;
  if (fwd_per_pass == 0)
    fwd_per_pass = sm90 ? streaming_heads_per_pass(fwd, fwd_k, heads_q, sms, sm90::forward_pass_min_keys(plan->padded_d))
                        : heads_q;
  // Resident works: one per SM (several with the Hopper forward's 64-row tiles), one per cluster of the Hopper
  // kernels' clusters.
  const int fwd_slots =
      sm90 ? sms * sm90::forward_blocks_per_sm(plan->padded_d, fwd_q) / sm90::forward_cluster_size(plan->padded_d)
           : sms;
  const PassOrder fwd_passes = fwd_per_pass == heads_q
                                   ? PassOrder{heads_q, 0}
                                   : order_in_passes(fwd, heads_q, 0.0, l2_bytes, fwd_slots, fwd_per_pass);
  if (tuning.forward_pairs < -1 || tuning.forward_pairs > 1)
    throw InvalidArgument("cuda plan: forward_pairs " + std::to_string(tuning.forward_pairs) +
                          " is not one of -1 (the planner's choice), 0 (never), 1 (wherever the tile takes them)");
  // Pairs of works for the Hopper forward's clusters: the q heads 2j and 2j + 1 of each tile where one kv head serves
  // both (an even GQA group: every work has a partner, whatever the mask), else q tiles reading the same K / V tiles.
  PassOrder fwd_pair_passes{heads_q, 0};
  HostList fwd_pairs;
  if (sm90 && tuning.forward_pairs != 0 && sm90::forward_takes_pairs(plan->padded_d, fwd_q) &&
      plan->fwd_tile_unit == 0) {
    const bool always = tuning.forward_pairs == 1;
    if ((heads_q / heads_kv) % 2 == 0 && fwd_passes.heads_per_pass % 2 == 0)
      plan->fwd_pairs_of_heads = always || streams_long_keys(fwd, fwd_k);
    else
      fwd_pairs = pair_tiles(fwd, fwd_k, always,
                             [&](HostList& first) {
                               return fwd_per_pass == heads_q ? PassOrder{heads_q, 0}
                                                              : order_in_passes(first, heads_q, 0.0, l2_bytes,
                                                                                fwd_slots / 2, fwd_per_pass);
                             },
                             fwd_pair_passes);
  }
  // The families' k tiles are the same up to head-dim tile 256; above, the Hopper kernel's is 64 keys, the portable
  // D-split kernel's 32 or 16.
  const int dkdv_k = plan->bwd_family == KernelFamily::Sm90 ? sm90::backward_tile_k(plan->padded_d)
                                                            : detail::dkdv_tile_k(plan->padded_d);
  HostList dkdv = convert(mask, tiling::by_k_tile(mask, dkdv_k, detail::kDkdvTileQ), false);
  if (tuning.backward_aligned_tiles < -1 || tuning.backward_aligned_tiles > 1)
    throw InvalidArgument("cuda plan: backward_aligned_tiles " + std::to_string(tuning.backward_aligned_tiles) +
                          " is not one of -1 (the planner's choice), 0 (never), 1 (wherever the tile takes them)");
  // The Hopper dk/dv kernel's k tiles aligned to the slices where they compute fewer cells; the global grid's list
  // stays for the portable kernel, which runs a call whose addresses the Hopper one cannot load.
  HostList dkdv_grid;
  if (plan->bwd_family == KernelFamily::Sm90 && tuning.backward_aligned_tiles != 0 &&
      sm90::backward_takes_aligned_tiles(plan->padded_d)) {
    const tiling::TileLists grid = tiling::by_k_tile(mask, dkdv_k, detail::kDkdvTileQ);
    const tiling::TileLists aligned =
        tiling::by_k_tile_aligned(mask, dkdv_k, detail::kDkdvTileQ, sm90::backward_tile_unit);
    if (tuning.backward_aligned_tiles == 1 ||
        sm90::prefer_aligned_tiles(static_cast<double>(grid.computed_cells()),
                                   static_cast<double>(aligned.computed_cells()))) {
      plan->dkdv_tile_unit = aligned.unit;
      dkdv_grid = std::move(dkdv);
      dkdv = convert(mask, aligned, false);
    }
  }
  // The dk/dv kernel (one block per SM or cluster) in passes of kv heads sharing their group's Q, dO and fp32 dq
  // accumulator in L2: varlen causal backward +7% (H100). (Counting SMs, not clusters, the Hopper D 512 backward took
  // every full-mask tile for heavy and ran all heads at once: 67% of DRAM's bandwidth, 141 bwd TFLOP/s.)
  const double group_bytes = 8.0 * (plan->hq / plan->hkv) * plan->tq * plan->padded_d;
  const int dkdv_slots =
      plan->bwd_family == KernelFamily::Sm90 ? sms / sm90::backward_cluster_size(plan->padded_d) : sms;
  const PassOrder dkdv_passes = order_in_passes(dkdv, plan->hkv, group_bytes, l2_bytes, dkdv_slots);
  rank_dq_adds(dkdv, detail::kDkdvTileQ);
  const PassOrder dkdv_grid_passes =
      dkdv_grid.tiles.empty() ? PassOrder{} : order_in_passes(dkdv_grid, plan->hkv, group_bytes, l2_bytes, sms);
  // Concatenated heads: a 64-row chunk holds 64 / group tokens of every q head of the group.
  const int32_t group = plan->hq / plan->hkv;
  HostList dkdv_cat;
  PassOrder dkdv_cat_passes{};
  if (tuning.backward_cat_gqa && plan->bwd_family == KernelFamily::Sm90 && sm90::sm90_ordered_dq(plan->padded_d) &&
      group > 1 && detail::kDkdvTileQ % group == 0 &&
      !concatenation_leaves_l2(dkdv, dkdv_passes, plan->hkv, group, plan->tq, plan->padded_d, l2_bytes, dkdv_slots)) {
    plan->bwd_cat_group = group;
    dkdv_cat = convert(mask, tiling::by_k_tile(mask, dkdv_k, detail::kDkdvTileQ / group), false);
    dkdv_cat_passes = order_in_passes(dkdv_cat, plan->hkv, group_bytes, l2_bytes, dkdv_slots);
    rank_dq_adds(dkdv_cat, detail::kDkdvTileQ / group);
  }
  const int dq_k = detail::dq_tile_k(plan->padded_d);
  const int dq_q = detail::dq_tile_q(plan->padded_d);
  const bool dq_shared = dq_k == fwd_k && dq_q == fwd_q && plan->fwd_tile_unit == 0;
  HostList dq_own;
  if (!dq_shared) dq_own = convert(mask, tiling::by_q_tile(mask, dq_q, dq_k), true);
  const HostList& dq = dq_shared ? fwd : dq_own;
  // The Hopper dq kernel's own tiles (the portable list stays for calls whose addresses the Hopper kernels can't load).
  // It streams K and V per item as the Hopper forward does: in passes of heads by the forward's rule.
  HostList dq_sm90;
  PassOrder dq_sm90_passes{plan->hq, 0};
  if (plan->bwd_family == KernelFamily::Sm90 && sm90::sm90_dq_kernel(plan->padded_d)) {
    dq_sm90 = convert(mask, tiling::by_q_tile(mask, sm90::dq_tile_q(), sm90::dq_tile_k()), true);
    const int32_t per_pass = streaming_heads_per_pass(dq_sm90, sm90::dq_tile_k(), plan->hq, sms, sm90::dq_pass_min_keys());
    if (per_pass != plan->hq) dq_sm90_passes = order_in_passes(dq_sm90, plan->hq, 0.0, l2_bytes, sms, per_pass);
  }

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
  const Offsets o_fwd_pairs{append(fwd_pairs.tiles.data(), fwd_pairs.tiles.size() * sizeof(detail::TileInfo)),
                            o_fwd.items};  // the fwd list's items
  const Offsets o_dkdv = append_list(dkdv);
  const Offsets o_dkdv_grid = append_list(dkdv_grid);
  const Offsets o_dq = dq_shared ? o_fwd : append_list(dq_own);
  const Offsets o_dkdv_cat = append_list(dkdv_cat);
  const Offsets o_dq_sm90 = append_list(dq_sm90);
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
  // The dq list runs as one pass: every head of a tile in turn, in the list's order.
  plan->fwd = make_list(fwd, o_fwd, fwd_passes);
  plan->fwd.tile_unit = plan->fwd_tile_unit;
  plan->fwd_pairs = plan->fwd_pairs_of_heads ? plan->fwd : make_list(fwd_pairs, o_fwd_pairs, fwd_pair_passes);
  plan->dkdv = make_list(dkdv, o_dkdv, dkdv_passes);
  plan->dkdv.tile_unit = plan->dkdv_tile_unit;
  plan->dkdv_grid = plan->dkdv_tile_unit == 0 ? plan->dkdv : make_list(dkdv_grid, o_dkdv_grid, dkdv_grid_passes);
  plan->dq = make_list(dq, o_dq, {plan->hq, 0});
  if (plan->bwd_cat_group > 1) plan->dkdv_cat = make_list(dkdv_cat, o_dkdv_cat, dkdv_cat_passes);
  plan->dq_sm90 = make_list(dq_sm90, o_dq_sm90, dq_sm90_passes);
  plan->dq_sm90_items = static_cast<int64_t>(dq_sm90.items.size());
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
  s.backward_family = plan.bwd_family;
  s.forward_variant = plan.fwd_variant;
  s.backward_variant = plan.bwd_variant;
  s.forward_heads_per_pass = plan.fwd.heads_per_pass;
  s.backward_cat_group = plan.bwd_cat_group;
  s.forward_pairs = plan.fwd_pairs_of_heads
                        ? int64_t{plan.fwd.num_tiles - plan.fwd_itemless_tiles} * plan.hq / 2
                        : int64_t{plan.fwd_pairs.num_tiles} / 2 * plan.hq;
  s.forward_pairs_of_heads = plan.fwd_pairs_of_heads;
  s.forward_aligned_tiles = plan.fwd_tile_unit != 0;
  s.backward_aligned_tiles = plan.dkdv_tile_unit != 0;
  s.forward_items = plan.fwd_items;
  s.dkdv_items = plan.dkdv_items;
  s.dq_items = plan.dq_items;
  s.forward_tiles = plan.fwd.num_tiles;
  s.dkdv_tiles = plan.dkdv.num_tiles;
  s.dq_tiles = plan.dq.num_tiles;
  s.device_bytes = static_cast<int64_t>(plan.arena_bytes);
  return s;
}

}  // namespace magi::cuda
