#include "env/log.hpp"

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>

#include "magi/env.hpp"

namespace magi::log {
namespace {

constexpr int kUnset = -1;
std::atomic<int> g_threshold{kUnset};
std::mutex g_write_mutex;  // keeps lines from concurrent threads whole

std::string_view prefix(Level message_level) {
  switch (message_level) {
    case Level::Error: return "magi-attn: error: ";
    case Level::Warn: return "magi-attn: warning: ";
    case Level::Info: return "magi-attn: info: ";
    case Level::Debug: return "magi-attn: debug: ";
  }
  return "magi-attn: ";
}

}  // namespace

std::optional<Level> parse_level(std::string_view text) {
  if (text == "error") return Level::Error;
  if (text == "warn") return Level::Warn;
  if (text == "info") return Level::Info;
  if (text == "debug") return Level::Debug;
  return std::nullopt;
}

Level level() {
  if (g_threshold.load(std::memory_order_acquire) == kUnset) {
    try {
      env::ensure_validated();  // sets the threshold before it can fail or log
    } catch (...) {
      // The bad variable is reported by the next library call; logging must not throw.
    }
  }
  const int threshold = g_threshold.load(std::memory_order_acquire);
  return threshold == kUnset ? Level::Warn : static_cast<Level>(threshold);
}

bool enabled(Level message_level) { return static_cast<int>(message_level) <= static_cast<int>(level()); }

void set_level(Level threshold) { g_threshold.store(static_cast<int>(threshold), std::memory_order_release); }

void clear_level() { g_threshold.store(kUnset, std::memory_order_release); }

void write(Level message_level, std::string_view message) {
  if (!enabled(message_level)) return;
  std::string line(prefix(message_level));
  line.append(message);
  // One line per message, whatever it quotes (a variable's value may hold a newline).
  for (size_t i = prefix(message_level).size(); i < line.size(); ++i)
    if (line[i] == '\n' || line[i] == '\r') line[i] = ' ';
  line.push_back('\n');
  std::lock_guard lock(g_write_mutex);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

void warn(std::string_view message) { write(Level::Warn, message); }
void info(std::string_view message) { write(Level::Info, message); }
void debug(std::string_view message) { write(Level::Debug, message); }

}  // namespace magi::log
