#include "engine/cuda/cuda_forward.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/io/load_progress.h"
#include "common/io/safetensors.h"
#include "engine/cuda/cuda_status.h"
#include "engine/cuda/custom_allreduce.h"
#include "engine/cuda/nccl_group.h"
#include "engine/kv/paged_kv_table.h"
#include "specd/kernels/cuda/allreduce.h"
#include "specd/kernels/cuda/embedding.h"
#include "specd/kernels/cuda/kv_cache.h"
#include "specd/kernels/cuda/logits_processors.h"
#include "specd/kernels/cuda/rmsnorm.h"
#include "specd/kernels/cuda/sampling.h"
#include "specd/kernels/cuda/swiglu.h"
#include "specd/kernels/cuda/topk.h"
#include "specd/kernels/cuda/tree_accept.h"

namespace specd {
namespace {

// The device memory the KV pools leave free for activations, cuBLASLt and the split-KV
// workspace.
constexpr size_t kReserveBytes = size_t{2} << 30;

// All-reduce sites of a step (specd/kernels/cuda/allreduce.h): the embedding, then each layer's
// attention and MLP. Consecutive all-reduces never share a site (..., attn, mlp, | embed, attn,
// ...), which is what lets the one-shot kernel skip its end barrier; kCudaAllReduceSites in all,
// whatever the depth.
constexpr int kEmbedSite = 2;
constexpr int kAttnSite = 0;
constexpr int kMlpSite = 1;
static_assert(kEmbedSite < kCudaAllReduceSites && kAttnSite < kCudaAllReduceSites &&
              kMlpSite < kCudaAllReduceSites);

}  // namespace

CudaForward::CudaForward(const ModelConfig& config, int device, const BackendOptions& options,
                         const CudaTpRank* tp, const CudaTuning& tuning)
    : config_(config), device_(device), options_(options), tuning_(tuning) {
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
    for (const TpRankPlan& rp : tp_.plan->ranks) {
      vocab_rows_max_ = std::max(vocab_rows_max_, rp.vocab.size());
    }
  }
  kv_dim_ = kv_heads_ * config_.head_dim;
  l2_discard_ = tuning_.l2_discard;
  l2_discard_min_tokens_ = tuning_.l2_discard_min_tokens;
  if (world_ == 1) residual_splits_ = tuning_.residual_splits;
}

CudaForward::~CudaForward() {
  if (cudaSetDevice(device_) != cudaSuccess) return;
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  // The GEMM algorithms this process ended up with, per weight shape and row class (benchmark
  // runs: which cuBLASLt kernel a step's time went to).
  if (gemm_ != nullptr && tuning_.gemm_summary) {
    std::fprintf(stderr, "GEMM picks, device %d:\n%s", device_, gemm_->Summary().c_str());
  }
  gemm_.reset();
  Buffers& b = buffers_;
  for (Scratch* s : {&b.meta,        &b.residual,  &b.x,    &b.split,      &b.normed,   &b.qkv,
                     &b.attn,        &b.gate_up,   &b.act,  &b.last,       &b.logits,   &b.attn_ws,
                     &b.sample_ws,   &b.verify,    &b.topk, &b.cand_local, &b.cand_all, &b.gathered,
                     &b.full_logits, &b.processed, &b.taps}) {
    if (s->ptr != nullptr) cudaFree(s->ptr);
  }
  for (bf16* pool : {k_pool_, v_pool_}) {
    if (pool != nullptr) cudaFree(pool);
  }
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status CudaForward::Init() {
  SPECD_CUDA_RETURN_(cudaSetDevice(device_), absl::StrCat("selecting cuda:", device_));
  SPECD_CUDA_RETURN_(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                     "creating a stream");
  SPECD_CUDA_RETURN_(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_),
                     "reading the multiprocessor count");
  // 128 MiB of cuBLASLt workspace: split-K algorithms of the narrow, deep weights (down_proj)
  // need room for up to cuda_gemm_invariant_rows rows of partial sums to qualify as the one
  // row-invariant algorithm of their shape. Row classes that end at the graph buckets of a
  // batch-1 verify step (the pending token and 2^j tree nodes); SPECD_GEMM_CLASSES=pow2 restores
  // the plain doubling classes, SPECD_GEMM_TIMING=0 picks algorithms without timing them, the
  // same in every process (A/B runs), and SPECD_GEMM_RETILE=0 keeps row classes to cuBLASLt's
  // own candidates.
  if (cublasStatus_t st =
          cuda::Gemm::Create(size_t{128} << 20, &gemm_, options_.cuda_gemm_invariant_rows,
                             /*plan_rows=*/16,
                             /*bucket_classes=*/tuning_.gemm_bucket_classes,
                             /*timed_picks=*/tuning_.gemm_timed_picks,
                             /*retile=*/tuning_.gemm_retile);
      st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cuda backend: cuBLASLt: ", cublasLtGetStatusString(st)));
  }

  absl::StatusOr<std::unique_ptr<TensorStore>> opened = TensorStore::OpenFolder(config_.dir);
  if (!opened.ok()) return opened.status();
  // One line per device: with tensor parallelism each rank places its own shards.
  LoadProgress progress(absl::StrCat("cuda:", device_));
  SPECD_RETURN_IF_ERROR_(weights_.Load(**opened, config_, slice_, &progress));
  progress.Finish();
  SPECD_RETURN_IF_ERROR_(ReserveStepBuffers());
  return AllocateKvPools();
}

absl::Status CudaForward::ReserveStepBuffers() {
  const ReservedStep reserved =
      ReservedStepShape(options_.cuda_gemm_invariant_rows, config_.head_dim, world_ > 1);
  const CudaStep& step = reserved.step;
  SPECD_RETURN_IF_ERROR_(PrepareBuffers(step, reserved.meta_bytes));
  // EnqueueTopK's layout at the largest k (its row list travels in the step's metadata).
  return Ensure(&buffers_.topk, TopKBufferBytes(step.R, kMaxForwardTopK));
}

size_t CudaForward::TopKBufferBytes(int64_t rows, int k) const {
  return TopKWorkspaceOffset(rows, k) +
         static_cast<size_t>(cuda::TopKWorkspaceBytes(rows, config_.vocab_size, k));
}

size_t CudaForward::TopKWorkspaceOffset(int64_t rows, int k) {
  return (static_cast<size_t>(rows) * k * (sizeof(int32_t) + sizeof(float)) + 15) / 16 * 16;
}

absl::Status CudaForward::AllocateKvPools() {
  // The requested capacity, or what the free memory allows.
  absl::StatusOr<KvPools> pools =
      specd::AllocateKvPools(config_.num_layers, kv_dim_, options_.kv_capacity_tokens,
                             kReserveBytes, device_, "the KV cache after the weights");
  if (!pools.ok()) return pools.status();
  k_pool_ = pools->k;
  v_pool_ = pools->v;
  num_blocks_ = pools->num_blocks;
  layer_stride_ = pools->layer_stride;
  if (num_blocks_ * kKvBlockTokens < options_.kv_capacity_tokens) {
    std::fprintf(stderr,
                 "specd cuda backend: KV capacity clamped to %lld tokens by device memory\n",
                 static_cast<long long>(num_blocks_ * kKvBlockTokens));
  }
  return absl::OkStatus();
}

StepPlanOptions CudaForward::PlanOptions() const {
  StepPlanOptions o;
  o.block_tokens = kKvBlockTokens;
  o.hidden = config_.hidden_size;
  o.head_dim = config_.head_dim;
  o.heads = heads_;
  o.kv_heads = kv_heads_;
  o.kv_group = config_.num_heads / config_.num_kv_heads;
  o.num_sms = num_sms_;
  o.custom_allreduce_max_bytes = world_ > 1 && tp_.custom != nullptr ? tp_.custom->max_bytes() : -1;
  o.shared_spine = tuning_.shared_spine;
  o.attn_chunks_per_cta = tuning_.attn_chunks_per_cta;
  return o;
}

absl::Status CudaForward::CopyKvSlots(absl::Span<const int64_t> src,
                                      absl::Span<const int64_t> dst) {
  if (src.empty()) return absl::OkStatus();
  SPECD_CUDA_RETURN_(cudaSetDevice(device_), "selecting the device");
  StepPacker pack;
  const size_t o_src = pack.Add(src.data(), src.size()), o_dst = pack.Add(dst.data(), dst.size());
  SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.verify, pack.bytes().size()));
  SPECD_CUDA_RETURN_(cudaMemcpyAsync(buffers_.verify.ptr, pack.bytes().data(), pack.bytes().size(),
                                     cudaMemcpyHostToDevice, stream_),
                     "uploading commit slots");
  cuda::KvCacheCopyParams p;
  p.k_cache = k_pool_;
  p.v_cache = v_pool_;
  p.num_layers = config_.num_layers;
  p.layer_stride = layer_stride_;
  p.src_slots = MetaAt<int64_t>(buffers_.verify.ptr, o_src);
  p.dst_slots = MetaAt<int64_t>(buffers_.verify.ptr, o_dst);
  p.num_copies = static_cast<int64_t>(src.size());
  p.kv_dim = kv_dim_;
  SPECD_CUDA_RETURN_(cuda::KvCacheCopyCuda(p, stream_), "KV copy");
  return absl::OkStatus();
}

bool CudaForward::DropDead(const CudaStep& step) const {
  return l2_discard_ && step.T >= l2_discard_min_tokens_;
}

int CudaForward::SiteSplits(int site) const {
  // The depth of the site's GEMM: o_proj reads the attention output, down_proj
  // the MLP's activations; the embedding has no GEMM.
  const int64_t k = site == kAttnSite ? heads_ * config_.head_dim : site == kMlpSite ? ffn_ : 0;
  return k > 0 && residual_splits_ > 1 && cuda::Gemm::KSplitFits(k, residual_splits_)
             ? residual_splits_
             : 1;
}

absl::Status CudaForward::Ensure(Scratch* s, size_t bytes) {
  bool grown = false;
  SPECD_RETURN_IF_ERROR_(EnsureDeviceScratch(s, bytes, stream_, &grown));
  // Commit()'s slot lists are read by launches outside the captured step: growing them leaves
  // every graph valid. (The top-k rows are written inside it, by the graph of a draft level.)
  if (grown && s != &buffers_.verify) ++buffer_generation_;
  return absl::OkStatus();
}

absl::Status CudaForward::PrepareBuffers(const CudaStep& step, size_t meta_bytes) {
  const ModelConfig& c = config_;
  const int64_t T = step.T, R = std::max<int64_t>(step.R, 1);
  const int64_t H = c.hidden_size, F = ffn_;
  const int64_t QD = heads_ * c.head_dim, QKVD = QD + 2 * kv_dim_;
  SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.meta, meta_bytes));
  SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.residual, T * H * sizeof(float)));
  SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.x, T * H * sizeof(bf16)));
  if (residual_splits_ > 1) {
    SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.split, residual_splits_ * T * H * sizeof(float)));
  }
  SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.normed, T * H * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.qkv, T * QKVD * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.attn, T * QD * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.gate_up, T * 2 * F * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.act, T * F * sizeof(bf16)));
  SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.last, R * H * sizeof(bf16)));
  // The all-gather of top-k / top-p rows sends vocab_rows_max_ columns a row.
  SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.logits, R * vocab_rows_max_ * sizeof(float)));
  SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.attn_ws, step.ws_floats * sizeof(float)));
  SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.sample_ws, cuda::SampleWorkspaceBytes(R, c.vocab_size)));
  if (!step.tap_layers.empty()) {
    SPECD_RETURN_IF_ERROR_(Ensure(
        &buffers_.taps, T * static_cast<int64_t>(step.tap_layers.size()) * H * sizeof(float)));
  }
  if (world_ > 1 && step.verify) {
    const size_t cand = sizeof(cuda::SampleCandidate);
    SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.cand_local, R * cand));
    SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.cand_all, world_ * R * cand));
  }
  if (world_ > 1 && ((step.verify && step.gather_logits) || step.topk_k > 0)) {
    SPECD_RETURN_IF_ERROR_(
        Ensure(&buffers_.gathered, world_ * R * vocab_rows_max_ * sizeof(float)));
    SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.full_logits, R * c.vocab_size * sizeof(float)));
  }
  if (step.topk_k > 0) {
    SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.topk, TopKBufferBytes(step.topk_rows, step.topk_k)));
  }
  if (step.verify && step.processors) {
    SPECD_RETURN_IF_ERROR_(Ensure(&buffers_.processed, R * c.vocab_size * sizeof(float)));
  }
  return absl::OkStatus();
}

absl::Status CudaForward::UploadMeta(const StepPacker& pack) {
  // Every step ends with a stream synchronisation (PinnedUploader's condition).
  return uploader_.Upload(pack.bytes(), buffers_.meta.ptr, stream_);
}

CudaForward::bf16* CudaForward::Partial(const CudaStep& step, int site) {
  if (step.custom_allreduce) return tp_.custom->input(tp_.rank, site);
  return static_cast<bf16*>(buffers_.x.ptr);
}

absl::Status CudaForward::ReduceNorm(const CudaStep& step, int site, bool init, const float* weight,
                                     cuda::DeadRows dead0, cuda::DeadRows dead1) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size;
  float* residual = static_cast<float*>(buffers_.residual.ptr);
  bf16* normed = static_cast<bf16*>(buffers_.normed.ptr);
  bf16* x = static_cast<bf16*>(buffers_.x.ptr);
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
    SPECD_RETURN_IF_ERROR_(
        tp_.nccl->AllReduceSum(tp_.rank, x, x, static_cast<size_t>(step.T * H), stream_));
  }
  cuda::RmsNormParams p;
  if (const int k_splits = SiteSplits(site); k_splits > 1) {
    p.partials = static_cast<const float*>(buffers_.split.ptr);
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
absl::Status CudaForward::Enqueue(const CudaStep& step) {
  const ModelConfig& c = config_;
  const int64_t T = step.T, R = step.R;
  const int64_t H = c.hidden_size, hd = c.head_dim;
  // This rank's widths (the whole model's without tensor parallelism).
  const int64_t QD = heads_ * hd, KVD = kv_dim_, QKVD = QD + 2 * KVD, F = ffn_;
  void* meta = buffers_.meta.ptr;
  bf16* normed = static_cast<bf16*>(buffers_.normed.ptr);
  bf16* qkv = static_cast<bf16*>(buffers_.qkv.ptr);
  bf16* attn = static_cast<bf16*>(buffers_.attn.ptr);
  bf16* gate_up = static_cast<bf16*>(buffers_.gate_up.ptr);
  bf16* act = static_cast<bf16*>(buffers_.act.ptr);
  const int32_t* block_tables = MetaAt<int32_t>(meta, step.o_tables);

  // Vocabulary-parallel embedding: a rank gathers the rows it holds and zeros
  // for the others, so the all-reduce that starts the residual stream is exact.
  cuda::EmbeddingParams emb;
  emb.tokens = MetaAt<int32_t>(meta, step.o_tokens);
  emb.table = weights_.embed();
  emb.out = Partial(step, kEmbedSite);
  emb.num_tokens = T;
  emb.vocab_size = vocab_rows_;
  emb.vocab_offset = slice_.vocab.begin;
  emb.hidden = H;
  SPECD_CUDA_RETURN_(cuda::EmbeddingCuda(emb, stream_), "embedding");

  // A sublayer's output (o_proj, down_proj): a K-split GEMM into buffers_.split whose
  // slabs the site's norm adds, or bf16 into the site's partial (buffers_.x without
  // tensor parallelism).
  const auto sublayer_out = [&](const bf16* in, const bf16* weight, int64_t k, int site) {
    const int k_splits = SiteSplits(site);
    return k_splits > 1 ? Gemm(in, weight, nullptr, buffers_.split.ptr, true, T, H, k, k_splits)
                        : Gemm(in, weight, nullptr, Partial(step, site), false, T, H, k);
  };
  // Copies the residual stream ([T, hidden] fp32, whole on every rank once the norm that
  // all-reduced it ran) into the taps columns of every tap naming `layer`: device to device,
  // so a captured graph replays them too.
  const int64_t tap_width = static_cast<int64_t>(step.tap_layers.size()) * H;
  const auto capture = [&](int layer) -> absl::Status {
    for (size_t i = 0; i < step.tap_layers.size(); ++i) {
      if (step.tap_layers[i] != layer) continue;
      SPECD_CUDA_RETURN_(
          cudaMemcpy2DAsync(static_cast<float*>(buffers_.taps.ptr) + i * H,
                            tap_width * sizeof(float), buffers_.residual.ptr, H * sizeof(float),
                            H * sizeof(float), T, cudaMemcpyDeviceToDevice, stream_),
          "copying a residual-stream tap");
    }
    return absl::OkStatus();
  };
  // Buffers dead once the next GEMM has read them; the kernel after it drops
  // them from L2 (l2_discard_).
  const cuda::DeadRows act_rows{act, F * static_cast<int64_t>(sizeof(bf16))};
  for (int l = 0; l < c.num_layers; ++l) {
    const CudaLayerWeights& w = weights_.layer(l);
    // Layer 0 starts the residual stream from the embedding; later layers add
    // the previous MLP's output to it.
    SPECD_RETURN_IF_ERROR_(ReduceNorm(step, l == 0 ? kEmbedSite : kMlpSite, l == 0, w.input_norm,
                                      l == 0 ? cuda::DeadRows{} : act_rows));
    SPECD_RETURN_IF_ERROR_(capture(l));  // the norm added the previous MLP: the stream entering l
    SPECD_RETURN_IF_ERROR_(Gemm(normed, w.qkv, w.qkv_bias, qkv, false, T, QKVD, H));

    AttentionLaunch a;
    a.heads = heads_;
    a.kv_heads = kv_heads_;
    a.kv_group = c.num_heads / c.num_kv_heads;
    a.head_dim = hd;
    a.q_head_offset = slice_.q_heads.begin;
    a.kv_head_offset = slice_.kv_heads.begin;
    a.inv_freq = weights_.inv_freq();
    a.q_norm = w.q_norm;
    a.k_norm = w.k_norm;
    a.norm_eps = c.rms_norm_eps;
    a.k_cache = k_pool_ + l * layer_stride_;
    a.v_cache = v_pool_ + l * layer_stride_;
    a.workspace = static_cast<float*>(buffers_.attn_ws.ptr);
    a.discard_workspace = DropDead(step);
    SPECD_RETURN_IF_ERROR_(EnqueueStepAttention(step, meta, qkv, attn, a, stream_));

    SPECD_RETURN_IF_ERROR_(sublayer_out(attn, w.o_proj, QD, kAttnSite));
    SPECD_RETURN_IF_ERROR_(ReduceNorm(step, kAttnSite, false, w.post_norm,
                                      {qkv, QKVD * static_cast<int64_t>(sizeof(bf16))},
                                      {attn, QD * static_cast<int64_t>(sizeof(bf16))}));
    SPECD_RETURN_IF_ERROR_(Gemm(normed, w.gate_up, nullptr, gate_up, false, T, 2 * F, H));
    cuda::SwiGluParams sw;
    sw.gate_up = gate_up;
    sw.out = act;
    sw.rows = T;
    sw.dim = F;
    sw.discard_gate_up = DropDead(step);
    if (sw.discard_gate_up) sw.dead = {normed, H * static_cast<int64_t>(sizeof(bf16))};
    SPECD_CUDA_RETURN_(cuda::SwiGluCuda(sw, stream_), "SwiGLU");
    SPECD_RETURN_IF_ERROR_(sublayer_out(act, w.down, F, kMlpSite));
  }
  // Final norm of every token (cheap next to the LM head), then the requested
  // rows only.
  SPECD_RETURN_IF_ERROR_(ReduceNorm(step, c.num_layers == 0 ? kEmbedSite : kMlpSite,
                                    c.num_layers == 0, weights_.final_norm(),
                                    c.num_layers == 0 ? cuda::DeadRows{} : act_rows));
  SPECD_RETURN_IF_ERROR_(capture(c.num_layers));  // the last layer's output, pre-norm
  // FinalNormTap (an EAGLE-1/2 head's feature): the bf16 rows the LM head reads, widened. Whole
  // on every rank: the norm ran on the all-reduced stream.
  for (size_t i = 0; i < step.tap_layers.size(); ++i) {
    if (step.tap_layers[i] != FinalNormTap(c.num_layers)) continue;
    cuda::Bf16ToF32Params wp;
    wp.src = normed;
    wp.src_stride = H;
    wp.dst = static_cast<float*>(buffers_.taps.ptr) + i * H;
    wp.dst_stride = tap_width;
    wp.rows = T;
    wp.dim = H;
    SPECD_CUDA_RETURN_(cuda::Bf16ToF32Cuda(wp, stream_), "copying the final norm tap");
  }
  if (R == 0) return absl::OkStatus();
  SPECD_RETURN_IF_ERROR_(
      EnqueueGatherRows(step, meta, normed, H, static_cast<bf16*>(buffers_.last.ptr), stream_));
  SPECD_RETURN_IF_ERROR_(Gemm(static_cast<bf16*>(buffers_.last.ptr), weights_.lm_head(), nullptr,
                              buffers_.logits.ptr, true, R, vocab_rows_, H));
  if (step.topk_k > 0) return EnqueueTopK(step);
  if (!step.verify) return absl::OkStatus();

  // Verify: sample every row, accept along each tree, compact the accepted KV.
  int32_t* accepted = MetaAt<int32_t>(meta, step.o_out);
  int32_t* out_tokens = accepted + step.batch;
  int32_t* out_nodes = out_tokens + step.batch * step.out_stride;
  int32_t* sampled = MetaAt<int32_t>(meta, step.o_sampled);
  SPECD_RETURN_IF_ERROR_(SampleRows(step, sampled));

  cuda::TreeAcceptParams tp;
  tp.sampled = sampled;
  tp.sample_offset = MetaAt<int32_t>(meta, step.o_sample_offset);
  tp.tree_tokens = MetaAt<int32_t>(meta, step.o_tree_tokens);
  tp.tree_parents = MetaAt<int32_t>(meta, step.o_tree_parents);
  tp.node_offset = MetaAt<int32_t>(meta, step.o_node_offset);
  tp.num_nodes = MetaAt<int32_t>(meta, step.o_num_nodes);
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
  cp.seq_rows = MetaAt<int32_t>(meta, step.o_seq_rows);
  cp.base_slot = MetaAt<int32_t>(meta, step.o_base_slot);
  cp.nodes = out_nodes;
  cp.num_nodes = accepted;
  cp.node_stride = step.out_stride;
  cp.num_seqs = step.batch;
  SPECD_CUDA_RETURN_(cuda::KvCacheCompactCuda(cp, stream_), "KV compaction");
  return absl::OkStatus();
}

absl::Status CudaForward::SampleRows(const CudaStep& step, int32_t* tokens) {
  const int64_t R = step.R, vocab = config_.vocab_size;
  cuda::SampleParams sp;
  sp.logits = static_cast<const float*>(buffers_.logits.ptr);
  sp.logits_stride = vocab_rows_;
  sp.rows = MetaAt<cuda::SampleRowParams>(buffers_.meta.ptr, step.o_row_params);
  sp.tokens = tokens;
  sp.num_rows = R;
  sp.vocab_size = vocab_rows_;
  sp.workspace = buffers_.sample_ws.ptr;
  if (world_ > 1 && !step.gather_logits) {
    // Greedy and plain temperature: each rank reduces its shard to one
    // candidate a row (Gumbel noise keyed by the global token id), and the
    // candidates' reduction is the choice over the whole row.
    sp.vocab_offset = slice_.vocab.begin;
    sp.candidates = static_cast<cuda::SampleCandidate*>(buffers_.cand_local.ptr);
    SPECD_CUDA_RETURN_(cuda::SampleCuda(sp, stream_), "sampling candidates");
    // The candidates travel as 32-bit words (NCCL moves bytes alike).
    static_assert(sizeof(cuda::SampleCandidate) % sizeof(int32_t) == 0);
    SPECD_RETURN_IF_ERROR_(tp_.nccl->AllGather(
        tp_.rank, static_cast<const int32_t*>(buffers_.cand_local.ptr),
        static_cast<int32_t*>(buffers_.cand_all.ptr),
        static_cast<size_t>(R) * sizeof(cuda::SampleCandidate) / sizeof(int32_t), stream_));
    cuda::ReduceCandidatesParams rp;
    rp.candidates = static_cast<const cuda::SampleCandidate*>(buffers_.cand_all.ptr);
    rp.world_size = world_;
    rp.num_rows = R;
    rp.tokens = tokens;
    SPECD_CUDA_RETURN_(cuda::ReduceCandidatesCuda(rp, stream_), "reducing sampling candidates");
    return absl::OkStatus();
  }
  if (world_ > 1) {
    // Top-k / top-p, the logits processors and logprobs need the whole row.
    SPECD_RETURN_IF_ERROR_(GatherLogits(step, /*place=*/true));
    sp.logits = static_cast<const float*>(buffers_.full_logits.ptr);
    sp.logits_stride = vocab;
    sp.vocab_size = vocab;
  }
  if (step.processors) {
    cuda::LogitsProcessorsParams lp;
    lp.in = sp.logits;
    lp.in_stride = sp.logits_stride;
    lp.out = static_cast<float*>(buffers_.processed.ptr);
    lp.out_stride = vocab;
    lp.num_rows = R;
    lp.vocab_size = vocab;
    lp.rows = MetaAt<cuda::LogitsProcessorRow>(buffers_.meta.ptr, step.o_proc_rows);
    lp.seqs = MetaAt<cuda::LogitsProcessorSeq>(buffers_.meta.ptr, step.o_proc_seqs);
    lp.data = MetaAt<int32_t>(buffers_.meta.ptr, step.o_proc_data);
    SPECD_CUDA_RETURN_(cuda::LogitsProcessorsCuda(lp, stream_), "logits processors");
    sp.logits = lp.out;
    sp.logits_stride = vocab;
  }
  if (step.kept_lower) sp.kept_lower = MetaAt<uint64_t>(buffers_.meta.ptr, step.o_kept_lower);
  SPECD_CUDA_RETURN_(cuda::SampleCuda(sp, stream_), "sampling");
  return absl::OkStatus();
}

absl::Status CudaForward::GatherLogits(const CudaStep& step, bool place) {
  // Every rank's [R, rows_r] logits at a common stride, then side by side.
  const int64_t R = step.R, vocab = config_.vocab_size;
  const size_t stride = static_cast<size_t>(R) * vocab_rows_max_;
  SPECD_RETURN_IF_ERROR_(
      tp_.nccl->AllGather(tp_.rank, static_cast<const float*>(buffers_.logits.ptr),
                          static_cast<float*>(buffers_.gathered.ptr), stride, stream_));
  if (!place) return absl::OkStatus();
  float* full = static_cast<float*>(buffers_.full_logits.ptr);
  for (int r = 0; r < world_; ++r) {
    const TpRange v = tp_.plan->ranks[r].vocab;
    SPECD_CUDA_RETURN_(
        cudaMemcpy2DAsync(full + v.begin, vocab * sizeof(float),
                          static_cast<const float*>(buffers_.gathered.ptr) + r * stride,
                          v.size() * sizeof(float), v.size() * sizeof(float), R,
                          cudaMemcpyDeviceToDevice, stream_),
        "placing gathered logits");
  }
  return absl::OkStatus();
}

absl::Status CudaForward::EnqueueTopK(const CudaStep& step) {
  const int64_t vocab = config_.vocab_size;
  cuda::TopKLogprobsParams p;
  p.logits = static_cast<const float*>(buffers_.logits.ptr);
  p.logits_stride = vocab_rows_;
  if (world_ > 1) {
    // A rank holds a slice of each row: the whole rows meet on rank 0, which alone ranks them
    // (the others only contribute to the collective).
    SPECD_RETURN_IF_ERROR_(GatherLogits(step, /*place=*/tp_.rank == 0));
    if (tp_.rank != 0) return absl::OkStatus();
    p.logits = static_cast<const float*>(buffers_.full_logits.ptr);
    p.logits_stride = vocab;
  }
  p.row_index = MetaAt<int32_t>(buffers_.meta.ptr, step.o_topk_rows);
  p.num_rows = step.topk_rows;
  p.vocab_size = vocab;
  p.k = step.topk_k;
  p.ids = static_cast<int32_t*>(buffers_.topk.ptr);
  p.logprobs = reinterpret_cast<float*>(p.ids + step.topk_rows * step.topk_k);
  // The split path's scratch follows the results (a draft level ranks few rows of a large
  // vocabulary: one CTA a row would leave most SMs idle). Its launch shape depends on the
  // bucket's rows only, so the level's graph keeps it.
  const size_t offset = TopKWorkspaceOffset(step.topk_rows, step.topk_k);
  p.workspace = static_cast<char*>(buffers_.topk.ptr) + offset;
  p.workspace_bytes = static_cast<int64_t>(buffers_.topk.bytes - offset);
  SPECD_CUDA_RETURN_(cuda::TopKLogprobsCuda(p, stream_), "top-k");
  return absl::OkStatus();
}

const float* CudaForward::VerifyLogits(const CudaStep& step, bool processed, int64_t* stride) {
  if (processed && step.processors) {
    *stride = config_.vocab_size;
    return static_cast<const float*>(buffers_.processed.ptr);
  }
  if (world_ > 1 && step.gather_logits) {
    *stride = config_.vocab_size;
    return static_cast<const float*>(buffers_.full_logits.ptr);
  }
  *stride = vocab_rows_;
  return static_cast<const float*>(buffers_.logits.ptr);
}

absl::Status CudaForward::Gemm(const bf16* x, const bf16* w, const bf16* bias, void* y, bool y_fp32,
                               int64_t m, int64_t n, int64_t k, int k_splits) {
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
  return RunGemm(*gemm_, p, stream_, "cuda backend");
}
}  // namespace specd
