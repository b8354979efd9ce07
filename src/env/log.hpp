// Diagnostics on stderr, filtered by MAGI_ATTENTION_LOG_LEVEL (error | warn | info | debug; default warn).
// Errors are not logged: the library throws them (include/magi/error.hpp).
#pragma once

#include <optional>
#include <string_view>

namespace magi::log {

enum class Level { Error = 0, Warn = 1, Info = 2, Debug = 3 };

std::optional<Level> parse_level(std::string_view text);  // exact lower-case names

// The threshold. Until the env registry has set it, the first query runs env::ensure_validated()
// (which sets it); if that fails, Warn applies.
Level level();
bool enabled(Level message_level);
void set_level(Level threshold);  // called by the env registry when it reads the environment
void clear_level();               // back to "not read yet" (env::reset_for_testing)

// One line each: "magi-attn: warning: <message>", "magi-attn: info: ...", "magi-attn: debug: ...".
void warn(std::string_view message);
void info(std::string_view message);
void debug(std::string_view message);
void write(Level message_level, std::string_view message);

}  // namespace magi::log
