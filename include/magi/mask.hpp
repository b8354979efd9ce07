// Attention masks as lists of slices (SPEC section 2). This header is the single source of truth for
// which (q, k) cells a slice keeps; every backend and planner calls these functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace magi {

enum class MaskType : int32_t {
  Full = 0,       // all cells
  Causal = 1,     // bottom-right aligned: k <= q + (ke - qe)
  InvCausal = 2,  // top-left aligned:     k >= q + (ks - qs)
  BiCausal = 3,   // both
};

// "full" | "causal" | "inv_causal" | "bi_causal"
std::string_view to_string(MaskType type);
// Accepts the names above and the ids "0".."3". Throws InvalidArgument naming `what`.
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
constexpr Range kept_keys(const Slice& s, int32_t q) {
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

constexpr Range kept_queries(const Slice& s, int32_t k) {
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

// Full validation (SPEC section 2): ranges inside [0, total), start <= end, known types, and no two
// slices whose kept areas overlap. Throws InvalidArgument naming the offending slice index(es).
void validate(const Mask& mask);
// Same without the overlap check (O(N log N) instead of the area sweep); used when sanity checks are off.
void validate_bounds(const Mask& mask);

// ---- builders (each returns a valid mask) ----
namespace masks {

Mask full(int32_t total_q, int32_t total_k);
Mask causal(int32_t total_q, int32_t total_k);  // bottom-right aligned
// cu_seqlens: prefix sums starting at 0, one entry more than documents.
Mask varlen_full(const std::vector<int32_t>& cu_seqlens_q, const std::vector<int32_t>& cu_seqlens_k);
Mask varlen_causal(const std::vector<int32_t>& cu_seqlens_q, const std::vector<int32_t>& cu_seqlens_k);
Mask varlen_full(const std::vector<int32_t>& cu_seqlens);    // self-attention: q and k share lengths
Mask varlen_causal(const std::vector<int32_t>& cu_seqlens);
// Each query q sees keys k with q - left <= k <= q + right (self-attention over total tokens), decomposed
// into FULL / CAUSAL / INV_CAUSAL / BI_CAUSAL slices. left/right < 0 mean unbounded.
Mask sliding_window(int32_t total, int32_t left, int32_t right);
// Varlen sliding window: the window applies inside each document.
Mask varlen_sliding_window(const std::vector<int32_t>& cu_seqlens, int32_t left, int32_t right);
// Blocks of `block` tokens: a query sees every key of its own block and of all earlier blocks.
Mask block_causal(int32_t total, int32_t block);
// Block-causal inside each document.
Mask varlen_block_causal(const std::vector<int32_t>& cu_seqlens, int32_t block);
// A shared prefix of `question` tokens followed by answers of the given lengths: the question is causal,
// each answer sees the question (full) and itself (causal), never another answer.
Mask shared_question(int32_t question, const std::vector<int32_t>& answers);
// The first `global` tokens are seen by every query and see every key (causally: k <= q); every other
// query also sees a causal window of `window` keys before it.
Mask global_sliding_window(int32_t total, int32_t global, int32_t window);

}  // namespace masks

// ---- JSON form ----
// {"q_ranges": [[s,e],...], "k_ranges": [[s,e],...], "attn_type_map": [0 | "causal", ...],
//  "total_q": N?, "total_k": N?}   (totals default to the max range end)
Mask mask_from_json(std::string_view json_text);
std::string mask_to_json(const Mask& mask);

}  // namespace magi
