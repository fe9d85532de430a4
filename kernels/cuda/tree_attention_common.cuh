// Tree attention's kernels (kernels/cuda/tree_attention*.cu, the family of
// specd/kernels/cuda/tree_attention.h): the work decomposition's constants, the bit helpers of
// the tree masks and the online softmax's merge, shared by the MMA kernel, the combine kernel and
// the generic kernel; and the launchers that the dispatcher (tree_attention.cu) calls, one per
// kernel family, instantiated per head size in tree_attention_instances/.
#ifndef SPECD_KERNELS_CUDA_TREE_ATTENTION_COMMON_CUH_
#define SPECD_KERNELS_CUDA_TREE_ATTENTION_COMMON_CUH_

#include <climits>
#include <cstddef>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/mma_utils.cuh"
#include "specd/kernels/cuda/tree_attention.h"

// Code for profiling builds only (cmake -DSPECD_ATTN_PROFILE=ON; TreeAttentionProfile).
#ifdef SPECD_ATTN_PROFILE
#define SPECD_PROF(...) __VA_ARGS__
#else
#define SPECD_PROF(...)
#endif

namespace specd {
namespace cuda {
namespace tree_attn {

using internal::CpAsync16;
using internal::CpAsyncCommit;
using internal::CpAsyncWait;
using internal::FenceProxyAsyncShared;
using internal::GmmaDescSw128;
using internal::kFullMask;
using internal::LdMatrixX4;
using internal::LdMatrixX4Trans;
using internal::Mma16816;
using internal::PackBf16x2;
using internal::SmemAddr;
using internal::Wgmma64x128x16;
using internal::Wgmma64x64x16;
using internal::WgmmaCommit;
using internal::WgmmaFence;
using internal::WgmmaFenceOperands;
using internal::WgmmaWait;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16 * kWarps;  // one m16 MMA row block per warp
static_assert(kRows == kTreeAttentionTileRows, "tile rows");
constexpr int kKeys = 64;  // ranks per shared-memory stage (a sub-chunk)
constexpr int kStages = 2;
// A window job holds up to this many distinct keys (WindowRows, in the stages' memory).
constexpr int kWindowRows = kStages * kKeys;
constexpr uint8_t kZeroRow = 0xff;  // window-table entry of a padding column
static_assert(kWindowRows <= kZeroRow, "window rows fit the table's bytes");
constexpr int kMaskWords = kTreeAttentionMaskWords;
constexpr int kChunk = kTreeAttentionChunkKeys;
static_assert(kChunk % kKeys == 0, "chunks are whole sub-chunks");
constexpr int kSub = kChunk / kKeys;
constexpr float kLog2e = 1.4426950408889634f;
// Block-table entries a CTA keeps in shared memory, from its first chunk's block on (2048 slots at
// 16-slot blocks: every split CTA of up to 8 chunks); jobs past them read the table in global
// memory.
constexpr int kTableEntries = 128;

// Host: the MMA kernel and, when p.num_splits > 1, the combine kernel for head size HD (16, 32,
// 64 or 128; tree_attention_instances/ instantiates each). p is validated by TreeAttentionCuda.
template <int HD>
cudaError_t LaunchMma(const TreeAttentionParams& p, cudaStream_t stream);

// Host: the generic kernel (tree_attention_generic.cu), for the head sizes LaunchMma has none of.
cudaError_t LaunchGeneric(const TreeAttentionParams& p, cudaStream_t stream);

#ifdef SPECD_ATTN_PROFILE
// Host, profiling builds: TreeAttentionProfile's copy for the MMA kernel of head size HD (each
// instance file keeps the records of its own kernels).
template <int HD>
cudaError_t ReadMmaProfile(unsigned long long* records, int64_t ctas);
#endif

// Bit position of the n-th (from 0) set bit of x; n < popc(x).
__device__ __forceinline__ int SelectBit(uint32_t x, int n) {
  int pos = 0;
#pragma unroll
  for (int w = 16; w > 0; w >>= 1) {
    const uint32_t low = x & ((1u << w) - 1u);
    const int c = __popc(low);
    if (n >= c) {
      n -= c;
      x >>= w;
      pos += w;
    } else {
      x = low;
    }
  }
  return pos;
}

// 2^x with MUFU.EX2 alone (flushing subnormal results to zero: a probability below 2^-126 of
// the row's largest). exp2f would add the range fix-ups around it on every score.
__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The lowest n set bits of x (all of them when n >= popc(x), none when n <= 0).
__device__ __forceinline__ uint32_t LowestSetBits(uint32_t x, int n) {
  if (n <= 0) return 0u;
  if (n >= __popc(x)) return x;
  return x & ((1u << SelectBit(x, n)) - 1u);
}

// The set bits of a query's mask whose index among the set bits is in [k_lo, k_hi): the tree
// ancestors of ranks [mask_begin + k_lo, mask_begin + k_hi).
__device__ __forceinline__ void SetBitsOfRanks(const uint32_t* words, int k_lo, int k_hi,
                                               uint32_t (&out)[kMaskWords]) {
  int before = 0;  // set bits in the words before w
#pragma unroll
  for (int w = 0; w < kMaskWords; ++w) {
    const uint32_t x = words[w];
    out[w] = LowestSetBits(x, k_hi - before) & ~LowestSetBits(x, k_lo - before);
    before += __popc(x);
  }
}

// Batch invariance (docs/architecture.md, lossless verification): a row's result is a function of
// its own query and its own visible keys only. Keys are numbered by RANK, the position in the
// query's logical key order (the committed prefix and chain, then its tree ancestors), which is the
// order a plain decode of the same token sees them in. Chunk c is ranks [c * kChunk, +kChunk) for
// every query, whatever the batch, tile or split; inside it 64-rank sub-chunks sit at fixed
// offsets, rank R0 + i in column i of the score tile. Each chunk starts a fresh online softmax
// whose per-row arithmetic is fixed: sub-chunks in order, each one AttendColumns pass; chunk states
// are merged in chunk order with one fixed formula (MergeWeights), in this kernel when a CTA owns
// all chunks, or in the combine kernel when chunks are split over CTAs: both give the same bits.
// Every float operation that a compiler could contract or reorder is spelled out with _rn
// intrinsics.
//
// Merging a chunk state (m, l) into the running one (big_m, big_l): returns 0 (nothing to merge:
// the chunk saw no key), 1 (the running state was empty: take the chunk's o as is) or 2 (o_new =
// o_big * a + o * b, elementwise); big_m and big_l are updated.
__device__ __forceinline__ int MergeWeights(float& big_m, float& big_l, float m, float l, float& a,
                                            float& b) {
  if (!(l > 0.0f)) return 0;
  if (!(big_l > 0.0f)) {
    big_m = m;
    big_l = l;
    return 1;
  }
  const float mn = fmaxf(big_m, m);
  a = exp2f(__fsub_rn(big_m, mn));
  b = exp2f(__fsub_rn(m, mn));
  big_l = __fmaf_rn(big_l, a, __fmul_rn(l, b));
  big_m = mn;
  return 2;
}

__device__ __forceinline__ float MergeValue(int mode, float big, float o, float a, float b) {
  return mode == 1 ? o : __fmaf_rn(big, a, __fmul_rn(o, b));
}

}  // namespace tree_attn
}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_TREE_ATTENTION_COMMON_CUH_
