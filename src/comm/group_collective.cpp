#include "comm/group_collective.hpp"

#include <cstring>
#include <numeric>
#include <string>

#include "comm/elements.hpp"
#include "common/lse_merge.hpp"

namespace magi::comm {
namespace {

std::vector<int64_t> displacements(const std::vector<int64_t>& counts) {
  std::vector<int64_t> displs(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) displs[i] = displs[i - 1] + counts[i - 1];
  return displs;
}

std::vector<int64_t> send_row_counts(const RowRoutes& routes) {
  std::vector<int64_t> counts;
  for (const auto& rows : routes.send_rows) counts.push_back(static_cast<int64_t>(rows.size()));
  return counts;
}

std::vector<int64_t> scaled(std::vector<int64_t> rows, int64_t row_bytes) {
  for (auto& r : rows) r *= row_bytes;
  return rows;
}

void check_routes(const Communicator& comm, const RowRoutes& routes, int64_t row_bytes) {
  const auto n = static_cast<size_t>(comm.size());
  if (routes.send_rows.size() != n || routes.recv_rows.size() != n)
    throw InvalidArgument("group collective: routes need one entry per rank (" + std::to_string(n) + ")");
  if (row_bytes <= 0) throw InvalidArgument("group collective: row_bytes must be > 0");
}

}  // namespace

int64_t RowRoutes::total_recv_rows() const { return std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0}); }

int64_t RowRoutes::total_send_rows() const {
  int64_t n = 0;
  for (const auto& rows : send_rows) n += static_cast<int64_t>(rows.size());
  return n;
}

GroupCast::GroupCast(Communicator& comm, const RowRoutes& routes, const void* table, int64_t row_bytes,
                     void* recv) {
  check_routes(comm, routes, row_bytes);
  staging_.resize(static_cast<size_t>(routes.total_send_rows() * row_bytes));
  const auto* src = static_cast<const std::byte*>(table);
  std::byte* out = staging_.data();
  for (const auto& rows : routes.send_rows)
    for (int32_t row : rows) {
      std::memcpy(out, src + int64_t{row} * row_bytes, static_cast<size_t>(row_bytes));
      out += row_bytes;
    }
  const auto send_counts = scaled(send_row_counts(routes), row_bytes);
  const auto recv_counts = scaled(routes.recv_rows, row_bytes);
  request_ = comm.start_all_to_all_v(staging_.data(), send_counts, displacements(send_counts), recv, recv_counts,
                                     displacements(recv_counts));
}

void GroupCast::wait() {
  if (request_) request_->wait();
  request_.reset();
  staging_ = {};
}

GroupReduce::GroupReduce(Communicator& comm, const RowRoutes& routes, const void* partials, int64_t row_bytes)
    : routes_(routes), row_bytes_(row_bytes) {
  check_routes(comm, routes, row_bytes);
  // The transpose of the cast: send what was received, receive what was sent.
  const auto send_counts = scaled(routes.recv_rows, row_bytes);
  const auto recv_counts = scaled(send_row_counts(routes), row_bytes);
  received_.resize(static_cast<size_t>(routes.total_send_rows() * row_bytes));
  request_ = comm.start_all_to_all_v(partials, send_counts, displacements(send_counts), received_.data(),
                                     recv_counts, displacements(recv_counts));
}

void GroupReduce::wait() {
  if (request_) request_->wait();
  request_.reset();
}

void GroupReduce::finish_sum(DType dtype, int64_t elems_per_row, double* accum) {
  if (elems_per_row * dtype_size(dtype) != row_bytes_)
    throw InvalidArgument("group_reduce: elems_per_row x dtype size does not match row_bytes");
  wait();
  const std::byte* in = received_.data();
  for (const auto& rows : routes_.send_rows)
    for (int32_t row : rows) {
      double* dst = accum + int64_t{row} * elems_per_row;
      for (int64_t e = 0; e < elems_per_row; ++e) dst[e] += load_element(dtype, in, e);
      in += row_bytes_;
    }
}

void GroupReduce::finish_lse_merge(DType out_dtype, DType lse_dtype, int32_t heads, int32_t head_dim,
                                   double* out_accum, double* lse_accum) {
  const int64_t out_bytes = int64_t{heads} * head_dim * dtype_size(out_dtype);
  if (out_bytes + int64_t{heads} * dtype_size(lse_dtype) != row_bytes_)
    throw InvalidArgument("group_reduce: heads x head_dim out values + heads lse values do not match row_bytes");
  wait();
  const std::byte* in = received_.data();
  for (const auto& rows : routes_.send_rows)
    for (int32_t row : rows) {
      for (int32_t h = 0; h < heads; ++h) {
        double& lse = lse_accum[int64_t{row} * heads + h];
        const auto w = merge_weights<double>(lse, load_element(lse_dtype, in + out_bytes, h));
        double* out = out_accum + (int64_t{row} * heads + h) * head_dim;
        for (int32_t d = 0; d < head_dim; ++d) {
          const double part = load_element(out_dtype, in, int64_t{h} * head_dim + d);
          // Zero weights must not touch the values: an empty part may hold anything finite.
          out[d] = (w.w1 == 0 ? 0.0 : w.w1 * out[d]) + (w.w2 == 0 ? 0.0 : w.w2 * part);
        }
        lse = w.lse;
      }
      in += row_bytes_;
    }
}

}  // namespace magi::comm
