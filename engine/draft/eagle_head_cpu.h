// The fp32 CPU forward of an EAGLE head (engine/draft/eagle_head.h): the reference the CUDA
// version will be checked against, on the CPU kernels the CPU backend uses (batch-invariant GEMMs,
// RMSNorm, RoPE, paged tree attention) and the same KV bookkeeping
// (engine/kv/paged_kv_table.h, one pool a head layer).
//
// Determinism: as CpuModel, every row's result depends only on its own inputs and keys, so a
// sequence's outputs do not depend on the other sequences of a batch, nor on which of its other
// rows are requested (the last layer computes past its keys and values only for those).
//
// Cost: a forward of a few rows is bound by the weight bytes it streams, so a bf16 checkpoint's
// matrices stay bf16 (EagleHeadOptions::cpu_bf16_weights), widened exactly inside the GEMM.
//
// Not thread-safe: one thread drives it.
#ifndef SPECD_ENGINE_DRAFT_EAGLE_HEAD_CPU_H_
#define SPECD_ENGINE_DRAFT_EAGLE_HEAD_CPU_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/draft/eagle_head.h"
#include "engine/kv/paged_kv_table.h"
#include "engine/thread_pool.h"

namespace specd {

class EagleHeadCpu : public EagleHead {
 public:
  // `config` and `weights` from LoadEagleHeadConfig / LoadEagleHeadWeights against `target`.
  // INVALID_ARGUMENT naming the option when `options` is out of range.
  static absl::StatusOr<std::unique_ptr<EagleHeadCpu>> Create(EagleHeadConfig config,
                                                              const ModelConfig& target,
                                                              EagleHeadWeights weights,
                                                              const EagleHeadOptions& options);

  const EagleHeadConfig& config() const override { return config_; }
  absl::Span<const int32_t> draft_to_target() const override { return w_.draft_to_target; }
  int context_length() const override { return context_length_; }

  absl::Status AddSequence(SeqId seq) override { return table_.AddSequence(seq); }
  absl::Status RemoveSequence(SeqId seq) override { return table_.RemoveSequence(seq); }
  bool HasSequence(SeqId seq) const override { return table_.HasSequence(seq); }
  absl::StatusOr<int64_t> CommittedLength(SeqId seq) const override {
    return table_.CommittedLength(seq);
  }
  absl::Status Forward(absl::Span<const EagleHeadItem> items, EagleHeadOutputs* out) override;
  absl::Status Commit(SeqId seq, absl::Span<const int32_t> path) override;
  KvUsage Usage() const override { return table_.Usage(); }
  // Bytes of the GEMM matrices held (host): fp32, and bf16 for those kept so.
  int64_t GemmWeightBytes() const;

 private:
  // The bf16 bit patterns ([out, in] uint16, host) of the GEMM matrices of EagleHeadWeights that
  // were packed (EagleHeadOptions::cpu_bf16_weights); a matrix packed here has its fp32 vector
  // in w_ emptied, one left empty is read as fp32.
  struct Bf16Weights {
    std::vector<uint16_t> fc, lm_head;
    struct Layer {
      std::vector<uint16_t> q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj;
    };
    std::vector<Layer> layers;
  };

  EagleHeadCpu(EagleHeadConfig config, EagleHeadWeights weights, Bf16Weights bf16,
               int context_length, const EagleHeadOptions& options);

  void Norm(const float* x, float* residual, const std::vector<float>& w, float* out,
            int64_t rows) const;
  // y = x w^T (+ bias), reading `w16` (w's bf16 bit patterns) instead of `w` when not empty.
  void Linear(const float* x, const std::vector<float>& w, const std::vector<uint16_t>& w16,
              const std::vector<float>* bias, float* y, int64_t rows, int64_t in,
              int64_t out) const;
  // Attention of head layer `layer` over the step: x [T, in] (already normed); writes every
  // token's K/V into the layer's pools, and the attention output of the tokens `rows` lists
  // (indices into T; all T in order when null) to out [rows, H]. Only the outputs a step asks
  // for need queries: the other tokens of a chain are there for their keys and values.
  void Attention(int layer, const StepLayout& l, const float* x, int64_t in,
                 const std::vector<int64_t>* rows, float* out);
  // The rest of layer `layer` for its attention output attn [R, H]: h [R, H] (the residual
  // stream of those rows) += attn, then += the MLP of its post-attention norm.
  void Finish(int layer, const float* attn, float* h, int64_t rows) const;
  // out [T, H] = down(silu(gate(x)) * up(x)) for x [T, H].
  void Mlp(int layer, const float* x, float* out, int64_t rows) const;

  const EagleHeadConfig config_;
  const EagleHeadWeights w_;
  const Bf16Weights bf16_;
  const int context_length_;
  PagedKvTable table_;
  std::vector<float> inv_freq_;
  std::unique_ptr<ThreadPool> pool_;
  int64_t kv_blocks_ = 0;
  std::vector<std::vector<float>> k_pool_, v_pool_;  // per head layer [slots, kv_heads * head_dim]
};

}  // namespace specd

#endif  // SPECD_ENGINE_DRAFT_EAGLE_HEAD_CPU_H_
