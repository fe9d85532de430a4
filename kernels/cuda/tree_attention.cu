// Tree attention on the GPU, the dispatcher: checks the params and picks the kernel family for
// the head size, as ggml-cuda's fattn.cu does. The family:
//   tree_attention_plan.cc         the planner (tiles, split), plain C++
//   tree_attention_common.cuh      constants, mask bit helpers, the chunk-state merge
//   tree_attention_mma_core.cuh    the MMA kernel's stages and AttendColumns
//   tree_attention_mma_jobs.cuh    its plain and window jobs
//   tree_attention_mma.cuh         the MMA kernel and its launcher
//   tree_attention_combine.cuh     the split launch's combine kernel
//   tree_attention_generic.cu      the generic kernel (other head sizes)
//   tree_attention_instances/      one MMA instantiation per head size
#include <algorithm>
#include <atomic>
#include <climits>

#include "kernels/cuda/tree_attention_common.cuh"
#include "specd/kernels/cuda/tree_attention.h"

namespace specd {
namespace cuda {
namespace {

#ifdef SPECD_ATTN_PROFILE
// The head size of the last MMA launch, whose instance file holds the records.
std::atomic<int> g_profiled_head_dim{0};  // launches may come from several threads (ranks)
#endif

// Whether the tensor-parallel head mapping is well formed: the local KV heads are exactly those
// the local query heads read, so each serves between 1 and `group` of them (rows <=
// kTreeAttentionTileRows).
bool HeadRangesValid(const TreeAttentionParams& p) {
  if (p.q_head_offset < 0 || p.kv_head_offset < 0 || p.kv_group < 0) return false;
  if (p.kv_group == 0 && p.num_heads % p.num_kv_heads != 0) return false;
  const int64_t group = p.kv_group > 0 ? p.kv_group : p.num_heads / p.num_kv_heads;
  return group <= kTreeAttentionTileRows && p.q_head_offset / group == p.kv_head_offset &&
         (p.q_head_offset + p.num_heads - 1) / group == p.kv_head_offset + p.num_kv_heads - 1;
}

}  // namespace

cudaError_t TreeAttentionCuda(const TreeAttentionParams& p, cudaStream_t stream) {
  if (p.num_queries < 0 || p.num_tiles < 0 || p.num_heads <= 0 || p.num_kv_heads <= 0 ||
      p.num_kv_heads > 65535 || !HeadRangesValid(p) || !TreeAttentionHeadDimSupported(p.head_dim) ||
      p.num_splits < 1 || p.num_splits > 65535 || p.chunks_per_cta < 1 || p.kv.block_size <= 0 ||
      p.kv.max_blocks_per_seq <= 0 || p.q_stride < p.num_heads * p.head_dim ||
      p.q_stride % 2 != 0 || p.out_stride < p.num_heads * p.head_dim || p.out_stride % 2 != 0 ||
      (p.mask == nullptr) != (p.mask_begin == nullptr) || !(p.scale > 0.0f && p.scale < INFINITY) ||
      p.kv.block_size > INT_MAX / (p.num_kv_heads * p.head_dim)) {
    return cudaErrorInvalidValue;
  }
  if (p.num_queries == 0) return cudaSuccess;
  const bool mma = TreeAttentionUsesMmaKernel(p.head_dim);
  // The generic kernel reads no tiles (it needs none: a warp per (query, head)).
  if (mma && p.num_tiles == 0) return cudaSuccess;
  if (p.q == nullptr || p.out == nullptr || p.kv.k_cache == nullptr || p.kv.v_cache == nullptr ||
      p.kv.block_tables == nullptr || p.query_seq == nullptr || p.kv_end == nullptr ||
      (mma && (p.tile_begin == nullptr || p.tile_end == nullptr ||
               (p.num_splits > 1 && p.workspace == nullptr)))) {
    return cudaErrorInvalidValue;
  }
  // Pairs of bf16 everywhere; the MMA kernel copies 16-byte pieces of K and V (head_dim a
  // multiple of 8 keeps every head's row 16-byte aligned in an aligned cache).
  const uintptr_t kv_align = mma ? 16 : 4;
  if (!IsAligned(p.q, 4) || !IsAligned(p.out, 4) || !IsAligned(p.kv.k_cache, kv_align) ||
      !IsAligned(p.kv.v_cache, kv_align) || (mma && !IsAligned(p.workspace, 8))) {
    return cudaErrorInvalidValue;
  }
  SPECD_PROF(g_profiled_head_dim = static_cast<int>(p.head_dim);)
  switch (p.head_dim) {
    case 16:
      return tree_attn::LaunchMma<16>(p, stream);
    case 32:
      return tree_attn::LaunchMma<32>(p, stream);
    case 64:
      return tree_attn::LaunchMma<64>(p, stream);
    case 128:
      return tree_attn::LaunchMma<128>(p, stream);
    default:
      return tree_attn::LaunchGeneric(p, stream);
  }
}

#ifdef SPECD_ATTN_PROFILE
cudaError_t TreeAttentionProfile(unsigned long long* records, int64_t ctas) {
  switch (g_profiled_head_dim.load()) {
    case 16:
      return tree_attn::ReadMmaProfile<16>(records, ctas);
    case 32:
      return tree_attn::ReadMmaProfile<32>(records, ctas);
    case 64:
      return tree_attn::ReadMmaProfile<64>(records, ctas);
    case 128:
      return tree_attn::ReadMmaProfile<128>(records, ctas);
    default:
      return cudaErrorInvalidValue;  // no MMA launch yet
  }
}
#endif

}  // namespace cuda
}  // namespace specd
