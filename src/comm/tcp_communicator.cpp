// Launch without MPI: the launcher's variables (torchrun, ATOM) and a host communicator over TCP sockets, a star
// through rank 0 (every collective is a gather to rank 0 and a scatter back). Meant for bootstrapping (NCCL ids)
// and host-tensor runs of modest size; every socket wait is bounded by the communicator's timeout.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "magi/comm.hpp"

namespace magi::comm {

namespace {

const char* get(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

int64_t parse_integer(const char* name, const char* text, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || value < lo || value > hi)
    throw InvalidArgument(std::string(name) + "=" + text + ": not an integer in " + std::to_string(lo) + ".." +
                          std::to_string(hi));
  return value;
}

// One convention's variables: rank, size, local rank, address, port (nullptr default = required).
LaunchInfo read_convention(const char* convention, const char* rank, const char* size, const char* local,
                           const char* addr, const char* addr_default, const char* port, const char* port_default) {
  LaunchInfo info;
  info.convention = convention;
  for (const char* required : {rank, size})
    if (get(required) == nullptr)
      throw InvalidArgument(std::string(convention) + " launch: " + required + " is not set (" + convention +
                            " needs " + rank + " and " + size + ")");
  info.size = static_cast<int32_t>(parse_integer(size, get(size), 1, 1 << 20));
  info.rank = static_cast<int32_t>(parse_integer(rank, get(rank), 0, info.size - 1));
  info.local_rank = get(local) ? static_cast<int32_t>(parse_integer(local, get(local), 0, 1 << 20)) : 0;
  const char* a = get(addr) ? get(addr) : addr_default;
  const char* p = get(port) ? get(port) : port_default;
  if (a == nullptr) throw InvalidArgument(std::string(convention) + " launch: " + addr + " is not set (the master's address)");
  if (p == nullptr) throw InvalidArgument(std::string(convention) + " launch: " + port + " is not set (the master's port)");
  info.master_addr = a;
  info.master_port = static_cast<int32_t>(parse_integer(port, p, 1, 65535));
  return info;
}

using Clock = std::chrono::steady_clock;

double seconds_left(Clock::time_point deadline) {
  return std::chrono::duration<double>(deadline - Clock::now()).count();
}

// Waits until fd is ready for `events` or the deadline passes (false).
bool wait_for(int fd, short events, Clock::time_point deadline) {
  while (true) {
    const double left = seconds_left(deadline);
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(std::min(left * 1000.0, 1000.0)) + 1);
    if (ready > 0) return true;
    if (ready < 0 && errno != EINTR) return false;
  }
}

class TcpCommunicator final : public Communicator {
 public:
  TcpCommunicator(const LaunchInfo& launch, double timeout) : rank_(launch.rank), size_(launch.size) {
    set_timeout(timeout);
    peers_.assign(static_cast<size_t>(size_), -1);
    if (size_ == 1) return;
    if (rank_ == 0) listen_and_accept(launch);
    else connect_to_root(launch);
  }
  ~TcpCommunicator() override {
    for (int fd : peers_)
      if (fd >= 0) ::close(fd);
  }

  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  Device device() const override { return Device{DeviceType::CPU, 0}; }
  std::string describe() const override { return "tcp:" + std::to_string(size_); }

  std::unique_ptr<Request> start_all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                              std::span<const int64_t> send_displs, void* recv,
                                              std::span<const int64_t> recv_counts,
                                              std::span<const int64_t> recv_displs) override {
    const auto* in = static_cast<const char*>(send);
    auto* out = static_cast<char*>(recv);
    const Clock::time_point deadline = this->deadline();
    if (rank_ != 0) {
      // To the root: the counts, then every segment in destination order; back: the segments for me.
      std::vector<int64_t> counts(send_counts.begin(), send_counts.end());
      send_all(peers_[0], counts.data(), counts.size() * sizeof(int64_t), deadline, 0);
      for (int32_t d = 0; d < size_; ++d) send_all(peers_[0], in + send_displs[d], send_counts[d], deadline, 0);
      for (int32_t s = 0; s < size_; ++s) recv_all(peers_[0], out + recv_displs[s], recv_counts[s], deadline, 0);
    } else {
      std::vector<std::vector<int64_t>> counts(static_cast<size_t>(size_));
      std::vector<std::vector<char>> data(static_cast<size_t>(size_));
      counts[0].assign(send_counts.begin(), send_counts.end());
      for (int32_t r = 1; r < size_; ++r) {
        counts[r].resize(static_cast<size_t>(size_));
        recv_all(peers_[r], counts[r].data(), counts[r].size() * sizeof(int64_t), deadline, r);
        int64_t total = 0;
        for (int64_t c : counts[r]) total += c;
        data[r].resize(static_cast<size_t>(total));
        recv_all(peers_[r], data[r].data(), total, deadline, r);
      }
      for (int32_t d = 0; d < size_; ++d) {
        for (int32_t s = 0; s < size_; ++s) {
          const char* segment = in + send_displs[d];  // the root's own
          if (s != 0) {
            int64_t offset = 0;
            for (int32_t e = 0; e < d; ++e) offset += counts[s][e];
            segment = data[s].data() + offset;
          }
          const int64_t bytes = counts[s][d];
          if (d == 0) {
            if (bytes != recv_counts[s]) throw CommError("tcp all_to_all_v: rank " + std::to_string(s) + " sends " +
                                                         std::to_string(bytes) + " bytes, rank 0 expects " +
                                                         std::to_string(recv_counts[s]));
            std::memcpy(out + recv_displs[s], segment, static_cast<size_t>(bytes));
          } else {
            send_all(peers_[d], segment, bytes, deadline, d);
          }
        }
      }
    }
    return std::make_unique<Done>();
  }

  void allgather(const void* send, int64_t bytes, void* recv) override {
    const Clock::time_point deadline = this->deadline();
    auto* out = static_cast<char*>(recv);
    if (rank_ != 0) {
      send_all(peers_[0], send, bytes, deadline, 0);
      recv_all(peers_[0], out, bytes * size_, deadline, 0);
      return;
    }
    std::memcpy(out, send, static_cast<size_t>(bytes));
    for (int32_t r = 1; r < size_; ++r) recv_all(peers_[r], out + r * bytes, bytes, deadline, r);
    for (int32_t r = 1; r < size_; ++r) send_all(peers_[r], out, bytes * size_, deadline, r);
  }

  void barrier() override {
    std::vector<char> all(static_cast<size_t>(size_));
    const char mine = 1;
    allgather(&mine, 1, all.data());
  }

 private:
  struct Done final : Request {
    void wait() override {}
  };
  struct Hello {
    uint32_t magic;
    int32_t rank, size;
  };
  static constexpr uint32_t kMagic = 0x4d414749;  // "MAGI"

  Clock::time_point deadline() const {
    return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout()));
  }

  std::string timeout_text() const {
    std::string text = std::to_string(timeout());
    text.erase(text.find_last_not_of('0') + 1);
    if (text.back() == '.') text.pop_back();
    return text + " s";
  }

  [[noreturn]] void fail(const std::string& what, int32_t peer) const {
    throw CommError("tcp communicator (rank " + std::to_string(rank_) + " of " + std::to_string(size_) + "): " +
                    what + (peer >= 0 ? " (peer rank " + std::to_string(peer) + ")" : ""));
  }

  void send_all(int fd, const void* data, int64_t bytes, Clock::time_point deadline, int32_t peer) const {
    const auto* p = static_cast<const char*>(data);
    while (bytes > 0) {
      if (!wait_for(fd, POLLOUT, deadline)) fail("send timed out after " + timeout_text(), peer);
      const ssize_t n = ::send(fd, p, static_cast<size_t>(bytes), MSG_NOSIGNAL);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) fail(std::string("connection lost: ") + std::strerror(errno), peer);
      p += n;
      bytes -= n;
    }
  }
  void recv_all(int fd, void* data, int64_t bytes, Clock::time_point deadline, int32_t peer) const {
    auto* p = static_cast<char*>(data);
    while (bytes > 0) {
      if (!wait_for(fd, POLLIN, deadline)) fail("receive timed out after " + timeout_text(), peer);
      const ssize_t n = ::recv(fd, p, static_cast<size_t>(bytes), 0);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) fail(n == 0 ? "connection closed by the peer" : std::string("receive failed: ") + std::strerror(errno), peer);
      p += n;
      bytes -= n;
    }
  }

  static void tune(int fd) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  }

  void listen_and_accept(const LaunchInfo& launch) {
    const int server = ::socket(AF_INET, SOCK_STREAM, 0);
    if (server < 0) fail(std::string("socket: ") + std::strerror(errno), -1);
    const int one = 1;
    ::setsockopt(server, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_ANY);
    address.sin_port = htons(static_cast<uint16_t>(launch.master_port));
    if (::bind(server, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 || ::listen(server, size_) != 0) {
      const std::string error = std::strerror(errno);
      ::close(server);
      fail("cannot listen on port " + std::to_string(launch.master_port) + ": " + error, -1);
    }
    const Clock::time_point deadline = this->deadline();
    int32_t joined = 1;
    try {
      while (joined < size_) {
        if (!wait_for(server, POLLIN, deadline)) {
          std::string missing;
          for (int32_t r = 1; r < size_; ++r)
            if (peers_[r] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
          fail("rank(s) " + missing + " did not join within " + timeout_text() + " (" +
                   launch.convention + " master port " + std::to_string(launch.master_port) + ")",
               -1);
        }
        const int fd = ::accept(server, nullptr, nullptr);
        if (fd < 0) continue;
        tune(fd);
        Hello hello{};
        recv_all(fd, &hello, sizeof hello, deadline, -1);
        if (hello.magic != kMagic || hello.size != size_ || hello.rank < 1 || hello.rank >= size_ ||
            peers_[hello.rank] >= 0) {
          ::close(fd);
          fail("a rank announced itself as " + std::to_string(hello.rank) + " of " + std::to_string(hello.size) +
                   " (expected a new rank of " + std::to_string(size_) + ": check WORLD_SIZE and RANK)",
               -1);
        }
        peers_[hello.rank] = fd;
        ++joined;
      }
    } catch (...) {
      ::close(server);
      throw;
    }
    ::close(server);
    const char go = 1;
    for (int32_t r = 1; r < size_; ++r) send_all(peers_[r], &go, 1, deadline, r);
  }

  void connect_to_root(const LaunchInfo& launch) {
    const Clock::time_point deadline = this->deadline();
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (::getaddrinfo(launch.master_addr.c_str(), std::to_string(launch.master_port).c_str(), &hints, &found) != 0 ||
        found == nullptr)
      throw InvalidArgument(launch.convention + " launch: master address '" + launch.master_addr +
                            "' does not resolve (allowed: a host name or IPv4 address)");
    sockaddr_in address = *reinterpret_cast<sockaddr_in*>(found->ai_addr);
    ::freeaddrinfo(found);
    int fd = -1;
    while (true) {  // the root may not listen yet
      fd = ::socket(AF_INET, SOCK_STREAM, 0);
      if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0) break;
      if (fd >= 0) ::close(fd);
      if (seconds_left(deadline) <= 0)
        fail("rank 0 at " + launch.master_addr + ":" + std::to_string(launch.master_port) + " did not accept within " + timeout_text(),
             0);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    tune(fd);
    peers_[0] = fd;
    const Hello hello{kMagic, rank_, size_};
    send_all(fd, &hello, sizeof hello, deadline, 0);
    char go = 0;
    recv_all(fd, &go, 1, deadline, 0);  // every rank joined
  }

  int32_t rank_, size_;
  std::vector<int> peers_;  // rank 0: a socket per other rank; others: peers_[0] = the root
};

}  // namespace

std::optional<LaunchInfo> launch_from_env() {
  if (get("RANK") != nullptr || get("WORLD_SIZE") != nullptr)
    return read_convention("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", nullptr, "MASTER_PORT",
                           nullptr);
  if (get("ATOM_DP_RANK") != nullptr || get("ATOM_DP_SIZE") != nullptr)
    return read_convention("ATOM", "ATOM_DP_RANK", "ATOM_DP_SIZE", "ATOM_DP_RANK_LOCAL", "ATOM_DP_MASTER_IP",
                           "127.0.0.1", "ATOM_DP_MASTER_PORT", "29500");
  return std::nullopt;
}

std::shared_ptr<Communicator> tcp_communicator(const LaunchInfo& launch, double timeout_seconds) {
  if (launch.size < 1 || launch.rank < 0 || launch.rank >= launch.size)
    throw InvalidArgument("tcp communicator: rank " + std::to_string(launch.rank) + " of size " +
                          std::to_string(launch.size) + " (allowed: 0 <= rank < size)");
  return std::make_shared<TcpCommunicator>(launch, timeout_seconds);
}

}  // namespace magi::comm
