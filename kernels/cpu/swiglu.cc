#include "specd/kernels/swiglu.h"

#include <cmath>

namespace specd {

void SwiGluCpu(const SwiGluParams& p) {
  for (int64_t i = 0; i < p.n; ++i) {
    const float g = p.gate[i];
    p.out[i] = g / (1.0f + std::exp(-g)) * p.up[i];
  }
}

}  // namespace specd
