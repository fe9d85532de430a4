// The gated activation of Llama-family MLPs: out = silu(gate) * up, silu(g) = g / (1 + e^-g).
#ifndef SPECD_KERNELS_SWIGLU_H_
#define SPECD_KERNELS_SWIGLU_H_

#include <stdint.h>

namespace specd {

struct SwiGluParams {
  const float* gate = nullptr;  // [n] fp32, host (gate_proj output)
  const float* up = nullptr;    // [n] fp32, host (up_proj output)
  float* out = nullptr;         // [n] fp32, host; may alias gate or up
  int64_t n = 0;                // rows * intermediate_size
};

void SwiGluCpu(const SwiGluParams& p);

}  // namespace specd

#endif  // SPECD_KERNELS_SWIGLU_H_
