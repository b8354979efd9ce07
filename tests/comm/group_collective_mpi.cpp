// The MPI engine and the group collectives under mpirun (cp = the number of ranks).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <random>
#include <cstring>
#include <thread>

#include "comm/elements.hpp"
#include "comm/group_collective.hpp"
#include "common/lse_merge.hpp"
#include "comm/mpi_test_main.hpp"

namespace magi::comm {
namespace {

using test::world;

// Identical on every rank: which rows of each owner every rank receives in one cast.
std::vector<RowRoutes> random_routes(std::mt19937_64& rng, int32_t cp, int32_t table_rows) {
  std::vector<RowRoutes> routes(static_cast<size_t>(cp));
  for (auto& r : routes) {
    r.send_rows.assign(static_cast<size_t>(cp), {});
    r.recv_rows.assign(static_cast<size_t>(cp), 0);
  }
  for (int32_t owner = 0; owner < cp; ++owner)
    for (int32_t dst = 0; dst < cp; ++dst) {
      const int32_t n = std::uniform_int_distribution<int32_t>(0, table_rows)(rng);
      for (int32_t i = 0; i < n; ++i)
        routes[owner].send_rows[dst].push_back(std::uniform_int_distribution<int32_t>(0, table_rows - 1)(rng));
      routes[dst].recv_rows[owner] = n;
    }
  return routes;
}

// Value of element e of row `row` of `rank`'s table: exact in every dtype used below.
// At most 8 significant bits (rows < 64, ranks < 4), so bf16 holds it exactly.
// Distinct per (rank, row); bf16 holds them only after rounding (they exceed 256 at cp >= 4).
double table_value(int32_t rank, int32_t row, int64_t e) { return (rank * 64 + row) * (1.0 + static_cast<double>(e % 2)); }

TEST(MpiEngine, AllToAllVMovesEveryByteToTheRightPlace) {
  const int32_t cp = world().size(), me = world().rank();
  std::mt19937_64 rng(test::shared_seed());
  std::vector<std::vector<int64_t>> counts(static_cast<size_t>(cp), std::vector<int64_t>(static_cast<size_t>(cp)));
  for (auto& row : counts)
    for (auto& c : row) c = std::uniform_int_distribution<int64_t>(0, 5000)(rng);  // odd byte counts too
  std::vector<int64_t> send_counts(static_cast<size_t>(cp)), send_displs(static_cast<size_t>(cp)),
      recv_counts(static_cast<size_t>(cp)), recv_displs(static_cast<size_t>(cp));
  int64_t send_total = 0, recv_total = 0;
  for (int32_t r = 0; r < cp; ++r) {
    send_counts[r] = counts[me][r];
    send_displs[r] = send_total;
    send_total += send_counts[r];
    recv_counts[r] = counts[r][me];
    recv_displs[r] = recv_total;
    recv_total += recv_counts[r];
  }
  std::vector<uint8_t> send(static_cast<size_t>(send_total)), recv(static_cast<size_t>(recv_total), 0xAB);
  for (int32_t r = 0; r < cp; ++r)
    for (int64_t i = 0; i < send_counts[r]; ++i) send[send_displs[r] + i] = static_cast<uint8_t>(me * 31 + r * 7 + i);
  world().all_to_all_v(send.data(), send_counts, send_displs, recv.data(), recv_counts, recv_displs);
  for (int32_t r = 0; r < cp; ++r)
    for (int64_t i = 0; i < recv_counts[r]; ++i)
      ASSERT_EQ(recv[recv_displs[r] + i], static_cast<uint8_t>(r * 31 + me * 7 + i)) << "from rank " << r;
}

TEST(GroupCollectives, CastDeliversRowsAndReduceSumsThemBackInOrder) {
  const int32_t cp = world().size(), me = world().rank();
  const uint64_t seed = test::shared_seed();
  std::mt19937_64 rng(seed);
  const int32_t rows = 37, elems = 24;
  for (DType dtype : {DType::F32, DType::BF16, DType::F64}) {
    const auto routes = random_routes(rng, cp, rows);
    std::vector<std::byte> table(static_cast<size_t>(rows * elems * dtype_size(dtype)));
    for (int32_t r = 0; r < rows; ++r)
      for (int64_t e = 0; e < elems; ++e) store_element(dtype, table.data(), r * elems + e, table_value(me, r, e));
    const int64_t row_bytes = elems * dtype_size(dtype);
    std::vector<std::byte> recv(static_cast<size_t>(routes[me].total_recv_rows() * row_bytes));
    GroupCast cast(world(), routes[me], table.data(), row_bytes, recv.data());
    cast.wait();
    int64_t at = 0;
    for (int32_t src = 0; src < cp; ++src)
      for (int32_t row : routes[src].send_rows[me]) {
        for (int64_t e = 0; e < elems; ++e)
          ASSERT_EQ(load_element(dtype, recv.data(), at * elems + e), round_to(dtype, table_value(src, row, e)))
              << "seed " << seed << " dtype " << to_string(dtype);
        ++at;
      }
    // Send the received rows back, doubled: each owner row gains 2 x its value per copy it sent out.
    for (int64_t i = 0; i < at * elems; ++i) store_element(dtype, recv.data(), i, 2 * load_element(dtype, recv.data(), i));
    GroupReduce reduce(world(), routes[me], recv.data(), row_bytes);
    std::vector<double> accum(static_cast<size_t>(rows * elems), 1.0);
    reduce.finish_sum(dtype, elems, accum.data());
    std::vector<int> copies(static_cast<size_t>(rows), 0);
    for (const auto& list : routes[me].send_rows)
      for (int32_t row : list) ++copies[row];
    for (int32_t r = 0; r < rows; ++r)
      for (int64_t e = 0; e < elems; ++e)
        ASSERT_EQ(accum[r * elems + e], 1.0 + 2.0 * copies[r] * round_to(dtype, table_value(me, r, e)))
            << "seed " << seed;
  }
}

TEST(GroupCollectives, ReduceLseMergeMatchesSequentialMerges) {
  const int32_t cp = world().size(), me = world().rank();
  const uint64_t seed = test::shared_seed();
  std::mt19937_64 rng(seed);
  const int32_t rows = 21, heads = 2, dim = 8;
  const auto routes = random_routes(rng, cp, rows);
  const int64_t row_bytes = heads * dim * 4 + heads * 4;
  // Partial (out, lse) that rank `src` computed for entry i of its receive list from `owner` (some empty).
  const auto partial = [&](int32_t src, int32_t owner, int64_t i, int32_t h, int32_t d, double* lse) {
    *lse = (src + owner + i + h) % 5 == 0 ? -INFINITY : std::sin(src * 7.0 + owner * 3.0 + i + h);
    return std::cos(src + owner * 5.0 + i * 0.5 + h * 3 + d);
  };
  std::vector<std::byte> partials(static_cast<size_t>(routes[me].total_recv_rows() * row_bytes));
  int64_t at = 0;
  for (int32_t owner = 0; owner < cp; ++owner)
    for (int64_t i = 0; i < routes[me].recv_rows[owner]; ++i, ++at)
      for (int32_t h = 0; h < heads; ++h) {
        double lse = 0;
        for (int32_t d = 0; d < dim; ++d)
          store_element(DType::F32, partials.data() + at * row_bytes, h * dim + d, partial(me, owner, i, h, d, &lse));
        const float l = static_cast<float>(lse);
        std::memcpy(partials.data() + at * row_bytes + heads * dim * 4 + h * 4, &l, 4);
      }
  std::vector<double> out(static_cast<size_t>(rows * heads * dim), 0.5), lse(static_cast<size_t>(rows * heads), 0.0);
  auto expected_out = out;
  auto expected_lse = lse;
  for (int32_t src = 0; src < cp; ++src)
    for (size_t i = 0; i < routes[me].send_rows[src].size(); ++i) {
      const int32_t row = routes[me].send_rows[src][i];
      for (int32_t h = 0; h < heads; ++h) {
        double part_lse = 0;
        std::vector<double> part(dim);
        for (int32_t d = 0; d < dim; ++d) {
          // volatile: GCC 12 at -O3 was seen to drop this float rounding in a vectorised loop.
          const volatile float value = static_cast<float>(partial(src, me, static_cast<int64_t>(i), h, d, &part_lse));
          part[d] = value;
        }
        const auto w = merge_weights<double>(expected_lse[row * heads + h], static_cast<float>(part_lse));
        for (int32_t d = 0; d < dim; ++d) {
          double& o = expected_out[(row * heads + h) * dim + d];
          o = (w.w1 == 0 ? 0.0 : w.w1 * o) + (w.w2 == 0 ? 0.0 : w.w2 * part[d]);
        }
        expected_lse[row * heads + h] = w.lse;
      }
    }
  GroupReduce reduce(world(), routes[me], partials.data(), row_bytes);
  reduce.finish_lse_merge(DType::F32, DType::F32, heads, dim, out.data(), lse.data());
  // Same operations in the same order; the library may contract a * b + c into an FMA, so not bitwise.
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], expected_out[i], 1e-12) << "seed " << seed << " at " << i;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(expected_lse[i])) ASSERT_EQ(lse[i], expected_lse[i]) << "seed " << seed;
    else ASSERT_NEAR(lse[i], expected_lse[i], 1e-12) << "seed " << seed << " at " << i;
  }
}

TEST(MpiEngine, MismatchedFingerprintFailsOnEveryRank) {
  const int32_t me = world().rank();
  EXPECT_NO_THROW(require_same_on_all_ranks(world(), 42, "test value"));
  if (world().size() > 1) EXPECT_THROW(require_same_on_all_ranks(world(), me == 1 ? 7 : 42, "test value"), InvalidArgument);
}

TEST(MpiEngine, AMissingRankEndsInCommErrorNotAHang) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  auto comm = mpi_world();
  comm->set_timeout(0.5);
  const auto start = std::chrono::steady_clock::now();
  if (comm->rank() == 0) {
    // Rank 0 is late: the others time out, then rank 0 joins so the barrier completes everywhere.
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    comm->set_timeout(60);
    EXPECT_NO_THROW(comm->barrier());
  } else {
    EXPECT_THROW(comm->barrier(), CommError);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1.4);
  }
  world().barrier();
}

TEST(MpiEngine, ExchangesProgressWhileARankComputes) {
  // Overlap needs an exchange to advance while its caller is busy outside MPI (the engine's progress
  // thread). Rank 0 starts a large exchange and then "computes" for 1.5 s without MPI calls; the other
  // ranks must have their data long before that.
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  const int32_t cp = world().size(), me = world().rank();
  const int64_t bytes = int64_t{16} << 20;
  std::vector<char> send(static_cast<size_t>(bytes * cp), static_cast<char>(me + 1)), recv(send.size(), 0);
  std::vector<int64_t> counts(static_cast<size_t>(cp), bytes), displs(static_cast<size_t>(cp));
  for (int32_t r = 0; r < cp; ++r) displs[r] = r * bytes;
  world().barrier();
  const auto start = std::chrono::steady_clock::now();
  auto request = world().start_all_to_all_v(send.data(), counts, displs, recv.data(), counts, displs);
  if (me == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  request->wait();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (me != 0) EXPECT_LT(seconds, 1.0) << "the exchange waited for rank 0 to call MPI again";
  for (int32_t r = 0; r < cp; ++r) ASSERT_EQ(recv[static_cast<size_t>(r * bytes + bytes - 1)], static_cast<char>(r + 1));
}

TEST(MpiEngine, RejectsBadArguments) {
  EXPECT_THROW(world().set_timeout(0), InvalidArgument);
  std::vector<int64_t> wrong(static_cast<size_t>(world().size()) + 1, 0);
  EXPECT_THROW(world().start_all_to_all_v(nullptr, wrong, wrong, nullptr, wrong, wrong), InvalidArgument);
}

}  // namespace
}  // namespace magi::comm
