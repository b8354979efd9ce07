// Packed-document masks like those of LLM pre-training: document lengths from a long-tailed (lognormal)
// distribution, reproducible from a seed on every platform (own normal sampler over std::mt19937_64).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace magi::cli {

// Standard normal samples by Box-Muller over mt19937_64 (std::normal_distribution differs between
// standard libraries, which would make --seed results platform dependent).
class NormalSampler {
 public:
  explicit NormalSampler(uint64_t seed) : engine_(seed) {}
  double operator()();
  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

struct DocumentShape {
  double median_length = 512;  // lognormal median
  double sigma = 1.2;          // lognormal sigma: a heavy right tail
  int32_t min_length = 16;
  int32_t max_length = 0;      // 0 = total / 2 (at least min_length)
};

// cu_seqlens (0, ..., total) of documents packed into `total` tokens. The last document takes the
// remainder; a remainder shorter than min_length is merged into its predecessor.
std::vector<int32_t> draw_documents(int32_t total, uint64_t seed, const DocumentShape& shape = {});

}  // namespace magi::cli
