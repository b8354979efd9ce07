// Mask builders (SPEC section 2). The exact kept set of each builder is documented in magi/mask.hpp.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "magi/error.hpp"
#include "magi/mask.hpp"

namespace magi::masks {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

void require_non_negative(const char* builder, const char* name, int64_t value) {
  if (value < 0) {
    throw InvalidArgument(std::string("masks::") + builder + ": " + name + " = " + std::to_string(value) +
                          " must be >= 0");
  }
}

void check_cu_seqlens(const char* builder, const char* name, const std::vector<int32_t>& cu) {
  const std::string where = std::string("masks::") + builder + ": " + name;
  if (cu.empty()) {
    throw InvalidArgument(where + " is empty; it needs one entry more than documents, starting with 0");
  }
  if (cu.front() != 0) {
    throw InvalidArgument(where + "[0] = " + std::to_string(cu.front()) + " must be 0");
  }
  for (size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1]) {
      throw InvalidArgument(where + " must be non-decreasing, but " + name + "[" + std::to_string(i) +
                            "] = " + std::to_string(cu[i]) + " < " + name + "[" + std::to_string(i - 1) +
                            "] = " + std::to_string(cu[i - 1]));
    }
  }
}

void check_same_documents(const char* builder, const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k) {
  check_cu_seqlens(builder, "cu_seqlens_q", cu_q);
  check_cu_seqlens(builder, "cu_seqlens_k", cu_k);
  if (cu_q.size() != cu_k.size()) {
    throw InvalidArgument(std::string("masks::") + builder +
                          ": cu_seqlens_q and cu_seqlens_k must have the same number of entries (documents + 1), "
                          "got " + std::to_string(cu_q.size()) + " and " + std::to_string(cu_k.size()));
  }
}

// Window edges beyond the document never bind, so an unbounded (< 0) or larger edge becomes `length`.
int64_t clip_window_edge(int32_t edge, int32_t length) {
  return edge < 0 ? length : std::min<int64_t>(edge, length);
}

// Appends self-attention rows/keys [offset, offset + length) keeping q - left <= k <= q + right.
// Rows split where the left edge stops being clipped at the sequence start (q = left + 1) and where the
// right edge starts being clipped at the end (q = length - right); each band is one slice type.
void append_sliding_window(std::vector<Slice>& slices, int32_t offset, int32_t length, int64_t left, int64_t right) {
  std::vector<int64_t> cuts = {0, std::clamp<int64_t>(left + 1, 0, length), std::clamp<int64_t>(length - right, 0, length),
                               length};
  std::sort(cuts.begin(), cuts.end());
  for (size_t band = 0; band + 1 < cuts.size(); ++band) {
    const int64_t q0 = cuts[band], q1 = cuts[band + 1];  // local rows [q0, q1)
    if (q0 == q1) continue;
    const bool left_edge = q0 >= left + 1;      // k >= q - left binds (else k >= 0)
    const bool right_edge = q1 <= length - right;  // k <= q + right binds (else k < length)
    // CAUSAL keeps k <= q + (ke - qe): ke = q1 + right. INV_CAUSAL keeps k >= q + (ks - qs): ks = q0 - left.
    const int64_t k0 = left_edge ? q0 - left : 0;
    const int64_t k1 = right_edge ? q1 + right : length;
    const MaskType type = left_edge ? (right_edge ? MaskType::BiCausal : MaskType::InvCausal)
                                    : (right_edge ? MaskType::Causal : MaskType::Full);
    slices.push_back({{static_cast<int32_t>(offset + q0), static_cast<int32_t>(offset + q1)},
                      {static_cast<int32_t>(offset + k0), static_cast<int32_t>(offset + k1)},
                      type});
  }
}

void append_block_causal(std::vector<Slice>& slices, int32_t offset, int32_t length, int32_t block) {
  for (int64_t start = 0; start < length; start += block) {
    const auto end = static_cast<int32_t>(std::min<int64_t>(start + block, length));
    slices.push_back({{static_cast<int32_t>(offset + start), offset + end}, {offset, offset + end}, MaskType::Full});
  }
}

void require_positive_block(const char* builder, int32_t block) {
  if (block <= 0) {
    throw InvalidArgument(std::string("masks::") + builder + ": block = " + std::to_string(block) + " must be > 0");
  }
}

Mask per_document(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k, MaskType type) {
  Mask mask;
  mask.total_q = cu_q.back();
  mask.total_k = cu_k.back();
  mask.slices.reserve(cu_q.size() - 1);
  for (size_t d = 0; d + 1 < cu_q.size(); ++d) {
    mask.slices.push_back({{cu_q[d], cu_q[d + 1]}, {cu_k[d], cu_k[d + 1]}, type});
  }
  return mask;
}

}  // namespace

Mask full(int32_t total_q, int32_t total_k) {
  require_non_negative("full", "total_q", total_q);
  require_non_negative("full", "total_k", total_k);
  return {{{{0, total_q}, {0, total_k}, MaskType::Full}}, total_q, total_k};
}

Mask causal(int32_t total_q, int32_t total_k) {
  require_non_negative("causal", "total_q", total_q);
  require_non_negative("causal", "total_k", total_k);
  return {{{{0, total_q}, {0, total_k}, MaskType::Causal}}, total_q, total_k};
}

Mask varlen_full(const std::vector<int32_t>& cu_seqlens_q, const std::vector<int32_t>& cu_seqlens_k) {
  check_same_documents("varlen_full", cu_seqlens_q, cu_seqlens_k);
  return per_document(cu_seqlens_q, cu_seqlens_k, MaskType::Full);
}

Mask varlen_causal(const std::vector<int32_t>& cu_seqlens_q, const std::vector<int32_t>& cu_seqlens_k) {
  check_same_documents("varlen_causal", cu_seqlens_q, cu_seqlens_k);
  return per_document(cu_seqlens_q, cu_seqlens_k, MaskType::Causal);
}

Mask varlen_full(const std::vector<int32_t>& cu_seqlens) {
  check_cu_seqlens("varlen_full", "cu_seqlens", cu_seqlens);
  return per_document(cu_seqlens, cu_seqlens, MaskType::Full);
}

Mask varlen_causal(const std::vector<int32_t>& cu_seqlens) {
  check_cu_seqlens("varlen_causal", "cu_seqlens", cu_seqlens);
  return per_document(cu_seqlens, cu_seqlens, MaskType::Causal);
}

Mask sliding_window(int32_t total, int32_t left, int32_t right) {
  require_non_negative("sliding_window", "total", total);
  Mask mask{{}, total, total};
  append_sliding_window(mask.slices, 0, total, clip_window_edge(left, total), clip_window_edge(right, total));
  return mask;
}

Mask varlen_sliding_window(const std::vector<int32_t>& cu_seqlens, int32_t left, int32_t right) {
  check_cu_seqlens("varlen_sliding_window", "cu_seqlens", cu_seqlens);
  Mask mask{{}, cu_seqlens.back(), cu_seqlens.back()};
  for (size_t d = 0; d + 1 < cu_seqlens.size(); ++d) {
    const int32_t length = cu_seqlens[d + 1] - cu_seqlens[d];
    append_sliding_window(mask.slices, cu_seqlens[d], length, clip_window_edge(left, length),
                          clip_window_edge(right, length));
  }
  return mask;
}

Mask block_causal(int32_t total, int32_t block) {
  require_non_negative("block_causal", "total", total);
  require_positive_block("block_causal", block);
  Mask mask{{}, total, total};
  append_block_causal(mask.slices, 0, total, block);
  return mask;
}

Mask varlen_block_causal(const std::vector<int32_t>& cu_seqlens, int32_t block) {
  check_cu_seqlens("varlen_block_causal", "cu_seqlens", cu_seqlens);
  require_positive_block("varlen_block_causal", block);
  Mask mask{{}, cu_seqlens.back(), cu_seqlens.back()};
  for (size_t d = 0; d + 1 < cu_seqlens.size(); ++d) {
    append_block_causal(mask.slices, cu_seqlens[d], cu_seqlens[d + 1] - cu_seqlens[d], block);
  }
  return mask;
}

Mask shared_question(int32_t question, const std::vector<int32_t>& answers) {
  require_non_negative("shared_question", "question", question);
  int64_t total = question;
  for (size_t a = 0; a < answers.size(); ++a) {
    if (answers[a] < 0) {
      throw InvalidArgument("masks::shared_question: answers[" + std::to_string(a) + "] = " +
                            std::to_string(answers[a]) + " must be >= 0");
    }
    total += answers[a];
  }
  if (total > kInt32Max) {
    throw InvalidArgument("masks::shared_question: question + sum(answers) = " + std::to_string(total) +
                          " exceeds the int32 token limit " + std::to_string(kInt32Max));
  }
  Mask mask{{}, static_cast<int32_t>(total), static_cast<int32_t>(total)};
  mask.slices.reserve(1 + 2 * answers.size());
  mask.slices.push_back({{0, question}, {0, question}, MaskType::Causal});
  int32_t start = question;
  for (int32_t length : answers) {
    const Range answer{start, start + length};
    mask.slices.push_back({answer, {0, question}, MaskType::Full});
    mask.slices.push_back({answer, answer, MaskType::Causal});
    start = answer.end;
  }
  return mask;
}

Mask global_sliding_window(int32_t total, int32_t global, int32_t window) {
  require_non_negative("global_sliding_window", "total", total);
  require_non_negative("global_sliding_window", "window", window);
  if (global < 0 || global > total) {
    throw InvalidArgument("masks::global_sliding_window: global = " + std::to_string(global) +
                          " must be in [0, total = " + std::to_string(total) + "]");
  }
  Mask mask{{}, total, total};
  mask.slices.push_back({{0, global}, {0, global}, MaskType::Causal});
  mask.slices.push_back({{global, total}, {0, global}, MaskType::Full});
  const int32_t rest = total - global;
  append_sliding_window(mask.slices, global, rest, clip_window_edge(window, rest), 0);
  return mask;
}

}  // namespace magi::masks
