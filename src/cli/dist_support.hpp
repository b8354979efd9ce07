// What the distributed commands (dist-run, dist-demo) share: the MPI world of one command, error handling
// that stops every rank with one line from rank 0 and never hangs, and moving whole tensors between
// rank 0 (which reads and writes files) and the per-rank shards of a runtime key.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cli/host_tensor.hpp"
#include "cli/options.hpp"
#include "magi/comm.hpp"
#include "magi/dist.hpp"
#include "magi/error.hpp"

namespace magi::cli {

class DistWorld {
 public:
  DistWorld();   // initialises MPI unless already done; the world communicator
  ~DistWorld();  // drops the cached runtimes (they hold the communicator) before MPI is finalised
  DistWorld(const DistWorld&) = delete;
  DistWorld& operator=(const DistWorld&) = delete;

  comm::Communicator& comm() { return *comm_; }
  const std::shared_ptr<comm::Communicator>& comm_ptr() const { return comm_; }
  int32_t rank() const { return comm_->rank(); }
  int32_t size() const { return comm_->size(); }
  bool root() const { return comm_->rank() == 0; }

  // Runs `work` here, then every rank learns whether it failed anywhere. If it did, rank 0 throws the
  // first error (prefixed "rank N: " when another rank had it) and the others throw QuietExit, so
  // exactly one line is printed and every rank exits 2. Work that a single rank may fail (reading files
  // on rank 0) must go through here before any collective the other ranks would wait in.
  void agree(const std::function<void()>& work);

  // Rank 0's bytes, on every rank.
  std::vector<std::byte> broadcast(std::vector<std::byte> bytes);
  // The largest of `value` over ranks, on every rank.
  double max_over_ranks(double value);
  // True on every rank iff `ok` on every rank.
  bool all(bool ok);
  // CPU threads for each rank: `requested` if > 0, else 0 (OpenMP's choice) when OMP_NUM_THREADS is set,
  // else this node's cores shared by its ranks (ranks on one machine must not each take every core).
  int32_t threads_per_rank(int32_t requested) const;

 private:
  comm::MpiEnvironment mpi_;
  std::shared_ptr<comm::Communicator> comm_;
};

// Rows of one axis of a runtime key: which global row each rank's local rows hold.
class Shards {
 public:
  // Collective (one allgather of position ids). `total` = global rows (mask.total_q or total_k).
  Shards(const dist::RuntimeKey& key, dist::Axis axis, comm::Communicator& comm, int64_t total);

  int64_t local_rows() const { return local_rows_; }
  // Collective: rank 0's `global` [total, ...] (ignored elsewhere) into every rank's `local`
  // [local_rows, ...] of the same dtype and trailing shape; padding rows are zero.
  void scatter(HostTensor* global, HostTensor& local) const;
  // Collective inverse: every rank's `local` into rank 0's `global` (untouched elsewhere).
  void gather(HostTensor& local, HostTensor* global) const;

 private:
  comm::Communicator& comm_;
  int64_t total_ = 0;
  int64_t local_rows_ = 0;
  std::vector<int32_t> rows_;  // [rank * local_rows + i]: global row of rank's local row i (>= total: padding)
};

// --chunk-size --overlap-degree --dispatch --hierarchical --ranks-per-node --comm-timeout
std::vector<OptionSpec> dist_option_specs();
// The distributed config from those options around `attention`. A shared (sh) sink's gradient is summed
// over ranks, so every rank ends with the global dsink.
dist::DistConfig parse_dist_config(const Options& options, const AttentionOptions& attention);

// PlanSummary::to_text plus the kv bytes moved against ring attention's, at the dtype's size.
std::string plan_text(const dist::PlanSummary& plan, DType dtype);

// Runs a distributed command's body; an error that escapes it on a rank other than 0 (a failed
// collective, which rank 0 sees too) names its rank.
template <class Body>
int run_on_every_rank(DistWorld& world, Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    if (world.root()) throw;
    throw Error("rank " + std::to_string(world.rank()) + ": " + e.what());
  }
}

}  // namespace magi::cli
