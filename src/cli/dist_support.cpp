#include "cli/dist_support.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <initializer_list>
#include <iostream>
#include <string_view>
#include <thread>

#include "cli/commands.hpp"
#include "magi/env.hpp"
#include "magi/error.hpp"

namespace magi::cli {

DistWorld::DistWorld(double timeout_seconds) {
  if (!launched_by_mpi()) {
    if (const std::optional<comm::LaunchInfo> launch = comm::launch_from_env()) {
      comm_ = comm::tcp_communicator(*launch, timeout_seconds);
      return;
    }
  }
  mpi_.emplace(nullptr, nullptr);
  comm_ = comm::mpi_world();
}

DistWorld::DistWorld(std::shared_ptr<comm::Communicator> comm) : comm_(std::move(comm)) {}

DistWorld::~DistWorld() {
  dist::clear_runtime_cache();
  comm_.reset();
}

void DistWorld::agree(const std::function<void()>& work) {
  // One fixed-size record per rank: a failure flag and the message (truncated), so one allgather decides.
  constexpr size_t kRecord = 1024;
  std::vector<char> mine(kRecord, '\0');
  const auto fail = [&](const std::string& message) {
    mine[0] = 1;
    std::memcpy(mine.data() + 1, message.data(), std::min(message.size(), kRecord - 2));
  };
  try {
    work();
  } catch (const QuietExit&) {
    fail("");
  } catch (const std::exception& e) {
    fail(e.what());
  } catch (...) {
    fail("unknown exception");
  }
  std::vector<char> all(kRecord * static_cast<size_t>(size()));
  try {
    comm_->allgather(mine.data(), kRecord, all.data());
  } catch (const std::exception&) {
    // A failed collective can take the communicator down with it (NCCL aborts): then this rank's own
    // error is the one worth reporting, not the allgather's.
    if (mine[0] == 0) throw;
    throw Error(std::string(mine.data() + 1));  // run_on_every_rank names a rank other than 0
  }
  for (int32_t r = 0; r < size(); ++r) {
    const char* record = all.data() + kRecord * static_cast<size_t>(r);
    if (record[0] == 0) continue;
    if (!root()) throw QuietExit{2};
    const std::string message(record + 1);
    throw Error(r == 0 ? message : "rank " + std::to_string(r) + ": " + message);
  }
}

std::vector<std::byte> DistWorld::broadcast(std::vector<std::byte> bytes) {
  const int64_t mine = root() ? static_cast<int64_t>(bytes.size()) : 0;
  std::vector<int64_t> sizes(static_cast<size_t>(size()));
  comm_->allgather(&mine, sizeof mine, sizes.data());
  const int64_t n = sizes[0];
  const auto ranks = static_cast<size_t>(size());
  if (comm_->device().type != DeviceType::CPU) {
    // A device engine's all-to-all takes device buffers only; its allgather takes host ones. Control
    // messages are small, so every rank sending n bytes costs little.
    bytes.resize(static_cast<size_t>(n));
    std::vector<std::byte> all(static_cast<size_t>(n) * ranks);
    comm_->allgather(bytes.data(), n, all.data());
    all.resize(static_cast<size_t>(n));
    return all;
  }
  std::vector<int64_t> send_counts(ranks, root() ? n : 0), displs(ranks, 0), recv_counts(ranks, 0);
  recv_counts[0] = n;
  std::vector<std::byte> received(static_cast<size_t>(n));
  comm_->all_to_all_v(bytes.data(), send_counts, displs, received.data(), recv_counts, displs);
  return received;
}

double DistWorld::max_over_ranks(double value) {
  std::vector<double> all(static_cast<size_t>(size()));
  comm_->allgather(&value, sizeof value, all.data());
  return *std::max_element(all.begin(), all.end());
}

bool DistWorld::all(bool ok) {
  const double worst = max_over_ranks(ok ? 0.0 : 1.0);
  return worst == 0.0;
}

int32_t DistWorld::threads_per_rank(int32_t requested) const {
  if (requested > 0) return requested;
  if (const char* omp = std::getenv("OMP_NUM_THREADS"); omp != nullptr && *omp != '\0') return 0;  // OpenMP's
  const int32_t ranks_here = std::max(1, comm_->ranks_per_node());
  const auto cores = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / ranks_here);
}

namespace {

// The first of `names` that is set, as a number; -1 when none is.
int32_t env_int(std::initializer_list<const char*> names) {
  for (const char* name : names)
    if (const char* value = std::getenv(name); value != nullptr && *value != '\0') return std::atoi(value);
  return -1;
}

}  // namespace

bool launched_by_mpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(name) != nullptr) return true;
  return false;
}

int32_t launcher_rank() {
  if (launched_by_mpi()) return std::max(0, env_int({"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}));
  return std::max(0, env_int({"RANK", "ATOM_DP_RANK"}));
}

double bootstrap_timeout(std::span<const std::string> args) {
  for (size_t i = 0; i < args.size(); ++i) {
    std::string text;
    if (args[i] == "--comm-timeout" && i + 1 < args.size()) text = args[i + 1];
    else if (args[i].starts_with("--comm-timeout=")) text = args[i].substr(15);
    else continue;
    char* end = nullptr;
    const double value = std::strtod(text.c_str(), &end);
    if (end != text.c_str() && *end == '\0' && value > 0) return value;  // a bad value is the parser's error
  }
  return comm::Communicator::kDefaultTimeoutSeconds;
}

int32_t launcher_local_ranks() { return std::max(0, env_int({"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"})); }

int32_t visible_gpu_count() {
  namespace fs = std::filesystem;
  std::error_code error;
  int32_t driver = 0;
  for (const auto& entry : fs::directory_iterator("/proc/driver/nvidia/gpus", error)) {
    (void)entry;
    ++driver;
  }
  if (driver == 0)  // no /proc entries (some containers): the device nodes
    for (const auto& entry : fs::directory_iterator("/dev", error)) {
      const std::string name = entry.path().filename().string();
      if (name.size() > 6 && name.starts_with("nvidia") &&
          name.find_first_not_of("0123456789", 6) == std::string::npos)
        ++driver;
    }
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (driver == 0 || visible == nullptr) return driver;
  int32_t listed = 0;  // entries of the comma-separated list ("" hides every GPU)
  for (std::string_view rest = visible; !rest.empty();) {
    const size_t comma = rest.find(',');
    if (!rest.substr(0, comma).empty()) ++listed;
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
  }
  return std::min(driver, listed);
}

void print_error_line(std::string_view message) {
  std::string line(message);
  for (char& c : line)
    if (c == '\n' || c == '\r') c = ' ';
  std::cerr << "magi-attn: error: " << line << std::endl;
}

Shards::Shards(const dist::RuntimeKey& key, dist::Axis axis, comm::Communicator& comm, int64_t total)
    : comm_(comm), total_(total) {
  const std::vector<int32_t> mine = dist::position_ids(key, axis);
  local_rows_ = static_cast<int64_t>(mine.size());  // the same on every rank
  rows_.resize(static_cast<size_t>(local_rows_ * comm.size()));
  comm.allgather(mine.data(), local_rows_ * static_cast<int64_t>(sizeof(int32_t)), rows_.data());
}

namespace {

int64_t row_bytes(HostTensor& t, int64_t rows) {
  const TensorView view = t.view();
  return rows == 0 ? 0 : view.nbytes() / rows;
}

}  // namespace

void Shards::scatter(HostTensor* global, HostTensor& local) const {
  const auto ranks = static_cast<size_t>(comm_.size());
  const bool root = comm_.rank() == 0;
  const int64_t row = row_bytes(local, local_rows_), share = row * local_rows_;
  std::vector<std::byte> send;
  if (root) {
    if (global == nullptr || global->dtype() != local.dtype() || global->shape()[0] != total_)
      throw InvalidArgument("scatter: rank 0 needs the global tensor in the local dtype");
    const TensorView source = global->view();
    const auto* src = static_cast<const std::byte*>(source.data);
    send.assign(static_cast<size_t>(share) * ranks, std::byte{0});
    for (size_t i = 0; i < rows_.size(); ++i)
      if (rows_[i] < total_) std::memcpy(send.data() + i * row, src + rows_[i] * row, static_cast<size_t>(row));
  }
  std::vector<int64_t> send_counts(ranks, root ? share : 0), send_displs(ranks, 0), recv_counts(ranks, 0),
      recv_displs(ranks, 0);
  for (size_t r = 0; r < ranks; ++r) send_displs[r] = static_cast<int64_t>(r) * share;
  recv_counts[0] = share;
  comm_.all_to_all_v(send.data(), send_counts, send_displs, local.view().data, recv_counts, recv_displs);
}

void Shards::gather(HostTensor& local, HostTensor* global) const {
  const auto ranks = static_cast<size_t>(comm_.size());
  const bool root = comm_.rank() == 0;
  const int64_t row = row_bytes(local, local_rows_), share = row * local_rows_;
  std::vector<std::byte> received(root ? static_cast<size_t>(share) * ranks : 0);
  std::vector<int64_t> send_counts(ranks, 0), send_displs(ranks, 0), recv_counts(ranks, root ? share : 0),
      recv_displs(ranks, 0);
  send_counts[0] = share;
  for (size_t r = 0; r < ranks; ++r) recv_displs[r] = static_cast<int64_t>(r) * share;
  comm_.all_to_all_v(local.view().data, send_counts, send_displs, received.data(), recv_counts, recv_displs);
  if (!root) return;
  if (global == nullptr || global->dtype() != local.dtype() || global->shape()[0] != total_)
    throw InvalidArgument("gather: rank 0 needs a global tensor in the local dtype");
  auto* dst = static_cast<std::byte*>(global->view().data);
  for (size_t i = 0; i < rows_.size(); ++i)
    if (rows_[i] < total_) std::memcpy(dst + rows_[i] * row, received.data() + i * row, static_cast<size_t>(row));
}

std::vector<OptionSpec> dist_option_specs() {
  return {{"chunk-size", "N", "dispatch chunk in tokens (default 512)"},
          {"overlap-degree", "N", "remote kv stages overlapped with compute; 0 = no overlap (default 1)"},
          {"dispatch", "NAME", "dispatch solver greedy|greedy_swap|locality (default locality)"},
          {"hierarchical", "", "hierarchical comm: kv crosses nodes once, then fans out (default: "
                               "MAGI_ATTENTION_HIERARCHICAL_COMM)"},
          {"ranks-per-node", "N", "with hierarchical comm: ranks per node (default: from MPI)"},
          {"comm-timeout", "S", "seconds a collective may take before the run fails (default 300)"}};
}

dist::DistConfig parse_dist_config(const Options& options, const AttentionOptions& attention) {
  dist::DistConfig c;
  c.chunk_size = static_cast<int32_t>(options.get_int("chunk-size", 512, 1, 1 << 30));
  c.overlap_degree = static_cast<int32_t>(options.get_int("overlap-degree", 1, 0, 4096));
  if (auto name = options.get("dispatch")) {
    if (*name == "greedy") c.algorithm = dist::DispatchAlgorithm::Greedy;
    else if (*name == "greedy_swap") c.algorithm = dist::DispatchAlgorithm::GreedySwap;
    else if (*name == "locality") c.algorithm = dist::DispatchAlgorithm::Locality;
    else throw InvalidArgument("--dispatch: '" + *name + "' (allowed: greedy, greedy_swap, locality)");
  }
  if (options.has("hierarchical")) c.hierarchical_comm = true;
  if (options.has("ranks-per-node")) {
    if (!options.has("hierarchical") && !env::get_bool("MAGI_ATTENTION_HIERARCHICAL_COMM"))
      throw InvalidArgument("--ranks-per-node needs --hierarchical (or MAGI_ATTENTION_HIERARCHICAL_COMM=1)");
    c.ranks_per_node = static_cast<int32_t>(options.get_int("ranks-per-node", 0, 1, 1 << 20));
  }
  c.comm_timeout_seconds = options.get_double("comm-timeout").value_or(300.0);
  if (!(c.comm_timeout_seconds > 0.0))
    throw InvalidArgument("--comm-timeout: must be > 0 seconds, got " + *options.get("comm-timeout"));
  c.attention = attention;
  if (attention.sink_layout == SinkLayout::SH) c.dsink_reduce_op = dist::DsinkReduceOp::Sum;
  return c;
}

void check_chunk_size(const dist::DistConfig& config, int64_t total_q, int64_t total_k) {
  const int64_t longest = dist::max_chunk_size(total_q, total_k);
  if (config.chunk_size > longest)
    throw InvalidArgument("--chunk-size: " + std::to_string(config.chunk_size) + " (allowed: 1 .. " +
                          std::to_string(longest) + ", the longer of the q tokens, the k tokens and 16384)");
}

std::string plan_text(const dist::PlanSummary& plan, DType dtype) {
  int64_t fetched = 0;
  for (int64_t rows : plan.fetched_kv_rows) fetched += rows;
  const double row_bytes = 2.0 * static_cast<double>(plan.kv_row_elements) * dtype_size(dtype);  // k and v
  char line[160];
  std::snprintf(line, sizeof line, "kv bytes moved %.3f MiB vs ring attention %.3f MiB (%s k and v)\n",
                fetched * row_bytes / (1 << 20), plan.ring_kv_rows * row_bytes / (1 << 20),
                std::string(to_string(dtype)).c_str());
  return plan.to_text() + line;
}

}  // namespace magi::cli
