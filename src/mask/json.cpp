// The JSON form of a mask (magi/mask.hpp), read and written with nlohmann::json.
#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "magi/error.hpp"
#include "magi/mask.hpp"

namespace magi {
namespace {

using nlohmann::json;

constexpr std::array<std::string_view, 5> kKeys = {"q_ranges", "k_ranges", "attn_type_map", "total_q", "total_k"};
constexpr std::string_view kPrefix = "mask JSON: ";

[[noreturn]] void fail(const std::string& message) { throw InvalidArgument(std::string(kPrefix) + message); }

// A key as JSON writes it (control characters escaped, so that a message stays one line), cut after 48 bytes.
std::string in_quotes(std::string_view key) {
  constexpr size_t kShown = 48;
  const std::string quoted =
      json(std::string(key.substr(0, kShown))).dump(-1, ' ', false, json::error_handler_t::replace);
  return key.size() > kShown ? quoted.substr(0, quoted.size() - 1) + "...\"" : quoted;
}
std::string entry(std::string_view key, size_t index) { return in_quotes(key) + "[" + std::to_string(index) + "]"; }

// Short rendering of an offending value for messages.
std::string shown(const json& value) {
  std::string text = value.dump();
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

std::optional<int32_t> as_int32(const json& value) {
  if (value.is_number_unsigned()) {
    const auto v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) return std::nullopt;
    return static_cast<int32_t>(v);
  }
  if (value.is_number_integer()) {
    const auto v = value.get<int64_t>();
    if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) return std::nullopt;
    return static_cast<int32_t>(v);
  }
  return std::nullopt;
}

const json& require_array(const json& doc, std::string_view key) {
  const auto it = doc.find(key);
  if (it == doc.end()) {
    fail("missing key " + in_quotes(key) + "; required keys: \"q_ranges\", \"k_ranges\", \"attn_type_map\"");
  }
  if (!it->is_array()) fail(in_quotes(key) + " must be an array, got " + std::string(it->type_name()) + " " + shown(*it));
  return *it;
}

std::vector<Range> read_ranges(const json& doc, std::string_view key) {
  const json& list = require_array(doc, key);
  std::vector<Range> ranges;
  ranges.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const json& pair = list[i];
    std::optional<int32_t> start, end;
    if (pair.is_array() && pair.size() == 2) {
      start = as_int32(pair[0]);
      end = as_int32(pair[1]);
    }
    if (!start || !end) {
      fail(entry(key, i) + " must be a pair [start, end] of int32 integers, got " + shown(pair));
    }
    ranges.push_back({*start, *end});
  }
  return ranges;
}

std::vector<MaskType> read_types(const json& doc) {
  constexpr std::string_view key = "attn_type_map";
  const json& list = require_array(doc, key);
  std::vector<MaskType> types;
  types.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const json& value = list[i];
    if (value.is_string()) {
      types.push_back(parse_mask_type(value.get_ref<const std::string&>(), std::string(kPrefix) + entry(key, i)));
      continue;
    }
    const auto id = as_int32(value);
    if (!id || *id < 0 || *id > static_cast<int32_t>(MaskType::BiCausal)) {
      fail(entry(key, i) + " = " + shown(value) +
           " is not a mask type; allowed: 0..3 or \"full\", \"causal\", \"inv_causal\", \"bi_causal\"");
    }
    types.push_back(static_cast<MaskType>(*id));
  }
  return types;
}

std::optional<int32_t> read_total(const json& doc, std::string_view key) {
  const auto it = doc.find(key);
  if (it == doc.end()) return std::nullopt;
  const auto value = as_int32(*it);
  if (!value || *value < 0) fail(in_quotes(key) + " must be an integer in [0, 2^31), got " + shown(*it));
  return value;
}

}  // namespace

Mask mask_from_json(std::string_view json_text) {
  json doc;
  // A key given twice would silently keep its last value; name it instead.
  std::set<std::string> keys;
  std::string repeated, current;  // current: the top-level key being read
  // A mask nests three deep ({"q_ranges": [[0, 4]]}); deeper text is refused as it is read, before any recursion
  // over it (a message's rendering of 100000 nested arrays overflowed the stack). Top-level keys are checked as they
  // are read, so that an unknown key is named even where its value nests deeper.
  constexpr int kMaxDepth = 3;
  const json::parser_callback_t check_keys = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth > kMaxDepth)
      fail("nested deeper than a mask's {\"q_ranges\": [[start, end], ...]}" +
           (current.empty() ? std::string() : " (in " + in_quotes(current) + ")"));
    if (event != json::parse_event_t::key || depth != 1) return true;
    current = parsed.get<std::string>();
    if (std::find(kKeys.begin(), kKeys.end(), current) == kKeys.end()) {
      fail("unknown key " + in_quotes(current) +
           "; allowed: \"q_ranges\", \"k_ranges\", \"attn_type_map\", \"total_q\", \"total_k\"");
    }
    if (repeated.empty() && !keys.insert(current).second) repeated = current;
    return true;
  };
  // The JSON reader stops at a NUL byte; whatever follows it would be ignored.
  if (const auto nul = json_text.find('\0'); nul != std::string_view::npos)
    fail("malformed JSON at byte " + std::to_string(nul + 1) + ": a NUL byte");
  // e.what() starts with "[json.exception.<kind>.N] "; keep only the description after it.
  const auto description = [](const json::exception& e) {
    std::string what = e.what();
    if (const auto pos = what.find("] "); pos != std::string::npos) what = what.substr(pos + 2);
    return what;
  };
  try {
    doc = json::parse(json_text.begin(), json_text.end(), check_keys);
  } catch (const json::parse_error& e) {
    fail("malformed JSON at byte " + std::to_string(e.byte) + ": " + description(e));
  } catch (const json::exception& e) {  // e.g. a number beyond double's range
    fail("malformed JSON: " + description(e));
  }
  if (!doc.is_object()) {
    fail("top level must be an object with keys \"q_ranges\", \"k_ranges\", \"attn_type_map\" (optional \"total_q\", "
         "\"total_k\"), got " + std::string(doc.type_name()));
  }
  if (!repeated.empty()) fail("key " + in_quotes(repeated) + " appears more than once");
  const std::vector<Range> q_ranges = read_ranges(doc, "q_ranges");
  const std::vector<Range> k_ranges = read_ranges(doc, "k_ranges");
  const std::vector<MaskType> types = read_types(doc);
  if (k_ranges.size() != q_ranges.size()) {
    fail("\"k_ranges\" has " + std::to_string(k_ranges.size()) + " entries but \"q_ranges\" has " +
         std::to_string(q_ranges.size()) + "; every slice needs one of each");
  }
  if (types.size() != q_ranges.size()) {
    fail("\"attn_type_map\" has " + std::to_string(types.size()) + " entries but \"q_ranges\" has " +
         std::to_string(q_ranges.size()) + "; every slice needs one of each");
  }

  Mask mask;
  mask.slices.reserve(q_ranges.size());
  int32_t max_q_end = 0, max_k_end = 0;
  for (size_t i = 0; i < q_ranges.size(); ++i) {
    mask.slices.push_back({q_ranges[i], k_ranges[i], types[i]});
    max_q_end = std::max(max_q_end, q_ranges[i].end);
    max_k_end = std::max(max_k_end, k_ranges[i].end);
  }
  mask.total_q = read_total(doc, "total_q").value_or(max_q_end);
  mask.total_k = read_total(doc, "total_k").value_or(max_k_end);
  try {
    validate(mask);
  } catch (const InvalidArgument& e) {
    fail(e.what());
  }
  return mask;
}

std::string mask_to_json(const Mask& mask) {
  using ordered = nlohmann::ordered_json;  // keeps the documented key order
  ordered doc;
  ordered q_ranges = ordered::array(), k_ranges = ordered::array(), types = ordered::array();
  for (const Slice& s : mask.slices) {
    q_ranges.push_back({s.q.start, s.q.end});
    k_ranges.push_back({s.k.start, s.k.end});
    types.push_back(static_cast<int32_t>(s.type));
  }
  doc["q_ranges"] = std::move(q_ranges);
  doc["k_ranges"] = std::move(k_ranges);
  doc["attn_type_map"] = std::move(types);
  doc["total_q"] = mask.total_q;
  doc["total_k"] = mask.total_k;
  return doc.dump();
}

}  // namespace magi
