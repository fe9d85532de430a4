#include "engine/draft/eagle_head_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_status.h"
#include "engine/cuda/cuda_step_plan.h"
#include "specd/kernels/cuda/embedding.h"
#include "specd/kernels/cuda/kv_cache.h"
#include "specd/kernels/cuda/rmsnorm.h"
#include "specd/kernels/cuda/swiglu.h"
#include "specd/kernels/cuda/topk.h"
#include "specd/kernels/cuda/tree_attention.h"

namespace specd {
namespace {

// Device memory the KV pools leave free for the target's backend when both share a GPU, the
// activations and cuBLASLt.
constexpr size_t kReserveBytes = size_t{2} << 30;
// GEMMs of up to this many rows share one algorithm per weight (cuda::Gemm), so a node's outputs
// do not depend on how many other nodes share its step.
constexpr int64_t kInvariantRows = 1024;

}  // namespace

absl::StatusOr<std::unique_ptr<EagleHeadCuda>> EagleHeadCuda::Create(
    EagleHeadConfig config, const ModelConfig& target, EagleHeadWeights weights, int device,
    const EagleHeadOptions& options) {
  if (options.kv_capacity_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_capacity_tokens: must be positive, got ", options.kv_capacity_tokens));
  }
  if (options.context_length < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("context_length: must be >= 0, got ", options.context_length));
  }
  const ModelConfig& h = config.head;
  if (!cuda::TreeAttentionHeadDimSupported(h.head_dim)) {
    return absl::UnimplementedError(absl::StrCat("cuda eagle head: head_dim ", h.head_dim,
                                                 " is not supported (even, at most ",
                                                 cuda::kTreeAttentionMaxHeadDim, ")"));
  }
  if (h.num_kv_heads <= 0 || h.num_heads % h.num_kv_heads != 0 ||
      h.num_heads / h.num_kv_heads > cuda::kTreeAttentionTileRows) {
    return absl::UnimplementedError(absl::StrCat("cuda eagle head: ", h.num_heads,
                                                 " query heads over ", h.num_kv_heads,
                                                 " KV heads is not supported"));
  }
  // What LoadEagleHeadWeights gives; the forward below relies on it.
  if (config.kind == EagleKind::kEagle3 && weights.layers.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda eagle head: an EAGLE-3 head has one decoder layer, got ", weights.layers.size()));
  }
  if (config.kind != EagleKind::kEagle3) {
    if (weights.layers.empty() || config.feature_size() != h.hidden_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda eagle head: an EAGLE-1/2 head needs a decoder layer and features of its hidden "
          "size, got ",
          weights.layers.size(), " layers and ", config.feature_size(), " floats"));
    }
    for (size_t l = 0; l < weights.layers.size(); ++l) {
      if (weights.layers[l].input_norm.empty() != (l == 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat("cuda eagle head: layers.", l,
                         ".input_layernorm: an EAGLE-1/2 head's first layer has "
                         "none and every later layer has one"));
      }
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device cuda:", device, " is not available: this machine has ", count, " CUDA device(s)"));
  }
  const int context =
      options.context_length > 0 ? options.context_length : target.max_position_embeddings;
  std::unique_ptr<EagleHeadCuda> head(new EagleHeadCuda(std::move(config), device, context));
  head->draft_to_target_ = std::move(weights.draft_to_target);
  SPECD_RETURN_IF_ERROR_(head->Init(weights, options));
  return head;
}

EagleHeadCuda::EagleHeadCuda(EagleHeadConfig config, int device, int context_length)
    : config_(std::move(config)),
      eagle3_(config_.kind == EagleKind::kEagle3),
      device_(device),
      context_length_(context_length) {}

EagleHeadCuda::~EagleHeadCuda() {
  if (cudaSetDevice(device_) != cudaSuccess) return;
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  gemm_.reset();
  for (DeviceScratch* s : {&meta_, &residual_, &emb_, &normed_, &cat_, &qkv_out_, &attn_,
                           &gate_up_out_, &act_, &last_, &logits_, &attn_ws_, &slots_, &topk_}) {
    FreeDeviceScratch(s);
  }
  for (void* p : allocations_) cudaFree(p);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::StatusOr<float*> EagleHeadCuda::UploadF32(const std::vector<float>& host) {
  if (host.empty()) return nullptr;
  void* p = nullptr;
  SPECD_CUDA_RETURN_(cudaMalloc(&p, host.size() * sizeof(float)), "allocating eagle head weights");
  allocations_.push_back(p);
  SPECD_CUDA_RETURN_(
      cudaMemcpy(p, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
      "uploading eagle head weights");
  return static_cast<float*>(p);
}

absl::StatusOr<EagleHeadCuda::bf16*> EagleHeadCuda::UploadBf16(const std::vector<float>& host) {
  if (host.empty()) return nullptr;
  std::vector<bf16> converted(host.size());
  for (size_t i = 0; i < host.size(); ++i) converted[i] = __float2bfloat16(host[i]);
  void* p = nullptr;
  SPECD_CUDA_RETURN_(cudaMalloc(&p, host.size() * sizeof(bf16)), "allocating eagle head weights");
  allocations_.push_back(p);
  SPECD_CUDA_RETURN_(
      cudaMemcpy(p, converted.data(), host.size() * sizeof(bf16), cudaMemcpyHostToDevice),
      "uploading eagle head weights");
  return static_cast<bf16*>(p);
}

absl::Status EagleHeadCuda::Init(const EagleHeadWeights& w, const EagleHeadOptions& options) {
  SPECD_CUDA_RETURN_(cudaSetDevice(device_), absl::StrCat("selecting cuda:", device_));
  SPECD_CUDA_RETURN_(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                     "creating a stream");
  SPECD_CUDA_RETURN_(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_),
                     "reading the multiprocessor count");
  if (cublasStatus_t st = cuda::Gemm::Create(size_t{32} << 20, &gemm_, kInvariantRows);
      st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cuda eagle head: cuBLASLt: ", cublasLtGetStatusString(st)));
  }
  const auto bf16_of = [&](const std::vector<float>& v, bf16** out) -> absl::Status {
    absl::StatusOr<bf16*> p = UploadBf16(v);
    if (!p.ok()) return p.status();
    *out = *p;
    return absl::OkStatus();
  };
  const auto f32_of = [&](const std::vector<float>& v, float** out) -> absl::Status {
    absl::StatusOr<float*> p = UploadF32(v);
    if (!p.ok()) return p.status();
    *out = *p;
    return absl::OkStatus();
  };
  const auto stacked = [](std::initializer_list<const std::vector<float>*> parts) {
    std::vector<float> all;
    for (const std::vector<float>* p : parts) all.insert(all.end(), p->begin(), p->end());
    return all;
  };
  SPECD_RETURN_IF_ERROR_(bf16_of(w.embed, &embed_));
  SPECD_RETURN_IF_ERROR_(bf16_of(w.fc, &fc_));
  SPECD_RETURN_IF_ERROR_(f32_of(w.fc_bias, &fc_bias_));
  layers_.resize(w.layers.size());
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const EagleHeadWeights::Layer& l = w.layers[i];
    Layer& d = layers_[i];
    SPECD_RETURN_IF_ERROR_(f32_of(l.input_norm, &d.input_norm));
    SPECD_RETURN_IF_ERROR_(f32_of(l.hidden_norm, &d.hidden_norm));
    SPECD_RETURN_IF_ERROR_(f32_of(l.post_norm, &d.post_norm));
    SPECD_RETURN_IF_ERROR_(bf16_of(stacked({&l.q_proj, &l.k_proj, &l.v_proj}), &d.qkv));
    SPECD_RETURN_IF_ERROR_(bf16_of(l.o_proj, &d.o_proj));
    SPECD_RETURN_IF_ERROR_(bf16_of(stacked({&l.gate_proj, &l.up_proj}), &d.gate_up));
    SPECD_RETURN_IF_ERROR_(bf16_of(l.down_proj, &d.down));
  }
  SPECD_RETURN_IF_ERROR_(f32_of(w.norm, &final_norm_));
  SPECD_RETURN_IF_ERROR_(bf16_of(w.lm_head, &lm_head_));
  SPECD_RETURN_IF_ERROR_(f32_of(RopeInvFreq(config_.head), &inv_freq_));

  // KV pools: the requested capacity, or what the free memory allows.
  const ModelConfig& h = config_.head;
  absl::StatusOr<KvPools> pools = AllocateKvPools(
      static_cast<int>(layers_.size()), int64_t{h.num_kv_heads} * h.head_dim,
      options.kv_capacity_tokens, kReserveBytes, device_, "the eagle head's KV cache");
  if (!pools.ok()) return pools.status();
  kv_ = *pools;
  allocations_.push_back(kv_.k);
  allocations_.push_back(kv_.v);
  table_ = std::make_unique<PagedKvTable>(kKvBlockTokens, kv_.num_blocks * kKvBlockTokens,
                                          config_.vocab_size, context_length_);
  table_->AllocateUpFront();
  table_->SetMaskBits(cuda::kTreeAttentionMaskBits);
  return absl::OkStatus();
}

absl::Status EagleHeadCuda::Ensure(DeviceScratch* s, size_t bytes) {
  return EnsureDeviceScratch(s, bytes, stream_);
}

absl::Status EagleHeadCuda::Gemm(const bf16* x, const bf16* w, const bf16* bias, void* y,
                                 bool y_fp32, int64_t m, int64_t n, int64_t k) {
  if (m == 0) return absl::OkStatus();
  cuda::GemmParams p;
  p.x = x;
  p.w = w;
  p.bias = bias;
  p.y = y;
  p.y_fp32 = y_fp32;
  p.m = m;
  p.n = n;
  p.k = k;
  return RunGemm(*gemm_, p, stream_, "cuda eagle head");
}

absl::Status EagleHeadCuda::Forward(absl::Span<const EagleHeadItem> items, EagleHeadOutputs* out) {
  return Run(items, 0, out, nullptr);
}

absl::Status EagleHeadCuda::ForwardTopK(absl::Span<const EagleHeadItem> items, int k,
                                        EagleHeadOutputs* out, TopKRows* top) {
  if (top == nullptr) return absl::InvalidArgumentError("top is null");
  if (k < 1 || k > kMaxForwardTopK) {
    return absl::InvalidArgumentError(
        absl::StrCat("k: ", k, " is not in [1, ", kMaxForwardTopK, "]"));
  }
  return Run(items, k, out, top);
}

absl::Status EagleHeadCuda::Run(absl::Span<const EagleHeadItem> items, int k, EagleHeadOutputs* out,
                                TopKRows* top) {
  if (out == nullptr) return absl::InvalidArgumentError("out is null");
  out->hidden.clear();
  out->logits.clear();
  if (top != nullptr) {
    top->k = static_cast<int>(std::min<int64_t>(k, config_.draft_vocab_size));
    top->ids.clear();
    top->logprobs.clear();
  }
  const ModelConfig& hc = config_.head;
  const int64_t H = hc.hidden_size, Ft = config_.feature_size(), F = hc.intermediate_size;
  const int64_t hd = hc.head_dim, QD = int64_t{hc.num_heads} * hd;
  const int64_t KVD = int64_t{hc.num_kv_heads} * hd, QKVD = QD + 2 * KVD;
  const int64_t dv = config_.draft_vocab_size;
  // The inputs' widths first: PrepareForward checks the rest and changes the table only when
  // the whole batch is good.
  std::vector<ForwardItem> forward(items.size());
  for (size_t b = 0; b < items.size(); ++b) {
    const EagleHeadItem& it = items[b];
    const int64_t width = it.input == EagleInput::kTargetFeatures ? Ft : H;
    const int64_t want = static_cast<int64_t>(it.tokens.size()) * width;
    if (static_cast<int64_t>(it.inputs.size()) != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "items[", b, "].inputs: holds ", it.inputs.size(), " floats, expected ", want, " (",
          it.tokens.size(), " nodes x ", width,
          it.input == EagleInput::kTargetFeatures ? " target-feature" : " hidden", " floats)"));
    }
    forward[b].seq = it.seq;
    forward[b].tokens = it.tokens;
    forward[b].parents = it.parents;
    forward[b].logit_rows = it.output_rows;
  }
  StepLayout layout;
  SPECD_RETURN_IF_ERROR_(table_->PrepareForward(forward, &layout));
  if (items.empty()) return absl::OkStatus();
  SPECD_CUDA_RETURN_(cudaSetDevice(device_), "selecting the device");

  PlanItems plan;
  PlanItemsFromLayout(layout, &plan);
  StepPlanOptions po;
  po.block_tokens = kKvBlockTokens;
  po.hidden = H;
  po.head_dim = hd;
  po.heads = hc.num_heads;
  po.kv_heads = hc.num_kv_heads;
  po.kv_group = hc.num_heads / hc.num_kv_heads;
  po.num_sms = num_sms_;
  CudaStep step;
  StepPacker pack;
  LayoutForward(forward, plan.items, po, &step, &pack);
  const int64_t T = step.T, R = step.R;

  // The inputs ride with the metadata. EAGLE-3: hidden inputs as fp32 rows of a [T, H] array
  // (feature rows left zero, fc overwrites them; none when every item brings features, as a
  // prefill chain does), target features as bf16 rows packed item after item. EAGLE-1/2: every
  // node's input as a bf16 row of a [T, H] array (fc reads it in bf16 whatever its kind).
  bool any_hidden = false;
  for (const EagleHeadItem& it : items) any_hidden |= it.input == EagleInput::kHidden;
  std::vector<float> x_in(eagle3_ && any_hidden ? T * H : 0, 0.0f);
  std::vector<bf16> features(eagle3_ ? 0 : T * H);
  struct FcItem {
    int64_t token = 0, feature_row = 0, rows = 0;
  };
  std::vector<FcItem> fc_items;
  for (size_t b = 0; b < items.size(); ++b) {
    const EagleHeadItem& it = items[b];
    const int64_t n = static_cast<int64_t>(it.tokens.size()), t0 = step.item_token_begin[b];
    if (!eagle3_) {
      for (int64_t i = 0; i < n * H; ++i) features[t0 * H + i] = __float2bfloat16(it.inputs[i]);
    } else if (it.input == EagleInput::kTargetFeatures) {
      fc_items.push_back({t0, static_cast<int64_t>(features.size()) / Ft, n});
      for (float v : it.inputs) features.push_back(__float2bfloat16(v));
    } else {
      std::memcpy(&x_in[t0 * H], it.inputs.data(), sizeof(float) * n * H);
    }
  }
  const size_t o_x = pack.Add(x_in);
  const size_t o_features = pack.Add(features);
  const std::vector<uint8_t>& bytes = pack.bytes();

  SPECD_RETURN_IF_ERROR_(Ensure(&meta_, bytes.size()));
  SPECD_RETURN_IF_ERROR_(Ensure(&residual_, T * H * sizeof(float)));
  SPECD_RETURN_IF_ERROR_(Ensure(&emb_, T * H * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&normed_, T * H * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&cat_, T * 2 * H * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&qkv_out_, T * QKVD * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&attn_, T * QD * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&gate_up_out_, T * 2 * F * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&act_, T * F * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&last_, std::max<int64_t>(R, 1) * H * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&logits_, std::max<int64_t>(R, 1) * dv * sizeof(float)));
  SPECD_RETURN_IF_ERROR_(Ensure(&attn_ws_, step.ws_floats * sizeof(float)));
  void* meta = meta_.ptr;
  // Every step ends with a stream synchronisation (PinnedUploader's condition).
  SPECD_RETURN_IF_ERROR_(uploader_.Upload(bytes, meta, stream_));

  float* residual = static_cast<float*>(residual_.ptr);
  bf16* emb = static_cast<bf16*>(emb_.ptr);
  bf16* normed = static_cast<bf16*>(normed_.ptr);
  bf16* cat = static_cast<bf16*>(cat_.ptr);
  bf16* qkv = static_cast<bf16*>(qkv_out_.ptr);
  bf16* attn = static_cast<bf16*>(attn_.ptr);
  const auto norm = [&](const bf16* x, const float* x32, bool residual_init, const float* weight,
                        bf16* y, bool add_to_stream, const char* what) -> absl::Status {
    cuda::RmsNormParams p;
    if (x32 != nullptr) {
      p.partials = x32;  // one fp32 slab: the row itself
      p.num_partials = 1;
    } else {
      p.x = x;
    }
    p.residual = add_to_stream ? residual : nullptr;
    p.residual_init = residual_init;
    p.weight = weight;
    p.out = y;
    p.rows = T;
    p.dim = H;
    p.eps = hc.rms_norm_eps;
    SPECD_CUDA_RETURN_(cuda::RmsNormCuda(p, stream_), what);
    return absl::OkStatus();
  };
  // Adds x (when given) and `bias` to the stream and rounds the sum to bf16 into `y`.
  const auto add = [&](const bf16* x, const float* bias, bf16* y) -> absl::Status {
    cuda::ResidualAddParams p;
    p.x = x;
    p.residual = residual;
    p.bias = bias;
    p.out = y;
    p.rows = T;
    p.dim = H;
    SPECD_CUDA_RETURN_(cuda::ResidualAddCuda(p, stream_), "residual add");
    return absl::OkStatus();
  };
  // `half` of a [T, 2H] row-pair buffer from [T, H] rows.
  const auto to_cat = [&](int half, const bf16* rows) -> absl::Status {
    SPECD_CUDA_RETURN_(
        cudaMemcpy2DAsync(cat + half * H, 2 * H * sizeof(bf16), rows, H * sizeof(bf16),
                          H * sizeof(bf16), T, cudaMemcpyDeviceToDevice, stream_),
        "assembling a layer input");
    return absl::OkStatus();
  };

  cuda::EmbeddingParams ep;
  ep.tokens = MetaAt<int32_t>(meta, step.o_tokens);
  ep.table = embed_;
  ep.out = emb;
  ep.num_tokens = T;
  ep.vocab_size = config_.vocab_size;
  ep.hidden = H;
  SPECD_CUDA_RETURN_(cuda::EmbeddingCuda(ep, stream_), "embedding");
  if (eagle3_) {
    // The H-wide inputs: hidden rows as given, feature rows fc(features) in fp32. Then
    // input_layernorm(embedding) | hidden_norm(input): the attention's 2H-wide input.
    if (any_hidden) {
      SPECD_CUDA_RETURN_(cudaMemcpyAsync(residual, MetaAt<float>(meta, o_x), T * H * sizeof(float),
                                         cudaMemcpyDeviceToDevice, stream_),
                         "placing hidden inputs");
    }
    for (const FcItem& f : fc_items) {
      SPECD_RETURN_IF_ERROR_(Gemm(MetaAt<bf16>(meta, o_features) + f.feature_row * Ft, fc_, nullptr,
                                  residual + f.token * H, /*y_fp32=*/true, f.rows, H, Ft));
    }
    const Layer& l0 = layers_[0];
    SPECD_RETURN_IF_ERROR_(norm(emb, nullptr, false, l0.input_norm, normed, false, "input norm"));
    SPECD_RETURN_IF_ERROR_(to_cat(0, normed));
    SPECD_RETURN_IF_ERROR_(
        norm(nullptr, residual, false, l0.hidden_norm, normed, false, "hidden norm"));
    SPECD_RETURN_IF_ERROR_(to_cat(1, normed));
    if (config_.norm_before_residual) {
      // The stream starts from hidden_norm(input) (its bf16 rounding) instead of the input.
      SPECD_RETURN_IF_ERROR_(
          norm(normed, nullptr, true, l0.hidden_norm, emb, true, "starting the residual stream"));
    }
  } else {
    // fc(embedding | input) + bias starts the stream in fp32; its bf16 rounding is the first
    // layer's input.
    SPECD_RETURN_IF_ERROR_(to_cat(0, emb));
    SPECD_RETURN_IF_ERROR_(to_cat(1, MetaAt<bf16>(meta, o_features)));
    SPECD_RETURN_IF_ERROR_(Gemm(cat, fc_, nullptr, residual, /*y_fp32=*/true, T, H, 2 * H));
    SPECD_RETURN_IF_ERROR_(add(nullptr, fc_bias_, emb));
  }

  // The layers. `emb` ends each holding its MLP output, which the next layer's input norm (or,
  // after the last, the final norm or the residual add) adds to the stream.
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& w = layers_[l];
    const bf16* in = cat;  // EAGLE-3: the 2H-wide pair
    if (!eagle3_ && w.input_norm != nullptr) {
      SPECD_RETURN_IF_ERROR_(norm(emb, nullptr, false, w.input_norm, normed, true, "input norm"));
      in = normed;
    } else if (!eagle3_) {
      in = emb;  // the first layer reads fc's output as it is
    }
    SPECD_RETURN_IF_ERROR_(Gemm(in, w.qkv, nullptr, qkv, false, T, QKVD, eagle3_ ? 2 * H : H));
    AttentionLaunch a;
    a.heads = hc.num_heads;
    a.kv_heads = hc.num_kv_heads;
    a.kv_group = hc.num_heads / hc.num_kv_heads;
    a.head_dim = hd;
    a.inv_freq = inv_freq_;
    a.k_cache = kv_.k + static_cast<int64_t>(l) * kv_.layer_stride;
    a.v_cache = kv_.v + static_cast<int64_t>(l) * kv_.layer_stride;
    a.workspace = static_cast<float*>(attn_ws_.ptr);
    SPECD_RETURN_IF_ERROR_(EnqueueStepAttention(step, meta, qkv, attn, a, stream_));
    // Stream += o_proj(attention); MLP of its norm.
    SPECD_RETURN_IF_ERROR_(Gemm(attn, w.o_proj, nullptr, emb, false, T, H, QD));
    SPECD_RETURN_IF_ERROR_(norm(emb, nullptr, false, w.post_norm, normed, true, "post norm"));
    SPECD_RETURN_IF_ERROR_(
        Gemm(normed, w.gate_up, nullptr, static_cast<bf16*>(gate_up_out_.ptr), false, T, 2 * F, H));
    cuda::SwiGluParams sw;
    sw.gate_up = static_cast<const bf16*>(gate_up_out_.ptr);
    sw.out = static_cast<bf16*>(act_.ptr);
    sw.rows = T;
    sw.dim = F;
    SPECD_CUDA_RETURN_(cuda::SwiGluCuda(sw, stream_), "SwiGLU");
    SPECD_RETURN_IF_ERROR_(
        Gemm(static_cast<const bf16*>(act_.ptr), w.down, nullptr, emb, false, T, H, F));
  }
  // Stream += MLP: the layer output. The LM head reads its norm (EAGLE-3) or itself (EAGLE-1/2).
  if (eagle3_) {
    SPECD_RETURN_IF_ERROR_(norm(emb, nullptr, false, final_norm_, normed, true, "final norm"));
  } else {
    SPECD_RETURN_IF_ERROR_(add(emb, nullptr, normed));
  }

  out->hidden.resize(R * H);
  if (top == nullptr) out->logits.resize(R * dv);
  if (R > 0) {
    SPECD_RETURN_IF_ERROR_(
        EnqueueGatherRows(step, meta, normed, H, static_cast<bf16*>(last_.ptr), stream_));
    SPECD_RETURN_IF_ERROR_(
        Gemm(static_cast<bf16*>(last_.ptr), lm_head_, nullptr, logits_.ptr, true, R, dv, H));
    if (top == nullptr) {
      SPECD_CUDA_RETURN_(cudaMemcpyAsync(out->logits.data(), logits_.ptr, R * dv * sizeof(float),
                                         cudaMemcpyDeviceToHost, stream_),
                         "copying eagle head logits");
    } else {
      // Only [R, k] ids and log-probabilities come back, rows in the step's order.
      const int64_t kk = top->k;
      // Then the top-k kernel's split-path scratch (a level's few rows over the target's
      // vocabulary: one CTA a row would leave most SMs idle), 16-byte aligned.
      const size_t ws_offset = (R * kk * (sizeof(int32_t) + sizeof(float)) + 15) / 16 * 16;
      const int64_t ws_bytes = cuda::TopKWorkspaceBytes(R, dv, static_cast<int>(kk));
      SPECD_RETURN_IF_ERROR_(Ensure(&topk_, ws_offset + static_cast<size_t>(ws_bytes)));
      cuda::TopKLogprobsParams p;
      p.workspace = static_cast<char*>(topk_.ptr) + ws_offset;
      p.workspace_bytes = ws_bytes;
      p.logits = static_cast<const float*>(logits_.ptr);
      p.logits_stride = dv;
      p.num_rows = R;
      p.vocab_size = dv;
      p.k = static_cast<int>(kk);
      p.ids = static_cast<int32_t*>(topk_.ptr);
      p.logprobs = reinterpret_cast<float*>(p.ids + R * kk);
      SPECD_CUDA_RETURN_(cuda::TopKLogprobsCuda(p, stream_), "top-k launch");
      top->ids.resize(R * kk);
      top->logprobs.resize(R * kk);
      SPECD_CUDA_RETURN_(cudaMemcpyAsync(top->ids.data(), p.ids, R * kk * sizeof(int32_t),
                                         cudaMemcpyDeviceToHost, stream_),
                         "copying eagle head top-k ids");
      SPECD_CUDA_RETURN_(cudaMemcpyAsync(top->logprobs.data(), p.logprobs, R * kk * sizeof(float),
                                         cudaMemcpyDeviceToHost, stream_),
                         "copying eagle head top-k log-probabilities");
    }
    // The layer outputs of the requested rows (the stream before the final norm).
    int64_t r = 0;
    for (size_t b = 0; b < items.size(); ++b) {
      for (int32_t row : items[b].output_rows) {
        SPECD_CUDA_RETURN_(
            cudaMemcpyAsync(&out->hidden[r * H], residual + (step.item_token_begin[b] + row) * H,
                            H * sizeof(float), cudaMemcpyDeviceToHost, stream_),
            "copying eagle head outputs");
        ++r;
      }
    }
  }
  SPECD_CUDA_RETURN_(cudaStreamSynchronize(stream_), "eagle head step");
  return absl::OkStatus();
}

absl::Status EagleHeadCuda::Commit(SeqId seq, absl::Span<const int32_t> path) {
  std::vector<int64_t> src, dst;
  SPECD_RETURN_IF_ERROR_(table_->PrepareCommit(seq, path, &src, &dst));
  if (src.empty()) return absl::OkStatus();
  SPECD_CUDA_RETURN_(cudaSetDevice(device_), "selecting the device");
  const int64_t n = static_cast<int64_t>(src.size());
  SPECD_RETURN_IF_ERROR_(Ensure(&slots_, 2 * n * sizeof(int64_t)));
  int64_t* slots = static_cast<int64_t*>(slots_.ptr);
  std::vector<int64_t> both = src;
  both.insert(both.end(), dst.begin(), dst.end());
  SPECD_CUDA_RETURN_(cudaMemcpyAsync(slots, both.data(), both.size() * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, stream_),
                     "uploading KV slot copies");
  cuda::KvCacheCopyParams p;
  p.k_cache = kv_.k;
  p.v_cache = kv_.v;
  p.num_layers = static_cast<int>(layers_.size());
  p.kv_dim = int64_t{config_.head.num_kv_heads} * config_.head.head_dim;
  p.layer_stride = kv_.layer_stride;
  p.src_slots = slots;
  p.dst_slots = slots + n;
  p.num_copies = n;
  // No synchronisation: a copy from pageable memory has left `both` when cudaMemcpyAsync
  // returns, and the next step runs after the copy kernel on the same stream.
  SPECD_CUDA_RETURN_(cuda::KvCacheCopyCuda(p, stream_), "KV copy");
  return absl::OkStatus();
}

}  // namespace specd
