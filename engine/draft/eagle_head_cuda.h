// The CUDA forward of an EAGLE head (engine/draft/eagle_head.h), EAGLE-3 or EAGLE-1/2, on one
// GPU: bf16 weights, fp32 accumulation and an fp32 residual stream, on the CUDA backend's kernels
// (cuBLASLt GEMMs, RMSNorm with a fused residual add, RoPE with the fused KV write, paged tree
// attention) and its step planner and launch code (engine/cuda/cuda_step_plan.h,
// engine/cuda/cuda_step_launch.h), over the same KV bookkeeping as the CPU head
// (engine/kv/paged_kv_table.h, pools allocated up front as the CUDA backend's).
//
// A Forward() step. EAGLE-3: the target features of the items that bring them go up as bf16 and
// through fc (one GEMM per such item, fp32 out, straight into the residual stream); hidden
// inputs go up as fp32. Then embedding, input_layernorm and hidden_norm into the two halves of
// the attention input, the layer, and the final norm (adding the MLP output: the stream is then
// the layer output). EAGLE-1/2: every input (a target feature or a hidden state, both H wide)
// goes up as bf16 beside the embedding, fc over the pair (fp32 out, its bias added in fp32)
// starts the stream, then the layers (the first without an input norm: it reads the stream's
// bf16 rounding), and the stream after the
// last MLP is the output, read unnormalised by the target's LM head. A layer: the fused q/k/v
// projection, RoPE and KV write, tree attention, o_proj, the post-attention norm (adding the
// attention output to the stream), the SwiGLU MLP. The requested rows' layer outputs (fp32) and
// logits (fp32) come back to the host, or their top-k (ForwardTopK).
//
// Numerics: within bf16 accuracy of the fp32 CPU head (tests/gpu/cuda_eagle_head_test.cc checks
// 2e-2 against the PyTorch oracle's logits). GEMMs of up to 1024 rows are row-invariant, so a
// sequence's outputs do not depend on the rest of the batch while the attention takes one split.
//
// Not thread-safe: one thread drives it.
#ifndef SPECD_ENGINE_DRAFT_EAGLE_HEAD_CUDA_H_
#define SPECD_ENGINE_DRAFT_EAGLE_HEAD_CUDA_H_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/cuda/cuda_step_launch.h"
#include "engine/draft/eagle_head.h"
#include "engine/kv/paged_kv_table.h"
#include "specd/kernels/cuda/gemm.h"

namespace specd {

class EagleHeadCuda : public EagleHead {
 public:
  // `config` and `weights` from LoadEagleHeadConfig / LoadEagleHeadWeights against `target`;
  // `device`: the CUDA device index. INVALID_ARGUMENT naming the option when `options` is out of
  // range; UNIMPLEMENTED for a head shape the attention kernel lacks.
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
  // One decoder layer's weights, device. H: hidden, F: intermediate, Q/KV: query/key widths,
  // In: the attention's input width (2H for EAGLE-3, H for EAGLE-1/2).
  struct Layer {
    float* input_norm = nullptr;   // [H] fp32; null for an EAGLE-1/2 head's first layer
    float* hidden_norm = nullptr;  // [H] fp32, EAGLE-3 only
    float* post_norm = nullptr;    // [H] fp32
    bf16* qkv = nullptr;           // [Q + 2 KV, In] bf16: q_proj, k_proj, v_proj stacked
    bf16* o_proj = nullptr;        // [H, Q] bf16
    bf16* gate_up = nullptr;       // [2F, H] bf16: gate_proj, up_proj stacked
    bf16* down = nullptr;          // [H, F] bf16
  };

  EagleHeadCuda(EagleHeadConfig config, int device, int context_length);
  absl::Status Init(const EagleHeadWeights& w, const EagleHeadOptions& options);
  // Forward() (top == nullptr: the logits to out->logits) or ForwardTopK() (k in
  // [1, kMaxForwardTopK]).
  absl::Status Run(absl::Span<const EagleHeadItem> items, int k, EagleHeadOutputs* out,
                   TopKRows* top);
  absl::Status Ensure(DeviceScratch* s, size_t bytes);
  absl::Status Gemm(const bf16* x, const bf16* w, const bf16* bias, void* y, bool y_fp32, int64_t m,
                    int64_t n, int64_t k);
  // Copies `host` to a new device allocation (recorded for the destructor) as bf16 or fp32;
  // an empty vector gives null.
  absl::StatusOr<bf16*> UploadBf16(const std::vector<float>& host);
  absl::StatusOr<float*> UploadF32(const std::vector<float>& host);

  const EagleHeadConfig config_;
  const bool eagle3_;
  const int device_;
  const int context_length_;
  std::vector<int32_t> draft_to_target_;
  std::unique_ptr<PagedKvTable> table_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<cuda::Gemm> gemm_;
  int num_sms_ = 0;

  // Weights, device. Ft: feature_size(); V: draft_vocab_size (the target's vocabulary for
  // EAGLE-1/2).
  bf16* embed_ = nullptr;     // [vocab, H] bf16 (the target's embedding)
  bf16* fc_ = nullptr;        // EAGLE-3 [H, Ft], EAGLE-1/2 [H, 2H] bf16
  float* fc_bias_ = nullptr;  // [H] fp32 (EAGLE-1/2 with a bias), else null
  std::vector<Layer> layers_;
  float* final_norm_ = nullptr;  // [H] fp32, EAGLE-3 only
  bf16* lm_head_ = nullptr;      // [V, H] bf16
  float* inv_freq_ = nullptr;    // [head_dim / 2] fp32 (RopeInvFreq of the head's config)
  std::vector<void*> allocations_;

  // KV pools of the layers: [layers, num_blocks * kKvBlockTokens, KV] bf16 each.
  KvPools kv_;

  // Per-step buffers. T: the step's nodes, R: its output rows, Tf: nodes with target features.
  DeviceScratch meta_;         // the step planner's metadata and the inputs (StepPacker)
  DeviceScratch residual_;     // [T, H] fp32: the input, then the stream, then the layer output
  DeviceScratch emb_;          // [T, H] bf16: embedding, fc's output (EAGLE-1/2), sublayer outputs
  DeviceScratch normed_;       // [T, H] bf16
  DeviceScratch cat_;          // [T, 2H] bf16: the attention's (EAGLE-3) or fc's (EAGLE-1/2) input
  DeviceScratch qkv_out_;      // [T, Q + 2 KV] bf16
  DeviceScratch attn_;         // [T, Q] bf16
  DeviceScratch gate_up_out_;  // [T, 2F] bf16
  DeviceScratch act_;          // [T, F] bf16
  DeviceScratch last_;         // [R, H] bf16: the requested rows, the LM head's input
  DeviceScratch logits_;       // [R, V] fp32
  DeviceScratch attn_ws_;      // split-KV workspace
  DeviceScratch slots_;        // Commit()'s slot lists: [2, copies] int64
  // ForwardTopK(): [R, k] int32 ids, then [R, k] fp32 log-probabilities, then (16-byte
  // aligned) the top-k kernel's workspace (cuda::TopKWorkspaceBytes)
  DeviceScratch topk_;
  PinnedUploader uploader_;  // a step's metadata and inputs on their way up
};

}  // namespace specd

#endif  // SPECD_ENGINE_DRAFT_EAGLE_HEAD_CUDA_H_
