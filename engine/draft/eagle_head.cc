#include "engine/draft/eagle_head.h"

#include <cstring>
#include <numeric>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/draft/eagle_head_cpu.h"
#ifdef SPECD_WITH_CUDA
#include "engine/draft/eagle_head_cuda.h"
#endif

namespace specd {
namespace {

std::string Shape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Reads a head's tensors by name and remembers which it read, so that the rest can be refused.
class HeadReader {
 public:
  HeadReader(const TensorStore& store, const EagleHeadConfig& config)
      : store_(store),
        where_(config.dir.empty() ? std::string("head") : config.dir),
        kind_(config.kind == EagleKind::kEagle3 ? "EAGLE-3" : "EAGLE-1/2") {}

  bool Has(const std::string& name) const { return store_.Has(name); }

  absl::Status Read(const std::string& name, const std::vector<int64_t>& shape,
                    std::vector<float>* out) {
    if (!store_.Has(name)) {
      return absl::InvalidArgumentError(absl::StrCat(where_, ": missing tensor ", name,
                                                     ", expected shape ", Shape(shape), " (", kind_,
                                                     " head)"));
    }
    used_.insert(name);
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    out->resize(n);
    return store_.ReadF32(name, shape, out->data());
  }

  // An integer tensor [n] (int64 or int32) as int64.
  absl::Status ReadInts(const std::string& name, int64_t n, std::vector<int64_t>* out) {
    absl::StatusOr<const TensorView*> v = store_.Get(name);
    if (!v.ok()) return v.status();
    used_.insert(name);
    const TensorView& t = **v;
    if (t.shape != std::vector<int64_t>{n} || (t.dtype != DType::kI64 && t.dtype != DType::kI32)) {
      return absl::InvalidArgumentError(absl::StrCat(t.file, ": tensor ", name, " is ",
                                                     DTypeName(t.dtype), " ", Shape(t.shape),
                                                     ", expected I64 [", n, "]"));
    }
    out->resize(n);
    for (int64_t i = 0; i < n; ++i) {
      if (t.dtype == DType::kI64) {
        std::memcpy(&(*out)[i], t.data + i * 8, 8);
      } else {
        int32_t x;
        std::memcpy(&x, t.data + i * 4, 4);
        (*out)[i] = x;
      }
    }
    return absl::OkStatus();
  }

  // A boolean mask [n] (BOOL or U8).
  absl::Status ReadMask(const std::string& name, int64_t n, std::vector<uint8_t>* out) {
    absl::StatusOr<const TensorView*> v = store_.Get(name);
    if (!v.ok()) return v.status();
    used_.insert(name);
    const TensorView& t = **v;
    if (t.shape != std::vector<int64_t>{n} || (t.dtype != DType::kBool && t.dtype != DType::kU8)) {
      return absl::InvalidArgumentError(absl::StrCat(t.file, ": tensor ", name, " is ",
                                                     DTypeName(t.dtype), " ", Shape(t.shape),
                                                     ", expected BOOL [", n, "]"));
    }
    out->assign(t.data, t.data + n);
    return absl::OkStatus();
  }

  absl::Status CheckAllRead() const {
    for (const std::string& name : store_.Names()) {
      if (used_.count(name) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(where_, ": tensor ", name,
                                                       " is not part of an ", kind_,
                                                       " head (specd would ignore it)"));
      }
    }
    return absl::OkStatus();
  }

 private:
  const TensorStore& store_;
  const std::string where_;
  const char* kind_;
  std::set<std::string> used_;
};

#define SPECD_RETURN_IF_ERROR_(expr) \
  do {                               \
    absl::Status _s = (expr);        \
    if (!_s.ok()) return _s;         \
  } while (0)

// d2t / t2d of an EAGLE-3 head: the target id of every draft id.
absl::Status ReadVocabMap(HeadReader& r, const EagleHeadConfig& c, std::vector<int32_t>* out) {
  const int64_t dv = c.draft_vocab_size, v = c.vocab_size;
  std::vector<int64_t> d2t(dv, 0);
  if (r.Has("d2t")) {
    SPECD_RETURN_IF_ERROR_(r.ReadInts("d2t", dv, &d2t));
  } else if (dv != v) {
    return absl::InvalidArgumentError(absl::StrCat(c.dir, ": missing tensor d2t, expected I64 [",
                                                   dv, "] (draft_vocab_size ", dv, " < vocab ", v,
                                                   ")"));
  }
  out->resize(dv);
  std::vector<uint8_t> seen(v, 0);
  for (int64_t d = 0; d < dv; ++d) {
    const int64_t t = d + d2t[d];
    if (t < 0 || t >= v) {
      return absl::InvalidArgumentError(absl::StrCat(c.dir, ": d2t[", d, "] = ", d2t[d],
                                                     " maps draft id ", d, " to ", t,
                                                     ", outside the vocabulary [0, ", v, ")"));
    }
    if (seen[t]) {
      return absl::InvalidArgumentError(
          absl::StrCat(c.dir, ": d2t maps two draft ids to target id ", t));
    }
    seen[t] = 1;
    (*out)[d] = static_cast<int32_t>(t);
  }
  if (r.Has("t2d")) {
    std::vector<uint8_t> t2d;
    SPECD_RETURN_IF_ERROR_(r.ReadMask("t2d", v, &t2d));
    for (int64_t t = 0; t < v; ++t) {
      if ((t2d[t] != 0) != (seen[t] != 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat(c.dir, ": t2d[", t, "] is ", t2d[t] != 0 ? "true" : "false", " but d2t ",
                         seen[t] ? "maps" : "does not map", " a draft id to ", t));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<EagleHeadWeights> LoadEagleHeadWeights(const EagleHeadConfig& c,
                                                      const TensorStore& head,
                                                      const TensorStore& target,
                                                      const ModelConfig& tc) {
  const ModelConfig& h = c.head;
  const int64_t H = h.hidden_size, Ht = c.target_hidden_size, F = h.intermediate_size;
  const int64_t Q = int64_t{h.num_heads} * h.head_dim, KV = int64_t{h.num_kv_heads} * h.head_dim;
  const int64_t V = c.vocab_size;
  const bool e3 = c.kind == EagleKind::kEagle3;
  HeadReader r(head, c);
  EagleHeadWeights w;

  if (r.Has("embed_tokens.weight")) {
    SPECD_RETURN_IF_ERROR_(r.Read("embed_tokens.weight", {V, H}, &w.embed));
  } else {
    if (H != tc.hidden_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          c.dir, ": missing tensor embed_tokens.weight, expected shape ", Shape({V, H}),
          " (the head's hidden_size differs from the target's, so it cannot use the target's "
          "embedding)"));
    }
    w.embed.resize(V * H);
    SPECD_RETURN_IF_ERROR_(target.ReadF32("model.embed_tokens.weight", {V, H}, w.embed.data()));
  }
  SPECD_RETURN_IF_ERROR_(r.Read("fc.weight", {H, e3 ? 3 * Ht : 2 * H}, &w.fc));
  if (!e3 && c.fc_bias) SPECD_RETURN_IF_ERROR_(r.Read("fc.bias", {H}, &w.fc_bias));

  const int64_t in = e3 ? 2 * H : H;
  w.layers.resize(h.num_layers);
  for (int l = 0; l < h.num_layers; ++l) {
    const std::string p = e3 ? std::string("midlayer.") : absl::StrCat("layers.", l, ".");
    EagleHeadWeights::Layer& L = w.layers[l];
    if (e3 || l > 0) {
      SPECD_RETURN_IF_ERROR_(r.Read(p + "input_layernorm.weight", {H}, &L.input_norm));
    }
    if (e3) SPECD_RETURN_IF_ERROR_(r.Read(p + "hidden_norm.weight", {H}, &L.hidden_norm));
    SPECD_RETURN_IF_ERROR_(r.Read(p + "post_attention_layernorm.weight", {H}, &L.post_norm));
    SPECD_RETURN_IF_ERROR_(r.Read(p + "self_attn.q_proj.weight", {Q, in}, &L.q_proj));
    SPECD_RETURN_IF_ERROR_(r.Read(p + "self_attn.k_proj.weight", {KV, in}, &L.k_proj));
    SPECD_RETURN_IF_ERROR_(r.Read(p + "self_attn.v_proj.weight", {KV, in}, &L.v_proj));
    SPECD_RETURN_IF_ERROR_(r.Read(p + "self_attn.o_proj.weight", {H, Q}, &L.o_proj));
    SPECD_RETURN_IF_ERROR_(r.Read(p + "mlp.gate_proj.weight", {F, H}, &L.gate_proj));
    SPECD_RETURN_IF_ERROR_(r.Read(p + "mlp.up_proj.weight", {F, H}, &L.up_proj));
    SPECD_RETURN_IF_ERROR_(r.Read(p + "mlp.down_proj.weight", {H, F}, &L.down_proj));
  }
  if (e3) {
    SPECD_RETURN_IF_ERROR_(r.Read("norm.weight", {H}, &w.norm));
    SPECD_RETURN_IF_ERROR_(r.Read("lm_head.weight", {c.draft_vocab_size, H}, &w.lm_head));
    SPECD_RETURN_IF_ERROR_(ReadVocabMap(r, c, &w.draft_to_target));
  } else {
    const char* name = tc.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    w.lm_head.resize(V * H);
    SPECD_RETURN_IF_ERROR_(target.ReadF32(name, {V, H}, w.lm_head.data()));
    w.draft_to_target.resize(V);
    for (int32_t i = 0; i < V; ++i) w.draft_to_target[i] = i;
  }
  SPECD_RETURN_IF_ERROR_(r.CheckAllRead());
  return w;
}

absl::Status EagleHead::ForwardTopK(absl::Span<const EagleHeadItem> items, int k,
                                    EagleHeadOutputs* out, TopKRows* top) {
  if (out == nullptr || top == nullptr) return absl::InvalidArgumentError("out or top is null");
  if (k < 1 || k > kMaxForwardTopK) {
    return absl::InvalidArgumentError(
        absl::StrCat("k: ", k, " is not in [1, ", kMaxForwardTopK, "]"));
  }
  if (absl::Status s = Forward(items, out); !s.ok()) return s;
  TopKRowsOnHost(out->logits, config().draft_vocab_size, k, top);
  out->logits.clear();
  return absl::OkStatus();
}

absl::StatusOr<WarmUpReport> WarmUpEagleHead(EagleHead& head, const std::vector<int64_t>& rows) {
  const EagleHeadConfig& config = head.config();
  const KvUsage usage = head.Usage();
  const int64_t limit =
      std::min<int64_t>(head.context_length(), usage.capacity_tokens - usage.used_tokens);
  EagleHeadOutputs out;
  std::vector<float> features;
  return WarmUpRows(head, rows, limit, [&](int64_t m) {
    EagleHeadItem item;
    item.seq = kWarmUpSeq;
    item.tokens = WarmUpTokens(m, config.vocab_size);
    item.parents.resize(m);
    std::iota(item.parents.begin(), item.parents.end(), -1);
    item.input = EagleInput::kTargetFeatures;
    features.assign(static_cast<size_t>(m) * config.feature_size(), 0.01f);
    item.inputs = features;
    item.output_rows.resize(m);
    std::iota(item.output_rows.begin(), item.output_rows.end(), 0);
    return head.Forward({item}, &out);
  });
}

absl::StatusOr<std::unique_ptr<EagleHead>> CreateEagleHead(const std::string& head_dir,
                                                           const std::string& target_dir,
                                                           const EagleHeadOptions& options) {
  // cuda or cuda:N selects the CUDA head (bf16), cpu the fp32 one.
  int cuda_device = -1;
  if (options.device == "cuda") {
    cuda_device = 0;
  } else if (absl::StartsWith(options.device, "cuda:")) {
    if (!absl::SimpleAtoi(options.device.substr(5), &cuda_device) || cuda_device < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device: \"", options.device, "\": expected cpu, cuda or cuda:N with N a GPU index"));
    }
  } else if (options.device != "cpu") {
    return absl::InvalidArgumentError(
        absl::StrCat("device: \"", options.device, "\": expected cpu, cuda or cuda:N"));
  }
#ifndef SPECD_WITH_CUDA
  if (cuda_device >= 0) {
    return absl::UnimplementedError(
        absl::StrCat("device: \"", options.device, "\": this build has no CUDA"));
  }
#endif
  absl::StatusOr<ModelConfig> target = LoadModelConfig(target_dir);
  if (!target.ok()) return target.status();
  absl::StatusOr<EagleHeadConfig> config = LoadEagleHeadConfig(head_dir, *target);
  if (!config.ok()) return config.status();
  absl::StatusOr<std::unique_ptr<TensorStore>> head_store = TensorStore::OpenFolder(head_dir);
  if (!head_store.ok()) return head_store.status();
  absl::StatusOr<std::unique_ptr<TensorStore>> target_store = TensorStore::OpenFolder(target_dir);
  if (!target_store.ok()) return target_store.status();
  absl::StatusOr<EagleHeadWeights> weights =
      LoadEagleHeadWeights(*config, **head_store, **target_store, *target);
  if (!weights.ok()) return weights.status();
#ifdef SPECD_WITH_CUDA
  if (cuda_device >= 0) {
    return EagleHeadCuda::Create(*std::move(config), *target, *std::move(weights), cuda_device,
                                 options);
  }
#endif
  return EagleHeadCpu::Create(*std::move(config), *target, *std::move(weights), options);
}

}  // namespace specd
