// Distributed attention under mpirun against the single-device API (magi::forward / magi::backward,
// Backend::Reference): SPEC section 7's distributed cases scaled to CPU size (with the forward's in-place
// and out-of-place merge), overlap degrees, reduce precision, sinks with each dsink op, determinism, the
// runtime LRU and mismatched configs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <tuple>

#include "comm/mpi_test_main.hpp"
#include "distributed/runtime.hpp"
#include "distributed/timeline.hpp"
#include "magi/dist.hpp"
#include "magi/env.hpp"
#include "reference/random_inputs.hpp"

namespace magi::dist {
namespace {

using test::HostTensor;
using test::world;

struct Case {
  std::string name;
  Mask mask;
  HeadShape heads{2, 2, 32};
  DType dtype = DType::F64;
  int32_t chunk_size = 64;
  int32_t overlap_degree = 1;
  SinkLayout sink = SinkLayout::None;
  DsinkReduceOp dsink_op = DsinkReduceOp::None;
  bool high_precision = false;
  DispatchAlgorithm algorithm = DispatchAlgorithm::GreedySwap;
  int32_t ranks_per_node = 0;  // > 0: hierarchical comm
  bool env_options = false;    // leave the dsink op, hierarchical comm and routes to the environment
  bool qo_comm = false, flatten = false, forward_high_precision = false;  // routes (qo_plan.hpp)
  Backend backend = Backend::Reference;
  std::optional<bool> deterministic;
  std::optional<DType> results;  // out, dq, dk, dv in this dtype (else the inputs')
};

struct Global {
  HostTensor q, k, v, dout, sink;
};

// Sets one environment variable for a scope (the registry re-reads the environment).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    setenv(name, value, 1);
    env::reset_for_testing();
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    unsetenv(name_);
    env::reset_for_testing();
  }

 private:
  const char* name_;
};

// Same values on every rank (same seed).
Global make_inputs(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t tq = c.mask.total_q, tk = c.mask.total_k, hq = c.heads.heads_q, hkv = c.heads.heads_kv,
                d = c.heads.head_dim;
  Global g;
  g.q = HostTensor::from_values(test::random_normal(rng, static_cast<size_t>(tq * hq * d), c.dtype), c.dtype, {tq, hq, d});
  g.k = HostTensor::from_values(test::random_normal(rng, static_cast<size_t>(tk * hkv * d), c.dtype), c.dtype, {tk, hkv, d});
  g.v = HostTensor::from_values(test::random_normal(rng, static_cast<size_t>(tk * hkv * d), c.dtype), c.dtype, {tk, hkv, d});
  g.dout = HostTensor::from_values(test::random_normal(rng, static_cast<size_t>(tq * hq * d), c.dtype), c.dtype, {tq, hq, d});
  if (c.sink == SinkLayout::SH)
    g.sink = HostTensor::from_values(test::random_normal(rng, static_cast<size_t>(2 * hq), DType::F32), DType::F32, {2, hq});
  if (c.sink == SinkLayout::SSH)
    g.sink = HostTensor::from_values(test::random_normal(rng, static_cast<size_t>(tq * 2 * hq), DType::F32), DType::F32,
                                     {tq, 2, hq});
  return g;
}

struct Outputs {
  HostTensor out, lse, max_logits, dq, dk, dv, dsink;
};

DType lse_dtype(DType dtype) { return dtype == DType::F64 ? DType::F64 : DType::F32; }

AttentionOptions options_of(const Case& c) {
  AttentionOptions o;
  o.backend = c.backend;
  o.deterministic = c.deterministic;
  o.sink_layout = c.sink;
  o.num_threads = 1;
  return o;
}

Outputs single_device(const Case& c, Global& g) {
  const int64_t tq = c.mask.total_q, tk = c.mask.total_k, hq = c.heads.heads_q, hkv = c.heads.heads_kv,
                d = c.heads.head_dim;
  const DType rd = c.results.value_or(c.dtype);
  Outputs r;
  r.out = HostTensor::poisoned(rd, {tq, hq, d});
  r.lse = HostTensor::poisoned(lse_dtype(c.dtype), {tq, hq});
  r.max_logits = HostTensor::poisoned(DType::F32, {hq});
  ForwardArgs f{g.q.view(), g.k.view(), g.v.view(), g.sink.view(), r.out.view(), r.lse.view(), r.max_logits.view()};
  forward(c.mask, f, options_of(c));
  r.dq = HostTensor::poisoned(rd, {tq, hq, d});
  r.dk = HostTensor::poisoned(rd, {tk, hkv, d});
  r.dv = HostTensor::poisoned(rd, {tk, hkv, d});
  if (g.sink.defined()) r.dsink = HostTensor::poisoned(DType::F32, g.sink.shape());
  BackwardArgs b{g.q.view(), g.k.view(), g.v.view(), r.out.view(), r.lse.view(), g.dout.view(), g.sink.view(),
                 r.dq.view(), r.dk.view(), r.dv.view(), r.dsink.view()};
  backward(c.mask, b, options_of(c));
  return r;
}

HostTensor local_of(const RuntimeKey& key, Axis axis, HostTensor& global) {
  auto shape = global.shape();
  shape[0] = axis == Axis::Q ? key.local_q_tokens() : key.local_k_tokens();
  HostTensor local = HostTensor::poisoned(global.dtype(), shape);
  dispatch(key, axis, global.view(), local.view());
  return local;
}

HostTensor global_of(const RuntimeKey& key, Axis axis, HostTensor& local, int64_t total) {
  auto shape = local.shape();
  shape[0] = total;
  HostTensor global = HostTensor::poisoned(local.dtype(), shape);
  undispatch(key, axis, local.view(), global.view());
  return global;
}

DistConfig config_of(const Case& c) {
  DistConfig config;
  config.chunk_size = c.chunk_size;
  config.overlap_degree = c.overlap_degree;
  config.algorithm = c.algorithm;
  config.attention = options_of(c);
  config.backward_high_precision_reduce = c.high_precision;
  config.comm_timeout_seconds = 120;
  if (c.env_options) return config;
  config.qo_comm = c.qo_comm;
  config.flatten_head_groups = c.flatten;
  config.forward_high_precision_reduce = c.forward_high_precision;
  config.dsink_reduce_op = c.dsink_op;
  config.hierarchical_comm = c.ranks_per_node > 0;
  config.ranks_per_node = c.ranks_per_node;
  return config;
}

// Runs forward and backward distributed; returns global out/lse/dq/dk/dv and this rank's dsink.
Outputs distributed(const Case& c, Global& g) {
  const RuntimeKey key = make_runtime_key(c.mask, c.heads, test::world_ptr(), config_of(c));
  const int64_t lq = key.local_q_tokens(), lk = key.local_k_tokens(), hq = c.heads.heads_q, hkv = c.heads.heads_kv,
                d = c.heads.head_dim;
  HostTensor q = local_of(key, Axis::Q, g.q), k = local_of(key, Axis::K, g.k), v = local_of(key, Axis::K, g.v);
  HostTensor dout = local_of(key, Axis::Q, g.dout);
  HostTensor sink;
  if (c.sink == SinkLayout::SH) sink = g.sink;
  if (c.sink == SinkLayout::SSH) sink = local_of(key, Axis::Q, g.sink);
  const DType rd = c.results.value_or(c.dtype);
  HostTensor out = HostTensor::poisoned(rd, {lq, hq, d}), lse = HostTensor::poisoned(lse_dtype(c.dtype), {lq, hq});
  HostTensor max_logits = HostTensor::poisoned(DType::F32, {hq});
  calc_attn(key, ForwardArgs{q.view(), k.view(), v.view(), sink.view(), out.view(), lse.view(), max_logits.view(), {}, {}});
  HostTensor dq = HostTensor::poisoned(rd, {lq, hq, d}), dk = HostTensor::poisoned(rd, {lk, hkv, d}),
             dv = HostTensor::poisoned(rd, {lk, hkv, d});
  HostTensor dsink;
  if (sink.defined()) dsink = HostTensor::poisoned(DType::F32, sink.shape());
  calc_attn_backward(key, BackwardArgs{q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), sink.view(),
                                       dq.view(), dk.view(), dv.view(), dsink.view()});
  Outputs r;
  r.max_logits = max_logits;
  r.out = global_of(key, Axis::Q, out, c.mask.total_q);
  r.lse = global_of(key, Axis::Q, lse, c.mask.total_q);
  r.dq = global_of(key, Axis::Q, dq, c.mask.total_q);
  r.dk = global_of(key, Axis::K, dk, c.mask.total_k);
  r.dv = global_of(key, Axis::K, dv, c.mask.total_k);
  if (c.sink == SinkLayout::SSH) r.dsink = global_of(key, Axis::Q, dsink, c.mask.total_q);
  else r.dsink = dsink;
  return r;
}

// Max abs error relative to max |ref| (SPEC section 5 for fp64; a relative bound for other dtypes).
void expect_close(const HostTensor& got, const HostTensor& ref, double tolerance, const std::string& what) {
  const auto a = got.values(), b = ref.values();
  ASSERT_EQ(a.size(), b.size()) << what;
  double scale = 0, err = 0;
  for (double x : b)
    if (std::isfinite(x)) scale = std::max(scale, std::abs(x));
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(b[i])) {
      ASSERT_EQ(a[i], b[i]) << what << " at " << i << " (must be -inf exactly)";
      continue;
    }
    ASSERT_TRUE(std::isfinite(a[i])) << what << " at " << i << " is " << a[i];
    err = std::max(err, std::abs(a[i] - b[i]));
  }
  EXPECT_LE(err, tolerance * std::max(scale, 1e-300)) << what << ": max abs error " << err << ", max |ref| " << scale;
}

double tolerance_of(DType dtype) { return dtype == DType::F64 ? 1e-10 : dtype == DType::F32 ? 1e-5 : 2e-2; }

void check_case(const Case& c) {
  const uint64_t seed = test::shared_seed();
  SCOPED_TRACE(c.name + ", cp " + std::to_string(world().size()) + ", ranks/node " + std::to_string(c.ranks_per_node) +
               ", degree " + std::to_string(c.overlap_degree) +
               ", chunk " + std::to_string(c.chunk_size) + ", seed " + std::to_string(seed));
  Global g = make_inputs(c, seed);
  const Outputs ref = single_device(c, g);
  const Outputs got = distributed(c, g);
  const double tol = tolerance_of(c.dtype);
  expect_close(got.out, ref.out, tol, "out");
  expect_close(got.lse, ref.lse, c.dtype == DType::F64 ? 1e-10 : 1e-5, "lse");
  expect_close(got.max_logits, ref.max_logits, 1e-6, "max_logits (global max over ranks)");
  expect_close(got.dq, ref.dq, tol, "dq");
  expect_close(got.dk, ref.dk, tol, "dk");
  expect_close(got.dv, ref.dv, tol, "dv");
  // dsink sums over rows of products with out and dout: fp32-level for fp64 inputs, the grads' bound otherwise.
  const double dsink_tol = c.dtype == DType::F64 ? 1e-5 : tol;
  if (c.sink == SinkLayout::SSH) expect_close(got.dsink, ref.dsink, dsink_tol, "dsink (ssh)");
  if (c.sink == SinkLayout::SH) {
    // Each rank holds a partial; the op decides what it returns.
    const auto mine = got.dsink.values();
    std::vector<double> all(mine.size() * static_cast<size_t>(world().size()));
    world().allgather(mine.data(), static_cast<int64_t>(mine.size() * sizeof(double)), all.data());
    std::vector<double> sum(mine.size(), 0.0);
    for (int32_t r = 0; r < world().size(); ++r)
      for (size_t i = 0; i < mine.size(); ++i) sum[i] += all[r * mine.size() + i];
    const auto expected = ref.dsink.values();
    const double cp = world().size();
    for (size_t i = 0; i < expected.size(); ++i) {
      const double bound = dsink_tol * (1 + std::abs(expected[i]));
      if (c.dsink_op == DsinkReduceOp::None) EXPECT_NEAR(sum[i], expected[i], bound * cp) << "dsink partials " << i;
      if (c.dsink_op == DsinkReduceOp::Sum) EXPECT_NEAR(mine[i], expected[i], bound) << "dsink sum " << i;
      if (c.dsink_op == DsinkReduceOp::Avg) EXPECT_NEAR(mine[i], expected[i] / cp, bound) << "dsink avg " << i;
    }
  }
}

Mask varlen_full_12() {  // "varlen full 12k" scaled: 10 uneven documents
  return masks::varlen_full(test::cu_seqlens_of({130, 17, 260, 96, 41, 300, 77, 12, 190, 77}));
}
Mask varlen_block_causal_15() {
  return masks::varlen_block_causal(test::cu_seqlens_of({300, 190, 45, 410, 255}), 64);
}
Mask q_overlap_12() {  // several slices sharing q rows, all types
  using test::make_slice;
  Mask m{{make_slice(0, 400, 0, 200, MaskType::Full), make_slice(0, 400, 200, 600, MaskType::Causal),
          make_slice(400, 800, 0, 300, MaskType::InvCausal), make_slice(400, 800, 300, 700, MaskType::BiCausal),
          make_slice(400, 800, 700, 800, MaskType::Full), make_slice(100, 300, 600, 800, MaskType::Full)},
         800, 800};
  return m;
}
Mask mixed_types_10() {
  using test::make_slice;
  return Mask{{make_slice(0, 250, 0, 250, MaskType::Causal), make_slice(250, 500, 0, 250, MaskType::Full),
               make_slice(250, 500, 250, 500, MaskType::InvCausal), make_slice(500, 700, 100, 600, MaskType::BiCausal),
               make_slice(700, 700, 0, 10, MaskType::Full)},
              700, 700};
}
Mask small_slices_full() {  // "128 small slices forming a full mask"
  Mask m{{}, 512, 512};
  for (int32_t i = 0; i < 16; ++i)
    for (int32_t j = 0; j < 8; ++j) m.slices.push_back(test::make_slice(i * 32, i * 32 + 32, j * 64, j * 64 + 64, MaskType::Full));
  return m;
}

std::vector<Case> section7_cases(uint64_t mask_seed) {
  std::mt19937_64 mask_rng(mask_seed);
  return {
      {"full", masks::full(640, 640)},
      {"causal", masks::causal(700, 700), {2, 2, 64}},
      {"varlen full", varlen_full_12(), {2, 1, 32}},
      {"varlen block-causal", varlen_block_causal_15()},
      {"q-overlap", q_overlap_12(), {4, 2, 32}},
      {"mixed types", mixed_types_10()},
      {"128 small slices forming full", small_slices_full()},
      {"random rectangles, q/k lengths 500/550, mask seed " + std::to_string(mask_seed),
       test::random_rectangles(mask_rng, 500, 550, 40)},
      {"uneven varlen causal 1111, chunk 63", masks::varlen_causal(test::cu_seqlens_of({400, 311, 200, 200})),
       {2, 2, 32}, DType::F64, 63},
      {"uneven causal 1111, chunk 253", masks::causal(1111, 1111), {2, 2, 32}, DType::F64, 253},
      {"disjoint ranges, uncovered rows", test::cases::disjoint_uncovered()},
      {"bi-causal with Sq > Sk (empty rows)", test::cases::causal_sq_gt_sk(MaskType::BiCausal)},
      {"no slices at all", Mask{{}, 300, 300}},
      {"uneven sliding window 1000, chunk 111", masks::sliding_window(1000, 100, 20), {2, 2, 32}, DType::F64, 111},
  };
}

// Both forward merges (MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT 1, the default, and 0): out, lse, max_logits
// and the gradients match the single device.
TEST(DistAttn, Section7CasesMatchSingleDevice) {
  const uint64_t mask_seed = test::shared_seed();  // the random mask is the same on every rank
  for (const char* in_place : {"1", "0"}) {
    const ScopedEnv inplace_env("MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT", in_place);
    for (const Case& c : section7_cases(mask_seed)) {
      SCOPED_TRACE(std::string("MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT=") + in_place);
      check_case(c);
      if (HasFatalFailure()) return;
    }
  }
}

// The switch is read when the runtime is keyed: each setting is its own cached runtime. Each setting matches the
// single device in every dtype with both sink layouts, and is bitwise reproducible (deterministic mode). The two
// settings are bitwise equal for fp64 inputs (fp64 running result, the same merge arithmetic); for fp32 / bf16
// the in-place running result is rounded to fp32 between stages, so they only agree within the bounds.
TEST(DistAttn, ForwardInplaceCorrectBothSettings) {
  const uint64_t seed = test::shared_seed();
  const ScopedEnv deterministic("MAGI_ATTENTION_DETERMINISTIC_MODE", "1");
  for (DType dtype : {DType::F64, DType::F32, DType::BF16})
    for (SinkLayout sink : {SinkLayout::SH, SinkLayout::SSH}) {
      Case c{"q-overlap " + std::string(to_string(dtype)) + (sink == SinkLayout::SH ? " sh sink" : " ssh sink"),
             q_overlap_12(), {4, 2, 32}};
      c.dtype = dtype;
      c.sink = sink;
      c.dsink_op = DsinkReduceOp::Sum;
      c.overlap_degree = 3;
      c.chunk_size = 50;
      Global g = make_inputs(c, seed);
      std::vector<Outputs> first;
      const DistAttnRuntime* runtimes[2] = {};
      for (bool in_place : {false, true}) {
        const ScopedEnv inplace_env("MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT", in_place ? "1" : "0");
        SCOPED_TRACE(c.name + (in_place ? ", in place" : ", out of place") + ", seed " + std::to_string(seed));
        const RuntimeKey key = make_runtime_key(c.mask, c.heads, test::world_ptr(), config_of(c));
        EXPECT_EQ(key.runtime().forward_inplace_correct(), in_place);
        runtimes[in_place] = &key.runtime();
        check_case(c);
        const Outputs a = distributed(c, g), b = distributed(c, g);
        for (auto [x, y, name] : {std::tuple{&a.out, &b.out, "out"}, {&a.lse, &b.lse, "lse"},
                                  {&a.max_logits, &b.max_logits, "max_logits"}, {&a.dq, &b.dq, "dq"},
                                  {&a.dk, &b.dk, "dk"}, {&a.dv, &b.dv, "dv"}, {&a.dsink, &b.dsink, "dsink"}})
          EXPECT_EQ(x->bytes(), y->bytes()) << name << " differs between two runs";
        first.push_back(a);
      }
      EXPECT_NE(runtimes[0], runtimes[1]) << "the switch is part of the runtime key";
      fprintf(stderr, "DIAG %s out equal %d lse equal %d\n", c.name.c_str(), first[0].out.bytes() == first[1].out.bytes(), first[0].lse.bytes() == first[1].lse.bytes());
      if (dtype == DType::F64) {
        EXPECT_EQ(first[0].out.bytes(), first[1].out.bytes()) << c.name << ": in place vs out of place, out";
        EXPECT_EQ(first[0].lse.bytes(), first[1].lse.bytes()) << c.name << ": in place vs out of place, lse";
      }
      if (HasFatalFailure()) return;
    }
}

TEST(DistAttn, OverlapDegreesAndDispatchAlgorithms) {
  for (int32_t degree : {0, 1, 2, 4})
    for (auto algorithm : {DispatchAlgorithm::Greedy, DispatchAlgorithm::GreedySwap}) {
      Case c{"varlen causal", masks::varlen_causal(test::cu_seqlens_of({200, 33, 180, 300, 90}))};
      c.overlap_degree = degree;
      c.algorithm = algorithm;
      c.chunk_size = 41;
      check_case(c);
      if (HasFatalFailure()) return;
    }
}

TEST(DistAttn, LowPrecisionWithAndWithoutFp32Reduce) {
  for (DType dtype : {DType::BF16, DType::F32})
    for (bool high : {false, true}) {
      Case c{"causal " + std::string(to_string(dtype)) + (high ? " fp32 reduce" : " input-dtype reduce"),
             masks::causal(600, 600)};
      c.dtype = dtype;
      c.high_precision = high;
      c.overlap_degree = 2;
      check_case(c);
      if (HasFatalFailure()) return;
    }
}

// SPEC section 5: the distributed max error is at most twice the single device's, also where the caller asks for
// fp32 results of 16-bit inputs; the partial dk / dv (and out, dq of the q/out route) then cross the wire in fp32.
// Rounded to the inputs' precision on the wire they were ~200-1800x the single device's error (bf16, cp 4).
double max_abs_error(const HostTensor& got, const HostTensor& ref) {
  const auto a = got.values(), b = ref.values();
  double err = 0;
  for (size_t i = 0; i < a.size(); ++i) err = std::max(err, std::isfinite(a[i]) ? std::abs(a[i] - b[i]) : HUGE_VAL);
  return err;
}

TEST(DistAttn, Fp32ResultsOfLowPrecisionInputsKeepTheSingleDeviceError) {
  const uint64_t seed = test::shared_seed();
  for (DType dtype : {DType::BF16, DType::F16})
    for (bool qo : {false, true}) {
      Case c{std::string(to_string(dtype)) + " inputs, fp32 results" + (qo ? ", q/out route" : ""),
             masks::varlen_causal(test::cu_seqlens_of({300, 211, 189})), {4, 2, 32}, dtype, 35};
      c.results = DType::F32;
      c.qo_comm = qo;
      c.backend = Backend::Cpu;
      SCOPED_TRACE(c.name + ", cp " + std::to_string(world().size()) + ", seed " + std::to_string(seed));
      Global g = make_inputs(c, seed);
      // The fp64 reference on the same (rounded) inputs.
      Case r = c;
      r.dtype = DType::F64;
      r.results.reset();
      r.backend = Backend::Reference;
      Global g64;
      for (auto [from, to] : {std::pair{&g.q, &g64.q}, {&g.k, &g64.k}, {&g.v, &g64.v}, {&g.dout, &g64.dout}})
        *to = HostTensor::from_values(from->values(), DType::F64, from->shape());
      const Outputs ref = single_device(r, g64), one = single_device(c, g), got = distributed(c, g);
      for (auto [name, a, b, x] : {std::tuple{"out", &got.out, &one.out, &ref.out}, {"dq", &got.dq, &one.dq, &ref.dq},
                                   {"dk", &got.dk, &one.dk, &ref.dk}, {"dv", &got.dv, &one.dv, &ref.dv}}) {
        const double dist_err = max_abs_error(*a, *x), one_err = max_abs_error(*b, *x);
        EXPECT_GT(one_err, 0.0) << name;  // else the bound below says nothing
        EXPECT_LE(dist_err, 2 * one_err) << name << ": distributed " << dist_err << ", one device " << one_err;
      }
      if (HasFailure()) return;
    }
}

TEST(DistAttn, SinkWithEachDsinkOp) {
  for (auto op : {DsinkReduceOp::None, DsinkReduceOp::Sum, DsinkReduceOp::Avg}) {
    Case c{"full with sh sink", masks::varlen_causal(test::cu_seqlens_of({250, 150, 200}))};
    c.sink = SinkLayout::SH;
    c.dsink_op = op;
    check_case(c);
    if (HasFatalFailure()) return;
  }
  Case c{"full with ssh sink", masks::full(400, 400)};
  c.sink = SinkLayout::SSH;
  c.overlap_degree = 2;
  check_case(c);
}

TEST(DistAttn, HierarchicalCommMatchesSingleDevice) {
  // Every way to cut this cp into equal nodes of consecutive ranks (cp 4: 4x1, 2x2, 1x4).
  for (int32_t per_node = 1; per_node <= world().size(); ++per_node) {
    if (world().size() % per_node != 0) continue;
    for (DType dtype : {DType::F64, DType::BF16}) {
      Case c{"hierarchical varlen causal " + std::string(to_string(dtype)),
             masks::varlen_causal(test::cu_seqlens_of({260, 45, 300, 120, 90}))};
      c.ranks_per_node = per_node;
      c.dtype = dtype;
      c.overlap_degree = 2;
      c.chunk_size = 37;
      check_case(c);
      if (HasFatalFailure()) return;
    }
  }
  if (world().size() == 4) {  // the 2 x 2 case with the remaining configuration axes
    Case c{"hierarchical 2x2 q-overlap with sh sink", q_overlap_12(), {4, 2, 32}};
    c.ranks_per_node = 2;
    c.sink = SinkLayout::SH;
    c.dsink_op = DsinkReduceOp::Sum;
    c.overlap_degree = 4;
    check_case(c);
  }
}

TEST(DistAttn, HierarchicalCommRejectsNodesThatDoNotDivideCp) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  DistConfig config = config_of(Case{"", masks::full(64, 64)});
  config.hierarchical_comm = true;
  config.ranks_per_node = world().size() + 1;
  EXPECT_THROW(make_runtime_key(masks::full(64, 64), {2, 2, 32}, test::world_ptr(), config), InvalidArgument);
}

TEST(DistAttn, NegativeRanksPerNodeIsRefusedOnEveryRank) {
  DistConfig config = config_of(Case{"", masks::full(64, 64)});
  config.ranks_per_node = -1;
  EXPECT_THROW(make_runtime_key(masks::full(64, 64), {2, 2, 32}, test::world_ptr(), config), InvalidArgument);
}

// Key options checked when the key is made, on every rank: a chunk far longer than the sequence (it only pads every
// rank's share: 2^29 asked for 137 GB), a NaN softmax_scale or softcap (else only ranks with work would throw).
TEST(DistAttn, KeyOptionsAreCheckedWhenTheKeyIsMade) {
  const Mask mask = masks::full(256, 256);
  DistConfig config = config_of(Case{"", mask});
  config.chunk_size = 1 << 29;
  EXPECT_THROW(make_runtime_key(mask, {2, 2, 32}, test::world_ptr(), config), InvalidArgument);
  config.chunk_size = 512;  // longer than the sequence, within 16384: still valid
  EXPECT_NO_THROW(make_runtime_key(mask, {2, 2, 32}, test::world_ptr(), config));
  config.attention.softmax_scale = std::nan("");
  EXPECT_THROW(make_runtime_key(mask, {2, 2, 32}, test::world_ptr(), config), InvalidArgument);
  config.attention.softmax_scale.reset();
  config.attention.softcap = std::nan("");
  EXPECT_THROW(make_runtime_key(mask, {2, 2, 32}, test::world_ptr(), config), InvalidArgument);
}

// Ranks whose tensors or roll shift differ would break the exchange (gloo aborts the process): every rank throws.
TEST(DistAttn, RanksDisagreeingOnTensorsThrowOnEveryRank) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  const Mask mask = masks::causal(256, 256);
  const auto key = make_runtime_key(mask, {2, 2, 32}, test::world_ptr(), config_of(Case{"", mask}));
  const int64_t width = world().rank() == 0 ? 4 : 8;
  HostTensor local = HostTensor::poisoned(DType::F32, {key.local_q_tokens(), width});
  HostTensor global = HostTensor::poisoned(DType::F32, {256, width});
  EXPECT_THROW(undispatch(key, Axis::Q, local.view(), global.view()), InvalidArgument);
  HostTensor same = HostTensor::poisoned(DType::F32, {key.local_q_tokens(), 4}), rolled = same;
  EXPECT_THROW(roll(key, Axis::Q, same.view(), rolled.view(), world().rank() == 0 ? 1 : 2), InvalidArgument);
}

// The local tensors of a call against the runtime key, before any work or communication (so every rank throws
// alike): whole shapes and dtypes of every output, no partial result or accumulate_dq (the runtime merges the key
// parts itself), outputs sharing memory. Outputs stay as they were.
TEST(DistAttn, CallArgumentsAreCheckedBeforeAnyWork) {
  const Mask mask = masks::causal(192, 192);
  const auto key = make_runtime_key(mask, {4, 2, 32}, test::world_ptr(), config_of(Case{"", mask}));
  const int64_t lq = key.local_q_tokens(), lk = key.local_k_tokens();
  HostTensor q = HostTensor::poisoned(DType::F32, {lq, 4, 32}), k = HostTensor::poisoned(DType::F32, {lk, 2, 32}),
             v = HostTensor::poisoned(DType::F32, {lk, 2, 32});
  HostTensor out = HostTensor::poisoned(DType::F32, {lq, 4, 32}), lse = HostTensor::poisoned(DType::F32, {lq, 4});
  HostTensor narrow = HostTensor::poisoned(DType::F32, {lq, 4, 8}), lse1 = HostTensor::poisoned(DType::F32, {lq, 1});
  HostTensor out16 = HostTensor::poisoned(DType::BF16, {lq, 4, 32}), logits1 = HostTensor::poisoned(DType::F32, {1});
  auto forward_rejects = [&](ForwardArgs a, const std::string& needle) {
    std::string message;
    try {
      calc_attn(key, a);
    } catch (const InvalidArgument& e) {
      message = e.what();
    }
    EXPECT_NE(message.find(needle), std::string::npos) << "expected '" << needle << "', got '" << message << "'";
  };
  const ForwardArgs good{q.view(), k.view(), v.view(), {}, out.view(), lse.view(), {}, {}, {}};
  ForwardArgs a = good;
  a.out = narrow.view();
  forward_rejects(a, "out: expected shape");
  a = good;
  a.lse = lse1.view();
  forward_rejects(a, "lse: expected shape");
  a = good;
  a.out = out16.view();
  forward_rejects(a, "out: dtype bf16");
  a = good;
  a.out = TensorView(nullptr, DType::F32, {lq, 4, 32});
  forward_rejects(a, "out: null data pointer");
  a = good;
  a.max_logits = logits1.view();
  forward_rejects(a, "max_logits: expected shape");
  a = good;
  a.prev_out = out.view();
  a.prev_lse = lse.view();
  forward_rejects(a, "prev_out / prev_lse");
  a = good;
  a.lse = TensorView(out.view().data, DType::F32, {lq, 4});
  forward_rejects(a, "out: overlaps lse");
  const auto all_nan = [](const HostTensor& t) {
    const std::vector<double> values = t.values();
    return std::all_of(values.begin(), values.end(), [](double x) { return std::isnan(x); });
  };
  EXPECT_TRUE(all_nan(out));

  HostTensor dq = HostTensor::poisoned(DType::F32, {lq, 4, 32}), dk = HostTensor::poisoned(DType::F32, {lk, 2, 32}),
             dv = HostTensor::poisoned(DType::F32, {lk, 2, 32});
  auto backward_rejects = [&](BackwardArgs b, const std::string& needle) {
    std::string message;
    try {
      calc_attn_backward(key, b);
    } catch (const InvalidArgument& e) {
      message = e.what();
    }
    EXPECT_NE(message.find(needle), std::string::npos) << "expected '" << needle << "', got '" << message << "'";
  };
  BackwardArgs b;
  b.q = q.view();
  b.k = k.view();
  b.v = v.view();
  b.out = out.view();
  b.lse = lse.view();
  b.dout = out.view();
  b.dq = dq.view();
  b.dk = dk.view();
  b.dv = dv.view();
  BackwardArgs bad = b;
  bad.accumulate_dq = true;
  backward_rejects(bad, "accumulate_dq");
  bad = b;
  bad.dv = dk.view();
  backward_rejects(bad, "dk: overlaps dv");
  bad = b;
  bad.dq = narrow.view();
  backward_rejects(bad, "dq: expected shape");
  EXPECT_TRUE(all_nan(dq));
}

TEST(DistAttn, EnvironmentSelectsDsinkOpAndHierarchicalComm) {
  setenv("MAGI_ATTENTION_DSINK_ALL_REDUCE_OP", "sum", 1);
  setenv("MAGI_ATTENTION_HIERARCHICAL_COMM", "1", 1);
  env::reset_for_testing();
  Case c{"env: dsink sum, hierarchical (one node)", masks::varlen_causal(test::cu_seqlens_of({250, 150, 200}))};
  c.sink = SinkLayout::SH;
  c.dsink_op = DsinkReduceOp::Sum;  // what the environment asks for; checked below
  c.env_options = true;
  check_case(c);
  // Under one mpirun on one machine every rank shares memory: one node of cp ranks.
  const auto key = make_runtime_key(c.mask, c.heads, test::world_ptr(), config_of(c));
  EXPECT_EQ(key.summary().ranks_per_node, world().size());
  unsetenv("MAGI_ATTENTION_DSINK_ALL_REDUCE_OP");
  unsetenv("MAGI_ATTENTION_HIERARCHICAL_COMM");
  env::reset_for_testing();
}

// Two distributed runs of the case on the same inputs give the same bytes.
void expect_two_runs_bitwise_equal(const Case& c) {
  const uint64_t seed = test::shared_seed();
  Global g = make_inputs(c, seed);
  const Outputs a = distributed(c, g);
  const Outputs b = distributed(c, g);
  for (auto [x, y, name] : {std::tuple{&a.out, &b.out, "out"}, {&a.lse, &b.lse, "lse"}, {&a.dq, &b.dq, "dq"},
                            {&a.dk, &b.dk, "dk"}, {&a.dv, &b.dv, "dv"}})
    EXPECT_EQ(x->bytes(), y->bytes()) << name << " differs between two runs, seed " << seed;
}

TEST(DistAttn, BitwiseDeterministic) {
  Case c{"varlen block-causal bf16", varlen_block_causal_15()};
  c.dtype = DType::BF16;
  c.overlap_degree = 2;
  expect_two_runs_bitwise_equal(c);
}

Mask heavy_first_rows() {  // 32 documents of 64 rows, and the first 64 rows also see every key: one heavy chunk
  Mask m = masks::varlen_causal(test::cu_seqlens_of(std::vector<int32_t>(32, 64)));
  m.slices.push_back(test::make_slice(0, 64, 64, 2048, MaskType::Full));
  return m;
}

// MAGI_ATTENTION_QO_COMM / FLATTEN_HEAD_GROUPS / FORWARD_HIGH_PRECISION_REDUCE: plans where some work takes the
// q/out route (checked to be so from cp 2 on) match the single device like k/v-only plans.
TEST(DistAttn, QueryOutputRoutesMatchSingleDevice) {
  const auto routed = [](const Case& c) {
    return make_runtime_key(c.mask, c.heads, test::world_ptr(), config_of(c)).summary().qo_units;
  };
  std::vector<Case> cases;
  {
    Case c{"heavy first rows, q/out route", heavy_first_rows(), {4, 2, 32}};
    c.qo_comm = true;
    cases.push_back(c);
    c.name = "heavy first rows, q/out route per head group, overlap 0";
    c.flatten = true;
    c.overlap_degree = 0;
    cases.push_back(c);
    c.name = "heavy first rows, flattened head groups alone, sh sink, degree 2";
    c.qo_comm = false;
    c.overlap_degree = 2;
    c.sink = SinkLayout::SH;
    c.dsink_op = DsinkReduceOp::Sum;
    cases.push_back(c);
    c.name = "heavy first rows, q/out route, ssh sink";
    c.qo_comm = true;
    c.flatten = false;
    c.sink = SinkLayout::SSH;
    cases.push_back(c);
  }
  for (bool high : {false, true}) {
    Case c{std::string("heavy first rows bf16, q/out route, ") + (high ? "fp32" : "bf16") + " partial out",
           heavy_first_rows(), {4, 4, 32}};
    c.dtype = DType::BF16;
    c.qo_comm = c.flatten = true;
    c.forward_high_precision = high;
    c.high_precision = high;
    cases.push_back(c);
  }
  {
    Case c{"long documents per head group", masks::varlen_causal(test::cu_seqlens_of({900, 200, 100})), {4, 4, 32}};
    c.chunk_size = 16;
    c.qo_comm = c.flatten = true;
    c.algorithm = DispatchAlgorithm::Locality;
    cases.push_back(c);
  }
  for (const Case& base : {Case{"q-overlap", q_overlap_12(), {4, 2, 32}}, Case{"mixed types", mixed_types_10()},
                           Case{"disjoint ranges, uncovered rows", test::cases::disjoint_uncovered()},
                           Case{"no slices", Mask{{}, 300, 300}}}) {
    Case c = base;
    c.name += ", q/out route per head group";
    c.qo_comm = c.flatten = true;
    cases.push_back(c);
  }
  for (Case c : cases) {
    check_case(c);
    if (HasFatalFailure()) return;
    if (world().size() > 1 && c.name.find("heavy") != std::string::npos)
      EXPECT_GT(routed(c), 0) << c.name << ": no work took the q/out route, so the test would prove nothing";
  }
  if (world().size() % 2 == 0) {  // with hierarchical k/v comm (the q/out route stays flat)
    Case c{"hierarchical + q/out route", heavy_first_rows(), {4, 2, 32}};
    c.qo_comm = c.flatten = true;
    c.ranks_per_node = 2;
    c.overlap_degree = 2;
    check_case(c);
  }
}

TEST(DistAttn, QueryOutputRoutesAreBitwiseDeterministicAndFromTheEnvironment) {
  setenv("MAGI_ATTENTION_QO_COMM", "1", 1);
  setenv("MAGI_ATTENTION_FLATTEN_HEAD_GROUPS", "1", 1);
  env::reset_for_testing();
  Case c{"env: q/out route per head group, bf16", heavy_first_rows(), {4, 2, 32}};
  c.dtype = DType::BF16;
  c.overlap_degree = 2;
  c.env_options = true;
  const auto key = make_runtime_key(c.mask, c.heads, test::world_ptr(), config_of(c));
  EXPECT_TRUE(key.summary().qo_comm && key.summary().flatten_head_groups);
  if (world().size() > 1) EXPECT_GT(key.summary().qo_units, 0);
  check_case(c);
  expect_two_runs_bitwise_equal(c);
  unsetenv("MAGI_ATTENTION_QO_COMM");
  unsetenv("MAGI_ATTENTION_FLATTEN_HEAD_GROUPS");
  env::reset_for_testing();
  EXPECT_FALSE(make_runtime_key(c.mask, c.heads, test::world_ptr(), config_of(c)).summary().qo_comm);
}

// MAGI_ATTENTION_AUTO_RANGE_MERGE: the global mask merged before dispatch matches one device; in deterministic mode
// the global mask stays as given and the stage calls merge only where their bits cannot change.
TEST(DistAttn, AutoRangeMergeMatchesOneDeviceAndKeepsDeterministicBits) {
  setenv("MAGI_ATTENTION_AUTO_RANGE_MERGE", "1", 1);
  env::reset_for_testing();
  Case c{"auto range merge: 128 small slices forming a full mask", small_slices_full()};
  c.deterministic = false;
  check_case(c);
  EXPECT_EQ(make_runtime_key(c.mask, c.heads, test::world_ptr(), config_of(c)).summary().planned_slices, 1);

  // Causal documents cut into row bands of 96 (the CPU tiles): merged back whole outside deterministic mode.
  Case d{"auto range merge, deterministic: causal documents in row bands",
         masks::varlen_causal(test::cu_seqlens_of({384, 200, 192}))};
  std::vector<Slice> bands;
  for (const Slice& s : d.mask.slices) test::row_bands(s, 96, bands);
  d.mask.slices = bands;
  d.backend = Backend::Cpu;  // fp32 sums: a moved tile edge would show in the bits
  d.dtype = DType::F32;
  d.deterministic = true;
  d.chunk_size = 64;  // chunks cut the bands: merged global slices would give other stage masks
  d.overlap_degree = 2;
  const uint64_t seed = test::shared_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Global g = make_inputs(d, seed);
  const Outputs merged = distributed(d, g);
  EXPECT_EQ(make_runtime_key(d.mask, d.heads, test::world_ptr(), config_of(d)).summary().planned_slices,
            static_cast<int64_t>(d.mask.slices.size()))
      << "deterministic mode keeps the global mask";
  unsetenv("MAGI_ATTENTION_AUTO_RANGE_MERGE");
  env::reset_for_testing();
  const Outputs plain = distributed(d, g);
  for (auto [x, y, name] : {std::tuple{&merged.out, &plain.out, "out"}, {&merged.lse, &plain.lse, "lse"},
                            {&merged.dq, &plain.dq, "dq"}, {&merged.dk, &plain.dk, "dk"},
                            {&merged.dv, &plain.dv, "dv"}})
    EXPECT_EQ(x->bytes(), y->bytes()) << name << " differs with MAGI_ATTENTION_AUTO_RANGE_MERGE=1";
}

// Head dims past the GPU kernels' 256 (issue 24): the host runtime takes any D.
TEST(DistAttn, LargeHeadDimsMatchSingleDevice) {
  for (const auto& [dim, dtype] : {std::pair{520, DType::F64}, {1024, DType::BF16}}) {
    Case c{"varlen causal D " + std::to_string(dim), masks::varlen_causal(test::cu_seqlens_of({150, 40, 110})),
           {2, 1, dim}};
    c.dtype = dtype;
    c.chunk_size = 25;
    c.overlap_degree = 2;
    check_case(c);
    if (HasFatalFailure()) return;
  }
}

TEST(DistAttn, RuntimeLruEvictsTheOldest) {
  setenv("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE", "2", 1);
  env::reset_for_testing();
  clear_runtime_cache();
  DistConfig config = config_of(Case{"", masks::full(64, 64)});
  const auto key_a = make_runtime_key(masks::full(64, 64), {2, 2, 32}, test::world_ptr(), config);
  const auto key_a2 = make_runtime_key(masks::full(64, 64), {2, 2, 32}, test::world_ptr(), config);
  EXPECT_EQ(&key_a.runtime(), &key_a2.runtime()) << "a hit returns the cached runtime";
  const auto key_b = make_runtime_key(masks::causal(64, 64), {2, 2, 32}, test::world_ptr(), config);
  make_runtime_key(masks::full(64, 64), {2, 2, 32}, test::world_ptr(), config);  // a is now most recent
  const auto key_c = make_runtime_key(masks::full(96, 96), {2, 2, 32}, test::world_ptr(), config);  // evicts b
  EXPECT_EQ(runtime_cache_size(), 2u);
  EXPECT_EQ(&make_runtime_key(masks::full(64, 64), {2, 2, 32}, test::world_ptr(), config).runtime(), &key_a.runtime());
  EXPECT_NE(&make_runtime_key(masks::causal(64, 64), {2, 2, 32}, test::world_ptr(), config).runtime(), &key_b.runtime())
      << "b was evicted, so it is planned again";
  config.chunk_size = 32;  // config is part of the key
  EXPECT_NE(&make_runtime_key(masks::full(64, 64), {2, 2, 32}, test::world_ptr(), config).runtime(), &key_a.runtime());
  unsetenv("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE");
  env::reset_for_testing();
}

TEST(DistAttn, MismatchedMaskOrConfigFailsOnEveryRank) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  const bool odd = world().rank() % 2 == 1;
  DistConfig config = config_of(Case{"", masks::full(64, 64)});
  EXPECT_THROW(make_runtime_key(odd ? masks::causal(128, 128) : masks::full(128, 128), {2, 2, 32}, test::world_ptr(), config),
               InvalidArgument);
  config.overlap_degree = odd ? 2 : 1;
  EXPECT_THROW(make_runtime_key(masks::full(128, 128), {2, 2, 32}, test::world_ptr(), config), InvalidArgument);
  config.overlap_degree = 1;
  EXPECT_THROW(make_runtime_key(masks::full(128, 128), {2, 2, odd ? 64 : 32}, test::world_ptr(), config), InvalidArgument);
  // Still usable afterwards: the check itself never leaves a collective half done.
  EXPECT_NO_THROW(make_runtime_key(masks::full(128, 128), {2, 2, 32}, test::world_ptr(), config));
}

TEST(DistAttn, PositionIdsAndDispatchRoundTrip) {
  const Mask mask = masks::causal(333, 333);
  const auto key = make_runtime_key(mask, {2, 2, 32}, test::world_ptr(), config_of(Case{"", mask}));
  const auto ids = position_ids(key);
  ASSERT_EQ(static_cast<int32_t>(ids.size()), key.local_q_tokens());
  std::vector<double> values(333 * 3);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<double>(i);
  HostTensor global = HostTensor::from_values(values, DType::F32, {333, 3});
  HostTensor local = local_of(key, Axis::Q, global);
  const auto local_values = local.values();
  for (size_t i = 0; i < ids.size(); ++i)
    for (int j = 0; j < 3; ++j)
      EXPECT_EQ(local_values[i * 3 + j], ids[i] < 333 ? ids[i] * 3.0 + j : 0.0) << "row " << i;
  EXPECT_EQ(global_of(key, Axis::Q, local, 333).bytes(), global.bytes());
  const PlanSummary summary = key.summary();
  EXPECT_EQ(summary.cp, world().size());
  EXPECT_GE(summary.imbalance(), 1.0);
  if (world().rank() == 0) std::printf("%s", summary.to_text().c_str());
}

// A second mask on an existing dispatch (layers whose masks differ share one dispatch of q/k/v): the new key keeps
// the partition, so the tensors dispatched with the first key give the single-device result of the second mask.
TEST(DistAttn, NewMaskAfterDispatchKeepsThePartition) {
  const uint64_t seed = test::shared_seed();
  SCOPED_TRACE("cp " + std::to_string(world().size()) + ", seed " + std::to_string(seed));
  const Mask first = varlen_block_causal_15();  // 1200 x 1200
  Case c{"second mask", masks::varlen_causal(test::cu_seqlens_of({500, 64, 300, 336}))};
  c.chunk_size = 48;
  const RuntimeKey key = make_runtime_key(first, c.heads, test::world_ptr(), config_of(c));
  const RuntimeKey second = make_runtime_key_for_new_mask(key, c.mask);
  for (Axis axis : {Axis::Q, Axis::K}) EXPECT_EQ(position_ids(second, axis), position_ids(key, axis));
  int64_t area = 0;
  for (int64_t a : second.summary().rank_area) area += a;
  EXPECT_EQ(area, c.mask.area()) << "the per-rank areas are the new mask's";

  Global g = make_inputs(c, seed);
  const Outputs ref = single_device(c, g);
  const int64_t lq = key.local_q_tokens(), hq = c.heads.heads_q, d = c.heads.head_dim;
  HostTensor q = local_of(key, Axis::Q, g.q), k = local_of(key, Axis::K, g.k), v = local_of(key, Axis::K, g.v);
  HostTensor dout = local_of(key, Axis::Q, g.dout);
  const DType rd = c.results.value_or(c.dtype);
  HostTensor out = HostTensor::poisoned(rd, {lq, hq, d}), lse = HostTensor::poisoned(DType::F64, {lq, hq});
  calc_attn(second, ForwardArgs{q.view(), k.view(), v.view(), {}, out.view(), lse.view(), {}, {}, {}});
  HostTensor dq = HostTensor::poisoned(c.dtype, q.shape()), dk = HostTensor::poisoned(c.dtype, k.shape()),
             dv = HostTensor::poisoned(c.dtype, v.shape());
  calc_attn_backward(second, BackwardArgs{q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), {},
                                          dq.view(), dk.view(), dv.view(), {}});
  const double tol = tolerance_of(c.dtype);
  expect_close(global_of(key, Axis::Q, out, 1200), ref.out, tol, "out");
  expect_close(global_of(key, Axis::Q, lse, 1200), ref.lse, 1e-10, "lse");
  expect_close(global_of(key, Axis::Q, dq, 1200), ref.dq, tol, "dq");
  expect_close(global_of(key, Axis::K, dk, 1200), ref.dk, tol, "dk");
  expect_close(global_of(key, Axis::K, dv, 1200), ref.dv, tol, "dv");

  // The same request again is the cached runtime; other totals are refused on every rank.
  EXPECT_EQ(&make_runtime_key_for_new_mask(key, c.mask).runtime(), &second.runtime());
  EXPECT_THROW(make_runtime_key_for_new_mask(key, masks::causal(1300, 1300)), InvalidArgument);
  EXPECT_THROW(make_runtime_key_for_new_mask(RuntimeKey{}, c.mask), InvalidArgument);
}

// roll of dispatched tensors equals torch.roll of the global one, for either axis, any shift (negative, past the
// length), in place too; padding rows are zero.
TEST(DistAttn, RollMatchesRollingTheGlobalTensor) {
  const Mask mask = masks::varlen_causal(test::cu_seqlens_of({140, 37, 200}));  // 377 rows
  Case c{"", Mask{{test::make_slice(0, 377, 0, 150, MaskType::Full)}, 377, 150}};  // q and k of other lengths
  c.chunk_size = 16;
  for (const Mask* m : {&mask, static_cast<const Mask*>(&c.mask)}) {
    const RuntimeKey key = make_runtime_key(*m, {2, 2, 32}, test::world_ptr(), config_of(c));
    for (Axis axis : {Axis::Q, Axis::K}) {
      const int32_t total = axis == Axis::Q ? m->total_q : m->total_k;
      std::vector<double> values(static_cast<size_t>(total) * 3);
      for (size_t i = 0; i < values.size(); ++i) values[i] = 1.0 + static_cast<double>(i);
      HostTensor global = HostTensor::from_values(values, DType::F32, {total, 3});
      for (int64_t shift : {int64_t{1}, int64_t{-1}, int64_t{-3}, int64_t{0}, int64_t{total} + 5}) {
        HostTensor local = local_of(key, axis, global);
        HostTensor rolled = HostTensor::poisoned(DType::F32, local.shape());
        roll(key, axis, local.view(), rolled.view(), shift);
        const auto got = global_of(key, axis, rolled, total).values();
        for (int64_t g = 0; g < total; ++g) {
          const int64_t from = (((g - shift) % total) + total) % total;
          for (int j = 0; j < 3; ++j)
            ASSERT_EQ(got[g * 3 + j], values[from * 3 + j]) << "axis " << static_cast<int>(axis) << " shift " << shift
                                                            << " row " << g;
        }
        const auto ids = position_ids(key, axis);
        const auto local_rolled = rolled.values();
        for (size_t i = 0; i < ids.size(); ++i)
          if (ids[i] >= total) EXPECT_EQ(local_rolled[i * 3], 0.0) << "padding row " << i;
        roll(key, axis, local.view(), local.view(), shift);  // in place
        EXPECT_EQ(local.values(), local_rolled) << "in place, shift " << shift;
      }
    }
  }
  const RuntimeKey key = make_runtime_key(mask, {2, 2, 32}, test::world_ptr(), config_of(c));
  HostTensor local = HostTensor::poisoned(DType::F32, {key.local_q_tokens() + 1, 3});
  EXPECT_THROW(roll(key, Axis::Q, local.view(), local.view(), 1), InvalidArgument);
}

// MAGI_ATTENTION_PROFILE_DIR: every rank writes its timeline (planning, exchanges, stages, reductions), readable
// back, with the communication it overlapped.
TEST(DistAttn, ProfileDirWritesEveryRanksTimeline) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("magi_profile_" + std::to_string(test::shared_seed()));
  setenv("MAGI_ATTENTION_PROFILE_DIR", dir.c_str(), 1);
  env::reset_for_testing();
  Case c{"profiled", varlen_full_12()};
  Global g = make_inputs(c, test::shared_seed());
  distributed(c, g);
  world().barrier();
  const int32_t cp = world().size();
  for (int32_t r = 0; r < cp; ++r) {
    int32_t rank = -1;
    const std::vector<Span> spans = read_spans((dir / ("rank_" + std::to_string(r) + ".json")).string(), &rank);
    EXPECT_EQ(rank, r);
    auto has = [&](const std::string& name, const std::string& lane) {
      for (const Span& s : spans)
        if (s.name == name && s.lane == lane && s.end_us >= s.start_us) return true;
      return false;
    };
    EXPECT_TRUE(has("plan (dispatch + comm plan)", "host")) << "rank " << r;
    EXPECT_TRUE(has("forward local attention", "compute")) << "rank " << r << " (in place, the default)";
    EXPECT_TRUE(has("backward store dq / dk / dv", "compute")) << "rank " << r;
    if (cp > 1) {
      EXPECT_TRUE(has("forward stage 0 k/v exchange", "comm")) << "rank " << r;
      EXPECT_TRUE(has("backward stage 0 dk/dv reduce", "comm")) << "rank " << r;
    }
    const Overlap o = overlap_of(spans);
    EXPECT_GT(o.compute_us, 0.0);
    EXPECT_GE(o.hidden_fraction(), 0.0);
    EXPECT_LE(o.hidden_fraction(), 1.0);
    EXPECT_FALSE(has("forward local attention + merge", "compute")) << "in place, no call is followed by a merge";
  }
  {  // Out of place: each stage's attention, then its merge, then one store pass.
    world().barrier();
    const ScopedEnv out_of_place("MAGI_ATTENTION_FFA_FORWARD_INPLACE_CORRECT", "0");
    distributed(c, g);
    const std::vector<Span> spans = read_spans((dir / ("rank_" + std::to_string(world().rank()) + ".json")).string());
    const auto has = [&](const std::string& name) {
      return std::any_of(spans.begin(), spans.end(), [&](const Span& s) { return s.name == name; });
    };
    EXPECT_TRUE(has("forward local attention + merge"));
    EXPECT_TRUE(has("forward store out / lse"));
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
  unsetenv("MAGI_ATTENTION_PROFILE_DIR");
  env::reset_for_testing();
}

// MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE: the local stage runs last, while the last remote dk/dv reduction is in
// flight; the gradients still match the single device.
TEST(DistAttn, HideTailReduceRunsTheLocalStageLastWithTheSameGradients) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("magi_tail_" + std::to_string(test::shared_seed()));
  setenv("MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE", "1", 1);
  setenv("MAGI_ATTENTION_PROFILE_DIR", dir.c_str(), 1);
  env::reset_for_testing();
  for (int32_t degree : {1, 2}) {
    Case c{"hide tail reduce", q_overlap_12()};
    c.overlap_degree = degree;
    check_case(c);
  }
  world().barrier();
  const std::vector<Span> spans = read_spans((dir / ("rank_" + std::to_string(world().rank()) + ".json")).string());
  double local_start = -1, last_reduce_end = -1, first_reduce_start = -1;
  for (const Span& s : spans) {  // the last call's spans win
    if (s.name == "backward local attention") local_start = s.start_us;
    if (s.name.find("dk/dv reduce") != std::string::npos) last_reduce_end = s.end_us;
    if (s.name.starts_with("backward stage 0 dk/dv reduce")) first_reduce_start = s.start_us;
  }
  ASSERT_GE(local_start, 0.0);
  if (world().size() > 1) {
    EXPECT_GT(local_start, first_reduce_start) << "the local stage runs after the remote stages started reducing";
    EXPECT_LE(local_start, last_reduce_end) << "the last reduction finishes after the local stage starts";
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
  unsetenv("MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE");
  unsetenv("MAGI_ATTENTION_PROFILE_DIR");
  env::reset_for_testing();
}

}  // namespace
}  // namespace magi::dist
