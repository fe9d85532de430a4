#include "specd/kernels/cuda/allreduce.h"

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/rmsnorm_row.cuh"

namespace specd {
namespace cuda {
namespace {

using internal::Bf16x8ToFloat;
using internal::FloatToBf16x8;
using internal::RmsNormRow8;
using internal::RowResidual;
using internal::RmsNormThreads;

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

// Rows strided over the grid, one row at a time per block, through RmsNormCuda's own row code
// and block size (kernels/cuda/rmsnorm_row.cuh): with x = the rank sum, the results are
// RmsNormCuda's bit for bit.
template <int N>
__global__ void __launch_bounds__(1024)
    AllReduceFusedKernel(const __grid_constant__ AllReduceParams p) {
  __shared__ float scratch[32];
  StartBarrier<N>(p);
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const int64_t base = r * p.dim;
    const auto load = [&p, base](int64_t i, float* h) { SumRanks<N>(p, base + i, h); };
    RmsNormRow8<RowResidual::kAlways>(p.dim, load, p.residual + base, p.residual_init,
                                      p.norm_weight, p.eps, p.out + base, scratch);
  }
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
    AllReduceFusedKernel<N><<<static_cast<unsigned>(grid), RmsNormThreads(p.dim), 0, stream>>>(p);
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
