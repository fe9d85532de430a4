#include "specd/kernels/rope.h"

#include <cmath>

namespace specd {

void RopeCpu(const RopeParams& p) {
  const int64_t half = p.head_dim / 2;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const float pos = static_cast<float>(p.positions[t]);
    float* row = p.x + t * p.row_stride;
    for (int64_t i = 0; i < half; ++i) {
      // fp32 angle, as transformers computes inv_freq @ position_ids in fp32.
      const float angle = pos * p.inv_freq[i];
      const float c = std::cos(angle);
      const float s = std::sin(angle);
      for (int64_t h = 0; h < p.num_heads; ++h) {
        float* x = row + h * p.head_dim;
        const float x1 = x[i];
        const float x2 = x[i + half];
        x[i] = x1 * c - x2 * s;
        x[i + half] = x2 * c + x1 * s;
      }
    }
  }
}

}  // namespace specd
