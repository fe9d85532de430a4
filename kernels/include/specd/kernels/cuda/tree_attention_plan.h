// The host side of tree attention on the GPU (specd/kernels/cuda/tree_attention.h): its limits,
// and how a batch is cut into CTAs (the tiles and the split of the key range). Plain C++ with no
// CUDA header, so that a build without the CUDA toolkit compiles and tests the planner.
#ifndef SPECD_KERNELS_CUDA_TREE_ATTENTION_PLAN_H_
#define SPECD_KERNELS_CUDA_TREE_ATTENTION_PLAN_H_

#include <stdint.h>

#include <vector>

namespace specd {
namespace cuda {

inline constexpr int kTreeAttentionMaskBits = 256;  // docs/architecture.md: at most 256 tree nodes
inline constexpr int kTreeAttentionMaskWords = kTreeAttentionMaskBits / 32;
inline constexpr int kTreeAttentionTileRows = 64;
// Keys per chunk: four 64-key sub-chunks. Every chunk's state goes through the split workspace
// and the combine kernel's merge, so fewer, longer chunks make verify steps cheaper (a 64-node
// tree at 2K keys: 9 chunk states a row instead of 17), at the price of fewer CTAs for a batch-1
// decode at short contexts (8 KV heads x 9 chunks = 72 CTAs at 2K). Measured on an H200 against
// 128 keys (bench/history/13-gpu-run-07.md): the 64-node 8B step 6.6% faster, decode at 2K 2-4%
// slower, attention at 8K keys ~20% faster for decode and verify alike.
inline constexpr int kTreeAttentionChunkKeys = 256;
// The largest head_dim TreeAttentionCuda accepts: the largest that FlashAttention and vLLM serve
// (Gemma's 256); beyond it a lane of the generic kernel would hold more than four dim pairs.
inline constexpr int kTreeAttentionMaxHeadDim = 256;

// How to cut a batch into CTAs (host).
struct TreeAttentionPlan {
  std::vector<int32_t> tile_begin;
  std::vector<int32_t> tile_end;
  int num_splits = 1;
  int chunks_per_cta = 1;
};

// The chunks_per_cta that PlanTreeAttention picks for a split launch of num_tiles tiles: the
// count that minimises the waves of CTAs (two resident per multiprocessor) times each CTA's
// work (its chunks plus about half a chunk of setup).
int TreeAttentionChunksPerCta(int64_t num_tiles, int64_t num_kv_heads, int num_splits, int num_sms);

// Tiles group consecutive queries of one sequence (queries of a sequence must be contiguous).
// The key range is split into its chunks when the tiles alone would leave some of the GPU's
// `num_sms` multiprocessors idle (and the workspace stays under a cap); either way the results
// are the same bits. query_seq and kv_end are host copies of the params' arrays. Returns an empty
// plan (no tiles) when num_kv_heads does not divide num_heads.
TreeAttentionPlan PlanTreeAttention(const int32_t* query_seq, const int32_t* kv_end,
                                    int64_t num_queries, int64_t num_heads, int64_t num_kv_heads,
                                    int num_sms);

// The same for a tensor-parallel head range: num_heads and num_kv_heads are the local counts and
// kv_group the params' kv_group (0: num_heads / num_kv_heads, as above); tiles are sized for
// kv_group heads per KV head, the most a local KV head serves. Empty plan when kv_group < 0, or
// kv_group is 0 and num_kv_heads does not divide num_heads.
TreeAttentionPlan PlanTreeAttention(const int32_t* query_seq, const int32_t* kv_end,
                                    int64_t num_queries, int64_t num_heads, int64_t num_kv_heads,
                                    int64_t kv_group, int num_sms);

// Chunks of a query with `max_kv_end` keys: the num_splits that splits them all.
int TreeAttentionChunks(int32_t max_kv_end);

// The most workspace floats PlanTreeAttention lets a split take (for a head size of 128; others
// take proportionally fewer): it keeps the query count unsplit past it.
inline constexpr int64_t kTreeAttentionMaxWorkspaceFloats = int64_t{64} << 20;

// Workspace floats that TreeAttentionCuda needs for `num_splits` (0 when it is 1, and for head
// sizes of the generic kernel, which never splits).
int64_t TreeAttentionWorkspaceFloats(int num_splits, int64_t num_queries, int64_t num_heads,
                                     int64_t head_dim);

// The head sizes the MMA kernel is instantiated for: whole k-steps of the m16n8k16 MMA (16 dims),
// and V read as pairs of 8-dim tiles. Only these split the key range (PlanTreeAttention's
// num_splits and chunks_per_cta, the workspace).
bool TreeAttentionUsesMmaKernel(int64_t head_dim);

// The head sizes TreeAttentionCuda accepts at all: every even one from 2 to
// kTreeAttentionMaxHeadDim (the MMA kernel's, and the generic kernel for the rest).
bool TreeAttentionHeadDimSupported(int64_t head_dim);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_TREE_ATTENTION_PLAN_H_
