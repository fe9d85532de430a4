// Attention of new tokens over a paged KV cache with a tree mask (SpecInfer / Medusa / EAGLE
// style verification, and plain prefill and decode as special cases).
//
// Query t belongs to one sequence. Its keys are, in this order:
//   1. a contiguous run of logical slots [0, prefix_len[t]): the committed prefix, possibly
//      extended over leading ancestors that sit in consecutive slots right after it (the
//      backend does that for chains, so a long prefill does not list O(n^2) keys);
//   2. its other tree ancestors: the logical slots tree_keys[tree_key_offsets[t] ..
//      tree_key_offsets[t+1]), root first and the query's own slot last (the query's own slot
//      is in the run instead when the whole path is contiguous).
// Logical slot j of the sequence lives at physical slot
//   block_tables[query_seq[t] * max_blocks_per_seq + j / block_size] * block_size + j % block_size
// (see kv_cache.h). A decode step is a query with a run of L + 1 keys (or a run of L and one
// tree key: the same keys in the same order); token i of a prefill chain has a run of L + i + 1.
// The ancestor lists are explicit (CSR) rather than a bitmask so trees of any size and shape, and
// several sequences, share one description that the CUDA kernel reads as is.
//
// Grouped-query attention: query head h reads KV head h / (num_heads / num_kv_heads). A
// tensor-parallel rank holds a contiguous slice of the model's query heads and the KV heads
// they read, and a slice's query heads need not split evenly over its KV heads (64 query heads
// over 7 ranks: a rank with global heads 6..15 and group 8 reads KV head 0 for two of them and
// KV head 1 for eight). So the mapping is stated in global terms: local query head h is global
// head q_head_offset + h, reads global KV head (q_head_offset + h) / kv_group, which is local
// KV head (q_head_offset + h) / kv_group - kv_head_offset.
//
// Determinism: keys are visited exactly in the order above, so a tree node and the same token
// decoded after its path was committed (whose keys are then all prefix, in the same order)
// produce bit-identical outputs.
#ifndef SPECD_KERNELS_TREE_ATTENTION_H_
#define SPECD_KERNELS_TREE_ATTENTION_H_

#include <stdint.h>

#include "specd/kernels/paged_kv.h"

namespace specd {

struct TreeAttentionParams {
  const float* q = nullptr;        // [num_queries, num_heads, head_dim] fp32, host (RoPE applied)
  float* out = nullptr;            // [num_queries, num_heads, head_dim] fp32, host
  // The cache: pools [num_slots, num_kv_heads, head_dim] fp32, host, and the block tables
  // [num_seqs, max_blocks_per_seq] int32, host.
  PagedKvT<const float> kv;
  const int32_t* query_seq = nullptr;         // [num_queries] int32, host: row of block_tables
  const int32_t* prefix_len = nullptr;        // [num_queries] int32, host: length of the key run
  const int32_t* tree_key_offsets = nullptr;  // [num_queries + 1] int32, host (CSR offsets)
  const int32_t* tree_keys = nullptr;  // [tree_key_offsets[num_queries]] int32, host: logical slots
  int64_t num_queries = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;  // divides num_heads unless kv_group is set
  int64_t head_dim = 0;
  float scale = 1.0f;  // usually 1 / sqrt(head_dim)
  // Tensor-parallel slices (see above): query heads per KV head in the whole model (0: the
  // unsliced num_heads / num_kv_heads, with both offsets 0), and the global indices of this
  // slice's first query head and first KV head.
  int64_t kv_group = 0;
  int64_t q_head_offset = 0;
  int64_t kv_head_offset = 0;
};

// Computes work items [item_begin, item_end) where item = query * num_heads + head, so callers
// can split the num_queries * num_heads items across threads. Scores, softmax and the weighted
// sum of values are fp32, accumulated sequentially in key order.
void TreeAttentionCpuItems(const TreeAttentionParams& p, int64_t item_begin, int64_t item_end);

// All items on the calling thread.
void TreeAttentionCpu(const TreeAttentionParams& p);

}  // namespace specd

#endif  // SPECD_KERNELS_TREE_ATTENTION_H_
