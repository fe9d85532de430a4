// Device-independent bookkeeping of a paged KV cache (the KV model of engine/backend.h):
// sequence ids, block tables, free blocks, scratch trees, validation of Forward() batches and
// Commit() paths, and the per-token layout of a step that every attention kernel reads
// (tree_attention.h). It owns no K/V storage: the owners of the pools (one per tensor-parallel
// rank, each with its own KV heads) size them to allocated_blocks() and apply the slot copies
// that PrepareCommit() returns. CpuBackend and the tensor-parallel backends share it, so they
// have one KV semantics and one set of error messages; so does CudaBackend (each tensor-parallel
// CUDA rank), whose pools are sized up front (AllocateUpFront) and whose step planner encodes
// the keys as a mask (SetMaskBits).
#ifndef SPECD_ENGINE_KV_PAGED_KV_TABLE_H_
#define SPECD_ENGINE_KV_PAGED_KV_TABLE_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/backend.h"

namespace specd {

// Tokens per KV block of every backend's paged pools (CPU, CUDA, their tensor-parallel ranks and
// the EAGLE heads).
inline constexpr int64_t kKvBlockTokens = 16;

// Everything about one Forward() step that does not depend on the weights; T tokens over all
// items, R requested logits rows.
struct StepLayout {
  int64_t num_tokens = 0;          // T
  int64_t num_seqs = 0;            // items in the batch
  std::vector<int32_t> tokens;     // [T]
  std::vector<int32_t> positions;  // [T] absolute RoPE positions
  std::vector<int64_t> slots;      // [T] physical KV slot each token writes
  std::vector<int32_t> query_seq;  // [T] row of block_tables
  // Keys of token t (tree_attention.h): the run of logical slots [0, prefix_len[t]) (the
  // committed prefix and the leading ancestors that follow it contiguously), then the other
  // ancestors tree_keys[key_offsets[t] .. key_offsets[t + 1]), root first, itself last.
  std::vector<int32_t> prefix_len;   // [T]
  std::vector<int32_t> key_offsets;  // [T + 1] CSR offsets into tree_keys
  std::vector<int32_t> tree_keys;
  std::vector<int32_t> block_tables;  // [num_seqs, max_blocks_per_seq]
  int64_t max_blocks_per_seq = 0;
  std::vector<int64_t> logit_tokens;  // [R] token index (into T) of each requested row
  // Only from a table with SetMaskBits() (the CUDA step planner, which encodes the keys as a
  // prefix and a bit mask: engine/cuda/tree_mask.h): per item, its sequence's committed length,
  // and every scratch node's parent, this step's nodes included (the last ones).
  std::vector<int64_t> committed;                     // [num_seqs]
  std::vector<std::vector<int32_t>> scratch_parents;  // [num_seqs][scratch nodes]
};

class PagedKvTable {
 public:
  PagedKvTable(int64_t block_tokens, int64_t capacity_tokens, int vocab_size, int max_positions);

  // Sizes the pools once, up front (owners whose pools cannot grow: GPU memory): every block of
  // the capacity counts as allocated from now on, handed out lowest first as before. Call before
  // any sequence exists.
  void AllocateUpFront();
  // For an attention mask of `mask_bits` bits past a node's spine end (engine/cuda/tree_mask.h):
  // PrepareForward() refuses with UNIMPLEMENTED a node that lies further off the chain from the
  // committed end, and fills StepLayout::committed and scratch_parents.
  void SetMaskBits(int mask_bits) { mask_bits_ = mask_bits; }

  int64_t block_tokens() const { return block_tokens_; }
  int64_t capacity_blocks() const { return max_blocks_; }
  // Blocks the pools must hold (physical blocks [0, allocated_blocks())); grows geometrically
  // as PrepareForward() needs blocks, never beyond the capacity.
  int64_t allocated_blocks() const { return allocated_blocks_; }

  absl::Status AddSequence(SeqId seq);
  absl::Status RemoveSequence(SeqId seq);
  bool HasSequence(SeqId seq) const { return seqs_.contains(seq); }
  absl::StatusOr<int64_t> CommittedLength(SeqId seq) const;
  absl::StatusOr<int64_t> ScratchLength(SeqId seq) const;
  KvUsage Usage() const;

  // Validates the whole batch first (a bad item changes nothing), then appends its nodes to
  // the scratch regions, allocates blocks and fills `layout`.
  absl::Status PrepareForward(absl::Span<const ForwardItem> items, StepLayout* layout);

  // Validates `path` (see Backend::Commit); on success the sequence's committed prefix grows
  // by the path and its scratch region is dropped, and `src`/`dst` receive the physical slot
  // copies (apply in order) that move the path's K/V into place. Blocks beyond the new end are
  // already back on the free list, but nothing reuses them before the next PrepareForward(),
  // so the caller must apply the copies before calling it again.
  absl::Status PrepareCommit(SeqId seq, absl::Span<const int32_t> path, std::vector<int64_t>* src,
                             std::vector<int64_t>* dst);

 private:
  struct Sequence {
    int64_t committed = 0;
    std::vector<int32_t> blocks;
    std::vector<int32_t> scratch_parents;
    std::vector<int32_t> scratch_depth;
    int64_t tokens() const { return committed + static_cast<int64_t>(scratch_parents.size()); }
  };

  int64_t FreeBlocks() const;
  int32_t AllocateBlock();
  void ReleaseBlocks(Sequence* s, int64_t keep_blocks);
  int64_t PhysicalSlot(const Sequence& s, int64_t logical) const;
  int64_t BlocksFor(int64_t tokens) const { return (tokens + block_tokens_ - 1) / block_tokens_; }

  const int64_t block_tokens_;
  const int vocab_size_;
  const int max_positions_;
  int64_t max_blocks_ = 0;
  int64_t allocated_blocks_ = 0;
  int mask_bits_ = 0;  // 0: no mask limit, no mask fields
  std::vector<int32_t> free_blocks_;
  absl::flat_hash_map<SeqId, Sequence> seqs_;
};

}  // namespace specd

#endif  // SPECD_ENGINE_KV_PAGED_KV_TABLE_H_
