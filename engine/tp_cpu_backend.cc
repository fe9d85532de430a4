#include "engine/tp_cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/safetensors.h"
#include "engine/cpu_backend.h"
#include "engine/model_config.h"
#include "engine/thread_pool.h"
#include "engine/tp_plan.h"
#include "specd/kernels/kv_cache.h"
#include "specd/kernels/linear.h"
#include "specd/kernels/rmsnorm.h"
#include "specd/kernels/rope.h"
#include "specd/kernels/swiglu.h"
#include "specd/kernels/tree_attention.h"

namespace specd {
namespace {

#define SPECD_RETURN_IF_ERROR_(expr) \
  do {                               \
    absl::Status _s = (expr);        \
    if (!_s.ok()) return _s;         \
  } while (0)

// Which part of a checkpoint tensor a rank reads.
enum class Slice { kAll, kRows, kCols };

// Reads `name` after checking its full shape is `shape`, keeping rows (dim 0) or columns
// (dim 1) [range.begin, range.end) for kRows / kCols.
absl::Status ReadShard(const TensorStore& store, const std::string& name,
                       std::vector<int64_t> shape, Slice slice, TpRange range,
                       std::vector<float>* out) {
  absl::StatusOr<const TensorView*> view = store.Get(name);
  if (!view.ok()) return view.status();
  if ((*view)->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        (*view)->file, ": tensor ", name, " has shape [", absl::StrJoin((*view)->shape, ", "),
        "], expected [", absl::StrJoin(shape, ", "), "]"));
  }
  switch (slice) {
    case Slice::kAll: {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      out->assign(n, 0.0f);
      return store.ReadF32(name, shape, out->data());
    }
    case Slice::kRows: {
      const int64_t row = shape.size() > 1 ? shape[1] : 1;
      out->assign(range.size() * row, 0.0f);
      return store.ReadRowsF32(name, range.begin, range.end, out->data());
    }
    case Slice::kCols:
      out->assign(shape[0] * range.size(), 0.0f);
      return store.ReadColsF32(name, range.begin, range.end, out->data());
  }
  return absl::InternalError("unknown slice");
}

void Linear(const float* x, const std::vector<float>& w, const std::vector<float>* bias, float* y,
            int64_t rows, int64_t in, int64_t out, int64_t row_block);

class CpuRankExecutor : public TpRankExecutor {
 public:
  CpuRankExecutor(const ModelConfig& config, const TpPlan& plan, int rank,
                  std::shared_ptr<const TensorStore> store, int threads)
      : c_(config),
        kv_group_(plan.kv_group),
        rp_(plan.ranks[rank]),
        store_(std::move(store)),
        threads_(threads),
        inv_freq_(RopeInvFreq(config)) {}

  absl::Status Load() override;
  void ReserveKvBlocks(int64_t blocks) override;
  absl::Status Forward(const StepLayout& layout, TpCommunicator* comm, const Output& out) override;
  void CopyKvSlots(absl::Span<const int64_t> src, absl::Span<const int64_t> dst) override;

 private:
  struct LayerShard {
    std::vector<float> input_norm, post_norm;   // [H], replicated
    std::vector<float> q_proj, k_proj, v_proj;  // rows of the heads held
    std::vector<float> q_bias, k_bias, v_bias;  // same rows (Qwen2), else empty
    std::vector<float> q_norm, k_norm;          // [head_dim], replicated (Qwen3)
    std::vector<float> o_proj;                  // [H, local q dim]: input columns
    std::vector<float> gate_proj, up_proj;      // [local ffn, H]
    std::vector<float> down_proj;               // [H, local ffn]
  };

  int64_t local_q_heads() const { return rp_.q_heads.size(); }
  int64_t local_kv_dim() const { return rp_.kv_heads.size() * c_.head_dim; }
  void Norm(const float* x, float* residual, const std::vector<float>& w, float* out, int64_t rows,
            int64_t dim) const;

  const ModelConfig c_;
  const int64_t kv_group_;
  const TpRankPlan rp_;
  std::shared_ptr<const TensorStore> store_;
  const int threads_;
  int64_t row_block_ = kLinearRowBlock;
  std::unique_ptr<ThreadPool> pool_;
  std::vector<float> inv_freq_;
  std::vector<float> embed_, final_norm_, lm_head_;  // embed_ and lm_head_: [local vocab, H]
  std::vector<LayerShard> layers_;
  int64_t kv_blocks_ = 0;
  std::vector<std::vector<float>> k_pool_, v_pool_;  // per layer [slots, local kv dim]
};

absl::Status CpuRankExecutor::Load() {
  // The pool's workers belong to this rank, so they are created on its thread.
  pool_ = std::make_unique<ThreadPool>(threads_);
  const TensorStore& st = *store_;
  const int64_t h = c_.hidden_size, hd = c_.head_dim, f = c_.intermediate_size, v = c_.vocab_size;
  const int64_t q = int64_t{c_.num_heads} * hd, kv = int64_t{c_.num_kv_heads} * hd;
  const TpRange q_rows{rp_.q_heads.begin * hd, rp_.q_heads.end * hd};
  const TpRange kv_rows{rp_.kv_heads.begin * hd, rp_.kv_heads.end * hd};
  const TpRange none;
  SPECD_RETURN_IF_ERROR_(
      ReadShard(st, "model.embed_tokens.weight", {v, h}, Slice::kRows, rp_.vocab, &embed_));
  SPECD_RETURN_IF_ERROR_(ReadShard(st, "model.norm.weight", {h}, Slice::kAll, none, &final_norm_));
  if (!c_.tie_word_embeddings) {
    SPECD_RETURN_IF_ERROR_(
        ReadShard(st, "lm_head.weight", {v, h}, Slice::kRows, rp_.vocab, &lm_head_));
  }
  layers_.resize(c_.num_layers);
  for (int l = 0; l < c_.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    LayerShard& w = layers_[l];
    SPECD_RETURN_IF_ERROR_(
        ReadShard(st, p + "input_layernorm.weight", {h}, Slice::kAll, none, &w.input_norm));
    SPECD_RETURN_IF_ERROR_(
        ReadShard(st, p + "post_attention_layernorm.weight", {h}, Slice::kAll, none, &w.post_norm));
    SPECD_RETURN_IF_ERROR_(
        ReadShard(st, p + "self_attn.q_proj.weight", {q, h}, Slice::kRows, q_rows, &w.q_proj));
    SPECD_RETURN_IF_ERROR_(
        ReadShard(st, p + "self_attn.k_proj.weight", {kv, h}, Slice::kRows, kv_rows, &w.k_proj));
    SPECD_RETURN_IF_ERROR_(
        ReadShard(st, p + "self_attn.v_proj.weight", {kv, h}, Slice::kRows, kv_rows, &w.v_proj));
    if (c_.attention_bias) {
      SPECD_RETURN_IF_ERROR_(
          ReadShard(st, p + "self_attn.q_proj.bias", {q}, Slice::kRows, q_rows, &w.q_bias));
      SPECD_RETURN_IF_ERROR_(
          ReadShard(st, p + "self_attn.k_proj.bias", {kv}, Slice::kRows, kv_rows, &w.k_bias));
      SPECD_RETURN_IF_ERROR_(
          ReadShard(st, p + "self_attn.v_proj.bias", {kv}, Slice::kRows, kv_rows, &w.v_bias));
    }
    if (c_.qk_norm) {
      SPECD_RETURN_IF_ERROR_(
          ReadShard(st, p + "self_attn.q_norm.weight", {hd}, Slice::kAll, none, &w.q_norm));
      SPECD_RETURN_IF_ERROR_(
          ReadShard(st, p + "self_attn.k_norm.weight", {hd}, Slice::kAll, none, &w.k_norm));
    }
    SPECD_RETURN_IF_ERROR_(
        ReadShard(st, p + "self_attn.o_proj.weight", {h, q}, Slice::kCols, q_rows, &w.o_proj));
    SPECD_RETURN_IF_ERROR_(
        ReadShard(st, p + "mlp.gate_proj.weight", {f, h}, Slice::kRows, rp_.ffn, &w.gate_proj));
    SPECD_RETURN_IF_ERROR_(
        ReadShard(st, p + "mlp.up_proj.weight", {f, h}, Slice::kRows, rp_.ffn, &w.up_proj));
    SPECD_RETURN_IF_ERROR_(
        ReadShard(st, p + "mlp.down_proj.weight", {h, f}, Slice::kCols, rp_.ffn, &w.down_proj));
  }
  k_pool_.resize(c_.num_layers);
  v_pool_.resize(c_.num_layers);
  // As CpuBackend: every GEMM shape of this rank's shards is probed once for row invariance in
  // blocks (specd/kernels/linear.h), falling back to one sgemm per row where it fails.
  const LayerShard& w0 = layers_[0];
  const struct {
    const std::vector<float>* w;
    int64_t out, in;
  } shapes[] = {{&w0.q_proj, q_rows.size(), h},
                {&w0.k_proj, kv_rows.size(), h},
                {&w0.o_proj, h, q_rows.size()},
                {&w0.gate_proj, rp_.ffn.size(), h},
                {&w0.down_proj, h, rp_.ffn.size()},
                {lm_head_.empty() ? &embed_ : &lm_head_, rp_.vocab.size(), h}};
  row_block_ = kLinearRowBlock;
  for (const auto& s : shapes) {
    if (s.out == 0 || s.in == 0) continue;  // a part this rank does not hold
    if (!LinearRowBlockInvariant(s.w->data(), s.out, s.in)) {
      std::fprintf(stderr,
                   "specd tp cpu backend: this BLAS is not row-invariant in blocks of %lld for "
                   "a [%lld, %lld] weight; using one sgemm per row (slower, still lossless)\n",
                   static_cast<long long>(kLinearRowBlock), static_cast<long long>(s.out),
                   static_cast<long long>(s.in));
      row_block_ = 1;
      break;
    }
  }
  return absl::OkStatus();
}

void CpuRankExecutor::ReserveKvBlocks(int64_t blocks) {
  if (blocks <= kv_blocks_) return;
  const size_t elems = static_cast<size_t>(blocks * kKvBlockTokens * local_kv_dim());
  for (int l = 0; l < c_.num_layers; ++l) {
    k_pool_[l].resize(elems);
    v_pool_[l].resize(elems);
  }
  kv_blocks_ = blocks;
}

void CpuRankExecutor::CopyKvSlots(absl::Span<const int64_t> src, absl::Span<const int64_t> dst) {
  if (local_kv_dim() == 0) return;
  for (int l = 0; l < c_.num_layers; ++l) {
    KvCacheCopyParams p;
    p.k_cache = k_pool_[l].data();
    p.v_cache = v_pool_[l].data();
    p.src_slots = src.data();
    p.dst_slots = dst.data();
    p.num_copies = static_cast<int64_t>(src.size());
    p.kv_dim = local_kv_dim();
    KvCacheCopyCpu(p);
  }
}

void CpuRankExecutor::Norm(const float* x, float* residual, const std::vector<float>& w, float* out,
                           int64_t rows, int64_t dim) const {
  RmsNormParams p;
  p.x = x;
  p.residual = residual;
  p.weight = w.data();
  p.out = out;
  p.rows = rows;
  p.dim = dim;
  p.eps = c_.rms_norm_eps;
  RmsNormCpu(p);
}

void Linear(const float* x, const std::vector<float>& w, const std::vector<float>* bias, float* y,
            int64_t rows, int64_t in, int64_t out, int64_t row_block) {
  LinearParams p;
  p.x = x;
  p.w = w.data();
  p.bias = bias != nullptr && !bias->empty() ? bias->data() : nullptr;
  p.y = y;
  p.rows = rows;
  p.in_features = in;
  p.out_features = out;
  p.row_block = row_block;
  LinearCpu(p);
}

absl::Status CpuRankExecutor::Forward(const StepLayout& l, TpCommunicator* comm,
                                      const Output& out) {
  const int64_t T = l.num_tokens, H = c_.hidden_size, hd = c_.head_dim;
  const int64_t QH = local_q_heads(), KVH = rp_.kv_heads.size();
  const int64_t QD = QH * hd, KVD = KVH * hd, F = rp_.ffn.size(), V = rp_.vocab.size();
  std::vector<float> residual(T * H, 0.0f), normed(T * H), sub(T * H), q(T * QD), k(T * KVD),
      v(T * KVD), attn(T * QD), gate(T * F), up(T * F);

  // Vocab-parallel embedding: each token's row comes from the one rank that owns it; the
  // others add zeros, so the all-reduce reproduces the row exactly.
  for (int64_t t = 0; t < T; ++t) {
    if (rp_.vocab.contains(l.tokens[t])) {
      std::memcpy(&residual[t * H], &embed_[(l.tokens[t] - rp_.vocab.begin) * H],
                  sizeof(float) * H);
    }
  }
  comm->AllReduceSum(residual.data(), T * H);

  const auto rope = [&](float* x, int64_t heads) {
    RopeParams p;
    p.x = x;
    p.positions = l.positions.data();
    p.inv_freq = inv_freq_.data();
    p.num_tokens = T;
    p.num_heads = heads;
    p.head_dim = hd;
    p.row_stride = heads * hd;
    RopeCpu(p);
  };

  for (int layer = 0; layer < c_.num_layers; ++layer) {
    const LayerShard& w = layers_[layer];
    // The previous layer's (all-reduced) MLP output joins the residual stream here.
    Norm(layer == 0 ? residual.data() : sub.data(), layer == 0 ? nullptr : residual.data(),
         w.input_norm, normed.data(), T, H);
    if (QH > 0) {
      Linear(normed.data(), w.q_proj, &w.q_bias, q.data(), T, H, QD, row_block_);
      Linear(normed.data(), w.k_proj, &w.k_bias, k.data(), T, H, KVD, row_block_);
      Linear(normed.data(), w.v_proj, &w.v_bias, v.data(), T, H, KVD, row_block_);
      if (c_.qk_norm) {
        Norm(q.data(), nullptr, w.q_norm, q.data(), T * QH, hd);
        Norm(k.data(), nullptr, w.k_norm, k.data(), T * KVH, hd);
      }
      rope(q.data(), QH);
      rope(k.data(), KVH);

      KvCacheWriteParams kw;
      kw.k = k.data();
      kw.v = v.data();
      kw.k_cache = k_pool_[layer].data();
      kw.v_cache = v_pool_[layer].data();
      kw.slots = l.slots.data();
      kw.num_tokens = T;
      kw.kv_dim = KVD;
      KvCacheWriteCpu(kw);

      TreeAttentionParams ap;
      ap.q = q.data();
      ap.out = attn.data();
      ap.k_cache = k_pool_[layer].data();
      ap.v_cache = v_pool_[layer].data();
      ap.block_tables = l.block_tables.data();
      ap.query_seq = l.query_seq.data();
      ap.prefix_len = l.prefix_len.data();
      ap.tree_key_offsets = l.key_offsets.data();
      ap.tree_keys = l.tree_keys.data();
      ap.num_queries = T;
      ap.num_heads = QH;
      ap.num_kv_heads = KVH;
      ap.head_dim = hd;
      ap.block_size = kKvBlockTokens;
      ap.max_blocks_per_seq = l.max_blocks_per_seq;
      ap.scale = 1.0f / std::sqrt(static_cast<float>(hd));
      ap.kv_group = kv_group_;
      ap.q_head_offset = rp_.q_heads.begin;
      ap.kv_head_offset = rp_.kv_heads.begin;
      pool_->ParallelFor(
          T * QH, 1, [&ap](int64_t begin, int64_t end) { TreeAttentionCpuItems(ap, begin, end); });
      // Row-parallel o_proj: this rank's heads' share of the output.
      Linear(attn.data(), w.o_proj, nullptr, sub.data(), T, QD, H, row_block_);
    } else {
      std::fill(sub.begin(), sub.end(), 0.0f);
    }
    comm->AllReduceSum(sub.data(), T * H);

    Norm(sub.data(), residual.data(), w.post_norm, normed.data(), T, H);
    if (F > 0) {
      Linear(normed.data(), w.gate_proj, nullptr, gate.data(), T, H, F, row_block_);
      Linear(normed.data(), w.up_proj, nullptr, up.data(), T, H, F, row_block_);
      SwiGluParams sp;
      sp.gate = gate.data();
      sp.up = up.data();
      sp.out = gate.data();
      sp.n = T * F;
      SwiGluCpu(sp);
      Linear(gate.data(), w.down_proj, nullptr, sub.data(), T, F, H, row_block_);
    } else {
      std::fill(sub.begin(), sub.end(), 0.0f);
    }
    comm->AllReduceSum(sub.data(), T * H);
  }

  // Every rank holds the same residual stream, so each normalises the requested rows itself
  // and computes the logits of its vocabulary range only.
  const int64_t R = static_cast<int64_t>(l.logit_tokens.size());
  if (out.candidates != nullptr) {
    for (int64_t r = 0; r < R; ++r) out.candidates[r * comm->world_size() + comm->rank()] = {};
  }
  if (V == 0 || R == 0) return absl::OkStatus();
  std::vector<float> last_sub(R * H), last_res(R * H), last_norm(R * H), shard(R * V);
  for (int64_t r = 0; r < R; ++r) {
    std::memcpy(&last_sub[r * H], &sub[l.logit_tokens[r] * H], sizeof(float) * H);
    std::memcpy(&last_res[r * H], &residual[l.logit_tokens[r] * H], sizeof(float) * H);
  }
  Norm(last_sub.data(), last_res.data(), final_norm_, last_norm.data(), R, H);
  Linear(last_norm.data(), lm_head_.empty() ? embed_ : lm_head_, nullptr, shard.data(), R, H, V,
         row_block_);
  for (int64_t r = 0; r < R; ++r) {
    const float* row = &shard[r * V];
    if (out.logits != nullptr) {
      std::memcpy(out.logits + r * c_.vocab_size + rp_.vocab.begin, row, sizeof(float) * V);
    }
    if (out.candidates != nullptr) {
      out.candidates[r * comm->world_size() + comm->rank()] = ShardCandidate(
          absl::Span<const float>(row, V), rp_.vocab, *out.row_sampling[r], out.row_position[r]);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TensorParallelBackend>> CreateTpCpuBackend(
    const std::string& dir, const BackendOptions& options) {
  if (options.kv_capacity_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_capacity_tokens must be positive, got ", options.kv_capacity_tokens));
  }
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_threads must be >= 0, got ", options.num_threads));
  }
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  if (!config.ok()) return config.status();
  absl::StatusOr<TpPlan> plan = MakeTpPlan(*config, options.tensor_parallel);
  if (!plan.ok()) return plan.status();
  absl::StatusOr<std::unique_ptr<TensorStore>> store = TensorStore::OpenFolder(dir);
  if (!store.ok()) return store.status();
  std::shared_ptr<const TensorStore> shared_store(std::move(*store));

  const int n = plan->world_size;
  int threads = options.num_threads;
  if (threads == 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (n > 1) openblas_set_num_threads(1);  // see the header: one BLAS thread per rank thread
  const int per_rank = std::max(1, threads / n);

  std::vector<std::unique_ptr<TpRankExecutor>> executors;
  for (int r = 0; r < n; ++r) {
    executors.push_back(
        std::make_unique<CpuRankExecutor>(*config, *plan, r, shared_store, per_rank));
  }
  absl::StatusOr<std::unique_ptr<TensorParallelBackend>> backend = TensorParallelBackend::Create(
      *config, *plan, std::move(executors), std::make_unique<InProcessCommGroup>(n), kKvBlockTokens,
      options.kv_capacity_tokens);
  return backend;
}

}  // namespace specd
