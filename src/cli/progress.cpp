#include "cli/progress.hpp"

#include <unistd.h>

#include <cstdio>

namespace magi::cli {

Progress::Progress(std::string prefix) : prefix_(std::move(prefix)), tty_(::isatty(STDERR_FILENO) == 1) {
  if (tty_) ticker_ = std::jthread([this](std::stop_token stop) { tick_loop(stop); });
}

Progress::~Progress() {
  if (active_) end();
  if (ticker_.joinable()) {
    ticker_.request_stop();
    wake_.notify_all();
  }
}

void Progress::begin(std::string phase) {
  if (active_) end();
  std::lock_guard lock(mutex_);
  phase_ = std::move(phase);
  start_ = std::chrono::steady_clock::now();
  active_ = true;
  if (tty_) std::fprintf(stderr, "\r%s %s ...\x1b[K", prefix_.c_str(), phase_.c_str());
  wake_.notify_all();
}

double Progress::end() {
  std::lock_guard lock(mutex_);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (!active_) return 0.0;
  active_ = false;
  if (tty_) std::fprintf(stderr, "\r\x1b[K");  // the summary on stdout reports the result
  else std::fprintf(stderr, "%s %s: %.2f s\n", prefix_.c_str(), phase_.c_str(), seconds);
  std::fflush(stderr);
  return seconds;
}

void Progress::tick_loop(std::stop_token stop) {
  std::unique_lock lock(mutex_);
  while (!stop.stop_requested()) {
    wake_.wait_for(lock, stop, std::chrono::milliseconds(200), [] { return false; });
    if (stop.stop_requested()) break;
    if (!active_) continue;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::fprintf(stderr, "\r%s %s ... %.1f s\x1b[K", prefix_.c_str(), phase_.c_str(), seconds);
    std::fflush(stderr);
  }
}

}  // namespace magi::cli
