#include "engine/cpu/cpu_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/tp/tp_backend.h"
#include "engine/tp/weight_shard.h"
#include "specd/kernels/kv_cache.h"
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

// Below this many multiply-adds (keys x heads x head_dim), attention runs on the calling thread.
constexpr int64_t kInlineAttentionWork = 1 << 16;
// Below this many multiply-adds (rows x in x out), a GEMM runs on the calling thread; threads get
// whole groups of this many output columns (a multiple of every ISA's tile width).
constexpr int64_t kInlineLinearWork = 1 << 18;
constexpr int64_t kLinearColumnGroup = 24;

}  // namespace

absl::Status CheckCpuBackendOptions(const BackendOptions& options) {
  if (options.kv_capacity_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_capacity_tokens must be positive, got ", options.kv_capacity_tokens));
  }
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_threads must be >= 0, got ", options.num_threads));
  }
  return absl::OkStatus();
}

int CpuBackendThreads(const BackendOptions& options) {
  if (options.num_threads > 0) return options.num_threads;
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

void LinearOnPool(const LinearParams& p, ThreadPool* pool) {
  if (pool == nullptr || pool->num_threads() == 1 ||
      p.rows * p.in_features * p.out_features < kInlineLinearWork) {
    LinearCpu(p);
    return;
  }
  const int64_t groups = (p.out_features + kLinearColumnGroup - 1) / kLinearColumnGroup;
  pool->ParallelFor(groups, 1, [&p](int64_t begin, int64_t end) {
    LinearCpuColumns(p, begin * kLinearColumnGroup,
                     std::min(p.out_features, end * kLinearColumnGroup));
  });
}

CpuModel::CpuModel(const ModelConfig& config, const TpRankPlan& slice, bool bf16_weights)
    : config_(config),
      slice_(slice),
      kv_group_(config.num_heads / config.num_kv_heads),
      bf16_weights_(bf16_weights),
      inv_freq_(RopeInvFreq(config)) {}

void CpuModel::Pack(Matrix* m) const {
  if (!bf16_weights_ || m->f32.empty()) return;
  std::vector<uint16_t> bits(m->f32.size());
  for (size_t i = 0; i < m->f32.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &m->f32[i], sizeof(u));
    if ((u & 0xffffu) != 0) return;  // not a bf16 value: the matrix stays fp32
    bits[i] = static_cast<uint16_t>(u >> 16);
  }
  m->bf16 = std::move(bits);
  m->f32 = std::vector<float>();
}

absl::Status CpuModel::Load(const TensorStore& st) {
  const ModelConfig& c = config_;
  const int64_t h = c.hidden_size, hd = c.head_dim, f = c.intermediate_size, v = c.vocab_size;
  const int64_t q = int64_t{c.num_heads} * hd, kv = int64_t{c.num_kv_heads} * hd;
  const TpRange q_rows{slice_.q_heads.begin * hd, slice_.q_heads.end * hd};
  const TpRange kv_rows{slice_.kv_heads.begin * hd, slice_.kv_heads.end * hd};
  const TpRange vocab = slice_.vocab, ffn = slice_.ffn, none;
  SPECD_RETURN_IF_ERROR_(
      ReadShard(st, "model.embed_tokens.weight", {v, h}, ShardSlice::kRows, vocab, &embed_));
  SPECD_RETURN_IF_ERROR_(
      ReadShard(st, "model.norm.weight", {h}, ShardSlice::kAll, none, &final_norm_));
  if (!c.tie_word_embeddings) {
    SPECD_RETURN_IF_ERROR_(
        ReadShard(st, "lm_head.weight", {v, h}, ShardSlice::kRows, vocab, &lm_head_.f32));
    Pack(&lm_head_);
  } else {
    lm_head_.f32 = embed_;
    Pack(&lm_head_);
    if (lm_head_.bf16.empty()) lm_head_.f32 = std::vector<float>();  // reads embed_ instead
  }
  layers_.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    LayerWeights& w = layers_[l];
    SPECD_RETURN_IF_ERROR_(
        ReadShard(st, p + "input_layernorm.weight", {h}, ShardSlice::kAll, none, &w.input_norm));
    SPECD_RETURN_IF_ERROR_(ReadShard(st, p + "self_attn.q_proj.weight", {q, h}, ShardSlice::kRows,
                                     q_rows, &w.q_proj.f32));
    Pack(&w.q_proj);
    SPECD_RETURN_IF_ERROR_(ReadShard(st, p + "self_attn.k_proj.weight", {kv, h}, ShardSlice::kRows,
                                     kv_rows, &w.k_proj.f32));
    Pack(&w.k_proj);
    SPECD_RETURN_IF_ERROR_(ReadShard(st, p + "self_attn.v_proj.weight", {kv, h}, ShardSlice::kRows,
                                     kv_rows, &w.v_proj.f32));
    Pack(&w.v_proj);
    if (c.attention_bias) {
      SPECD_RETURN_IF_ERROR_(
          ReadShard(st, p + "self_attn.q_proj.bias", {q}, ShardSlice::kRows, q_rows, &w.q_bias));
      SPECD_RETURN_IF_ERROR_(
          ReadShard(st, p + "self_attn.k_proj.bias", {kv}, ShardSlice::kRows, kv_rows, &w.k_bias));
      SPECD_RETURN_IF_ERROR_(
          ReadShard(st, p + "self_attn.v_proj.bias", {kv}, ShardSlice::kRows, kv_rows, &w.v_bias));
    }
    if (c.qk_norm) {
      SPECD_RETURN_IF_ERROR_(
          ReadShard(st, p + "self_attn.q_norm.weight", {hd}, ShardSlice::kAll, none, &w.q_norm));
      SPECD_RETURN_IF_ERROR_(
          ReadShard(st, p + "self_attn.k_norm.weight", {hd}, ShardSlice::kAll, none, &w.k_norm));
    }
    SPECD_RETURN_IF_ERROR_(ReadShard(st, p + "self_attn.o_proj.weight", {h, q}, ShardSlice::kCols,
                                     q_rows, &w.o_proj.f32));
    Pack(&w.o_proj);
    SPECD_RETURN_IF_ERROR_(ReadShard(st, p + "post_attention_layernorm.weight", {h},
                                     ShardSlice::kAll, none, &w.post_norm));
    SPECD_RETURN_IF_ERROR_(ReadShard(st, p + "mlp.gate_proj.weight", {f, h}, ShardSlice::kRows, ffn,
                                     &w.gate_proj.f32));
    Pack(&w.gate_proj);
    SPECD_RETURN_IF_ERROR_(
        ReadShard(st, p + "mlp.up_proj.weight", {f, h}, ShardSlice::kRows, ffn, &w.up_proj.f32));
    Pack(&w.up_proj);
    SPECD_RETURN_IF_ERROR_(ReadShard(st, p + "mlp.down_proj.weight", {h, f}, ShardSlice::kCols, ffn,
                                     &w.down_proj.f32));
    Pack(&w.down_proj);
  }
  k_pool_.resize(c.num_layers);
  v_pool_.resize(c.num_layers);

  return absl::OkStatus();
}

int64_t CpuModel::WeightBytes() const {
  int64_t bytes = 0;
  auto add = [&bytes](const std::vector<float>& v) {
    bytes += static_cast<int64_t>(v.size() * sizeof(float));
  };
  auto add_matrix = [&](const Matrix& m) {
    add(m.f32);
    bytes += static_cast<int64_t>(m.bf16.size() * sizeof(uint16_t));
  };
  add(embed_);
  add(final_norm_);
  add_matrix(lm_head_);
  for (const LayerWeights& w : layers_) {
    for (const std::vector<float>* v :
         {&w.input_norm, &w.post_norm, &w.q_bias, &w.k_bias, &w.v_bias, &w.q_norm, &w.k_norm}) {
      add(*v);
    }
    for (const Matrix* m :
         {&w.q_proj, &w.k_proj, &w.v_proj, &w.o_proj, &w.gate_proj, &w.up_proj, &w.down_proj}) {
      add_matrix(*m);
    }
  }
  return bytes;
}

void CpuModel::ReserveKvBlocks(int64_t blocks) {
  if (blocks <= kv_blocks_) return;
  const size_t elems = static_cast<size_t>(blocks * kKvBlockTokens * local_kv_dim());
  for (int l = 0; l < config_.num_layers; ++l) {
    k_pool_[l].resize(elems);
    v_pool_[l].resize(elems);
  }
  kv_blocks_ = blocks;
}

void CpuModel::CopyKvSlots(absl::Span<const int64_t> src, absl::Span<const int64_t> dst) {
  if (src.empty() || local_kv_dim() == 0) return;
  for (int l = 0; l < config_.num_layers; ++l) {
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

void CpuModel::Norm(const float* x, float* residual, const std::vector<float>& w, float* out,
                    int64_t rows, int64_t dim) const {
  RmsNormParams p;
  p.x = x;
  p.residual = residual;
  p.weight = w.data();
  p.out = out;
  p.rows = rows;
  p.dim = dim;
  p.eps = config_.rms_norm_eps;
  RmsNormCpu(p);
}

void CpuModel::Linear(const float* x, const Matrix& w, const std::vector<float>* bias, float* y,
                      int64_t rows, int64_t in, int64_t out, ThreadPool* pool) const {
  LinearParams p;
  p.x = x;
  p.w = w.f32.data();
  p.w_bf16 = w.bf16.empty() ? nullptr : w.bf16.data();
  p.bias = bias != nullptr && !bias->empty() ? bias->data() : nullptr;
  p.y = y;
  p.rows = rows;
  p.in_features = in;
  p.out_features = out;
  LinearOnPool(p, pool);
}

void CpuModel::Hidden(const StepLayout& l, ThreadPool* pool, TpCommunicator* comm,
                      std::vector<float>* residual_out, std::vector<float>* sub_out,
                      absl::Span<const int> tap_layers, std::vector<float>* taps) {
  const ModelConfig& c = config_;
  const int64_t T = l.num_tokens, H = c.hidden_size, hd = c.head_dim;
  const int64_t QH = slice_.q_heads.size(), KVH = slice_.kv_heads.size();
  const int64_t QD = QH * hd, KVD = KVH * hd, F = slice_.ffn.size();
  std::vector<float>& residual = *residual_out;
  std::vector<float>& sub = *sub_out;
  residual.assign(T * H, 0.0f);
  sub.assign(T * H, 0.0f);
  std::vector<float> normed(T * H), q(T * QD), k(T * KVD), v(T * KVD), attn(T * QD), gate(T * F),
      up(T * F);
  const auto all_reduce = [&](std::vector<float>* x) {
    if (comm != nullptr) comm->AllReduceSum(x->data(), T * H);
  };

  // Vocab-parallel embedding: each token's row comes from the one slice that holds it; the
  // others add zeros, so the all-reduce reproduces the row exactly.
  for (int64_t t = 0; t < T; ++t) {
    if (slice_.vocab.contains(l.tokens[t])) {
      std::memcpy(&residual[t * H], &embed_[(l.tokens[t] - slice_.vocab.begin) * H],
                  sizeof(float) * H);
    }
  }
  all_reduce(&residual);

  int64_t attention_keys = 0;  // keys summed over queries: the attention's work per head
  for (int64_t i = 0; i < T; ++i) {
    attention_keys += l.prefix_len[i] + l.key_offsets[i + 1] - l.key_offsets[i];
  }
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

  const int64_t tap_width = static_cast<int64_t>(tap_layers.size()) * H;
  if (taps != nullptr) taps->assign(T * tap_width, 0.0f);
  // Copies the stream `x` ([T, H]) into the columns of every tap naming `layer`.
  const auto capture = [&](int layer, const float* x) {
    if (taps == nullptr) return;
    for (size_t i = 0; i < tap_layers.size(); ++i) {
      if (tap_layers[i] != layer) continue;
      for (int64_t t = 0; t < T; ++t) {
        std::memcpy(&(*taps)[t * tap_width + i * H], x + t * H, sizeof(float) * H);
      }
    }
  };

  for (int layer = 0; layer < c.num_layers; ++layer) {
    const LayerWeights& w = layers_[layer];
    // The previous layer's (all-reduced) MLP output joins the residual stream here.
    Norm(layer == 0 ? residual.data() : sub.data(), layer == 0 ? nullptr : residual.data(),
         w.input_norm, normed.data(), T, H);
    capture(layer, residual.data());  // now the stream entering `layer`
    if (QH > 0) {
      Linear(normed.data(), w.q_proj, &w.q_bias, q.data(), T, H, QD, pool);
      Linear(normed.data(), w.k_proj, &w.k_bias, k.data(), T, H, KVD, pool);
      Linear(normed.data(), w.v_proj, &w.v_bias, v.data(), T, H, KVD, pool);
      if (c.qk_norm) {
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
      ap.kv.k_cache = k_pool_[layer].data();
      ap.kv.v_cache = v_pool_[layer].data();
      ap.kv.block_tables = l.block_tables.data();
      ap.query_seq = l.query_seq.data();
      ap.prefix_len = l.prefix_len.data();
      ap.tree_key_offsets = l.key_offsets.data();
      ap.tree_keys = l.tree_keys.data();
      ap.num_queries = T;
      ap.num_heads = QH;
      ap.num_kv_heads = KVH;
      ap.head_dim = hd;
      ap.kv.block_size = kKvBlockTokens;
      ap.kv.max_blocks_per_seq = l.max_blocks_per_seq;
      ap.scale = 1.0f / std::sqrt(static_cast<float>(hd));
      ap.kv_group = kv_group_;
      ap.q_head_offset = slice_.q_heads.begin;
      ap.kv_head_offset = slice_.kv_heads.begin;
      if (attention_keys * QH * hd < kInlineAttentionWork) {
        TreeAttentionCpu(ap);  // waking the pool would cost more than the work
      } else {
        pool->ParallelFor(T * QH, 1, [&ap](int64_t begin, int64_t end) {
          TreeAttentionCpuItems(ap, begin, end);
        });
      }
      // Row-parallel o_proj: this slice's heads' share of the output.
      Linear(attn.data(), w.o_proj, nullptr, sub.data(), T, QD, H, pool);
    } else {
      std::fill(sub.begin(), sub.end(), 0.0f);
    }
    all_reduce(&sub);

    Norm(sub.data(), residual.data(), w.post_norm, normed.data(), T, H);
    if (F > 0) {
      Linear(normed.data(), w.gate_proj, nullptr, gate.data(), T, H, F, pool);
      Linear(normed.data(), w.up_proj, nullptr, up.data(), T, H, F, pool);
      SwiGluParams sp;
      sp.gate = gate.data();
      sp.up = up.data();
      sp.out = gate.data();
      sp.n = T * F;
      SwiGluCpu(sp);
      Linear(gate.data(), w.down_proj, nullptr, sub.data(), T, F, H, pool);
    } else {
      std::fill(sub.begin(), sub.end(), 0.0f);
    }
    all_reduce(&sub);
  }
  if (taps != nullptr &&
      std::find(tap_layers.begin(), tap_layers.end(), c.num_layers) != tap_layers.end()) {
    // The last layer's output: the sum Logits()' fused norm forms, in the same order (x +
    // residual), so these are the bits the final norm reads.
    std::vector<float> last(T * H);
    for (int64_t i = 0; i < T * H; ++i) last[i] = sub[i] + residual[i];
    capture(c.num_layers, last.data());
  }
  if (taps != nullptr && std::find(tap_layers.begin(), tap_layers.end(),
                                   FinalNormTap(c.num_layers)) != tap_layers.end()) {
    // The final norm's output, as Logits() forms it for the LM head: the norm is per row, so
    // every row here has the bits of the row Logits() reads. Copies, since the fused add
    // writes into its residual argument.
    std::vector<float> x(sub), res(residual), normed(T * H);
    Norm(x.data(), res.data(), final_norm_, normed.data(), T, H);
    capture(FinalNormTap(c.num_layers), normed.data());
  }
}

void CpuModel::Logits(const StepLayout& l, const std::vector<float>& residual,
                      const std::vector<float>& sub, float* out, ThreadPool* pool) const {
  const int64_t H = config_.hidden_size, V = slice_.vocab.size();
  const int64_t R = static_cast<int64_t>(l.logit_tokens.size());
  if (V == 0 || R == 0) return;
  // Only the requested rows go through the final norm and the LM head.
  std::vector<float> last_sub(R * H), last_res(R * H), last_norm(R * H);
  for (int64_t r = 0; r < R; ++r) {
    std::memcpy(&last_sub[r * H], &sub[l.logit_tokens[r] * H], sizeof(float) * H);
    std::memcpy(&last_res[r * H], &residual[l.logit_tokens[r] * H], sizeof(float) * H);
  }
  Norm(last_sub.data(), last_res.data(), final_norm_, last_norm.data(), R, H);
  if (lm_head_.f32.empty() && lm_head_.bf16.empty()) {
    // Tied embeddings kept as fp32: the LM head is embed_ itself.
    LinearParams p;
    p.x = last_norm.data();
    p.w = embed_.data();
    p.y = out;
    p.rows = R;
    p.in_features = H;
    p.out_features = V;
    LinearOnPool(p, pool);
    return;
  }
  Linear(last_norm.data(), lm_head_, nullptr, out, R, H, V, pool);
}

}  // namespace specd
