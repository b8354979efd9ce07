// The NCCL engine on device memory, one process per GPU (forked, or under mpirun): all-to-all-v with
// random per-pair counts, allgather of host and device bytes, argument errors, and a peer that never
// joins the init, the first exchange (NCCL's lazy connection) or a later collective: the others end in
// CommError within the timeout, never a hang, and every process (the one that skipped too) goes on.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "comm/nccl_communicator.hpp"
#include "comm/nccl_local_launch.hpp"
#include "reference/random_inputs.hpp"

namespace magi::comm {
namespace {

std::shared_ptr<NcclCommunicator>& world_slot() {
  static std::shared_ptr<NcclCommunicator> world;
  return world;
}
NcclCommunicator& world() { return *world_slot(); }

uint64_t shared_seed() {
  uint64_t mine = test::fresh_seed();
  std::vector<uint64_t> all(static_cast<size_t>(world().size()));
  world().allgather(&mine, sizeof(mine), all.data());
  return all[0];
}

struct DeviceBytes {
  explicit DeviceBytes(size_t n) : size(n) {
    if (cudaMalloc(&ptr, n + 1) != cudaSuccess) throw std::runtime_error("cudaMalloc");
  }
  ~DeviceBytes() { cudaFree(ptr); }
  void* ptr = nullptr;
  size_t size;
};

uint8_t pattern(int32_t src, int32_t dst, int64_t i) { return static_cast<uint8_t>(src * 131 + dst * 31 + i * 7); }

TEST(NcclEngine, AllToAllVRandomCountsLandInPlace) {
  const uint64_t seed = shared_seed();
  const int32_t n = world().size(), me = world().rank();
  for (int round = 0; round < 3; ++round) {
    // counts[src][dst] from the shared seed: every rank knows every pair's count.
    std::mt19937_64 rng(seed + round);
    std::uniform_int_distribution<int64_t> count_of(0, 1 << 16);
    std::vector<std::vector<int64_t>> counts(n, std::vector<int64_t>(n));
    for (auto& row : counts)
      for (auto& c : row) c = count_of(rng);
    std::vector<int64_t> send_counts(n), recv_counts(n), send_displs(n), recv_displs(n);
    int64_t send_total = 0, recv_total = 0;
    for (int32_t r = 0; r < n; ++r) {
      send_counts[r] = counts[me][r];
      recv_counts[r] = counts[r][me];
      send_displs[r] = send_total;
      recv_displs[r] = recv_total;
      send_total += send_counts[r];
      recv_total += recv_counts[r];
    }
    std::vector<uint8_t> host_send(static_cast<size_t>(send_total));
    for (int32_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < send_counts[r]; ++i) host_send[send_displs[r] + i] = pattern(me, r, i);
    DeviceBytes send(static_cast<size_t>(send_total)), recv(static_cast<size_t>(recv_total));
    ASSERT_EQ(cudaMemcpy(send.ptr, host_send.data(), host_send.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(recv.ptr, 0xAB, recv.size), cudaSuccess);
    world().all_to_all_v(send.ptr, send_counts, send_displs, recv.ptr, recv_counts, recv_displs);
    std::vector<uint8_t> got(static_cast<size_t>(recv_total));
    ASSERT_EQ(cudaMemcpy(got.data(), recv.ptr, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int32_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < recv_counts[r]; ++i)
        ASSERT_EQ(got[recv_displs[r] + i], pattern(r, me, i)) << "from rank " << r << " byte " << i << ", seed " << seed;
  }
}

TEST(NcclEngine, AllgatherOfHostAndDeviceBytes) {
  const int32_t n = world().size(), me = world().rank();
  std::vector<int32_t> mine{me * 10, me * 10 + 1, -me};
  std::vector<int32_t> all(static_cast<size_t>(3 * n), -777);
  world().allgather(mine.data(), sizeof(int32_t) * 3, all.data());
  for (int32_t r = 0; r < n; ++r) {
    EXPECT_EQ(all[3 * r], r * 10);
    EXPECT_EQ(all[3 * r + 1], r * 10 + 1);
    EXPECT_EQ(all[3 * r + 2], -r);
  }
  DeviceBytes send(12), recv(static_cast<size_t>(12 * n));
  ASSERT_EQ(cudaMemcpy(send.ptr, mine.data(), 12, cudaMemcpyHostToDevice), cudaSuccess);
  world().allgather(send.ptr, 12, recv.ptr);
  std::vector<int32_t> back(static_cast<size_t>(3 * n), -777);
  ASSERT_EQ(cudaMemcpy(back.data(), recv.ptr, back.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, all);
  world().barrier();
}

TEST(NcclEngine, BadCountsAreInvalidArguments) {
  const int32_t n = world().size();
  std::vector<int64_t> short_list(static_cast<size_t>(n - 1 + 2), 0), zeros(static_cast<size_t>(n), 0);
  short_list.pop_back();
  short_list.pop_back();
  EXPECT_THROW(world().all_to_all_v(nullptr, short_list, zeros, nullptr, zeros, zeros), InvalidArgument);
  std::vector<int64_t> self_send(static_cast<size_t>(n), 0);
  self_send[world().rank()] = 16;  // sends itself 16 bytes but expects none
  EXPECT_THROW(world().all_to_all_v(nullptr, self_send, zeros, nullptr, zeros, zeros), InvalidArgument);
  EXPECT_THROW(world().set_timeout(0.0), InvalidArgument);
  // The public factory validates before NCCL sees anything (so no rank is left waiting).
  EXPECT_THROW(nccl_communicator(NcclUniqueId{}, world().rank(), n, world().cuda_device(), 0.0), InvalidArgument);
  EXPECT_THROW(nccl_communicator(NcclUniqueId{}, n, n, world().cuda_device()), InvalidArgument);
  EXPECT_THROW(nccl_communicator(NcclUniqueId{}, world().rank(), n, -1), InvalidArgument);
}

// ---- A peer that never joins. Each test builds its own communicator, so that the world survives. ----

constexpr double kFaultTimeout = 5.0;

// Rank 0's fresh id, handed to every rank through the world.
NcclUniqueId shared_id() {
  NcclUniqueId mine;
  if (world().rank() == 0) mine = nccl_unique_id();
  std::vector<NcclUniqueId> all(static_cast<size_t>(world().size()));
  world().allgather(&mine, sizeof(mine), all.data());
  return all[0];
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Rank 0 receives 4096 bytes that rank 1 never sends; expects CommError within the timeout.
void expect_rank0_times_out_waiting_for_rank1(Communicator& victim, double limit_seconds) {
  const int32_t n = victim.size();
  DeviceBytes buffer(4096);
  std::vector<int64_t> recv_counts(static_cast<size_t>(n), 0), zeros(static_cast<size_t>(n), 0);
  recv_counts[1] = 4096;
  const auto start = std::chrono::steady_clock::now();
  try {
    victim.all_to_all_v(buffer.ptr, zeros, zeros, buffer.ptr, recv_counts, zeros);
    ADD_FAILURE() << "all_to_all_v returned although rank 1 never sent";
  } catch (const CommError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("all_to_all_v"), std::string::npos) << message;
    EXPECT_NE(message.find("rank 0"), std::string::npos) << message;
    EXPECT_NE(message.find("timeout of 5 s"), std::string::npos) << message;
  }
  EXPECT_LT(seconds_since(start), limit_seconds);
  EXPECT_THROW(victim.barrier(), CommError);  // aborted for good
}

// Every rank but 1 creates the communicator; rank 1 never does.
TEST(NcclEngineFaults, PeerThatNeverJoinsTheInitEndsInCommError) {
  const int32_t n = world().size(), me = world().rank();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  const NcclUniqueId id = shared_id();
  if (me != 1) {
    const auto start = std::chrono::steady_clock::now();
    try {
      nccl_communicator(id, me, n, world().cuda_device(), kFaultTimeout);
      ADD_FAILURE() << "the communicator came up without rank 1";
    } catch (const CommError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("ncclCommInitRankConfig"), std::string::npos) << message;
      EXPECT_NE(message.find("rank " + std::to_string(me)), std::string::npos) << message;
    }
    EXPECT_LT(seconds_since(start), kFaultTimeout + 25.0);
  }
  world().barrier();  // the world is untouched
}

// Rank 1 never joins the first exchange, where NCCL connects the pair (this hung a blocking communicator
// inside ncclGroupEnd on 2 x H200).
TEST(NcclEngineFaults, PeerThatNeverJoinsTheFirstExchangeEndsInCommError) {
  const int32_t n = world().size(), me = world().rank();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  auto victim = nccl_communicator(shared_id(), me, n, world().cuda_device(), kFaultTimeout);
  EXPECT_EQ(victim->rank(), me);
  EXPECT_EQ(victim->size(), n);
  EXPECT_EQ(victim->device().type, DeviceType::CUDA);
  EXPECT_EQ(victim->device().index, world().cuda_device());
  EXPECT_DOUBLE_EQ(victim->timeout(), kFaultTimeout);
  // Either the connection or the receive times out: twice the timeout at most, plus slack.
  if (me == 0) expect_rank0_times_out_waiting_for_rank1(*victim, 2 * kFaultTimeout + 20.0);
  world().barrier();  // rank 1 keeps its communicator until rank 0 has given up
  // The rank that skipped tears down (finalize, or abort at the timeout) without hanging.
  const auto start = std::chrono::steady_clock::now();
  victim.reset();
  EXPECT_LT(seconds_since(start), kFaultTimeout + 20.0) << "rank " << me << " tearing down";
  world().barrier();
}

// The pair is connected first, then rank 1 skips a collective: a device-side wait that the timeout ends.
TEST(NcclEngineFaults, PeerThatSkipsALaterCollectiveEndsInCommError) {
  const int32_t n = world().size(), me = world().rank();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  auto victim = nccl_communicator(shared_id(), me, n, world().cuda_device(), kFaultTimeout);
  {
    DeviceBytes send(static_cast<size_t>(16 * n)), recv(static_cast<size_t>(16 * n));
    std::vector<int64_t> counts(static_cast<size_t>(n), 16), displs(static_cast<size_t>(n));
    for (int32_t r = 0; r < n; ++r) displs[r] = 16 * r;
    victim->all_to_all_v(send.ptr, counts, displs, recv.ptr, counts, displs);
  }
  if (me == 0) expect_rank0_times_out_waiting_for_rank1(*victim, kFaultTimeout + 20.0);
  world().barrier();
  const auto start = std::chrono::steady_clock::now();
  victim.reset();
  EXPECT_LT(seconds_since(start), kFaultTimeout + 20.0) << "rank " << me << " tearing down";
  world().barrier();
}

}  // namespace
}  // namespace magi::comm

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return magi::comm::run_on_local_gpus([](std::shared_ptr<magi::comm::NcclCommunicator> comm) {
    magi::comm::world_slot() = std::move(comm);
    magi::comm::world().set_timeout(120.0);
    const int rank = magi::comm::world().rank();
    if (rank != 0) GTEST_FLAG_SET(brief, true);  // other ranks print their failures only
    const bool ok = RUN_ALL_TESTS() == 0;
    if (!ok) std::fprintf(stderr, "[rank %d] failed\n", rank);
    magi::comm::world_slot().reset();
    return ok ? 0 : 1;
  });
}
