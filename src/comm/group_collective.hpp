// Group collectives on top of all_to_all_v (SPEC section 4).
//
// group_cast sends rows of this rank's table to the ranks that need them; group_reduce is its transpose:
// partial rows computed on other ranks come back to their owner and are reduced there (sum, or the SPEC
// lse merge for out/lse). Both are described by one RowRoutes, seen from the table's owner.
// Reductions apply contributions in a fixed order (source rank ascending, then route order), so results
// are bitwise reproducible whatever the timing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "magi/comm.hpp"
#include "magi/tensor.hpp"

namespace magi::comm {

struct RowRoutes {
  // [dst]: rows of this rank's table that dst receives, in the order they arrive there.
  std::vector<std::vector<int32_t>> send_rows;
  // [src]: how many rows this rank receives from src. Received rows are grouped by source, ascending.
  std::vector<int64_t> recv_rows;

  int64_t total_recv_rows() const;
  int64_t total_send_rows() const;
};

// Sends this rank's `table` rows ([rows, row_bytes]) along `routes` into `recv` ([total_recv_rows,
// row_bytes]). Starts on construction; wait() completes it. Buffers must outlive the wait.
class GroupCast {
 public:
  GroupCast(Communicator& comm, const RowRoutes& routes, const void* table, int64_t row_bytes, void* recv);
  void wait();

 private:
  std::vector<std::byte> staging_;
  std::unique_ptr<Request> request_;
};

enum class ReduceOp {
  Sum,       // rows are elements of one dtype; added to a double accumulator
  LseMerge,  // rows are [out: heads x head_dim in out dtype][lse: heads in lse dtype]; merged per head
};

// Sends partial rows back to their owners: `partials` ([total_recv_rows, row_bytes]) is laid out like the
// receive buffer of a GroupCast with the same routes. The owner receives them on construction's
// matching call and reduces them into its table rows in finish_*.
class GroupReduce {
 public:
  GroupReduce(Communicator& comm, const RowRoutes& routes, const void* partials, int64_t row_bytes);

  // Sum: accum[row * elems_per_row + e] += element e of each partial row of `row` (elements in `dtype`).
  void finish_sum(DType dtype, int64_t elems_per_row, double* accum);
  // LseMerge: merges each partial (out, lse) into (out_accum [rows, heads, head_dim], lse_accum [rows, heads]).
  void finish_lse_merge(DType out_dtype, DType lse_dtype, int32_t heads, int32_t head_dim, double* out_accum,
                        double* lse_accum);

 private:
  void wait();
  const RowRoutes& routes_;
  int64_t row_bytes_;
  std::vector<std::byte> received_;
  std::unique_ptr<Request> request_;
};

}  // namespace magi::comm
