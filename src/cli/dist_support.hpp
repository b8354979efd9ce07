// What the distributed commands (dist-run, dist-demo) share: the world of one command (MPI, or a given
// communicator such as the NCCL one of a GPU rank), error handling that stops every rank with one line
// from rank 0 and never hangs, moving whole tensors between rank 0 (which reads and writes files) and the
// per-rank shards of a runtime key, and what a command can learn before any rank starts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cli/host_tensor.hpp"
#include "cli/options.hpp"
#include "magi/comm.hpp"
#include "magi/dist.hpp"
#include "magi/error.hpp"

namespace magi::cli {

class DistWorld {
 public:
  // The world of this process's launch (host memory): mpirun's ranks through MPI (initialised unless already
  // done), or, without mpirun, a torchrun / ATOM launch (comm::launch_from_env) through the TCP engine, whose
  // bootstrap waits at most `timeout_seconds` for every rank; neither: MPI's (a single rank).
  explicit DistWorld(double timeout_seconds = comm::Communicator::kDefaultTimeoutSeconds);
  // Over `comm` (e.g. a GPU rank's NCCL communicator); MPI, if any, is the caller's. Control traffic
  // (agree, broadcast, ...) goes through its allgather, which takes host buffers on every engine.
  explicit DistWorld(std::shared_ptr<comm::Communicator> comm);
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
  std::optional<comm::MpiEnvironment> mpi_;
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

// The library's bound on --chunk-size (dist::max_chunk_size), checked by the commands up front: the error comes
// before any progress output, the same on every rank, and names the option.
void check_chunk_size(const dist::DistConfig& config, int64_t total_q, int64_t total_k);

// PlanSummary::to_text plus the kv bytes moved against ring attention's, at the dtype's size.
std::string plan_text(const dist::PlanSummary& plan, DType dtype);

// This process's rank as the launcher announces it (mpirun: OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK; else
// torchrun's RANK or ATOM's ATOM_DP_RANK), else 0: lets a command that fails before any communicator exists report
// from rank 0 alone.
int32_t launcher_rank();
// Whether mpirun (or another MPI launcher) started this process.
bool launched_by_mpi();
// The value of --comm-timeout among `args` (the bootstrap's bound before the options are parsed), else the default.
double bootstrap_timeout(std::span<const std::string> args);
// Ranks the MPI launcher put on this node (OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS), else 0 (not
// launched by mpirun, or a launcher that does not say).
int32_t launcher_local_ranks();
// GPUs this process may use, counted without initialising CUDA (a process that forks its GPU ranks must
// not): the driver's list (/proc/driver/nvidia/gpus, else /dev/nvidiaN), narrowed by CUDA_VISIBLE_DEVICES.
int32_t visible_gpu_count();
// The one line main prints for an error ("magi-attn: error: ..."), for ranks that end outside main.
void print_error_line(std::string_view message);

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
