// The CUDA forward of an EAGLE-3 head (engine/draft/eagle_head.h) on one GPU: bf16 weights,
// fp32 accumulation and an fp32 residual stream, on the CUDA backend's kernels (cuBLASLt GEMMs,
// RMSNorm with a fused residual add, RoPE with the fused KV write, paged tree attention) and its
// step planner (engine/cuda/cuda_step_plan.h), over the same KV bookkeeping as the CPU head
// (engine/kv/paged_kv_table.h, pools allocated up front as the CUDA backend's).
//
// A Forward() step: the target features of the items that bring them go up as bf16 and through
// fc (one GEMM per such item, fp32 out, straight into the residual stream); hidden inputs go up
// as fp32. Then embedding, input_layernorm and hidden_norm into the two halves of the attention
// input, the fused q/k/v projection, RoPE and KV write, tree attention, o_proj, the
// post-attention norm (adding the attention output to the stream), the SwiGLU MLP, and the final
// norm (adding the MLP output: the stream is then the layer output). The requested rows' layer
// outputs (fp32) and draft-vocabulary logits (fp32, from the normed rows through lm_head) come
// back to the host.
//
// Numerics: within bf16 accuracy of the fp32 CPU head (tests/gpu/cuda_eagle_head_test.cc checks
// 2e-2 against the PyTorch oracle's logits). GEMMs of up to 1024 rows are row-invariant, so a
// sequence's outputs do not depend on the rest of the batch while the attention takes one split.
//
// EAGLE-1/2 heads run on the CPU head only (Create answers UNIMPLEMENTED).
//
// Not thread-safe: one thread drives it.
#ifndef SPECD_ENGINE_DRAFT_EAGLE_HEAD_CUDA_H_
#define SPECD_ENGINE_DRAFT_EAGLE_HEAD_CUDA_H_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/draft/eagle_head.h"
#include "engine/kv/paged_kv_table.h"
#include "specd/kernels/cuda/gemm.h"

namespace specd {

class EagleHeadCuda : public EagleHead {
 public:
  // `config` and `weights` from LoadEagleHeadConfig / LoadEagleHeadWeights against `target`;
  // `device`: the CUDA device index. INVALID_ARGUMENT naming the option when `options` is out of
  // range; UNIMPLEMENTED for an EAGLE-1/2 head or a head shape the attention kernel lacks.
  static absl::StatusOr<std::unique_ptr<EagleHeadCuda>> Create(EagleHeadConfig config,
                                                               const ModelConfig& target,
                                                               EagleHeadWeights weights, int device,
                                                               const EagleHeadOptions& options);
  ~EagleHeadCuda() override;

  const EagleHeadConfig& config() const override { return config_; }
  absl::Span<const int32_t> draft_to_target() const override { return draft_to_target_; }
  int context_length() const override { return context_length_; }

  absl::Status AddSequence(SeqId seq) override { return table_->AddSequence(seq); }
  absl::Status RemoveSequence(SeqId seq) override { return table_->RemoveSequence(seq); }
  bool HasSequence(SeqId seq) const override { return table_->HasSequence(seq); }
  absl::StatusOr<int64_t> CommittedLength(SeqId seq) const override {
    return table_->CommittedLength(seq);
  }
  absl::Status Forward(absl::Span<const EagleHeadItem> items, EagleHeadOutputs* out) override;
  // The rows' top-k by kernels/cuda/topk.cu, so only [rows, k] ids and log-probabilities (and
  // the rows' layer outputs) reach the host.
  absl::Status ForwardTopK(absl::Span<const EagleHeadItem> items, int k, EagleHeadOutputs* out,
                           TopKRows* top) override;
  absl::Status Commit(SeqId seq, absl::Span<const int32_t> path) override;
  KvUsage Usage() const override { return table_->Usage(); }

 private:
  using bf16 = __nv_bfloat16;
  // A device allocation that grows on demand (contents not preserved).
  struct Scratch {
    void* ptr = nullptr;
    size_t bytes = 0;
  };

  EagleHeadCuda(EagleHeadConfig config, int device, int context_length);
  absl::Status Init(const EagleHeadWeights& w, const EagleHeadOptions& options);
  // Forward() (top == nullptr: the logits to out->logits) or ForwardTopK() (k in
  // [1, kMaxForwardTopK]).
  absl::Status Run(absl::Span<const EagleHeadItem> items, int k, EagleHeadOutputs* out,
                   TopKRows* top);
  absl::Status Ensure(Scratch* s, size_t bytes);
  absl::Status Gemm(const bf16* x, const bf16* w, void* y, bool y_fp32, int64_t m, int64_t n,
                    int64_t k);
  // Copies `host` to a new device allocation (recorded for the destructor) as bf16 or fp32.
  absl::StatusOr<bf16*> UploadBf16(const std::vector<float>& host);
  absl::StatusOr<float*> UploadF32(const std::vector<float>& host);

  const EagleHeadConfig config_;
  const int device_;
  const int context_length_;
  std::vector<int32_t> draft_to_target_;
  std::unique_ptr<PagedKvTable> table_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<cuda::Gemm> gemm_;
  int num_sms_ = 0;

  // Weights, device. H: hidden, F: intermediate, Q/KV: query/key widths, Ft: feature_size().
  bf16* embed_ = nullptr;         // [vocab, H] bf16 (the target's embedding)
  bf16* fc_ = nullptr;            // [H, Ft] bf16
  float* input_norm_ = nullptr;   // [H] fp32
  float* hidden_norm_ = nullptr;  // [H] fp32
  float* post_norm_ = nullptr;    // [H] fp32
  float* final_norm_ = nullptr;   // [H] fp32
  bf16* qkv_ = nullptr;           // [Q + 2 KV, 2H] bf16: q_proj, k_proj, v_proj stacked
  bf16* o_proj_ = nullptr;        // [H, Q] bf16
  bf16* gate_up_ = nullptr;       // [2F, H] bf16: gate_proj, up_proj stacked
  bf16* down_ = nullptr;          // [H, F] bf16
  bf16* lm_head_ = nullptr;       // [draft vocab, H] bf16
  float* inv_freq_ = nullptr;     // [head_dim / 2] fp32 (RopeInvFreq of the head's config)
  std::vector<void*> allocations_;

  // KV pools of the one decoder layer: [num_blocks * kKvBlockTokens, KV] bf16 each.
  bf16* k_pool_ = nullptr;
  bf16* v_pool_ = nullptr;
  int64_t num_blocks_ = 0;

  // Per-step buffers. T: the step's nodes, R: its output rows, Tf: nodes with target features.
  Scratch meta_;         // the step planner's metadata (StepPacker), one upload
  Scratch features_;     // [Tf, Ft] bf16
  Scratch residual_;     // [T, H] fp32: the input, then the stream, then the layer output
  Scratch emb_;          // [T, H] bf16: embedding, then the attention's and the MLP's outputs
  Scratch normed_;       // [T, H] bf16
  Scratch cat_;          // [T, 2H] bf16: input_layernorm(embedding) | hidden_norm(input)
  Scratch qkv_out_;      // [T, Q + 2 KV] bf16
  Scratch attn_;         // [T, Q] bf16
  Scratch gate_up_out_;  // [T, 2F] bf16
  Scratch act_;          // [T, F] bf16
  Scratch last_;         // [R, H] bf16: the requested rows' normed outputs
  Scratch logits_;       // [R, draft vocab] fp32
  Scratch attn_ws_;      // split-KV workspace
  Scratch slots_;        // Commit()'s slot lists: [2, copies] int64
  // ForwardTopK(): [R, k] int32 ids, then [R, k] fp32 log-probabilities, then (16-byte
  // aligned) the top-k kernel's workspace (cuda::TopKWorkspaceBytes)
  Scratch topk_;
  // Pinned host staging for the uploads (features, hidden inputs, metadata).
  void* host_stage_ = nullptr;
  size_t host_stage_bytes_ = 0;
};

}  // namespace specd

#endif  // SPECD_ENGINE_DRAFT_EAGLE_HEAD_CUDA_H_
