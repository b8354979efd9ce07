#include "cuda/reference/reference_engine.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <vector>

#include "cuda/check.hpp"
#include "magi/error.hpp"

namespace magi::cuda::reference {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxHeadDim = 1024;
constexpr int kDimsPerThread = kMaxHeadDim / kThreads;  // accumulators each thread owns

// A typed view of one tensor for the kernels: every element goes through fp64.
struct Buffer {
  void* data = nullptr;
  DType dtype = DType::F32;
};

Buffer buffer(const TensorView& t) { return {t.data, t.dtype}; }

__device__ double load(const Buffer& b, int64_t i) {
  switch (b.dtype) {
    case DType::F64: return static_cast<const double*>(b.data)[i];
    case DType::F32: return static_cast<const float*>(b.data)[i];
    case DType::BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(b.data)[i]);
    case DType::F16: return __half2float(static_cast<const __half*>(b.data)[i]);
  }
  return 0.0;
}

// Rounds once, from fp64 straight to the buffer's dtype.
__device__ void store(const Buffer& b, int64_t i, double x) {
  switch (b.dtype) {
    case DType::F64: static_cast<double*>(b.data)[i] = x; return;
    case DType::F32: static_cast<float*>(b.data)[i] = static_cast<float>(x); return;
    case DType::BF16: static_cast<__nv_bfloat16*>(b.data)[i] = __double2bfloat16(x); return;
    case DType::F16: static_cast<__half*>(b.data)[i] = __double2half(x); return;
  }
}

constexpr double kMinusInf = -HUGE_VAL;

// Fixed-shape tree reductions over the block (deterministic); `scratch` holds kThreads doubles. Every
// thread gets the result.
__device__ double block_sum(double x, double* scratch) {
  scratch[threadIdx.x] = x;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) scratch[threadIdx.x] += scratch[threadIdx.x + stride];
    __syncthreads();
  }
  const double total = scratch[0];
  __syncthreads();
  return total;
}

__device__ double block_max(double x, double* scratch) {
  scratch[threadIdx.x] = x;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) scratch[threadIdx.x] = fmax(scratch[threadIdx.x], scratch[threadIdx.x + stride]);
    __syncthreads();
  }
  const double total = scratch[0];
  __syncthreads();
  return total;
}

struct Geometry {
  int32_t tq = 0, tk = 0, hq = 0, hkv = 0, d = 0;
  __host__ __device__ int32_t group() const { return hq / hkv; }
};

struct Logits {
  double scale = 0.0;
  double softcap = 0.0;
  // s = scale * dot, softcapped; `derivative` gets ds/d(dot) / scale (1 without softcap).
  __device__ double operator()(double dot, double* derivative = nullptr) const {
    double s = scale * dot;
    if (softcap > 0.0) {
      s = softcap * tanh(s / softcap);
      if (derivative) *derivative = 1.0 - (s / softcap) * (s / softcap);
    } else if (derivative) {
      *derivative = 1.0;
    }
    return s;
  }
};

// dot(row in shared memory, global row at `base`), fp64, fixed order.
__device__ double dot_row(const double* shared_row, const Buffer& b, int64_t base, int32_t d) {
  double acc = 0.0;
  for (int32_t c = 0; c < d; ++c) acc += shared_row[c] * load(b, base + c);
  return acc;
}

// Sinks of row `row`, head `head`: sh [S, Hq] or ssh [Tq, S, Hq].
__device__ int64_t sink_index(SinkLayout layout, int32_t sink_len, int32_t hq, int32_t row, int32_t s, int32_t head) {
  return layout == SinkLayout::SH ? int64_t{s} * hq + head : (int64_t{row} * sink_len + s) * hq + head;
}

struct MaskLists {
  const Slice* slices = nullptr;
  const int64_t* row_offsets = nullptr;  // [Tq + 1]: slices keeping keys of row q
  const int32_t* row_slices = nullptr;
  const int64_t* key_offsets = nullptr;  // [Tk + 1]: slices keeping rows of key k
  const int32_t* key_slices = nullptr;
};

struct ForwardParams {
  MaskLists mask;
  Geometry g;
  Logits logits;
  Buffer q, k, v, out, lse;
  const float* sink = nullptr;
  SinkLayout sink_layout = SinkLayout::None;
  int32_t sink_len = 0;
  double* row_max = nullptr;  // [Tq, Hq] when max_logits is wanted
};

// One block per (row, head): max pass, then weights and the weighted sum of v in key chunks.
__global__ void __launch_bounds__(kThreads) forward_kernel(ForwardParams p) {
  extern __shared__ double shared[];
  double* q_row = shared;                // [d]
  double* weight = q_row + p.g.d;        // [kThreads]
  double* scratch = weight + kThreads;   // [kThreads]
  const int32_t row = blockIdx.x, head = blockIdx.y, kv_head = head / p.g.group();
  const int64_t q_base = (int64_t{row} * p.g.hq + head) * p.g.d;
  for (int32_t c = threadIdx.x; c < p.g.d; c += kThreads) q_row[c] = load(p.q, q_base + c);
  __syncthreads();
  const int64_t first = p.mask.row_offsets[row], last = p.mask.row_offsets[row + 1];
  auto key_base = [&](int32_t key) { return (int64_t{key} * p.g.hkv + kv_head) * p.g.d; };

  double local_max = kMinusInf;
  for (int64_t e = first; e < last; ++e) {
    const Range keys = kept_keys(p.mask.slices[p.mask.row_slices[e]], row);
    for (int32_t key = keys.start + threadIdx.x; key < keys.end; key += kThreads)
      local_max = fmax(local_max, p.logits(dot_row(q_row, p.k, key_base(key), p.g.d)));
  }
  const double logit_max = block_max(local_max, scratch);
  if (p.row_max && threadIdx.x == 0) p.row_max[int64_t{row} * p.g.hq + head] = logit_max;
  double shift = logit_max;  // max over keys and sinks, so that no exp overflows
  for (int32_t s = 0; s < p.sink_len; ++s)
    shift = fmax(shift, static_cast<double>(p.sink[sink_index(p.sink_layout, p.sink_len, p.g.hq, row, s, head)]));

  double acc[kDimsPerThread] = {};
  double local_sum = 0.0;
  for (int64_t e = first; e < last; ++e) {
    const Range keys = kept_keys(p.mask.slices[p.mask.row_slices[e]], row);
    for (int32_t chunk = keys.start; chunk < keys.end; chunk += kThreads) {
      const int32_t key = chunk + threadIdx.x;
      double w = 0.0;
      if (key < keys.end) w = exp(p.logits(dot_row(q_row, p.k, key_base(key), p.g.d)) - shift);
      local_sum += w;
      weight[threadIdx.x] = w;
      __syncthreads();
      const int32_t n = min(kThreads, keys.end - chunk);
      for (int32_t j = 0; j < n; ++j) {
        const double wj = weight[j];
        const int64_t base = key_base(chunk + j);
        for (int32_t i = 0; i < kDimsPerThread; ++i) {
          const int32_t c = threadIdx.x + i * kThreads;
          if (c < p.g.d) acc[i] += wj * load(p.v, base + c);
        }
      }
      __syncthreads();
    }
  }
  double total = block_sum(local_sum, scratch);
  for (int32_t s = 0; s < p.sink_len; ++s)
    total += exp(static_cast<double>(p.sink[sink_index(p.sink_layout, p.sink_len, p.g.hq, row, s, head)]) - shift);
  // No key and no finite sink: out 0, lse -inf (shift is -inf and total 0 or NaN-free 0).
  const bool empty = !(shift > kMinusInf) || !(total > 0.0);
  for (int32_t i = 0; i < kDimsPerThread; ++i) {
    const int32_t c = threadIdx.x + i * kThreads;
    if (c < p.g.d) store(p.out, q_base + c, empty ? 0.0 : acc[i] / total);
  }
  if (threadIdx.x == 0) store(p.lse, int64_t{row} * p.g.hq + head, empty ? kMinusInf : shift + log(total));
}

// max_logits[h] = max over rows of row_max; one block per head, fixed order.
__global__ void __launch_bounds__(kThreads) max_logits_kernel(const double* row_max, int32_t tq, int32_t hq,
                                                              float* max_logits) {
  __shared__ double scratch[kThreads];
  const int32_t head = blockIdx.x;
  double m = kMinusInf;
  for (int32_t row = threadIdx.x; row < tq; row += kThreads) m = fmax(m, row_max[int64_t{row} * hq + head]);
  m = block_max(m, scratch);
  if (threadIdx.x == 0) max_logits[head] = static_cast<float>(m);
}

struct BackwardParams {
  MaskLists mask;
  Geometry g;
  Logits logits;
  Buffer q, k, v, out, dout, lse, dq, dk, dv;
  const float* sink = nullptr;
  float* dsink = nullptr;
  SinkLayout sink_layout = SinkLayout::None;
  int32_t sink_len = 0;
  double* delta = nullptr;  // [Tq, Hq] workspace: dout . out
};

__device__ double lse_of(const BackwardParams& p, int32_t row, int32_t head) {
  return load(p.lse, int64_t{row} * p.g.hq + head);
}

// One block per (row, head): Delta, the ssh dsink terms and dq = scale * sum_j dS_ij k_j.
__global__ void __launch_bounds__(kThreads) dq_kernel(BackwardParams p) {
  extern __shared__ double shared[];
  double* q_row = shared;               // [d]
  double* dout_row = q_row + p.g.d;     // [d]
  double* weight = dout_row + p.g.d;    // [kThreads]
  double* scratch = weight + kThreads;  // [kThreads]
  const int32_t row = blockIdx.x, head = blockIdx.y, kv_head = head / p.g.group();
  const int64_t q_base = (int64_t{row} * p.g.hq + head) * p.g.d;
  double local_delta = 0.0;
  for (int32_t c = threadIdx.x; c < p.g.d; c += kThreads) {
    q_row[c] = load(p.q, q_base + c);
    dout_row[c] = load(p.dout, q_base + c);
    local_delta += dout_row[c] * load(p.out, q_base + c);
  }
  const double lse = lse_of(p, row, head);
  const bool empty = !(lse > kMinusInf);  // rows with lse = -inf give 0 everywhere
  const double delta = empty ? 0.0 : block_sum(local_delta, scratch);  // syncs q_row / dout_row too
  __syncthreads();
  if (threadIdx.x == 0) p.delta[int64_t{row} * p.g.hq + head] = delta;
  if (p.sink_layout == SinkLayout::SSH) {
    for (int32_t s = threadIdx.x; s < p.sink_len; s += kThreads) {
      const int64_t at = sink_index(p.sink_layout, p.sink_len, p.g.hq, row, s, head);
      p.dsink[at] = empty ? 0.0f : static_cast<float>(-exp(static_cast<double>(p.sink[at]) - lse) * delta);
    }
  }
  auto key_base = [&](int32_t key) { return (int64_t{key} * p.g.hkv + kv_head) * p.g.d; };
  double acc[kDimsPerThread] = {};
  const int64_t first = empty ? 0 : p.mask.row_offsets[row], last = empty ? 0 : p.mask.row_offsets[row + 1];
  for (int64_t e = first; e < last; ++e) {
    const Range keys = kept_keys(p.mask.slices[p.mask.row_slices[e]], row);
    for (int32_t chunk = keys.start; chunk < keys.end; chunk += kThreads) {
      const int32_t key = chunk + threadIdx.x;
      double ds = 0.0;
      if (key < keys.end) {
        double derivative = 1.0;
        const double s = p.logits(dot_row(q_row, p.k, key_base(key), p.g.d), &derivative);
        const double prob = exp(s - lse);
        const double dp = dot_row(dout_row, p.v, key_base(key), p.g.d);
        ds = prob * (dp - delta) * derivative * p.logits.scale;
      }
      weight[threadIdx.x] = ds;
      __syncthreads();
      const int32_t n = min(kThreads, keys.end - chunk);
      for (int32_t j = 0; j < n; ++j) {
        const double wj = weight[j];
        const int64_t base = key_base(chunk + j);
        for (int32_t i = 0; i < kDimsPerThread; ++i) {
          const int32_t c = threadIdx.x + i * kThreads;
          if (c < p.g.d) acc[i] += wj * load(p.k, base + c);
        }
      }
      __syncthreads();
    }
  }
  for (int32_t i = 0; i < kDimsPerThread; ++i) {
    const int32_t c = threadIdx.x + i * kThreads;
    if (c < p.g.d) store(p.dq, q_base + c, acc[i]);
  }
}

// One block per (key, kv head): dv = sum P^T dout and dk = scale * sum dS^T q over the GQA group's heads
// and the rows every slice keeps for this key (after dq_kernel wrote Delta).
__global__ void __launch_bounds__(kThreads) dkdv_kernel(BackwardParams p) {
  extern __shared__ double shared[];
  double* k_row = shared;                  // [d]
  double* v_row = k_row + p.g.d;           // [d]
  double* prob_weight = v_row + p.g.d;     // [kThreads]
  double* ds_weight = prob_weight + kThreads;  // [kThreads]
  const int32_t key = blockIdx.x, kv_head = blockIdx.y;
  const int64_t k_base = (int64_t{key} * p.g.hkv + kv_head) * p.g.d;
  for (int32_t c = threadIdx.x; c < p.g.d; c += kThreads) {
    k_row[c] = load(p.k, k_base + c);
    v_row[c] = load(p.v, k_base + c);
  }
  __syncthreads();
  double dk[kDimsPerThread] = {}, dv[kDimsPerThread] = {};
  const int64_t first = p.mask.key_offsets[key], last = p.mask.key_offsets[key + 1];
  for (int32_t g = 0; g < p.g.group(); ++g) {
    const int32_t head = kv_head * p.g.group() + g;
    auto q_base = [&](int32_t row) { return (int64_t{row} * p.g.hq + head) * p.g.d; };
    for (int64_t e = first; e < last; ++e) {
      const Range rows = kept_queries(p.mask.slices[p.mask.key_slices[e]], key);
      for (int32_t chunk = rows.start; chunk < rows.end; chunk += kThreads) {
        const int32_t row = chunk + threadIdx.x;
        double prob = 0.0, ds = 0.0;
        if (row < rows.end) {
          const double lse = lse_of(p, row, head);
          if (lse > kMinusInf) {
            double derivative = 1.0;
            const double s = p.logits(dot_row(k_row, p.q, q_base(row), p.g.d), &derivative);
            prob = exp(s - lse);
            const double dp = dot_row(v_row, p.dout, q_base(row), p.g.d);
            ds = prob * (dp - p.delta[int64_t{row} * p.g.hq + head]) * derivative * p.logits.scale;
          }
        }
        prob_weight[threadIdx.x] = prob;
        ds_weight[threadIdx.x] = ds;
        __syncthreads();
        const int32_t n = min(kThreads, rows.end - chunk);
        for (int32_t j = 0; j < n; ++j) {
          const double pj = prob_weight[j], dsj = ds_weight[j];
          const int64_t base = q_base(chunk + j);
          for (int32_t i = 0; i < kDimsPerThread; ++i) {
            const int32_t c = threadIdx.x + i * kThreads;
            if (c < p.g.d) {
              dv[i] += pj * load(p.dout, base + c);
              dk[i] += dsj * load(p.q, base + c);
            }
          }
        }
        __syncthreads();
      }
    }
  }
  for (int32_t i = 0; i < kDimsPerThread; ++i) {
    const int32_t c = threadIdx.x + i * kThreads;
    if (c < p.g.d) {
      store(p.dk, k_base + c, dk[i]);
      store(p.dv, k_base + c, dv[i]);
    }
  }
}

// sh sinks: dsink[s, h] = -sum_i exp(sink - lse_i) Delta_i; one block per (s, h), fixed order.
__global__ void __launch_bounds__(kThreads) dsink_shared_kernel(BackwardParams p) {
  __shared__ double scratch[kThreads];
  const int32_t s = blockIdx.x, head = blockIdx.y;
  const int64_t at = int64_t{s} * p.g.hq + head;
  const double sink = p.sink[at];
  double local = 0.0;
  for (int32_t row = threadIdx.x; row < p.g.tq; row += kThreads) {
    const double lse = lse_of(p, row, head);
    if (lse > kMinusInf) local += exp(sink - lse) * p.delta[int64_t{row} * p.g.hq + head];
  }
  const double total = block_sum(local, scratch);
  if (threadIdx.x == 0) p.dsink[at] = static_cast<float>(-total);
}

// CSR lists: for each row (key), the indices of the slices that keep at least one key (row) of it.
template <class Kept>
void build_lists(const Mask& mask, int32_t count, Kept kept, std::vector<int64_t>& offsets,
                 std::vector<int32_t>& entries) {
  offsets.assign(static_cast<size_t>(count) + 1, 0);
  auto each = [&](auto&& visit) {
    for (int32_t i = 0; i < static_cast<int32_t>(mask.slices.size()); ++i) {
      const Slice& s = mask.slices[i];
      const Range span = kept.span(s);
      for (int32_t x = span.start; x < span.end; ++x)
        if (!kept(s, x).empty()) visit(x, i);
    }
  };
  each([&](int32_t x, int32_t) { ++offsets[x + 1]; });
  for (int32_t x = 0; x < count; ++x) offsets[x + 1] += offsets[x];
  entries.resize(static_cast<size_t>(offsets[count]));
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
  each([&](int32_t x, int32_t i) { entries[fill[x]++] = i; });  // slice order within a row: deterministic
}

struct RowsKept {
  Range span(const Slice& s) const { return s.q; }
  Range operator()(const Slice& s, int32_t q) const { return kept_keys(s, q); }
};
struct KeysKept {
  Range span(const Slice& s) const { return s.k; }
  Range operator()(const Slice& s, int32_t k) const { return kept_queries(s, k); }
};

size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

struct Plan {
  int32_t device = 0;
  Geometry g;
  MaskLists lists;
  double* row_max = nullptr;  // [Tq, Hq]
  double* delta = nullptr;    // [Tq, Hq]
  void* memory = nullptr;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (memory) {
      int previous = 0;
      cudaGetDevice(&previous);
      cudaSetDevice(device);
      cudaFree(memory);
      cudaSetDevice(previous);
    }
  }
};

std::shared_ptr<Plan> make_plan(const Mask& mask, int32_t heads_q, int32_t heads_kv, int32_t head_dim,
                                int32_t device) {
  if (head_dim > kMaxHeadDim)
    throw NotAvailable("reference backend on CUDA: head dim " + std::to_string(head_dim) + " is above " +
                       std::to_string(kMaxHeadDim));
  auto plan = std::make_shared<Plan>();
  plan->device = device;
  plan->g = {mask.total_q, mask.total_k, heads_q, heads_kv, head_dim};
  std::vector<int64_t> row_offsets, key_offsets;
  std::vector<int32_t> row_slices, key_slices;
  build_lists(mask, mask.total_q, RowsKept{}, row_offsets, row_slices);
  build_lists(mask, mask.total_k, KeysKept{}, key_offsets, key_slices);

  struct Part {
    const void* host;
    size_t bytes;
    size_t offset = 0;
  };
  const size_t row_stats = sizeof(double) * static_cast<size_t>(mask.total_q) * heads_q;
  Part parts[] = {{mask.slices.data(), sizeof(Slice) * mask.slices.size()},
                  {row_offsets.data(), sizeof(int64_t) * row_offsets.size()},
                  {row_slices.data(), sizeof(int32_t) * row_slices.size()},
                  {key_offsets.data(), sizeof(int64_t) * key_offsets.size()},
                  {key_slices.data(), sizeof(int32_t) * key_slices.size()},
                  {nullptr, row_stats},
                  {nullptr, row_stats}};
  size_t total = 0;
  for (Part& part : parts) {
    part.offset = total;
    total += aligned(part.bytes);
  }
  DeviceGuard guard(device);
  check(cudaMalloc(&plan->memory, total == 0 ? 256 : total), "cudaMalloc (reference plan)");
  char* base = static_cast<char*>(plan->memory);
  for (const Part& part : parts)
    if (part.host && part.bytes) check(cudaMemcpy(base + part.offset, part.host, part.bytes, cudaMemcpyHostToDevice),
                                       "cudaMemcpy (reference plan)");
  plan->lists = {reinterpret_cast<const Slice*>(base + parts[0].offset),
                 reinterpret_cast<const int64_t*>(base + parts[1].offset),
                 reinterpret_cast<const int32_t*>(base + parts[2].offset),
                 reinterpret_cast<const int64_t*>(base + parts[3].offset),
                 reinterpret_cast<const int32_t*>(base + parts[4].offset)};
  plan->row_max = reinterpret_cast<double*>(base + parts[5].offset);
  plan->delta = reinterpret_cast<double*>(base + parts[6].offset);
  return plan;
}

namespace {

int32_t sink_len_of(const TensorView& sink, SinkLayout layout) {
  if (layout == SinkLayout::None) return 0;
  return static_cast<int32_t>(layout == SinkLayout::SH ? sink.shape[0] : sink.shape[1]);
}

// At most (2 * 1024 + 2 * 128) doubles = 18 KiB: under the 48 KiB default, no opt-in needed.
size_t row_shared_bytes(const Geometry& g, int rows_of_d) {
  return sizeof(double) * (static_cast<size_t>(rows_of_d) * g.d + 2 * kThreads);
}

void launch_check(const char* kernel) { check(cudaGetLastError(), kernel); }

}  // namespace

void forward(const Plan& plan, const ForwardArgs& args, const Options& options, cudaStream_t stream) {
  DeviceGuard guard(plan.device);
  const Geometry& g = plan.g;
  ForwardParams p;
  p.mask = plan.lists;
  p.g = g;
  p.logits = {options.softmax_scale, options.softcap};
  p.q = buffer(args.q);
  p.k = buffer(args.k);
  p.v = buffer(args.v);
  p.out = buffer(args.out);
  p.lse = buffer(args.lse);
  p.sink_layout = options.sink_layout;
  p.sink_len = sink_len_of(args.sink, options.sink_layout);
  p.sink = p.sink_len ? args.sink.as<const float>() : nullptr;
  const bool want_max = args.max_logits.ndim != 0;
  p.row_max = want_max ? plan.row_max : nullptr;
  if (g.tq > 0) {
    const size_t shared = row_shared_bytes(g, 1);
    forward_kernel<<<dim3(g.tq, g.hq), kThreads, shared, stream>>>(p);
    launch_check("reference forward kernel");
  }
  if (want_max) {
    max_logits_kernel<<<g.hq, kThreads, 0, stream>>>(plan.row_max, g.tq, g.hq, args.max_logits.as<float>());
    launch_check("reference max_logits kernel");
  }
}

void backward(const Plan& plan, const BackwardArgs& args, const Options& options, cudaStream_t stream) {
  DeviceGuard guard(plan.device);
  const Geometry& g = plan.g;
  BackwardParams p;
  p.mask = plan.lists;
  p.g = g;
  p.logits = {options.softmax_scale, options.softcap};
  p.q = buffer(args.q);
  p.k = buffer(args.k);
  p.v = buffer(args.v);
  p.out = buffer(args.out);
  p.dout = buffer(args.dout);
  p.lse = buffer(args.lse);
  p.dq = buffer(args.dq);
  p.dk = buffer(args.dk);
  p.dv = buffer(args.dv);
  p.sink_layout = options.sink_layout;
  p.sink_len = sink_len_of(args.sink, options.sink_layout);
  p.sink = p.sink_len ? args.sink.as<const float>() : nullptr;
  p.dsink = p.sink_len ? args.dsink.as<float>() : nullptr;
  p.delta = plan.delta;
  const size_t shared = row_shared_bytes(g, 2);
  if (g.tq > 0) {
    dq_kernel<<<dim3(g.tq, g.hq), kThreads, shared, stream>>>(p);
    launch_check("reference dq kernel");
  }
  if (g.tk > 0) {
    dkdv_kernel<<<dim3(g.tk, g.hkv), kThreads, shared, stream>>>(p);
    launch_check("reference dk/dv kernel");
  }
  if (options.sink_layout == SinkLayout::SH) {
    dsink_shared_kernel<<<dim3(p.sink_len, g.hq), kThreads, 0, stream>>>(p);
    launch_check("reference dsink kernel");
  }
}

}  // namespace magi::cuda::reference
