// Device helpers private to kernels/cuda: warp/block reductions, bf16 vector access.
#ifndef SPECD_KERNELS_CUDA_DEVICE_UTILS_CUH_
#define SPECD_KERNELS_CUDA_DEVICE_UTILS_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <utility>

#include "specd/kernels/cuda/launch_tuning.h"

namespace specd {
namespace cuda {
namespace internal {

constexpr unsigned kFullMask = 0xffffffffu;

// Monotone map of floats to uint32 (NaN lowest; -0 as +0, as the host's comparisons see them).
__device__ __forceinline__ uint32_t OrderedBits(float x) {
  if (x != x) return 0u;
  if (x == 0.0f) x = 0.0f;
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// engine/sampling.cc's sort order (logit descending, id ascending) as one descending 64-bit key.
__device__ __forceinline__ uint64_t SortKey(float logit, int id) {
  return (static_cast<uint64_t>(OrderedBits(logit)) << 32) |
         (0xffffffffu - static_cast<uint32_t>(id));
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Sum over the block; every thread gets the result. `scratch` holds >= 32 floats; the block's
// size is a multiple of 32. Contains __syncthreads(): call from all threads.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = WarpSum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = lane < warps ? scratch[lane] : 0.0f;
  return WarpSum(total);
}

// 8 bf16 values <-> 8 floats through one 16-byte access.
__device__ __forceinline__ void Bf16x8ToFloat(const uint4& raw, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

// 8 floats (16-byte aligned) through two 16-byte loads.
__device__ __forceinline__ void LoadFloat8(const float* p, float* f) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x;
  f[1] = a.y;
  f[2] = a.z;
  f[3] = a.w;
  f[4] = b.x;
  f[5] = b.y;
  f[6] = b.z;
  f[7] = b.w;
}

__device__ __forceinline__ uint4 FloatToBf16x8(const float* f) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return raw;
}

__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Programmatic dependent launch (sm_90; no-ops below). A kernel launched with LaunchPdl may be
// scheduled while the kernel before it in the stream is still running, so it must call PdlWait()
// before it touches global memory that an earlier kernel writes or reads (its inputs, and
// outputs an earlier kernel may still be reading); read-only data such as weights may come
// before, and so may a step's metadata that the host copied in before the step's first kernel
// (every kernel here waits before it triggers, so when one starts, all but its predecessor have
// finished). PdlTrigger() lets the next PDL kernel be scheduled: it only waits for this grid's
// completion and memory in its own PdlWait(), so triggering first thing is safe, and it hides
// the next launch behind this kernel.
__device__ __forceinline__ void PdlWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void PdlTrigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Drops one 128-byte aligned line from L2 without write-back (PTX discard.global.L2). A drop
// costs the issuing thread about an L2 round trip, so a kernel spreads its lines over its threads
// rather than looping in a few. Every read of the line, by any thread, must be ordered before
// this (program order in the thread that read, else a barrier or an earlier grid's completion).
// See DeadRows (common.h) for why.
__device__ __forceinline__ void DiscardL2Line(const void* line) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(line) : "memory");
#endif
}

// DiscardL2Line over the lines wholly inside [begin, begin + bytes) (a partial line at either end
// may hold live data and stays); thread i of n takes lines i, i + n, ....
__device__ __forceinline__ void DiscardL2(const void* begin, int64_t bytes, int i, int n) {
  const uintptr_t b = reinterpret_cast<uintptr_t>(begin);
  const uintptr_t lo = (b + 127) & ~uintptr_t{127};
  const uintptr_t hi = (b + static_cast<uintptr_t>(bytes)) & ~uintptr_t{127};
  for (uintptr_t a = lo + static_cast<uintptr_t>(i) * 128; a < hi;
       a += static_cast<uintptr_t>(n) * 128) {
    DiscardL2Line(reinterpret_cast<const void*>(a));
  }
}

// DeadRows' row r, by the threads of a block.
__device__ __forceinline__ void DiscardRow(const void* ptr, int64_t row_bytes, int64_t r) {
  if (ptr != nullptr) {
    DiscardL2(static_cast<const unsigned char*>(ptr) + r * row_bytes, row_bytes,
              static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
  }
}

}  // namespace internal

// Host side: whether launches at `site` ("rmsnorm", "swiglu", "rope", "embedding", "attention",
// "combine", "allreduce") use programmatic dependent launch, as the process's LaunchTuning says
// (specd/kernels/cuda/launch_tuning.h; the engine sets it from SPECD_PDL and SPECD_PDL_OFF).
inline bool PdlEnabled(const char* site) { return GetLaunchTuning().PdlAt(site); }

// Host side: the shared-memory share of L1, in percent, that LaunchPdl asks for; -1 for none.
// Every launch asks for the largest share (100) unless the LaunchTuning says otherwise
// (SPECD_SMEM_CARVEOUT). An SM changes its split only when idle, and a kernel launched early by
// PDL lands on SMs where its predecessor still runs: behind RoPE under a small split, the 64-node
// verify attention (200 CTAs of 80 KB, two an SM) fitted one CTA on some SMs and ran 43-45 us a
// layer instead of 37 (cuda_step_bench --trace). Asking for the same split everywhere took
// 0.18 ms off that 8B step and left decode and 16 nodes as they were
// (bench/history/16-gpu-run-10.md); none of these kernels leans on L1.
inline int SmemCarveout() { return GetLaunchTuning().smem_carveout; }

// Launches `kernel` as a programmatic dependent of the stream's previous kernel (when
// PdlEnabled(site)); the kernel must call internal::PdlWait() as described above. Works under
// stream capture (a programmatic graph edge).
template <typename... Params, typename... Args>
cudaError_t LaunchPdl(const char* site, void (*kernel)(Params...), dim3 grid, dim3 block,
                      size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  unsigned n = 0;
  if (PdlEnabled(site)) {
    attribute[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (const int carveout = SmemCarveout(); carveout >= 0) {
    attribute[n].id = cudaLaunchAttributePreferredSharedMemoryCarveout;
    attribute[n].val.sharedMemCarveout = static_cast<unsigned>(carveout);
    ++n;
  }
  config.attrs = attribute;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Host side: whether `p` is aligned to `bytes`.
inline bool IsAligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_DEVICE_UTILS_CUH_
