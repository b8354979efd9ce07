// merge_slices: fewer, longer slices with exactly the same kept cells (MAGI_ATTENTION_AUTO_RANGE_MERGE).
//
// Row q of a slice keeps [lo(q), hi(q)) with lo = q + ks - qs on an inverse-causal (diagonal) left edge, else ks,
// and hi = q + ke - qe + 1 on a causal right edge, else ke (kept_keys: neither bound is ever clipped inside the
// slice's rows). Two slices are one exactly when these edge formulas line up; every rule below compares them.
#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "magi/mask.hpp"

namespace magi {
namespace {

bool causal_edge(MaskType t) { return t == MaskType::Causal || t == MaskType::BiCausal; }
bool inv_edge(MaskType t) { return t == MaskType::InvCausal || t == MaskType::BiCausal; }

MaskType type_with(bool inv, bool causal) {
  if (inv) return causal ? MaskType::BiCausal : MaskType::InvCausal;
  return causal ? MaskType::Causal : MaskType::Full;
}

// Every row ends at ke: no causal diagonal (one row is its own corner), and an inverse-causal row never starts
// past ke (the last row starts at ks + Sq - 1).
bool right_edge_straight(const Slice& s) {
  const int64_t sq = s.q.size(), sk = s.k.size();
  return (!causal_edge(s.type) || sq <= 1) && (!inv_edge(s.type) || sk >= sq - 1);
}

// Every row starts at ks: the mirror image (a causal row never ends before ks: the first ends at ke - Sq + 1).
bool left_edge_straight(const Slice& s) {
  const int64_t sq = s.q.size(), sk = s.k.size();
  return (!inv_edge(s.type) || sq <= 1) && (!causal_edge(s.type) || sk >= sq - 1);
}

// The one slice whose cells are those of a (first in the list) and b, if there is one under `rule`.
std::optional<Slice> merged_pair(const Slice& a, const Slice& b, const MergeRule& rule) {
  const int32_t g = rule.boundary_multiple;
  // Side by side, a on the left: rows meet at k = a.k.end, so the union keeps a's left and b's right edge.
  if (a.q == b.q && a.k.end == b.k.start && right_edge_straight(a) && left_edge_straight(b) &&
      (g <= 0 || a.k.end % g == 0))
    return Slice{a.q, {a.k.start, b.k.end}, type_with(inv_edge(a.type), causal_edge(b.type))};
  // Stacked, a on top, one type: each edge continues across the seam as the same straight line (same end) or the
  // same diagonal (same end - row). Diagonals move right going down: a starts and b ends the union.
  if (a.q.end == b.q.start && a.type == b.type && (g <= 0 || a.q.end % g == 0)) {
    const bool same_left = inv_edge(a.type) ? int64_t{a.k.start} - a.q.start == int64_t{b.k.start} - b.q.start
                                            : a.k.start == b.k.start;
    const bool same_right = causal_edge(a.type) ? int64_t{a.k.end} - a.q.end == int64_t{b.k.end} - b.q.end
                                                : a.k.end == b.k.end;
    if (same_left && same_right) return Slice{{a.q.start, b.q.end}, {a.k.start, b.k.end}, a.type};
  }
  return std::nullopt;
}

// One pass in list order: each slice merges into the last kept one while it can, and the result again into the
// one before. Afterwards no two neighbours merge (each pair was tried with its final values). True if any merged.
bool merge_neighbours(std::vector<Slice>& slices, const MergeRule& rule) {
  std::vector<Slice> kept;
  kept.reserve(slices.size());
  for (Slice s : slices) {
    while (!kept.empty()) {
      const std::optional<Slice> m = merged_pair(kept.back(), s, rule);
      if (!m) break;
      s = *m;
      kept.pop_back();
    }
    kept.push_back(s);
  }
  const bool changed = kept.size() != slices.size();
  slices = std::move(kept);
  return changed;
}

auto row_key(const Slice& s) { return std::make_tuple(s.q.start, s.q.end, s.k.start, s.k.end, s.type); }

// Slices that may stack share their type and both edge lines; within a group, in row order.
auto column_key(const Slice& s) {
  const int64_t left = inv_edge(s.type) ? int64_t{s.k.start} - s.q.start : s.k.start;
  const int64_t right = causal_edge(s.type) ? int64_t{s.k.end} - s.q.end : s.k.end;
  return std::make_tuple(s.type, left, right, s.q.start, s.q.end, s.k.start, s.k.end);
}

}  // namespace

Mask merge_slices(const Mask& mask, MergeRule rule) {
  Mask out;
  out.total_q = mask.total_q;
  out.total_k = mask.total_k;
  out.slices.reserve(mask.slices.size());
  for (const Slice& s : mask.slices)
    if (area(s) > 0) out.slices.push_back(s);
  if (rule.boundary_multiple > 0) {
    merge_neighbours(out.slices, rule);  // order kept: one pass is a fixed point
    return out;
  }
  // Free order: neighbours by rows (side by side), then by column group (stacked), until nothing merges.
  const auto by = [](auto key) { return [key](const Slice& x, const Slice& y) { return key(x) < key(y); }; };
  for (bool changed = true; changed;) {
    std::sort(out.slices.begin(), out.slices.end(), by([](const Slice& s) { return row_key(s); }));
    changed = merge_neighbours(out.slices, rule);
    std::sort(out.slices.begin(), out.slices.end(), by([](const Slice& s) { return column_key(s); }));
    changed = merge_neighbours(out.slices, rule) || changed;
  }
  std::sort(out.slices.begin(), out.slices.end(), by([](const Slice& s) { return row_key(s); }));
  return out;
}

}  // namespace magi
