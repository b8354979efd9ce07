// Builders: each mask is valid and keeps exactly the documented cells, checked cell by cell against
// brute-force definitions written from the header's documentation.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <random>
#include <string>

#include "magi/error.hpp"
#include "magi/mask.hpp"
#include "mask/mask_oracle.hpp"
#include "reference/random_inputs.hpp"

namespace magi {
namespace {

using Keeps = std::function<bool(int32_t q, int32_t k)>;

template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

// validate() passes, totals are as expected, every cell is kept by exactly one slice when `keeps` says so
// and by none otherwise, and the closed-form area equals the number of intended cells.
void expect_mask_keeps_exactly(const Mask& mask, int32_t total_q, int32_t total_k, const Keeps& keeps,
                               const std::string& context) {
  ASSERT_EQ(mask.total_q, total_q) << context;
  ASSERT_EQ(mask.total_k, total_k) << context;
  ASSERT_NO_THROW(validate(mask)) << context << "\n" << mask_to_json(mask);
  const std::vector<int32_t> counts = test::cell_counts(mask);
  int64_t intended = 0;
  for (int32_t q = 0; q < total_q; ++q) {
    for (int32_t k = 0; k < total_k; ++k) {
      const bool want = keeps(q, k);
      intended += want;
      ASSERT_EQ(counts[static_cast<size_t>(q) * static_cast<size_t>(total_k) + static_cast<size_t>(k)], want ? 1 : 0)
          << context << " cell (" << q << ", " << k << ")\n" << mask_to_json(mask);
    }
  }
  EXPECT_EQ(mask.area(), intended) << context;
}

std::vector<int32_t> random_cu_seqlens(std::mt19937_64& rng, int max_docs, int32_t max_len) {
  const int docs = std::uniform_int_distribution<int>(0, max_docs)(rng);
  std::vector<int32_t> cu = {0};
  for (int d = 0; d < docs; ++d) {
    // About one document in five is empty.
    const int32_t len = std::uniform_int_distribution<int32_t>(0, 4)(rng) == 0
                            ? 0
                            : std::uniform_int_distribution<int32_t>(1, max_len)(rng);
    cu.push_back(cu.back() + len);
  }
  return cu;
}

// Index of the document holding token t (documents may be empty), or -1.
int document_of(const std::vector<int32_t>& cu, int32_t t) {
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    if (t >= cu[d] && t < cu[d + 1]) return static_cast<int>(d);
  }
  return -1;
}

std::string describe(const std::vector<int32_t>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) text += (i ? "," : "") + std::to_string(values[i]);
  return text + "]";
}

class Builders : public ::testing::Test {
 protected:
  uint64_t seed_ = test::fresh_seed();
  std::mt19937_64 rng_{seed_};
  std::string note() const { return "seed " + std::to_string(seed_); }
  int32_t uniform(int32_t lo, int32_t hi) { return std::uniform_int_distribution<int32_t>(lo, hi)(rng_); }
};

TEST_F(Builders, FullAndCausal) {
  for (int trial = 0; trial < 200; ++trial) {
    const int32_t tq = uniform(0, 30), tk = uniform(0, 30);
    const std::string context = note() + " tq " + std::to_string(tq) + " tk " + std::to_string(tk);
    expect_mask_keeps_exactly(masks::full(tq, tk), tq, tk, [](int32_t, int32_t) { return true; }, context);
    expect_mask_keeps_exactly(masks::causal(tq, tk), tq, tk,
                              [&](int32_t q, int32_t k) { return k <= q + (tk - tq); }, context);
    if (HasFatalFailure()) return;
  }
}

TEST_F(Builders, VarlenFullAndCausalWithSeparateQAndK) {
  for (int trial = 0; trial < 200; ++trial) {
    const std::vector<int32_t> cu_q = random_cu_seqlens(rng_, 6, 9);
    std::vector<int32_t> cu_k = {0};
    for (size_t d = 1; d < cu_q.size(); ++d) cu_k.push_back(cu_k.back() + uniform(0, 9));
    const std::string context = note() + " cu_q " + describe(cu_q) + " cu_k " + describe(cu_k);
    const auto same_doc = [&](int32_t q, int32_t k) {
      const int d = document_of(cu_q, q);
      return d >= 0 && k >= cu_k[d] && k < cu_k[d + 1];
    };
    const Mask full = masks::varlen_full(cu_q, cu_k);
    expect_mask_keeps_exactly(full, cu_q.back(), cu_k.back(), same_doc, context);
    const Mask causal = masks::varlen_causal(cu_q, cu_k);
    expect_mask_keeps_exactly(causal, cu_q.back(), cu_k.back(), [&](int32_t q, int32_t k) {
      if (!same_doc(q, k)) return false;
      const int d = document_of(cu_q, q);
      const int32_t sq = cu_q[d + 1] - cu_q[d], sk = cu_k[d + 1] - cu_k[d];
      return k - cu_k[d] <= q - cu_q[d] + (sk - sq);  // bottom-right aligned inside the document
    }, context);
    if (HasFatalFailure()) return;
    // Slice d is document d.
    ASSERT_EQ(full.slices.size(), cu_q.size() - 1) << context;
    for (size_t d = 0; d + 1 < cu_q.size(); ++d) {
      EXPECT_EQ(full.slices[d], (Slice{{cu_q[d], cu_q[d + 1]}, {cu_k[d], cu_k[d + 1]}, MaskType::Full})) << context;
      EXPECT_EQ(causal.slices[d].type, MaskType::Causal) << context;
    }
  }
}

TEST_F(Builders, VarlenSelfAttention) {
  for (int trial = 0; trial < 200; ++trial) {
    const std::vector<int32_t> cu = random_cu_seqlens(rng_, 6, 12);
    const std::string context = note() + " cu " + describe(cu);
    const auto same_doc = [&](int32_t q, int32_t k) { return document_of(cu, q) == document_of(cu, k); };
    expect_mask_keeps_exactly(masks::varlen_full(cu), cu.back(), cu.back(), same_doc, context);
    expect_mask_keeps_exactly(masks::varlen_causal(cu), cu.back(), cu.back(),
                              [&](int32_t q, int32_t k) { return same_doc(q, k) && k <= q; }, context);
    EXPECT_EQ(masks::varlen_causal(cu).slices, masks::varlen_causal(cu, cu).slices) << context;
    if (HasFatalFailure()) return;
  }
}

bool in_window(int32_t q, int32_t k, int32_t left, int32_t right) {
  return (left < 0 || int64_t{k} >= int64_t{q} - left) && (right < 0 || int64_t{k} <= int64_t{q} + right);
}

TEST_F(Builders, SlidingWindowDecomposesIntoAtMostThreeBands) {
  const int32_t huge = std::numeric_limits<int32_t>::max();
  for (int trial = 0; trial < 1500; ++trial) {
    const int32_t total = uniform(0, 40);
    const int32_t choices[] = {-1, 0, 1, uniform(0, 45), uniform(0, 45), huge};
    const int32_t left = choices[uniform(0, 5)], right = choices[uniform(0, 5)];
    const std::string context = note() + " total " + std::to_string(total) + " left " + std::to_string(left) +
                                " right " + std::to_string(right);
    const Mask mask = masks::sliding_window(total, left, right);
    expect_mask_keeps_exactly(mask, total, total,
                              [&](int32_t q, int32_t k) { return in_window(q, k, left, right); }, context);
    if (HasFatalFailure()) return;
    EXPECT_LE(mask.slices.size(), 3u) << context;
    for (const Slice& s : mask.slices) EXPECT_GT(area(s), 0) << context;
  }
}

TEST_F(Builders, SlidingWindowUsesEveryTypeWhereTheEdgesDemand) {
  // Window [q - 2, q + 3] over 10 tokens: top rows clip the left edge, bottom rows the right edge.
  const Mask mask = masks::sliding_window(10, 2, 3);
  ASSERT_EQ(mask.slices.size(), 3u);
  EXPECT_EQ(mask.slices[0], (Slice{{0, 3}, {0, 6}, MaskType::Causal}));
  EXPECT_EQ(mask.slices[1], (Slice{{3, 7}, {1, 10}, MaskType::BiCausal}));
  EXPECT_EQ(mask.slices[2], (Slice{{7, 10}, {5, 10}, MaskType::InvCausal}));
  // A window wider than the sequence on both sides is one FULL slice.
  EXPECT_EQ(masks::sliding_window(6, 8, -1).slices, (std::vector<Slice>{{{0, 6}, {0, 6}, MaskType::Full}}));
  // Left window 0, unbounded right: exactly inverse-causal.
  const Mask inv = masks::sliding_window(6, 0, -1);
  EXPECT_EQ(inv.area(), 21);
  EXPECT_EQ(masks::sliding_window(0, 3, 3).slices.size(), 0u);
}

TEST_F(Builders, SlidingWindowAreaAtScale) {
  // 2^20 tokens, window [q - 4095, q]: rows q < 4095 keep q + 1 keys, later rows 4096.
  const int64_t total = 1 << 20, left = 4095;
  const Mask mask = masks::sliding_window(static_cast<int32_t>(total), static_cast<int32_t>(left), 0);
  EXPECT_NO_THROW(validate(mask));
  EXPECT_EQ(mask.area(), left * (left + 1) / 2 + (total - left) * (left + 1));
}

TEST_F(Builders, VarlenSlidingWindowStaysInsideDocuments) {
  for (int trial = 0; trial < 300; ++trial) {
    const std::vector<int32_t> cu = random_cu_seqlens(rng_, 5, 14);
    const int32_t left = uniform(-1, 8), right = uniform(-1, 8);
    const std::string context = note() + " cu " + describe(cu) + " left " + std::to_string(left) + " right " +
                                std::to_string(right);
    expect_mask_keeps_exactly(masks::varlen_sliding_window(cu, left, right), cu.back(), cu.back(),
                              [&](int32_t q, int32_t k) {
                                return document_of(cu, q) == document_of(cu, k) && in_window(q, k, left, right);
                              },
                              context);
    if (HasFatalFailure()) return;
  }
}

TEST_F(Builders, BlockCausal) {
  for (int trial = 0; trial < 300; ++trial) {
    const int32_t total = uniform(0, 50), block = uniform(1, 12);
    const std::string context = note() + " total " + std::to_string(total) + " block " + std::to_string(block);
    const Mask mask = masks::block_causal(total, block);
    expect_mask_keeps_exactly(mask, total, total, [&](int32_t q, int32_t k) {
      return k < std::min((q / block + 1) * block, total);
    }, context);
    if (HasFatalFailure()) return;
    EXPECT_EQ(mask.slices.size(), static_cast<size_t>((total + block - 1) / block)) << context;
  }
}

TEST_F(Builders, VarlenBlockCausalRestartsBlocksAtEachDocument) {
  for (int trial = 0; trial < 300; ++trial) {
    const std::vector<int32_t> cu = random_cu_seqlens(rng_, 5, 20);
    const int32_t block = uniform(1, 7);
    const std::string context = note() + " cu " + describe(cu) + " block " + std::to_string(block);
    expect_mask_keeps_exactly(masks::varlen_block_causal(cu, block), cu.back(), cu.back(),
                              [&](int32_t q, int32_t k) {
                                const int d = document_of(cu, q);
                                if (d < 0 || document_of(cu, k) != d) return false;
                                const int32_t local_q = q - cu[d], length = cu[d + 1] - cu[d];
                                return k - cu[d] < std::min((local_q / block + 1) * block, length);
                              },
                              context);
    if (HasFatalFailure()) return;
  }
}

TEST_F(Builders, SharedQuestion) {
  for (int trial = 0; trial < 300; ++trial) {
    const int32_t question = uniform(0, 10);
    std::vector<int32_t> answers(static_cast<size_t>(uniform(0, 5)));
    for (int32_t& a : answers) a = uniform(0, 8);
    std::vector<int32_t> cu = {question};  // answer a spans [cu[a], cu[a + 1])
    for (int32_t a : answers) cu.push_back(cu.back() + a);
    const std::string context = note() + " question " + std::to_string(question) + " answers " + describe(answers);
    const Mask mask = masks::shared_question(question, answers);
    expect_mask_keeps_exactly(mask, cu.back(), cu.back(), [&](int32_t q, int32_t k) {
      if (q < question) return k <= q;
      if (k < question) return true;
      return document_of(cu, q) == document_of(cu, k) && k <= q;
    }, context);
    if (HasFatalFailure()) return;
    EXPECT_EQ(mask.slices.size(), 1 + 2 * answers.size()) << context;
  }
}

TEST_F(Builders, GlobalSlidingWindow) {
  for (int trial = 0; trial < 500; ++trial) {
    const int32_t total = uniform(0, 40), global = uniform(0, total), window = uniform(0, 45);
    const std::string context = note() + " total " + std::to_string(total) + " global " + std::to_string(global) +
                                " window " + std::to_string(window);
    expect_mask_keeps_exactly(masks::global_sliding_window(total, global, window), total, total,
                              [&](int32_t q, int32_t k) {
                                if (q < global) return k <= q;
                                return k < global || (k >= std::max(global, q - window) && k <= q);
                              },
                              context);
    if (HasFatalFailure()) return;
  }
}

// ---- argument errors ----

void expect_error(const std::function<void()>& fn, const std::string& expected) {
  const std::string message = error_of(fn);
  EXPECT_NE(message.find(expected), std::string::npos) << "message: \"" << message << "\"\nexpected: " << expected;
}

TEST(BuilderArguments, NegativeSizes) {
  expect_error([] { masks::full(-1, 3); }, "masks::full: total_q = -1 must be >= 0");
  expect_error([] { masks::causal(3, -2); }, "masks::causal: total_k = -2 must be >= 0");
  expect_error([] { masks::sliding_window(-5, 1, 1); }, "masks::sliding_window: total = -5 must be >= 0");
  expect_error([] { masks::block_causal(-1, 4); }, "masks::block_causal: total = -1 must be >= 0");
  expect_error([] { masks::shared_question(-1, {}); }, "masks::shared_question: question = -1 must be >= 0");
  expect_error([] { masks::shared_question(4, {2, -3}); }, "masks::shared_question: answers[1] = -3 must be >= 0");
  expect_error([] { masks::global_sliding_window(-1, 0, 0); }, "total = -1 must be >= 0");
  expect_error([] { masks::global_sliding_window(10, 2, -1); }, "window = -1 must be >= 0");
}

TEST(BuilderArguments, CuSeqlens) {
  expect_error([] { masks::varlen_full(std::vector<int32_t>{}); },
               "masks::varlen_full: cu_seqlens is empty; it needs one entry more than documents, starting with 0");
  expect_error([] { masks::varlen_causal(std::vector<int32_t>{2, 5}); }, "masks::varlen_causal: cu_seqlens[0] = 2 must be 0");
  expect_error([] { masks::varlen_block_causal({0, 5, 3}, 2); },
               "masks::varlen_block_causal: cu_seqlens must be non-decreasing, but cu_seqlens[2] = 3 < cu_seqlens[1] = 5");
  expect_error([] { masks::varlen_sliding_window({1}, 2, 2); }, "masks::varlen_sliding_window: cu_seqlens[0] = 1 must be 0");
  expect_error([] { masks::varlen_full({0, 4, 8}, {0, 4}); },
               "masks::varlen_full: cu_seqlens_q and cu_seqlens_k must have the same number of entries (documents + 1), "
               "got 3 and 2");
  expect_error([] { masks::varlen_causal({0, 4}, {0, 6, 5}); },
               "masks::varlen_causal: cu_seqlens_k must be non-decreasing, but cu_seqlens_k[2] = 5 < cu_seqlens_k[1] = 6");
  expect_error([] { masks::varlen_full({1, 4}, {0, 4}); }, "cu_seqlens_q[0] = 1 must be 0");
  // A single entry {0} is zero documents: legal and empty.
  EXPECT_EQ(masks::varlen_full(std::vector<int32_t>{0}).slices.size(), 0u);
}

TEST(BuilderArguments, BlocksAndLimits) {
  expect_error([] { masks::block_causal(10, 0); }, "masks::block_causal: block = 0 must be > 0");
  expect_error([] { masks::varlen_block_causal({0, 4}, -2); }, "masks::varlen_block_causal: block = -2 must be > 0");
  expect_error([] { masks::global_sliding_window(10, 11, 2); },
               "masks::global_sliding_window: global = 11 must be in [0, total = 10]");
  expect_error([] { masks::global_sliding_window(10, -1, 2); }, "global = -1 must be in [0, total = 10]");
  const int32_t big = std::numeric_limits<int32_t>::max() / 2 + 1;
  expect_error([&] { masks::shared_question(big, {big}); }, "exceeds the int32 token limit");
}

TEST(BuilderLimits, BlockCausalNearTheInt32Limit) {
  // The last block ends at the int32 limit without overflowing the loop.
  const int32_t total = std::numeric_limits<int32_t>::max();
  const Mask mask = masks::block_causal(total, total / 2 + 1);
  ASSERT_EQ(mask.slices.size(), 2u);
  EXPECT_EQ(mask.slices[1], (Slice{{total / 2 + 1, total}, {0, total}, MaskType::Full}));
  EXPECT_NO_THROW(validate(mask));
}

}  // namespace
}  // namespace magi
