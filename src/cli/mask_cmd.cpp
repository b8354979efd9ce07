// `magi-attn mask`: validate and describe a mask from a JSON file or a named preset.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "cli/commands.hpp"
#include "cli/documents.hpp"
#include "cli/mask_file.hpp"
#include "cli/npy.hpp"
#include "cli/options.hpp"
#include "mask/png.hpp"
#include "magi/error.hpp"
#include "magi/mask.hpp"

namespace magi::cli {
namespace {

constexpr int32_t kMaxTokens = 0x7fffffff;
constexpr const char* kPresets =
    "full, causal, varlen_full, varlen_causal, sliding_window, block_causal, varlen_block_causal, "
    "shared_question, global_sliding_window, documents";
// Options that only some presets use; each preset rejects the ones it ignores.
const std::vector<std::string> kPresetArgs = {"tk", "block", "window", "window-right", "docs", "seed",
                                              "global", "question", "answers"};

std::vector<int32_t> to_int32(const std::vector<int64_t>& values, const std::string& what) {
  std::vector<int32_t> out;
  for (int64_t v : values) {
    if (v < 0 || v > kMaxTokens) throw InvalidArgument(what + ": " + std::to_string(v) + " is out of range [0, 2^31)");
    out.push_back(static_cast<int32_t>(v));
  }
  return out;
}

// --docs takes cu_seqlens ("0,100,350"); without it, documents are drawn from --seed over --tq tokens.
std::vector<int32_t> preset_documents(const Options& o, std::optional<int32_t> tq) {
  if (auto docs = o.get_int_list("docs")) {
    std::vector<int32_t> cu = to_int32(*docs, "--docs");
    // "0" alone is no documents, as the library's builders take it.
    if (cu.empty() || cu.front() != 0 || !std::is_sorted(cu.begin(), cu.end()))
      throw InvalidArgument("--docs: expected cu_seqlens starting at 0 and non-decreasing, e.g. 0,100,350");
    if (tq && *tq != cu.back())
      throw InvalidArgument("--docs ends at " + std::to_string(cu.back()) + " but --tq is " + std::to_string(*tq));
    if (o.has("seed")) throw InvalidArgument("--seed is not used together with --docs");
    return cu;
  }
  if (!tq) throw InvalidArgument("this preset needs --docs CU_SEQLENS or --tq N (documents drawn from --seed)");
  return draw_documents(*tq, static_cast<uint64_t>(o.get_int("seed", 0, 0, INT64_MAX)));
}

Mask build_preset(const Options& o, const std::string& name) {
  auto tq_opt = [&]() -> std::optional<int32_t> {
    auto v = o.get_int("tq", 0, kMaxTokens);
    return v ? std::optional<int32_t>(static_cast<int32_t>(*v)) : std::nullopt;
  };
  auto tq = [&]() {
    auto v = tq_opt();
    if (!v) throw InvalidArgument("preset '" + name + "' needs --tq N");
    return *v;
  };
  auto int_arg = [&](const char* option, int64_t fallback, int64_t lo) {
    return static_cast<int32_t>(o.get_int(option, fallback, lo, kMaxTokens));
  };
  auto required_int = [&](const char* option, int64_t lo) {
    auto v = o.get_int(option, lo, kMaxTokens);
    if (!v) throw InvalidArgument("preset '" + name + "' needs --" + option + " N");
    return static_cast<int32_t>(*v);
  };
  auto only = [&](std::initializer_list<std::string> used) {
    std::vector<std::string> unused;
    for (const std::string& arg : kPresetArgs)
      if (std::find(used.begin(), used.end(), arg) == used.end()) unused.push_back(arg);
    o.reject_unless_used(unused, "preset '" + name + "'");
  };

  if (name == "full" || name == "causal") {
    only({"tk"});
    const int32_t q = tq();
    const int32_t k = int_arg("tk", q, 0);
    return name == "full" ? masks::full(q, k) : masks::causal(q, k);
  }
  if (name == "varlen_full" || name == "varlen_causal") {
    only({"docs", "seed"});
    const auto cu = preset_documents(o, tq_opt());
    return name == "varlen_full" ? masks::varlen_full(cu) : masks::varlen_causal(cu);
  }
  if (name == "sliding_window") {
    only({"window", "window-right"});
    return masks::sliding_window(tq(), required_int("window", 0), int_arg("window-right", 0, 0));
  }
  if (name == "block_causal") {
    only({"block"});
    return masks::block_causal(tq(), required_int("block", 1));
  }
  if (name == "varlen_block_causal" || name == "documents") {
    only({"docs", "seed", "block"});
    if (name == "documents" && o.has("docs")) throw InvalidArgument("preset 'documents' draws its own documents; use varlen_block_causal with --docs");
    const auto cu = preset_documents(o, tq_opt());
    return masks::varlen_block_causal(cu, int_arg("block", 128, 1));
  }
  if (name == "shared_question") {
    only({"question", "answers"});
    const int32_t question = required_int("question", 0);
    auto answers = o.get_int_list("answers");
    if (!answers) throw InvalidArgument("preset 'shared_question' needs --answers LEN,LEN,...");
    const std::vector<int32_t> lengths = to_int32(*answers, "--answers");
    int64_t total = question;
    for (int32_t a : lengths) total += a;
    if (auto q = tq_opt(); q && *q != total)
      throw InvalidArgument("--tq " + std::to_string(*q) + " differs from --question + sum of --answers = " +
                            std::to_string(total));
    if (total > kMaxTokens) throw InvalidArgument("--question + --answers exceed 2^31 tokens");
    return masks::shared_question(question, lengths);
  }
  if (name == "global_sliding_window") {
    only({"global", "window"});
    return masks::global_sliding_window(tq(), required_int("global", 0), required_int("window", 0));
  }
  throw InvalidArgument("--preset: unknown preset '" + name + "' (allowed: " + kPresets + ")");
}

}  // namespace

int mask_command(std::span<const std::string> args) {
  Options options(
      "mask",
      "magi-attn mask (--mask FILE.json | --preset NAME --tq N [preset options]) [--png FILE] [--json]",
      "Validates a mask and describes it: slices, area, density and a text picture; --png draws it\n"
      "(white = kept, black = masked, grey = partly kept where downsampled).\n"
      "\n"
      "presets and their options:\n"
      "  full, causal                 --tq N [--tk N]\n"
      "  varlen_full, varlen_causal   --docs CU_SEQLENS | --tq N [--seed S]\n"
      "  sliding_window               --tq N --window L [--window-right R]\n"
      "  block_causal                 --tq N --block B\n"
      "  varlen_block_causal          (--docs CU_SEQLENS | --tq N [--seed S]) [--block 128]\n"
      "  documents                    --tq N [--seed S] [--block 128]: long-tailed packed documents,\n"
      "                               block-causal inside (the mask of `magi-attn demo`)\n"
      "  shared_question              --question N --answers LENS\n"
      "  global_sliding_window        --tq N --global G --window W",
      {{"mask", "FILE.json", "mask JSON file"},
       {"preset", "NAME", "build a mask by name (see above)"},
       {"tq", "N", "query tokens"},
       {"tk", "N", "key tokens (full, causal; default = --tq)"},
       {"block", "N", "block size (block_causal, varlen_block_causal, documents)"},
       {"window", "N", "left window (sliding_window) or causal window (global_sliding_window)"},
       {"window-right", "N", "right window of sliding_window (default 0)"},
       {"docs", "CU_SEQLENS", "document boundaries, e.g. 0,100,350 (varlen presets)"},
       {"seed", "S", "seed of the drawn document lengths (default 0)"},
       {"global", "N", "global tokens (global_sliding_window)"},
       {"question", "N", "question length (shared_question)"},
       {"answers", "LENS", "answer lengths, e.g. 100,80,120 (shared_question)"},
       {"png", "FILE", "write a PNG picture (at most 1024 pixels a side)"},
       {"json", "", "print the mask as JSON instead of the description"}});
  options.parse(args);
  if (options.help_requested()) {
    std::cout << options.help_text();
    return 0;
  }
  if (options.has("mask") == options.has("preset"))
    throw InvalidArgument("mask: give exactly one of --mask FILE.json or --preset NAME (see --help)");
  Mask mask;
  if (auto path = options.get("mask")) {
    std::vector<std::string> preset_only = kPresetArgs;
    preset_only.push_back("tq");
    options.reject_unless_used(preset_only, "--mask (preset options need --preset)");
    try {
      mask = load_mask_file(*path);
    } catch (const Error& e) {
      throw InvalidArgument(std::string("--mask ") + e.what());
    }
  } else {
    mask = build_preset(options, *options.get("preset"));
    validate(mask);
  }

  // Build every output before writing anything.
  std::ostringstream text;
  if (options.has("json")) text << mask_to_json(mask) << "\n";
  else text << describe(mask);
  if (auto png = options.get("png")) {
    if (auto input = options.get("mask"); input && same_file(*input, *png))
      throw InvalidArgument("--png " + *png + ": is the --mask input (choose another file)");
    try {
      replace_file(*png, [&](const std::string& temporary) { picture::write_mask_png(mask, temporary); });
    } catch (const Error& e) {
      throw InvalidArgument(std::string("--png ") + e.what());
    }
    if (!options.has("json")) text << "wrote " << *png << "\n";
  }
  std::cout << text.str();
  return 0;
}

}  // namespace magi::cli
