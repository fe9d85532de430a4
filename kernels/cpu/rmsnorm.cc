#include "specd/kernels/rmsnorm.h"

#include <cmath>

namespace specd {

void RmsNormCpu(const RmsNormParams& p) {
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* x = p.x + r * p.dim;
    float* out = p.out + r * p.dim;
    // With a residual, the normalised input is the updated residual row.
    const float* in = x;
    if (p.residual != nullptr) {
      float* res = p.residual + r * p.dim;
      for (int64_t i = 0; i < p.dim; ++i) res[i] = x[i] + res[i];
      in = res;
    }
    double sum_sq = 0.0;
    for (int64_t i = 0; i < p.dim; ++i) sum_sq += static_cast<double>(in[i]) * in[i];
    const double inv = 1.0 / std::sqrt(sum_sq / static_cast<double>(p.dim) + p.eps);
    for (int64_t i = 0; i < p.dim; ++i) {
      out[i] = static_cast<float>(in[i] * inv) * p.weight[i];
    }
  }
}

}  // namespace specd
