// The NCCL engine (device memory) behind magi::comm::Communicator; the public factories
// (magi::comm::nccl_communicator, nccl_world in magi/comm.hpp) wrap the typed ones here.
//
// All-to-all-v is one ncclGroupStart/ncclSend/ncclRecv/ncclGroupEnd on the communicator's own comm
// stream. Besides the blocking interface, enqueue_all_to_all_v puts the exchange on a caller's stream
// without waiting for it, which is what the overlapped distributed runtime uses (ordering by CUDA events).
// The NCCL communicator is non-blocking (ncclConfig_t::blocking = 0): init, ncclGroupEnd and collectives
// may return ncclInProgress while NCCL connects peers or launches from a helper thread, and every such
// call is followed by await_launch, which polls ncclCommGetAsyncError within the timeout. So a peer that
// never joins (the init, or the first exchange, whose lazy connection handshake hung a blocking
// communicator inside ncclGroupEnd) ends in CommError, not a hang.
// Errors come back as CommError: a failed NCCL call, an asynchronous NCCL error, or a wait that outlives
// the timeout (the communicator is then aborted).
// Available when the library was built with NCCL (>= 2.14) and the CUDA backend (MAGI_ATTN_WITH_NCCL).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "magi/comm.hpp"

namespace magi::comm {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `size` processes: every rank passes the same id (from ncclGetUniqueId on one rank).
  // The timeout (set_timeout) starts as `timeout_seconds` and bounds the initialisation too.
  NcclCommunicator(const ncclUniqueId& id, int32_t rank, int32_t size, int32_t device,
                   double timeout_seconds = kDefaultTimeoutSeconds);
  // Finalises within the timeout (waiting for pending work), else aborts; never throws.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  Device device() const override { return Device{DeviceType::CUDA, device_}; }
  std::string describe() const override { return "nccl:" + std::to_string(size_); }

  // Device buffers; runs on the comm stream, wait() waits for it with the timeout.
  std::unique_ptr<Request> start_all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                              std::span<const int64_t> send_displs, void* recv,
                                              std::span<const int64_t> recv_counts,
                                              std::span<const int64_t> recv_displs) override;
  // Host or device buffers (host ones pass through a device copy); blocking, with the timeout.
  void allgather(const void* send, int64_t bytes, void* recv) override;
  void barrier() override;

  // Enqueues an all-to-all-v of device buffers on `stream` (returns once NCCL has put it on the stream,
  // not when it completes). Counts in bytes. Inside a caller's ncclGroupStart/ncclGroupEnd the launch
  // happens at the caller's ncclGroupEnd: pass its result to await_launch before recording events.
  void enqueue_all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                            std::span<const int64_t> send_displs, void* recv, std::span<const int64_t> recv_counts,
                            std::span<const int64_t> recv_displs, cudaStream_t stream);
  // Enqueues an allgather of device buffers on `stream`.
  void enqueue_allgather(const void* send, int64_t bytes, void* recv, cudaStream_t stream);
  // Waits for `event` with the timeout, polling NCCL's asynchronous error; aborts and throws on either.
  void wait_event(cudaEvent_t event, const std::string& what);
  // Throws CommError if NCCL reported an asynchronous error (and aborts the communicator).
  void check_async_error(const std::string& what);
  // After a non-blocking NCCL call on this communicator that returned `code`: waits, within the timeout,
  // until NCCL has finished it on the host (work enqueued, peers connected), then returns; aborts and
  // throws CommError naming `what` on an error or at the timeout.
  void await_launch(ncclResult_t code, const std::string& what);

  // Aborts the communicator (pending operations end; later calls throw CommError). Idempotent.
  void abort();

  cudaStream_t comm_stream() const { return stream_; }
  // Makes the comm stream wait for the work pending on the legacy default stream (the blocking interface's order).
  void after_default_stream();
  int32_t cuda_device() const { return device_; }

 private:
  [[noreturn]] void abort_and_throw(const std::string& message);
  // "rank r of nccl:n", for messages.
  std::string where() const;

  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int32_t rank_ = 0, size_ = 1, device_ = 0;
  bool aborted_ = false;
};

// Typed versions of magi::comm::nccl_communicator and nccl_world (the public ones return these).
std::shared_ptr<NcclCommunicator> make_nccl_communicator(const NcclUniqueId& id, int32_t rank, int32_t size,
                                                         int32_t device,
                                                         double timeout_seconds = Communicator::kDefaultTimeoutSeconds);
// Throws NotAvailable when the library was built without MPI.
std::shared_ptr<NcclCommunicator> make_nccl_world(int32_t device = -1,
                                                  double timeout_seconds = Communicator::kDefaultTimeoutSeconds);

}  // namespace magi::comm
