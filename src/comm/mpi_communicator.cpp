// The MPI engine: host buffers, non-blocking collectives, a deadline on every wait.
//
// OpenMPI progresses a non-blocking collective only inside MPI calls. While the caller computes (the
// whole point of overlap) nobody would call MPI, so a helper thread polls the requests in flight. MPI is
// then used from two threads, never at the same time: one process-wide mutex serialises every call, which
// is what MPI_THREAD_SERIALIZED allows.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <list>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "magi/comm.hpp"

namespace magi::comm {
namespace {

std::mutex& mpi_mutex() {
  static std::mutex mutex;
  return mutex;
}

void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw CommError(std::string("MPI ") + call + " failed: " + std::string(text, static_cast<size_t>(length)));
}

bool mpi_initialized() {
  int flag = 0;
  MPI_Initialized(&flag);
  int finalized = 0;
  MPI_Finalized(&finalized);
  return flag && !finalized;
}

bool progress_thread_allowed() {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  return provided >= MPI_THREAD_SERIALIZED;
}

// One MPI request plus its completion state, shared by the waiter and the progress thread.
struct InFlight {
  MPI_Request request = MPI_REQUEST_NULL;
  std::atomic<bool> done = false;
  int error = MPI_SUCCESS;
  MPI_Datatype unit = MPI_DATATYPE_NULL;  // freed on completion
};

// Polls every registered request until it completes. Calls MPI only under mpi_mutex().
class ProgressThread {
 public:
  ProgressThread() : thread_([this] { run(); }) {}
  ~ProgressThread() {
    {
      std::lock_guard lock(state_mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  void add(std::shared_ptr<InFlight> op) {
    {
      std::lock_guard lock(state_mutex_);
      ops_.push_back(std::move(op));
    }
    wake_.notify_all();
  }

 private:
  void run() {
    std::unique_lock lock(state_mutex_);
    while (true) {
      wake_.wait(lock, [this] { return stop_ || !ops_.empty(); });
      if (stop_) return;
      auto ops = ops_;
      lock.unlock();
      {
        std::lock_guard mpi(mpi_mutex());
        for (auto& op : ops) test_locked(*op);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      lock.lock();
      ops_.remove_if([](const std::shared_ptr<InFlight>& op) { return op->done.load(); });
    }
  }

 public:
  // Requires mpi_mutex() held.
  static void test_locked(InFlight& op) {
    if (op.done) return;
    int flag = 0;
    op.error = MPI_Test(&op.request, &flag, MPI_STATUS_IGNORE);
    if (op.error != MPI_SUCCESS || flag) {
      if (op.unit != MPI_DATATYPE_NULL) MPI_Type_free(&op.unit);
      op.done = true;
    }
  }

 private:
  std::mutex state_mutex_;
  std::condition_variable wake_;
  std::list<std::shared_ptr<InFlight>> ops_;
  bool stop_ = false;
  std::thread thread_;
};

class MpiRequest final : public Request {
 public:
  MpiRequest(std::shared_ptr<InFlight> op, double timeout, std::string what)
      : op_(std::move(op)), timeout_(timeout), what_(std::move(what)) {}
  ~MpiRequest() override {
    if (waited_) return;
    try {
      wait();
    } catch (...) {
      // A destructor must not throw; the caller that wanted the error calls wait() itself.
    }
  }

  void wait() override {
    if (waited_) return;
    waited_ = true;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_);
    while (true) {
      {
        std::lock_guard mpi(mpi_mutex());
        ProgressThread::test_locked(*op_);
        if (op_->done) break;
      }
      if (std::chrono::steady_clock::now() > deadline)
        throw CommError(what_ + " did not complete within " + std::to_string(timeout_) +
                        " s (a rank diverged, died, or passed mismatched counts)");
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    check_mpi(op_->error, what_.c_str());
  }

 private:
  std::shared_ptr<InFlight> op_;
  double timeout_;
  std::string what_;
  bool waited_ = false;
};

// MPI counts are int: move bytes in units of the largest power of two (<= 4 KiB) dividing every count and
// displacement, so multi-GiB exchanges of whole rows still fit.
int64_t common_unit(std::initializer_list<std::span<const int64_t>> lists) {
  int64_t unit = 4096;
  for (auto list : lists)
    for (int64_t value : list)
      while (unit > 1 && value % unit != 0) unit /= 2;
  return unit;
}

std::vector<int> in_units(std::span<const int64_t> bytes, int64_t unit, const char* what) {
  std::vector<int> out(bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) {
    const int64_t n = bytes[i] / unit;
    if (bytes[i] < 0 || n > INT_MAX)
      throw CommError(std::string("all_to_all_v: ") + what + "[" + std::to_string(i) + "] = " +
                      std::to_string(bytes[i]) + " bytes is negative or too large for MPI");
    out[i] = static_cast<int>(n);
  }
  return out;
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm parent) {
    if (!mpi_initialized())
      throw InvalidArgument("MPI communicator: MPI is not initialised (create a magi::comm::MpiEnvironment or "
                            "call MPI_Init first)");
    std::lock_guard mpi(mpi_mutex());
    check_mpi(MPI_Comm_dup(parent, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    ranks_per_node_ = uniform_node_size();
    if (progress_thread_allowed()) progress_ = std::make_unique<ProgressThread>();
  }
  ~MpiCommunicator() override {
    progress_.reset();
    if (mpi_initialized()) {
      std::lock_guard mpi(mpi_mutex());
      MPI_Comm_free(&comm_);
    }
  }

  int32_t ranks_per_node() const override { return ranks_per_node_; }
  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  Device device() const override { return Device{DeviceType::CPU, 0}; }
  std::string describe() const override { return "mpi:" + std::to_string(size_); }

  std::unique_ptr<Request> start_all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                              std::span<const int64_t> send_displs, void* recv,
                                              std::span<const int64_t> recv_counts,
                                              std::span<const int64_t> recv_displs) override {
    const auto n = static_cast<size_t>(size_);
    if (send_counts.size() != n || send_displs.size() != n || recv_counts.size() != n || recv_displs.size() != n)
      throw InvalidArgument("all_to_all_v: counts and displacements need one entry per rank (" +
                            std::to_string(n) + ")");
    const int64_t unit = common_unit({send_counts, send_displs, recv_counts, recv_displs});
    const auto sc = in_units(send_counts, unit, "send_counts"), sd = in_units(send_displs, unit, "send_displs");
    const auto rc = in_units(recv_counts, unit, "recv_counts"), rd = in_units(recv_displs, unit, "recv_displs");
    auto op = std::make_shared<InFlight>();
    {
      std::lock_guard mpi(mpi_mutex());
      check_mpi(MPI_Type_contiguous(static_cast<int>(unit), MPI_BYTE, &op->unit), "MPI_Type_contiguous");
      MPI_Type_commit(&op->unit);
      // MPI copies the count arrays at the call, so the local vectors may go.
      const int code = MPI_Ialltoallv(send, sc.data(), sd.data(), op->unit, recv, rc.data(), rd.data(), op->unit,
                                      comm_, &op->request);
      if (code != MPI_SUCCESS) MPI_Type_free(&op->unit);
      check_mpi(code, "MPI_Ialltoallv");
    }
    if (progress_) progress_->add(op);
    return std::make_unique<MpiRequest>(std::move(op), timeout(), "all_to_all_v on " + describe());
  }

  void allgather(const void* send, int64_t bytes, void* recv) override {
    if (bytes < 0 || bytes > INT_MAX) throw CommError("allgather: " + std::to_string(bytes) + " bytes per rank");
    auto op = std::make_shared<InFlight>();
    {
      std::lock_guard mpi(mpi_mutex());
      check_mpi(MPI_Iallgather(send, static_cast<int>(bytes), MPI_BYTE, recv, static_cast<int>(bytes), MPI_BYTE,
                               comm_, &op->request),
                "MPI_Iallgather");
    }
    MpiRequest(std::move(op), timeout(), "allgather on " + describe()).wait();
  }

  void barrier() override {
    auto op = std::make_shared<InFlight>();
    {
      std::lock_guard mpi(mpi_mutex());
      check_mpi(MPI_Ibarrier(comm_, &op->request), "MPI_Ibarrier");
    }
    MpiRequest(std::move(op), timeout(), "barrier on " + describe()).wait();
  }

 private:
  // Shared-memory groups: their size if all are equal and made of consecutive ranks, else 0.
  // Collective; called with mpi_mutex() held during construction.
  int32_t uniform_node_size() {
    MPI_Comm node = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
    int node_rank = 0, node_size = 1;
    MPI_Comm_rank(node, &node_rank);
    MPI_Comm_size(node, &node_size);
    MPI_Comm_free(&node);
    const int mine[2] = {node_size, rank_ - node_rank};  // size, first rank of my node
    std::vector<int> all(static_cast<size_t>(2 * size_));
    check_mpi(MPI_Allgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, comm_), "MPI_Allgather");
    for (int r = 0; r < size_; ++r)
      if (all[2 * r] != node_size || all[2 * r + 1] != r / node_size * node_size) return 0;
    return node_size;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int32_t ranks_per_node_ = 0;
  int rank_ = 0;
  int size_ = 1;
  std::unique_ptr<ProgressThread> progress_;
};

}  // namespace

MpiEnvironment::MpiEnvironment(int* argc, char*** argv) {
  if (mpi_initialized()) return;
  int provided = 0;
  check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
  owns_ = true;
}

MpiEnvironment::~MpiEnvironment() {
  if (owns_ && mpi_initialized()) MPI_Finalize();
}

std::shared_ptr<Communicator> mpi_world() { return std::make_shared<MpiCommunicator>(MPI_COMM_WORLD); }

std::shared_ptr<Communicator> mpi_communicator(const void* mpi_comm) {
  if (mpi_comm == nullptr) throw InvalidArgument("mpi_communicator: mpi_comm must point to an MPI_Comm");
  return std::make_shared<MpiCommunicator>(*static_cast<const MPI_Comm*>(mpi_comm));
}

}  // namespace magi::comm
