// Tree attention's combine kernel: when PlanTreeAttention split the key range over CTAs, it
// merges the chunk states that the MMA kernel left in the workspace (tree_attention_mma.cuh
// launches it after the MMA kernel).
#ifndef SPECD_KERNELS_CUDA_TREE_ATTENTION_COMBINE_CUH_
#define SPECD_KERNELS_CUDA_TREE_ATTENTION_COMBINE_CUH_

#include "kernels/cuda/tree_attention_common.cuh"

namespace specd {
namespace cuda {
namespace tree_attn {

// One warp per (query, head): the chunk states merged in chunk order with MergeWeights, exactly
// as the main kernel merges them when one CTA owns all chunks.
template <int HD>
__global__ void __launch_bounds__(kThreads) TreeAttentionCombineKernel(TreeAttentionParams p) {
  // Launched as a programmatic dependent of the main kernel: nothing it wrote may be read
  // before this.
  internal::PdlWait();
  const int64_t item = blockIdx.x * static_cast<int64_t>(kWarps) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  const int64_t items = p.num_queries * p.num_heads;
  if (item >= items) return;
  // Below 32 dims a lane owns one dim and the lanes past head_dim have none (the kernel uses
  // no warp collectives, so they may leave). The merge is elementwise, so how dims are dealt
  // to lanes does not change a dim's bits.
  constexpr int kPerLane = HD >= 32 ? HD / 32 : 1;
  if constexpr (HD < 32) {
    if (lane >= HD) return;
  }
  const float* ml = p.workspace + static_cast<int64_t>(p.num_splits) * items * HD;
  float acc[kPerLane];
#pragma unroll
  for (int d = 0; d < kPerLane; ++d) acc[d] = 0.0f;
  float big_m = -INFINITY, big_l = 0.0f;
  // The states are read kBatch chunks ahead of their merges (which stay in chunk order), so that
  // a long split (33 chunks at 8K keys) costs a few memory latencies, not one per chunk; 16 makes
  // the common splits (9-10 chunks at 2K keys) one round trip instead of two.
  constexpr int kBatch = 16;
  for (int sp0 = 0; sp0 < p.num_splits; sp0 += kBatch) {
    float cm[kBatch], cl[kBatch], part[kBatch][kPerLane];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      cm[i] = -INFINITY;
      cl[i] = 0.0f;  // past the last chunk: nothing to merge
#pragma unroll
      for (int d = 0; d < kPerLane; ++d) part[i][d] = 0.0f;
      if (sp0 + i < p.num_splits) {
        const int64_t at = (sp0 + i) * items + item;
        cm[i] = ml[2 * at];
        cl[i] = ml[2 * at + 1];
        const float* o = p.workspace + at * HD;
#pragma unroll
        for (int d = 0; d < kPerLane; ++d) part[i][d] = o[lane + 32 * d];
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      float a = 0.0f, b = 0.0f;
      const int mode = MergeWeights(big_m, big_l, cm[i], cl[i], a, b);
      if (mode != 0) {
#pragma unroll
        for (int d = 0; d < kPerLane; ++d) acc[d] = MergeValue(mode, acc[d], part[i][d], a, b);
      }
    }
  }
  if constexpr (HD % 32 == 0) {
    if (p.discard_workspace && (reinterpret_cast<uintptr_t>(p.workspace) & 127) == 0) {
      // The merges above consumed every lane's loads; the warp's barrier orders them all before
      // the drops. An item's partial output is HD floats of its own, kLines whole lines; the
      // warp's lanes take one line each (a drop costs its thread about an L2 round trip).
      constexpr int kLines = HD * static_cast<int>(sizeof(float)) / 128;
      __syncwarp();
      for (int idx = lane; idx < p.num_splits * kLines; idx += 32) {
        internal::DiscardL2Line(p.workspace + ((idx / kLines) * items + item) * HD +
                                (idx % kLines) * 32);
      }
    }
  }
  const float inv = big_l > 0.0f ? __fdiv_rn(1.0f, big_l) : 0.0f;
  const int64_t qi = item / p.num_heads, head = item % p.num_heads;
  bf16* dst = p.out + qi * p.out_stride + head * HD;
#pragma unroll
  for (int d = 0; d < kPerLane; ++d)
    dst[lane + 32 * d] = __float2bfloat16_rn(__fmul_rn(acc[d], inv));
}

}  // namespace tree_attn
}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_TREE_ATTENTION_COMBINE_CUH_
