// The NCCL engine (device memory) behind magi::comm::Communicator.
//
// All-to-all-v is one ncclGroupStart/ncclSend/ncclRecv/ncclGroupEnd on the communicator's own comm
// stream. Besides the blocking interface, enqueue_all_to_all_v puts the exchange on a caller's stream
// without a host wait, which is what the overlapped distributed runtime uses (ordering by CUDA events).
// Errors come back as CommError: a failed NCCL call, an asynchronous NCCL error, or a wait that outlives
// the timeout (the communicator is then aborted). Limit: the communicator is blocking, and NCCL connects a
// pair of ranks on their first send/recv inside ncclGroupEnd, on the host: a peer that never joins that
// first exchange hangs the caller there, outside the timeout (seen on 2 x H200). Non-blocking
// communicators (ncclConfig_t::blocking = 0, polling ncclCommGetAsyncError) would cover it.
// Available when the library was built with NCCL and the CUDA backend (MAGI_ATTN_WITH_NCCL).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <array>
#include <span>
#include <string>

#include "magi/comm.hpp"

namespace magi::comm {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `size` processes: every rank passes the same id (from ncclGetUniqueId on one rank).
  NcclCommunicator(const ncclUniqueId& id, int32_t rank, int32_t size, int32_t device);
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

  // Enqueues an all-to-all-v of device buffers on `stream` (no host wait). Counts in bytes.
  void enqueue_all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                            std::span<const int64_t> send_displs, void* recv, std::span<const int64_t> recv_counts,
                            std::span<const int64_t> recv_displs, cudaStream_t stream);
  // Enqueues an allgather of device buffers on `stream`.
  void enqueue_allgather(const void* send, int64_t bytes, void* recv, cudaStream_t stream);
  // Waits for `event` with the timeout, polling NCCL's asynchronous error; aborts and throws on either.
  void wait_event(cudaEvent_t event, const std::string& what);
  // Throws CommError if NCCL reported an asynchronous error (and aborts the communicator).
  void check_async_error(const std::string& what);

  // Aborts the communicator (pending operations end; later calls throw CommError). Idempotent.
  void abort();

  cudaStream_t comm_stream() const { return stream_; }
  int32_t cuda_device() const { return device_; }

 private:
  [[noreturn]] void abort_and_throw(const std::string& message);

  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int32_t rank_ = 0, size_ = 1, device_ = 0;
  bool aborted_ = false;
};

// A fresh unique id (call on one rank, hand it to the others, e.g. through torch.distributed).
ncclUniqueId nccl_unique_id();
// A communicator over `size` ranks from a caller-supplied id (collective).
std::shared_ptr<NcclCommunicator> nccl_communicator(const ncclUniqueId& id, int32_t rank, int32_t size,
                                                    int32_t device);
#if MAGI_ATTN_WITH_MPI
// Bootstrapped through MPI_COMM_WORLD (MPI initialised): rank 0 makes the id and broadcasts it; each
// rank uses device (node-local rank % visible devices) unless `device` >= 0.
std::shared_ptr<NcclCommunicator> nccl_world(int32_t device = -1);
#endif

}  // namespace magi::comm
