// The NCCL engine on device memory, one process per GPU (forked, or under mpirun): all-to-all-v with
// random per-pair counts, allgather of host and device bytes, argument errors, and a peer that never
// joins a collective (timeout -> CommError, communicator aborted, never a hang).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
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
}

// DISABLED: on 2 x H200 (2026-11-22) this hung in ncclGroupEnd: NCCL connects peers lazily on their first
// send/recv, and with a blocking communicator that handshake waits on the host, outside the timeout (the
// timeout covers device-side waits only). The exchange below now connects the pair first; enable once it
// has run on a GPU machine, or once the engine uses non-blocking communicators (ncclConfig_t::blocking = 0).
TEST(NcclEngine, DISABLED_PeerThatNeverJoinsEndsInCommErrorNotAHang) {
  const int32_t n = world().size(), me = world().rank();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  // A separate communicator, so that the world survives the abort.
  std::array<char, sizeof(ncclUniqueId)> id_bytes{};
  if (me == 0) {
    const ncclUniqueId id = nccl_unique_id();
    std::memcpy(id_bytes.data(), &id, sizeof(id));
  }
  std::vector<char> all(sizeof(ncclUniqueId) * n);
  world().allgather(id_bytes.data(), sizeof(ncclUniqueId), all.data());
  ncclUniqueId id;
  std::memcpy(&id, all.data(), sizeof(id));
  auto victim = nccl_communicator(id, me, n, world().cuda_device());
  victim->set_timeout(2.0);
  {  // connect every pair once, so that the hang below is a device-side wait
    DeviceBytes send(static_cast<size_t>(16 * n)), recv(static_cast<size_t>(16 * n));
    std::vector<int64_t> counts(static_cast<size_t>(n), 16), displs(static_cast<size_t>(n));
    for (int32_t r = 0; r < n; ++r) displs[r] = 16 * r;
    victim->all_to_all_v(send.ptr, counts, displs, recv.ptr, counts, displs);
  }
  if (me == 0) {
    DeviceBytes buffer(4096);
    std::vector<int64_t> recv_counts(static_cast<size_t>(n), 0), zeros(static_cast<size_t>(n), 0);
    recv_counts[1] = 4096;  // rank 1 never sends
    const auto start = std::chrono::steady_clock::now();
    EXPECT_THROW(victim->all_to_all_v(buffer.ptr, zeros, zeros, buffer.ptr, recv_counts, zeros), CommError);
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(waited, 30.0);
    EXPECT_THROW(victim->barrier(), CommError);  // aborted for good
  }
  victim->abort();
  victim.reset();
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
