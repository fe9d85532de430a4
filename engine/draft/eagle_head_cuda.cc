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
#include "specd/kernels/cuda/rope.h"
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

template <typename T>
T* At(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(base) + offset);
}

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
  if (config.kind != EagleKind::kEagle3) {
    return absl::UnimplementedError(
        "device: EAGLE-1/2 heads run on the cpu only; the CUDA head is EAGLE-3's");
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
  if (weights.layers.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda eagle head: an EAGLE-3 head has one decoder layer, got ", weights.layers.size()));
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
    : config_(std::move(config)), device_(device), context_length_(context_length) {}

EagleHeadCuda::~EagleHeadCuda() {
  if (cudaSetDevice(device_) != cudaSuccess) return;
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  gemm_.reset();
  for (Scratch* s : {&meta_, &features_, &residual_, &emb_, &normed_, &cat_, &qkv_out_, &attn_,
                     &gate_up_out_, &act_, &last_, &logits_, &attn_ws_, &slots_, &topk_}) {
    if (s->ptr != nullptr) cudaFree(s->ptr);
  }
  for (void* p : allocations_) cudaFree(p);
  if (host_stage_ != nullptr) cudaFreeHost(host_stage_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::StatusOr<float*> EagleHeadCuda::UploadF32(const std::vector<float>& host) {
  void* p = nullptr;
  SPECD_CUDA_RETURN_(cudaMalloc(&p, std::max<size_t>(host.size(), 1) * sizeof(float)),
                     "allocating eagle head weights");
  allocations_.push_back(p);
  SPECD_CUDA_RETURN_(
      cudaMemcpy(p, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
      "uploading eagle head weights");
  return static_cast<float*>(p);
}

absl::StatusOr<EagleHeadCuda::bf16*> EagleHeadCuda::UploadBf16(const std::vector<float>& host) {
  std::vector<bf16> converted(host.size());
  for (size_t i = 0; i < host.size(); ++i) converted[i] = __float2bfloat16(host[i]);
  void* p = nullptr;
  SPECD_CUDA_RETURN_(cudaMalloc(&p, std::max<size_t>(host.size(), 1) * sizeof(bf16)),
                     "allocating eagle head weights");
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
  const EagleHeadWeights::Layer& l = w.layers[0];
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
  SPECD_RETURN_IF_ERROR_(f32_of(l.input_norm, &input_norm_));
  SPECD_RETURN_IF_ERROR_(f32_of(l.hidden_norm, &hidden_norm_));
  SPECD_RETURN_IF_ERROR_(f32_of(l.post_norm, &post_norm_));
  SPECD_RETURN_IF_ERROR_(f32_of(w.norm, &final_norm_));
  SPECD_RETURN_IF_ERROR_(bf16_of(stacked({&l.q_proj, &l.k_proj, &l.v_proj}), &qkv_));
  SPECD_RETURN_IF_ERROR_(bf16_of(l.o_proj, &o_proj_));
  SPECD_RETURN_IF_ERROR_(bf16_of(stacked({&l.gate_proj, &l.up_proj}), &gate_up_));
  SPECD_RETURN_IF_ERROR_(bf16_of(l.down_proj, &down_));
  SPECD_RETURN_IF_ERROR_(bf16_of(w.lm_head, &lm_head_));
  SPECD_RETURN_IF_ERROR_(f32_of(RopeInvFreq(config_.head), &inv_freq_));

  // KV pools: the requested capacity, or what the free memory allows.
  const ModelConfig& h = config_.head;
  const int64_t kv_dim = int64_t{h.num_kv_heads} * h.head_dim;
  size_t free_bytes = 0, total_bytes = 0;
  SPECD_CUDA_RETURN_(cudaMemGetInfo(&free_bytes, &total_bytes), "reading free memory");
  const size_t block_bytes = size_t{2} * kKvBlockTokens * kv_dim * sizeof(bf16);
  const int64_t fit = free_bytes > kReserveBytes
                          ? static_cast<int64_t>((free_bytes - kReserveBytes) / block_bytes)
                          : 0;
  num_blocks_ =
      std::min<int64_t>((options.kv_capacity_tokens + kKvBlockTokens - 1) / kKvBlockTokens, fit);
  if (num_blocks_ <= 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda:", device_, ": no device memory left for the eagle head's KV cache (",
                     free_bytes >> 20, " MiB free)"));
  }
  const size_t pool_bytes = static_cast<size_t>(num_blocks_) * kKvBlockTokens * kv_dim * 2;
  for (bf16** pool : {&k_pool_, &v_pool_}) {
    void* p = nullptr;
    SPECD_CUDA_RETURN_(cudaMalloc(&p, pool_bytes), "allocating the eagle head's KV cache");
    allocations_.push_back(p);
    // Zeros, so that no slot holds NaN bit patterns (a masked key's value is multiplied by a
    // zero probability, which would not cancel a NaN).
    SPECD_CUDA_RETURN_(cudaMemset(p, 0, pool_bytes), "clearing the eagle head's KV cache");
    *pool = static_cast<bf16*>(p);
  }
  SPECD_CUDA_RETURN_(cudaDeviceSynchronize(), "initialising the eagle head");
  table_ = std::make_unique<PagedKvTable>(kKvBlockTokens, num_blocks_ * kKvBlockTokens,
                                          config_.vocab_size, context_length_);
  table_->AllocateUpFront();
  table_->SetMaskBits(cuda::kTreeAttentionMaskBits);
  return absl::OkStatus();
}

absl::Status EagleHeadCuda::Ensure(Scratch* s, size_t bytes) {
  if (s->bytes >= bytes) return absl::OkStatus();
  if (s->ptr != nullptr) {
    // Work queued on the stream may still read the old buffer.
    SPECD_CUDA_RETURN_(cudaStreamSynchronize(stream_), "synchronizing");
    cudaFree(s->ptr);
    s->ptr = nullptr;
    s->bytes = 0;
  }
  const size_t grown = std::max<size_t>(bytes + bytes / 4, 4096);
  SPECD_CUDA_RETURN_(cudaMalloc(&s->ptr, grown), absl::StrCat("allocating ", grown, " bytes"));
  s->bytes = grown;
  return absl::OkStatus();
}

absl::Status EagleHeadCuda::Gemm(const bf16* x, const bf16* w, void* y, bool y_fp32, int64_t m,
                                 int64_t n, int64_t k) {
  if (m == 0) return absl::OkStatus();
  cuda::GemmParams p;
  p.x = x;
  p.w = w;
  p.y = y;
  p.y_fp32 = y_fp32;
  p.m = m;
  p.n = n;
  p.k = k;
  if (cublasStatus_t st = gemm_->Run(p, stream_); st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuda eagle head: GEMM [", m, ", ", k, "] x [", n, ", ",
                                            k, "]^T: ", cublasLtGetStatusString(st)));
  }
  return absl::OkStatus();
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

  // The inputs ride with the metadata: hidden inputs as fp32 rows of a [T, H] array (feature
  // rows left zero, fc overwrites them; none when every item brings features, as a prefill
  // chain does), target features as bf16 rows packed item after item.
  bool any_hidden = false;
  for (const EagleHeadItem& it : items) any_hidden |= it.input == EagleInput::kHidden;
  std::vector<float> x_in(any_hidden ? T * H : 0, 0.0f);
  std::vector<bf16> features;
  struct FcItem {
    int64_t token = 0, feature_row = 0, rows = 0;
  };
  std::vector<FcItem> fc_items;
  for (size_t b = 0; b < items.size(); ++b) {
    const EagleHeadItem& it = items[b];
    const int64_t n = static_cast<int64_t>(it.tokens.size()), t0 = step.item_token_begin[b];
    if (it.input == EagleInput::kTargetFeatures) {
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
  if (host_stage_bytes_ < bytes.size()) {
    // The previous step's upload finished: every step ends with a stream synchronisation.
    if (host_stage_ != nullptr) cudaFreeHost(host_stage_);
    host_stage_ = nullptr;
    host_stage_bytes_ = 0;
    const size_t grown = std::max<size_t>(bytes.size() + bytes.size() / 4, 1 << 16);
    SPECD_CUDA_RETURN_(cudaMallocHost(&host_stage_, grown), "allocating pinned staging memory");
    host_stage_bytes_ = grown;
  }
  std::memcpy(host_stage_, bytes.data(), bytes.size());
  void* meta = meta_.ptr;
  SPECD_CUDA_RETURN_(
      cudaMemcpyAsync(meta, host_stage_, bytes.size(), cudaMemcpyHostToDevice, stream_),
      "uploading the eagle head's step");

  float* residual = static_cast<float*>(residual_.ptr);
  bf16* emb = static_cast<bf16*>(emb_.ptr);
  bf16* normed = static_cast<bf16*>(normed_.ptr);
  bf16* cat = static_cast<bf16*>(cat_.ptr);
  bf16* qkv = static_cast<bf16*>(qkv_out_.ptr);
  bf16* attn = static_cast<bf16*>(attn_.ptr);
  // The H-wide inputs: hidden rows as given, feature rows fc(features) in fp32.
  if (any_hidden) {
    SPECD_CUDA_RETURN_(cudaMemcpyAsync(residual, At<float>(meta, o_x), T * H * sizeof(float),
                                       cudaMemcpyDeviceToDevice, stream_),
                       "placing hidden inputs");
  }
  for (const FcItem& f : fc_items) {
    SPECD_RETURN_IF_ERROR_(Gemm(At<bf16>(meta, o_features) + f.feature_row * Ft, fc_,
                                residual + f.token * H, /*y_fp32=*/true, f.rows, H, Ft));
  }

  // input_layernorm(embedding) | hidden_norm(input): the attention's 2H-wide input.
  cuda::EmbeddingParams ep;
  ep.tokens = At<int32_t>(meta, step.o_tokens);
  ep.table = embed_;
  ep.out = emb;
  ep.num_tokens = T;
  ep.vocab_size = config_.vocab_size;
  ep.hidden = H;
  SPECD_CUDA_RETURN_(cuda::EmbeddingCuda(ep, stream_), "embedding");
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
  const auto to_cat = [&](int half) -> absl::Status {
    SPECD_CUDA_RETURN_(
        cudaMemcpy2DAsync(cat + half * H, 2 * H * sizeof(bf16), normed, H * sizeof(bf16),
                          H * sizeof(bf16), T, cudaMemcpyDeviceToDevice, stream_),
        "assembling the attention input");
    return absl::OkStatus();
  };
  SPECD_RETURN_IF_ERROR_(norm(emb, nullptr, false, input_norm_, normed, false, "input norm"));
  SPECD_RETURN_IF_ERROR_(to_cat(0));
  SPECD_RETURN_IF_ERROR_(
      norm(nullptr, residual, false, hidden_norm_, normed, false, "hidden norm"));
  SPECD_RETURN_IF_ERROR_(to_cat(1));
  if (config_.norm_before_residual) {
    // The stream starts from hidden_norm(input) (its bf16 rounding) instead of the input.
    SPECD_RETURN_IF_ERROR_(
        norm(normed, nullptr, true, hidden_norm_, emb, true, "starting the residual stream"));
  }

  SPECD_RETURN_IF_ERROR_(Gemm(cat, qkv_, qkv, false, T, QKVD, 2 * H));
  cuda::RopeParams rope;
  rope.q = qkv;
  rope.q_stride = QKVD;
  rope.num_q_heads = hc.num_heads;
  rope.k = qkv + QD;
  rope.k_stride = QKVD;
  rope.num_k_heads = hc.num_kv_heads;
  rope.positions = At<int32_t>(meta, step.o_positions);
  rope.inv_freq = inv_freq_;
  rope.num_tokens = T;
  rope.head_dim = hd;
  rope.v = qkv + QD + KVD;
  rope.v_stride = QKVD;
  rope.k_cache = k_pool_;
  rope.v_cache = v_pool_;
  rope.slots = At<int64_t>(meta, step.o_slots);
  SPECD_CUDA_RETURN_(cuda::RopeCuda(rope, stream_), "RoPE and KV write");

  cuda::TreeAttentionParams ap;
  ap.q = qkv;
  ap.q_stride = QKVD;
  ap.out = attn;
  ap.out_stride = QD;
  ap.kv.k_cache = k_pool_;
  ap.kv.v_cache = v_pool_;
  ap.kv.block_tables = At<int32_t>(meta, step.o_tables);
  ap.kv.max_blocks_per_seq = step.max_blocks;
  ap.kv.block_size = kKvBlockTokens;
  ap.query_seq = At<int32_t>(meta, step.o_query_seq);
  ap.kv_end = At<int32_t>(meta, step.o_kv_end);
  ap.mask_begin = step.tree_masks ? At<int32_t>(meta, step.o_mask_begin) : nullptr;
  ap.mask = step.tree_masks ? At<uint32_t>(meta, step.o_mask) : nullptr;
  ap.tile_begin = At<int32_t>(meta, step.o_tile_begin);
  ap.tile_end = At<int32_t>(meta, step.o_tile_end);
  ap.kv_stable_end = At<int32_t>(meta, step.o_kv_stable);
  ap.num_tiles = step.num_tiles;
  ap.num_splits = step.num_splits;
  ap.chunks_per_cta = step.chunks_per_cta;
  ap.workspace = static_cast<float*>(attn_ws_.ptr);
  ap.num_queries = T;
  ap.num_heads = hc.num_heads;
  ap.num_kv_heads = hc.num_kv_heads;
  ap.kv_group = hc.num_heads / hc.num_kv_heads;
  ap.head_dim = hd;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(hd));
  SPECD_CUDA_RETURN_(cuda::TreeAttentionCuda(ap, stream_), "attention");

  // Stream += o_proj(attention); MLP of its norm; stream += MLP, and the final norm of it.
  SPECD_RETURN_IF_ERROR_(Gemm(attn, o_proj_, emb, false, T, H, QD));
  SPECD_RETURN_IF_ERROR_(norm(emb, nullptr, false, post_norm_, normed, true, "post norm"));
  SPECD_RETURN_IF_ERROR_(
      Gemm(normed, gate_up_, static_cast<bf16*>(gate_up_out_.ptr), false, T, 2 * F, H));
  cuda::SwiGluParams sw;
  sw.gate_up = static_cast<const bf16*>(gate_up_out_.ptr);
  sw.out = static_cast<bf16*>(act_.ptr);
  sw.rows = T;
  sw.dim = F;
  SPECD_CUDA_RETURN_(cuda::SwiGluCuda(sw, stream_), "SwiGLU");
  SPECD_RETURN_IF_ERROR_(Gemm(static_cast<const bf16*>(act_.ptr), down_, emb, false, T, H, F));
  SPECD_RETURN_IF_ERROR_(norm(emb, nullptr, false, final_norm_, normed, true, "final norm"));

  out->hidden.resize(R * H);
  if (top == nullptr) out->logits.resize(R * dv);
  if (R > 0) {
    cuda::EmbeddingParams gather;  // a row gather: the "table" is the normed outputs
    gather.tokens = At<int32_t>(meta, step.o_rows);
    gather.table = normed;
    gather.out = static_cast<bf16*>(last_.ptr);
    gather.num_tokens = R;
    gather.vocab_size = T;
    gather.hidden = H;
    SPECD_CUDA_RETURN_(cuda::EmbeddingCuda(gather, stream_), "gathering output rows");
    SPECD_RETURN_IF_ERROR_(
        Gemm(static_cast<bf16*>(last_.ptr), lm_head_, logits_.ptr, true, R, dv, H));
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
  p.k_cache = k_pool_;
  p.v_cache = v_pool_;
  p.num_layers = 1;
  p.kv_dim = int64_t{config_.head.num_kv_heads} * config_.head.head_dim;
  p.layer_stride = num_blocks_ * kKvBlockTokens * p.kv_dim;
  p.src_slots = slots;
  p.dst_slots = slots + n;
  p.num_copies = n;
  // No synchronisation: a copy from pageable memory has left `both` when cudaMemcpyAsync
  // returns, and the next step runs after the copy kernel on the same stream.
  SPECD_CUDA_RETURN_(cuda::KvCacheCopyCuda(p, stream_), "KV copy");
  return absl::OkStatus();
}

}  // namespace specd
