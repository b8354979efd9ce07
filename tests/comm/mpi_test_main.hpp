// main() for GoogleTest programs run under mpirun: initialises MPI, gives tests the world communicator
// and a seed shared by all ranks, prints the full log on rank 0 and failures (prefixed) on other ranks,
// and exits non-zero on every rank if any rank failed. Include from exactly one .cpp per program.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <memory>

#include "magi/comm.hpp"
#include "reference/random_inputs.hpp"

namespace magi::test {

inline std::shared_ptr<comm::Communicator>& world_slot() {
  static std::shared_ptr<comm::Communicator> world;
  return world;
}
inline comm::Communicator& world() { return *world_slot(); }
inline std::shared_ptr<comm::Communicator> world_ptr() { return world_slot(); }

// Rank 0's fresh seed, known to every rank (all ranks build the same global inputs from it).
inline uint64_t shared_seed() {
  uint64_t mine = fresh_seed();
  std::vector<uint64_t> all(static_cast<size_t>(world().size()));
  world().allgather(&mine, sizeof(mine), all.data());
  return all[0];
}

// Logical AND of `ok` over ranks.
inline bool all_ranks(bool ok) {
  std::vector<int32_t> all(static_cast<size_t>(world().size()));
  const int32_t mine = ok ? 1 : 0;
  world().allgather(&mine, sizeof(mine), all.data());
  for (int32_t v : all)
    if (v == 0) return false;
  return true;
}

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, result.file_name() ? result.file_name() : "?",
                   result.line_number(), result.summary());
  }

 private:
  int rank_;
};

}  // namespace magi::test

int main(int argc, char** argv) {
  magi::comm::MpiEnvironment mpi(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int result = 1;
  {
    magi::test::world_slot() = magi::comm::mpi_world();
    magi::test::world().set_timeout(120.0);
    const int rank = magi::test::world().rank();
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    if (rank != 0) {
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new magi::test::RankFailurePrinter(rank));
    }
    const bool ok = RUN_ALL_TESTS() == 0;
    const bool all_ok = magi::test::all_ranks(ok);
    if (rank == 0 && !all_ok && ok) std::fprintf(stderr, "another rank failed (see [rank N] lines)\n");
    result = all_ok ? 0 : 1;
    magi::test::world_slot().reset();
  }
  return result;
}
