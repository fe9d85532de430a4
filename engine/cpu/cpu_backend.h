// The fp32 CPU backend: the reference implementation of Backend (engine/backend.h) and what CI
// runs. Weights are converted to fp32 at load, except that the matrices of a bf16 checkpoint stay
// bf16 in memory and are widened exactly inside the GEMM (BackendOptions::cpu_bf16_weights: the
// same bits, half the bytes a step streams); GEMMs are specd's own batch-invariant kernel (see
// kernels/include/specd/kernels/linear.h) with their output columns split over a thread pool,
// and attention is split over (token, head) pairs on that pool.
//
// KV cache. Keys and values live in a paged pool (kKvBlockTokens slots a block, blocks handed
// out on demand up to BackendOptions::kv_capacity_tokens). A sequence's committed prefix takes
// logical slots [0, L) of its block table and its scratch nodes the slots after it, in the
// order they were appended; Commit() moves the accepted path's slots down to [L, L + n) and
// returns the blocks no longer needed. Scratch nodes therefore count against the capacity.
//
// The bookkeeping is engine/kv/paged_kv_table.h and the model engine/cpu/cpu_model.h, both shared
// with the tensor-parallel CPU backend.
//
// Determinism. Every per-token computation is independent of batching: the GEMMs are
// batch-invariant and attention visits the committed prefix then the node's ancestors in
// order, so a tree node's logits are bit-identical to those of the same token decoded alone
// after its path, and a sequence's logits do not depend on the other sequences in the batch.
//
// Not thread-safe: one thread drives a backend (docs/architecture.md: one thread owns each model).
#ifndef SPECD_ENGINE_CPU_CPU_BACKEND_H_
#define SPECD_ENGINE_CPU_CPU_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/cpu/cpu_model.h"
#include "engine/kv/paged_kv_table.h"
#include "engine/model_config.h"
#include "engine/thread_pool.h"

namespace specd {

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
  // The rows' top-k on the thread pool, a row per task, straight from the logits buffer.
  absl::Status ForwardTopK(absl::Span<const ForwardItem> items, int k, TopKRows* out) override;
  // Copies of the fp32 residual stream the layers read (CpuModel::Hidden()).
  absl::Status ForwardWithTaps(absl::Span<const ForwardItem> items,
                               absl::Span<const int> tap_layers, std::vector<float>* logits,
                               std::vector<float>* taps) override;
  absl::Status Commit(SeqId seq, absl::Span<const int32_t> path) override;
  // used_tokens counts committed and scratch tokens; blocks are allocated kKvBlockTokens at a
  // time, so RESOURCE_EXHAUSTED can come up to one partly filled block per sequence early.
  KvUsage Usage() const override;
  // Backend::Verify() on the host: every processor, logprobs and taps.
  VerifyFeatures verify_features() const override { return {true, true, true, true}; }

  // Number of scratch nodes appended since the last Commit() (for tests and drafters).
  absl::StatusOr<int64_t> ScratchLength(SeqId seq) const;

 private:
  CpuBackend(ModelConfig config, const BackendOptions& options);

  ModelConfig config_;
  std::unique_ptr<ThreadPool> pool_;
  // Sequences, block tables and scratch trees; the K/V pools live in model_.
  PagedKvTable table_;
  CpuModel model_;                  // the whole model: FullModelSlice()
  std::vector<float> topk_logits_;  // ForwardTopK()'s [rows, vocab] logits
};

}  // namespace specd

#endif  // SPECD_ENGINE_CPU_CPU_BACKEND_H_
