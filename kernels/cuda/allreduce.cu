#include "specd/kernels/cuda/allreduce.h"

#include "kernels/cuda/device_utils.cuh"

namespace specd {
namespace cuda {
namespace {

using internal::Bf16x8ToFloat;
using internal::BlockSum;
using internal::FloatToBf16x8;

// One site's signal area on one rank. flags[b][p] is written only by block b of rank p (remote
// stores); counters[b][t] only by thread t of this rank's block b, which keeps one copy per
// barrier thread so that no thread has to share its count through shared memory.
struct SignalArea {
  uint32_t flags[kAllReduceMaxBlocks][kAllReduceMaxRanks];
  uint32_t counters[kAllReduceMaxBlocks][kAllReduceMaxRanks];
};

constexpr int kPlainThreads = 512;

__device__ __forceinline__ void StoreReleaseSys(uint32_t* addr, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t LoadAcquireSys(const uint32_t* addr) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
}

// The start barrier of block blockIdx.x (see allreduce.h). Thread t < N signals rank t and waits
// for rank t; the release store orders everything this rank wrote before the kernel (its
// partials, written by the previous kernel on its stream) before the flag, and the acquire load
// plus __syncthreads orders the peer's partials before every thread's reads below. The count
// increments identically on every rank because every rank launches the same grid at every call
// of the site, so no host value is needed and graph replays stay in step.
template <int N>
__device__ __forceinline__ void StartBarrier(const AllReduceParams& p) {
  if (threadIdx.x < N) {
    SignalArea* self = reinterpret_cast<SignalArea*>(p.signals[p.rank]);
    SignalArea* peer = reinterpret_cast<SignalArea*>(p.signals[threadIdx.x]);
    uint32_t* counter = &self->counters[blockIdx.x][threadIdx.x];
    // .cg: this block may run on another SM than at the last call; never trust L1 here.
    const uint32_t flag = __ldcg(counter) + 1u;
    __stcg(counter, flag);
    StoreReleaseSys(&peer->flags[blockIdx.x][p.rank], flag);
    const uint32_t* wait = &self->flags[blockIdx.x][threadIdx.x];
    // Equality, not >=: the count wraps after 2^32 calls, and rule 2 of the contract keeps a
    // peer from writing the next value before this block has seen this one.
    while (LoadAcquireSys(wait) != flag) {
    }
  }
  __syncthreads();
}

// h[0..7] = sum over ranks, in rank order, of the 8 bf16 at element `offset` of each input.
// All N loads are issued before any is used so that their NVLink latencies overlap. .cg loads
// bypass L1, which may hold lines of these addresses from an earlier call.
template <int N>
__device__ __forceinline__ void SumRanks(const AllReduceParams& p, int64_t offset, float* h) {
  uint4 raw[N];
#pragma unroll
  for (int q = 0; q < N; ++q) raw[q] = __ldcg(reinterpret_cast<const uint4*>(p.inputs[q] + offset));
  Bf16x8ToFloat(raw[0], h);
#pragma unroll
  for (int q = 1; q < N; ++q) {
    float t[8];
    Bf16x8ToFloat(raw[q], t);
#pragma unroll
    for (int j = 0; j < 8; ++j) h[j] += t[j];
  }
}

// out = sum; the 16-byte vectors of the whole [rows, dim] tensor are strided over the grid.
template <int N>
__global__ void __launch_bounds__(kPlainThreads)
    AllReducePlainKernel(const __grid_constant__ AllReduceParams p) {
  StartBarrier<N>(p);
  const int64_t vectors = p.rows * p.dim / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors;
       v += stride) {
    float h[8];
    SumRanks<N>(p, v * 8, h);
    *reinterpret_cast<uint4*>(p.out + v * 8) = FloatToBf16x8(h);
  }
}

// Rows strided over the grid, one row at a time per block, with RmsNormKernel<8>'s loop
// structure (kernels/cuda/rmsnorm.cu) and the same block size for the same dim, so that each
// thread's partial sum of squares and the block reduction are the same operations in the same
// order: with x = the rank sum, the results are RmsNormCuda's bit for bit.
template <int N>
__global__ void __launch_bounds__(1024)
    AllReduceFusedKernel(const __grid_constant__ AllReduceParams p) {
  __shared__ float scratch[32];
  StartBarrier<N>(p);
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const int64_t base = r * p.dim;
    float* res = p.residual + base;
    bf16* out = p.out + base;
    float sum_sq = 0.0f;
    for (int64_t i = threadIdx.x * 8; i < p.dim; i += blockDim.x * 8) {
      float h[8];
      SumRanks<N>(p, base + i, h);
      float4* rv = reinterpret_cast<float4*>(res + i);
      if (!p.residual_init) {
        const float4 a = rv[0], b = rv[1];
        h[0] += a.x;
        h[1] += a.y;
        h[2] += a.z;
        h[3] += a.w;
        h[4] += b.x;
        h[5] += b.y;
        h[6] += b.z;
        h[7] += b.w;
      }
      rv[0] = make_float4(h[0], h[1], h[2], h[3]);
      rv[1] = make_float4(h[4], h[5], h[6], h[7]);
#pragma unroll
      for (int j = 0; j < 8; ++j) sum_sq += h[j] * h[j];
    }
    // BlockSum starts with a __syncthreads, so the previous row's reads of scratch are done.
    sum_sq = BlockSum(sum_sq, scratch);
    const float inv = rsqrtf(sum_sq / static_cast<float>(p.dim) + p.eps);
    for (int64_t i = threadIdx.x * 8; i < p.dim; i += blockDim.x * 8) {
      // Each thread re-reads only the residual elements it wrote itself above.
      const float4* rv = reinterpret_cast<const float4*>(res + i);
      const float4 a = rv[0], b = rv[1];
      float h[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      float w[8];
      Bf16x8ToFloat(*reinterpret_cast<const uint4*>(p.norm_weight + i), w);
#pragma unroll
      for (int j = 0; j < 8; ++j) h[j] = h[j] * inv * w[j];
      *reinterpret_cast<uint4*>(out + i) = FloatToBf16x8(h);
    }
  }
}

// RmsNormCuda's block size for a row of `dim` (kernels/cuda/rmsnorm.cu): part of the fused
// mode's arithmetic, since it fixes how the sum of squares is split over threads.
int FusedThreads(int64_t dim) {
  int threads = 32;
  while (threads < 1024 && threads * 8 * 2 < dim) threads *= 2;
  return threads;
}

template <int N>
cudaError_t Launch(const AllReduceParams& p, int cap, cudaStream_t stream) {
  if (p.residual == nullptr) {
    const int64_t vectors = p.rows * p.dim / 8;
    int64_t grid = (vectors + kPlainThreads - 1) / kPlainThreads;
    grid = grid < 1 ? 1 : (grid > cap ? cap : grid);
    AllReducePlainKernel<N><<<static_cast<unsigned>(grid), kPlainThreads, 0, stream>>>(p);
  } else {
    const int64_t grid = p.rows < 1 ? 1 : (p.rows > cap ? cap : p.rows);
    AllReduceFusedKernel<N><<<static_cast<unsigned>(grid), FusedThreads(p.dim), 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

int64_t AllReduceSignalBytes() { return static_cast<int64_t>(sizeof(SignalArea)); }

cudaError_t AllReduceCuda(const AllReduceParams& p, cudaStream_t stream) {
  const int n = p.world_size;
  if (n < 1 || n > kAllReduceMaxRanks || p.rank < 0 || p.rank >= n) return cudaErrorInvalidValue;
  if (p.rows < 0 || p.dim <= 0 || p.dim % 8 != 0) return cudaErrorInvalidValue;
  if (p.max_blocks < 0 || p.max_blocks > kAllReduceMaxBlocks) return cudaErrorInvalidValue;
  for (int r = 0; r < n; ++r) {
    if (p.inputs[r] == nullptr || !IsAligned(p.inputs[r], 16)) return cudaErrorInvalidValue;
    if (p.signals[r] == nullptr || !IsAligned(p.signals[r], 16)) return cudaErrorInvalidValue;
  }
  if (p.out == nullptr || !IsAligned(p.out, 16)) return cudaErrorInvalidValue;
  if (p.residual != nullptr) {
    if (!IsAligned(p.residual, 16) || p.norm_weight == nullptr || !IsAligned(p.norm_weight, 16) ||
        !(p.eps >= 0.0f)) {
      return cudaErrorInvalidValue;
    }
  }
  const int cap = p.max_blocks == 0 ? kAllReduceDefaultBlocks : p.max_blocks;
  switch (n) {
    case 1:
      return Launch<1>(p, cap, stream);
    case 2:
      return Launch<2>(p, cap, stream);
    case 3:
      return Launch<3>(p, cap, stream);
    case 4:
      return Launch<4>(p, cap, stream);
    case 5:
      return Launch<5>(p, cap, stream);
    case 6:
      return Launch<6>(p, cap, stream);
    case 7:
      return Launch<7>(p, cap, stream);
    default:
      return Launch<8>(p, cap, stream);
  }
}

}  // namespace cuda
}  // namespace specd
