// The bf16 CUDA backend: Backend (engine/backend.h) on one NVIDIA GPU with the kernels of
// kernels/cuda. Weights are uploaded as bf16 (q/k/v and gate/up fused into one GEMM each);
// GEMMs go through cuBLASLt with fp32 accumulation; the residual stream is fp32.
//
// KV cache. One pool per tensor for all layers, [num_layers, num_slots, kv_dim] bf16, allocated
// at load for BackendOptions::kv_capacity_tokens (clamped to the free device memory), in blocks
// of kKvBlockTokens slots with per-sequence block tables -- the CPU backend's bookkeeping, so
// committed prefixes take logical slots [0, L) and scratch nodes the slots after them.
//
// Verify() runs on the device end to end: one forward pass over every sequence's pending
// tokens and tree, sampling of every tree row (Philox, the host sampler's semantics), tree
// acceptance and compaction of the accepted KV, then a single copy of the outcomes to the host.
//
// Attention masks. A scratch node sees the committed prefix, then the run of scratch nodes
// 0..a that form a chain from the committed end (its deepest such ancestor a), then its other
// ancestors through a 256-bit mask; so a node may lie at most 256 scratch slots past a. Verify
// steps (pending chain + a tree of <= 256 nodes) and prefill chains always fit; a Forward()
// whose scratch region grows wider off the chain is refused with UNIMPLEMENTED.
//
// Not thread-safe: one thread drives a backend. Numerics: logits agree with the fp32 CPU
// backend to bf16 accuracy (tests/gpu/cuda_backend_test.cc); they are not bit-identical across
// batch shapes, since cuBLASLt picks its algorithm per GEMM shape.
#ifndef SPECD_ENGINE_CUDA_CUDA_BACKEND_H_
#define SPECD_ENGINE_CUDA_CUDA_BACKEND_H_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/model_config.h"
#include "specd/kernels/cuda/gemm.h"

namespace specd {

class CudaBackend : public Backend {
 public:
  static constexpr int64_t kKvBlockTokens = 16;

  // Loads the model folder `dir` onto CUDA device `device`.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const std::string& dir, int device,
                                                             const BackendOptions& options);
  ~CudaBackend() override;

  const ModelConfig& config() const override { return config_; }
  absl::Status AddSequence(SeqId seq) override;
  absl::Status RemoveSequence(SeqId seq) override;
  bool HasSequence(SeqId seq) const override;
  absl::StatusOr<int64_t> CommittedLength(SeqId seq) const override;
  absl::Status Forward(absl::Span<const ForwardItem> items, std::vector<float>* logits) override;
  absl::Status Commit(SeqId seq, absl::Span<const int32_t> path) override;
  KvUsage Usage() const override;
  absl::StatusOr<std::vector<VerifyOutcome>> Verify(absl::Span<const VerifyItem> items) override;

 private:
  using bf16 = __nv_bfloat16;

  struct LayerWeights {
    bf16* input_norm = nullptr;  // [hidden]
    bf16* qkv = nullptr;         // [q_dim + 2 kv_dim, hidden]: q_proj, k_proj, v_proj rows
    bf16* qkv_bias = nullptr;    // [q_dim + 2 kv_dim] or null
    bf16* q_norm = nullptr;      // [head_dim] or null
    bf16* k_norm = nullptr;      // [head_dim] or null
    bf16* o_proj = nullptr;      // [hidden, q_dim]
    bf16* post_norm = nullptr;   // [hidden]
    bf16* gate_up = nullptr;     // [2 intermediate, hidden]: gate_proj, up_proj rows
    bf16* down = nullptr;        // [hidden, intermediate]
  };
  struct Sequence {
    int64_t committed = 0;
    std::vector<int32_t> blocks;
    std::vector<int32_t> scratch_parents;
    std::vector<int32_t> scratch_depth;
    int64_t tokens() const { return committed + static_cast<int64_t>(scratch_parents.size()); }
  };
  // A device allocation that grows on demand (contents not preserved).
  struct Scratch {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  // A validated batch: per item its sequence, the new nodes' depths, and for each new node its
  // deepest ancestor on the chain from the committed end (-1 if none).
  struct Batch {
    std::vector<Sequence*> seqs;
    std::vector<std::vector<int32_t>> depth;
    std::vector<std::vector<int32_t>> spine;
    int64_t tokens = 0;
    int64_t rows = 0;
  };

  CudaBackend(ModelConfig config, int device, const BackendOptions& options);
  absl::Status Init();
  absl::Status Upload(const std::vector<float>& host, bf16** out);
  absl::Status Ensure(Scratch* s, size_t bytes);
  absl::StatusOr<Batch> Validate(absl::Span<const ForwardItem> items);
  // Appends the batch to the scratch regions and runs the model; leaves
  // [batch.rows, vocab] fp32 logits in logits_ (rows in item order).
  absl::Status RunForward(absl::Span<const ForwardItem> items, const Batch& batch);
  void ReleaseBlocks(Sequence* s, int64_t keep_blocks);
  int64_t PhysicalSlot(const Sequence& s, int64_t logical) const;
  absl::Status Gemm(const bf16* x, const bf16* w, const bf16* bias, void* y, bool y_fp32, int64_t m,
                    int64_t n, int64_t k);

  ModelConfig config_;
  int device_ = 0;
  BackendOptions options_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<cuda::Gemm> gemm_;
  int num_sms_ = 0;
  std::vector<void*> allocations_;  // weights and pools, freed at destruction

  float* inv_freq_ = nullptr;  // [head_dim / 2] fp32
  bf16* embed_ = nullptr;      // [vocab, hidden]
  bf16* final_norm_ = nullptr;
  bf16* lm_head_ = nullptr;  // embed_ when tied
  std::vector<LayerWeights> layers_;

  int64_t kv_dim_ = 0;
  int64_t num_blocks_ = 0;
  int64_t layer_stride_ = 0;  // elements between layers in the pools
  bf16* k_pool_ = nullptr;
  bf16* v_pool_ = nullptr;
  std::vector<int32_t> free_blocks_;
  absl::flat_hash_map<SeqId, Sequence> seqs_;

  // Per-call device buffers.
  Scratch meta_;      // step metadata, uploaded in one copy
  Scratch residual_;  // [T, hidden] fp32
  Scratch x_;         // [T, hidden] bf16: embedding, then each sublayer's output
  Scratch normed_;    // [T, hidden] bf16
  Scratch qkv_;       // [T, q_dim + 2 kv_dim] bf16
  Scratch attn_;      // [T, q_dim] bf16
  Scratch gate_up_;   // [T, 2 intermediate] bf16
  Scratch act_;       // [T, intermediate] bf16
  Scratch last_;      // [R, hidden] bf16
  Scratch logits_;    // [R, vocab] fp32
  Scratch attn_ws_;   // split-KV workspace
  Scratch verify_;    // sampling and acceptance outputs
  // Device pointers into meta_ for the current step (valid until the next upload).
  const int32_t* d_block_tables_ = nullptr;
  int64_t max_blocks_per_seq_ = 0;
};

}  // namespace specd

#endif  // SPECD_ENGINE_CUDA_CUDA_BACKEND_H_
