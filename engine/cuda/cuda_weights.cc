#include "engine/cuda/cuda_weights.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_status.h"

namespace specd {
namespace {

using bf16 = __nv_bfloat16;

std::vector<bf16> ToBf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(v[i]);
  return out;
}

}  // namespace

CudaWeights::~CudaWeights() {
  for (void* p : allocations_) cudaFree(p);
}

absl::Status CudaWeights::UploadBf16(const TensorStore& st, const std::vector<Part>& parts,
                                     bf16** out) {
  // Elements of each part, after checking its full shape.
  std::vector<const TensorView*> views;
  std::vector<int64_t> sizes;
  int64_t total = 0;
  for (const Part& part : parts) {
    absl::StatusOr<const TensorView*> view = GetShardTensor(st, part.name, part.shape);
    if (!view.ok()) return view.status();
    SPECD_RETURN_IF_ERROR_(CheckShardRange(part.name, part.shape, part.slice, part.range));
    const int64_t n = ShardElements(part.shape, part.slice, part.range);
    views.push_back(*view);
    sizes.push_back(n);
    total += n;
  }
  void* p = nullptr;
  SPECD_CUDA_RETURN_(cudaMalloc(&p, std::max<int64_t>(1, total) * sizeof(bf16)),
                     "allocating weights");
  allocations_.push_back(p);
  bf16* dst = static_cast<bf16*>(p);
  for (size_t i = 0; i < parts.size(); ++i) {
    const Part& part = parts[i];
    const TensorView& view = *views[i];
    const int64_t row = part.shape.size() > 1 ? part.shape[1] : 1;
    if (view.dtype == DType::kBF16) {
      // bf16 checkpoints go straight from the mapping to the device: no fp32 round trip (what
      // makes an 8B model load in seconds).
      if (part.slice == ShardSlice::kCols) {
        const size_t width = part.range.size() * sizeof(bf16);
        SPECD_CUDA_RETURN_(
            cudaMemcpy2D(dst, width, view.data + part.range.begin * sizeof(bf16),
                         row * sizeof(bf16), width, part.shape[0], cudaMemcpyHostToDevice),
            "uploading weights");
      } else {
        const int64_t first = part.slice == ShardSlice::kRows ? part.range.begin * row : 0;
        SPECD_CUDA_RETURN_(cudaMemcpy(dst, view.data + first * sizeof(bf16),
                                      sizes[i] * sizeof(bf16), cudaMemcpyHostToDevice),
                           "uploading weights");
      }
    } else {
      std::vector<float> buf;
      SPECD_RETURN_IF_ERROR_(ReadShard(st, part.name, part.shape, part.slice, part.range, &buf));
      const std::vector<bf16> h = ToBf16(buf);
      SPECD_CUDA_RETURN_(cudaMemcpy(dst, h.data(), h.size() * sizeof(bf16), cudaMemcpyHostToDevice),
                         "uploading weights");
    }
    dst += sizes[i];
    if (progress_ != nullptr) progress_->Add(sizes[i] * static_cast<int64_t>(sizeof(bf16)));
  }
  *out = static_cast<bf16*>(p);
  return absl::OkStatus();
}

absl::Status CudaWeights::UploadFp32(const TensorStore& st, const std::string& name, int64_t size,
                                     float** out) {
  std::vector<float> buf;
  SPECD_RETURN_IF_ERROR_(ReadShard(st, name, {size}, ShardSlice::kAll, TpRange{}, &buf));
  void* p = nullptr;
  SPECD_CUDA_RETURN_(cudaMalloc(&p, std::max<size_t>(1, buf.size()) * sizeof(float)),
                     "allocating weights");
  allocations_.push_back(p);
  SPECD_CUDA_RETURN_(cudaMemcpy(p, buf.data(), buf.size() * sizeof(float), cudaMemcpyHostToDevice),
                     "uploading weights");
  if (progress_ != nullptr) progress_->Add(static_cast<int64_t>(buf.size() * sizeof(float)));
  *out = static_cast<float*>(p);
  return absl::OkStatus();
}

absl::Status CudaWeights::Load(const TensorStore& st, const ModelConfig& c, const TpRankPlan& slice,
                               LoadProgress* progress) {
  progress_ = progress;
  // Full (checkpoint) sizes, and this rank's rows and columns of them.
  const int64_t h = c.hidden_size, hd = c.head_dim, q = int64_t{c.num_heads} * hd,
                kv = int64_t{c.num_kv_heads} * hd, f = c.intermediate_size, v = c.vocab_size;
  const TpRange q_rows{slice.q_heads.begin * hd, slice.q_heads.end * hd};
  const TpRange kv_rows{slice.kv_heads.begin * hd, slice.kv_heads.end * hd};
  const ShardSlice rows = ShardSlice::kRows, cols = ShardSlice::kCols;
  const auto upload = [&](std::vector<Part> parts, bf16** out) {
    return UploadBf16(st, parts, out);
  };
  SPECD_RETURN_IF_ERROR_(
      upload({{"model.embed_tokens.weight", {v, h}, rows, slice.vocab}}, &embed_));
  SPECD_RETURN_IF_ERROR_(UploadFp32(st, "model.norm.weight", h, &final_norm_));
  lm_head_ = embed_;
  if (!c.tie_word_embeddings) {
    SPECD_RETURN_IF_ERROR_(upload({{"lm_head.weight", {v, h}, rows, slice.vocab}}, &lm_head_));
  }
  layers_.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    CudaLayerWeights& w = layers_[l];
    SPECD_RETURN_IF_ERROR_(UploadFp32(st, p + "input_layernorm.weight", h, &w.input_norm));
    SPECD_RETURN_IF_ERROR_(upload({{p + "self_attn.q_proj.weight", {q, h}, rows, q_rows},
                                   {p + "self_attn.k_proj.weight", {kv, h}, rows, kv_rows},
                                   {p + "self_attn.v_proj.weight", {kv, h}, rows, kv_rows}},
                                  &w.qkv));
    if (c.attention_bias) {
      SPECD_RETURN_IF_ERROR_(upload({{p + "self_attn.q_proj.bias", {q}, rows, q_rows},
                                     {p + "self_attn.k_proj.bias", {kv}, rows, kv_rows},
                                     {p + "self_attn.v_proj.bias", {kv}, rows, kv_rows}},
                                    &w.qkv_bias));
    }
    if (c.qk_norm) {
      SPECD_RETURN_IF_ERROR_(UploadFp32(st, p + "self_attn.q_norm.weight", hd, &w.q_norm));
      SPECD_RETURN_IF_ERROR_(UploadFp32(st, p + "self_attn.k_norm.weight", hd, &w.k_norm));
    }
    SPECD_RETURN_IF_ERROR_(
        upload({{p + "self_attn.o_proj.weight", {h, q}, cols, q_rows}}, &w.o_proj));
    SPECD_RETURN_IF_ERROR_(UploadFp32(st, p + "post_attention_layernorm.weight", h, &w.post_norm));
    SPECD_RETURN_IF_ERROR_(upload({{p + "mlp.gate_proj.weight", {f, h}, rows, slice.ffn},
                                   {p + "mlp.up_proj.weight", {f, h}, rows, slice.ffn}},
                                  &w.gate_up));
    SPECD_RETURN_IF_ERROR_(
        upload({{p + "mlp.down_proj.weight", {h, f}, cols, slice.ffn}}, &w.down));
  }
  const std::vector<float> inv_freq = RopeInvFreq(c);
  void* p = nullptr;
  SPECD_CUDA_RETURN_(cudaMalloc(&p, inv_freq.size() * sizeof(float)), "allocating inv_freq");
  allocations_.push_back(p);
  inv_freq_ = static_cast<float*>(p);
  SPECD_CUDA_RETURN_(cudaMemcpy(inv_freq_, inv_freq.data(), inv_freq.size() * sizeof(float),
                                cudaMemcpyHostToDevice),
                     "uploading inv_freq");
  progress_ = nullptr;
  return absl::OkStatus();
}

}  // namespace specd
