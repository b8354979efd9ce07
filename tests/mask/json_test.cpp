// The JSON form of a mask: round trips, accepted spellings, and one test per class of error.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "magi/error.hpp"
#include "magi/mask.hpp"
#include "mask/mask_oracle.hpp"
#include "reference/random_inputs.hpp"

namespace magi {
namespace {

std::string error_of(const std::string& text) {
  try {
    mask_from_json(text);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

void expect_error(const std::string& text, const std::string& expected) {
  const std::string message = error_of(text);
  EXPECT_NE(message.find(expected), std::string::npos) << "json: " << text << "\nmessage: \"" << message
                                                       << "\"\nexpected: " << expected;
  EXPECT_EQ(message.rfind("mask JSON: ", 0), 0u) << message;
}

TEST(MaskJson, WritesCompactJsonWithIdsAndTotals) {
  const Mask mask{{{{0, 4}, {0, 4}, MaskType::Causal}, {{4, 6}, {2, 8}, MaskType::BiCausal}}, 6, 9};
  EXPECT_EQ(mask_to_json(mask),
            R"({"q_ranges":[[0,4],[4,6]],"k_ranges":[[0,4],[2,8]],"attn_type_map":[1,3],"total_q":6,"total_k":9})");
  EXPECT_EQ(mask_to_json(Mask{}), R"({"q_ranges":[],"k_ranges":[],"attn_type_map":[],"total_q":0,"total_k":0})");
}

TEST(MaskJson, RoundTripsRandomAndBuiltMasks) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  std::vector<Mask> masks_to_check = {masks::sliding_window(100, 7, 3), masks::shared_question(10, {3, 0, 5}),
                                      masks::varlen_block_causal({0, 10, 10, 37}, 4), Mask{{}, 5, 0}};
  for (int i = 0; i < 40; ++i) masks_to_check.push_back(test::random_rectangles(rng, 200, 300, 40));
  for (const Mask& mask : masks_to_check) {
    const Mask back = mask_from_json(mask_to_json(mask));
    EXPECT_EQ(back.slices, mask.slices) << "seed " << seed;
    EXPECT_EQ(back.total_q, mask.total_q) << "seed " << seed;
    EXPECT_EQ(back.total_k, mask.total_k) << "seed " << seed;
  }
}

TEST(MaskJson, AcceptsNamesIdsAndDefaultTotals) {
  const Mask mask = mask_from_json(R"({
    "q_ranges": [[0, 4], [4, 8], [8, 9], [9, 12]],
    "k_ranges": [[0, 4], [0, 3], [1, 10], [2, 6]],
    "attn_type_map": ["causal", 0, "INV_CAUSAL", "3"]
  })");
  ASSERT_EQ(mask.slices.size(), 4u);
  EXPECT_EQ(mask.slices[0], (Slice{{0, 4}, {0, 4}, MaskType::Causal}));
  EXPECT_EQ(mask.slices[1].type, MaskType::Full);
  EXPECT_EQ(mask.slices[2].type, MaskType::InvCausal);
  EXPECT_EQ(mask.slices[3].type, MaskType::BiCausal);
  EXPECT_EQ(mask.total_q, 12);  // largest q end
  EXPECT_EQ(mask.total_k, 10);  // largest k end, not the last one
  const Mask explicit_totals =
      mask_from_json(R"({"q_ranges":[[0,2]],"k_ranges":[[0,2]],"attn_type_map":[0],"total_q":7,"total_k":3})");
  EXPECT_EQ(explicit_totals.total_q, 7);
  EXPECT_EQ(explicit_totals.total_k, 3);
  const Mask empty = mask_from_json(R"({"q_ranges":[],"k_ranges":[],"attn_type_map":[]})");
  EXPECT_TRUE(empty.slices.empty());
  EXPECT_EQ(empty.total_q, 0);
}

TEST(MaskJsonErrors, MalformedJsonGivesThePosition) {
  expect_error(R"({"q_ranges": [[0, 4]], })", "malformed JSON at byte 24");
  expect_error("", "malformed JSON at byte 1");
  expect_error(R"({"q_ranges": [[0, 4]]} trailing)", "malformed JSON at byte 26: parse error at line 1, column 26");
}

TEST(MaskJsonErrors, TopLevelMustBeAnObjectWithKnownKeys) {
  expect_error("[1, 2]", "top level must be an object");
  expect_error(R"({"q_ranges":[],"k_ranges":[],"attn_type_map":[],"attn_type_mask":[]})",
               "unknown key \"attn_type_mask\"; allowed: \"q_ranges\", \"k_ranges\", \"attn_type_map\"");
  // A repeated key would keep its last value; a nested object's keys are its own.
  expect_error(R"({"q_ranges":[[0,1]],"k_ranges":[[0,1]],"attn_type_map":[0],"q_ranges":[[0,2]]})",
               "key \"q_ranges\" appears more than once");
  expect_error(R"({"q_ranges":[[0,1]],"k_ranges":[[0,1]],"attn_type_map":[0],"total_q":4,"total_q":4})",
               "key \"total_q\" appears more than once");
  // An unknown key is named even where its value nests deeper than a mask does; a key is shown escaped (one line)
  // and cut when long.
  expect_error(R"({"slices":[[[0,10],[0,10],"full"]]})", "unknown key \"slices\"; allowed:");
  expect_error(R"({"q_ranges":[[0,1]],"k_\nranges":[]})", "unknown key \"k_\\nranges\"");
  try {
    mask_from_json("{\"" + std::string(100000, 'x') + "\": 1}");
    ADD_FAILURE() << "a long unknown key was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_LT(std::string(e.what()).size(), 200u) << e.what();
    EXPECT_NE(std::string(e.what()).find("unknown key \"" + std::string(48, 'x') + "...\""), std::string::npos) << e.what();
  }
}

// Text no mask has: nested deeper than three (refused while read: 100000 nested arrays overflowed the stack once),
// a number beyond double's range, bytes after a NUL (the reader stops there).
TEST(MaskJsonErrors, DeepNumbersAndNul) {
  const std::string deep = "{\"q_ranges\":" + std::string(100000, '[') + std::string(100000, ']') +
                           ",\"k_ranges\":[],\"attn_type_map\":[]}";
  expect_error(deep, "nested deeper than a mask's");
  expect_error(R"({"q_ranges":[[[0,1]]],"k_ranges":[[0,1]],"attn_type_map":[0]})", "nested deeper");
  expect_error(R"({"k_ranges":[[0,1]],"q_ranges":[[[0,1]]]})", "(in \"q_ranges\")");
  expect_error(R"({"q_ranges":[[0,1e400]],"k_ranges":[[0,1]],"attn_type_map":[0]})", "malformed JSON: number overflow");
  const std::string nul = std::string(R"({"q_ranges":[[0,1]],"k_ranges":[[0,1]],"attn_type_map":[0]})") + '\0' + "x";
  expect_error(nul, "malformed JSON at byte 60: a NUL byte");
}

TEST(MaskJsonErrors, MissingKeys) {
  expect_error(R"({"k_ranges":[[0,1]],"attn_type_map":[0]})", "missing key \"q_ranges\"");
  expect_error(R"({"q_ranges":[[0,1]],"attn_type_map":[0]})", "missing key \"k_ranges\"");
  expect_error(R"({"q_ranges":[[0,1]],"k_ranges":[[0,1]]})", "missing key \"attn_type_map\"");
}

TEST(MaskJsonErrors, WrongTypes) {
  expect_error(R"({"q_ranges":{"a":1},"k_ranges":[],"attn_type_map":[]})", "\"q_ranges\" must be an array, got object");
  expect_error(R"({"q_ranges":[],"k_ranges":"0,1","attn_type_map":[]})", "\"k_ranges\" must be an array, got string");
  expect_error(R"({"q_ranges":[[0,1]],"k_ranges":[[0,1]],"attn_type_map":0})",
               "\"attn_type_map\" must be an array, got number");
  expect_error(R"({"q_ranges":[[0,1]],"k_ranges":[[0,1]],"attn_type_map":[0],"total_q":"8"})",
               "\"total_q\" must be an integer in [0, 2^31), got \"8\"");
  expect_error(R"({"q_ranges":[[0,1]],"k_ranges":[[0,1]],"attn_type_map":[0],"total_k":-1})",
               "\"total_k\" must be an integer in [0, 2^31), got -1");
}

TEST(MaskJsonErrors, BadPairsNameKeyAndIndex) {
  const std::string tail = R"(,"attn_type_map":[0,0]})";
  expect_error(R"({"q_ranges":[[0,1],[1,2,3]],"k_ranges":[[0,1],[1,2]])" + tail,
               "\"q_ranges\"[1] must be a pair [start, end] of int32 integers, got [1,2,3]");
  expect_error(R"({"q_ranges":[[0,1],[1,2]],"k_ranges":[[0,1.5],[1,2]])" + tail,
               "\"k_ranges\"[0] must be a pair [start, end] of int32 integers, got [0,1.5]");
  expect_error(R"({"q_ranges":[[0,1],[1,2]],"k_ranges":[[0,1],5])" + tail, "\"k_ranges\"[1] must be a pair");
  expect_error(R"({"q_ranges":[[0,1],["1",2]],"k_ranges":[[0,1],[1,2]])" + tail, "\"q_ranges\"[1] must be a pair");
  expect_error(R"({"q_ranges":[[0,1],[1,3000000000]],"k_ranges":[[0,1],[1,2]])" + tail,
               "\"q_ranges\"[1] must be a pair [start, end] of int32 integers, got [1,3000000000]");
  expect_error(R"({"q_ranges":[[0,1],[1,2]],"k_ranges":[[0,1],[true,2]])" + tail, "\"k_ranges\"[1] must be a pair");
}

TEST(MaskJsonErrors, LengthMismatch) {
  expect_error(R"({"q_ranges":[[0,1],[1,2]],"k_ranges":[[0,1]],"attn_type_map":[0,0]})",
               "\"k_ranges\" has 1 entries but \"q_ranges\" has 2");
  expect_error(R"({"q_ranges":[[0,1],[1,2]],"k_ranges":[[0,1],[1,2]],"attn_type_map":[0]})",
               "\"attn_type_map\" has 1 entries but \"q_ranges\" has 2");
}

TEST(MaskJsonErrors, UnknownTypes) {
  const std::string head = R"({"q_ranges":[[0,1],[1,2]],"k_ranges":[[0,1],[1,2]],"attn_type_map":)";
  expect_error(head + "[0,4]}", "\"attn_type_map\"[1] = 4 is not a mask type; allowed: 0..3 or \"full\"");
  expect_error(head + "[-1,0]}", "\"attn_type_map\"[0] = -1 is not a mask type");
  expect_error(head + "[0,1.0]}", "\"attn_type_map\"[1] = 1.0 is not a mask type");
  expect_error(head + "[0,null]}", "\"attn_type_map\"[1] = null is not a mask type");
  expect_error(head + R"([0,"diagonal"]})", "\"attn_type_map\"[1] \"diagonal\" is unknown; allowed: full, causal");
}

TEST(MaskJsonErrors, ValidationFailuresNameTheSlice) {
  expect_error(R"({"q_ranges":[[0,4],[2,3]],"k_ranges":[[0,4],[1,2]],"attn_type_map":[0,0]})",
               "slices 0 and 1 overlap at (q=2, k=1)");
  expect_error(R"({"q_ranges":[[0,4],[5,3]],"k_ranges":[[0,4],[1,2]],"attn_type_map":[0,0]})",
               "slice 1 (q [5, 3), k [1, 2), full): q_range start 5 > end 3");
  expect_error(R"({"q_ranges":[[0,4]],"k_ranges":[[0,4]],"attn_type_map":[1],"total_q":3})",
               "slice 0 (q [0, 4), k [0, 4), causal): q_range end 4 exceeds total_q 3");
  expect_error(R"({"q_ranges":[[-2,4]],"k_ranges":[[0,4]],"attn_type_map":[1]})", "q_range start -2 is negative");
}

}  // namespace
}  // namespace magi
