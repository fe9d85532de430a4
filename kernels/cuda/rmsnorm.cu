#include <algorithm>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/rmsnorm_row.cuh"
#include "specd/kernels/cuda/rmsnorm.h"

namespace specd {
namespace cuda {
namespace {

using internal::Bf16x8ToFloat;
using internal::BlockSum;
using internal::LoadFloat8;
using internal::RmsNormRow8;
using internal::RmsNormThreads;
using internal::RowResidual;

// A row of any size or alignment, one element a thread at a time; load(i) is the input's
// element i as fp32.
template <typename Load1>
__device__ __forceinline__ void RmsNormRow1(const RmsNormParams& p, Load1 load, float* res,
                                            bf16* out, float* scratch) {
  float sum_sq = 0.0f;
  for (int64_t i = threadIdx.x; i < p.dim; i += blockDim.x) {
    float h = load(i);
    if (res != nullptr) {
      if (!p.residual_init) h += res[i];
      res[i] = h;
    }
    sum_sq += h * h;
  }
  sum_sq = BlockSum(sum_sq, scratch);
  const float inv = rsqrtf(sum_sq / static_cast<float>(p.dim) + p.eps);
  for (int64_t i = threadIdx.x; i < p.dim; i += blockDim.x) {
    const float h = res != nullptr ? res[i] : load(i);
    out[i] = __float2bfloat16(h * inv * p.weight[i]);
  }
}

// One block per row. Pass 1 forms h (updating the residual) and the sum of squares; pass 2
// re-reads h (from the residual, or the input) -- each thread touches only its own elements, so
// `out` may alias `x`, and the second read hits L1/L2. kPartials: the input is the sum of
// p.partials' slabs rather than p.x.
template <int kVec, bool kPartials>
__global__ void RmsNormKernel(RmsNormParams p) {
  __shared__ float scratch[32];
  internal::PdlWait();
  internal::PdlTrigger();
  const int64_t r = blockIdx.x;
  float* res = p.residual != nullptr ? p.residual + r * p.dim : nullptr;
  bf16* out = p.out + r * p.dim;
  if constexpr (kPartials) {
    // Slab s of the row at parts + s * slab.
    const float* parts = p.partials + r * p.dim;
    const int64_t slab = p.rows * p.dim;
    const int n = p.num_partials;
    if constexpr (kVec == 8) {
      const auto load = [parts, slab, n](int64_t i, float* h) {
        LoadFloat8(parts + i, h);
        for (int s = 1; s < n; ++s) {
          float t[8];
          LoadFloat8(parts + s * slab + i, t);
#pragma unroll
          for (int j = 0; j < 8; ++j) h[j] += t[j];
        }
      };
      RmsNormRow8<RowResidual::kIfGiven>(p.dim, load, res, p.residual_init, p.weight, p.eps, out,
                                         scratch);
    } else {
      const auto load = [parts, slab, n](int64_t i) {
        float h = parts[i];
        for (int s = 1; s < n; ++s) h += parts[s * slab + i];
        return h;
      };
      RmsNormRow1(p, load, res, out, scratch);
    }
    // Every thread's reads of the slabs came before the block sum's barrier (with a residual,
    // pass 2 reads the residual instead).
    if (p.discard_partials && res != nullptr) {
      for (int s = 0; s < n; ++s) {
        internal::DiscardL2(parts + s * slab, p.dim * static_cast<int64_t>(sizeof(float)),
                            static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
      }
    }
  } else {
    const bf16* x = p.x + r * p.dim;
    if constexpr (kVec == 8) {
      const auto load = [x](int64_t i, float* h) {
        Bf16x8ToFloat(*reinterpret_cast<const uint4*>(x + i), h);
      };
      RmsNormRow8<RowResidual::kIfGiven>(p.dim, load, res, p.residual_init, p.weight, p.eps, out,
                                         scratch);
    } else {
      RmsNormRow1(
          p, [x](int64_t i) { return __bfloat162float(x[i]); }, res, out, scratch);
    }
  }
  // Their readers are earlier grids, complete since PdlWait.
  for (const DeadRows& d : p.dead) internal::DiscardRow(d.ptr, d.row_bytes, r);
}

// Grid-stride over elements; the same fp32 sum as RmsNormKernel's residual update.
__global__ void ResidualAddKernel(ResidualAddParams p) {
  internal::PdlWait();
  internal::PdlTrigger();
  const int64_t n = p.rows * p.dim;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    float h = p.residual_init && p.x != nullptr ? 0.0f : p.residual[i];
    if (p.x != nullptr) h += __bfloat162float(p.x[i]);
    if (p.bias != nullptr) h += p.bias[i % p.dim];
    p.residual[i] = h;
    if (p.out != nullptr) p.out[i] = __float2bfloat16(h);
  }
}

// Grid-stride over elements.
__global__ void Bf16ToF32Kernel(Bf16ToF32Params p) {
  internal::PdlWait();
  internal::PdlTrigger();
  const int64_t n = p.rows * p.dim;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    const int64_t r = i / p.dim, c = i % p.dim;
    p.dst[r * p.dst_stride + c] = __bfloat162float(p.src[r * p.src_stride + c]);
  }
}

}  // namespace

cudaError_t Bf16ToF32Cuda(const Bf16ToF32Params& p, cudaStream_t stream) {
  if (p.rows < 0 || p.dim <= 0 || p.src_stride < p.dim || p.dst_stride < p.dim) {
    return cudaErrorInvalidValue;
  }
  if (p.rows == 0) return cudaSuccess;
  if (p.src == nullptr || p.dst == nullptr) return cudaErrorInvalidValue;
  const int threads = 256;
  const int64_t n = p.rows * p.dim;
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>((n + threads - 1) / threads, 1 << 16));
  return LaunchPdl("rmsnorm", Bf16ToF32Kernel, dim3(blocks), dim3(threads), 0, stream, p);
}

cudaError_t ResidualAddCuda(const ResidualAddParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.dim <= 0) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  if (p.residual == nullptr) return cudaErrorInvalidValue;
  const int threads = 256;
  const int64_t n = p.rows * p.dim;
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>((n + threads - 1) / threads, 1 << 16));
  return LaunchPdl("rmsnorm", ResidualAddKernel, dim3(blocks), dim3(threads), 0, stream, p);
}

cudaError_t RmsNormCuda(const RmsNormParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.dim <= 0 || !(p.eps >= 0.0f)) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  const bool parts = p.partials != nullptr;
  if ((p.x == nullptr) == !parts || (parts && p.num_partials < 1) || p.weight == nullptr ||
      p.out == nullptr)
    return cudaErrorInvalidValue;
  const void* input = parts ? static_cast<const void*>(p.partials) : p.x;
  const bool vec = p.dim % 8 == 0 && IsAligned(input, 16) && IsAligned(p.weight, 16) &&
                   IsAligned(p.out, 16) && (p.residual == nullptr || IsAligned(p.residual, 16));
  // Slabs cost 4 bytes an element each (a bf16 input 2), so a row of them is read with one
  // 8-element group a thread: each thread's loads all issue at once. The bf16 path keeps
  // RmsNormThreads, whose bits the fused all-reduce reproduces (rmsnorm_row.cuh).
  int threads = RmsNormThreads(p.dim);
  if (parts && vec) {
    while (threads < 1024 && threads * 8 < p.dim) threads *= 2;
  }
  const auto kernel = parts ? (vec ? RmsNormKernel<8, true> : RmsNormKernel<1, true>)
                            : (vec ? RmsNormKernel<8, false> : RmsNormKernel<1, false>);
  return LaunchPdl("rmsnorm", kernel, dim3(static_cast<unsigned>(p.rows)), dim3(threads), 0, stream,
                   p);
}

}  // namespace cuda
}  // namespace specd
