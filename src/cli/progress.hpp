// A progress line on stderr for long phases: live "\r"-updated elapsed time when stderr is a terminal,
// one line per finished phase otherwise (logs stay readable).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace magi::cli {

class Progress {
 public:
  explicit Progress(std::string prefix);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void begin(std::string phase);  // ends the running phase, if any
  double end();                   // seconds the phase took

 private:
  void tick_loop(std::stop_token stop);

  std::string prefix_;
  bool tty_ = false;
  std::mutex mutex_;
  std::condition_variable_any wake_;
  std::string phase_;
  bool active_ = false;
  std::chrono::steady_clock::time_point start_;
  std::jthread ticker_;
};

}  // namespace magi::cli
