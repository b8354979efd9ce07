#include "distributed/band.hpp"

#include <algorithm>

namespace magi::dist {
namespace {

Range intersect(Range a, Range b) {
  const int32_t lo = std::max(a.start, b.start), hi = std::min(a.end, b.end);
  return lo < hi ? Range{lo, hi} : Range{lo, lo};
}

int32_t clamp32(int64_t v, int32_t lo, int32_t hi) { return static_cast<int32_t>(std::clamp<int64_t>(v, lo, hi)); }

}  // namespace

Band band_of(const Slice& s) {
  Band b{s.q, s.k};
  // The global forms of SPEC section 2's table.
  if (s.type == MaskType::Causal || s.type == MaskType::BiCausal) b.diag_hi = int64_t{s.k.end} - s.q.end;
  if (s.type == MaskType::InvCausal || s.type == MaskType::BiCausal) b.diag_lo = int64_t{s.k.start} - s.q.start;
  return b;
}

Band clip(const Band& band, Range rows, Range cols) {
  Band b = band;
  b.rows = intersect(band.rows, rows);
  b.cols = intersect(band.cols, cols);
  return b;
}

Band clip_rows(const Band& band, Range rows) { return clip(band, rows, band.cols); }
Band clip_cols(const Band& band, Range cols) { return clip(band, band.rows, cols); }

Band shift(const Band& band, int32_t dq, int32_t dk) {
  Band b = band;
  b.rows = {band.rows.start + dq, band.rows.end + dq};
  b.cols = {band.cols.start + dk, band.cols.end + dk};
  if (b.diag_lo > -Band::kUnbounded) b.diag_lo += int64_t{dk} - dq;
  if (b.diag_hi < Band::kUnbounded) b.diag_hi += int64_t{dk} - dq;
  return b;
}

void append_slices(const Band& band, std::vector<Slice>& out) {
  const int64_t r0 = band.rows.start, r1 = band.rows.end, c0 = band.cols.start, c1 = band.cols.end;
  const int64_t lo = band.diag_lo, hi = band.diag_hi;
  if (r0 >= r1 || c0 >= c1 || lo > hi) return;
  // Row q keeps [max(c0, q + lo), min(c1, q + hi + 1)). The lower edge follows the diagonal from row
  // lower_diag_from on, the upper edge until row upper_diag_until; between the cuts each row band is one type.
  // The rows where a diagonal meets a corner belong to the diagonal's slice, so a causal block stays one
  // causal slice (not causal + a one-row full slice, which the kernels would visit as a second tile).
  const int64_t lower_diag_from = std::clamp(c0 - lo, r0, r1);
  const int64_t upper_diag_until = std::clamp(c1 - hi, r0, r1);
  int64_t cuts[4] = {r0, std::min(lower_diag_from, upper_diag_until), std::max(lower_diag_from, upper_diag_until), r1};
  for (int i = 0; i < 3; ++i) {
    int64_t a = cuts[i], b = cuts[i + 1];
    if (a >= b) continue;
    const bool lower_diag = a >= lower_diag_from;
    const bool upper_diag = b <= upper_diag_until;
    // Trim rows that keep nothing: they sit at the start (upper edge on the diagonal) or the end (lower).
    if (upper_diag) a = std::max(a, c0 - hi);
    if (lower_diag) b = std::min(b, c1 - lo);
    if (a >= b) continue;
    const int64_t ks = lower_diag ? a + lo : c0;
    const int64_t ke = upper_diag ? b + hi : c1;
    if (ks >= ke) continue;
    const MaskType type = lower_diag ? (upper_diag ? MaskType::BiCausal : MaskType::InvCausal)
                                     : (upper_diag ? MaskType::Causal : MaskType::Full);
    out.push_back(Slice{{static_cast<int32_t>(a), static_cast<int32_t>(b)},
                        {static_cast<int32_t>(ks), static_cast<int32_t>(ke)}, type});
  }
}

int64_t area(const Band& band) {
  std::vector<Slice> slices;
  append_slices(band, slices);
  int64_t total = 0;
  for (const auto& s : slices) total += magi::area(s);
  return total;
}

Range kept_cols(const Band& band) {
  std::vector<Slice> slices;
  append_slices(band, slices);
  if (slices.empty()) return {0, 0};
  // Keys kept by the first and last non-empty rows bound the union (row edges never move left).
  const Range first = kept_keys(slices.front(), slices.front().q.start);
  const Range last = kept_keys(slices.back(), slices.back().q.end - 1);
  return {clamp32(first.start, band.cols.start, band.cols.end), clamp32(last.end, band.cols.start, band.cols.end)};
}

Range kept_rows(const Band& band) {
  std::vector<Slice> slices;
  append_slices(band, slices);
  if (slices.empty()) return {0, 0};
  return {slices.front().q.start, slices.back().q.end};
}

}  // namespace magi::dist
