// Engine-independent parts of the communicator interface.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "magi/comm.hpp"

namespace magi::comm {

void Communicator::set_timeout(double seconds) {
  if (!(seconds > 0) || !std::isfinite(seconds))
    throw InvalidArgument("communicator timeout must be a finite number of seconds > 0, got " +
                          std::to_string(seconds));
  // A deadline past the steady clock's 64-bit nanoseconds (~292 years) would wrap into the past.
  timeout_seconds_ = std::min(seconds, kLongestTimeoutSeconds);
}

void require_same_on_all_ranks(Communicator& comm, uint64_t fingerprint, std::string_view what) {
  std::vector<uint64_t> all(static_cast<size_t>(comm.size()));
  comm.allgather(&fingerprint, sizeof(fingerprint), all.data());
  std::string differing;
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r] != all[0]) differing += (differing.empty() ? "" : ", ") + std::to_string(r);
  if (!differing.empty())
    throw InvalidArgument(std::string(what) + " differs between ranks: ranks " + differing +
                          " disagree with rank 0 (every rank must pass the same value)");
}

#if !MAGI_ATTN_WITH_MPI
// The MPI engine is not part of this build (src/comm/mpi_communicator.cpp defines these when it is).
namespace {
[[noreturn]] void mpi_not_built(const char* function) {
  throw NotAvailable(std::string(function) + ": magi-attn was built without MPI (install libopenmpi-dev and rebuild)");
}
}  // namespace

MpiEnvironment::MpiEnvironment(int*, char***) { mpi_not_built("MpiEnvironment"); }
MpiEnvironment::~MpiEnvironment() = default;
std::shared_ptr<Communicator> mpi_world() { mpi_not_built("mpi_world"); }
std::shared_ptr<Communicator> mpi_communicator(const void*) { mpi_not_built("mpi_communicator"); }
#endif

#if !MAGI_ATTN_WITH_NCCL
// The NCCL engine is not part of this build (src/comm/nccl_communicator.cpp defines these when it is).
namespace {
[[noreturn]] void nccl_not_built(const char* function) {
  throw NotAvailable(std::string(function) +
                     ": magi-attn was built without NCCL (the NCCL engine needs the CUDA backend and NCCL >= 2.14)");
}
}  // namespace

NcclUniqueId nccl_unique_id() { nccl_not_built("nccl_unique_id"); }
std::shared_ptr<Communicator> nccl_communicator(const NcclUniqueId&, int32_t, int32_t, int32_t, double) {
  nccl_not_built("nccl_communicator");
}
std::shared_ptr<Communicator> nccl_world(int32_t, double) { nccl_not_built("nccl_world"); }
#endif

}  // namespace magi::comm
