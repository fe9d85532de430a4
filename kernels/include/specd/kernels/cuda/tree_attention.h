// Attention of new tokens over the paged KV cache with a tree mask, on the GPU: prefill (a
// causal chain), single-token decode and tree verification are one kernel. The CPU reference is
// specd/kernels/tree_attention.h TreeAttentionCpu, which lists each query's tree ancestors
// explicitly; here a query's visible keys are described by three numbers and a bitmask, which
// a kernel can test per key without walking a list:
//   keys [0, mask_begin) are all visible (the committed prefix, and for a chain the earlier
//   tokens of the chain); keys [mask_begin, kv_end) are visible where the mask has bit
//   (key - mask_begin) set (the tree's ancestors of the query, itself included); nothing at or
//   after kv_end is visible. kv_end - mask_begin <= kTreeAttentionMaskBits.
// A decode step or a chain token t has mask_begin = kv_end = committed + t + 1 (no mask).
// A tree hanging below a chain has mask_begin = the tree's first slot for each tree node.
//
// Keys are logical slots of the query's sequence, mapped to physical slots through its block
// table (specd/kernels/kv_cache.h layout). Grouped-query attention: query head h reads KV head
// h / (num_heads / num_kv_heads). Under tensor parallelism a rank holds a contiguous range of
// the model's query heads that need not align with the KV-head groups, and the KV heads they
// read (a KV head whose group spans two ranks is on both): the params then give the global
// offsets and the model's group, and a local KV head serves between 1 and kv_group local query
// heads (the range of its group that the rank owns).
//
// Work decomposition (PlanTreeAttention): a CTA takes one KV head and one tile of up to
// kTreeAttentionTileRows (query, head) rows -- consecutive queries of one sequence times the
// local query heads that read the KV head; scores and the weighted sum use bf16 tensor-core MMAs
// with fp32 accumulation and an online softmax. Keys go through shared memory in 64-key
// sub-chunks, loaded with cp.async into two stages. A sub-chunk whose keys are the same slots for
// every row that needs it (the committed prefix, chains, and a tree's contiguous start) is one
// "plain" load serving every query and head of the tile, streamed through the two stages (the next
// loads while the current one is computed on). A tree node's remaining sub-chunks (the end of the
// prefix and its ancestors) are served by "window" loads: the distinct keys that a group of the
// tile's nodes need there, loaded once into both stages, and read by each node through its own
// column -> key table. With null masks the kernel is built without the window machinery (fewer
// registers): pass null masks for batches without trees. The results are the same bits either way.
//
// Batch invariance: a query's output bits depend only on its own query vector and visible keys,
// never on the batch, its tile, the split count or padding, so a token verified as a tree node and
// the same token decoded alone give the same bits (docs/architecture.md: greedy speculative output
// is target-only greedy output). Keys are taken by rank in the query's own key order (prefix, then
// ancestors) in fixed chunks of kTreeAttentionChunkKeys ranks; each chunk is a fresh online softmax
// and chunks merge in order with one formula, in the kernel or, when the chunks are split over CTAs
// (flash-decoding, so even a single decode token spreads over many SMs), in a second kernel with
// the same arithmetic.
//
// Head sizes. The MMA kernel above is built for head_dim 16, 32, 64 and 128
// (TreeAttentionUsesMmaKernel). Every other even head_dim up to kTreeAttentionMaxHeadDim goes to a
// generic kernel, for small or unusual models (the mistral test fixture's head_dim 8, 24, 80, 96,
// 256): one warp per (query, head) walks the query's keys by rank in the same sub-chunks and
// chunks with the same online-softmax, rounding (probabilities to bf16 before P V) and merge
// formulas, with fp32 FMAs instead of MMAs -- close to the MMA kernel's results, not its bits (a
// model only ever runs one of the two). A warp touches nothing of another query's, so it is batch
// invariant by construction. It never splits the key range: it reads neither the tiles nor
// num_splits, chunks_per_cta and the workspace (TreeAttentionWorkspaceFloats is 0 for its head
// sizes; a caller should plan num_splits = 1 for them, which is what the kernel does anyway).
#ifndef SPECD_KERNELS_CUDA_TREE_ATTENTION_H_
#define SPECD_KERNELS_CUDA_TREE_ATTENTION_H_

#include "specd/kernels/cuda/common.h"
#include "specd/kernels/cuda/paged_kv.h"
#include "specd/kernels/cuda/tree_attention_plan.h"

namespace specd {
namespace cuda {

struct TreeAttentionParams {
  // [num_queries, q_stride] bf16, device (RoPE applied): head h of query t at
  // q + t * q_stride + h * head_dim. q_stride is even.
  const bf16* q = nullptr;
  int64_t q_stride = 0;
  bf16* out = nullptr;  // [num_queries, out_stride] bf16, device, same layout; even stride
  int64_t out_stride = 0;
  // One layer's cache: pools [num_slots, num_kv_heads * head_dim] bf16, device, and the block
  // tables; query t's keys are logical slots of block-table row query_seq[t].
  PagedKvView kv;
  const int32_t* query_seq = nullptr;  // [num_queries] int32, device: block-table row
  const int32_t* kv_end = nullptr;     // [num_queries] int32, device
  // [num_queries] int32, device; null: no masks (no query has tree keys; the same results as
  // masks without bits, from a kernel built without the tree machinery).
  const int32_t* mask_begin = nullptr;
  // [num_queries, kTreeAttentionMaskWords] uint32, device; bit b of word b / 32 is slot
  // mask_begin + b. Null exactly when mask_begin is.
  const uint32_t* mask = nullptr;
  // [rows of block_tables] int32, device, optional: per sequence, slots below this one were all
  // written before the step's first kernel (its committed prefix; the step's own slots, which
  // RoPE writes, lie at or above it). The MMA kernel may then load those slots before its
  // programmatic-dependency wait, overlapping RoPE. Null: it waits first. Results are the same.
  const int32_t* kv_stable_end = nullptr;
  // [num_tiles] int32, device: query ranges [tile_begin, tile_end) from PlanTreeAttention with
  // the same head counts and kv_group (a tile holds at most 64 / kv_group queries). MMA kernel
  // only: the generic kernel ignores the tiles and the split fields below (they may be left as
  // they are, or null / 1).
  const int32_t* tile_begin = nullptr;
  const int32_t* tile_end = nullptr;
  int64_t num_tiles = 0;
  // 1: a CTA walks all chunks of its tile. Otherwise each chunk's state goes to the workspace
  // and a combine kernel merges them; num_splits must be at least TreeAttentionChunks(max
  // kv_end) (later chunks are not computed).
  int num_splits = 1;
  // Split only: chunks a CTA computes one after the other (CTA z: chunks [z * chunks_per_cta,
  // +chunks_per_cta)), so that a long split runs in fewer waves of CTAs, each paying its setup
  // once. Any value >= 1 gives the same bits.
  int chunks_per_cta = 1;
  // [TreeAttentionWorkspaceFloats(...)] fp32, device; needed when num_splits > 1.
  float* workspace = nullptr;
  // Split only: the combine kernel drops the chunks' partial outputs from L2 once it has merged
  // them, without write-back (DeadRows in common.h says why): the workspace's contents are then
  // indeterminate until the next launch writes them.
  bool discard_workspace = false;
  int64_t num_queries = 0;
  // Local counts: q holds num_heads heads per query, the caches num_kv_heads heads per slot.
  // Without kv_group, num_kv_heads divides num_heads, with num_heads / num_kv_heads <= 64.
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  // Even, in [2, kTreeAttentionMaxHeadDim] (TreeAttentionHeadDimSupported); 16, 32, 64 and 128
  // take the MMA kernel, the others the generic one (see the top).
  int64_t head_dim = 0;
  float scale = 1.0f;  // usually 1 / sqrt(head_dim)
  // Tensor parallelism: local query head h is global head q_head_offset + h, which reads global KV
  // head (q_head_offset + h) / kv_group, i.e. local KV head (q_head_offset + h) / kv_group -
  // kv_head_offset. kv_group = 0 means num_heads / num_kv_heads (and then num_kv_heads must divide
  // num_heads, as without tensor parallelism). kv_group <= 64, and the local KV heads must be
  // exactly those the local query heads read: every one serves at least one local query head
  // (q_head_offset / kv_group == kv_head_offset and (q_head_offset + num_heads - 1) / kv_group ==
  // kv_head_offset + num_kv_heads - 1), else cudaErrorInvalidValue.
  int64_t q_head_offset = 0;
  int64_t kv_head_offset = 0;
  int64_t kv_group = 0;
};

cudaError_t TreeAttentionCuda(const TreeAttentionParams& p, cudaStream_t stream);

#ifdef SPECD_ATTN_PROFILE
// Profiling builds only (cmake -DSPECD_ATTN_PROFILE=ON; never a release): the MMA kernel's last
// launch, per CTA (linear block index x + X (y + Y z)), kTreeAttentionProfileFields values:
// globaltimer ns at its start and at its end; SM cycles in all, until its PDL wait returned, in
// plain jobs, in window jobs, and within those grouping queries, building tables, loading and
// in the passes; blockIdx.z; its window sub-chunks. Copies the first `ctas` CTAs'
// records (at most kTreeAttentionProfileCtas) to host memory `records`.
inline constexpr int kTreeAttentionProfileCtas = 1 << 14;
inline constexpr int kTreeAttentionProfileFields = 12;
cudaError_t TreeAttentionProfile(unsigned long long* records, int64_t ctas);
#endif

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_TREE_ATTENTION_H_
