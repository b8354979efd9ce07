// The NCCL engine: see nccl_communicator.hpp.
#include "comm/nccl_communicator.hpp"
#include "cuda/check.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <thread>
#include <vector>

#if MAGI_ATTN_WITH_MPI
#include <mpi.h>
#endif

// Non-blocking communicators (ncclConfig_t::blocking, ncclInProgress) arrived in NCCL 2.14.
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "the NCCL engine needs NCCL >= 2.14 (non-blocking communicators)"
#endif

namespace magi::comm {

static_assert(sizeof(ncclUniqueId) == sizeof(NcclUniqueId::bytes), "NcclUniqueId must hold an ncclUniqueId");

namespace {

std::string seconds_text(double seconds) {
  std::ostringstream text;
  text << seconds << " s";
  return text.str();
}

ncclUniqueId to_nccl_id(const NcclUniqueId& id) {
  ncclUniqueId nccl;
  std::memcpy(&nccl, id.bytes.data(), sizeof(nccl));
  return nccl;
}

void check_cuda(cudaError_t code, const char* call) { cuda::check<CommError>(code, call); }

std::string nccl_message(ncclResult_t code, ncclComm_t comm) {
  std::string text = ncclGetErrorString(code);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += std::string(" (") + last + ")";
  return text;
}

void require_entries(std::span<const int64_t> list, size_t n, const char* what) {
  if (list.size() != n)
    throw InvalidArgument(std::string("all_to_all_v: ") + what + " needs one entry per rank (" + std::to_string(n) +
                          "), got " + std::to_string(list.size()));
  for (int64_t v : list)
    if (v < 0) throw InvalidArgument(std::string("all_to_all_v: ") + what + " must be >= 0");
}

// A blocking request: an event recorded on the comm stream after the exchange.
class NcclRequest final : public Request {
 public:
  NcclRequest(NcclCommunicator& comm, std::string what) : comm_(comm), what_(std::move(what)) {
    check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(event_, comm.comm_stream()), "cudaEventRecord");
  }
  ~NcclRequest() override {
    if (!waited_) {
      try {
        wait();
      } catch (...) {
        // A destructor must not throw; callers that want the error call wait() themselves.
      }
    }
    cudaEventDestroy(event_);
  }
  void wait() override {
    if (waited_) return;
    waited_ = true;
    comm_.wait_event(event_, what_);
  }

 private:
  NcclCommunicator& comm_;
  std::string what_;
  cudaEvent_t event_ = nullptr;
  bool waited_ = false;
};

}  // namespace

NcclCommunicator::NcclCommunicator(const ncclUniqueId& id, int32_t rank, int32_t size, int32_t device,
                                   double timeout_seconds)
    : rank_(rank), size_(size), device_(device) {
  if (size < 1 || rank < 0 || rank >= size)
    throw InvalidArgument("nccl communicator: need 0 <= rank < size, got rank " + std::to_string(rank) + ", size " +
                          std::to_string(size));
  set_timeout(timeout_seconds);
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess || version < NCCL_VERSION(2, 14, 0))
    throw NotAvailable("nccl communicator: needs NCCL >= 2.14 at run time (non-blocking communicators), loaded " +
                       std::to_string(version));
  int devices = 0;
  check_cuda(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  if (device < 0 || device >= devices)
    throw InvalidArgument("nccl communicator: device must be in [0, " + std::to_string(devices) + "), got " +
                          std::to_string(device));
  cuda::DeviceGuard scope(device_);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t code = ncclCommInitRankConfig(&comm_, size, id, rank, &config);
  if (comm_ == nullptr)
    throw CommError("ncclCommInitRankConfig on " + where() + " failed: " + nccl_message(code, nullptr));
  // Every rank must join the init: one that never does ends here, at the timeout.
  await_launch(code, "ncclCommInitRankConfig");
  const cudaError_t stream_code = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
  if (stream_code != cudaSuccess) abort_and_throw(std::string("cudaStreamCreate: ") + cudaGetErrorString(stream_code));
}

NcclCommunicator::~NcclCommunicator() {
  int previous = -1;
  const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_ && cudaSetDevice(device_) == cudaSuccess;
  if (!aborted_) {
    try {
      // Pending work, then NCCL's own flush, each within the timeout: a peer that left must not hang us.
      cudaEvent_t drained = nullptr;
      check_cuda(cudaEventCreateWithFlags(&drained, cudaEventDisableTiming), "cudaEventCreate");
      const cudaError_t recorded = cudaEventRecord(drained, stream_);
      if (recorded == cudaSuccess) wait_event(drained, "draining the comm stream before destruction");
      cudaEventDestroy(drained);
      check_cuda(recorded, "cudaEventRecord");
      await_launch(ncclCommFinalize(comm_), "ncclCommFinalize");
      ncclCommDestroy(comm_);
    } catch (...) {
      abort();  // a destructor must not throw; the failing step already aborted, or this does
    }
  }
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (switched) cudaSetDevice(previous);
}

std::string NcclCommunicator::where() const { return "rank " + std::to_string(rank_) + " of " + describe(); }

void NcclCommunicator::abort() {
  if (aborted_) return;
  aborted_ = true;
  // Local and blocking even for a non-blocking communicator; ends NCCL's helper threads and kernels.
  ncclCommAbort(comm_);
}

void NcclCommunicator::abort_and_throw(const std::string& message) {
  abort();
  throw CommError(message);
}

void NcclCommunicator::check_async_error(const std::string& what) {
  if (aborted_) throw CommError(what + ": the communicator was aborted by an earlier error");
  ncclResult_t async = ncclSuccess;
  const ncclResult_t code = ncclCommGetAsyncError(comm_, &async);
  if (code != ncclSuccess) abort_and_throw(what + ": ncclCommGetAsyncError failed: " + nccl_message(code, comm_));
  if (async != ncclSuccess && async != ncclInProgress)
    abort_and_throw(what + " failed on " + where() + ": " + nccl_message(async, comm_));
}

void NcclCommunicator::await_launch(ncclResult_t code, const std::string& what) {
  if (aborted_) throw CommError(what + ": the communicator was aborted by an earlier error");
  if (code != ncclSuccess && code != ncclInProgress)
    abort_and_throw(what + " on " + where() + " failed: " + nccl_message(code, comm_));
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::duration<double>(timeout());
  // Launches settle in microseconds (yield, as CUDA's own synchronisation does, for the first millisecond:
  // a sleep overshoots by its timer slack, and the compute stream's next kernel waits for this), connecting
  // peers takes milliseconds: then back off to 1 ms sleeps.
  auto pause = std::chrono::microseconds(1);
  while (true) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t query = ncclCommGetAsyncError(comm_, &state);
    if (query != ncclSuccess)
      abort_and_throw(what + " on " + where() + ": ncclCommGetAsyncError failed: " + nccl_message(query, comm_));
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) abort_and_throw(what + " failed on " + where() + ": " + nccl_message(state, comm_));
    if (std::chrono::steady_clock::now() > deadline)
      abort_and_throw(what + " on " + where() + " did not get going within the timeout of " + seconds_text(timeout()) +
                      " (a peer never joined it: it skipped this call, diverged or died); communicator aborted");
    if (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(1)) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

void NcclCommunicator::wait_event(cudaEvent_t event, const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout());
  while (true) {
    const cudaError_t state = cudaEventQuery(event);
    if (state == cudaSuccess) break;
    if (state != cudaErrorNotReady) abort_and_throw(what + ": " + cudaGetErrorString(state));
    check_async_error(what);
    if (std::chrono::steady_clock::now() > deadline)
      abort_and_throw(what + " on " + where() + " did not complete within the timeout of " + seconds_text(timeout()) +
                      " (a rank diverged, died, or passed mismatched counts); communicator aborted");
    std::this_thread::yield();  // as cudaEventSynchronize does by default: a sleep adds its timer slack to every call
  }
  check_async_error(what);
}

void NcclCommunicator::enqueue_all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                            std::span<const int64_t> send_displs, void* recv,
                                            std::span<const int64_t> recv_counts,
                                            std::span<const int64_t> recv_displs, cudaStream_t stream) {
  const auto n = static_cast<size_t>(size_);
  require_entries(send_counts, n, "send_counts");
  require_entries(send_displs, n, "send_displs");
  require_entries(recv_counts, n, "recv_counts");
  require_entries(recv_displs, n, "recv_displs");
  if (aborted_) throw CommError("all_to_all_v: the communicator was aborted by an earlier error");
  cuda::DeviceGuard scope(device_);
  const auto* src = static_cast<const char*>(send);
  auto* dst = static_cast<char*>(recv);
  // Our own share is a device copy: no NCCL channel needed.
  if (send_counts[rank_] != recv_counts[rank_])
    throw InvalidArgument("all_to_all_v: this rank sends itself " + std::to_string(send_counts[rank_]) +
                          " bytes but expects " + std::to_string(recv_counts[rank_]));
  if (send_counts[rank_] > 0)
    check_cuda(cudaMemcpyAsync(dst + recv_displs[rank_], src + send_displs[rank_],
                               static_cast<size_t>(send_counts[rank_]), cudaMemcpyDeviceToDevice, stream),
               "cudaMemcpyAsync");
  bool any = false;
  for (size_t r = 0; r < n; ++r) any = any || (r != static_cast<size_t>(rank_) && (send_counts[r] || recv_counts[r]));
  if (!any) return;
  ncclResult_t code = ncclGroupStart();
  for (int32_t r = 0; r < size_ && code == ncclSuccess; ++r) {
    if (r == rank_) continue;
    if (send_counts[r] > 0)
      code = ncclSend(src + send_displs[r], static_cast<size_t>(send_counts[r]), ncclUint8, r, comm_, stream);
    if (code == ncclSuccess && recv_counts[r] > 0)
      code = ncclRecv(dst + recv_displs[r], static_cast<size_t>(recv_counts[r]), ncclUint8, r, comm_, stream);
  }
  const ncclResult_t end = ncclGroupEnd();
  if (code != ncclSuccess) abort_and_throw("all_to_all_v on " + where() + ": " + nccl_message(code, comm_));
  // The first exchange with a peer connects to it here: a peer that never joins times out.
  await_launch(end, "all_to_all_v");
}

void NcclCommunicator::enqueue_allgather(const void* send, int64_t bytes, void* recv, cudaStream_t stream) {
  if (bytes < 0) throw InvalidArgument("allgather: bytes must be >= 0");
  if (aborted_) throw CommError("allgather: the communicator was aborted by an earlier error");
  if (bytes == 0) return;
  cuda::DeviceGuard scope(device_);
  await_launch(ncclAllGather(send, recv, static_cast<size_t>(bytes), ncclUint8, comm_, stream), "allgather");
}

// The blocking interface takes no stream: its work on the (non-blocking) comm stream starts after what the
// caller left on the legacy default stream (a cudaMemset or kernel launch without a stream), as a blocking call
// on the default stream would.
void NcclCommunicator::after_default_stream() {
  cuda::DeviceGuard scope(device_);
  cudaEvent_t event = nullptr;
  check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  check_cuda(cudaEventRecord(event, cudaStreamLegacy), "cudaEventRecord");
  const cudaError_t code = cudaStreamWaitEvent(stream_, event, 0);
  cudaEventDestroy(event);
  check_cuda(code, "cudaStreamWaitEvent");
}

std::unique_ptr<Request> NcclCommunicator::start_all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                                              std::span<const int64_t> send_displs, void* recv,
                                                              std::span<const int64_t> recv_counts,
                                                              std::span<const int64_t> recv_displs) {
  after_default_stream();
  enqueue_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, stream_);
  cuda::DeviceGuard scope(device_);
  return std::make_unique<NcclRequest>(*this, "all_to_all_v");
}

void NcclCommunicator::allgather(const void* send, int64_t bytes, void* recv) {
  if (bytes < 0) throw InvalidArgument("allgather: bytes must be >= 0");
  if (bytes == 0) return;
  cuda::DeviceGuard scope(device_);
  cudaPointerAttributes attributes{};
  const bool on_device = cudaPointerGetAttributes(&attributes, send) == cudaSuccess &&
                         attributes.type == cudaMemoryTypeDevice;
  cudaGetLastError();  // a host pointer may leave an error behind on older runtimes
  if (on_device) {
    after_default_stream();
    enqueue_allgather(send, bytes, recv, stream_);
  } else {
    // Host bytes (fingerprints, flags, timings): through a device scratch buffer.
    void* scratch = nullptr;
    const size_t total = static_cast<size_t>(bytes) * static_cast<size_t>(size_ + 1);
    check_cuda(cudaMalloc(&scratch, total), "cudaMalloc");
    auto* base = static_cast<char*>(scratch);
    try {
      check_cuda(cudaMemcpyAsync(base, send, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream_),
                 "cudaMemcpyAsync");
      enqueue_allgather(base, bytes, base + bytes, stream_);
      check_cuda(cudaMemcpyAsync(recv, base + bytes, static_cast<size_t>(bytes) * size_, cudaMemcpyDeviceToHost, stream_),
                 "cudaMemcpyAsync");
      NcclRequest(*this, "allgather").wait();
    } catch (...) {
      if (!aborted_) cudaFree(scratch);
      throw;
    }
    cudaFree(scratch);
    return;
  }
  NcclRequest(*this, "allgather").wait();
}

void NcclCommunicator::barrier() {
  int32_t token = rank_;
  std::vector<int32_t> all(static_cast<size_t>(size_));
  allgather(&token, sizeof(token), all.data());
}

NcclUniqueId nccl_unique_id() {
  ncclUniqueId id;
  const ncclResult_t code = ncclGetUniqueId(&id);
  if (code != ncclSuccess) throw CommError("ncclGetUniqueId failed: " + nccl_message(code, nullptr));
  NcclUniqueId bytes;
  std::memcpy(bytes.bytes.data(), &id, sizeof(id));
  return bytes;
}

std::shared_ptr<NcclCommunicator> make_nccl_communicator(const NcclUniqueId& id, int32_t rank, int32_t size,
                                                         int32_t device, double timeout_seconds) {
  return std::make_shared<NcclCommunicator>(to_nccl_id(id), rank, size, device, timeout_seconds);
}

std::shared_ptr<Communicator> nccl_communicator(const NcclUniqueId& id, int32_t rank, int32_t size,
                                                int32_t cuda_device, double timeout_seconds) {
  return make_nccl_communicator(id, rank, size, cuda_device, timeout_seconds);
}

std::shared_ptr<NcclCommunicator> make_nccl_world(int32_t device, double timeout_seconds) {
#if MAGI_ATTN_WITH_MPI
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized)
    throw InvalidArgument("nccl_world: MPI is not initialised (create a magi::comm::MpiEnvironment first)");
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (device < 0) {
    MPI_Comm node = MPI_COMM_NULL;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    int local_rank = 0;
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_free(&node);
    int devices = 0;
    check_cuda(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    if (devices < 1) throw NotAvailable("nccl_world: no CUDA device is visible");
    device = local_rank % devices;
  }
  NcclUniqueId id;
  if (rank == 0) id = nccl_unique_id();
  if (MPI_Bcast(id.bytes.data(), static_cast<int>(id.bytes.size()), MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
    throw CommError("nccl_world: MPI_Bcast of the NCCL unique id failed");
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  return make_nccl_communicator(id, rank, size, device, timeout_seconds);
#else
  (void)device;
  (void)timeout_seconds;
  throw NotAvailable("nccl_world: magi-attn was built without MPI (use nccl_unique_id and nccl_communicator)");
#endif
}

std::shared_ptr<Communicator> nccl_world(int32_t cuda_device, double timeout_seconds) {
  return make_nccl_world(cuda_device, timeout_seconds);
}

}  // namespace magi::comm
