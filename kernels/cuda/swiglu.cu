#include "specd/kernels/cuda/swiglu.h"

#include <algorithm>

#include "kernels/cuda/device_utils.cuh"

namespace specd {
namespace cuda {
namespace {

using internal::Bf16x8ToFloat;
using internal::FloatToBf16x8;

__device__ __forceinline__ float Silu(float g) { return g / (1.0f + expf(-g)); }

// Grid-stride over vectors of kVec outputs; fp32 math, one rounding to bf16.
template <int kVec>
__global__ void SwiGluKernel(SwiGluParams p) {
  internal::PdlWait();
  internal::PdlTrigger();
  const int64_t per_row = p.dim / kVec;
  const int64_t total = p.rows * per_row;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = v / per_row;
    const int64_t c = (v % per_row) * kVec;
    const bf16* gate = p.gate_up + r * 2 * p.dim + c;
    const bf16* up = gate + p.dim;
    bf16* out = p.out + r * p.dim + c;
    if constexpr (kVec == 8) {
      float g[8], u[8];
      Bf16x8ToFloat(*reinterpret_cast<const uint4*>(gate), g);
      Bf16x8ToFloat(*reinterpret_cast<const uint4*>(up), u);
#pragma unroll
      for (int j = 0; j < 8; ++j) g[j] = Silu(g[j]) * u[j];
      *reinterpret_cast<uint4*>(out) = FloatToBf16x8(g);
    } else {
      *out = __float2bfloat16(Silu(__bfloat162float(*gate)) * __bfloat162float(*up));
    }
  }
}

}  // namespace

cudaError_t SwiGluCuda(const SwiGluParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.dim <= 0) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  if (p.gate_up == nullptr || p.out == nullptr) return cudaErrorInvalidValue;
  const bool vec = p.dim % 8 == 0 && IsAligned(p.gate_up, 16) && IsAligned(p.out, 16);
  const int64_t items = p.rows * (vec ? p.dim / 8 : p.dim);
  const int threads = 256;
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>((items + threads - 1) / threads, 1 << 16));
  return LaunchPdl("swiglu", vec ? SwiGluKernel<8> : SwiGluKernel<1>,
                   dim3(blocks), dim3(threads), 0, stream, p);
}

}  // namespace cuda
}  // namespace specd
