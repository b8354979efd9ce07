// Runs a function once per GPU of this machine, each in its own process with an NCCL communicator:
// under mpirun (a library built with MPI) the ranks are mpirun's and the id travels by MPI_Bcast;
// otherwise the calling process forks one child per GPU and hands rank 0's unique id to the others
// through pipes (no MPI needed at run time). Used by the GPU test programs and benchmarks.
// No rank outlives the parent (PR_SET_PDEATHSIG), and once one rank fails the parent ends the others
// after a grace period, so a rank stuck on a dead peer cannot hang the program.
// Header-only: include from exactly one translation unit of a program.
#pragma once

#include <cuda_runtime_api.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/nccl_communicator.hpp"

namespace magi::comm {

inline bool launched_by_mpirun() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(name) != nullptr) return true;
  return false;
}

// GPUs to use without mpirun: MAGI_LOCAL_RANKS if set, else the driver's GPU count (read from /proc so
// that the parent never initialises CUDA before forking), else 1.
inline int32_t local_rank_count() {
  if (const char* env = std::getenv("MAGI_LOCAL_RANKS")) return std::max(1, std::atoi(env));
  int32_t count = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", error)) {
    (void)entry;
    ++count;
  }
  return count > 0 ? count : 1;
}

namespace detail {

inline bool write_all(int fd, const void* data, size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

inline bool read_all(int fd, void* data, size_t bytes) {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::read(fd, p, bytes);
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

// Runs body in this process as `rank`; exceptions become exit code 3.
inline int run_rank(const std::function<int(std::shared_ptr<NcclCommunicator>)>& body,
                    std::shared_ptr<NcclCommunicator> comm) {
  try {
    return body(std::move(comm));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank] uncaught exception: %s\n", e.what());
    return 3;
  }
}

// The forked ranks, for the parent's signal handler (a parent stopped by `timeout` takes them along).
inline std::vector<pid_t>& children() {
  static std::vector<pid_t> pids;
  return pids;
}
inline void end_children(int signal) {
  for (pid_t child : children()) ::kill(child, SIGKILL);
  std::_Exit(128 + signal);
}

}  // namespace detail

// Returns the exit code for main: in the forking mode the parent's (non-zero if any rank failed), under
// mpirun this rank's. `body` runs on every rank with the world communicator (rank r on GPU r % GPUs).
inline int run_on_local_gpus(const std::function<int(std::shared_ptr<NcclCommunicator>)>& body) {
#if MAGI_ATTN_WITH_MPI
  if (launched_by_mpirun()) {
    MpiEnvironment mpi(nullptr, nullptr);
    int code = 0;
    try {
      code = body(make_nccl_world());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "uncaught exception: %s\n", e.what());
      code = 3;
    }
    return code;
  }
#endif
  const int32_t ranks = local_rank_count();
  std::vector<std::array<int, 2>> pipes(static_cast<size_t>(ranks));
  for (auto& p : pipes)
    if (::pipe(p.data()) != 0) {
      std::perror("pipe");
      return 4;
    }
  std::fflush(nullptr);
  std::vector<pid_t>& children = detail::children();
  children.reserve(static_cast<size_t>(ranks));
  for (int32_t rank = 0; rank < ranks; ++rank) {
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("fork");
      for (pid_t child : children) ::kill(child, SIGKILL);
      return 4;
    }
    if (pid == 0) {
      // Die with the parent (a parent killed by a test driver must not leave ranks holding the GPUs).
      if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) std::_Exit(4);
      // Keep only this rank's ends, so that a rank 0 that dies leaves the others an end of file.
      for (int32_t r = 0; r < ranks; ++r) {
        auto& p = pipes[static_cast<size_t>(r)];
        if (rank != 0 || r == 0) ::close(p[1]), p[1] = -1;
        if (r != rank || rank == 0) ::close(p[0]), p[0] = -1;
      }
      int code = 0;
      try {
        NcclUniqueId id;
        if (rank == 0) {
          if (cudaSetDevice(0) != cudaSuccess) throw CommError("cudaSetDevice(0) failed");
          id = nccl_unique_id();
          for (int32_t r = 1; r < ranks; ++r)
            if (!detail::write_all(pipes[static_cast<size_t>(r)][1], &id, sizeof(id)))
              throw CommError("could not hand the NCCL id to rank " + std::to_string(r));
        } else if (!detail::read_all(pipes[static_cast<size_t>(rank)][0], &id, sizeof(id))) {
          throw CommError("rank " + std::to_string(rank) + " did not receive the NCCL id");
        }
        for (auto& p : pipes)
          for (int fd : p)
            if (fd >= 0) ::close(fd);
        if (cudaSetDevice(rank) != cudaSuccess) throw CommError("cudaSetDevice failed");
        code = detail::run_rank(body, make_nccl_communicator(id, rank, ranks, rank));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d] %s\n", rank, e.what());
        code = 3;
      }
      std::fflush(nullptr);
      std::_Exit(code);  // the child must not run the parent's exit handlers (CUDA, gtest)
    }
    children.push_back(pid);
  }
  for (auto& p : pipes) ::close(p[0]), ::close(p[1]);
  std::signal(SIGTERM, detail::end_children);
  std::signal(SIGINT, detail::end_children);
  // Collect the ranks; once one fails, give the others a grace period, then end them.
  int result = 0;
  size_t remaining = children.size();
  std::chrono::steady_clock::time_point failed_at{};
  while (remaining > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, result != 0 ? WNOHANG : 0);
    if (pid > 0) {
      --remaining;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
      if (code != 0 && result == 0) {
        result = code;
        failed_at = std::chrono::steady_clock::now();
      }
      continue;
    }
    if (pid < 0) break;
    if (std::chrono::steady_clock::now() - failed_at > std::chrono::seconds(60)) {
      for (pid_t child : children) ::kill(child, SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return result;
}

}  // namespace magi::comm
