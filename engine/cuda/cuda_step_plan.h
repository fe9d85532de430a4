// The CUDA backend's step planner: how one Forward() or Verify() step is laid out for the
// kernels, separate from running it (FlashInfer's plan/run split). Plain C++, no CUDA toolkit,
// so every build compiles it and tests/unit/cuda_step_plan_test.cc checks it on the CPU.
//
// A step's launches are described by a CudaStep: how many token rows, logit rows and sequences
// the kernels see, the block-table stride, the attention plan's shape, and where each metadata
// array sits in the step's one metadata buffer (byte offsets, StepPacker). Unpadded, rows are
// packed item after item (what an eager step needs). Padded (CUDA graphs), the batch is rounded
// up to a batch bucket and every sequence gets the same number of token slots, so that two steps
// of one bucket launch exactly the same kernels with the same arguments and only the contents
// of the metadata differ (CudaGraphKey).
//
// Masks are engine/cuda/tree_mask.h's encoding of the kernel's
// (specd/kernels/cuda/tree_attention.h).
#ifndef SPECD_ENGINE_CUDA_CUDA_STEP_PLAN_H_
#define SPECD_ENGINE_CUDA_CUDA_STEP_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/types/span.h"
#include "engine/backend.h"
#include "engine/kv/paged_kv_table.h"

namespace specd {

// CUDA-graph buckets: at most this many sequences, tree nodes a sequence (after the pending
// token) and token rows a step. The batch limit covers a router's --max_batch up to 128 (32
// by default): a batch past the limit runs eagerly, whose launch jitter makes the steps the
// goodput policy times noisier exactly where speculation and plain decoding are closest.
inline constexpr int64_t kGraphMaxBatch = 128;
inline constexpr int64_t kGraphMaxTreeTokens = 256;
inline constexpr int64_t kGraphMaxTokens = 4096;

// The smallest power of two >= n (1 for n <= 1).
int64_t NextPow2(int64_t n);

// Token slots per sequence: 1 for a decode step; else the pending token plus a tree rounded up
// to a power of two (2, 3, 5, 9, ..., 257).
int64_t TokenBucket(int64_t n);

// Packs host arrays into one buffer with 16-byte aligned sections, so that a step's metadata
// goes to the device in a single copy.
class StepPacker {
 public:
  // Appends n elements of `data` (host); returns their byte offset in the buffer.
  template <typename T>
  size_t Add(const T* data, size_t n) {
    const size_t offset = (bytes_.size() + 15) / 16 * 16;
    bytes_.resize(offset + n * sizeof(T));
    if (n > 0) std::memcpy(bytes_.data() + offset, data, n * sizeof(T));
    return offset;
  }
  template <typename T>
  size_t Add(const std::vector<T>& v) {
    return Add(v.data(), v.size());
  }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

// The launches of one step: sizes as the kernels see them and where each metadata array sits
// in the metadata buffer (byte offsets from StepPacker::Add).
struct CudaStep {
  bool verify = false;
  bool padded = false;     // rounded up to a (batch, tokens a sequence) bucket
  int64_t batch = 0;       // sequences launched (padding sequences included)
  int64_t per_seq = 0;     // token slots (and logit rows) of each sequence when padded
  int64_t T = 0;           // token rows launched
  int64_t R = 0;           // logit rows launched
  int64_t max_blocks = 0;  // block-table stride
  int64_t num_tiles = 0;
  int num_splits = 1;
  int chunks_per_cta = 1;
  int64_t ws_floats = 0;  // split-KV workspace
  int64_t out_stride = 0;
  // Tensor parallel: all-reduces take the custom kernel; verify rows need the whole logits
  // (top-k / top-p) rather than per-rank candidates.
  bool custom_allreduce = false;
  bool gather_logits = false;
  // Some query sees keys through a tree mask (else every query is a chain).
  bool tree_masks = false;
  // ForwardTopK(): the top-k of topk_rows logit rows (o_topk_rows lists which, the requested
  // ones first) is launched right after the LM head, inside the step's graph; 0: none.
  int topk_k = 0;
  int64_t topk_rows = 0;
  // Verify: the rows go through the logits processors before sampling (o_proc_*:
  // cuda::LogitsProcessorRow [R], cuda::LogitsProcessorSeq [batch], then the lists, packed
  // last so the other offsets do not depend on their length), and the sampler reports each
  // row's kept set (o_kept_lower: [R] uint64) for processed log-probabilities.
  bool processors = false;
  bool kept_lower = false;
  std::vector<int64_t> item_row_begin;    // first logit row of each item
  std::vector<int64_t> item_token_begin;  // first token row of each item
  // Residual-stream taps the step copies into CudaForward::Buffers::taps (Backend::
  // ForwardWithTaps' layer ids, in the order the taps buffer's columns hold them); empty: none.
  // Part of the graph key: a step with taps replays its own graph.
  std::vector<int> tap_layers;
  size_t o_tokens = 0, o_positions = 0, o_query_seq = 0, o_kv_end = 0, o_mask_begin = 0, o_mask = 0,
         o_slots = 0, o_tables = 0, o_rows = 0, o_tile_begin = 0, o_tile_end = 0, o_kv_stable = 0;
  size_t o_row_params = 0, o_sample_offset = 0, o_node_offset = 0, o_num_nodes = 0,
         o_tree_tokens = 0, o_tree_parents = 0, o_seq_rows = 0, o_base_slot = 0, o_sampled = 0,
         o_out = 0, o_topk_rows = 0;
  size_t o_kept_lower = 0, o_proc_rows = 0, o_proc_seqs = 0, o_proc_data = 0;
};

// Picks the step's bucket (step->padded, batch, per_seq) when the step of `item_tokens` token
// slots a sequence fits one; false: run unpadded. The caller asks only when graphs are on.
bool ChooseBuckets(const std::vector<int64_t>& item_tokens, CudaStep* step);

// What the buffers that captured graphs read are sized for when a backend starts
// (CudaForward::Init, before the KV pools take the rest of the memory), so that no step within
// it reallocates one under the graphs, which would drop every captured graph:
//  - `invariant_rows` token rows and as many logit rows (kDefaultGemmInvariantRows when < 1), and
//    at least a padded step of kGraphMaxBatch sequences of 9 token slots: every forward the
//    warm-up runs and the draft model's drafter sends (DraftModelDrafterOptions::
//    max_forward_rows), as a verify step (with the gathered logits of a tensor-parallel one);
//  - the split-KV workspace the planner allows a step (cuda::kTreeAttentionMaxWorkspaceFloats),
//    for head sizes that split;
//  - `meta_bytes`: 256 bytes a token row, 1 MiB, and the block tables of kGraphMaxBatch
//    sequences of 4096 blocks (64 Ki tokens each).
// Larger steps (a long prefill, graph buckets past `invariant_rows` tokens) still grow them.
struct ReservedStep {
  CudaStep step;
  size_t meta_bytes = 0;
};
ReservedStep ReservedStepShape(int64_t invariant_rows, int64_t head_dim, bool tensor_parallel);

// One item of a validated batch as the planner reads it, after its nodes were appended to the
// sequence's scratch region and its blocks allocated.
struct PlanItem {
  int64_t committed = 0;  // the sequence's committed length
  // Every scratch node's parent (-1: the committed end), this step's nodes included; the
  // step's nodes are the last depth.size() entries.
  absl::Span<const int32_t> scratch_parents;
  absl::Span<const int32_t> depth;  // [n] the step's nodes' depths below the committed end
  // [n] each of the step's nodes' own spine end (engine/cuda/tree_mask.h SpineEnd).
  absl::Span<const int32_t> spine;
  absl::Span<const int32_t> blocks;  // the sequence's block table
};

// The planner's items of a step that PagedKvTable::PrepareForward laid out (with SetMaskBits):
// spans into the layout and into depth and spine, which hold each item's nodes' depths and own
// spine ends (from the layout's positions and prefix_len). Valid while the layout lives.
struct PlanItems {
  std::vector<std::vector<int32_t>> depth, spine;
  std::vector<PlanItem> items;
};
void PlanItemsFromLayout(const StepLayout& layout, PlanItems* out);

// What the planner needs of the model and the machine.
struct StepPlanOptions {
  int64_t block_tokens = 0;  // KV slots a block
  int64_t hidden = 0;
  int64_t head_dim = 0;
  int64_t heads = 0;     // query heads this rank holds
  int64_t kv_heads = 0;  // KV heads this rank holds
  int64_t kv_group = 1;  // query heads a KV head (the whole model's)
  int num_sms = 1;
  // Tensor parallel: all-reduce messages ([T, hidden] bf16) up to this many bytes take the
  // custom kernel; -1 when there is none (one rank, or NCCL only).
  int64_t custom_allreduce_max_bytes = -1;
  // CudaTuning::shared_spine and attn_chunks_per_cta (docs/tuning.md).
  bool shared_spine = true;
  int attn_chunks_per_cta = 0;
};

// Lays out the forward pass of `items` (each with its PlanItem) into `step` (whose bucket
// ChooseBuckets may have set) and packs its metadata: tokens, positions, query_seq, kv_end,
// mask_begin, mask, slots, block tables, logit rows, the attention tiles and kv_stable.
void LayoutForward(absl::Span<const ForwardItem> items, absl::Span<const PlanItem> plan,
                   const StepPlanOptions& options, CudaStep* step, StepPacker* pack);

// The sampling row of a verify step: which item it belongs to (-1: padding, sampled greedily
// from a row no one reads) and the absolute position of the token it draws.
struct VerifyRow {
  int item = -1;
  int64_t position = 0;
};

// One VerifyRow per logit row of a laid out verify step ([step.R]): the last pending token's
// row, then one per tree node, at the item's logit rows. committed[b]: item b's committed length
// before the step.
std::vector<VerifyRow> VerifyRows(absl::Span<const VerifyItem> items,
                                  absl::Span<const int64_t> committed, const CudaStep& step);

// Packs a verify step's trees (step->out_stride, sample and node offsets, node counts, the
// packed trees, sequence rows, where each sequence's tree starts in its KV) and its zeroed
// outputs (sampled tokens; accepted counts, tokens and nodes). A padding sequence has no tree
// nodes, so it accepts nothing and compacts nothing.
void LayoutVerify(absl::Span<const VerifyItem> items, absl::Span<const int64_t> committed,
                  CudaStep* step, StepPacker* pack);

// Int32 words of a verify step's outputs at step.o_out: [batch] accepted counts, then
// [batch, out_stride] accepted tokens and [batch, out_stride] accepted nodes.
size_t VerifyOutCount(const CudaStep& step);

// Everything a step's launches take by value, and every metadata offset they take: equal keys
// launch equal kernels with equal arguments (buffer pointers aside), so a captured graph of one
// key replays any step of that key.
std::vector<int64_t> CudaGraphKey(const CudaStep& step);

}  // namespace specd

#endif  // SPECD_ENGINE_CUDA_CUDA_STEP_PLAN_H_
