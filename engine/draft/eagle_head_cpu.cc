#include "engine/draft/eagle_head_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/cpu/cpu_model.h"
#include "specd/kernels/kv_cache.h"
#include "specd/kernels/linear.h"
#include "specd/kernels/rmsnorm.h"
#include "specd/kernels/rope.h"
#include "specd/kernels/swiglu.h"
#include "specd/kernels/tree_attention.h"

namespace specd {
namespace {

// Below this many multiply-adds (keys x heads x head_dim), attention runs on the calling thread.
constexpr int64_t kInlineAttentionWork = 1 << 16;

// Moves *f32 to *bf16 as bit patterns when every value is a bf16 value; else leaves both.
void PackBf16(std::vector<float>* f32, std::vector<uint16_t>* bf16) {
  if (f32->empty()) return;
  std::vector<uint16_t> bits(f32->size());
  for (size_t i = 0; i < f32->size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &(*f32)[i], sizeof(u));
    if ((u & 0xffffu) != 0) return;  // not a bf16 value: the matrix stays fp32
    bits[i] = static_cast<uint16_t>(u >> 16);
  }
  *bf16 = std::move(bits);
  *f32 = std::vector<float>();
}

}  // namespace

absl::StatusOr<std::unique_ptr<EagleHeadCpu>> EagleHeadCpu::Create(
    EagleHeadConfig config, const ModelConfig& target, EagleHeadWeights weights,
    const EagleHeadOptions& options) {
  if (options.kv_capacity_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_capacity_tokens: must be positive, got ", options.kv_capacity_tokens));
  }
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_threads: must be >= 0, got ", options.num_threads));
  }
  if (options.context_length < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("context_length: must be >= 0, got ", options.context_length));
  }
  const int context =
      options.context_length > 0 ? options.context_length : target.max_position_embeddings;
  Bf16Weights bf16;
  bf16.layers.resize(weights.layers.size());
  if (options.cpu_bf16_weights) {
    PackBf16(&weights.fc, &bf16.fc);
    PackBf16(&weights.lm_head, &bf16.lm_head);
    for (size_t i = 0; i < weights.layers.size(); ++i) {
      EagleHeadWeights::Layer& w = weights.layers[i];
      Bf16Weights::Layer& b = bf16.layers[i];
      PackBf16(&w.q_proj, &b.q_proj);
      PackBf16(&w.k_proj, &b.k_proj);
      PackBf16(&w.v_proj, &b.v_proj);
      PackBf16(&w.o_proj, &b.o_proj);
      PackBf16(&w.gate_proj, &b.gate_proj);
      PackBf16(&w.up_proj, &b.up_proj);
      PackBf16(&w.down_proj, &b.down_proj);
    }
  }
  std::unique_ptr<EagleHeadCpu> head(
      new EagleHeadCpu(std::move(config), std::move(weights), std::move(bf16), context, options));
  return head;
}

EagleHeadCpu::EagleHeadCpu(EagleHeadConfig config, EagleHeadWeights weights, Bf16Weights bf16,
                           int context_length, const EagleHeadOptions& options)
    : config_(std::move(config)),
      w_(std::move(weights)),
      bf16_(std::move(bf16)),
      context_length_(context_length),
      table_(kKvBlockTokens, options.kv_capacity_tokens, config_.vocab_size, context_length),
      inv_freq_(RopeInvFreq(config_.head)) {
  const int threads = options.num_threads > 0
                          ? options.num_threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  pool_ = std::make_unique<ThreadPool>(threads);
  k_pool_.resize(w_.layers.size());
  v_pool_.resize(w_.layers.size());
}

void EagleHeadCpu::Norm(const float* x, float* residual, const std::vector<float>& w, float* out,
                        int64_t rows) const {
  RmsNormParams p;
  p.x = x;
  p.residual = residual;
  p.weight = w.data();
  p.out = out;
  p.rows = rows;
  p.dim = config_.head.hidden_size;
  p.eps = config_.head.rms_norm_eps;
  RmsNormCpu(p);
}

void EagleHeadCpu::Linear(const float* x, const std::vector<float>& w,
                          const std::vector<uint16_t>& w16, const std::vector<float>* bias,
                          float* y, int64_t rows, int64_t in, int64_t out) const {
  if (rows == 0) return;
  LinearParams p;
  p.x = x;
  p.w = w.data();
  p.w_bf16 = w16.empty() ? nullptr : w16.data();
  p.bias = bias != nullptr && !bias->empty() ? bias->data() : nullptr;
  p.y = y;
  p.rows = rows;
  p.in_features = in;
  p.out_features = out;
  LinearOnPool(p, pool_.get());
}

void EagleHeadCpu::Attention(int layer, const StepLayout& l, const float* x, int64_t in,
                             const std::vector<int64_t>* rows, float* out) {
  const ModelConfig& h = config_.head;
  const EagleHeadWeights::Layer& w = w_.layers[layer];
  const Bf16Weights::Layer& w16 = bf16_.layers[layer];
  const int64_t T = l.num_tokens, hd = h.head_dim;
  const int64_t QD = int64_t{h.num_heads} * hd, KVD = int64_t{h.num_kv_heads} * hd;
  // The queries: all T tokens, or the rows asked for with their positions and keys gathered.
  const int64_t N = rows == nullptr ? T : static_cast<int64_t>(rows->size());
  const float* xq = x;
  const int32_t* positions = l.positions.data();
  const int32_t* query_seq = l.query_seq.data();
  const int32_t* prefix_len = l.prefix_len.data();
  const int32_t* key_offsets = l.key_offsets.data();
  const int32_t* tree_keys = l.tree_keys.data();
  std::vector<float> gathered;
  std::vector<int32_t> q_pos, q_seq, q_prefix, q_offsets, q_keys;
  if (rows != nullptr) {
    gathered.resize(N * in);
    q_offsets.push_back(0);
    for (int64_t i = 0; i < N; ++i) {
      const int64_t t = (*rows)[i];
      std::memcpy(&gathered[i * in], x + t * in, sizeof(float) * in);
      q_pos.push_back(l.positions[t]);
      q_seq.push_back(l.query_seq[t]);
      q_prefix.push_back(l.prefix_len[t]);
      q_keys.insert(q_keys.end(), l.tree_keys.begin() + l.key_offsets[t],
                    l.tree_keys.begin() + l.key_offsets[t + 1]);
      q_offsets.push_back(static_cast<int32_t>(q_keys.size()));
    }
    xq = gathered.data();
    positions = q_pos.data();
    query_seq = q_seq.data();
    prefix_len = q_prefix.data();
    key_offsets = q_offsets.data();
    tree_keys = q_keys.data();
  }
  std::vector<float> q(N * QD), k(T * KVD), v(T * KVD), attn(N * QD);
  Linear(xq, w.q_proj, w16.q_proj, nullptr, q.data(), N, in, QD);
  Linear(x, w.k_proj, w16.k_proj, nullptr, k.data(), T, in, KVD);
  Linear(x, w.v_proj, w16.v_proj, nullptr, v.data(), T, in, KVD);
  const auto rope = [&](float* y, const int32_t* pos, int64_t tokens, int64_t heads) {
    RopeParams p;
    p.x = y;
    p.positions = pos;
    p.inv_freq = inv_freq_.data();
    p.num_tokens = tokens;
    p.num_heads = heads;
    p.head_dim = hd;
    p.row_stride = heads * hd;
    RopeCpu(p);
  };
  rope(q.data(), positions, N, h.num_heads);
  rope(k.data(), l.positions.data(), T, h.num_kv_heads);

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
  ap.query_seq = query_seq;
  ap.prefix_len = prefix_len;
  ap.tree_key_offsets = key_offsets;
  ap.tree_keys = tree_keys;
  ap.num_queries = N;
  ap.num_heads = h.num_heads;
  ap.num_kv_heads = h.num_kv_heads;
  ap.head_dim = hd;
  ap.kv.block_size = kKvBlockTokens;
  ap.kv.max_blocks_per_seq = l.max_blocks_per_seq;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(hd));
  int64_t keys = 0;
  for (int64_t i = 0; i < N; ++i) keys += prefix_len[i] + key_offsets[i + 1] - key_offsets[i];
  if (keys * h.num_heads * hd < kInlineAttentionWork) {
    TreeAttentionCpu(ap);  // waking the pool would cost more than the work
  } else {
    pool_->ParallelFor(N * h.num_heads, 1, [&ap](int64_t begin, int64_t end) {
      TreeAttentionCpuItems(ap, begin, end);
    });
  }
  Linear(attn.data(), w.o_proj, w16.o_proj, nullptr, out, N, QD, h.hidden_size);
}

void EagleHeadCpu::Finish(int layer, const float* attn, float* h, int64_t rows) const {
  const int64_t H = config_.head.hidden_size;
  std::vector<float> normed(rows * H), mlp(rows * H);
  Norm(attn, h, w_.layers[layer].post_norm, normed.data(), rows);  // h += attn
  Mlp(layer, normed.data(), mlp.data(), rows);
  for (int64_t i = 0; i < rows * H; ++i) h[i] += mlp[i];
}

void EagleHeadCpu::Mlp(int layer, const float* x, float* out, int64_t rows) const {
  const EagleHeadWeights::Layer& w = w_.layers[layer];
  const Bf16Weights::Layer& w16 = bf16_.layers[layer];
  const int64_t H = config_.head.hidden_size, F = config_.head.intermediate_size;
  std::vector<float> gate(rows * F), up(rows * F);
  Linear(x, w.gate_proj, w16.gate_proj, nullptr, gate.data(), rows, H, F);
  Linear(x, w.up_proj, w16.up_proj, nullptr, up.data(), rows, H, F);
  SwiGluParams sp;
  sp.gate = gate.data();
  sp.up = up.data();
  sp.out = gate.data();
  sp.n = rows * F;
  SwiGluCpu(sp);
  Linear(gate.data(), w.down_proj, w16.down_proj, nullptr, out, rows, F, H);
}

absl::Status EagleHeadCpu::Forward(absl::Span<const EagleHeadItem> items, EagleHeadOutputs* out) {
  if (out == nullptr) return absl::InvalidArgumentError("out is null");
  out->hidden.clear();
  out->logits.clear();
  const bool e3 = config_.kind == EagleKind::kEagle3;
  const int64_t H = config_.head.hidden_size;
  // The inputs' widths first: PrepareForward checks the rest and changes the table only when
  // the whole batch is good.
  std::vector<ForwardItem> forward(items.size());
  for (size_t b = 0; b < items.size(); ++b) {
    const EagleHeadItem& it = items[b];
    const int64_t width = it.input == EagleInput::kTargetFeatures ? config_.feature_size() : H;
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
  StepLayout l;
  if (absl::Status s = table_.PrepareForward(forward, &l); !s.ok()) return s;
  if (items.empty()) return absl::OkStatus();
  if (table_.allocated_blocks() > kv_blocks_) {
    kv_blocks_ = table_.allocated_blocks();
    const int64_t elems =
        kv_blocks_ * kKvBlockTokens * config_.head.num_kv_heads * int64_t{config_.head.head_dim};
    for (size_t i = 0; i < k_pool_.size(); ++i) {
      k_pool_[i].resize(elems);
      v_pool_[i].resize(elems);
    }
  }
  const int64_t T = l.num_tokens;

  // x: the H-wide input of each node (EAGLE-3: fc(taps) or a hidden state; EAGLE-1/2: the
  // feature or a hidden state, both fed to fc below).
  std::vector<float> x(T * H);
  int64_t t0 = 0;
  for (const EagleHeadItem& it : items) {
    const int64_t n = static_cast<int64_t>(it.tokens.size());
    if (e3 && it.input == EagleInput::kTargetFeatures) {
      Linear(it.inputs.data(), w_.fc, bf16_.fc, nullptr, &x[t0 * H], n, config_.feature_size(), H);
    } else {
      std::memcpy(&x[t0 * H], it.inputs.data(), sizeof(float) * n * H);
    }
    t0 += n;
  }
  std::vector<float> emb(T * H), normed(T * H), sub(T * H), cat(T * 2 * H);
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(&emb[t * H], &w_.embed[static_cast<int64_t>(l.tokens[t]) * H], sizeof(float) * H);
  }
  // The last layer runs past its keys and values for the requested rows only, so its residual
  // stream is [R, H], in the order asked for: the layer outputs.
  const int64_t R = static_cast<int64_t>(l.logit_tokens.size());
  const int64_t dv = config_.draft_vocab_size;
  out->hidden.resize(R * H);
  out->logits.resize(R * dv);
  std::vector<float> attn(std::max(T, R) * H);
  // Every token asked for in order takes the plain path (no gather).
  bool in_order = R == T;
  for (int64_t r = 0; in_order && r < R; ++r) in_order = l.logit_tokens[r] == r;
  const std::vector<int64_t>* rows = in_order ? nullptr : &l.logit_tokens;
  const auto gather = [&](const std::vector<float>& from) {
    for (int64_t r = 0; r < R; ++r) {
      std::memcpy(&out->hidden[r * H], &from[l.logit_tokens[r] * H], sizeof(float) * H);
    }
  };
  if (e3) {
    const EagleHeadWeights::Layer& w = w_.layers[0];
    Norm(emb.data(), nullptr, w.input_norm, normed.data(), T);
    Norm(x.data(), nullptr, w.hidden_norm, sub.data(), T);
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(&cat[t * 2 * H], &normed[t * H], sizeof(float) * H);
      std::memcpy(&cat[t * 2 * H + H], &sub[t * H], sizeof(float) * H);
    }
    gather(config_.norm_before_residual ? sub : x);
    Attention(0, l, cat.data(), 2 * H, rows, attn.data());
    Finish(0, attn.data(), out->hidden.data(), R);
  } else {
    // The residual stream of every token up to the last layer.
    std::vector<float> h(T * H);
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(&cat[t * 2 * H], &emb[t * H], sizeof(float) * H);
      std::memcpy(&cat[t * 2 * H + H], &x[t * H], sizeof(float) * H);
    }
    Linear(cat.data(), w_.fc, bf16_.fc, &w_.fc_bias, h.data(), T, 2 * H, H);
    for (size_t layer = 0; layer < w_.layers.size(); ++layer) {
      const EagleHeadWeights::Layer& w = w_.layers[layer];
      const float* in = h.data();
      if (!w.input_norm.empty()) {
        Norm(h.data(), nullptr, w.input_norm, normed.data(), T);
        in = normed.data();
      }
      const int i = static_cast<int>(layer);
      if (layer + 1 < w_.layers.size()) {
        Attention(i, l, in, H, nullptr, attn.data());
        Finish(i, attn.data(), h.data(), T);
      } else {
        gather(h);
        Attention(i, l, in, H, rows, attn.data());
        Finish(i, attn.data(), out->hidden.data(), R);
      }
    }
  }

  if (e3) {
    std::vector<float> rows(R * H);
    Norm(out->hidden.data(), nullptr, w_.norm, rows.data(), R);
    Linear(rows.data(), w_.lm_head, bf16_.lm_head, nullptr, out->logits.data(), R, H, dv);
  } else {
    Linear(out->hidden.data(), w_.lm_head, bf16_.lm_head, nullptr, out->logits.data(), R, H, dv);
  }
  return absl::OkStatus();
}

int64_t EagleHeadCpu::GemmWeightBytes() const {
  int64_t bytes = 0;
  const auto add = [&bytes](const std::vector<float>& f32, const std::vector<uint16_t>& bf16) {
    bytes += static_cast<int64_t>(f32.size() * sizeof(float) + bf16.size() * sizeof(uint16_t));
  };
  add(w_.fc, bf16_.fc);
  add(w_.lm_head, bf16_.lm_head);
  for (size_t i = 0; i < w_.layers.size(); ++i) {
    const EagleHeadWeights::Layer& w = w_.layers[i];
    const Bf16Weights::Layer& b = bf16_.layers[i];
    add(w.q_proj, b.q_proj);
    add(w.k_proj, b.k_proj);
    add(w.v_proj, b.v_proj);
    add(w.o_proj, b.o_proj);
    add(w.gate_proj, b.gate_proj);
    add(w.up_proj, b.up_proj);
    add(w.down_proj, b.down_proj);
  }
  return bytes;
}

absl::Status EagleHeadCpu::Commit(SeqId seq, absl::Span<const int32_t> path) {
  std::vector<int64_t> src, dst;
  if (absl::Status s = table_.PrepareCommit(seq, path, &src, &dst); !s.ok()) return s;
  if (src.empty()) return absl::OkStatus();
  for (size_t i = 0; i < k_pool_.size(); ++i) {
    KvCacheCopyParams p;
    p.k_cache = k_pool_[i].data();
    p.v_cache = v_pool_[i].data();
    p.src_slots = src.data();
    p.dst_slots = dst.data();
    p.num_copies = static_cast<int64_t>(src.size());
    p.kv_dim = int64_t{config_.head.num_kv_heads} * config_.head.head_dim;
    KvCacheCopyCpu(p);
  }
  return absl::OkStatus();
}

}  // namespace specd
