#include "cli/mask_file.hpp"

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "magi/error.hpp"

namespace magi::cli {

std::string read_text_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw InvalidArgument(path + ": is a directory, not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument(path + ": cannot open: " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

Mask load_mask_file(const std::string& path, std::optional<int32_t> tensor_q, std::optional<int32_t> tensor_k) {
  const std::string text = read_text_file(path);
  try {
    Mask mask = mask_from_json(text);
    // mask_from_json fills absent totals with the largest range end; the tensors know better.
    const nlohmann::json doc = nlohmann::json::parse(text);
    auto settle = [&](int32_t& total, const char* key, std::optional<int32_t> tensor, const char* tensor_name) {
      if (!tensor) return;
      if (!doc.contains(key)) total = *tensor;
      else if (total != *tensor)
        throw InvalidArgument(std::string(key) + " " + std::to_string(total) + " does not match " + tensor_name +
                              " = " + std::to_string(*tensor));
    };
    settle(mask.total_q, "total_q", tensor_q, "the q rows (Tq)");
    settle(mask.total_k, "total_k", tensor_k, "the k rows (Tk)");
    validate(mask);
    return mask;
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(path + ": invalid JSON: " + e.what());
  } catch (const Error& e) {
    throw InvalidArgument(path + ": " + e.what());
  }
}

}  // namespace magi::cli
