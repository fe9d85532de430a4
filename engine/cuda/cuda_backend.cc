#include "engine/cuda/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/io/load_progress.h"
#include "common/io/safetensors.h"
#include "common/token_tree.h"
#include "engine/sampling.h"
#include "engine/tree_mask.h"
#include "engine/tp/weight_shard.h"
#include "engine/cuda/custom_allreduce.h"
#include "engine/cuda/nccl_group.h"
#include "specd/kernels/cuda/allreduce.h"
#include "specd/kernels/cuda/embedding.h"
#include "specd/kernels/cuda/kv_cache.h"
#include "specd/kernels/cuda/rmsnorm.h"
#include "specd/kernels/cuda/rope.h"
#include "specd/kernels/cuda/sampling.h"
#include "specd/kernels/cuda/swiglu.h"
#include "specd/kernels/cuda/topk.h"
#include "specd/kernels/cuda/tree_accept.h"
#include "specd/kernels/cuda/tree_attention.h"

namespace specd {
namespace {

#define SPECD_RETURN_IF_ERROR_(expr)                                           \
  do {                                                                         \
    absl::Status _s = (expr);                                                  \
    if (!_s.ok())                                                              \
      return _s;                                                               \
  } while (0)

#define SPECD_CUDA_RETURN_(expr, what)                                         \
  do {                                                                         \
    const cudaError_t _e = (expr);                                             \
    if (_e != cudaSuccess) {                                                   \
      return absl::InternalError(absl::StrCat("cuda backend: ", what, ": ",    \
                                              cudaGetErrorName(_e), " (",      \
                                              cudaGetErrorString(_e), ")"));   \
    }                                                                          \
  } while (0)

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The device memory the KV pools leave free for activations, cuBLASLt and the
// split-KV workspace.
constexpr size_t kReserveBytes = size_t{2} << 30;

constexpr int64_t kGraphMaxBatch = 64;
constexpr int64_t kGraphMaxTreeTokens = 256;

int64_t NextPow2(int64_t n) {
  int64_t p = 1;
  while (p < n)
    p *= 2;
  return p;
}

// Token slots per sequence: 1 for a decode step; else the pending token plus a
// tree rounded up to a power of two (2, 3, 5, 9, ..., 257).
int64_t TokenBucket(int64_t n) { return n <= 1 ? 1 : 1 + NextPow2(n - 1); }

template <typename T> T *At(void *base, size_t offset) {
  return reinterpret_cast<T *>(static_cast<uint8_t *>(base) + offset);
}

std::vector<__nv_bfloat16> ToBf16(const std::vector<float> &v) {
  std::vector<__nv_bfloat16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i)
    out[i] = __float2bfloat16(v[i]);
  return out;
}

// All-reduce sites of a step (specd/kernels/cuda/allreduce.h): the embedding,
// then each layer's attention and MLP. Consecutive all-reduces never share a
// site (..., attn, mlp, | embed, attn, ...), which is what lets the one-shot
// kernel skip its end barrier; CudaBackend::kAllReduceSites in all, whatever
// the depth.
constexpr int kEmbedSite = 2;
constexpr int kAttnSite = 0;
constexpr int kMlpSite = 1;
static_assert(kEmbedSite < CudaBackend::kAllReduceSites &&
              kAttnSite < CudaBackend::kAllReduceSites &&
              kMlpSite < CudaBackend::kAllReduceSites);

} // namespace

// A step's metadata goes to the device in a single copy.
class CudaBackend::Packer {
public:
  template <typename T> size_t Add(const T *data, size_t n) {
    const size_t offset = (bytes_.size() + 15) / 16 * 16;
    bytes_.resize(offset + n * sizeof(T));
    if (n > 0)
      std::memcpy(bytes_.data() + offset, data, n * sizeof(T));
    return offset;
  }
  template <typename T> size_t Add(const std::vector<T> &v) {
    return Add(v.data(), v.size());
  }
  const std::vector<uint8_t> &bytes() const { return bytes_; }

private:
  std::vector<uint8_t> bytes_;
};

absl::StatusOr<std::unique_ptr<CudaBackend>>
CudaBackend::Create(const std::string &dir, int device,
                    const BackendOptions &options, const CudaTpRank *tp,
                    const CudaTuning *tuning) {
  if (options.kv_capacity_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_capacity_tokens must be positive, got ",
                     options.kv_capacity_tokens));
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess)
    count = 0;
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device cuda:", device, " is not available: this machine has ", count,
        " CUDA device", count == 1 ? "" : "s"));
  }
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  if (!config.ok())
    return config.status();
  // 16, 32, 64 and 128 take the tensor-core attention kernel, other even sizes
  // up to kTreeAttentionMaxHeadDim a generic (slower) one.
  if (!cuda::TreeAttentionHeadDimSupported(config->head_dim)) {
    return absl::UnimplementedError(absl::StrCat(
        "cuda backend: head_dim ", config->head_dim,
        " is not supported (even, at most ", cuda::kTreeAttentionMaxHeadDim,
        ")"));
  }
  if (config->num_kv_heads <= 0 ||
      config->num_heads % config->num_kv_heads != 0 ||
      config->num_heads / config->num_kv_heads > cuda::kTreeAttentionTileRows) {
    return absl::UnimplementedError(absl::StrCat(
        "cuda backend: ", config->num_heads, " query heads over ",
        config->num_kv_heads, " KV heads is not supported (at most ",
        cuda::kTreeAttentionTileRows, " per KV head)"));
  }
  if (tp != nullptr) {
    const TpPlan *plan = tp->plan;
    if (plan == nullptr || tp->rank < 0 || tp->rank >= plan->world_size) {
      return absl::InvalidArgumentError("cuda backend: tensor-parallel rank "
                                        "without a plan, or out of range");
    }
    if (plan->world_size > 1 && tp->nccl == nullptr) {
      return absl::InvalidArgumentError(
          "cuda backend: tensor parallelism needs an NCCL group");
    }
    for (int r = 0; r < plan->world_size; ++r) {
      const TpRankPlan &rp = plan->ranks[r];
      if (rp.q_heads.empty() || rp.ffn.empty() || rp.vocab.empty()) {
        return absl::UnimplementedError(absl::StrCat(
            "tensor_parallel: ", plan->world_size, " ranks leave rank ", r,
            " without query heads, FFN columns or vocabulary rows (",
            config->num_heads, " heads, ", config->intermediate_size,
            " FFN columns); the CUDA backend needs every rank to own some"));
      }
    }
  }
  const CudaTuning parsed =
      tuning != nullptr ? *tuning : CudaTuningFromEnvironment();
  cuda::SetLaunchTuning(parsed.launch);
  std::unique_ptr<CudaBackend> backend(
      new CudaBackend(*std::move(config), device, options, tp, parsed));
  SPECD_RETURN_IF_ERROR_(backend->Init());
  return backend;
}

CudaBackend::CudaBackend(ModelConfig config, int device,
                         const BackendOptions &options, const CudaTpRank *tp,
                         const CudaTuning &tuning)
    : config_(std::move(config)), device_(device), options_(options),
      tuning_(tuning) {
  if (tp != nullptr && tp->plan->world_size > 1) {
    tp_ = *tp;
    world_ = tp->plan->world_size;
    slice_ = tp->plan->ranks[tp->rank];
  } else {
    slice_ = FullModelSlice(config_);
  }
  heads_ = slice_.q_heads.size();
  kv_heads_ = slice_.kv_heads.size();
  ffn_ = slice_.ffn.size();
  vocab_rows_ = slice_.vocab.size();
  vocab_rows_max_ = vocab_rows_;
  if (world_ > 1) {
    for (const TpRankPlan &rp : tp_.plan->ranks)
      vocab_rows_max_ = std::max(vocab_rows_max_, rp.vocab.size());
  }
  kv_dim_ = kv_heads_ * config_.head_dim;
  graphs_enabled_ = options_.cuda_graphs && tuning_.cuda_graphs;
  l2_discard_ = tuning_.l2_discard;
  l2_discard_min_tokens_ = tuning_.l2_discard_min_tokens;
  if (world_ == 1)
    residual_splits_ = tuning_.residual_splits;
}

bool CudaBackend::DropDead(const Step &step) const {
  return l2_discard_ && step.T >= l2_discard_min_tokens_;
}

int CudaBackend::SiteSplits(int site) const {
  // The depth of the site's GEMM: o_proj reads the attention output, down_proj
  // the MLP's activations; the embedding has no GEMM.
  const int64_t k = site == kAttnSite  ? heads_ * config_.head_dim
                    : site == kMlpSite ? ffn_
                                       : 0;
  return k > 0 && residual_splits_ > 1 &&
                 cuda::Gemm::KSplitFits(k, residual_splits_)
             ? residual_splits_
             : 1;
}

CudaBackend::~CudaBackend() {
  if (cudaSetDevice(device_) != cudaSuccess)
    return;
  if (stream_ != nullptr)
    cudaStreamSynchronize(stream_);
  // The GEMM algorithms this process ended up with, per weight shape and row
  // class (benchmark runs: which cuBLASLt kernel a step's time went to).
  if (gemm_ != nullptr && tuning_.gemm_summary)
    std::fprintf(stderr, "GEMM picks, device %d:\n%s", device_,
                 gemm_->Summary().c_str());
  ClearGraphs();
  if (host_stage_ != nullptr)
    cudaFreeHost(host_stage_);
  if (host_out_ != nullptr)
    cudaFreeHost(host_out_);
  for (cudaEvent_t e : phase_events_) {
    if (e != nullptr)
      cudaEventDestroy(e);
  }
  gemm_.reset();
  for (Scratch *s : {&meta_, &residual_, &x_, &normed_, &qkv_, &attn_,
                     &gate_up_, &act_, &last_, &logits_, &attn_ws_, &sample_ws_, &verify_,
                     &cand_local_, &cand_all_, &gathered_, &full_logits_}) {
    if (s->ptr != nullptr)
      cudaFree(s->ptr);
  }
  for (void *p : allocations_)
    cudaFree(p);
  if (stream_ != nullptr)
    cudaStreamDestroy(stream_);
}

absl::Status CudaBackend::UploadWeights(const TensorStore &st,
                                        const std::vector<WeightPart> &parts,
                                        bf16 **out) {
  // Elements of each part, after checking its full shape.
  std::vector<const TensorView *> views;
  std::vector<int64_t> sizes;
  int64_t total = 0;
  for (const WeightPart &part : parts) {
    absl::StatusOr<const TensorView *> view =
        GetShardTensor(st, part.name, part.shape);
    if (!view.ok())
      return view.status();
    SPECD_RETURN_IF_ERROR_(
        CheckShardRange(part.name, part.shape, part.slice, part.range));
    const int64_t n = ShardElements(part.shape, part.slice, part.range);
    views.push_back(*view);
    sizes.push_back(n);
    total += n;
  }
  void *p = nullptr;
  SPECD_CUDA_RETURN_(
      cudaMalloc(&p, std::max<int64_t>(1, total) * sizeof(bf16)),
      "allocating weights");
  allocations_.push_back(p);
  bf16 *dst = static_cast<bf16 *>(p);
  for (size_t i = 0; i < parts.size(); ++i) {
    const WeightPart &part = parts[i];
    const TensorView &view = *views[i];
    const int64_t row = part.shape.size() > 1 ? part.shape[1] : 1;
    if (view.dtype == DType::kBF16) {
      // bf16 checkpoints go straight from the mapping to the device: no fp32
      // round trip (what makes an 8B model load in seconds).
      if (part.slice == ShardSlice::kCols) {
        const size_t width = part.range.size() * sizeof(bf16);
        SPECD_CUDA_RETURN_(
            cudaMemcpy2D(dst, width, view.data + part.range.begin * sizeof(bf16),
                         row * sizeof(bf16), width, part.shape[0],
                         cudaMemcpyHostToDevice),
            "uploading weights");
      } else {
        const int64_t first =
            part.slice == ShardSlice::kRows ? part.range.begin * row : 0;
        SPECD_CUDA_RETURN_(cudaMemcpy(dst, view.data + first * sizeof(bf16),
                                      sizes[i] * sizeof(bf16),
                                      cudaMemcpyHostToDevice),
                           "uploading weights");
      }
    } else {
      std::vector<float> buf;
      SPECD_RETURN_IF_ERROR_(
          ReadShard(st, part.name, part.shape, part.slice, part.range, &buf));
      const std::vector<bf16> h = ToBf16(buf);
      SPECD_CUDA_RETURN_(cudaMemcpy(dst, h.data(), h.size() * sizeof(bf16),
                                    cudaMemcpyHostToDevice),
                         "uploading weights");
    }
    dst += sizes[i];
    if (load_progress_ != nullptr)
      load_progress_->Add(sizes[i] * static_cast<int64_t>(sizeof(bf16)));
  }
  *out = static_cast<bf16 *>(p);
  return absl::OkStatus();
}

absl::Status CudaBackend::UploadFp32(const TensorStore &st,
                                     const std::string &name, int64_t size,
                                     float **out) {
  std::vector<float> buf;
  SPECD_RETURN_IF_ERROR_(
      ReadShard(st, name, {size}, ShardSlice::kAll, TpRange{}, &buf));
  void *p = nullptr;
  SPECD_CUDA_RETURN_(
      cudaMalloc(&p, std::max<size_t>(1, buf.size()) * sizeof(float)),
      "allocating weights");
  allocations_.push_back(p);
  SPECD_CUDA_RETURN_(cudaMemcpy(p, buf.data(), buf.size() * sizeof(float),
                                cudaMemcpyHostToDevice),
                     "uploading weights");
  if (load_progress_ != nullptr)
    load_progress_->Add(static_cast<int64_t>(buf.size() * sizeof(float)));
  *out = static_cast<float *>(p);
  return absl::OkStatus();
}

absl::Status CudaBackend::Ensure(Scratch *s, size_t bytes) {
  if (s->bytes >= bytes)
    return absl::OkStatus();
  if (s->ptr != nullptr) {
    // Work queued on the stream may still read the old buffer.
    SPECD_CUDA_RETURN_(cudaStreamSynchronize(stream_), "synchronizing");
    cudaFree(s->ptr);
    s->ptr = nullptr;
    s->bytes = 0;
  }
  const size_t grown = std::max<size_t>(bytes + bytes / 4, 4096);
  SPECD_CUDA_RETURN_(cudaMalloc(&s->ptr, grown),
                     absl::StrCat("allocating ", grown, " bytes"));
  s->bytes = grown;
  ++buffer_generation_;
  return absl::OkStatus();
}

absl::Status CudaBackend::Init() {
  SPECD_CUDA_RETURN_(cudaSetDevice(device_),
                     absl::StrCat("selecting cuda:", device_));
  SPECD_CUDA_RETURN_(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                     "creating a stream");
  SPECD_CUDA_RETURN_(cudaDeviceGetAttribute(
                         &num_sms_, cudaDevAttrMultiProcessorCount, device_),
                     "reading the multiprocessor count");
  // 128 MiB of cuBLASLt workspace: split-K algorithms of the narrow, deep
  // weights (down_proj) need room for up to cuda_gemm_invariant_rows rows of
  // partial sums to qualify as the one row-invariant algorithm of their shape.
  // Row classes that end at the graph buckets of a batch-1 verify step (the
  // pending token and 2^j tree nodes); SPECD_GEMM_CLASSES=pow2 restores the
  // plain doubling classes, SPECD_GEMM_TIMING=0 picks algorithms without
  // timing them, the same in every process (A/B runs), and SPECD_GEMM_RETILE=0
  // keeps row classes to cuBLASLt's own candidates.
  if (cublasStatus_t st = cuda::Gemm::Create(
          size_t{128} << 20, &gemm_, options_.cuda_gemm_invariant_rows,
          /*plan_rows=*/16,
          /*bucket_classes=*/tuning_.gemm_bucket_classes,
          /*timed_picks=*/tuning_.gemm_timed_picks,
          /*retile=*/tuning_.gemm_retile);
      st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cuda backend: cuBLASLt: ", cublasLtGetStatusString(st)));
  }

  absl::StatusOr<std::unique_ptr<TensorStore>> opened =
      TensorStore::OpenFolder(config_.dir);
  if (!opened.ok())
    return opened.status();
  const TensorStore &st = **opened;
  // One line per device: with tensor parallelism each rank places its own shards.
  load_progress_ = std::make_unique<LoadProgress>(absl::StrCat("cuda:", device_));
  const ModelConfig &c = config_;
  // Full (checkpoint) sizes, and this rank's rows and columns of them.
  const int64_t h = c.hidden_size, hd = c.head_dim,
                q = int64_t{c.num_heads} * hd,
                kv = int64_t{c.num_kv_heads} * hd, f = c.intermediate_size,
                v = c.vocab_size;
  const TpRange q_rows{slice_.q_heads.begin * hd, slice_.q_heads.end * hd};
  const TpRange kv_rows{slice_.kv_heads.begin * hd, slice_.kv_heads.end * hd};
  const ShardSlice rows = ShardSlice::kRows, cols = ShardSlice::kCols;
  const auto upload = [&](std::vector<WeightPart> parts, bf16 **out) {
    return UploadWeights(st, parts, out);
  };
  SPECD_RETURN_IF_ERROR_(upload(
      {{"model.embed_tokens.weight", {v, h}, rows, slice_.vocab}}, &embed_));
  SPECD_RETURN_IF_ERROR_(UploadFp32(st, "model.norm.weight", h, &final_norm_));
  lm_head_ = embed_;
  if (!c.tie_word_embeddings) {
    SPECD_RETURN_IF_ERROR_(
        upload({{"lm_head.weight", {v, h}, rows, slice_.vocab}}, &lm_head_));
  }
  layers_.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    LayerWeights &w = layers_[l];
    SPECD_RETURN_IF_ERROR_(
        UploadFp32(st, p + "input_layernorm.weight", h, &w.input_norm));
    SPECD_RETURN_IF_ERROR_(
        upload({{p + "self_attn.q_proj.weight", {q, h}, rows, q_rows},
                {p + "self_attn.k_proj.weight", {kv, h}, rows, kv_rows},
                {p + "self_attn.v_proj.weight", {kv, h}, rows, kv_rows}},
               &w.qkv));
    if (c.attention_bias) {
      SPECD_RETURN_IF_ERROR_(
          upload({{p + "self_attn.q_proj.bias", {q}, rows, q_rows},
                  {p + "self_attn.k_proj.bias", {kv}, rows, kv_rows},
                  {p + "self_attn.v_proj.bias", {kv}, rows, kv_rows}},
                 &w.qkv_bias));
    }
    if (c.qk_norm) {
      SPECD_RETURN_IF_ERROR_(
          UploadFp32(st, p + "self_attn.q_norm.weight", hd, &w.q_norm));
      SPECD_RETURN_IF_ERROR_(
          UploadFp32(st, p + "self_attn.k_norm.weight", hd, &w.k_norm));
    }
    SPECD_RETURN_IF_ERROR_(upload(
        {{p + "self_attn.o_proj.weight", {h, q}, cols, q_rows}}, &w.o_proj));
    SPECD_RETURN_IF_ERROR_(
        UploadFp32(st, p + "post_attention_layernorm.weight", h, &w.post_norm));
    SPECD_RETURN_IF_ERROR_(
        upload({{p + "mlp.gate_proj.weight", {f, h}, rows, slice_.ffn},
                {p + "mlp.up_proj.weight", {f, h}, rows, slice_.ffn}},
               &w.gate_up));
    SPECD_RETURN_IF_ERROR_(upload(
        {{p + "mlp.down_proj.weight", {h, f}, cols, slice_.ffn}}, &w.down));
  }
  const std::vector<float> inv_freq = RopeInvFreq(c);
  void *p = nullptr;
  SPECD_CUDA_RETURN_(cudaMalloc(&p, inv_freq.size() * sizeof(float)),
                     "allocating inv_freq");
  allocations_.push_back(p);
  inv_freq_ = static_cast<float *>(p);
  SPECD_CUDA_RETURN_(cudaMemcpy(inv_freq_, inv_freq.data(),
                                inv_freq.size() * sizeof(float),
                                cudaMemcpyHostToDevice),
                     "uploading inv_freq");

  load_progress_->Finish();
  load_progress_.reset();

  // KV pools: the requested capacity, or what the free memory allows.
  size_t free_bytes = 0, total_bytes = 0;
  SPECD_CUDA_RETURN_(cudaMemGetInfo(&free_bytes, &total_bytes),
                     "reading free memory");
  const size_t block_bytes =
      size_t{2} * c.num_layers * kKvBlockTokens * kv_dim_ * sizeof(bf16);
  const int64_t fit =
      free_bytes > kReserveBytes
          ? static_cast<int64_t>((free_bytes - kReserveBytes) / block_bytes)
          : 0;
  num_blocks_ =
      std::min(CeilDiv(options_.kv_capacity_tokens, kKvBlockTokens), fit);
  if (num_blocks_ <= 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cuda:", device_,
        ": no device memory left for the KV cache after the weights (",
        free_bytes >> 20, " MiB free)"));
  }
  if (num_blocks_ < CeilDiv(options_.kv_capacity_tokens, kKvBlockTokens)) {
    std::fprintf(stderr,
                 "specd cuda backend: KV capacity clamped to %lld tokens by "
                 "device memory\n",
                 static_cast<long long>(num_blocks_ * kKvBlockTokens));
  }
  layer_stride_ = num_blocks_ * kKvBlockTokens * kv_dim_;
  const size_t pool_bytes =
      static_cast<size_t>(c.num_layers) * layer_stride_ * sizeof(bf16);
  for (bf16 **pool : {&k_pool_, &v_pool_}) {
    void *q_ptr = nullptr;
    SPECD_CUDA_RETURN_(cudaMalloc(&q_ptr, pool_bytes),
                       "allocating the KV cache");
    allocations_.push_back(q_ptr);
    // Zeros, so that no slot ever holds NaN bit patterns (a masked key's value
    // is multiplied by a zero probability, which would not cancel a NaN).
    SPECD_CUDA_RETURN_(cudaMemset(q_ptr, 0, pool_bytes),
                       "clearing the KV cache");
    *pool = static_cast<bf16 *>(q_ptr);
  }
  for (int64_t b = num_blocks_ - 1; b >= 0; --b)
    free_blocks_.push_back(static_cast<int32_t>(b));
  // The clears ran on the legacy default stream, which stream_ (non-blocking)
  // does not wait for.
  SPECD_CUDA_RETURN_(cudaDeviceSynchronize(), "initialising the device");
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Sequences and KV blocks (the CPU backend's bookkeeping).

void CudaBackend::ReleaseBlocks(Sequence *s, int64_t keep_blocks) {
  while (static_cast<int64_t>(s->blocks.size()) > keep_blocks) {
    free_blocks_.push_back(s->blocks.back());
    s->blocks.pop_back();
  }
}

int64_t CudaBackend::PhysicalSlot(const Sequence &s, int64_t logical) const {
  return int64_t{s.blocks[logical / kKvBlockTokens]} * kKvBlockTokens +
         logical % kKvBlockTokens;
}

absl::Status CudaBackend::AddSequence(SeqId seq) {
  if (seqs_.contains(seq)) {
    return absl::AlreadyExistsError(
        absl::StrCat("sequence ", seq, " already exists"));
  }
  if (free_blocks_.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: no free block for sequence ", seq,
                     " (capacity ", num_blocks_ * kKvBlockTokens, " tokens)"));
  }
  seqs_.emplace(seq, Sequence{});
  return absl::OkStatus();
}

absl::Status CudaBackend::RemoveSequence(SeqId seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end())
    return absl::NotFoundError(absl::StrCat("sequence ", seq, " not found"));
  ReleaseBlocks(&it->second, 0);
  seqs_.erase(it);
  return absl::OkStatus();
}

bool CudaBackend::HasSequence(SeqId seq) const { return seqs_.contains(seq); }

absl::StatusOr<int64_t> CudaBackend::CommittedLength(SeqId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end())
    return absl::NotFoundError(absl::StrCat("sequence ", seq, " not found"));
  return it->second.committed;
}

KvUsage CudaBackend::Usage() const {
  KvUsage u;
  for (const auto &[id, s] : seqs_)
    u.used_tokens += s.tokens();
  u.capacity_tokens = num_blocks_ * kKvBlockTokens;
  u.sequences = static_cast<int>(seqs_.size());
  return u;
}

absl::Status CudaBackend::Commit(SeqId seq, absl::Span<const int32_t> path) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end())
    return absl::NotFoundError(absl::StrCat("sequence ", seq, " not found"));
  Sequence &s = it->second;
  const int64_t scratch = static_cast<int64_t>(s.scratch_parents.size());
  for (size_t j = 0; j < path.size(); ++j) {
    if (path[j] < 0 || path[j] >= scratch) {
      return absl::InvalidArgumentError(absl::StrCat(
          "path[", j, "] = ", path[j], " is not a scratch node (sequence ", seq,
          " has ", scratch, ")"));
    }
    const int32_t want = j == 0 ? -1 : path[j - 1];
    if (s.scratch_parents[path[j]] != want) {
      return absl::InvalidArgumentError(
          absl::StrCat("path[", j, "] = ", path[j], " is not a child of ",
                       j == 0 ? std::string("the committed end")
                              : absl::StrCat("path[", j - 1, "]"),
                       " (its parent is ", s.scratch_parents[path[j]], ")"));
    }
  }
  // path[j] >= j and increases, so copying in order never overwrites a later
  // source.
  std::vector<int64_t> src, dst;
  for (size_t j = 0; j < path.size(); ++j) {
    if (path[j] == static_cast<int32_t>(j))
      continue;
    src.push_back(PhysicalSlot(s, s.committed + path[j]));
    dst.push_back(PhysicalSlot(s, s.committed + static_cast<int64_t>(j)));
  }
  if (!src.empty()) {
    SPECD_CUDA_RETURN_(cudaSetDevice(device_), "selecting the device");
    Packer pack;
    const size_t o_src = pack.Add(src), o_dst = pack.Add(dst);
    SPECD_RETURN_IF_ERROR_(Ensure(&verify_, pack.bytes().size()));
    SPECD_CUDA_RETURN_(cudaMemcpyAsync(verify_.ptr, pack.bytes().data(),
                                       pack.bytes().size(),
                                       cudaMemcpyHostToDevice, stream_),
                       "uploading commit slots");
    cuda::KvCacheCopyParams p;
    p.k_cache = k_pool_;
    p.v_cache = v_pool_;
    p.num_layers = config_.num_layers;
    p.layer_stride = layer_stride_;
    p.src_slots = At<int64_t>(verify_.ptr, o_src);
    p.dst_slots = At<int64_t>(verify_.ptr, o_dst);
    p.num_copies = static_cast<int64_t>(src.size());
    p.kv_dim = kv_dim_;
    SPECD_CUDA_RETURN_(cuda::KvCacheCopyCuda(p, stream_), "KV copy");
  }
  s.committed += static_cast<int64_t>(path.size());
  s.scratch_parents.clear();
  s.scratch_depth.clear();
  ReleaseBlocks(&s, CeilDiv(s.committed, kKvBlockTokens));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Forward.

absl::StatusOr<CudaBackend::Batch>
CudaBackend::Validate(absl::Span<const ForwardItem> items) {
  const ModelConfig &c = config_;
  Batch batch;
  batch.seqs.resize(items.size());
  batch.depth.resize(items.size());
  batch.spine.resize(items.size());
  absl::flat_hash_set<SeqId> seen;
  int64_t blocks_needed = 0;
  for (size_t b = 0; b < items.size(); ++b) {
    const ForwardItem &it = items[b];
    auto found = seqs_.find(it.seq);
    if (found == seqs_.end()) {
      return absl::NotFoundError(
          absl::StrCat("items[", b, "].seq: sequence ", it.seq, " not found"));
    }
    if (!seen.insert(it.seq).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("items[", b, "].seq: sequence ", it.seq,
                       " appears twice in one batch"));
    }
    Sequence &s = found->second;
    batch.seqs[b] = &s;
    const int64_t n = static_cast<int64_t>(it.tokens.size());
    if (n == 0)
      return absl::InvalidArgumentError(
          absl::StrCat("items[", b, "].tokens is empty"));
    if (it.parents.size() != it.tokens.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("items[", b, "].parents has ", it.parents.size(),
                       " entries for ", n, " tokens"));
    }
    const int64_t base = static_cast<int64_t>(s.scratch_parents.size());
    // Parents and depths of the old and new scratch nodes together, to find
    // each new node's deepest ancestor on the chain from the committed end.
    std::vector<int32_t> parents = s.scratch_parents, depth = s.scratch_depth;
    std::vector<int32_t> &new_depth = batch.depth[b];
    std::vector<int32_t> &spine = batch.spine[b];
    for (int64_t j = 0; j < n; ++j) {
      const int32_t tok = it.tokens[j];
      if (tok < 0 || tok >= c.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("items[", b, "].tokens[", j, "] = ", tok,
                         " is outside the vocabulary [0, ", c.vocab_size, ")"));
      }
      const int32_t parent = it.parents[j];
      if (parent < -1 || parent >= base + j) {
        return absl::InvalidArgumentError(absl::StrCat(
            "items[", b, "].parents[", j, "] = ", parent,
            " must be -1 or an earlier scratch node (< ", base + j, ")"));
      }
      const int32_t d = parent < 0 ? 0 : 1 + depth[parent];
      if (s.committed + d >= c.max_position_embeddings) {
        return absl::InvalidArgumentError(absl::StrCat(
            "items[", b, "].tokens[", j, "]: position ", s.committed + d,
            " is beyond the context (max_position_embeddings ",
            c.max_position_embeddings, ")"));
      }
      parents.push_back(parent);
      depth.push_back(d);
      new_depth.push_back(d);
      const int32_t index = static_cast<int32_t>(base + j);
      const int32_t a = SpineEnd(parents, depth, index);
      if (index - a > cuda::kTreeAttentionMaskBits) {
        return absl::UnimplementedError(
            absl::StrCat("items[", b, "].parents[", j, "]: scratch node ",
                         index, " lies ", index - a,
                         " nodes past the chain from the committed end; the "
                         "cuda backend masks at most ",
                         cuda::kTreeAttentionMaskBits));
      }
      spine.push_back(a);
    }
    for (int32_t r : it.logit_rows) {
      if (r < 0 || r >= n) {
        return absl::InvalidArgumentError(absl::StrCat(
            "items[", b, "].logit_rows holds ", r, ", outside [0, ", n, ")"));
      }
    }
    blocks_needed += CeilDiv(s.tokens() + n, kKvBlockTokens) -
                     static_cast<int64_t>(s.blocks.size());
    batch.tokens += n;
    batch.rows += static_cast<int64_t>(it.logit_rows.size());
  }
  if (blocks_needed > static_cast<int64_t>(free_blocks_.size())) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache full: the batch needs ", blocks_needed * kKvBlockTokens,
        " more slots, ", free_blocks_.size() * kKvBlockTokens,
        " are free (capacity ", num_blocks_ * kKvBlockTokens, " tokens)"));
  }
  return batch;
}

absl::Status CudaBackend::Gemm(const bf16 *x, const bf16 *w, const bf16 *bias,
                               void *y, bool y_fp32, int64_t m, int64_t n,
                               int64_t k, int k_splits) {
  cuda::GemmParams p;
  p.k_splits = k_splits;
  p.x = x;
  p.w = w;
  p.bias = bias;
  p.y = y;
  p.y_fp32 = y_fp32;
  p.m = m;
  p.n = n;
  p.k = k;
  if (cublasStatus_t st = gemm_->Run(p, stream_); st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cuda backend: GEMM [", m, ", ", k, "] x [", n, ", ", k,
                     "]^T: ", cublasLtGetStatusString(st)));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Step layout.
//
// A step's launches are described by a Step: how many token rows, logit rows
// and sequences the kernels see, the block-table stride, the attention plan's
// shape, and where each metadata array sits in meta_. Unpadded, rows are packed
// item after item (what an eager step needs). Padded (CUDA graphs), the batch
// is rounded up to a batch bucket and every sequence gets the same number of
// token slots, so that two steps of one bucket launch exactly the same kernels
// with the same arguments and only the contents of meta_ differ.

bool CudaBackend::ChooseBuckets(const std::vector<int64_t> &item_tokens,
                                Step *step) const {
  if (!graphs_enabled_ || item_tokens.empty())
    return false;
  const int64_t b = static_cast<int64_t>(item_tokens.size());
  if (b > kGraphMaxBatch)
    return false;
  int64_t most = 0;
  for (int64_t n : item_tokens)
    most = std::max(most, n);
  if (most > kGraphMaxTreeTokens + 1)
    return false;
  const int64_t batch = NextPow2(b), per_seq = TokenBucket(most);
  // Longer steps run eagerly: their activations and logits would take too
  // much memory for the little a graph saves on a step that long.
  if (batch * per_seq > kGraphMaxTokens)
    return false;
  step->padded = true;
  step->batch = batch;
  step->per_seq = per_seq;
  return true;
}

absl::Status CudaBackend::LayoutForward(absl::Span<const ForwardItem> items,
                                        const Batch &batch, Step *step,
                                        Packer *pack) {
  const ModelConfig &c = config_;
  const int64_t num_items = static_cast<int64_t>(items.size());
  if (!step->padded) {
    step->batch = num_items;
    step->T = batch.tokens;
    step->R = batch.rows;
  } else {
    step->T = step->batch * step->per_seq;
    step->R = step->batch * step->per_seq;
  }
  // The same choice on every rank: it depends on the step's shape only.
  step->custom_allreduce =
      world_ > 1 && tp_.custom != nullptr &&
      static_cast<int64_t>(step->T * c.hidden_size * sizeof(bf16)) <=
          tp_.custom->max_bytes();
  const int64_t T = step->T;
  // Token and logit-row base of each launched sequence.
  std::vector<int64_t> token_base(step->batch), row_base(step->batch);
  for (int64_t b = 0, t = 0, r = 0; b < step->batch; ++b) {
    token_base[b] = step->padded ? b * step->per_seq : t;
    row_base[b] = step->padded ? b * step->per_seq : r;
    if (b < num_items) {
      t += static_cast<int64_t>(items[b].tokens.size());
      r += static_cast<int64_t>(items[b].logit_rows.size());
    }
  }
  step->item_row_begin.assign(row_base.begin(), row_base.begin() + num_items);

  std::vector<int32_t> tokens(T, 0), positions(T, 0), query_seq(T, 0),
      kv_end(T, 1), mask_begin(T, 1), rows(step->R, 0);
  std::vector<uint32_t> mask(
      static_cast<size_t>(T) * cuda::kTreeAttentionMaskWords, 0u);
  // A negative slot makes the KV write skip the row: padding never touches the
  // cache.
  std::vector<int64_t> slots(T, -1);
  // The real queries alone, packed, for the split decision (see below).
  std::vector<int32_t> real_query_seq, real_kv_end;
  int64_t max_blocks = 1;
  for (int64_t b = 0; b < num_items; ++b) {
    const ForwardItem &it = items[b];
    Sequence &s = *batch.seqs[b];
    const int64_t n = static_cast<int64_t>(it.tokens.size());
    while (static_cast<int64_t>(s.blocks.size()) <
           CeilDiv(s.tokens() + n, kKvBlockTokens)) {
      s.blocks.push_back(free_blocks_.back());
      free_blocks_.pop_back();
    }
    max_blocks = std::max<int64_t>(max_blocks, s.blocks.size());
    for (size_t j = 0; j < it.logit_rows.size(); ++j) {
      rows[row_base[b] + j] =
          static_cast<int32_t>(token_base[b] + it.logit_rows[j]);
    }
    // One spine end for the sequence's masked tokens (engine/tree_mask.h: the
    // same keys, one attention window group a tile instead of one per run).
    // SPECD_SHARED_SPINE=0 keeps each token's own spine end (A/B runs).
    const bool share_spine = tuning_.shared_spine;
    const std::optional<int32_t> shared_a =
        share_spine ? SharedSpineEnd(batch.spine[b],
                                     static_cast<int32_t>(s.scratch_parents.size()))
                    : std::nullopt;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = token_base[b] + j;
      const int32_t index = static_cast<int32_t>(s.scratch_parents.size());
      s.scratch_parents.push_back(it.parents[j]);
      s.scratch_depth.push_back(batch.depth[b][j]);
      tokens[t] = it.tokens[j];
      positions[t] = static_cast<int32_t>(s.committed + batch.depth[b][j]);
      query_seq[t] = static_cast<int32_t>(b);
      slots[t] = PhysicalSlot(s, s.committed + index);
      // Visible: [0, committed + a + 1) in full, then the node's ancestors
      // after a (itself included) through the mask (engine/tree_mask.h).
      const int32_t a = MaskSpineEnd(index, batch.spine[b][j], shared_a,
                                     cuda::kTreeAttentionMaskBits);
      kv_end[t] = static_cast<int32_t>(s.committed + index + 1);
      mask_begin[t] = static_cast<int32_t>(s.committed + a + 1);
      SetTreeMaskBits(
          s.scratch_parents, index, a,
          absl::MakeSpan(&mask[static_cast<size_t>(t) *
                               cuda::kTreeAttentionMaskWords],
                         cuda::kTreeAttentionMaskWords));
      real_query_seq.push_back(static_cast<int32_t>(b));
      real_kv_end.push_back(kv_end[t]);
    }
    if (step->padded) {
      // Padding slots of a real sequence repeat its last query (same keys, same
      // mask, no KV write), so the attention tile they join keeps the key range
      // and fully visible prefix it has without them, and every real query's
      // result keeps its bits.
      const int64_t last = token_base[b] + n - 1;
      for (int64_t j = n; j < step->per_seq; ++j) {
        const int64_t t = token_base[b] + j;
        tokens[t] = tokens[last];
        positions[t] = positions[last];
        query_seq[t] = query_seq[last];
        kv_end[t] = kv_end[last];
        mask_begin[t] = mask_begin[last];
        std::copy_n(
            &mask[static_cast<size_t>(last) * cuda::kTreeAttentionMaskWords],
            cuda::kTreeAttentionMaskWords,
            &mask[static_cast<size_t>(t) * cuda::kTreeAttentionMaskWords]);
      }
      for (int64_t j = static_cast<int64_t>(it.logit_rows.size());
           j < step->per_seq; ++j) {
        rows[row_base[b] + j] = static_cast<int32_t>(token_base[b]);
      }
    }
  }
  // Padding sequences: their own block-table row of zeros (block 0: reads
  // only), one key each.
  for (int64_t b = num_items; b < step->batch; ++b) {
    for (int64_t j = 0; j < step->per_seq; ++j) {
      query_seq[token_base[b] + j] = static_cast<int32_t>(b);
      rows[row_base[b] + j] = static_cast<int32_t>(token_base[b]);
    }
  }
  step->tree_masks = false;
  for (int64_t t = 0; t < T; ++t)
    step->tree_masks = step->tree_masks || mask_begin[t] != kv_end[t];
  // A fixed block-table stride per power of two, so that contexts growing
  // within a bucket replay the same graph.
  step->max_blocks =
      step->padded ? std::max<int64_t>(8, NextPow2(max_blocks)) : max_blocks;
  std::vector<int32_t> block_tables(step->batch * step->max_blocks, 0);
  // Per block-table row, the slots written before this step (attention may
  // load them while RoPE writes the step's own slots); padding rows none.
  std::vector<int32_t> kv_stable(step->batch, 0);
  for (int64_t b = 0; b < num_items; ++b) {
    std::copy(batch.seqs[b]->blocks.begin(), batch.seqs[b]->blocks.end(),
              block_tables.begin() + b * step->max_blocks);
    kv_stable[b] = static_cast<int32_t>(batch.seqs[b]->committed);
  }
  const int64_t kv_group = c.num_heads / c.num_kv_heads;
  cuda::TreeAttentionPlan plan =
      cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), T, heads_,
                              kv_heads_, kv_group, num_sms_);
  if (step->padded) {
    // The key-range split changes how a query's partial softmaxes are combined,
    // so it must not depend on the padding: take the split the real queries
    // alone would get.
    plan.num_splits =
        cuda::PlanTreeAttention(real_query_seq.data(), real_kv_end.data(),
                                static_cast<int64_t>(real_query_seq.size()),
                                heads_, kv_heads_, kv_group, num_sms_)
            .num_splits;
    // How many chunks a CTA takes changes no bits: size it for the padded tiles.
    plan.chunks_per_cta = cuda::TreeAttentionChunksPerCta(
        static_cast<int64_t>(plan.tile_begin.size()), kv_heads_, plan.num_splits,
        num_sms_);
  }
  if (!cuda::TreeAttentionUsesMmaKernel(c.head_dim)) {
    // The generic attention kernel never splits the key range: plan no split,
    // so that no workspace is allocated and graph keys do not vary with it.
    plan.num_splits = 1;
    plan.chunks_per_cta = 1;
  }
  // SPECD_ATTN_CHUNKS_PER_CTA=N, an A/B switch: N key chunks a CTA instead of the planner's
  // choice (its WaveCost model), to time the model against the step. It changes the CTA count,
  // never the bits.
  const int chunks_override = tuning_.attn_chunks_per_cta;
  if (chunks_override > 0 && plan.num_splits > 1)
    plan.chunks_per_cta = std::min(chunks_override, plan.num_splits);
  step->num_tiles = static_cast<int64_t>(plan.tile_begin.size());
  step->num_splits = plan.num_splits;
  step->chunks_per_cta = plan.chunks_per_cta;
  // Split, the chunk count (and so the workspace) grows with the context; a power of two
  // keeps reallocations, which drop every captured graph, rare.
  step->ws_floats = NextPow2(
      std::max<int64_t>(1, cuda::TreeAttentionWorkspaceFloats(
                               plan.num_splits, T, heads_, c.head_dim)));

  step->o_tokens = pack->Add(tokens);
  step->o_positions = pack->Add(positions);
  step->o_query_seq = pack->Add(query_seq);
  step->o_kv_end = pack->Add(kv_end);
  step->o_mask_begin = pack->Add(mask_begin);
  step->o_mask = pack->Add(mask);
  step->o_slots = pack->Add(slots);
  step->o_tables = pack->Add(block_tables);
  step->o_rows = pack->Add(rows);
  step->o_tile_begin = pack->Add(plan.tile_begin);
  step->o_tile_end = pack->Add(plan.tile_end);
  step->o_kv_stable = pack->Add(kv_stable);
  return absl::OkStatus();
}

absl::Status CudaBackend::PrepareBuffers(const Step &step, size_t meta_bytes) {
  const ModelConfig &c = config_;
  const int64_t T = step.T, R = std::max<int64_t>(step.R, 1);
  const int64_t H = c.hidden_size, F = ffn_;
  const int64_t QD = heads_ * c.head_dim, QKVD = QD + 2 * kv_dim_;
  SPECD_RETURN_IF_ERROR_(Ensure(&meta_, meta_bytes));
  SPECD_RETURN_IF_ERROR_(Ensure(&residual_, T * H * sizeof(float)));
  SPECD_RETURN_IF_ERROR_(Ensure(&x_, T * H * sizeof(bf16)));
  if (residual_splits_ > 1) {
    SPECD_RETURN_IF_ERROR_(
        Ensure(&split_, residual_splits_ * T * H * sizeof(float)));
  }
  SPECD_RETURN_IF_ERROR_(Ensure(&normed_, T * H * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&qkv_, T * QKVD * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&attn_, T * QD * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&gate_up_, T * 2 * F * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&act_, T * F * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&last_, R * H * sizeof(bf16)));
  // The all-gather of top-k / top-p rows sends vocab_rows_max_ columns a row.
  SPECD_RETURN_IF_ERROR_(
      Ensure(&logits_, R * vocab_rows_max_ * sizeof(float)));
  SPECD_RETURN_IF_ERROR_(Ensure(&attn_ws_, step.ws_floats * sizeof(float)));
  SPECD_RETURN_IF_ERROR_(
      Ensure(&sample_ws_, cuda::SampleWorkspaceBytes(R, c.vocab_size)));
  if (world_ > 1 && step.verify) {
    const size_t cand = sizeof(cuda::SampleCandidate);
    SPECD_RETURN_IF_ERROR_(Ensure(&cand_local_, R * cand));
    SPECD_RETURN_IF_ERROR_(Ensure(&cand_all_, world_ * R * cand));
    if (step.gather_logits) {
      SPECD_RETURN_IF_ERROR_(Ensure(
          &gathered_, world_ * R * vocab_rows_max_ * sizeof(float)));
      SPECD_RETURN_IF_ERROR_(
          Ensure(&full_logits_, R * c.vocab_size * sizeof(float)));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::UploadMeta(const Packer &pack) {
  const std::vector<uint8_t> &bytes = pack.bytes();
  if (host_stage_bytes_ < bytes.size()) {
    if (host_stage_ != nullptr) {
      // The previous step's copy finished: every step ends with a stream
      // synchronisation.
      cudaFreeHost(host_stage_);
      host_stage_ = nullptr;
      host_stage_bytes_ = 0;
    }
    const size_t grown =
        std::max<size_t>(bytes.size() + bytes.size() / 4, 1 << 16);
    SPECD_CUDA_RETURN_(cudaMallocHost(&host_stage_, grown),
                       "allocating pinned staging memory");
    host_stage_bytes_ = grown;
  }
  std::memcpy(host_stage_, bytes.data(), bytes.size());
  SPECD_CUDA_RETURN_(cudaMemcpyAsync(meta_.ptr, host_stage_, bytes.size(),
                                     cudaMemcpyHostToDevice, stream_),
                     "uploading step metadata");
  return absl::OkStatus();
}

CudaBackend::bf16 *CudaBackend::Partial(const Step &step, int site) {
  if (step.custom_allreduce)
    return tp_.custom->input(tp_.rank, site);
  return static_cast<bf16 *>(x_.ptr);
}

absl::Status CudaBackend::ReduceNorm(const Step &step, int site, bool init,
                                     const float *weight,
                                     cuda::DeadRows dead0,
                                     cuda::DeadRows dead1) {
  const ModelConfig &c = config_;
  const int64_t H = c.hidden_size;
  float *residual = static_cast<float *>(residual_.ptr);
  bf16 *normed = static_cast<bf16 *>(normed_.ptr);
  bf16 *x = static_cast<bf16 *>(x_.ptr);
  if (world_ > 1 && step.custom_allreduce) {
    cuda::AllReduceParams p = tp_.custom->Params(tp_.rank, site);
    p.rows = step.T;
    p.dim = H;
    p.out = normed;
    p.residual = residual;
    p.residual_init = init;
    p.norm_weight = weight;
    p.eps = c.rms_norm_eps;
    SPECD_CUDA_RETURN_(cuda::AllReduceCuda(p, stream_), "custom all-reduce");
    return absl::OkStatus();
  }
  if (world_ > 1) {
    SPECD_RETURN_IF_ERROR_(tp_.nccl->AllReduceSum(
        tp_.rank, x, x, static_cast<size_t>(step.T * H), stream_));
  }
  cuda::RmsNormParams p;
  if (const int k_splits = SiteSplits(site); k_splits > 1) {
    p.partials = static_cast<const float *>(split_.ptr);
    p.num_partials = k_splits;
    p.discard_partials = DropDead(step);
  } else {
    p.x = x;
  }
  p.residual = residual;
  p.residual_init = init;
  p.weight = weight;
  p.out = normed;
  p.rows = step.T;
  p.dim = H;
  p.eps = c.rms_norm_eps;
  if (DropDead(step)) {
    p.dead[0] = dead0;
    p.dead[1] = dead1;
  }
  SPECD_CUDA_RETURN_(cuda::RmsNormCuda(p, stream_), "RMSNorm");
  return absl::OkStatus();
}

// Enqueues the step's kernels on stream_. Allocates nothing, synchronises
// nothing and reads nothing back, so that it can be captured into a CUDA graph.
absl::Status CudaBackend::Enqueue(const Step &step) {
  const ModelConfig &c = config_;
  const int64_t T = step.T, R = step.R;
  const int64_t H = c.hidden_size, hd = c.head_dim;
  // This rank's widths (the whole model's without tensor parallelism).
  const int64_t QD = heads_ * hd, KVD = kv_dim_, QKVD = QD + 2 * KVD, F = ffn_;
  void *meta = meta_.ptr;
  bf16 *normed = static_cast<bf16 *>(normed_.ptr);
  bf16 *qkv = static_cast<bf16 *>(qkv_.ptr);
  bf16 *attn = static_cast<bf16 *>(attn_.ptr);
  bf16 *gate_up = static_cast<bf16 *>(gate_up_.ptr);
  bf16 *act = static_cast<bf16 *>(act_.ptr);
  const int32_t *block_tables = At<int32_t>(meta, step.o_tables);

  // Vocabulary-parallel embedding: a rank gathers the rows it holds and zeros
  // for the others, so the all-reduce that starts the residual stream is exact.
  cuda::EmbeddingParams emb;
  emb.tokens = At<int32_t>(meta, step.o_tokens);
  emb.table = embed_;
  emb.out = Partial(step, kEmbedSite);
  emb.num_tokens = T;
  emb.vocab_size = vocab_rows_;
  emb.vocab_offset = slice_.vocab.begin;
  emb.hidden = H;
  SPECD_CUDA_RETURN_(cuda::EmbeddingCuda(emb, stream_), "embedding");

  // A sublayer's output (o_proj, down_proj): a K-split GEMM into split_ whose
  // slabs the site's norm adds, or bf16 into the site's partial (x_ without
  // tensor parallelism).
  const auto sublayer_out = [&](const bf16 *in, const bf16 *weight, int64_t k,
                                int site) {
    const int k_splits = SiteSplits(site);
    return k_splits > 1 ? Gemm(in, weight, nullptr, split_.ptr, true, T, H, k,
                               k_splits)
                        : Gemm(in, weight, nullptr, Partial(step, site), false,
                               T, H, k);
  };
  // Buffers dead once the next GEMM has read them; the kernel after it drops
  // them from L2 (l2_discard_).
  const cuda::DeadRows act_rows{act, F * static_cast<int64_t>(sizeof(bf16))};
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights &w = layers_[l];
    // Layer 0 starts the residual stream from the embedding; later layers add
    // the previous MLP's output to it.
    SPECD_RETURN_IF_ERROR_(ReduceNorm(step, l == 0 ? kEmbedSite : kMlpSite,
                                      l == 0, w.input_norm,
                                      l == 0 ? cuda::DeadRows{} : act_rows));
    SPECD_RETURN_IF_ERROR_(
        Gemm(normed, w.qkv, w.qkv_bias, qkv, false, T, QKVD, H));

    cuda::RopeParams rope;
    rope.q = qkv;
    rope.q_stride = QKVD;
    rope.num_q_heads = heads_;
    rope.k = qkv + QD;
    rope.k_stride = QKVD;
    rope.num_k_heads = kv_heads_;
    rope.positions = At<int32_t>(meta, step.o_positions);
    rope.inv_freq = inv_freq_;
    rope.q_norm_weight = w.q_norm;
    rope.k_norm_weight = w.k_norm;
    rope.norm_eps = c.rms_norm_eps;
    rope.num_tokens = T;
    rope.head_dim = hd;
    // The rotated keys and the values go straight to their KV-cache slots.
    rope.v = qkv + QD + KVD;
    rope.v_stride = QKVD;
    rope.k_cache = k_pool_ + l * layer_stride_;
    rope.v_cache = v_pool_ + l * layer_stride_;
    rope.slots = At<int64_t>(meta, step.o_slots);
    SPECD_CUDA_RETURN_(cuda::RopeCuda(rope, stream_), "RoPE and KV write");

    cuda::TreeAttentionParams ap;
    ap.q = qkv;
    ap.q_stride = QKVD;
    ap.out = attn;
    ap.out_stride = QD;
    ap.kv.k_cache = rope.k_cache;
    ap.kv.v_cache = rope.v_cache;
    ap.kv.block_tables = block_tables;
    ap.kv.max_blocks_per_seq = step.max_blocks;
    ap.kv.block_size = kKvBlockTokens;
    ap.query_seq = At<int32_t>(meta, step.o_query_seq);
    ap.kv_end = At<int32_t>(meta, step.o_kv_end);
    // Chains only (decode, prefill): null masks select the kernel build
    // without the tree-tail code (same bits).
    ap.mask_begin =
        step.tree_masks ? At<int32_t>(meta, step.o_mask_begin) : nullptr;
    ap.mask = step.tree_masks ? At<uint32_t>(meta, step.o_mask) : nullptr;
    ap.tile_begin = At<int32_t>(meta, step.o_tile_begin);
    ap.tile_end = At<int32_t>(meta, step.o_tile_end);
    ap.kv_stable_end = At<int32_t>(meta, step.o_kv_stable);
    ap.num_tiles = step.num_tiles;
    ap.num_splits = step.num_splits;
    ap.chunks_per_cta = step.chunks_per_cta;
    ap.workspace = static_cast<float *>(attn_ws_.ptr);
    ap.discard_workspace = DropDead(step);
    ap.num_queries = T;
    ap.num_heads = heads_;
    ap.num_kv_heads = kv_heads_;
    ap.q_head_offset = slice_.q_heads.begin;
    ap.kv_head_offset = slice_.kv_heads.begin;
    ap.kv_group = c.num_heads / c.num_kv_heads;
    ap.head_dim = hd;
    ap.scale = 1.0f / std::sqrt(static_cast<float>(hd));
    SPECD_CUDA_RETURN_(cuda::TreeAttentionCuda(ap, stream_), "attention");

    SPECD_RETURN_IF_ERROR_(sublayer_out(attn, w.o_proj, QD, kAttnSite));
    SPECD_RETURN_IF_ERROR_(ReduceNorm(
        step, kAttnSite, false, w.post_norm,
        {qkv, QKVD * static_cast<int64_t>(sizeof(bf16))},
        {attn, QD * static_cast<int64_t>(sizeof(bf16))}));
    SPECD_RETURN_IF_ERROR_(
        Gemm(normed, w.gate_up, nullptr, gate_up, false, T, 2 * F, H));
    cuda::SwiGluParams sw;
    sw.gate_up = gate_up;
    sw.out = act;
    sw.rows = T;
    sw.dim = F;
    sw.discard_gate_up = DropDead(step);
    if (sw.discard_gate_up)
      sw.dead = {normed, H * static_cast<int64_t>(sizeof(bf16))};
    SPECD_CUDA_RETURN_(cuda::SwiGluCuda(sw, stream_), "SwiGLU");
    SPECD_RETURN_IF_ERROR_(sublayer_out(act, w.down, F, kMlpSite));
  }
  // Final norm of every token (cheap next to the LM head), then the requested
  // rows only.
  SPECD_RETURN_IF_ERROR_(ReduceNorm(
      step, c.num_layers == 0 ? kEmbedSite : kMlpSite, c.num_layers == 0,
      final_norm_, c.num_layers == 0 ? cuda::DeadRows{} : act_rows));
  if (R == 0)
    return absl::OkStatus();
  cuda::EmbeddingParams
      gather; // a row gather: the "table" is the normed activations
  gather.tokens = At<int32_t>(meta, step.o_rows);
  gather.table = normed;
  gather.out = static_cast<bf16 *>(last_.ptr);
  gather.num_tokens = R;
  gather.vocab_size = T;
  gather.hidden = H;
  SPECD_CUDA_RETURN_(cuda::EmbeddingCuda(gather, stream_),
                     "gathering logit rows");
  SPECD_RETURN_IF_ERROR_(Gemm(static_cast<bf16 *>(last_.ptr), lm_head_, nullptr,
                              logits_.ptr, true, R, vocab_rows_, H));
  if (!step.verify)
    return absl::OkStatus();

  // Verify: sample every row, accept along each tree, compact the accepted KV.
  int32_t *accepted = At<int32_t>(meta, step.o_out);
  int32_t *out_tokens = accepted + step.batch;
  int32_t *out_nodes = out_tokens + step.batch * step.out_stride;
  int32_t *sampled = At<int32_t>(meta, step.o_sampled);
  SPECD_RETURN_IF_ERROR_(SampleRows(step, sampled));

  cuda::TreeAcceptParams tp;
  tp.sampled = sampled;
  tp.sample_offset = At<int32_t>(meta, step.o_sample_offset);
  tp.tree_tokens = At<int32_t>(meta, step.o_tree_tokens);
  tp.tree_parents = At<int32_t>(meta, step.o_tree_parents);
  tp.node_offset = At<int32_t>(meta, step.o_node_offset);
  tp.num_nodes = At<int32_t>(meta, step.o_num_nodes);
  tp.out_tokens = out_tokens;
  tp.out_nodes = out_nodes;
  tp.out_accepted = accepted;
  tp.out_stride = step.out_stride;
  tp.num_seqs = step.batch;
  SPECD_CUDA_RETURN_(cuda::TreeAcceptCuda(tp, stream_), "tree acceptance");

  cuda::KvCacheCompactParams cp;
  cp.kv.k_cache = k_pool_;
  cp.kv.v_cache = v_pool_;
  cp.num_layers = c.num_layers;
  cp.layer_stride = layer_stride_;
  cp.kv_dim = kv_dim_;
  cp.kv.block_tables = block_tables;
  cp.kv.max_blocks_per_seq = step.max_blocks;
  cp.kv.block_size = kKvBlockTokens;
  cp.seq_rows = At<int32_t>(meta, step.o_seq_rows);
  cp.base_slot = At<int32_t>(meta, step.o_base_slot);
  cp.nodes = out_nodes;
  cp.num_nodes = accepted;
  cp.node_stride = step.out_stride;
  cp.num_seqs = step.batch;
  SPECD_CUDA_RETURN_(cuda::KvCacheCompactCuda(cp, stream_), "KV compaction");
  return absl::OkStatus();
}

absl::Status CudaBackend::SampleRows(const Step &step, int32_t *tokens) {
  const int64_t R = step.R, vocab = config_.vocab_size;
  cuda::SampleParams sp;
  sp.logits = static_cast<const float *>(logits_.ptr);
  sp.logits_stride = vocab_rows_;
  sp.rows = At<cuda::SampleRowParams>(meta_.ptr, step.o_row_params);
  sp.tokens = tokens;
  sp.num_rows = R;
  sp.vocab_size = vocab_rows_;
  sp.workspace = sample_ws_.ptr;
  if (world_ > 1 && !step.gather_logits) {
    // Greedy and plain temperature: each rank reduces its shard to one
    // candidate a row (Gumbel noise keyed by the global token id), and the
    // candidates' reduction is the choice over the whole row.
    sp.vocab_offset = slice_.vocab.begin;
    sp.candidates = static_cast<cuda::SampleCandidate *>(cand_local_.ptr);
    SPECD_CUDA_RETURN_(cuda::SampleCuda(sp, stream_), "sampling candidates");
    // The candidates travel as 32-bit words (NCCL moves bytes alike).
    static_assert(sizeof(cuda::SampleCandidate) % sizeof(int32_t) == 0);
    SPECD_RETURN_IF_ERROR_(tp_.nccl->AllGather(
        tp_.rank, static_cast<const int32_t *>(cand_local_.ptr),
        static_cast<int32_t *>(cand_all_.ptr),
        static_cast<size_t>(R) * sizeof(cuda::SampleCandidate) / sizeof(int32_t),
        stream_));
    cuda::ReduceCandidatesParams rp;
    rp.candidates = static_cast<const cuda::SampleCandidate *>(cand_all_.ptr);
    rp.world_size = world_;
    rp.num_rows = R;
    rp.tokens = tokens;
    SPECD_CUDA_RETURN_(cuda::ReduceCandidatesCuda(rp, stream_),
                       "reducing sampling candidates");
    return absl::OkStatus();
  }
  if (world_ > 1) {
    // Top-k / top-p need the whole row: gather every rank's [R, rows_r]
    // logits (at a common stride) and lay them side by side.
    const size_t stride = static_cast<size_t>(R) * vocab_rows_max_;
    SPECD_RETURN_IF_ERROR_(tp_.nccl->AllGather(
        tp_.rank, static_cast<const float *>(logits_.ptr),
        static_cast<float *>(gathered_.ptr), stride, stream_));
    float *full = static_cast<float *>(full_logits_.ptr);
    for (int r = 0; r < world_; ++r) {
      const TpRange v = tp_.plan->ranks[r].vocab;
      SPECD_CUDA_RETURN_(
          cudaMemcpy2DAsync(full + v.begin, vocab * sizeof(float),
                            static_cast<const float *>(gathered_.ptr) + r * stride,
                            v.size() * sizeof(float), v.size() * sizeof(float),
                            R, cudaMemcpyDeviceToDevice, stream_),
          "placing gathered logits");
    }
    sp.logits = full;
    sp.logits_stride = vocab;
    sp.vocab_size = vocab;
  }
  SPECD_CUDA_RETURN_(cuda::SampleCuda(sp, stream_), "sampling");
  return absl::OkStatus();
}

void CudaBackend::ClearGraphs() {
  for (auto &[key, entry] : graphs_) {
    if (entry.exec != nullptr)
      cudaGraphExecDestroy(entry.exec);
  }
  graphs_.clear();
}

// Runs a prepared step: eagerly, or as a CUDA graph when the step is padded. A
// bucket's graph is captured on its second use, so the first use runs (and
// warms up) the same launches eagerly: cuBLASLt's plans and lazily loaded
// kernels are in place before capture, and a bucket used once costs no capture.
absl::Status CudaBackend::Execute(const Step &step) {
  if (!step.padded) {
    ++eager_steps_;
    return Enqueue(step);
  }
  if (buffer_generation_ != graphs_generation_) {
    // A buffer a graph points into was reallocated (Ensure synchronised the
    // stream first).
    ClearGraphs();
    graphs_generation_ = buffer_generation_;
  }
  // Everything a launch takes by value, and every pointer it takes: equal keys
  // launch equal kernels with equal arguments. Buffer pointers are covered by
  // the generation.
  const std::vector<int64_t> key = {step.verify,
                                    step.custom_allreduce,
                                    step.tree_masks,
                                    step.gather_logits,
                                    step.batch,
                                    step.per_seq,
                                    step.T,
                                    step.R,
                                    step.max_blocks,
                                    step.num_tiles,
                                    step.num_splits,
                                    step.chunks_per_cta,
                                    step.ws_floats,
                                    step.out_stride,
                                    static_cast<int64_t>(step.o_tokens),
                                    static_cast<int64_t>(step.o_positions),
                                    static_cast<int64_t>(step.o_query_seq),
                                    static_cast<int64_t>(step.o_kv_end),
                                    static_cast<int64_t>(step.o_mask_begin),
                                    static_cast<int64_t>(step.o_mask),
                                    static_cast<int64_t>(step.o_slots),
                                    static_cast<int64_t>(step.o_tables),
                                    static_cast<int64_t>(step.o_rows),
                                    static_cast<int64_t>(step.o_tile_begin),
                                    static_cast<int64_t>(step.o_tile_end),
                                    static_cast<int64_t>(step.o_kv_stable),
                                    static_cast<int64_t>(step.o_row_params),
                                    static_cast<int64_t>(step.o_sample_offset),
                                    static_cast<int64_t>(step.o_node_offset),
                                    static_cast<int64_t>(step.o_num_nodes),
                                    static_cast<int64_t>(step.o_tree_tokens),
                                    static_cast<int64_t>(step.o_tree_parents),
                                    static_cast<int64_t>(step.o_seq_rows),
                                    static_cast<int64_t>(step.o_base_slot),
                                    static_cast<int64_t>(step.o_sampled),
                                    static_cast<int64_t>(step.o_out)};
  GraphEntry &entry = graphs_[key];
  if (entry.exec == nullptr) {
    if (entry.failed || ++entry.uses < 2) {
      ++eager_steps_;
      return Enqueue(step);
    }
    cudaGraph_t graph = nullptr;
    SPECD_CUDA_RETURN_(
        cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal),
        "beginning graph capture");
    const absl::Status enqueued = Enqueue(step);
    // Always end the capture, so the stream leaves capture mode whatever
    // happened.
    const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
    cudaError_t instantiated = cudaErrorUnknown;
    if (enqueued.ok() && ended == cudaSuccess && graph != nullptr) {
      instantiated = cudaGraphInstantiate(&entry.exec, graph, 0);
    }
    if (graph != nullptr)
      cudaGraphDestroy(graph);
    if (!enqueued.ok() || ended != cudaSuccess || instantiated != cudaSuccess) {
      entry.exec = nullptr;
      entry.failed = true;
      cudaGetLastError(); // a failed capture leaves a sticky-free error behind;
                          // clear it
      std::fprintf(
          stderr,
          "specd cuda backend: graph capture failed (batch %lld, %lld tokens a "
          "sequence): %s / %s / %s; this bucket runs eagerly\n",
          static_cast<long long>(step.batch),
          static_cast<long long>(step.per_seq), enqueued.ToString().c_str(),
          cudaGetErrorName(ended), cudaGetErrorName(instantiated));
      ++eager_steps_;
      return Enqueue(step);
    }
    ++graphs_captured_;
  }
  SPECD_CUDA_RETURN_(cudaGraphLaunch(entry.exec, stream_),
                     "launching a CUDA graph");
  ++graph_launches_;
  return absl::OkStatus();
}

absl::Status CudaBackend::Forward(absl::Span<const ForwardItem> items,
                                  std::vector<float> *logits) {
  if (logits == nullptr)
    return absl::InvalidArgumentError("logits is null");
  logits->clear();
  int64_t rows = 0;
  for (const ForwardItem &it : items)
    rows += static_cast<int64_t>(it.logit_rows.size());
  logits->resize(static_cast<size_t>(rows) * config_.vocab_size);
  absl::Status s = ForwardToHost(items, logits->data());
  if (!s.ok())
    logits->clear();
  return s;
}

absl::Status CudaBackend::ForwardColumns(absl::Span<const ForwardItem> items,
                                         float *logits) {
  return ForwardToHost(items, logits);
}

void CudaBackend::LimitKvBlocks(int64_t blocks) {
  if (blocks >= num_blocks_)
    return;
  // Only called before any sequence exists: every block is free.
  num_blocks_ = blocks;
  free_blocks_.clear();
  for (int64_t b = num_blocks_ - 1; b >= 0; --b)
    free_blocks_.push_back(static_cast<int32_t>(b));
}

absl::Status CudaBackend::PrepareForward(absl::Span<const ForwardItem> items,
                                         const Batch &batch, Step *step) {
  SPECD_CUDA_RETURN_(cudaSetDevice(device_), "selecting the device");
  std::vector<int64_t> item_tokens;
  // A padded sequence has per_seq token slots and per_seq logit rows (rows may
  // repeat).
  for (const ForwardItem &it : items) {
    item_tokens.push_back(
        static_cast<int64_t>(std::max(it.tokens.size(), it.logit_rows.size())));
  }
  ChooseBuckets(item_tokens, step);
  Packer pack;
  SPECD_RETURN_IF_ERROR_(LayoutForward(items, batch, step, &pack));
  SPECD_RETURN_IF_ERROR_(PrepareBuffers(*step, pack.bytes().size()));
  return UploadMeta(pack);
}

absl::Status CudaBackend::ForwardToHost(absl::Span<const ForwardItem> items,
                                        float *logits) {
  absl::StatusOr<Batch> batch = Validate(items);
  if (!batch.ok())
    return batch.status();
  if (items.empty())
    return absl::OkStatus();
  Step step;
  SPECD_RETURN_IF_ERROR_(PrepareForward(items, *batch, &step));
  SPECD_RETURN_IF_ERROR_(Execute(step));
  const int64_t vocab = config_.vocab_size;
  // Each item's rows are contiguous on the device; runs of items that follow
  // each other there go back in one copy (a whole decode batch is one run),
  // into this rank's columns of the host rows.
  int64_t dst = 0;
  for (size_t b = 0; b < items.size();) {
    const int64_t src = step.item_row_begin[b];
    int64_t n = static_cast<int64_t>(items[b].logit_rows.size());
    size_t e = b + 1;
    while (e < items.size() && step.item_row_begin[e] == src + n) {
      n += static_cast<int64_t>(items[e].logit_rows.size());
      ++e;
    }
    if (n > 0) {
      const size_t width = static_cast<size_t>(vocab_rows_) * sizeof(float);
      SPECD_CUDA_RETURN_(
          cudaMemcpy2DAsync(logits + dst * vocab + slice_.vocab.begin,
                            vocab * sizeof(float),
                            static_cast<const float *>(logits_.ptr) +
                                src * vocab_rows_,
                            width, width, n, cudaMemcpyDeviceToHost, stream_),
          "copying logits");
    }
    dst += n;
    b = e;
  }
  SPECD_CUDA_RETURN_(cudaStreamSynchronize(stream_), "forward pass");
  return absl::OkStatus();
}

absl::Status CudaBackend::ForwardTopK(absl::Span<const ForwardItem> items,
                                      int k, TopKRows *out) {
  SPECD_RETURN_IF_ERROR_(CheckForwardTopK(k, out));
  // A rank holds a slice of the vocabulary: the whole rows' top-k would need
  // the slices' lists merged across ranks, so the group takes the host path.
  if (world_ > 1)
    return Backend::ForwardTopK(items, k, out);
  absl::StatusOr<Batch> batch = Validate(items);
  if (!batch.ok())
    return batch.status();
  const int64_t vocab = config_.vocab_size;
  out->k = static_cast<int>(std::min<int64_t>(k, vocab));
  out->ids.clear();
  out->logprobs.clear();
  if (items.empty())
    return absl::OkStatus();
  Step step;
  SPECD_RETURN_IF_ERROR_(PrepareForward(items, *batch, &step));
  // The requested rows among the step's (padded steps interleave unused ones),
  // uploaded with the step's metadata, before the forward is launched: the
  // forward (a graph for bucketed steps) and the top-k then run back to back
  // with no host synchronisation until the [n, k] results are read.
  std::vector<int32_t> rows;
  for (size_t b = 0; b < items.size(); ++b) {
    for (size_t j = 0; j < items[b].logit_rows.size(); ++j)
      rows.push_back(static_cast<int32_t>(step.item_row_begin[b] + j));
  }
  const int64_t n = static_cast<int64_t>(rows.size());
  // [n] row index, then [n, k] ids and [n, k] logprobs, copied back in one go.
  const size_t index_bytes = (n * sizeof(int32_t) + 15) / 16 * 16;
  const size_t result_bytes = n * out->k * (sizeof(int32_t) + sizeof(float));
  SPECD_RETURN_IF_ERROR_(Ensure(&topk_, index_bytes + result_bytes));
  char *base = static_cast<char *>(topk_.ptr);
  if (n > 0) {
    SPECD_CUDA_RETURN_(cudaMemcpyAsync(base, rows.data(), n * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, stream_),
                       "uploading top-k rows");
  }
  SPECD_RETURN_IF_ERROR_(Execute(step));
  if (n == 0) {
    SPECD_CUDA_RETURN_(cudaStreamSynchronize(stream_), "forward pass");
    return absl::OkStatus();
  }
  cuda::TopKLogprobsParams p;
  p.logits = static_cast<const float *>(logits_.ptr);
  p.logits_stride = vocab_rows_;
  p.row_index = reinterpret_cast<const int32_t *>(base);
  p.num_rows = n;
  p.vocab_size = vocab;
  p.k = out->k;
  p.ids = reinterpret_cast<int32_t *>(base + index_bytes);
  p.logprobs = reinterpret_cast<float *>(p.ids + n * out->k);
  SPECD_CUDA_RETURN_(cuda::TopKLogprobsCuda(p, stream_), "top-k launch");
  std::vector<char> host(result_bytes);
  SPECD_CUDA_RETURN_(cudaMemcpyAsync(host.data(), base + index_bytes,
                                     result_bytes, cudaMemcpyDeviceToHost,
                                     stream_),
                     "copying top-k rows");
  SPECD_CUDA_RETURN_(cudaStreamSynchronize(stream_), "forward pass");
  out->ids.resize(n * out->k);
  out->logprobs.resize(n * out->k);
  std::memcpy(out->ids.data(), host.data(), out->ids.size() * sizeof(int32_t));
  std::memcpy(out->logprobs.data(),
              host.data() + out->ids.size() * sizeof(int32_t),
              out->logprobs.size() * sizeof(float));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Verify on the device: one metadata upload, one graph (or the same launches
// eagerly), one copy of the outcomes back.

bool CudaBackend::SamplesOnDevice(const VerifyItem &item) {
  return !item.sampling.has_processors();
}

bool CudaBackend::LogprobsOnDevice(const VerifyItem &item) {
  return item.logprobs < 0 || item.logprobs_mode == LogprobsMode::kRaw ||
         item.sampling.greedy();
}

absl::StatusOr<std::vector<VerifyOutcome>>
CudaBackend::Verify(absl::Span<const VerifyItem> items) {
  if (world_ > 1) {
    // A rank's Forward() fills only its columns, so the host path belongs to
    // the group (CudaTensorParallelBackend::Verify), never to one rank.
    // A rank holds a slice of the vocabulary, so log-probabilities (a whole
    // row's log-sum-exp and top-n) are the group's too.
    for (size_t b = 0; b < items.size(); ++b) {
      if (!SamplesOnDevice(items[b]) || items[b].logprobs >= 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "verify item ", b,
            ": a tensor-parallel rank verifies on the device only (no logits "
            "processors or logprobs); the group serves the rest"));
      }
    }
    return VerifyOnDevice(items);
  }
  return VerifySplit(*this, items, VerifiesOnDevice,
                     [this](absl::Span<const VerifyItem> device_items) {
                       return VerifyOnDevice(device_items);
                     });
}

absl::StatusOr<std::vector<VerifyOutcome>>
CudaBackend::VerifyOnDevice(absl::Span<const VerifyItem> items) {
  const auto t_enter = std::chrono::steady_clock::now();
  const int vocab = config_.vocab_size;
  std::vector<ForwardItem> forward(items.size());
  std::vector<int64_t> committed(items.size());
  for (size_t b = 0; b < items.size(); ++b) {
    const VerifyItem &it = items[b];
    if (it.pending.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("verify item ", b, ": no pending token"));
    }
    if (absl::Status s = ValidateTree(it.tree, vocab); !s.ok())
      return s;
    if (absl::Status s = ValidateSamplingParams(it.sampling); !s.ok())
      return s;
    if (it.logprobs < -1 || it.logprobs > kMaxLogprobs) {
      return absl::InvalidArgumentError(
          absl::StrCat("verify item ", b, ": logprobs ", it.logprobs,
                       " must be in [-1, ", kMaxLogprobs, "]"));
    }
    auto found = seqs_.find(it.seq);
    if (found == seqs_.end()) {
      return absl::NotFoundError(
          absl::StrCat("verify item ", b, ": sequence ", it.seq, " not found"));
    }
    // The tree's KV slots follow the pending tokens right after the committed
    // prefix.
    if (!found->second.scratch_parents.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "verify item ", b, ": sequence ", it.seq, " has ",
          found->second.scratch_parents.size(),
          " uncommitted scratch nodes; Commit() them before Verify()"));
    }
    committed[b] = found->second.committed;
    const int p = static_cast<int>(it.pending.size());
    ForwardItem &f = forward[b];
    f.seq = it.seq;
    f.tokens = it.pending;
    f.tokens.insert(f.tokens.end(), it.tree.tokens.begin(),
                    it.tree.tokens.end());
    for (int i = 0; i < p; ++i)
      f.parents.push_back(i - 1);
    for (int32_t parent : it.tree.parents)
      f.parents.push_back(parent < 0 ? p - 1 : parent + p);
    for (int i = p - 1; i < static_cast<int>(f.tokens.size()); ++i)
      f.logit_rows.push_back(i);
  }
  absl::StatusOr<Batch> batch = Validate(forward);
  if (!batch.ok())
    return batch.status();
  if (items.empty())
    return std::vector<VerifyOutcome>{};
  SPECD_CUDA_RETURN_(cudaSetDevice(device_), "selecting the device");

  Step step;
  step.verify = true;
  for (const VerifyItem &it : items) {
    if (world_ > 1 && !VocabParallelSamplingSupported(it.sampling))
      step.gather_logits = true;
  }
  std::vector<int64_t> item_tokens;
  for (const ForwardItem &f : forward)
    item_tokens.push_back(static_cast<int64_t>(f.tokens.size()));
  ChooseBuckets(item_tokens, &step);
  Packer pack;
  SPECD_RETURN_IF_ERROR_(LayoutForward(forward, *batch, &step, &pack));

  // Sampling rows (the last pending token's, then one per tree node, at the
  // item's logit rows), the packed trees, and where each sequence's tree starts
  // in the KV cache. Padding rows and sequences sample greedily from rows no
  // one reads; a padding sequence has no tree nodes, so it accepts nothing and
  // compacts nothing.
  const int64_t num_seqs = static_cast<int64_t>(items.size());
  int64_t max_nodes = 0;
  for (const VerifyItem &it : items)
    max_nodes = std::max<int64_t>(max_nodes, it.tree.size());
  step.out_stride = step.padded ? step.per_seq : max_nodes + 1;
  std::vector<cuda::SampleRowParams> row_params(step.R);
  std::vector<int32_t> sample_offset(step.batch, 0), node_offset(step.batch, 0),
      num_nodes(step.batch, 0), seq_rows(step.batch, 0),
      base_slot(step.batch, 0);
  std::vector<int32_t> tree_tokens, tree_parents;
  for (int64_t b = 0; b < step.batch; ++b) {
    seq_rows[b] = static_cast<int32_t>(b);
    sample_offset[b] =
        static_cast<int32_t>(b < num_seqs ? step.item_row_begin[b] : 0);
    if (step.padded) {
      // Fixed tree sections of per_seq nodes, so the layout depends on the
      // bucket only.
      node_offset[b] = static_cast<int32_t>(b * step.per_seq);
    } else {
      node_offset[b] = static_cast<int32_t>(tree_tokens.size());
    }
    if (b >= num_seqs)
      continue;
    const VerifyItem &it = items[b];
    const int64_t p = static_cast<int64_t>(it.pending.size());
    const int64_t first_position = committed[b] + p;
    const std::vector<int> depth = TreeDepths(it.tree);
    num_nodes[b] = it.tree.size();
    base_slot[b] = static_cast<int32_t>(committed[b] + p);
    tree_tokens.resize(node_offset[b]);
    tree_parents.resize(node_offset[b]);
    tree_tokens.insert(tree_tokens.end(), it.tree.tokens.begin(),
                       it.tree.tokens.end());
    tree_parents.insert(tree_parents.end(), it.tree.parents.begin(),
                        it.tree.parents.end());
    for (int node = -1; node < it.tree.size(); ++node) {
      cuda::SampleRowParams &r = row_params[sample_offset[b] + node + 1];
      r.seed = it.sampling.seed;
      r.position = first_position + (node < 0 ? 0 : depth[node] + 1);
      r.temperature = it.sampling.temperature;
      r.top_p = it.sampling.top_p;
      r.top_k = it.sampling.top_k;
      r.min_p = it.sampling.min_p;
    }
  }
  if (step.padded) {
    tree_tokens.resize(step.batch * step.per_seq, 0);
    tree_parents.resize(step.batch * step.per_seq, -1);
  }
  const size_t out_count =
      static_cast<size_t>(step.batch) * (1 + 2 * step.out_stride);
  step.o_row_params = pack.Add(row_params);
  step.o_sample_offset = pack.Add(sample_offset);
  step.o_node_offset = pack.Add(node_offset);
  step.o_num_nodes = pack.Add(num_nodes);
  step.o_tree_tokens = pack.Add(tree_tokens);
  step.o_tree_parents = pack.Add(tree_parents);
  step.o_seq_rows = pack.Add(seq_rows);
  step.o_base_slot = pack.Add(base_slot);
  // Outputs follow the inputs in the same buffer (uploaded as zeros): sampled
  // tokens, then (copied back in one piece) accepted counts, accepted tokens
  // and accepted nodes.
  step.o_sampled = pack.Add(std::vector<int32_t>(step.R));
  step.o_out = pack.Add(std::vector<int32_t>(out_count));

  SPECD_RETURN_IF_ERROR_(PrepareBuffers(step, pack.bytes().size()));

  // Log-probabilities: every sampling row of the items that ask (the walk's
  // rows are known only after acceptance), the top-n of the widest request,
  // and each row's sampled token's log-probability and rank, by one launch
  // after the step; only [rows, n] come back. The rows go up before the step
  // is launched, so nothing waits on the host in between.
  std::vector<int32_t> lp_rows;
  std::vector<int64_t> lp_first(num_seqs, -1); // item's first entry in lp_rows
  int lp_k = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    if (items[b].logprobs < 0)
      continue;
    lp_first[b] = static_cast<int64_t>(lp_rows.size());
    for (int j = 0; j <= items[b].tree.size(); ++j)
      lp_rows.push_back(static_cast<int32_t>(step.item_row_begin[b] + j));
    lp_k = std::max(lp_k, items[b].logprobs);
  }
  lp_k = std::min(lp_k, vocab);
  const int64_t lp_n = static_cast<int64_t>(lp_rows.size());
  // [lp_n] row index, then [lp_n, lp_k] ids, [lp_n, lp_k] log-probabilities,
  // [lp_n] token log-probabilities and [lp_n] ranks (copied back in one go).
  const size_t lp_index_bytes = (lp_n * sizeof(int32_t) + 15) / 16 * 16;
  const size_t lp_result_bytes =
      lp_n * (lp_k + 1) * (sizeof(int32_t) + sizeof(float));
  std::vector<char> lp_host(lp_result_bytes);
  if (lp_n > 0) {
    SPECD_RETURN_IF_ERROR_(Ensure(&topk_, lp_index_bytes + lp_result_bytes));
    SPECD_CUDA_RETURN_(cudaMemcpyAsync(topk_.ptr, lp_rows.data(),
                                       lp_n * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, stream_),
                       "uploading logprob rows");
  }
  const bool timing = phase_timing_ && world_ == 1;
  if (timing) {
    for (cudaEvent_t &e : phase_events_) {
      if (e == nullptr)
        SPECD_CUDA_RETURN_(cudaEventCreate(&e), "creating a timing event");
    }
    SPECD_CUDA_RETURN_(cudaEventRecord(phase_events_[0], stream_),
                       "recording a timing event");
  }
  const auto t_upload = std::chrono::steady_clock::now();
  SPECD_RETURN_IF_ERROR_(UploadMeta(pack));
  SPECD_RETURN_IF_ERROR_(Execute(step));
  if (lp_n > 0) {
    char *base = static_cast<char *>(topk_.ptr);
    cuda::TopKLogprobsParams p;
    p.logits = static_cast<const float *>(logits_.ptr);
    p.logits_stride = vocab_rows_;
    p.row_index = reinterpret_cast<const int32_t *>(base);
    p.num_rows = lp_n;
    p.vocab_size = vocab;
    p.k = lp_k;
    p.ids = reinterpret_cast<int32_t *>(base + lp_index_bytes);
    p.logprobs = reinterpret_cast<float *>(p.ids + lp_n * lp_k);
    p.tokens = At<int32_t>(meta_.ptr, step.o_sampled);
    p.token_logprobs = p.logprobs + lp_n * lp_k;
    p.token_ranks = reinterpret_cast<int32_t *>(p.token_logprobs + lp_n);
    if (lp_k == 0) {
      p.ids = nullptr;
      p.logprobs = nullptr;
    }
    SPECD_CUDA_RETURN_(cuda::TopKLogprobsCuda(p, stream_), "logprobs launch");
    SPECD_CUDA_RETURN_(cudaMemcpyAsync(lp_host.data(), base + lp_index_bytes,
                                       lp_result_bytes, cudaMemcpyDeviceToHost,
                                       stream_),
                       "copying logprobs");
  }
  if (host_out_count_ < out_count) {
    if (host_out_ != nullptr)
      cudaFreeHost(host_out_);
    host_out_ = nullptr;
    host_out_count_ = 0;
    void *p = nullptr;
    SPECD_CUDA_RETURN_(cudaMallocHost(&p, out_count * sizeof(int32_t)),
                       "allocating pinned outcome memory");
    host_out_ = static_cast<int32_t *>(p);
    host_out_count_ = out_count;
  }
  SPECD_CUDA_RETURN_(cudaMemcpyAsync(host_out_,
                                     At<int32_t>(meta_.ptr, step.o_out),
                                     out_count * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, stream_),
                     "copying verify outcomes");
  if (timing) {
    SPECD_CUDA_RETURN_(cudaEventRecord(phase_events_[1], stream_),
                       "recording a timing event");
  }
  const auto t_launched = std::chrono::steady_clock::now();
  SPECD_CUDA_RETURN_(cudaStreamSynchronize(stream_), "verify step");
  const auto t_synced = std::chrono::steady_clock::now();

  const int32_t *out = host_out_;
  const int64_t launched = step.batch, stride = step.out_stride;
  std::vector<VerifyOutcome> outcomes(num_seqs);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int n = out[b];
    const int32_t *toks = out + launched + b * stride;
    const int32_t *nodes = out + launched + (launched + b) * stride;
    VerifyOutcome &o = outcomes[b];
    o.tokens.assign(toks, toks + n + 1);
    o.accepted_nodes.assign(nodes, nodes + n);
    o.accepted_draft = n;
    if (lp_first[b] >= 0) {
      // Token j was drawn from the row of its parent on the accepted path.
      const int32_t *ids = reinterpret_cast<const int32_t *>(lp_host.data());
      const float *lps = reinterpret_cast<const float *>(ids + lp_n * lp_k);
      const float *token_lps = lps + lp_n * lp_k;
      const int32_t *ranks =
          reinterpret_cast<const int32_t *>(token_lps + lp_n);
      for (int j = 0; j <= n; ++j) {
        const int64_t e =
            lp_first[b] + (j == 0 ? 0 : o.accepted_nodes[j - 1] + 1);
        TokenLogprobs &t = o.logprobs.emplace_back();
        t.logprob = token_lps[e];
        t.rank = ranks[e];
        for (int m = 0; m < std::min(items[b].logprobs, lp_k); ++m) {
          // Probability 0 (a -inf logit) is never listed, as on the host.
          if (std::isinf(lps[e * lp_k + m]))
            break;
          t.top.push_back({ids[e * lp_k + m], lps[e * lp_k + m]});
        }
      }
    }
    Sequence &s = *batch->seqs[b];
    s.committed += static_cast<int64_t>(items[b].pending.size()) + n;
    s.scratch_parents.clear();
    s.scratch_depth.clear();
    ReleaseBlocks(&s, CeilDiv(s.committed, kKvBlockTokens));
  }
  if (timing) {
    const auto us = [](auto a, auto b) {
      return std::chrono::duration<double, std::micro>(b - a).count();
    };
    float device_ms = 0;
    SPECD_CUDA_RETURN_(cudaEventElapsedTime(&device_ms, phase_events_[0],
                                            phase_events_[1]),
                       "reading a timing event");
    last_phases_.prepare_us = us(t_enter, t_upload);
    last_phases_.launch_us = us(t_upload, t_launched);
    last_phases_.wait_us = us(t_launched, t_synced);
    last_phases_.finish_us = us(t_synced, std::chrono::steady_clock::now());
    last_phases_.device_us = 1e3 * device_ms;
  }
  return outcomes;
}

} // namespace specd
