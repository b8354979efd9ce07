// The naive dense fp64 attention reference, used only by tests.
//
// Deliberately simple and independent of the engine and of magi::kept_keys: the keep matrix is built by
// evaluating SPEC section 2's table literally with local indices, and forward/backward follow the
// textbook formulas of SPEC section 3 in double precision. Inputs are values already rounded to the
// dtype under test, so the only difference to a backend is the backend's own arithmetic.
#pragma once

#include <cstdint>
#include <vector>

#include "magi/attention.hpp"
#include "magi/mask.hpp"

namespace magi::test {

// True when `slice` keeps the global cell (q, k): SPEC section 2, local indices i = q - qs, j = k - ks.
bool slice_keeps(const Slice& slice, int32_t q, int32_t k);

// Dense keep matrix, row-major [total_q, total_k]: 1 where any slice keeps the cell.
std::vector<uint8_t> dense_keep(const Mask& mask);

// One attention problem in the thd layout; every vector holds values already rounded to the tested dtype.
struct ReferenceProblem {
  Mask mask;
  int32_t heads_q = 1;
  int32_t heads_kv = 1;
  int32_t head_dim = 8;
  double softmax_scale = 0.0;  // <= 0: D^-0.5
  double softcap = 0.0;        // > 0: s = softcap * tanh(s / softcap)
  SinkLayout sink_layout = SinkLayout::None;
  int32_t sink_len = 0;        // S: sink is [S, Hq] (sh) or [Tq, S, Hq] (ssh)
  std::vector<double> q, k, v, sink;

  int32_t total_q() const { return mask.total_q; }
  int32_t total_k() const { return mask.total_k; }
  double resolved_scale() const;
};

struct ReferenceForward {
  std::vector<double> out;         // [Tq, Hq, D]
  std::vector<double> lse;         // [Tq, Hq], includes the sink; -inf for empty rows without sink
  std::vector<double> max_logits;  // [Hq], max of s over kept cells; -inf when a head keeps none
  // [Hq], the largest scale * sum_d |q_d k_d| over kept cells: the size of the terms a logit sums, against which its
  // rounding is judged (a logit that cancels to near 0 carries the rounding of terms this large).
  std::vector<double> max_logits_magnitude;
};

struct ReferenceGrads {
  std::vector<double> dq, dk, dv;  // like q, k, v
  std::vector<double> dsink;       // like sink (empty without sink)
  // Like dsink, with the absolute values of the per-row terms summed: dsink may cancel to far below
  // the size of its terms, so errors are judged against this.
  std::vector<double> dsink_magnitude;
  // Like dq and dk, with every term's factor dS = P (dP - Delta) taken as P (|dP| + |Delta|) and the products in
  // absolute value: the size the gradient has before dP and Delta cancel (a row with one key: dS = 0 exactly,
  // and any finite-precision dS is rounding of terms this large).
  std::vector<double> dq_magnitude, dk_magnitude;
};

ReferenceForward reference_forward(const ReferenceProblem& problem);
// Gradients of sum(out * dout); recomputes the forward itself. dout is [Tq, Hq, D]. With given_out ([Tq, Hq, D]),
// Delta = dout . out takes that out (the backward's own input, e.g. a 16-bit forward result) instead of the exact
// one: where a row's dS cancels (one key beside a sink, a very sharp softmax) out's rounding alone moves dq and
// dsink by more than the gradient bound, whatever kernel reads it.
ReferenceGrads reference_backward(const ReferenceProblem& problem, const std::vector<double>& dout,
                                  const std::vector<double>* given_out = nullptr);

}  // namespace magi::test
