// Mask validation (SPEC section 2): bounds, types, and exact detection of overlapping kept areas.
//
// Overlap check: a sweep over q (slices ordered by their first kept row) with a segment tree over the
// compressed k axis holding the slices still active at the sweep row. Only pairs whose kept bounding
// boxes intersect are examined, and each pair is decided in O(1) from its piecewise-linear kept
// intervals, never row by row.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "magi/error.hpp"
#include "magi/mask.hpp"

namespace magi {
namespace {

bool is_known_type(MaskType type) {
  const auto id = static_cast<int32_t>(type);
  return id >= 0 && id <= static_cast<int32_t>(MaskType::BiCausal);
}

std::string describe(size_t index, const Slice& s) {
  const std::string type = is_known_type(s.type) ? std::string(to_string(s.type))
                                                  : "type " + std::to_string(static_cast<int32_t>(s.type));
  return "slice " + std::to_string(index) + " (q [" + std::to_string(s.q.start) + ", " + std::to_string(s.q.end) +
         "), k [" + std::to_string(s.k.start) + ", " + std::to_string(s.k.end) + "), " + type + ")";
}

void check_range(size_t index, const Slice& s, const Range& r, const char* axis, int32_t total) {
  const std::string name = std::string(axis) + "_range";
  const std::string total_name = std::string("total_") + axis;
  if (r.start < 0) {
    throw InvalidArgument(describe(index, s) + ": " + name + " start " + std::to_string(r.start) +
                          " is negative; ranges must lie in [0, " + total_name + ")");
  }
  if (r.start > r.end) {
    throw InvalidArgument(describe(index, s) + ": " + name + " start " + std::to_string(r.start) + " > end " +
                          std::to_string(r.end) + "; ranges are half-open [start, end) with start <= end");
  }
  if (r.end > total) {
    throw InvalidArgument(describe(index, s) + ": " + name + " end " + std::to_string(r.end) + " exceeds " +
                          total_name + " " + std::to_string(total));
  }
}

// Kept keys of row q are [max(lo_const, q + lo_shift), min(hi_const, q + hi_shift)); an absent diagonal
// edge is a shift so far out that it never binds (|values| < 2^33, far from int64 limits).
constexpr int64_t kNoShift = int64_t{1} << 40;

struct KeptShape {
  int64_t q_begin, q_end;
  int64_t lo_const, lo_shift;
  int64_t hi_const, hi_shift;
};

KeptShape shape_of(const Slice& s) {
  const bool causal_edge = s.type == MaskType::Causal || s.type == MaskType::BiCausal;
  const bool inv_edge = s.type == MaskType::InvCausal || s.type == MaskType::BiCausal;
  return {s.q.start,
          s.q.end,
          s.k.start,
          inv_edge ? int64_t{s.k.start} - s.q.start : -kNoShift,
          s.k.end,
          causal_edge ? int64_t{s.k.end} - s.q.end + 1 : kNoShift};
}

struct Cell {
  int64_t q, k;
};

// First row (and its first key) where both slices keep a common key. The common keys of row q are
// [max(C, q + D), min(E, q + F)); non-empty iff C < E, D < F, q >= C - F + 1 and q <= E - D - 1.
std::optional<Cell> first_common_cell(const Slice& a, const Slice& b) {
  const KeptShape x = shape_of(a), y = shape_of(b);
  const int64_t c = std::max(x.lo_const, y.lo_const), d = std::max(x.lo_shift, y.lo_shift);
  const int64_t e = std::min(x.hi_const, y.hi_const), f = std::min(x.hi_shift, y.hi_shift);
  if (c >= e || d >= f) return std::nullopt;
  const int64_t q_first = std::max({x.q_begin, y.q_begin, c - f + 1});
  const int64_t q_last = std::min({x.q_end - 1, y.q_end - 1, e - d - 1});
  if (q_first > q_last) return std::nullopt;
  return Cell{q_first, std::max(c, q_first + d)};
}

// Smallest box holding every kept cell of a non-empty slice. lo and hi of the kept interval never
// decrease with q, so the box is [first row lo, last row hi).
struct Box {
  int32_t q0, q1, k0, k1;
};

Box kept_box(const Slice& s) {
  const int32_t rows = s.q.size(), cols = s.k.size();
  int32_t q0 = s.q.start, q1 = s.q.end;
  if (s.type == MaskType::Causal) q0 += std::max(0, rows - cols);        // top rows above the diagonal
  if (s.type == MaskType::InvCausal) q1 = s.q.start + std::min(rows, cols);  // bottom rows past it
  return {q0, q1, kept_keys(s, q0).start, kept_keys(s, q1 - 1).end};
}

// Segment tree over elementary k segments; node v stores the active slices whose k extent covers v's
// segment range but not its parent's. Entries of slices that ended above the sweep row are dropped
// lazily when a query passes their node, so each entry is removed once.
class ActiveSlices {
 public:
  ActiveSlices(size_t segments, const std::vector<Box>& boxes)
      : segments_(segments), boxes_(boxes), nodes_(4 * std::max<size_t>(segments, 1)),
        seen_stamp_(boxes.size(), -1) {}

  void insert(int32_t id, size_t seg_begin, size_t seg_end) { insert(1, 0, segments_, seg_begin, seg_end, id); }

  // Active slices (q1 > sweep_q) whose k extent meets [seg_begin, seg_end), each once.
  void query(size_t seg_begin, size_t seg_end, int32_t sweep_q, int32_t stamp, std::vector<int32_t>& out) {
    sweep_q_ = sweep_q;
    stamp_ = stamp;
    query(1, 0, segments_, seg_begin, seg_end, out);
  }

 private:
  struct Node {
    std::vector<int32_t> ids;
    int64_t stored = 0;  // entries in this subtree
  };

  int64_t insert(size_t v, size_t l, size_t r, size_t a, size_t b, int32_t id) {
    if (b <= l || r <= a) return 0;
    int64_t added = 0;
    if (a <= l && r <= b) {
      nodes_[v].ids.push_back(id);
      added = 1;
    } else {
      const size_t m = (l + r) / 2;
      added = insert(2 * v, l, m, a, b, id) + insert(2 * v + 1, m, r, a, b, id);
    }
    nodes_[v].stored += added;
    return added;
  }

  // Returns the number of dead entries dropped in this subtree.
  int64_t query(size_t v, size_t l, size_t r, size_t a, size_t b, std::vector<int32_t>& out) {
    Node& node = nodes_[v];
    if (b <= l || r <= a || node.stored == 0) return 0;
    const size_t before = node.ids.size();
    std::erase_if(node.ids, [&](int32_t id) { return boxes_[static_cast<size_t>(id)].q1 <= sweep_q_; });
    int64_t dropped = static_cast<int64_t>(before - node.ids.size());
    for (int32_t id : node.ids) {
      int32_t& seen = seen_stamp_[static_cast<size_t>(id)];
      if (seen != stamp_) {
        seen = stamp_;
        out.push_back(id);
      }
    }
    if (r - l > 1) {
      const size_t m = (l + r) / 2;
      dropped += query(2 * v, l, m, a, b, out) + query(2 * v + 1, m, r, a, b, out);
    }
    node.stored -= dropped;
    return dropped;
  }

  size_t segments_;
  const std::vector<Box>& boxes_;
  std::vector<Node> nodes_;
  std::vector<int32_t> seen_stamp_;
  int32_t sweep_q_ = 0;
  int32_t stamp_ = 0;
};

void check_no_overlap(const Mask& mask) {
  const size_t n = mask.slices.size();
  std::vector<Box> boxes(n);
  std::vector<int32_t> order;
  std::vector<int32_t> k_coords;
  for (size_t i = 0; i < n; ++i) {
    if (area(mask.slices[i]) == 0) continue;  // empty slices overlap nothing
    boxes[i] = kept_box(mask.slices[i]);
    order.push_back(static_cast<int32_t>(i));
    k_coords.push_back(boxes[i].k0);
    k_coords.push_back(boxes[i].k1);
  }
  if (order.size() < 2) return;
  std::sort(k_coords.begin(), k_coords.end());
  k_coords.erase(std::unique(k_coords.begin(), k_coords.end()), k_coords.end());
  const auto segment = [&](int32_t k) {
    return static_cast<size_t>(std::lower_bound(k_coords.begin(), k_coords.end(), k) - k_coords.begin());
  };
  std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return boxes[x].q0 < boxes[y].q0; });

  ActiveSlices active(k_coords.size() - 1, boxes);
  std::vector<int32_t> candidates;
  int32_t stamp = 0;
  for (int32_t id : order) {
    const Box& box = boxes[static_cast<size_t>(id)];
    const size_t seg_begin = segment(box.k0), seg_end = segment(box.k1);
    candidates.clear();
    active.query(seg_begin, seg_end, box.q0, stamp++, candidates);
    std::sort(candidates.begin(), candidates.end());  // report the lowest partner index
    for (int32_t other : candidates) {
      const Slice& a = mask.slices[static_cast<size_t>(std::min(id, other))];
      const Slice& b = mask.slices[static_cast<size_t>(std::max(id, other))];
      if (const auto cell = first_common_cell(a, b)) {
        const size_t ia = static_cast<size_t>(std::min(id, other)), ib = static_cast<size_t>(std::max(id, other));
        throw InvalidArgument("slices " + std::to_string(ia) + " and " + std::to_string(ib) + " overlap at (q=" +
                              std::to_string(cell->q) + ", k=" + std::to_string(cell->k) + "): " +
                              describe(ia, a) + ", " + describe(ib, b) + "; kept areas must be disjoint");
      }
    }
    active.insert(id, seg_begin, seg_end);
  }
}

}  // namespace

void validate_bounds(const Mask& mask) {
  if (mask.total_q < 0) {
    throw InvalidArgument("mask total_q " + std::to_string(mask.total_q) + " is negative; must be >= 0");
  }
  if (mask.total_k < 0) {
    throw InvalidArgument("mask total_k " + std::to_string(mask.total_k) + " is negative; must be >= 0");
  }
  for (size_t i = 0; i < mask.slices.size(); ++i) {
    const Slice& s = mask.slices[i];
    if (!is_known_type(s.type)) {
      throw InvalidArgument(describe(i, s) + ": mask type id " + std::to_string(static_cast<int32_t>(s.type)) +
                            " is unknown; allowed: 0 (full), 1 (causal), 2 (inv_causal), 3 (bi_causal)");
    }
    check_range(i, s, s.q, "q", mask.total_q);
    check_range(i, s, s.k, "k", mask.total_k);
  }
}

void validate(const Mask& mask) {
  validate_bounds(mask);
  check_no_overlap(mask);
}

}  // namespace magi
