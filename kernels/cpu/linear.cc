#include "specd/kernels/linear.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace specd {

void LinearCpu(const LinearParams& p) {
  const int64_t n = p.out_features, k = p.in_features, block = p.row_block;
  const int64_t full = p.rows / block * block;
  // Whole blocks run in place on the caller's rows; each call has exactly `block` rows.
  for (int64_t r = 0; r < full; r += block) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, block, n, k, 1.0f, p.x + r * k, k, p.w, k,
                0.0f, p.y + r * n, n);
  }
  // The tail is padded with zero rows to a whole block, so it takes the same sgemm path.
  if (const int64_t tail = p.rows - full; tail > 0) {
    std::vector<float> x(block * k, 0.0f);
    std::vector<float> y(block * n);
    std::memcpy(x.data(), p.x + full * k, sizeof(float) * tail * k);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, block, n, k, 1.0f, x.data(), k, p.w, k,
                0.0f, y.data(), n);
    std::memcpy(p.y + full * n, y.data(), sizeof(float) * tail * n);
  }
  if (p.bias != nullptr) {
    for (int64_t r = 0; r < p.rows; ++r) {
      float* y = p.y + r * n;
      for (int64_t j = 0; j < n; ++j) y[j] += p.bias[j];
    }
  }
}

bool LinearRowBlockInvariant(const float* w, int64_t out_features, int64_t in_features) {
  const int64_t n = out_features, k = in_features, block = kLinearRowBlock;
  // Deterministic pseudo-random rows in [-1, 1) (a fixed LCG: no state shared with callers).
  uint32_t state = 12345;
  std::vector<float> x((block + 1) * k);
  for (float& v : x) {
    state = state * 1664525u + 1013904223u;
    v = static_cast<float>(state >> 8) / static_cast<float>(1u << 23) - 1.0f;
  }
  const float* probe = x.data() + block * k;  // the last row
  std::vector<float> alone(n), y(block * n);
  LinearParams p;
  p.w = w;
  p.in_features = k;
  p.out_features = n;
  p.x = probe;
  p.y = alone.data();
  p.rows = 1;
  LinearCpu(p);
  std::vector<float> xs(block * k);
  for (int64_t pos = 0; pos < block; ++pos) {
    std::memcpy(xs.data(), x.data(), sizeof(float) * block * k);
    std::memcpy(xs.data() + pos * k, probe, sizeof(float) * k);
    p.x = xs.data();
    p.y = y.data();
    p.rows = block;
    LinearCpu(p);
    if (std::memcmp(y.data() + pos * n, alone.data(), sizeof(float) * n) != 0) return false;
  }
  return true;
}

void LinearNaiveCpu(const LinearParams& p) {
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* x = p.x + r * p.in_features;
    for (int64_t j = 0; j < p.out_features; ++j) {
      const float* w = p.w + j * p.in_features;
      double acc = 0.0;
      for (int64_t i = 0; i < p.in_features; ++i) acc += static_cast<double>(x[i]) * w[i];
      float y = static_cast<float>(acc);
      if (p.bias != nullptr) y += p.bias[j];
      p.y[r * p.out_features + j] = y;
    }
  }
}

}  // namespace specd
