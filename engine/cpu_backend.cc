#include "engine/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "specd/kernels/embedding.h"
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

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Below this many multiply-adds (keys x heads x head_dim), attention runs on the calling thread.
constexpr int64_t kInlineAttentionWork = 1 << 16;

absl::Status Read(const TensorStore& store, const std::string& name, std::vector<int64_t> shape,
                  std::vector<float>* out) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  out->assign(n, 0.0f);
  return store.ReadF32(name, shape, out->data());
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(const std::string& dir,
                                                               const BackendOptions& options) {
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
  std::unique_ptr<CpuBackend> backend(new CpuBackend(*std::move(config), options));
  SPECD_RETURN_IF_ERROR_(backend->LoadWeights());
  return backend;
}

CpuBackend::CpuBackend(ModelConfig config, const BackendOptions& options)
    : config_(std::move(config)), options_(options) {
  int threads = options.num_threads;
  if (threads == 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // OpenBLAS keeps one global thread count; only an explicit request changes it.
  if (options.num_threads > 0) openblas_set_num_threads(threads);
  pool_ = std::make_unique<ThreadPool>(threads);
  inv_freq_ = RopeInvFreq(config_);
  kv_dim_ = int64_t{config_.num_kv_heads} * config_.head_dim;
  max_blocks_ = CeilDiv(options.kv_capacity_tokens, kKvBlockTokens);
  k_pool_.resize(config_.num_layers);
  v_pool_.resize(config_.num_layers);
}

CpuBackend::~CpuBackend() = default;

absl::Status CpuBackend::LoadWeights() {
  absl::StatusOr<std::unique_ptr<TensorStore>> opened = TensorStore::OpenFolder(config_.dir);
  if (!opened.ok()) return opened.status();
  const TensorStore& st = **opened;
  const ModelConfig& c = config_;
  const int64_t h = c.hidden_size, q = int64_t{c.num_heads} * c.head_dim, kv = kv_dim_,
                f = c.intermediate_size, v = c.vocab_size, hd = c.head_dim;
  SPECD_RETURN_IF_ERROR_(Read(st, "model.embed_tokens.weight", {v, h}, &embed_tokens_));
  SPECD_RETURN_IF_ERROR_(Read(st, "model.norm.weight", {h}, &final_norm_));
  if (!c.tie_word_embeddings) {
    SPECD_RETURN_IF_ERROR_(Read(st, "lm_head.weight", {v, h}, &lm_head_));
  }
  layers_.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    LayerWeights& w = layers_[l];
    SPECD_RETURN_IF_ERROR_(Read(st, p + "input_layernorm.weight", {h}, &w.input_norm));
    SPECD_RETURN_IF_ERROR_(Read(st, p + "self_attn.q_proj.weight", {q, h}, &w.q_proj));
    SPECD_RETURN_IF_ERROR_(Read(st, p + "self_attn.k_proj.weight", {kv, h}, &w.k_proj));
    SPECD_RETURN_IF_ERROR_(Read(st, p + "self_attn.v_proj.weight", {kv, h}, &w.v_proj));
    if (c.attention_bias) {
      SPECD_RETURN_IF_ERROR_(Read(st, p + "self_attn.q_proj.bias", {q}, &w.q_bias));
      SPECD_RETURN_IF_ERROR_(Read(st, p + "self_attn.k_proj.bias", {kv}, &w.k_bias));
      SPECD_RETURN_IF_ERROR_(Read(st, p + "self_attn.v_proj.bias", {kv}, &w.v_bias));
    }
    if (c.qk_norm) {
      SPECD_RETURN_IF_ERROR_(Read(st, p + "self_attn.q_norm.weight", {hd}, &w.q_norm));
      SPECD_RETURN_IF_ERROR_(Read(st, p + "self_attn.k_norm.weight", {hd}, &w.k_norm));
    }
    SPECD_RETURN_IF_ERROR_(Read(st, p + "self_attn.o_proj.weight", {h, q}, &w.o_proj));
    SPECD_RETURN_IF_ERROR_(Read(st, p + "post_attention_layernorm.weight", {h}, &w.post_norm));
    SPECD_RETURN_IF_ERROR_(Read(st, p + "mlp.gate_proj.weight", {f, h}, &w.gate_proj));
    SPECD_RETURN_IF_ERROR_(Read(st, p + "mlp.up_proj.weight", {f, h}, &w.up_proj));
    SPECD_RETURN_IF_ERROR_(Read(st, p + "mlp.down_proj.weight", {h, f}, &w.down_proj));
  }
  // Every GEMM shape of the model, probed once: the layers share shapes.
  const LayerWeights& w0 = layers_[0];
  const struct {
    const std::vector<float>* w;
    int64_t out, in;
  } shapes[] = {{&w0.q_proj, q, h},    {&w0.k_proj, kv, h},
                {&w0.o_proj, h, q},    {&w0.gate_proj, f, h},
                {&w0.down_proj, h, f}, {lm_head_.empty() ? &embed_tokens_ : &lm_head_, v, h}};
  row_block_ = kLinearRowBlock;
  for (const auto& s : shapes) {
    if (!LinearRowBlockInvariant(s.w->data(), s.out, s.in)) {
      std::fprintf(stderr,
                   "specd cpu backend: this BLAS is not row-invariant in blocks of %lld for a "
                   "[%lld, %lld] weight; using one sgemm per row (slower, still lossless)\n",
                   static_cast<long long>(kLinearRowBlock), static_cast<long long>(s.out),
                   static_cast<long long>(s.in));
      row_block_ = 1;
      break;
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Sequences and KV blocks.

int64_t CpuBackend::FreeBlocks() const {
  return static_cast<int64_t>(free_blocks_.size()) + (max_blocks_ - allocated_blocks_);
}

int32_t CpuBackend::AllocateBlock() {
  if (free_blocks_.empty()) {
    // Grow geometrically so a large capacity costs memory only when it is used.
    const int64_t grown =
        std::min(max_blocks_, std::max<int64_t>(allocated_blocks_ * 2, allocated_blocks_ + 4));
    const size_t elems = static_cast<size_t>(grown * kKvBlockTokens * kv_dim_);
    for (int l = 0; l < config_.num_layers; ++l) {
      k_pool_[l].resize(elems);
      v_pool_[l].resize(elems);
    }
    // Push in reverse so blocks are handed out in increasing order.
    for (int64_t b = grown - 1; b >= allocated_blocks_; --b) {
      free_blocks_.push_back(static_cast<int32_t>(b));
    }
    allocated_blocks_ = grown;
  }
  const int32_t b = free_blocks_.back();
  free_blocks_.pop_back();
  return b;
}

void CpuBackend::ReleaseBlocks(Sequence* s, int64_t keep_blocks) {
  while (static_cast<int64_t>(s->blocks.size()) > keep_blocks) {
    free_blocks_.push_back(s->blocks.back());
    s->blocks.pop_back();
  }
}

int64_t CpuBackend::PhysicalSlot(const Sequence& s, int64_t logical) const {
  return int64_t{s.blocks[logical / kKvBlockTokens]} * kKvBlockTokens + logical % kKvBlockTokens;
}

absl::Status CpuBackend::AddSequence(SeqId seq) {
  if (seqs_.contains(seq)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", seq, " already exists"));
  }
  if (FreeBlocks() == 0) {
    return absl::ResourceExhaustedError(absl::StrCat("KV cache full: no free block for sequence ",
                                                     seq, " (capacity ",
                                                     max_blocks_ * kKvBlockTokens, " tokens)"));
  }
  seqs_.emplace(seq, Sequence{});
  return absl::OkStatus();
}

absl::Status CpuBackend::RemoveSequence(SeqId seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " not found"));
  ReleaseBlocks(&it->second, 0);
  seqs_.erase(it);
  return absl::OkStatus();
}

bool CpuBackend::HasSequence(SeqId seq) const { return seqs_.contains(seq); }

absl::StatusOr<int64_t> CpuBackend::CommittedLength(SeqId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " not found"));
  return it->second.committed;
}

absl::StatusOr<int64_t> CpuBackend::ScratchLength(SeqId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " not found"));
  return static_cast<int64_t>(it->second.scratch_parents.size());
}

KvUsage CpuBackend::Usage() const {
  KvUsage u;
  for (const auto& [id, s] : seqs_) u.used_tokens += s.tokens();
  u.capacity_tokens = max_blocks_ * kKvBlockTokens;
  u.sequences = static_cast<int>(seqs_.size());
  return u;
}

absl::Status CpuBackend::Commit(SeqId seq, absl::Span<const int32_t> path) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " not found"));
  Sequence& s = it->second;
  const int64_t scratch = static_cast<int64_t>(s.scratch_parents.size());
  for (size_t j = 0; j < path.size(); ++j) {
    if (path[j] < 0 || path[j] >= scratch) {
      return absl::InvalidArgumentError(absl::StrCat("path[", j, "] = ", path[j],
                                                     " is not a scratch node (sequence ", seq,
                                                     " has ", scratch, ")"));
    }
    const int32_t want = j == 0 ? -1 : path[j - 1];
    if (s.scratch_parents[path[j]] != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "path[", j, "] = ", path[j], " is not a child of ",
          j == 0 ? std::string("the committed end") : absl::StrCat("path[", j - 1, "]"),
          " (its parent is ", s.scratch_parents[path[j]], ")"));
    }
  }
  // path[j] >= j and increases, so copying in order never overwrites a later source.
  std::vector<int64_t> src, dst;
  for (size_t j = 0; j < path.size(); ++j) {
    if (path[j] == static_cast<int32_t>(j)) continue;
    src.push_back(PhysicalSlot(s, s.committed + path[j]));
    dst.push_back(PhysicalSlot(s, s.committed + static_cast<int64_t>(j)));
  }
  for (int l = 0; l < config_.num_layers && !src.empty(); ++l) {
    KvCacheCopyParams p;
    p.k_cache = k_pool_[l].data();
    p.v_cache = v_pool_[l].data();
    p.src_slots = src.data();
    p.dst_slots = dst.data();
    p.num_copies = static_cast<int64_t>(src.size());
    p.kv_dim = kv_dim_;
    KvCacheCopyCpu(p);
  }
  s.committed += static_cast<int64_t>(path.size());
  s.scratch_parents.clear();
  s.scratch_depth.clear();
  ReleaseBlocks(&s, CeilDiv(s.committed, kKvBlockTokens));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Forward.

void CpuBackend::Linear(const float* x, const std::vector<float>& w, const std::vector<float>* bias,
                        float* y, int64_t rows, int64_t in, int64_t out) {
  LinearParams p;
  p.x = x;
  p.w = w.data();
  p.bias = bias != nullptr && !bias->empty() ? bias->data() : nullptr;
  p.y = y;
  p.rows = rows;
  p.in_features = in;
  p.out_features = out;
  p.row_block = row_block_;
  LinearCpu(p);
}

absl::Status CpuBackend::Forward(absl::Span<const ForwardItem> items, std::vector<float>* logits) {
  const ModelConfig& c = config_;
  if (logits == nullptr) return absl::InvalidArgumentError("logits is null");
  logits->clear();

  // Validate everything before touching any state, so a bad item leaves all sequences as they
  // were.
  absl::flat_hash_set<SeqId> seen;
  std::vector<Sequence*> seq_of(items.size());
  std::vector<std::vector<int32_t>> new_depth(items.size());
  int64_t blocks_needed = 0;
  int64_t total_tokens = 0, total_rows = 0;
  for (size_t b = 0; b < items.size(); ++b) {
    const ForwardItem& it = items[b];
    auto found = seqs_.find(it.seq);
    if (found == seqs_.end()) {
      return absl::NotFoundError(
          absl::StrCat("items[", b, "].seq: sequence ", it.seq, " not found"));
    }
    if (!seen.insert(it.seq).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("items[", b, "].seq: sequence ", it.seq, " appears twice in one batch"));
    }
    Sequence& s = found->second;
    seq_of[b] = &s;
    const int64_t n = static_cast<int64_t>(it.tokens.size());
    if (n == 0) return absl::InvalidArgumentError(absl::StrCat("items[", b, "].tokens is empty"));
    if (it.parents.size() != it.tokens.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "items[", b, "].parents has ", it.parents.size(), " entries for ", n, " tokens"));
    }
    const int64_t base = static_cast<int64_t>(s.scratch_parents.size());
    new_depth[b].resize(n);
    for (int64_t j = 0; j < n; ++j) {
      const int32_t tok = it.tokens[j];
      if (tok < 0 || tok >= c.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("items[", b, "].tokens[", j, "] = ", tok,
                                                       " is outside the vocabulary [0, ",
                                                       c.vocab_size, ")"));
      }
      const int32_t parent = it.parents[j];
      if (parent < -1 || parent >= base + j) {
        return absl::InvalidArgumentError(absl::StrCat("items[", b, "].parents[", j, "] = ", parent,
                                                       " must be -1 or an earlier scratch node (< ",
                                                       base + j, ")"));
      }
      const int32_t depth =
          parent < 0 ? 0
                     : 1 + (parent < base ? s.scratch_depth[parent] : new_depth[b][parent - base]);
      new_depth[b][j] = depth;
      if (s.committed + depth >= c.max_position_embeddings) {
        return absl::InvalidArgumentError(absl::StrCat(
            "items[", b, "].tokens[", j, "]: position ", s.committed + depth,
            " is beyond the context (max_position_embeddings ", c.max_position_embeddings, ")"));
      }
    }
    for (int32_t r : it.logit_rows) {
      if (r < 0 || r >= n) {
        return absl::InvalidArgumentError(
            absl::StrCat("items[", b, "].logit_rows holds ", r, ", outside [0, ", n, ")"));
      }
    }
    blocks_needed +=
        CeilDiv(s.tokens() + n, kKvBlockTokens) - static_cast<int64_t>(s.blocks.size());
    total_tokens += n;
    total_rows += static_cast<int64_t>(it.logit_rows.size());
  }
  if (blocks_needed > FreeBlocks()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: the batch needs ", blocks_needed * kKvBlockTokens,
                     " more slots, ", FreeBlocks() * kKvBlockTokens, " are free (capacity ",
                     max_blocks_ * kKvBlockTokens, " tokens)"));
  }
  if (items.empty()) return absl::OkStatus();

  // Append the nodes to the scratch regions and lay out the per-token metadata.
  const int64_t T = total_tokens;
  std::vector<int32_t> tokens(T), positions(T), query_seq(T), prefix_len(T);
  std::vector<int64_t> slots(T);
  std::vector<int32_t> key_offsets(T + 1, 0), keys;
  int64_t max_blocks_per_seq = 0;
  int64_t t = 0;
  for (size_t b = 0; b < items.size(); ++b) {
    const ForwardItem& it = items[b];
    Sequence& s = *seq_of[b];
    const int64_t n = static_cast<int64_t>(it.tokens.size());
    while (static_cast<int64_t>(s.blocks.size()) < CeilDiv(s.tokens() + n, kKvBlockTokens)) {
      s.blocks.push_back(AllocateBlock());
    }
    max_blocks_per_seq = std::max<int64_t>(max_blocks_per_seq, s.blocks.size());
    for (int64_t j = 0; j < n; ++j, ++t) {
      const int64_t scratch_index = static_cast<int64_t>(s.scratch_parents.size());
      s.scratch_parents.push_back(it.parents[j]);
      s.scratch_depth.push_back(new_depth[b][j]);
      tokens[t] = it.tokens[j];
      positions[t] = static_cast<int32_t>(s.committed + new_depth[b][j]);
      query_seq[t] = static_cast<int32_t>(b);
      slots[t] = PhysicalSlot(s, s.committed + scratch_index);
      // The keys are the node's ancestors (root first, itself last) after the committed prefix.
      // A scratch node whose depth equals its index has exactly scratch nodes 0..index as
      // ancestors, so the leading run of ancestors on that spine is passed as an extension of
      // the prefix (same keys, same order) rather than listed: a prefill chain then costs O(1)
      // metadata per token instead of O(length).
      const size_t start = keys.size();
      int32_t a = static_cast<int32_t>(scratch_index);
      for (; a >= 0 && s.scratch_depth[a] != a; a = s.scratch_parents[a]) {
        keys.push_back(static_cast<int32_t>(s.committed + a));
      }
      prefix_len[t] = static_cast<int32_t>(s.committed + a + 1);
      std::reverse(keys.begin() + start, keys.end());
      key_offsets[t + 1] = static_cast<int32_t>(keys.size());
    }
  }
  int64_t attention_keys = 0;  // keys summed over queries: the attention's work per head
  for (int64_t i = 0; i < T; ++i) {
    attention_keys += prefix_len[i] + key_offsets[i + 1] - key_offsets[i];
  }
  std::vector<int32_t> block_tables(items.size() * max_blocks_per_seq, 0);
  for (size_t b = 0; b < items.size(); ++b) {
    std::copy(seq_of[b]->blocks.begin(), seq_of[b]->blocks.end(),
              block_tables.begin() + b * max_blocks_per_seq);
  }

  const int64_t H = c.hidden_size, F = c.intermediate_size, hd = c.head_dim;
  const int64_t QD = int64_t{c.num_heads} * hd, KVD = kv_dim_;
  std::vector<float> residual(T * H), normed(T * H), q(T * QD), k(T * KVD), v(T * KVD),
      attn(T * QD), sub(T * H), gate(T * F), up(T * F);

  EmbeddingParams emb;
  emb.tokens = tokens.data();
  emb.table = embed_tokens_.data();
  emb.out = residual.data();
  emb.num_tokens = T;
  emb.vocab_size = c.vocab_size;
  emb.hidden = H;
  EmbeddingCpu(emb);

  const auto norm = [&](const float* x, float* res, const std::vector<float>& w, float* out,
                        int64_t rows, int64_t dim) {
    RmsNormParams p;
    p.x = x;
    p.residual = res;
    p.weight = w.data();
    p.out = out;
    p.rows = rows;
    p.dim = dim;
    p.eps = c.rms_norm_eps;
    RmsNormCpu(p);
  };
  const auto rope = [&](float* x, int64_t heads) {
    RopeParams p;
    p.x = x;
    p.positions = positions.data();
    p.inv_freq = inv_freq_.data();
    p.num_tokens = T;
    p.num_heads = heads;
    p.head_dim = hd;
    p.row_stride = heads * hd;
    RopeCpu(p);
  };

  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = layers_[l];
    // The previous layer's MLP output is added into the residual stream here.
    if (l == 0) {
      norm(residual.data(), nullptr, w.input_norm, normed.data(), T, H);
    } else {
      norm(sub.data(), residual.data(), w.input_norm, normed.data(), T, H);
    }
    Linear(normed.data(), w.q_proj, &w.q_bias, q.data(), T, H, QD);
    Linear(normed.data(), w.k_proj, &w.k_bias, k.data(), T, H, KVD);
    Linear(normed.data(), w.v_proj, &w.v_bias, v.data(), T, H, KVD);
    if (c.qk_norm) {
      norm(q.data(), nullptr, w.q_norm, q.data(), T * c.num_heads, hd);
      norm(k.data(), nullptr, w.k_norm, k.data(), T * c.num_kv_heads, hd);
    }
    rope(q.data(), c.num_heads);
    rope(k.data(), c.num_kv_heads);

    KvCacheWriteParams kw;
    kw.k = k.data();
    kw.v = v.data();
    kw.k_cache = k_pool_[l].data();
    kw.v_cache = v_pool_[l].data();
    kw.slots = slots.data();
    kw.num_tokens = T;
    kw.kv_dim = KVD;
    KvCacheWriteCpu(kw);

    TreeAttentionParams ap;
    ap.q = q.data();
    ap.out = attn.data();
    ap.k_cache = k_pool_[l].data();
    ap.v_cache = v_pool_[l].data();
    ap.block_tables = block_tables.data();
    ap.query_seq = query_seq.data();
    ap.prefix_len = prefix_len.data();
    ap.tree_key_offsets = key_offsets.data();
    ap.tree_keys = keys.data();
    ap.num_queries = T;
    ap.num_heads = c.num_heads;
    ap.num_kv_heads = c.num_kv_heads;
    ap.head_dim = hd;
    ap.block_size = kKvBlockTokens;
    ap.max_blocks_per_seq = max_blocks_per_seq;
    ap.scale = 1.0f / std::sqrt(static_cast<float>(hd));
    if (attention_keys * c.num_heads * hd < kInlineAttentionWork) {
      TreeAttentionCpu(ap);  // waking the pool would cost more than the work
    } else {
      pool_->ParallelFor(T * c.num_heads, 1, [&ap](int64_t begin, int64_t end) {
        TreeAttentionCpuItems(ap, begin, end);
      });
    }

    Linear(attn.data(), w.o_proj, nullptr, sub.data(), T, QD, H);
    norm(sub.data(), residual.data(), w.post_norm, normed.data(), T, H);
    Linear(normed.data(), w.gate_proj, nullptr, gate.data(), T, H, F);
    Linear(normed.data(), w.up_proj, nullptr, up.data(), T, H, F);
    SwiGluParams sp;
    sp.gate = gate.data();
    sp.up = up.data();
    sp.out = gate.data();
    sp.n = T * F;
    SwiGluCpu(sp);
    Linear(gate.data(), w.down_proj, nullptr, sub.data(), T, F, H);
  }

  // Only the requested rows go through the final norm and the LM head.
  const int64_t R = total_rows;
  std::vector<float> last_sub(R * H), last_res(R * H), last_norm(R * H);
  int64_t row = 0, first = 0;
  for (const ForwardItem& it : items) {
    for (int32_t r : it.logit_rows) {
      std::memcpy(&last_sub[row * H], &sub[(first + r) * H], sizeof(float) * H);
      std::memcpy(&last_res[row * H], &residual[(first + r) * H], sizeof(float) * H);
      ++row;
    }
    first += static_cast<int64_t>(it.tokens.size());
  }
  norm(last_sub.data(), last_res.data(), final_norm_, last_norm.data(), R, H);
  logits->resize(R * c.vocab_size);
  Linear(last_norm.data(), lm_head_.empty() ? embed_tokens_ : lm_head_, nullptr, logits->data(), R,
         H, c.vocab_size);
  return absl::OkStatus();
}

}  // namespace specd
