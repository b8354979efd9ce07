// Reading a mask JSON file (magi::mask_from_json format) for the CLI.
#pragma once

#include <optional>
#include <string>

#include "magi/mask.hpp"

namespace magi::cli {

// Reads and fully validates the mask in `path`. When the JSON omits total_q / total_k and a tensor
// length is given, that length becomes the total; when both are present they must agree. Errors are
// InvalidArgument "<path>: <problem>".
Mask load_mask_file(const std::string& path, std::optional<int32_t> tensor_q = std::nullopt,
                    std::optional<int32_t> tensor_k = std::nullopt);

std::string read_text_file(const std::string& path);

}  // namespace magi::cli
