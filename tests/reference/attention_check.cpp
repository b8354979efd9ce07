#include "reference/attention_check.hpp"

#include <cmath>
#include <exception>
#include <limits>
#include <sstream>
#include <utility>

#include "magi/error.hpp"
#include "reference/compare.hpp"

namespace magi::test {

namespace {

bool is_16bit(DType d) { return d == DType::BF16 || d == DType::F16; }

}  // namespace

StructuralZeros structural_zeros(const Mask& mask, int32_t heads_q, int32_t heads_kv, int32_t dim) {
  const std::vector<uint8_t> keep = dense_keep(mask);
  const std::size_t tq = mask.total_q, tk = mask.total_k;
  std::vector<uint8_t> row_empty(tq, 1), key_unread(tk, 1);
  for (std::size_t t = 0; t < tq; ++t)
    for (std::size_t k = 0; k < tk; ++k)
      if (keep[t * tk + k]) row_empty[t] = key_unread[k] = 0;
  StructuralZeros z;
  for (std::size_t t = 0; t < tq; ++t) z.q_rows.insert(z.q_rows.end(), static_cast<std::size_t>(heads_q) * dim, row_empty[t]);
  for (std::size_t k = 0; k < tk; ++k) z.k_rows.insert(z.k_rows.end(), static_cast<std::size_t>(heads_kv) * dim, key_unread[k]);
  return z;
}

DType CaseConfig::out_dtype() const { return (fp32_outputs || mixed_buffers) && is_16bit(dtype) ? DType::F32 : dtype; }
DType CaseConfig::dout_dtype() const { return mixed_buffers ? dtype : out_dtype(); }
DType CaseConfig::grad_dtype() const { return out_dtype(); }
DType CaseConfig::dq_dtype() const { return out_dtype(); }
DType CaseConfig::dk_dtype() const { return mixed_buffers ? dtype : out_dtype(); }
DType CaseConfig::dv_dtype() const { return out_dtype(); }
DType CaseConfig::lse_dtype() const { return dtype == DType::F64 && !fp32_lse ? DType::F64 : DType::F32; }
// An fp32 lse limits what fp64 inputs can reach: lse, and the gradients computed from it, get fp32 bounds.
DType CaseConfig::lse_judged_as() const { return dtype == DType::F64 && fp32_lse ? DType::F32 : dtype; }

AttentionOptions CaseConfig::options() const {
  AttentionOptions o;
  o.softmax_scale = softmax_scale;
  o.softcap = softcap;
  o.sink_layout = sink_layout;
  o.backend = backend;
  o.deterministic = deterministic;
  o.num_threads = num_threads;
  return o;
}

std::string CaseConfig::describe() const {
  std::ostringstream os;
  os << "heads " << heads_q << "/" << heads_kv << " D" << head_dim << " " << to_string(dtype);
  if (mixed_buffers) os << " (mixed output dtypes)";
  else if (out_dtype() != dtype) os << " (fp32 outputs)";
  if (fp32_lse) os << " (fp32 lse)";
  if (softmax_scale) os << " scale " << *softmax_scale;
  if (softcap > 0.0) os << " softcap " << softcap;
  if (sink_layout != SinkLayout::None)
    os << " sink " << to_string(sink_layout) << " x" << sink_len << " mean " << sink_mean << (sink_neg_inf ? " with -inf" : "");
  os << " backend " << to_string(backend) << " threads " << num_threads;
  return os.str();
}

CaseData make_case(const Mask& mask, const CaseConfig& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  CaseData d;
  d.mask = mask;
  const int64_t tq = mask.total_q, tk = mask.total_k;
  ReferenceProblem& p = d.problem;
  p.mask = mask;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.head_dim = c.head_dim;
  p.softmax_scale = c.softmax_scale.value_or(0.0);
  p.softcap = c.softcap;
  p.sink_layout = c.sink_layout;
  p.sink_len = c.sink_layout == SinkLayout::None ? 0 : c.sink_len;
  p.q = random_normal(rng, static_cast<std::size_t>(tq * c.heads_q * c.head_dim), c.dtype);
  p.k = random_normal(rng, static_cast<std::size_t>(tk * c.heads_kv * c.head_dim), c.dtype);
  p.v = random_normal(rng, static_cast<std::size_t>(tk * c.heads_kv * c.head_dim), c.dtype);
  d.q = HostTensor::from_values(p.q, c.dtype, {tq, c.heads_q, c.head_dim});
  d.k = HostTensor::from_values(p.k, c.dtype, {tk, c.heads_kv, c.head_dim});
  d.v = HostTensor::from_values(p.v, c.dtype, {tk, c.heads_kv, c.head_dim});
  if (c.sink_layout != SinkLayout::None) {
    std::vector<int64_t> shape = c.sink_layout == SinkLayout::SH ? std::vector<int64_t>{c.sink_len, c.heads_q}
                                                                  : std::vector<int64_t>{tq, c.sink_len, c.heads_q};
    std::size_t n = 1;
    for (int64_t s : shape) n *= static_cast<std::size_t>(s);
    // Shifted up so that the sinks carry a noticeable share of each row's probability mass.
    p.sink = random_normal(rng, n, DType::F32);
    for (double& s : p.sink) s = round_to(DType::F32, s + c.sink_mean);
    if (c.sink_neg_inf) {
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t head = i % c.heads_q, index = (i / c.heads_q) % c.sink_len;
        if (head == 0 || index == 0) p.sink[i] = -std::numeric_limits<double>::infinity();
      }
    }
    d.sink = HostTensor::from_values(p.sink, DType::F32, shape);
  }
  d.dout = random_normal(rng, static_cast<std::size_t>(tq * c.heads_q * c.head_dim), c.dout_dtype());
  d.dout_tensor = HostTensor::from_values(d.dout, c.dout_dtype(), {tq, c.heads_q, c.head_dim});
  return d;
}

std::string invalid_argument_message(const std::function<void()>& call) {
  try {
    call();
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not InvalidArgument> ") + e.what();
  }
  return "<no exception>";
}

EngineResult run_forward(CaseData& d, const CaseConfig& c) {
  const int64_t tq = d.mask.total_q;
  EngineResult r;
  r.out = HostTensor::poisoned(c.out_dtype(), {tq, c.heads_q, c.head_dim});
  r.lse = HostTensor::poisoned(c.lse_dtype(), {tq, c.heads_q});
  if (c.max_logits) r.max_logits = HostTensor::poisoned(DType::F32, {c.heads_q});
  ForwardArgs args;
  args.q = d.q.view();
  args.k = d.k.view();
  args.v = d.v.view();
  args.sink = d.sink.view();
  args.out = r.out.view();
  args.lse = r.lse.view();
  args.max_logits = r.max_logits.view();
  magi::forward(d.mask, args, c.options());
  return r;
}

void run_backward(CaseData& d, const CaseConfig& c, EngineResult& r) {
  r.dq = HostTensor::poisoned(c.dq_dtype(), d.q.shape());
  r.dk = HostTensor::poisoned(c.dk_dtype(), d.k.shape());
  r.dv = HostTensor::poisoned(c.dv_dtype(), d.v.shape());
  if (d.sink.defined()) r.dsink = HostTensor::poisoned(DType::F32, d.sink.shape());
  BackwardArgs args;
  args.q = d.q.view();
  args.k = d.k.view();
  args.v = d.v.view();
  args.out = r.out.view();
  args.lse = r.lse.view();
  args.dout = d.dout_tensor.view();
  args.sink = d.sink.view();
  args.dq = r.dq.view();
  args.dk = r.dk.view();
  args.dv = r.dv.view();
  args.dsink = r.dsink.view();
  magi::backward(d.mask, args, c.options());
}

testing::AssertionResult judge_forward(const CaseData& d, const CaseConfig& c, const EngineResult& r,
                                       std::string_view context) {
  const ReferenceForward ref = reference_forward(d.problem);
  const StructuralZeros zeros = structural_zeros(d.mask, c.heads_q, c.heads_kv, c.head_dim);
  if (auto ok = check_close("out", r.out.values(), ref.out, Quantity::Out, c.dtype, context, zeros.q_rows); !ok)
    return ok;
  if (auto ok = check_close("lse", r.lse.values(), ref.lse, Quantity::Lse, c.lse_judged_as(), context); !ok) return ok;
  if (c.max_logits)
    return check_max_logits(r.max_logits.values(), ref.max_logits, ref.max_logits_magnitude, c.dtype, context);
  return testing::AssertionSuccess();
}

testing::AssertionResult judge_backward(const CaseData& d, const CaseConfig& c, const EngineResult& r,
                                        std::string_view context, const std::vector<double>& dq_start) {
  const std::vector<double> given_out = r.out.values();
  const ReferenceGrads g = reference_backward(d.problem, d.dout, &given_out);
  const StructuralZeros zeros = structural_zeros(d.mask, c.heads_q, c.heads_kv, c.head_dim);
  const DType judged = c.lse_judged_as();
  std::vector<double> dq = r.dq.values();
  if (!dq_start.empty()) {
    if (dq_start.size() != dq.size())
      return testing::AssertionFailure() << "dq_start has " << dq_start.size() << " values, dq " << dq.size();
    for (std::size_t i = 0; i < dq.size(); ++i) dq[i] -= dq_start[i];
  }
  if (auto ok = check_grad_cancelling("dq", dq, g.dq, g.dq_magnitude, judged, context, zeros.q_rows); !ok) return ok;
  if (auto ok = check_grad_cancelling("dk", r.dk.values(), g.dk, g.dk_magnitude, judged, context, zeros.k_rows); !ok)
    return ok;
  if (auto ok = check_close("dv", r.dv.values(), g.dv, Quantity::Grad, judged, context, zeros.k_rows); !ok) return ok;
  if (d.sink.defined())
    return check_dsink(r.dsink.values(), g.dsink, g.dsink_magnitude, judged, context);
  return testing::AssertionSuccess();
}

testing::AssertionResult check_case(const Mask& mask, const CaseConfig& c, uint64_t seed, std::string_view name) {
  std::ostringstream context_stream;
  context_stream << "case " << name << ", " << c.describe() << ", seed " << seed;
  const std::string context = context_stream.str();

  CaseData d = make_case(mask, c, seed);
  const CaseData pristine = d;
  auto inputs_untouched = [&]() -> testing::AssertionResult {
    const std::pair<const HostTensor*, const HostTensor*> inputs[] = {
        {&d.q, &pristine.q}, {&d.k, &pristine.k}, {&d.v, &pristine.v}, {&d.sink, &pristine.sink},
        {&d.dout_tensor, &pristine.dout_tensor}};
    for (const auto& [now, before] : inputs)
      if (now->bytes() != before->bytes())
        return testing::AssertionFailure() << "an input tensor was modified by the engine [" << context << "]";
    return testing::AssertionSuccess();
  };
  EngineResult r;
  try {
    r = run_forward(d, c);
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "forward threw: " << e.what() << " [" << context << "]";
  }
  if (auto ok = judge_forward(d, c, r, context); !ok) return ok;
  if (auto ok = inputs_untouched(); !ok) return ok;
  if (!c.backward) return testing::AssertionSuccess();

  const HostTensor out_before = r.out, lse_before = r.lse;
  try {
    run_backward(d, c, r);
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "backward threw: " << e.what() << " [" << context << "]";
  }
  if (auto ok = judge_backward(d, c, r, context); !ok) return ok;
  if (auto ok = inputs_untouched(); !ok) return ok;
  if (r.out.bytes() != out_before.bytes() || r.lse.bytes() != lse_before.bytes())
    return testing::AssertionFailure() << "backward modified its inputs out/lse [" << context << "]";
  return testing::AssertionSuccess();
}

MaskFactory fixed_mask(Mask mask) {
  return [mask](std::mt19937_64&) { return mask; };
}

MaskFactory random_rectangles_mask(int32_t total_q, int32_t total_k, int32_t slices) {
  return [=](std::mt19937_64& rng) { return random_rectangles(rng, total_q, total_k, slices); };
}

std::string case_name(std::string_view mask_name, const CaseConfig& c) {
  std::ostringstream os;
  os << mask_name << "_" << to_string(c.dtype) << "_h" << c.heads_q << "x" << c.heads_kv << "_d" << c.head_dim;
  if (c.softcap > 0.0) os << "_softcap";
  if (c.sink_layout != SinkLayout::None) os << "_sink" << to_string(c.sink_layout) << c.sink_len;
  if (c.mixed_buffers) os << "_mixedbuffers";
  else if (c.out_dtype() != c.dtype) os << "_fp32out";
  if (c.fp32_lse) os << "_fp32lse";
  if (c.sink_neg_inf) os << "_neginfsink";
  if (c.sink_layout != SinkLayout::None && c.sink_mean != 3.0) os << "_sinkmean" << (c.sink_mean < 0 ? "m" : "") << static_cast<int>(std::fabs(c.sink_mean));
  if (c.softmax_scale) os << "_scaled";
  if (!c.max_logits) os << "_nomaxlogits";
  if (c.backend != Backend::Cpu) os << "_" << to_string(c.backend);
  return os.str();
}

CaseConfig config_for(DType dtype, int32_t heads_q, int32_t heads_kv, int32_t head_dim) {
  CaseConfig c;
  c.dtype = dtype;
  c.heads_q = heads_q;
  c.heads_kv = heads_kv;
  c.head_dim = head_dim;
  return c;
}

testing::AssertionResult run_engine_case(const EngineCase& c) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);  // the mask's stream, distinct from the tensors'
  const Mask mask = c.mask(rng);
  testing::AssertionResult result = check_case(mask, c.config, seed, c.name);
  if (!result && mask.slices.size() <= 200) result << "\nmask: " << mask_to_json(mask);
  return result;
}

EngineCase random_engine_case(std::mt19937_64& rng, int32_t max_tokens, bool backward) {
  auto uniform = [&](int32_t lo, int32_t hi) { return std::uniform_int_distribution<int32_t>(lo, hi)(rng); };
  struct Heads {
    int32_t q, kv;
  };
  const Heads heads[] = {{1, 1}, {2, 1}, {2, 2}, {4, 2}, {3, 3}, {6, 2}, {8, 1}};
  const DType dtypes[] = {DType::F64, DType::F32, DType::BF16, DType::F16};
  const Heads h = heads[uniform(0, 6)];
  CaseConfig c = config_for(dtypes[uniform(0, 3)], h.q, h.kv, 8 * uniform(1, 16));
  c.backward = backward;
  if (uniform(0, 2) == 0) c.softcap = 0.5 + uniform(0, 40) / 10.0;
  if (uniform(0, 2) == 0) {
    c.sink_layout = uniform(0, 1) ? SinkLayout::SH : SinkLayout::SSH;
    c.sink_len = uniform(1, 8);
  }
  if (uniform(0, 3) == 0) c.fp32_outputs = true;
  if (uniform(0, 4) == 0) c.softmax_scale = uniform(1, 30) / 100.0;
  if (c.dtype == DType::F64 && uniform(0, 3) == 0) c.fp32_lse = true;
  const int32_t tq = uniform(1, max_tokens), tk = uniform(1, max_tokens);
  // The mask (random_mask's kinds) is drawn from the case's own seed; the name gives the grid it starts from.
  const std::string name = "fuzz_" + std::to_string(tq) + "x" + std::to_string(tk);
  return {case_name(name, c), [tq, tk](std::mt19937_64& case_rng) { return random_mask(case_rng, tq, tk).mask; }, c};
}

}  // namespace magi::test
