#include "specd/kernels/linear.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace specd {

void LinearCpu(const LinearParams& p) {
  const int64_t n = p.out_features, k = p.in_features;
  const int64_t full = p.rows / kLinearRowBlock * kLinearRowBlock;
  // Whole blocks run in place on the caller's rows; each call has exactly kLinearRowBlock rows.
  for (int64_t r = 0; r < full; r += kLinearRowBlock) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, kLinearRowBlock, n, k, 1.0f,
                p.x + r * k, k, p.w, k, 0.0f, p.y + r * n, n);
  }
  // The tail is padded with zero rows to a whole block, so it takes the same sgemm path.
  if (const int64_t tail = p.rows - full; tail > 0) {
    std::vector<float> x(kLinearRowBlock * k, 0.0f);
    std::vector<float> y(kLinearRowBlock * n);
    std::memcpy(x.data(), p.x + full * k, sizeof(float) * tail * k);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, kLinearRowBlock, n, k, 1.0f, x.data(),
                k, p.w, k, 0.0f, y.data(), n);
    std::memcpy(p.y + full * n, y.data(), sizeof(float) * tail * n);
  }
  if (p.bias != nullptr) {
    for (int64_t r = 0; r < p.rows; ++r) {
      float* y = p.y + r * n;
      for (int64_t j = 0; j < n; ++j) y[j] += p.bias[j];
    }
  }
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
