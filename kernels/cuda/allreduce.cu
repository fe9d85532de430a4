#include "specd/kernels/cuda/allreduce.h"

#include <algorithm>

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
  // Push mode: the count of this site's push-mode calls (its low bit is the mailbox phase) and
  // the blocks of the current call that have finished (the last one advances the count).
  uint32_t push_calls;
  uint32_t push_done;
};

// bf16 -0.0 twice: a mailbox word that no sender has written (see allreduce.h).
constexpr uint32_t kEmpty2 = 0x80008000u;

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

// -0.0 made +0.0 in each bf16 half, so that data never looks like an empty mailbox word. Both
// modes sum canonical inputs, hence the same bits (a sum only differs in the sign of a zero).
__device__ __forceinline__ uint32_t CanonicalWord(uint32_t w) {
  const uint32_t lo = (w & 0xffffu) == 0x8000u ? 0x8000u : 0u;
  const uint32_t hi = (w >> 16) == 0x8000u ? 0x80000000u : 0u;
  return w ^ lo ^ hi;
}

__device__ __forceinline__ uint4 Canonical(uint4 v) {
  return make_uint4(CanonicalWord(v.x), CanonicalWord(v.y), CanonicalWord(v.z),
                    CanonicalWord(v.w));
}

__device__ __forceinline__ bool HalfEmpty(uint32_t w) {
  return (w & 0xffffu) == 0x8000u || (w >> 16) == 0x8000u;
}

// Every bf16 of the vector written (a 16-byte store may land in parts).
__device__ __forceinline__ bool Filled(const uint4& v) {
  return !(HalfEmpty(v.x) || HalfEmpty(v.y) || HalfEmpty(v.z) || HalfEmpty(v.w));
}

__device__ __forceinline__ uint4 LoadVolatile(const uint4* addr) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(addr)
               : "memory");
  return v;
}

__device__ __forceinline__ void StoreVolatile(uint4* addr, const uint4& v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(addr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// h[0..7] = the fp32 sum, in rank order, of raw[0..N-1] (canonical bf16 vectors).
template <int N>
__device__ __forceinline__ void SumInOrder(const uint4 (&raw)[N], float* h) {
  Bf16x8ToFloat(raw[0], h);
#pragma unroll
  for (int q = 1; q < N; ++q) {
    float t[8];
    Bf16x8ToFloat(raw[q], t);
#pragma unroll
    for (int j = 0; j < 8; ++j) h[j] += t[j];
  }
}

// h[0..7] = sum over ranks, in rank order, of the 8 bf16 at element `offset` of each input.
// All N loads are issued before any is used so that their NVLink latencies overlap. .cg loads
// bypass L1, which may hold lines of these addresses from an earlier call.
template <int N>
__device__ __forceinline__ void SumRanks(const AllReduceParams& p, int64_t offset, float* h) {
  uint4 raw[N];
#pragma unroll
  for (int q = 0; q < N; ++q) {
    raw[q] = Canonical(__ldcg(reinterpret_cast<const uint4*>(p.inputs[q] + offset)));
  }
  SumInOrder<N>(raw, h);
}

// Push mode. The slot that `sender` fills in `owner`'s mailbox for this call's phase, as
// 16-byte vectors.
__device__ __forceinline__ uint4* Slot(const AllReduceParams& p, int owner, uint32_t phase,
                                       int sender) {
  const int64_t slot_vectors = p.push_max_bytes / 16;
  return reinterpret_cast<uint4*>(p.mailboxes[owner]) +
         (static_cast<int64_t>(phase) * p.world_size + sender) * slot_vectors;
}

// This rank's canonical partials at vector v.
__device__ __forceinline__ uint4 OwnVector(const AllReduceParams& p, int64_t v) {
  return Canonical(__ldcg(reinterpret_cast<const uint4*>(p.inputs[p.rank]) + v));
}

// Sends `own`, vector v of this rank's partials, to every peer.
template <int N>
__device__ __forceinline__ void PushVector(const AllReduceParams& p, uint32_t phase, int64_t v,
                                           const uint4& own) {
#pragma unroll
  for (int q = 0; q < N; ++q) {
    if (q != p.rank) StoreVolatile(Slot(p, /*owner=*/q, phase, /*sender=*/p.rank) + v, own);
  }
}

// SumRanks for push mode: the peers' vectors come from this rank's mailbox, waited for, and
// each slot is emptied once read.
template <int N>
__device__ __forceinline__ void SumMailbox(const AllReduceParams& p, uint32_t phase, int64_t v,
                                           float* h) {
  uint4 raw[N];
#pragma unroll
  for (int q = 0; q < N; ++q) {
    if (q == p.rank) {
      raw[q] = OwnVector(p, v);
    } else {
      uint4* slot = Slot(p, /*owner=*/p.rank, phase, /*sender=*/q) + v;
      do {
        raw[q] = LoadVolatile(slot);
      } while (!Filled(raw[q]));
      StoreVolatile(slot, make_uint4(kEmpty2, kEmpty2, kEmpty2, kEmpty2));
    }
  }
  SumInOrder<N>(raw, h);
}

// The site's push-mode call count, read by every block at its start (the previous call's last
// block advanced it before that kernel ended); its low bit is the call's phase. Callers issue
// their first input loads before this, so that the two latencies overlap.
__device__ __forceinline__ uint32_t PushCount(const AllReduceParams& p, uint32_t* shared) {
  if (threadIdx.x == 0) {
    *shared = __ldcg(&reinterpret_cast<SignalArea*>(p.signals[p.rank])->push_calls);
  }
  __syncthreads();
  return *shared;
}

// The last block of the call to finish advances the site's count: a plain store when the call
// has one block (decode steps), else the block that completes the arrival count.
__device__ __forceinline__ void PushFinish(const AllReduceParams& p, uint32_t count) {
  __syncthreads();
  if (threadIdx.x == 0) {
    SignalArea* self = reinterpret_cast<SignalArea*>(p.signals[p.rank]);
    if (gridDim.x == 1) {
      self->push_calls = count + 1u;
    } else if (atomicAdd(&self->push_done, 1u) == gridDim.x - 1) {
      self->push_done = 0u;
      self->push_calls = count + 1u;
    }
  }
}

// out = sum; the 16-byte vectors of the whole [rows, dim] tensor are strided over the grid.
template <int N>
__global__ void __launch_bounds__(kPlainThreads)
    AllReducePlainKernel(const __grid_constant__ AllReduceParams p) {
  // Launched with LaunchPdl: the partials are the previous kernel's output.
  internal::PdlWait();
  internal::PdlTrigger();
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
  // Launched with LaunchPdl: the partials are the previous kernel's output.
  internal::PdlWait();
  internal::PdlTrigger();
  __shared__ float scratch[32];
  StartBarrier<N>(p);
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const int64_t base = r * p.dim;
    const auto load = [&p, base](int64_t i, float* h) { SumRanks<N>(p, base + i, h); };
    RmsNormRow8<RowResidual::kAlways>(p.dim, load, p.residual + base, p.residual_init,
                                      p.norm_weight, p.eps, p.out + base, scratch);
  }
}

// Push mode of AllReducePlainKernel: every vector of the block is sent before any is waited
// for, so no rank waits on a peer that is itself still waiting.
template <int N>
__global__ void __launch_bounds__(kPlainThreads)
    AllReducePushPlainKernel(const __grid_constant__ AllReduceParams p) {
  // Launched with LaunchPdl: the partials are the previous kernel's output.
  internal::PdlWait();
  internal::PdlTrigger();
  __shared__ uint32_t count_s;
  const int64_t vectors = p.rows * p.dim / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint4 own_first = first < vectors ? OwnVector(p, first) : uint4{};
  const uint32_t count = PushCount(p, &count_s);
  const uint32_t phase = count & 1u;
  for (int64_t v = first; v < vectors; v += stride) {
    PushVector<N>(p, phase, v, v == first ? own_first : OwnVector(p, v));
  }
  for (int64_t v = first; v < vectors; v += stride) {
    float h[8];
    SumMailbox<N>(p, phase, v, h);
    *reinterpret_cast<uint4*>(p.out + v * 8) = FloatToBf16x8(h);
  }
  PushFinish(p, count);
}

// Push mode of AllReduceFusedKernel: the block's rows are all sent, then normalised as they
// arrive.
template <int N>
__global__ void __launch_bounds__(1024)
    AllReducePushFusedKernel(const __grid_constant__ AllReduceParams p) {
  // Launched with LaunchPdl: the partials are the previous kernel's output.
  internal::PdlWait();
  internal::PdlTrigger();
  __shared__ float scratch[32];
  __shared__ uint32_t count_s;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * p.dim / 8 + threadIdx.x;
  const bool has_first = blockIdx.x < p.rows && threadIdx.x * 8 < p.dim;
  const uint4 own_first = has_first ? OwnVector(p, first) : uint4{};
  const uint32_t count = PushCount(p, &count_s);
  const uint32_t phase = count & 1u;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    for (int64_t i = threadIdx.x * 8; i < p.dim; i += blockDim.x * 8) {
      const int64_t v = (r * p.dim + i) / 8;
      PushVector<N>(p, phase, v, v == first && has_first ? own_first : OwnVector(p, v));
    }
  }
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const int64_t base = r * p.dim;
    const auto load = [&p, phase, base](int64_t i, float* h) {
      SumMailbox<N>(p, phase, (base + i) / 8, h);
    };
    RmsNormRow8<RowResidual::kAlways>(p.dim, load, p.residual + base, p.residual_init,
                                      p.norm_weight, p.eps, p.out + base, scratch);
  }
  PushFinish(p, count);
}

// Fills a mailbox with the empty pattern.
__global__ void MailboxInitKernel(uint4* mailbox, int64_t vectors) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors;
       v += stride) {
    mailbox[v] = make_uint4(kEmpty2, kEmpty2, kEmpty2, kEmpty2);
  }
}

// Plain mode strides 16-byte vectors over the grid, fused mode rows; either takes push mode
// when the message fits the mailboxes.
template <int N>
cudaError_t Launch(const AllReduceParams& p, int cap, cudaStream_t stream) {
  const bool push = p.push_max_bytes > 0 && p.rows * p.dim * 2 <= p.push_max_bytes;
  if (p.residual == nullptr) {
    const int64_t vectors = p.rows * p.dim / 8;
    int64_t grid = (vectors + kPlainThreads - 1) / kPlainThreads;
    grid = grid < 1 ? 1 : (grid > cap ? cap : grid);
    auto* kernel = push ? AllReducePushPlainKernel<N> : AllReducePlainKernel<N>;
    return LaunchPdl("allreduce", kernel, dim3(static_cast<unsigned>(grid)),
                     dim3(kPlainThreads), 0, stream, p);
  }
  const int64_t grid = p.rows < 1 ? 1 : (p.rows > cap ? cap : p.rows);
  auto* kernel = push ? AllReducePushFusedKernel<N> : AllReduceFusedKernel<N>;
  return LaunchPdl("allreduce", kernel, dim3(static_cast<unsigned>(grid)),
                   dim3(RmsNormThreads(p.dim)), 0, stream, p);
}

}  // namespace

int64_t AllReduceSignalBytes() {
  return (static_cast<int64_t>(sizeof(SignalArea)) + 15) / 16 * 16;
}

cudaError_t AllReduceMailboxInitCuda(void* mailbox, int64_t bytes, cudaStream_t stream) {
  if (bytes < 0 || bytes % 16 != 0 ||
      (bytes > 0 && (mailbox == nullptr || !IsAligned(mailbox, 16)))) {
    return cudaErrorInvalidValue;
  }
  if (bytes == 0) return cudaSuccess;
  const int64_t vectors = bytes / 16;
  const int64_t grid = std::min<int64_t>((vectors + 255) / 256, 1024);
  MailboxInitKernel<<<static_cast<unsigned>(grid), 256, 0, stream>>>(
      static_cast<uint4*>(mailbox), vectors);
  return cudaGetLastError();
}

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
  if (p.push_max_bytes < 0 || p.push_max_bytes % 16 != 0) return cudaErrorInvalidValue;
  if (p.push_max_bytes > 0) {
    for (int r = 0; r < n; ++r) {
      if (p.mailboxes[r] == nullptr || !IsAligned(p.mailboxes[r], 16)) {
        return cudaErrorInvalidValue;
      }
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
