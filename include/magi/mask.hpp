// Attention masks as lists of slices (SPEC section 2). This header is the single source of truth for
// which (q, k) cells a slice keeps; every backend and planner calls these functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

// kept_keys / kept_queries are also compiled for the GPU so that every CUDA engine uses these exact rules.
#if defined(__CUDACC__)
#define MAGI_MASK_HOST_DEVICE __host__ __device__
#else
#define MAGI_MASK_HOST_DEVICE
#endif

namespace magi {

enum class MaskType : int32_t {
  Full = 0,       // all cells
  Causal = 1,     // bottom-right aligned: k <= q + (ke - qe)
  InvCausal = 2,  // top-left aligned:     k >= q + (ks - qs)
  BiCausal = 3,   // both
};

// "full" | "causal" | "inv_causal" | "bi_causal". Throws InvalidArgument for an id outside 0..3.
std::string_view to_string(MaskType type);
// Accepts the names above (any letter case) and the ids "0".."3". Throws InvalidArgument naming `what`.
MaskType parse_mask_type(std::string_view text, std::string_view what = "mask type");

// Half-open [start, end) over token indices.
struct Range {
  int32_t start = 0;
  int32_t end = 0;

  constexpr int32_t size() const { return end > start ? end - start : 0; }
  constexpr bool empty() const { return end <= start; }
  friend constexpr bool operator==(const Range&, const Range&) = default;
};

struct Slice {
  Range q;
  Range k;
  MaskType type = MaskType::Full;
  friend constexpr bool operator==(const Slice&, const Slice&) = default;
};

// Keys kept by `slice` for global query row `q`: always one contiguous half-open interval (maybe empty).
// Columns kept for global key `k`: likewise contiguous. These two functions define the mask semantics.
MAGI_MASK_HOST_DEVICE constexpr Range kept_keys(const Slice& s, int32_t q) {
  if (q < s.q.start || q >= s.q.end) return {0, 0};
  int32_t lo = s.k.start, hi = s.k.end;
  if (s.type == MaskType::Causal || s.type == MaskType::BiCausal) {
    const int64_t last = int64_t{q} + (s.k.end - s.q.end);  // k <= last
    if (last + 1 < hi) hi = static_cast<int32_t>(last + 1 < lo ? lo : last + 1);
  }
  if (s.type == MaskType::InvCausal || s.type == MaskType::BiCausal) {
    const int64_t first = int64_t{q} + (s.k.start - s.q.start);  // k >= first
    if (first > lo) lo = static_cast<int32_t>(first > hi ? hi : first);
  }
  return lo < hi ? Range{lo, hi} : Range{0, 0};
}

MAGI_MASK_HOST_DEVICE constexpr Range kept_queries(const Slice& s, int32_t k) {
  if (k < s.k.start || k >= s.k.end) return {0, 0};
  int32_t lo = s.q.start, hi = s.q.end;
  if (s.type == MaskType::Causal || s.type == MaskType::BiCausal) {
    const int64_t first = int64_t{k} - (s.k.end - s.q.end);  // q >= first
    if (first > lo) lo = static_cast<int32_t>(first > hi ? hi : first);
  }
  if (s.type == MaskType::InvCausal || s.type == MaskType::BiCausal) {
    const int64_t last = int64_t{k} - (s.k.start - s.q.start);  // q <= last
    if (last + 1 < hi) hi = static_cast<int32_t>(last + 1 < lo ? lo : last + 1);
  }
  return lo < hi ? Range{lo, hi} : Range{0, 0};
}

// Number of kept cells, closed form, 64-bit.
int64_t area(const Slice& slice);

// A mask: slices plus the global lengths they index into.
struct Mask {
  std::vector<Slice> slices;
  int32_t total_q = 0;
  int32_t total_k = 0;

  int64_t area() const;           // sum of slice areas (areas never overlap in a valid mask)
  double density() const;         // area / (total_q * total_k), 0 for an empty grid
};

// Full validation (SPEC section 2): total_q/total_k >= 0, known types, 0 <= start <= end <= total for
// every range, and no two slices whose kept areas overlap (exact, decided per pair from the kept
// intervals; bounding boxes may overlap). Empty slices are legal. Throws InvalidArgument naming the
// offending slice index(es), e.g. "slices 2 and 7 overlap at (q=5, k=3)". O(N log N + candidate pairs),
// where candidates are pairs whose kept bounding boxes intersect.
void validate(const Mask& mask);
// Same without the overlap check (O(N)); used when sanity checks are off.
void validate_bounds(const Mask& mask);

// Validates, then describes the mask in text: slices (long lists shortened), area, density and a picture of
// about 64 characters ('#' all kept, '+' some, '.' none).
std::string describe(const Mask& mask);

// ---- merging (MAGI_ATTENTION_AUTO_RANGE_MERGE) ----
// Which merges merge_slices may make.
struct MergeRule {
  // 0: every merge below, whatever the list order; the result is sorted by (q.start, q.end, k.start, k.end, type).
  // g > 0: only neighbours in the list (zero-area slices aside), the earlier one left of or above the later,
  // meeting at a multiple of g; the merged slice takes the earlier one's place. Then every tiling whose tile sizes
  // divide g (src/mask/tiling.hpp) yields the same work items in the same order, so an engine planned on such
  // tiles computes bitwise the same results.
  int32_t boundary_multiple = 0;
};

// An equivalent mask with at most as many slices: the same totals and the same kept cells, each kept by as many
// slices as before (SPEC section 2: q-overlap is untouched). Zero-area slices are dropped, and two slices become
// one where their union is exactly one slice:
//  - side by side on the same rows (a.k.end == b.k.start), when every row of a reaches its right edge and every
//    row of b starts at its left edge: a FULL (or INV_CAUSAL with Sk >= Sq - 1) left of a FULL (or CAUSAL with
//    Sk >= Sq - 1); a one-row slice of any type keeps whole rows, so it qualifies too. The union takes a's left
//    edge and b's right edge: FULL, INV_CAUSAL, CAUSAL or BI_CAUSAL.
//  - stacked (a.q.end == b.q.start), same type, on the same edges: the same k start (for INV_CAUSAL and
//    BI_CAUSAL the same diagonal ks - qs) and the same k end (for CAUSAL and BI_CAUSAL the same diagonal
//    ke - qe), e.g. a causal slice cut into row bands.
// Greedy, repeated until no neighbours (in list order; in the free rule, in row and in column order) merge:
// merge_slices of the result returns it unchanged, though not always with the fewest slices (pieces can close a
// pinwheel that no pair leaves). Pure and deterministic; O(N log N) per round (one with boundary_multiple > 0).
Mask merge_slices(const Mask& mask, MergeRule rule = {});

// ---- builders (each returns a valid mask; exact kept sets below, q and k global indices) ----
// Arguments are checked: sizes >= 0, results must fit int32, cu_seqlens start at 0 and never decrease.
// Builders over documents emit a fixed structure (listed per builder) even where a slice is empty.
namespace masks {

// Every (q, k) with q < total_q, k < total_k. One FULL slice.
Mask full(int32_t total_q, int32_t total_k);
// k <= q + (total_k - total_q) (bottom-right aligned). One CAUSAL slice.
Mask causal(int32_t total_q, int32_t total_k);
// cu_seqlens: prefix sums starting at 0, one entry more than documents; q and k lists must have the same
// number of entries. Document d pairs q [cu_q[d], cu_q[d+1]) with k [cu_k[d], cu_k[d+1]); slice d is
// document d (FULL, or CAUSAL bottom-right aligned inside the document). total_q/k = last entries.
Mask varlen_full(const std::vector<int32_t>& cu_seqlens_q, const std::vector<int32_t>& cu_seqlens_k);
Mask varlen_causal(const std::vector<int32_t>& cu_seqlens_q, const std::vector<int32_t>& cu_seqlens_k);
Mask varlen_full(const std::vector<int32_t>& cu_seqlens);    // self-attention: q and k share lengths
Mask varlen_causal(const std::vector<int32_t>& cu_seqlens);
// Self-attention over `total` tokens: q keeps k with q - left <= k <= q + right (and 0 <= k < total).
// left/right < 0 mean unbounded. Decomposed into at most 3 non-empty slices over consecutive row bands
// (FULL / CAUSAL / INV_CAUSAL / BI_CAUSAL depending on which window edges are clipped by the sequence).
Mask sliding_window(int32_t total, int32_t left, int32_t right);
// The same window inside each document of cu_seqlens (never across documents); slices in document order.
Mask varlen_sliding_window(const std::vector<int32_t>& cu_seqlens, int32_t left, int32_t right);
// Blocks [b*block, min((b+1)*block, total)): a query keeps every key k < end of its own block.
// One FULL slice per block (q block x k prefix). block > 0.
Mask block_causal(int32_t total, int32_t block);
// Block-causal inside each document: blocks start at the document start; a query keeps keys from the
// document start to the end of its own block. One FULL slice per block, documents in order.
Mask varlen_block_causal(const std::vector<int32_t>& cu_seqlens, int32_t block);
// Tokens: the question [0, question), then answer a at [s_a, e_a) (lengths `answers`, in order).
// Question rows keep k <= q (causal). Answer rows keep the whole question and k in [s_a, q]; never another
// answer. Slices: CAUSAL question, then per answer FULL (answer x question) and CAUSAL (answer x itself).
Mask shared_question(int32_t question, const std::vector<int32_t>& answers);
// Rows q < global keep k <= q. Rows q >= global keep every k < global plus max(global, q - window) <= k <= q
// (themselves and the `window` tokens before them, excluding the global ones already kept).
// Slices: CAUSAL global x global, FULL rest x global, then the sliding window (left = window, right = 0)
// on the rest. 0 <= global <= total, window >= 0.
Mask global_sliding_window(int32_t total, int32_t global, int32_t window);

}  // namespace masks

// ---- JSON form ----
// {"q_ranges": [[s,e],...], "k_ranges": [[s,e],...], "attn_type_map": [0 | "causal", ...],
//  "total_q": N?, "total_k": N?}
// All three lists are required and have one entry per slice; types are ids 0..3 or names (to_string).
// Totals default to the largest range end (0 without slices). Other keys are rejected. The result is
// validate()d; every error is an InvalidArgument naming the key and the entry index.
Mask mask_from_json(std::string_view json_text);
// Compact one-line JSON with integer type ids and explicit totals; mask_from_json reads it back equal.
std::string mask_to_json(const Mask& mask);

}  // namespace magi
