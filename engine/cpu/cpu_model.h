// The fp32 CPU decoder, shared by CpuBackend (the whole model on one device) and the
// tensor-parallel CPU rank executor (one rank's shard, engine/tp/tp_cpu_backend.h). A CpuModel
// holds the weights of one TpRankPlan slice of the checkpoint and that slice's KV pools; CpuBackend
// uses FullModelSlice(), for which every all-reduce is skipped, so the two backends run the same
// layer code and a one-rank slice is the unsharded model.
//
// Determinism: every per-token result is independent of batching (batch-invariant GEMMs, see
// specd/kernels/linear.h; attention per (token, head) item), which both backends rely on.
#ifndef SPECD_ENGINE_CPU_CPU_MODEL_H_
#define SPECD_ENGINE_CPU_CPU_MODEL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/io/safetensors.h"
#include "engine/backend.h"
#include "engine/kv/paged_kv_table.h"
#include "engine/model_config.h"
#include "engine/thread_pool.h"
#include "engine/tp/tp_plan.h"
#include "specd/kernels/linear.h"

namespace specd {

class TpCommunicator;

// The checks of BackendOptions both CPU backends make: INVALID_ARGUMENT naming the field.
absl::Status CheckCpuBackendOptions(const BackendOptions& options);
// Threads for options.num_threads: the hardware's when 0.
int CpuBackendThreads(const BackendOptions& options);
// LinearCpu with the output columns split over `pool` (small products run on the caller); the
// bits do not depend on the split (specd/kernels/linear.h). Not from inside pool->ParallelFor.
void LinearOnPool(const LinearParams& p, ThreadPool* pool);

class CpuModel {
 public:
  // `slice` must come from a plan for `config` (MakeTpPlan, or FullModelSlice). `bf16_weights`:
  // keep a GEMM matrix whose every value is a bf16 value (a bf16 checkpoint's, widened) as those
  // 16-bit patterns rather than fp32. A step reads each matrix from memory once, and at a few
  // rows that traffic is most of its time; LinearCpu widens bf16 exactly, so the logits do not
  // change by a bit (BackendOptions::cpu_bf16_weights).
  CpuModel(const ModelConfig& config, const TpRankPlan& slice, bool bf16_weights = true);

  // Reads the slice's part of every tensor, checking each tensor's full shape (errors name the
  // file and the tensor).
  absl::Status Load(const TensorStore& store);

  // Bytes of weights held (host): fp32, and bf16 for the matrices kept so.
  int64_t WeightBytes() const;

  // Makes the KV pools hold physical blocks [0, blocks) (contents kept; only grows).
  void ReserveKvBlocks(int64_t blocks);
  // Copies K/V of physical slots src[i] to dst[i], in order, in every layer.
  void CopyKvSlots(absl::Span<const int64_t> src, absl::Span<const int64_t> dst);

  // Embedding and every decoder layer over `layout`, writing the step's K/V into the pools. On
  // return the hidden state of token t is residual[t] + sub[t] (the last MLP output is not yet
  // added; Logits() adds it in its norm). residual, sub: [T, H] fp32, host. `comm` sums partial
  // results over the ranks; null for the full-model slice. `taps`, when not null, receives the
  // residual stream entering the layers `tap_layers` lists (num_layers: the last layer's output
  // before the final norm) for every token: [T, tap_layers.size() * H] fp32, host, layers
  // concatenated in that order. The stream is whole on every rank (after the all-reduces), so any
  // rank's copy is the full one.
  void Hidden(const StepLayout& layout, ThreadPool* pool, TpCommunicator* comm,
              std::vector<float>* residual, std::vector<float>* sub,
              absl::Span<const int> tap_layers = {}, std::vector<float>* taps = nullptr);

  // Final norm and LM head of the requested rows (layout.logit_tokens), over this slice's
  // vocabulary range. residual, sub: as Hidden() left them. out: [R, slice vocab] fp32, host.
  // `pool` splits the LM head's columns.
  void Logits(const StepLayout& layout, const std::vector<float>& residual,
              const std::vector<float>& sub, float* out, ThreadPool* pool) const;

 private:
  // A GEMM weight matrix, host: fp32 in f32, or (see bf16_weights) its values' bf16 bit
  // patterns in bf16 with f32 empty.
  struct Matrix {
    std::vector<float> f32;
    std::vector<uint16_t> bf16;
  };
  struct LayerWeights {
    std::vector<float> input_norm, post_norm;   // [H], replicated
    Matrix q_proj, k_proj, v_proj;              // [heads held * head_dim, H]: rows
    std::vector<float> q_bias, k_bias, v_bias;  // same rows (Qwen2), else empty
    std::vector<float> q_norm, k_norm;          // [head_dim], replicated (Qwen3), else empty
    Matrix o_proj;                              // [H, local q dim]: input columns
    Matrix gate_proj, up_proj;                  // [local ffn, H]
    Matrix down_proj;                           // [H, local ffn]
  };

  // Moves m->f32 to m->bf16 when bf16_weights_ and every value is a bf16 value.
  void Pack(Matrix* m) const;

  void Norm(const float* x, float* residual, const std::vector<float>& w, float* out, int64_t rows,
            int64_t dim) const;
  void Linear(const float* x, const Matrix& w, const std::vector<float>* bias, float* y,
              int64_t rows, int64_t in, int64_t out, ThreadPool* pool) const;
  int64_t local_kv_dim() const { return slice_.kv_heads.size() * config_.head_dim; }

  const ModelConfig config_;
  const TpRankPlan slice_;
  const int64_t kv_group_;  // query heads per KV head
  const bool bf16_weights_;
  std::vector<float> inv_freq_;
  std::vector<float> embed_, final_norm_;  // embed_: [slice vocab, H]
  // [slice vocab, H]: lm_head.weight, or with tied embeddings embed_'s values when packed as
  // bf16 (embed_ stays fp32 for the lookup), else empty (the LM head reads embed_).
  Matrix lm_head_;
  std::vector<LayerWeights> layers_;
  int64_t kv_blocks_ = 0;
  std::vector<std::vector<float>> k_pool_, v_pool_;  // per layer [slots, local kv dim] fp32
};

}  // namespace specd

#endif  // SPECD_ENGINE_CPU_CPU_MODEL_H_
