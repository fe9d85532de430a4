// The fp32 CPU backend: the reference implementation of Backend (engine/backend.h) and what CI
// runs. Weights are converted to fp32 at load; GEMMs go through OpenBLAS (batch-invariant, see
// kernels/include/specd/kernels/linear.h) and attention is split over (token, head) pairs on a
// thread pool.
//
// KV cache. Keys and values live in a paged pool (kKvBlockTokens slots a block, blocks handed
// out on demand up to BackendOptions::kv_capacity_tokens). A sequence's committed prefix takes
// logical slots [0, L) of its block table and its scratch nodes the slots after it, in the
// order they were appended; Commit() moves the accepted path's slots down to [L, L + n) and
// returns the blocks no longer needed. Scratch nodes therefore count against the capacity.
//
// Determinism. Every per-token computation is independent of batching: the GEMMs are
// batch-invariant and attention visits the committed prefix then the node's ancestors in
// order, so a tree node's logits are bit-identical to those of the same token decoded alone
// after its path, and a sequence's logits do not depend on the other sequences in the batch.
//
// Not thread-safe: one thread drives a backend (DESIGN.md: one thread owns each model).
#ifndef SPECD_ENGINE_CPU_BACKEND_H_
#define SPECD_ENGINE_CPU_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/model_config.h"
#include "engine/thread_pool.h"

namespace specd {

inline constexpr int64_t kKvBlockTokens = 16;

class CpuBackend : public Backend {
 public:
  // Reads dir/config.json and the safetensors weights; every tensor's presence and shape is
  // checked, with errors naming the file and the tensor.
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(const std::string& dir,
                                                            const BackendOptions& options);
  ~CpuBackend() override;

  const ModelConfig& config() const override { return config_; }
  absl::Status AddSequence(SeqId seq) override;
  absl::Status RemoveSequence(SeqId seq) override;
  bool HasSequence(SeqId seq) const override;
  absl::StatusOr<int64_t> CommittedLength(SeqId seq) const override;
  absl::Status Forward(absl::Span<const ForwardItem> items, std::vector<float>* logits) override;
  absl::Status Commit(SeqId seq, absl::Span<const int32_t> path) override;
  // used_tokens counts committed and scratch tokens; blocks are allocated kKvBlockTokens at a
  // time, so RESOURCE_EXHAUSTED can come up to one partly filled block per sequence early.
  KvUsage Usage() const override;

  // Number of scratch nodes appended since the last Commit() (for tests and drafters).
  absl::StatusOr<int64_t> ScratchLength(SeqId seq) const;

  // Rows per sgemm call: kLinearRowBlock, or 1 when the load-time probe found this machine's
  // BLAS not batch-invariant in blocks (see specd/kernels/linear.h).
  int64_t linear_row_block() const { return row_block_; }

 private:
  struct LayerWeights {
    std::vector<float> input_norm, q_proj, k_proj, v_proj, q_bias, k_bias, v_bias, q_norm, k_norm,
        o_proj, post_norm, gate_proj, up_proj, down_proj;
  };
  struct Sequence {
    int64_t committed = 0;
    std::vector<int32_t> blocks;           // physical block of each logical block
    std::vector<int32_t> scratch_parents;  // per scratch node: parent scratch index or -1
    std::vector<int32_t> scratch_depth;    // per scratch node: depth below the committed end
    int64_t tokens() const { return committed + static_cast<int64_t>(scratch_parents.size()); }
  };

  CpuBackend(ModelConfig config, const BackendOptions& options);
  absl::Status LoadWeights();
  int64_t FreeBlocks() const;
  // Takes a free block, growing the pools if needed; the caller checked FreeBlocks().
  int32_t AllocateBlock();
  void ReleaseBlocks(Sequence* s, int64_t keep_blocks);
  int64_t PhysicalSlot(const Sequence& s, int64_t logical) const;
  void Linear(const float* x, const std::vector<float>& w, const std::vector<float>* bias, float* y,
              int64_t rows, int64_t in, int64_t out);

  ModelConfig config_;
  BackendOptions options_;
  std::unique_ptr<ThreadPool> pool_;
  std::vector<float> inv_freq_;
  std::vector<float> embed_tokens_, final_norm_, lm_head_;  // lm_head_ empty when tied
  std::vector<LayerWeights> layers_;
  int64_t row_block_ = 0;

  int64_t kv_dim_ = 0;
  int64_t max_blocks_ = 0;
  int64_t allocated_blocks_ = 0;
  std::vector<int32_t> free_blocks_;
  // Per layer: [allocated_blocks_ * kKvBlockTokens, kv_dim_] fp32.
  std::vector<std::vector<float>> k_pool_, v_pool_;
  absl::flat_hash_map<SeqId, Sequence> seqs_;
};

}  // namespace specd

#endif  // SPECD_ENGINE_CPU_BACKEND_H_
