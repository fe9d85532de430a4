#include "specd/kernels/cuda/swiglu.h"

#include <algorithm>

#include "kernels/cuda/device_utils.cuh"

namespace specd {
namespace cuda {
namespace {

using internal::Bf16x8ToFloat;
using internal::FloatToBf16x8;

__device__ __forceinline__ float Silu(float g) { return g / (1.0f + expf(-g)); }

// Grid-stride over vectors of kVec outputs; fp32 math, one rounding to bf16. A warp walks the
// stride loop as one (v = base + lane), so that with discard_gate_up its lanes can agree that a
// line's readers are done: lanes 8j..8j+7 read 64 consecutive elements (128 bytes) of gate and
// of up, and lanes 8j and 8j + 1 drop those two lines after a __syncwarp.
template <int kVec>
__global__ void SwiGluKernel(SwiGluParams p) {
  internal::PdlWait();
  internal::PdlTrigger();
  const int64_t per_row = p.dim / kVec;
  const int64_t total = p.rows * per_row;
  const int lane = threadIdx.x & 31;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const bool discard = kVec == 8 && p.discard_gate_up && per_row % 8 == 0;
  for (int64_t base = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x - lane;
       base < total; base += stride) {
    const int64_t v = base + lane;
    const int64_t r = v / per_row;
    const int64_t c = (v % per_row) * kVec;
    const bf16* gate = p.gate_up + r * 2 * p.dim + c;
    const bf16* up = gate + p.dim;
    if (v < total) {
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
    if (discard) {
      // base % 32 == 0 and per_row % 8 == 0, so lanes 8j..8j+7 share a row.
      __syncwarp();
      // Lane 8j drops the group's gate line, lane 8j + 1 its up line (their addresses from
      // lane 8j), when the line starts there.
      const int lead = lane & ~7;
      const bf16* line = (lane & 7) == 0 ? gate : up - 8;
      const int64_t lead_v = base + lead;
      if ((lane & 7) < 2 && lead_v + 7 < total &&
          (reinterpret_cast<uintptr_t>(line) & 127) == 0) {
        internal::DiscardL2Line(line);
      }
    }
  }
  // The dead buffer's readers are earlier grids, complete since PdlWait.
  if (p.dead.ptr != nullptr) {
    const int64_t threads = stride;
    const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    internal::DiscardL2(p.dead.ptr, p.rows * p.dead.row_bytes, static_cast<int>(first),
                        static_cast<int>(threads));
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
