// Dispatch (SPEC section 4): the global sequence is cut into chunks of chunk_size tokens (padded to a
// multiple of cp chunks; padding attends to nothing) and each rank gets the same number of chunks, chosen
// so that the largest per-rank mask area is small. Pure host code.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "magi/dist.hpp"
#include "magi/mask.hpp"

namespace magi::dist {

// One axis (q, or k/v) cut into chunks and dealt out to ranks.
struct Partition {
  int32_t total = 0;       // real tokens
  int32_t chunk_size = 0;
  int32_t num_chunks = 0;  // a multiple of cp; chunks past `total` are (partly) padding
  std::vector<int32_t> owner;               // [chunk] -> rank
  std::vector<int32_t> position;            // [chunk] -> index among its owner's chunks
  std::vector<std::vector<int32_t>> chunks; // [rank] -> its chunks, ascending

  int32_t cp() const { return static_cast<int32_t>(chunks.size()); }
  int32_t padded_total() const { return num_chunks * chunk_size; }
  int32_t local_tokens() const { return num_chunks / cp() * chunk_size; }
  Range chunk_range(int32_t chunk) const { return {chunk * chunk_size, (chunk + 1) * chunk_size}; }
  // Local row of global token `token` on its owner.
  int32_t local_row(int32_t token) const {
    const int32_t c = token / chunk_size;
    return position[c] * chunk_size + token % chunk_size;
  }
  int32_t owner_of(int32_t token) const { return owner[token / chunk_size]; }
  // Global index of each local row of `rank` (>= total for padding): the position_ids.
  std::vector<int32_t> global_rows(int32_t rank) const;
};

struct Dispatch {
  Partition q, k;
  std::vector<int64_t> chunk_area;  // [q chunk] kept cells in the chunk's rows
  std::vector<int64_t> rank_area;   // [rank]
  bool self_attention = true;       // k shares q's partition

  int64_t max_rank_area() const;
  // max(total_area / cp rounded up, largest chunk area): no assignment does better.
  int64_t lower_bound() const;
  // Tighter, since every rank holds the same number n of chunks: the rank with the largest chunk also
  // holds n - 1 others (at least the n - 1 smallest), and some rank holds none of the cp - 1 smallest.
  int64_t count_aware_lower_bound() const;
};

// Kept cells of each chunk's rows (chunks of chunk_size over num_chunks * chunk_size rows).
std::vector<int64_t> chunk_areas(const Mask& mask, int32_t chunk_size, int32_t num_chunks);

// Assigns costs.size() items (a multiple of cp) to cp ranks, costs.size() / cp each, minimising the
// largest per-rank sum. Returns the owner of each item. Deterministic.
std::vector<int32_t> balance(const std::vector<int64_t>& costs, int32_t cp, DispatchAlgorithm algorithm);

// The whole dispatch. For self-attention (total_q == total_k) k/v follow q's chunks; otherwise k/v chunks
// are dealt out in contiguous blocks (they carry no compute, only comm).
Dispatch make_dispatch(const Mask& mask, int32_t cp, int32_t chunk_size, DispatchAlgorithm algorithm);

// A roll by `shift` along the global sequence (out[g] = in[(g - shift) mod total]) seen from `rank`: send[r] are
// this rank's local rows that rank r receives, in r's row order; recv[r] the local rows this rank fills from r, in
// the order r sends them. Padding rows neither travel nor get filled.
struct RollRoutes {
  std::vector<std::vector<int32_t>> send, recv;
};
RollRoutes roll_routes(const Partition& partition, int32_t rank, int64_t shift);

// Another mask over the same sequences on an existing dispatch: the partitions stay (so tensors dispatched for
// `fixed` serve), the per-chunk and per-rank areas are the new mask's. Totals must match (InvalidArgument).
Dispatch redispatch(const Mask& mask, const Dispatch& fixed);

}  // namespace magi::dist
