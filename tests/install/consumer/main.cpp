// Runs a tiny causal attention through the installed library and checks one value by hand.
#include <cmath>
#include <cstdio>
#include <vector>

#include "magi/attention.hpp"

int main() {
  const int T = 2, D = 8;
  std::vector<double> q(T * D, 0.5), k(T * D, 0.25), v(T * D), out(T * D, NAN), lse(T, NAN);
  for (int i = 0; i < T * D; ++i) v[i] = i / D;  // row 0 of v is 0s, row 1 is 1s
  magi::ForwardArgs args;
  args.q = {q.data(), magi::DType::F64, {T, 1, D}};
  args.k = {k.data(), magi::DType::F64, {T, 1, D}};
  args.v = {v.data(), magi::DType::F64, {T, 1, D}};
  args.out = {out.data(), magi::DType::F64, {T, 1, D}};
  args.lse = {lse.data(), magi::DType::F64, {T, 1}};
  magi::forward(magi::masks::causal(T, T), args);
  // Row 0 sees only key 0 (v = 0); row 1 sees both keys with equal scores (v mean 0.5).
  const bool ok = out[0] == 0.0 && std::fabs(out[D] - 0.5) < 1e-12 && std::isfinite(lse[1]);
  std::printf("consumer: %s\n", ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
