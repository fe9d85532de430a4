// The CUDA backend's weights: one rank's slice of a checkpoint (engine/tp/tp_plan.h; the whole
// model without tensor parallelism) on one GPU. GEMM weights are bf16 with q/k/v and gate/up
// fused into one matrix each; norm weights are fp32 (RmsNormParams::weight says why).
#ifndef SPECD_ENGINE_CUDA_CUDA_WEIGHTS_H_
#define SPECD_ENGINE_CUDA_CUDA_WEIGHTS_H_

#include <cuda_bf16.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/io/load_progress.h"
#include "common/io/safetensors.h"
#include "engine/model_config.h"
#include "engine/tp/tp_plan.h"
#include "engine/tp/weight_shard.h"

namespace specd {

// One decoder layer's weights, device pointers into CudaWeights' allocations. Sizes are this
// rank's: q_dim = local query heads * head_dim, kv_dim = local KV heads * head_dim,
// intermediate = local FFN columns.
struct CudaLayerWeights {
  float* input_norm = nullptr;   // [hidden] fp32
  __nv_bfloat16* qkv = nullptr;  // [q_dim + 2 kv_dim, hidden] bf16: q_proj, k_proj, v_proj rows
  __nv_bfloat16* qkv_bias = nullptr;  // [q_dim + 2 kv_dim] bf16, or null
  float* q_norm = nullptr;            // [head_dim] fp32, or null
  float* k_norm = nullptr;            // [head_dim] fp32, or null
  __nv_bfloat16* o_proj = nullptr;    // [hidden, q_dim] bf16
  float* post_norm = nullptr;         // [hidden] fp32
  __nv_bfloat16* gate_up = nullptr;   // [2 intermediate, hidden] bf16: gate_proj, up_proj rows
  __nv_bfloat16* down = nullptr;      // [hidden, intermediate] bf16
};

class CudaWeights {
 public:
  CudaWeights() = default;
  CudaWeights(const CudaWeights&) = delete;
  CudaWeights& operator=(const CudaWeights&) = delete;
  // Frees every allocation (the caller has the device current and its work finished).
  ~CudaWeights();

  // Uploads `slice` of the checkpoint in `st` (model `config`) to the current device, checking
  // every tensor's full shape; `progress` (may be null) counts the bytes placed.
  absl::Status Load(const TensorStore& st, const ModelConfig& config, const TpRankPlan& slice,
                    LoadProgress* progress);

  // [head_dim / 2] fp32, device: RoPE's inverse frequencies (RopeInvFreq).
  const float* inv_freq() const { return inv_freq_; }
  // [local vocab, hidden] bf16, device: this rank's embedding rows.
  const __nv_bfloat16* embed() const { return embed_; }
  const float* final_norm() const { return final_norm_; }  // [hidden] fp32, device
  // [local vocab, hidden] bf16, device: embed() when the embeddings are tied.
  const __nv_bfloat16* lm_head() const { return lm_head_; }
  const CudaLayerWeights& layer(int l) const { return layers_[l]; }

 private:
  // One checkpoint tensor, or this rank's rows or columns of it (`shape` is the full shape,
  // checked).
  struct Part {
    std::string name;
    std::vector<int64_t> shape;
    ShardSlice slice = ShardSlice::kAll;
    TpRange range;
  };
  // Uploads the parts one after another into one bf16 device allocation (the fused q/k/v and
  // gate/up weights).
  absl::Status UploadBf16(const TensorStore& st, const std::vector<Part>& parts,
                          __nv_bfloat16** out);
  // Uploads a whole 1-D tensor (a norm weight, replicated on every rank) as fp32, whatever its
  // checkpoint dtype.
  absl::Status UploadFp32(const TensorStore& st, const std::string& name, int64_t size,
                          float** out);

  LoadProgress* progress_ = nullptr;  // Load()'s, for the uploads it makes (may be null)
  std::vector<void*> allocations_;    // device, freed at destruction
  float* inv_freq_ = nullptr;
  __nv_bfloat16* embed_ = nullptr;
  float* final_norm_ = nullptr;
  __nv_bfloat16* lm_head_ = nullptr;
  std::vector<CudaLayerWeights> layers_;
};

}  // namespace specd

#endif  // SPECD_ENGINE_CUDA_CUDA_WEIGHTS_H_
