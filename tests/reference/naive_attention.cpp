#include "reference/naive_attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace magi::test {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Everything a row needs, computed once per (row, head) and shared by forward and backward.
struct RowState {
  std::vector<int32_t> keys;     // kept key indices, ascending
  std::vector<double> raw;       // scale * q . k, before softcap
  std::vector<double> logits;    // s after softcap
  double lse = kNegInf;          // over kept keys and sinks
};

class Evaluator {
 public:
  explicit Evaluator(const ReferenceProblem& p)
      : p_(p), keep_(dense_keep(p.mask)), scale_(p.resolved_scale()), group_(p.heads_q / p.heads_kv) {}

  const double* q_row(int32_t t, int32_t h) const { return &p_.q[index3(t, h, p_.heads_q)]; }
  const double* k_row(int32_t t, int32_t hk) const { return &p_.k[index3(t, hk, p_.heads_kv)]; }
  const double* v_row(int32_t t, int32_t hk) const { return &p_.v[index3(t, hk, p_.heads_kv)]; }
  std::size_t index3(int32_t t, int32_t h, int32_t heads) const {
    return (static_cast<std::size_t>(t) * heads + h) * p_.head_dim;
  }
  int32_t kv_head(int32_t h) const { return h / group_; }

  // Sink logits seen by row t of head h (raw, unscaled).
  std::vector<double> sinks(int32_t t, int32_t h) const {
    std::vector<double> s;
    for (int32_t i = 0; i < p_.sink_len; ++i) {
      if (p_.sink_layout == SinkLayout::SH) s.push_back(p_.sink[static_cast<std::size_t>(i) * p_.heads_q + h]);
      if (p_.sink_layout == SinkLayout::SSH)
        s.push_back(p_.sink[(static_cast<std::size_t>(t) * p_.sink_len + i) * p_.heads_q + h]);
    }
    return s;
  }

  RowState row(int32_t t, int32_t h) const {
    RowState r;
    const int32_t tk = p_.total_k();
    const double* qr = q_row(t, h);
    for (int32_t j = 0; j < tk; ++j) {
      if (!keep_[static_cast<std::size_t>(t) * tk + j]) continue;
      const double* kr = k_row(j, kv_head(h));
      double dot = 0.0;
      for (int32_t d = 0; d < p_.head_dim; ++d) dot += qr[d] * kr[d];
      const double raw = scale_ * dot;
      r.keys.push_back(j);
      r.raw.push_back(raw);
      r.logits.push_back(p_.softcap > 0.0 ? p_.softcap * std::tanh(raw / p_.softcap) : raw);
    }
    const std::vector<double> sink = sinks(t, h);
    double m = kNegInf;
    for (double s : r.logits) m = std::max(m, s);
    for (double s : sink) m = std::max(m, s);
    if (m == kNegInf) return r;  // nothing to attend to: lse stays -inf
    double sum = 0.0;
    for (double s : r.logits) sum += std::exp(s - m);
    for (double s : sink) sum += std::exp(s - m);
    r.lse = m + std::log(sum);
    return r;
  }

  const ReferenceProblem& problem() const { return p_; }
  double scale() const { return scale_; }

 private:
  const ReferenceProblem& p_;
  std::vector<uint8_t> keep_;
  double scale_;
  int32_t group_;
};

}  // namespace

double ReferenceProblem::resolved_scale() const {
  return softmax_scale > 0.0 ? softmax_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

bool slice_keeps(const Slice& s, int32_t q, int32_t k) {
  if (q < s.q.start || q >= s.q.end || k < s.k.start || k >= s.k.end) return false;
  const int64_t i = q - s.q.start, j = k - s.k.start;
  const int64_t sq = s.q.end - s.q.start, sk = s.k.end - s.k.start;
  const bool causal = j <= i + (sk - sq);
  const bool inv_causal = j >= i;
  switch (s.type) {
    case MaskType::Full: return true;
    case MaskType::Causal: return causal;
    case MaskType::InvCausal: return inv_causal;
    case MaskType::BiCausal: return causal && inv_causal;
  }
  return false;
}

std::vector<uint8_t> dense_keep(const Mask& mask) {
  const std::size_t tk = static_cast<std::size_t>(mask.total_k);
  std::vector<uint8_t> keep(static_cast<std::size_t>(mask.total_q) * tk, 0);
  for (const Slice& s : mask.slices)
    for (int32_t q = std::max(s.q.start, 0); q < std::min(s.q.end, mask.total_q); ++q)
      for (int32_t k = std::max(s.k.start, 0); k < std::min(s.k.end, mask.total_k); ++k)
        if (slice_keeps(s, q, k)) keep[q * tk + k] = 1;
  return keep;
}

ReferenceForward reference_forward(const ReferenceProblem& p) {
  const Evaluator ev(p);
  const int32_t tq = p.total_q(), hq = p.heads_q, dim = p.head_dim;
  ReferenceForward f;
  f.out.assign(static_cast<std::size_t>(tq) * hq * dim, 0.0);
  f.lse.assign(static_cast<std::size_t>(tq) * hq, kNegInf);
  f.max_logits.assign(hq, kNegInf);
  f.max_logits_magnitude.assign(hq, 0.0);
  for (int32_t t = 0; t < tq; ++t) {
    for (int32_t h = 0; h < hq; ++h) {
      const RowState r = ev.row(t, h);
      f.lse[static_cast<std::size_t>(t) * hq + h] = r.lse;
      for (double s : r.logits) f.max_logits[h] = std::max(f.max_logits[h], s);
      for (int32_t key : r.keys) {
        const double* qr = ev.q_row(t, h);
        const double* kr = ev.k_row(key, ev.kv_head(h));
        double terms = 0.0;
        for (int32_t d = 0; d < dim; ++d) terms += std::fabs(qr[d] * kr[d]);
        f.max_logits_magnitude[h] = std::max(f.max_logits_magnitude[h], ev.scale() * terms);
      }
      double* o = &f.out[ev.index3(t, h, hq)];
      for (std::size_t n = 0; n < r.keys.size(); ++n) {
        const double w = std::exp(r.logits[n] - r.lse);
        const double* vr = ev.v_row(r.keys[n], ev.kv_head(h));
        for (int32_t d = 0; d < dim; ++d) o[d] += w * vr[d];
      }
    }
  }
  return f;
}

ReferenceGrads reference_backward(const ReferenceProblem& p, const std::vector<double>& dout,
                                  const std::vector<double>* given_out) {
  const Evaluator ev(p);
  const int32_t tq = p.total_q(), hq = p.heads_q, dim = p.head_dim;
  ReferenceGrads g;
  g.dq.assign(p.q.size(), 0.0);
  g.dk.assign(p.k.size(), 0.0);
  g.dv.assign(p.v.size(), 0.0);
  g.dsink.assign(p.sink.size(), 0.0);
  g.dsink_magnitude.assign(p.sink.size(), 0.0);
  g.dq_magnitude.assign(p.q.size(), 0.0);
  g.dk_magnitude.assign(p.k.size(), 0.0);
  for (int32_t t = 0; t < tq; ++t) {
    for (int32_t h = 0; h < hq; ++h) {
      const RowState r = ev.row(t, h);
      if (r.lse == kNegInf) continue;  // empty row: every gradient contribution is 0
      const int32_t hk = ev.kv_head(h);
      const double* qr = ev.q_row(t, h);
      const double* dor = &dout[ev.index3(t, h, hq)];

      // P over kept keys (sinks take the rest of the probability mass), out = P V, Delta = dout . out.
      std::vector<double> prob(r.keys.size());
      std::vector<double> out(dim, 0.0);
      for (std::size_t n = 0; n < r.keys.size(); ++n) {
        prob[n] = std::exp(r.logits[n] - r.lse);
        const double* vr = ev.v_row(r.keys[n], hk);
        for (int32_t d = 0; d < dim; ++d) out[d] += prob[n] * vr[d];
      }
      const double* delta_out = given_out ? &(*given_out)[ev.index3(t, h, hq)] : out.data();
      double delta = 0.0;
      for (int32_t d = 0; d < dim; ++d) delta += dor[d] * delta_out[d];

      double* dqr = &g.dq[ev.index3(t, h, hq)];
      double* dq_size = &g.dq_magnitude[ev.index3(t, h, hq)];
      for (std::size_t n = 0; n < r.keys.size(); ++n) {
        const int32_t j = r.keys[n];
        const double* kr = ev.k_row(j, hk);
        const double* vr = ev.v_row(j, hk);
        double* dkr = &g.dk[ev.index3(j, hk, p.heads_kv)];
        double* dvr = &g.dv[ev.index3(j, hk, p.heads_kv)];
        double* dk_size = &g.dk_magnitude[ev.index3(j, hk, p.heads_kv)];
        double dp = 0.0;
        for (int32_t d = 0; d < dim; ++d) dp += dor[d] * vr[d];
        double ds = prob[n] * (dp - delta);  // d loss / d s
        double ds_size = prob[n] * (std::fabs(dp) + std::fabs(delta));
        if (p.softcap > 0.0) {
          const double th = std::tanh(r.raw[n] / p.softcap);
          ds *= 1.0 - th * th;  // d s / d raw
          ds_size *= 1.0 - th * th;
        }
        const double dx = ds * ev.scale();  // d loss / d (q . k)
        const double dx_size = ds_size * std::fabs(ev.scale());
        for (int32_t d = 0; d < dim; ++d) {
          dqr[d] += dx * kr[d];
          dkr[d] += dx * qr[d];
          dvr[d] += prob[n] * dor[d];
          dq_size[d] += dx_size * std::fabs(kr[d]);
          dk_size[d] += dx_size * std::fabs(qr[d]);
        }
      }

      const std::vector<double> sink = ev.sinks(t, h);
      for (int32_t s = 0; s < p.sink_len; ++s) {
        const double ds = -std::exp(sink[s] - r.lse) * delta;
        const std::size_t at = p.sink_layout == SinkLayout::SH
                                   ? static_cast<std::size_t>(s) * hq + h
                                   : (static_cast<std::size_t>(t) * p.sink_len + s) * hq + h;
        g.dsink[at] += ds;
        g.dsink_magnitude[at] += std::fabs(ds);
      }
    }
  }
  return g;
}

}  // namespace magi::test
