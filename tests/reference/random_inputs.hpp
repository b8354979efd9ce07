// Test inputs: fresh seeds, random tensors rounded to a dtype, host buffers in any dtype, NaN poison,
// random non-overlapping masks and the SPEC section 7 cases scaled to CPU size.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "magi/mask.hpp"
#include "magi/tensor.hpp"

namespace magi::test {

// A seed from std::random_device; tests print it in every failure message.
uint64_t fresh_seed();

// n values ~ N(0, stddev^2), each rounded to `dtype`.
std::vector<double> random_normal(std::mt19937_64& rng, std::size_t n, DType dtype, double stddev = 1.0);
// Every value rounded to `dtype` (identity for F64).
std::vector<double> rounded(const std::vector<double>& values, DType dtype);

// An owning host buffer in any dtype (bf16/fp16 as uint16 bits) with a TensorView onto it.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape);  // zero-filled

  static HostTensor from_values(const std::vector<double>& values, DType dtype, std::vector<int64_t> shape);
  // Filled with NaN so that an element a backend forgets to write fails the comparison.
  static HostTensor poisoned(DType dtype, std::vector<int64_t> shape);

  std::vector<double> values() const;  // converted to double
  TensorView view();                   // non-owning view; empty HostTensor gives an undefined view
  bool defined() const { return !shape_.empty(); }
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const;
  const std::vector<unsigned char>& bytes() const { return bytes_; }

 private:
  DType dtype_ = DType::F32;
  std::vector<int64_t> shape_;
  std::vector<unsigned char> bytes_;
};

// Random mask of about `slices` slices whose areas never overlap: the grid is split recursively into
// disjoint boxes, each box gets a random type, and some are shrunk or dropped (leaving rows uncovered).
Mask random_rectangles(std::mt19937_64& rng, int32_t total_q, int32_t total_k, int32_t slices);

// Cuts `slice` into pieces of non-zero area whose union is exactly its cells (merge_slices' rules in reverse: row
// bands along the diagonals, key cuts where every row crosses), up to `depth` levels, appended in cut order (left
// before right, top before bottom). With align > 1 the cuts fall on multiples of `align`, where there are any.
void cut_slice(std::mt19937_64& rng, const Slice& slice, int depth, int32_t align, std::vector<Slice>& pieces);
// Row bands of `slice` cut at the multiples of `step` along its edges (diagonals carry on): exactly its cells.
void row_bands(const Slice& slice, int32_t step, std::vector<Slice>& pieces);
// random_rectangles whose slices are cut as above (in cut order, slice by slice): a mask rich in exact merges.
Mask random_cut_rectangles(std::mt19937_64& rng, int32_t total_q, int32_t total_k, int32_t slices, int depth,
                           int32_t align);

// A random valid mask of one of several kinds, for fuzzing: random_rectangles, random_cut_rectangles (align 1,
// 16, 64 or 128), documents (varlen full / causal), a sliding window, (varlen) block-causal, shared question, or
// one slice of any type over random sub-ranges. The builders' kinds are self-attention over about total_q tokens
// (total_k unused).
struct RandomMask {
  std::string kind;
  Mask mask;
};
RandomMask random_mask(std::mt19937_64& rng, int32_t total_q, int32_t total_k);

// Helpers to write masks by hand.
Slice make_slice(int32_t qs, int32_t qe, int32_t ks, int32_t ke, MaskType type);
std::vector<int32_t> cu_seqlens_of(const std::vector<int32_t>& lengths);

// SPEC section 7 cases scaled to CPU size, built from slices by hand (independent of magi::masks).
namespace cases {

Mask full(int32_t total);                                  // "full 4k (with sink)"
Mask varlen_full_uneven_docs();                            // 10 uneven documents, 620 tokens
Mask block_causal(int32_t total, int32_t block);           // q blocks see the k prefix up to their end
Mask varlen_block_causal();                                // block-causal inside 4 uneven documents
Mask sparse_repeated_q();                                  // 14 slices, repeated q ranges, mixed types
Mask disjoint_uncovered();                                 // disjoint ranges; some q rows uncovered
Mask shared_k_range();                                     // many slices reading one k range
Mask grid_alternating(int32_t cells, int32_t cell_size);   // cells x cells grid, FULL/CAUSAL checkerboard
Mask causal_sq_gt_sk(MaskType type);                       // CAUSAL or BI_CAUSAL with Sq > Sk: empty rows
Mask mixed_types_q_overlap();                              // all four types sharing q rows

struct Named {
  std::string name;
  Mask mask;
};
// Every case above at its default size.
std::vector<Named> all();

}  // namespace cases

}  // namespace magi::test
