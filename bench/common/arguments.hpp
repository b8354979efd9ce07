// Command-line helpers shared by the benchmark programs.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace magi::bench {

// "1,2,4" -> {1, 2, 4}; std::stoi throws on an item that is not a number.
inline std::vector<int32_t> parse_int_list(const std::string& text) {
  std::vector<int32_t> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::stoi(item));
  return out;
}

// "full,causal" -> {"full", "causal"}.
inline std::vector<std::string> parse_name_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

}  // namespace magi::bench
