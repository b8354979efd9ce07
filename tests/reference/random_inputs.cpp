#include "reference/random_inputs.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>

namespace magi::test {

uint64_t fresh_seed() {
  std::random_device device;
  return (uint64_t{device()} << 32) ^ device();
}

std::vector<double> random_normal(std::mt19937_64& rng, std::size_t n, DType dtype, double stddev) {
  std::normal_distribution<double> normal(0.0, stddev);
  std::vector<double> values(n);
  for (double& x : values) x = round_to(dtype, normal(rng));
  return values;
}

std::vector<double> rounded(const std::vector<double>& values, DType dtype) {
  std::vector<double> r(values.size());
  std::transform(values.begin(), values.end(), r.begin(), [dtype](double x) { return round_to(dtype, x); });
  return r;
}

// ---------------- HostTensor ----------------

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
  bytes_.assign(static_cast<std::size_t>(numel() * dtype_size(dtype_)), 0);
}

int64_t HostTensor::numel() const {
  if (shape_.empty()) return 0;
  return std::accumulate(shape_.begin(), shape_.end(), int64_t{1}, std::multiplies<>());
}

HostTensor HostTensor::from_values(const std::vector<double>& values, DType dtype, std::vector<int64_t> shape) {
  HostTensor t(dtype, std::move(shape));
  for (std::size_t i = 0; i < values.size() && static_cast<int64_t>(i) < t.numel(); ++i) {
    unsigned char* at = t.bytes_.data() + i * dtype_size(dtype);
    const double x = values[i];
    switch (dtype) {
      case DType::F64: std::memcpy(at, &x, 8); break;
      case DType::F32: {
        const float f = static_cast<float>(x);
        std::memcpy(at, &f, 4);
        break;
      }
      case DType::BF16: {
        const uint16_t b = float_to_bf16_bits(static_cast<float>(x));
        std::memcpy(at, &b, 2);
        break;
      }
      case DType::F16: {
        const uint16_t b = float_to_fp16_bits(static_cast<float>(x));
        std::memcpy(at, &b, 2);
        break;
      }
    }
  }
  return t;
}

HostTensor HostTensor::poisoned(DType dtype, std::vector<int64_t> shape) {
  HostTensor t(dtype, std::move(shape));
  const std::vector<double> nan(static_cast<std::size_t>(t.numel()), std::numeric_limits<double>::quiet_NaN());
  return from_values(nan, dtype, t.shape_);
}

std::vector<double> HostTensor::values() const {
  std::vector<double> out(static_cast<std::size_t>(numel()));
  for (std::size_t i = 0; i < out.size(); ++i) {
    const unsigned char* at = bytes_.data() + i * dtype_size(dtype_);
    switch (dtype_) {
      case DType::F64: std::memcpy(&out[i], at, 8); break;
      case DType::F32: {
        float f;
        std::memcpy(&f, at, 4);
        out[i] = f;
        break;
      }
      case DType::BF16: {
        uint16_t b;
        std::memcpy(&b, at, 2);
        out[i] = bf16_bits_to_float(b);
        break;
      }
      case DType::F16: {
        uint16_t b;
        std::memcpy(&b, at, 2);
        out[i] = fp16_bits_to_float(b);
        break;
      }
    }
  }
  return out;
}

TensorView HostTensor::view() {
  TensorView v;
  if (shape_.empty()) return v;
  v.data = bytes_.data();
  v.dtype = dtype_;
  v.ndim = static_cast<int32_t>(shape_.size());
  for (std::size_t i = 0; i < shape_.size(); ++i) v.shape[i] = shape_[i];
  return v;
}

// ---------------- masks ----------------

Slice make_slice(int32_t qs, int32_t qe, int32_t ks, int32_t ke, MaskType type) {
  return Slice{Range{qs, qe}, Range{ks, ke}, type};
}

std::vector<int32_t> cu_seqlens_of(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> cu{0};
  for (int32_t n : lengths) cu.push_back(cu.back() + n);
  return cu;
}

namespace {

struct Box {
  int32_t qs, qe, ks, ke;
  int64_t area() const { return int64_t{qe - qs} * (ke - ks); }
  bool splittable() const { return qe - qs >= 2 || ke - ks >= 2; }
};

// A random sub-range of [start, end) that is non-empty when the range is.
std::pair<int32_t, int32_t> random_subrange(std::mt19937_64& rng, int32_t start, int32_t end) {
  if (end - start <= 1) return {start, end};
  std::uniform_int_distribution<int32_t> pick(start, end - 1);
  int32_t a = pick(rng), b = pick(rng);
  if (a > b) std::swap(a, b);
  return {a, b + 1};
}

}  // namespace

Mask random_rectangles(std::mt19937_64& rng, int32_t total_q, int32_t total_k, int32_t slices) {
  std::vector<Box> boxes{{0, total_q, 0, total_k}};
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  // Split boxes chosen with probability proportional to area, so sizes stay mixed but not degenerate.
  while (static_cast<int32_t>(boxes.size()) < slices) {
    std::vector<double> weights;
    for (const Box& b : boxes) weights.push_back(b.splittable() ? static_cast<double>(b.area()) : 0.0);
    if (std::all_of(weights.begin(), weights.end(), [](double w) { return w == 0.0; })) break;
    std::discrete_distribution<std::size_t> choose(weights.begin(), weights.end());
    const std::size_t index = choose(rng);
    Box box = boxes[index];
    const int32_t sq = box.qe - box.qs, sk = box.ke - box.ks;
    const bool along_q = sk < 2 || (sq >= 2 && unit(rng) < static_cast<double>(sq) / (sq + sk));
    Box other = box;
    if (along_q) {
      const int32_t cut = std::uniform_int_distribution<int32_t>(box.qs + 1, box.qe - 1)(rng);
      box.qe = cut;
      other.qs = cut;
    } else {
      const int32_t cut = std::uniform_int_distribution<int32_t>(box.ks + 1, box.ke - 1)(rng);
      box.ke = cut;
      other.ks = cut;
    }
    boxes[index] = box;
    boxes.push_back(other);
  }

  Mask mask;
  mask.total_q = total_q;
  mask.total_k = total_k;
  std::uniform_int_distribution<int32_t> type(0, 3);
  for (Box b : boxes) {
    const double fate = unit(rng);
    if (fate < 0.05) continue;  // dropped: its rows may end up uncovered
    if (fate < 0.25) {          // shrunk inside its box
      std::tie(b.qs, b.qe) = random_subrange(rng, b.qs, b.qe);
      std::tie(b.ks, b.ke) = random_subrange(rng, b.ks, b.ke);
    } else if (fate < 0.27) {   // zero-area slice: legal, contributes nothing
      b.qe = b.qs;
    }
    mask.slices.push_back(make_slice(b.qs, b.qe, b.ks, b.ke, static_cast<MaskType>(type(rng))));
  }
  std::shuffle(mask.slices.begin(), mask.slices.end(), rng);
  return mask;
}

void cut_slice(std::mt19937_64& rng, const Slice& s, int depth, int32_t align, std::vector<Slice>& pieces) {
  std::uniform_int_distribution<int> coin(0, 3);
  const auto point = [&](int32_t lo, int32_t hi) -> std::optional<int32_t> {  // strictly inside (lo, hi)
    if (hi - lo < 2) return std::nullopt;
    if (align <= 1) return std::uniform_int_distribution<int32_t>(lo + 1, hi - 1)(rng);
    const int32_t first = (lo / align + 1) * align, last = (hi - 1) / align * align;
    if (first > last) return std::nullopt;
    return first + align * std::uniform_int_distribution<int32_t>(0, (last - first) / align)(rng);
  };
  const bool inv = s.type == MaskType::InvCausal || s.type == MaskType::BiCausal;
  const bool causal = s.type == MaskType::Causal || s.type == MaskType::BiCausal;
  if (depth > 0 && coin(rng) != 0) {
    if (coin(rng) < 2) {  // rows: the diagonals carry on
      if (const auto r = point(s.q.start, s.q.end)) {
        const Slice top{{s.q.start, *r}, {s.k.start, causal ? s.k.end - (s.q.end - *r) : s.k.end}, s.type};
        const Slice bottom{{*r, s.q.end}, {inv ? s.k.start + (*r - s.q.start) : s.k.start, s.k.end}, s.type};
        if (top.k.start <= top.k.end && bottom.k.start <= bottom.k.end && area(top) > 0 && area(bottom) > 0) {
          cut_slice(rng, top, depth - 1, align, pieces);
          cut_slice(rng, bottom, depth - 1, align, pieces);
          return;
        }
      }
    } else if (const auto c = point(s.k.start, s.k.end)) {  // keys: a straight seam every row crosses
      const int32_t sq = s.q.size();
      const Slice left{s.q, {s.k.start, *c}, inv ? MaskType::InvCausal : MaskType::Full};
      const Slice right{s.q, {*c, s.k.end}, causal ? MaskType::Causal : MaskType::Full};
      if ((!inv || *c - s.k.start >= sq - 1) && (!causal || s.k.end - *c >= sq - 1) && area(left) > 0 &&
          area(right) > 0) {
        cut_slice(rng, left, depth - 1, align, pieces);
        cut_slice(rng, right, depth - 1, align, pieces);
        return;
      }
    }
  }
  pieces.push_back(s);
}

void row_bands(const Slice& s, int32_t step, std::vector<Slice>& pieces) {
  const bool inv = s.type == MaskType::InvCausal || s.type == MaskType::BiCausal;
  const bool causal = s.type == MaskType::Causal || s.type == MaskType::BiCausal;
  for (int32_t r0 = s.q.start, r1 = 0; r0 < s.q.end; r0 = r1) {
    r1 = std::min(s.q.end, (r0 / step + 1) * step);
    pieces.push_back({{r0, r1},
                      {inv ? s.k.start + (r0 - s.q.start) : s.k.start, causal ? s.k.end - (s.q.end - r1) : s.k.end},
                      s.type});
  }
}

Mask random_cut_rectangles(std::mt19937_64& rng, int32_t total_q, int32_t total_k, int32_t slices, int depth,
                           int32_t align) {
  const Mask whole = random_rectangles(rng, total_q, total_k, slices);
  Mask mask{{}, total_q, total_k};
  for (const Slice& s : whole.slices) cut_slice(rng, s, depth, align, mask.slices);
  return mask;
}

namespace {

// Prefix sums of random document lengths (1 .. 700) covering `total` tokens.
std::vector<int32_t> random_documents(std::mt19937_64& rng, int32_t total) {
  std::vector<int32_t> cu{0};
  while (cu.back() < total)
    cu.push_back(cu.back() + std::uniform_int_distribution<int32_t>(1, std::min(total - cu.back(), 700))(rng));
  return cu;
}

}  // namespace

RandomMask random_mask(std::mt19937_64& rng, int32_t tq, int32_t tk) {
  auto uniform = [&](int32_t lo, int32_t hi) { return std::uniform_int_distribution<int32_t>(lo, hi)(rng); };
  switch (uniform(0, 6)) {
    case 0: return {"rectangles", random_rectangles(rng, tq, tk, uniform(1, 80))};
    case 1: {
      const int32_t aligns[] = {1, 16, 64, 128};
      return {"cut", random_cut_rectangles(rng, tq, tk, uniform(1, 12), uniform(1, 3), aligns[uniform(0, 3)])};
    }
    case 2:
      return {"documents", uniform(0, 1) ? masks::varlen_causal(random_documents(rng, tq))
                                         : masks::varlen_full(random_documents(rng, tq))};
    case 3: return {"window", masks::sliding_window(tq, uniform(-1, tq), uniform(-1, 64))};
    case 4:
      return {"block_causal", uniform(0, 1) ? masks::block_causal(tq, uniform(1, 300))
                                            : masks::varlen_block_causal(random_documents(rng, tq), uniform(1, 300))};
    case 5: {
      std::vector<int32_t> answers;
      for (int a = uniform(0, 5); a > 0; --a) answers.push_back(uniform(0, tq / 8));
      return {"shared_question", masks::shared_question(uniform(0, tq / 2), answers)};
    }
    default: {  // CAUSAL / BI_CAUSAL with Sq > Sk leave empty rows
      const int32_t qs = uniform(0, tq - 1), ks = uniform(0, tk - 1);
      return {"one_slice",
              Mask{{make_slice(qs, uniform(qs, tq), ks, uniform(ks, tk), static_cast<MaskType>(uniform(0, 3)))}, tq, tk}};
    }
  }
}

namespace cases {
namespace {

Mask with_totals(std::vector<Slice> slices, int32_t total_q, int32_t total_k) {
  Mask m;
  m.slices = std::move(slices);
  m.total_q = total_q;
  m.total_k = total_k;
  return m;
}

// Block-causal inside [start, start + length): each q block sees keys from `start` to the block's end.
void append_block_causal(std::vector<Slice>& out, int32_t start, int32_t length, int32_t block) {
  for (int32_t b = start; b < start + length; b += block) {
    const int32_t end = std::min(b + block, start + length);
    out.push_back(make_slice(b, end, start, end, MaskType::Full));
  }
}

}  // namespace

Mask full(int32_t total) { return with_totals({make_slice(0, total, 0, total, MaskType::Full)}, total, total); }

Mask varlen_full_uneven_docs() {
  const std::vector<int32_t> cu = cu_seqlens_of({7, 120, 33, 1, 90, 64, 150, 5, 80, 70});
  std::vector<Slice> s;
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) s.push_back(make_slice(cu[d], cu[d + 1], cu[d], cu[d + 1], MaskType::Full));
  return with_totals(s, cu.back(), cu.back());
}

Mask block_causal(int32_t total, int32_t block) {
  std::vector<Slice> s;
  for (int32_t b = 0; b < total; b += block) s.push_back(make_slice(b, std::min(b + block, total), 0, std::min(b + block, total), MaskType::Full));
  return with_totals(s, total, total);
}

Mask varlen_block_causal() {
  const std::vector<int32_t> cu = cu_seqlens_of({200, 77, 150, 93});
  std::vector<Slice> s;
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) append_block_causal(s, cu[d], cu[d + 1] - cu[d], 64);
  return with_totals(s, cu.back(), cu.back());
}

Mask sparse_repeated_q() {
  using T = MaskType;
  return with_totals({make_slice(0, 64, 0, 32, T::Full), make_slice(0, 64, 32, 64, T::Causal),
                      make_slice(0, 64, 64, 96, T::InvCausal), make_slice(64, 128, 0, 64, T::Full),
                      make_slice(64, 128, 64, 128, T::BiCausal), make_slice(128, 192, 0, 40, T::Full),
                      make_slice(128, 192, 40, 100, T::Causal), make_slice(128, 192, 100, 160, T::Full),
                      make_slice(128, 192, 160, 192, T::InvCausal), make_slice(192, 256, 0, 64, T::InvCausal),
                      make_slice(192, 256, 64, 128, T::Full), make_slice(192, 256, 128, 200, T::Causal),
                      make_slice(192, 256, 200, 256, T::BiCausal), make_slice(32, 96, 200, 256, T::Full)},
                     256, 256);
}

Mask disjoint_uncovered() {
  using T = MaskType;
  return with_totals({make_slice(10, 50, 0, 40, T::Full), make_slice(80, 120, 100, 180, T::Causal),
                      make_slice(150, 160, 200, 260, T::InvCausal), make_slice(200, 290, 20, 60, T::Causal),
                      make_slice(295, 295, 0, 10, T::Full)},
                     300, 260);
}

Mask shared_k_range() {
  std::vector<Slice> s;
  for (int32_t i = 0; i < 16; ++i) s.push_back(make_slice(20 * i, 20 * i + 20, 50, 150, static_cast<MaskType>(i % 4)));
  return with_totals(s, 320, 200);
}

Mask grid_alternating(int32_t cells, int32_t cell_size) {
  std::vector<Slice> s;
  for (int32_t i = 0; i < cells; ++i)
    for (int32_t j = 0; j < cells; ++j)
      s.push_back(make_slice(i * cell_size, (i + 1) * cell_size, j * cell_size, (j + 1) * cell_size,
                             (i + j) % 2 == 0 ? MaskType::Full : MaskType::Causal));
  return with_totals(s, cells * cell_size, cells * cell_size);
}

Mask causal_sq_gt_sk(MaskType type) {
  return with_totals({make_slice(0, 200, 0, 128, type), make_slice(200, 300, 0, 100, MaskType::Full),
                      make_slice(0, 150, 128, 200, type)},
                     300, 200);
}

Mask mixed_types_q_overlap() {
  using T = MaskType;
  return with_totals({make_slice(0, 128, 0, 96, T::Full), make_slice(0, 128, 96, 224, T::Causal),
                      make_slice(0, 128, 224, 384, T::InvCausal), make_slice(128, 256, 0, 256, T::BiCausal),
                      make_slice(128, 256, 256, 384, T::Causal)},
                     256, 384);
}

std::vector<Named> all() {
  return {{"full_512", full(512)},
          {"varlen_full_10_uneven_docs", varlen_full_uneven_docs()},
          {"block_causal_512_b128", block_causal(512, 128)},
          {"block_causal_384_b64", block_causal(384, 64)},
          {"varlen_block_causal", varlen_block_causal()},
          {"sparse_14_repeated_q", sparse_repeated_q()},
          {"disjoint_uncovered_rows", disjoint_uncovered()},
          {"shared_k_range", shared_k_range()},
          {"grid_20x20_full_causal", grid_alternating(20, 16)},
          {"causal_sq_gt_sk", causal_sq_gt_sk(MaskType::Causal)},
          {"bi_causal_sq_gt_sk", causal_sq_gt_sk(MaskType::BiCausal)},
          {"mixed_types_q_overlap", mixed_types_q_overlap()}};
}

}  // namespace cases
}  // namespace magi::test
