// Communicators for context parallelism: a small abstract interface (all-to-all-v over bytes, allgather,
// barrier) with one engine per memory kind: MPI moves host memory, NCCL device memory. Group
// collectives (src/comm) and distributed attention (magi/dist.hpp) only see this interface.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "magi/error.hpp"
#include "magi/tensor.hpp"

namespace magi::comm {

// A collective failed or did not finish within the communicator's timeout. Thrown on the calling rank;
// the communicator must not be used afterwards.
class CommError : public Error {
 public:
  using Error::Error;
};

// An operation in flight. Its buffers must stay valid until wait() returns. Destroying an unfinished
// request waits for it (errors are swallowed there; call wait() to see them).
class Request {
 public:
  virtual ~Request() = default;
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int32_t rank() const = 0;
  virtual int32_t size() const = 0;
  // Where buffers handed to this communicator must live.
  virtual Device device() const = 0;
  // A short name of the engine and group ("mpi:4"), for messages and summaries.
  virtual std::string describe() const = 0;
  // Ranks per node when every node holds the same number of consecutive ranks (what hierarchical comm
  // needs), else 0. The default says: one node.
  virtual int32_t ranks_per_node() const { return size(); }

  // Every rank calls the collectives below in the same order. Counts and displacements are in bytes,
  // one entry per rank; recv_counts[r] must equal what rank r sends here.
  virtual std::unique_ptr<Request> start_all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                                      std::span<const int64_t> send_displs, void* recv,
                                                      std::span<const int64_t> recv_counts,
                                                      std::span<const int64_t> recv_displs) = 0;
  void all_to_all_v(const void* send, std::span<const int64_t> send_counts, std::span<const int64_t> send_displs,
                    void* recv, std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs) {
    start_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs)->wait();
  }
  // Every rank contributes `bytes` bytes; `recv` receives size() * bytes, in rank order.
  virtual void allgather(const void* send, int64_t bytes, void* recv) = 0;
  virtual void barrier() = 0;

  // Seconds any collective may take before it fails with CommError (a rank that diverged or died must
  // not hang the others forever). Must be > 0; longer than kLongestTimeoutSeconds (~32 years) counts as that, so that
  // deadlines stay within the clocks' range.
  static constexpr double kDefaultTimeoutSeconds = 300.0;
  static constexpr double kLongestTimeoutSeconds = 1e9;
  void set_timeout(double seconds);
  double timeout() const { return timeout_seconds_; }

 private:
  double timeout_seconds_ = kDefaultTimeoutSeconds;
};

// Throws InvalidArgument on every rank when ranks disagree on `fingerprint` (e.g. a hash of mask and
// config); `what` names the thing compared. One allgather, so it cannot hang on a mismatch.
void require_same_on_all_ranks(Communicator& comm, uint64_t fingerprint, std::string_view what);

// ---- Launch without MPI: the launcher's variables and a TCP engine (host memory). ----

// Where this process sits in a job started by a launcher other than mpirun: torchrun's RANK, WORLD_SIZE,
// LOCAL_RANK, MASTER_ADDR, MASTER_PORT, or ATOM's ATOM_DP_RANK, ATOM_DP_SIZE, ATOM_DP_RANK_LOCAL,
// ATOM_DP_MASTER_IP (default 127.0.0.1), ATOM_DP_MASTER_PORT (default 29500).
struct LaunchInfo {
  int32_t rank = 0, size = 1, local_rank = 0;
  std::string master_addr;
  int32_t master_port = 0;
  std::string convention;  // "torchrun" or "ATOM"
};
// The launch of this process, if either convention's variables are set (RANK / ATOM_DP_RANK decide); a set but
// bad or incomplete convention is InvalidArgument naming the variable and what it allows.
std::optional<LaunchInfo> launch_from_env();

// A host communicator over TCP for a launcher's ranks: rank 0 listens on master_port, the others connect to
// master_addr:master_port (retrying until it listens); collectives pass through rank 0. Collective: a rank that
// never joins, or an unreachable master, is CommError on every rank after `timeout_seconds`.
std::shared_ptr<Communicator> tcp_communicator(const LaunchInfo& launch,
                                               double timeout_seconds = Communicator::kDefaultTimeoutSeconds);

// ---- MPI engine (host memory). Available when the library was built with MPI. ----

// Initialises MPI (thread level SERIALIZED, so the communicator can drive progress from a helper thread
// while the caller computes) unless already initialised, and finalises it on destruction if it did.
// Destroy every MPI communicator before it.
class MpiEnvironment {
 public:
  MpiEnvironment(int* argc, char*** argv);
  ~MpiEnvironment();
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;

 private:
  bool owns_ = false;
};

// A communicator over a duplicate of MPI_COMM_WORLD (errors return instead of aborting).
std::shared_ptr<Communicator> mpi_world();
// A communicator over a duplicate of `mpi_comm`, which points to an MPI_Comm handle.
std::shared_ptr<Communicator> mpi_communicator(const void* mpi_comm);

// ---- NCCL engine (device memory, one CUDA device per rank). ----
// Built with NCCL (>= 2.14) and the CUDA backend; otherwise every function here throws NotAvailable.
// Communicators are non-blocking underneath: initialisation and every collective, including NCCL's
// first connection to a peer, end in CommError after the timeout when a rank never joins.

// NCCL's unique id as plain bytes (ncclUniqueId), so that callers need no NCCL header to pass it on.
struct NcclUniqueId {
  std::array<char, 128> bytes{};
};
// A fresh id: call on one rank, hand it to the others (e.g. through torch.distributed or MPI).
NcclUniqueId nccl_unique_id();
// A communicator over `size` ranks on `cuda_device` (collective: every rank passes the same id).
// `timeout_seconds` also bounds the initialisation (a rank that never joins it).
std::shared_ptr<Communicator> nccl_communicator(const NcclUniqueId& id, int32_t rank, int32_t size,
                                                int32_t cuda_device,
                                                double timeout_seconds = Communicator::kDefaultTimeoutSeconds);
// Over MPI_COMM_WORLD (needs a library built with MPI, and MPI initialised): rank 0 makes the id and
// broadcasts it; each rank uses device (node-local rank % visible devices) unless `cuda_device` >= 0.
std::shared_ptr<Communicator> nccl_world(int32_t cuda_device = -1,
                                         double timeout_seconds = Communicator::kDefaultTimeoutSeconds);

}  // namespace magi::comm
