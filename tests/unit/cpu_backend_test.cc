// The CPU backend against an independent naive forward pass (full causal attention recomputed
// from scratch in double, no KV cache) on real checkpoint folders, plus the properties
// speculative decoding relies on: tree nodes, chains, single decodes and batches of sequences
// give bit-identical logits for the same token after the same prefix.
#include "engine/cpu/cpu_backend.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/io/safetensors.h"
#include "engine/backend.h"
#include "engine/model_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

using ::testing::HasSubstr;

// ---------------------------------------------------------------------------------------------
// Naive reference: every formula written out from the Hugging Face modeling code, in double.

class NaiveModel {
 public:
  explicit NaiveModel(const std::string& dir) {
    absl::StatusOr<ModelConfig> c = LoadModelConfig(dir);
    EXPECT_TRUE(c.ok()) << c.status();
    c_ = *c;
    absl::StatusOr<std::unique_ptr<TensorStore>> st = TensorStore::OpenFolder(dir);
    EXPECT_TRUE(st.ok()) << st.status();
    store_ = std::move(*st);
  }

  const ModelConfig& config() const { return c_; }

  // Logits of every position of `tokens`, [n][vocab].
  std::vector<std::vector<double>> Forward(const std::vector<int32_t>& tokens) const {
    const int n = static_cast<int>(tokens.size());
    const int H = c_.hidden_size, nh = c_.num_heads, nkv = c_.num_kv_heads, hd = c_.head_dim;
    const std::vector<float> embed = W("model.embed_tokens.weight");
    std::vector<std::vector<double>> h(n, std::vector<double>(H));
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < H; ++i) h[t][i] = embed[static_cast<size_t>(tokens[t]) * H + i];
    }
    const std::vector<double> inv_freq = InvFreq();
    for (int l = 0; l < c_.num_layers; ++l) {
      const std::string p = absl::StrCat("model.layers.", l, ".");
      std::vector<std::vector<double>> x(n);
      for (int t = 0; t < n; ++t) x[t] = Norm(h[t], W(p + "input_layernorm.weight"));
      auto q = Proj(x, p + "self_attn.q_proj", nh * hd);
      auto k = Proj(x, p + "self_attn.k_proj", nkv * hd);
      auto v = Proj(x, p + "self_attn.v_proj", nkv * hd);
      for (int t = 0; t < n; ++t) {
        for (int head = 0; head < nh; ++head)
          HeadOps(&q[t], head, t, inv_freq, p + "self_attn.q_norm.weight");
        for (int head = 0; head < nkv; ++head)
          HeadOps(&k[t], head, t, inv_freq, p + "self_attn.k_norm.weight");
      }
      std::vector<std::vector<double>> attn(n, std::vector<double>(nh * hd, 0.0));
      for (int t = 0; t < n; ++t) {
        for (int head = 0; head < nh; ++head) {
          const int kvh = head / (nh / nkv);
          std::vector<double> s(t + 1);
          double mx = -1e300;
          for (int j = 0; j <= t; ++j) {
            double dot = 0;
            for (int i = 0; i < hd; ++i) dot += q[t][head * hd + i] * k[j][kvh * hd + i];
            s[j] = dot / std::sqrt(static_cast<double>(hd));
            mx = std::max(mx, s[j]);
          }
          double sum = 0;
          for (int j = 0; j <= t; ++j) sum += s[j] = std::exp(s[j] - mx);
          for (int j = 0; j <= t; ++j) {
            for (int i = 0; i < hd; ++i) attn[t][head * hd + i] += s[j] / sum * v[j][kvh * hd + i];
          }
        }
      }
      auto o = Proj(attn, p + "self_attn.o_proj", H);
      for (int t = 0; t < n; ++t) {
        for (int i = 0; i < H; ++i) h[t][i] += o[t][i];
        x[t] = Norm(h[t], W(p + "post_attention_layernorm.weight"));
      }
      auto gate = Proj(x, p + "mlp.gate_proj", c_.intermediate_size);
      auto up = Proj(x, p + "mlp.up_proj", c_.intermediate_size);
      for (int t = 0; t < n; ++t) {
        for (int i = 0; i < c_.intermediate_size; ++i) {
          gate[t][i] = gate[t][i] / (1.0 + std::exp(-gate[t][i])) * up[t][i];
        }
      }
      auto down = Proj(gate, p + "mlp.down_proj", H);
      for (int t = 0; t < n; ++t) {
        for (int i = 0; i < H; ++i) h[t][i] += down[t][i];
      }
    }
    std::vector<std::vector<double>> x(n);
    for (int t = 0; t < n; ++t) x[t] = Norm(h[t], W("model.norm.weight"));
    return Proj(x, c_.tie_word_embeddings ? "model.embed_tokens" : "lm_head", c_.vocab_size);
  }

 private:
  std::vector<float> W(const std::string& name) const {
    absl::StatusOr<const TensorView*> t = store_->Get(name);
    EXPECT_TRUE(t.ok()) << t.status();
    std::vector<float> out((*t)->numel());
    EXPECT_TRUE(store_->ReadF32(name, (*t)->shape, out.data()).ok());
    return out;
  }

  std::vector<double> Norm(const std::vector<double>& x, const std::vector<float>& w) const {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double inv = 1.0 / std::sqrt(ss / x.size() + c_.rms_norm_eps);
    std::vector<double> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] * inv * w[i];
    return out;
  }

  std::vector<std::vector<double>> Proj(const std::vector<std::vector<double>>& x,
                                        const std::string& name, int out_dim) const {
    const std::vector<float> w = W(name + ".weight");
    std::vector<float> bias;
    if (store_->Has(name + ".bias")) bias = W(name + ".bias");
    const int in_dim = static_cast<int>(x[0].size());
    std::vector<std::vector<double>> y(x.size(), std::vector<double>(out_dim));
    for (size_t t = 0; t < x.size(); ++t) {
      for (int j = 0; j < out_dim; ++j) {
        double acc = bias.empty() ? 0.0 : bias[j];
        for (int i = 0; i < in_dim; ++i) acc += x[t][i] * w[static_cast<size_t>(j) * in_dim + i];
        y[t][j] = acc;
      }
    }
    return y;
  }

  // transformers' _compute_default_rope_parameters / _compute_llama3_parameters.
  std::vector<double> InvFreq() const {
    const int hd = c_.head_dim;
    std::vector<double> f(hd / 2);
    const RopeScaling& s = c_.rope_scaling;
    for (int i = 0; i < hd / 2; ++i) {
      f[i] = 1.0 / std::pow(static_cast<double>(c_.rope_theta), 2.0 * i / hd);
      if (s.type == "llama3") {
        const double wavelen = 2 * M_PI / f[i];
        const double low = s.original_max_position_embeddings / s.low_freq_factor;
        const double high = s.original_max_position_embeddings / s.high_freq_factor;
        if (wavelen > low) {
          f[i] /= s.factor;
        } else if (wavelen >= high) {
          const double smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) /
                                (s.high_freq_factor - s.low_freq_factor);
          f[i] = (1 - smooth) * f[i] / s.factor + smooth * f[i];
        }
      }
    }
    return f;
  }

  // Qwen3's per-head norm, then rotate-half RoPE at position `pos`.
  void HeadOps(std::vector<double>* x, int head, int pos, const std::vector<double>& inv_freq,
               const std::string& norm_name) const {
    const int hd = c_.head_dim, half = hd / 2;
    std::vector<double> v(x->begin() + head * hd, x->begin() + (head + 1) * hd);
    if (c_.qk_norm) v = Norm(v, W(norm_name));
    for (int i = 0; i < half; ++i) {
      const double a = pos * inv_freq[i];
      (*x)[head * hd + i] = v[i] * std::cos(a) - v[i + half] * std::sin(a);
      (*x)[head * hd + i + half] = v[i + half] * std::cos(a) + v[i] * std::sin(a);
    }
  }

  ModelConfig c_;
  std::unique_ptr<TensorStore> store_;
};

// ---------------------------------------------------------------------------------------------
// Helpers.

std::unique_ptr<Backend> MakeBackend(const std::string& dir, int64_t capacity = 1 << 16,
                                     int num_threads = 0) {
  BackendOptions opts;
  opts.kv_capacity_tokens = capacity;
  opts.num_threads = num_threads;
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir, opts);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

// Model folders written by this test, removed when the test program ends.
class TempDirs : public ::testing::Environment {
 public:
  static std::vector<std::string>& List() {
    static std::vector<std::string>* list = new std::vector<std::string>;
    return *list;
  }
  void TearDown() override {
    for (const std::string& d : List()) {
      std::error_code ec;
      std::filesystem::remove_all(d, ec);
    }
  }
};
::testing::Environment* const kTempDirs = ::testing::AddGlobalTestEnvironment(new TempDirs);

std::string WriteModel(const RandomCheckpointSpec& spec) {
  const std::string dir = MakeTempDir("cpu_backend_");
  TempDirs::List().push_back(dir);
  absl::Status s = WriteRandomCheckpoint(dir, spec);
  EXPECT_TRUE(s.ok()) << s;
  return dir;
}

ForwardItem Chain(SeqId seq, const std::vector<int32_t>& tokens, bool all_rows = true,
                  int32_t first_parent = -1) {
  ForwardItem it;
  it.seq = seq;
  it.tokens = tokens;
  for (size_t i = 0; i < tokens.size(); ++i) {
    it.parents.push_back(i == 0 ? first_parent : first_parent + static_cast<int32_t>(i));
    if (all_rows || i + 1 == tokens.size()) it.logit_rows.push_back(static_cast<int32_t>(i));
  }
  return it;
}

std::vector<int32_t> Iota(int n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// Feeds `tokens` to a fresh sequence one at a time (decode steps, committing each) and returns
// the logits after the last one.
std::vector<float> DecodeOneByOne(Backend* b, SeqId seq, const std::vector<int32_t>& tokens) {
  EXPECT_TRUE(b->AddSequence(seq).ok());
  std::vector<float> logits;
  for (int32_t tok : tokens) {
    EXPECT_TRUE(b->Forward({Chain(seq, {tok})}, &logits).ok());
    EXPECT_TRUE(b->Commit(seq, {0}).ok());
  }
  return logits;
}

std::vector<float> Row(const std::vector<float>& logits, int vocab, int r) {
  return std::vector<float>(logits.begin() + static_cast<size_t>(r) * vocab,
                            logits.begin() + static_cast<size_t>(r + 1) * vocab);
}

// max |got - want| / max(1, max |want|).
double RelError(absl::Span<const float> got, const std::vector<double>& want) {
  double err = 0, scale = 1;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    err = std::max(err, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / scale;
}

int32_t Argmax(absl::Span<const float> row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

// ---------------------------------------------------------------------------------------------
// Agreement with the naive forward, for every family.

struct FamilyCase {
  std::string name;
  RandomCheckpointSpec spec;
};

std::vector<FamilyCase> Families() {
  std::vector<FamilyCase> v;
  RandomCheckpointSpec s;
  s.llama3_rope_scaling = true;
  s.rope_theta = 500000.0f;
  v.push_back({"llama3_rope_scaling_gqa", s});
  s = {};
  s.model_type = "mistral";
  s.num_heads = 7;
  s.num_kv_heads = 7;
  s.hidden_size = 56;
  s.seed = 2;
  v.push_back({"mistral_7_heads", s});
  s = {};
  s.model_type = "qwen2";
  s.num_heads = 6;
  s.num_kv_heads = 2;
  s.hidden_size = 48;
  s.tie_word_embeddings = true;
  s.seed = 3;
  v.push_back({"qwen2_bias_tied", s});
  s = {};
  s.model_type = "qwen3";
  s.num_heads = 3;
  s.num_kv_heads = 1;
  s.hidden_size = 40;
  s.head_dim = 32;  // != hidden / heads
  s.seed = 4;
  v.push_back({"qwen3_qk_norm_3_heads_head_dim", s});
  s = {};
  s.num_heads = 7;
  s.num_kv_heads = 1;
  s.hidden_size = 70;
  s.head_dim = 12;
  s.num_layers = 3;
  s.dtype = DType::kBF16;
  s.shards = 3;
  s.seed = 5;
  v.push_back({"llama_bf16_sharded_7_heads", s});
  return v;
}

class FamilyTest : public ::testing::TestWithParam<FamilyCase> {};

TEST_P(FamilyTest, PrefillAndDecodeMatchNaiveForward) {
  const std::string dir = WriteModel(GetParam().spec);
  NaiveModel ref(dir);
  std::unique_ptr<Backend> b = MakeBackend(dir);
  ASSERT_NE(b, nullptr);
  const int vocab = b->config().vocab_size;
  std::vector<int32_t> seq = {257, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100};
  const int prompt = static_cast<int>(seq.size());

  ASSERT_TRUE(b->AddSequence(1).ok());
  std::vector<float> logits;
  ASSERT_TRUE(b->Forward({Chain(1, seq)}, &logits).ok());
  ASSERT_TRUE(b->Commit(1, Iota(prompt)).ok());
  EXPECT_EQ(*b->CommittedLength(1), prompt);
  std::vector<std::vector<double>> want = ref.Forward(seq);
  for (int t = 0; t < prompt; ++t) {
    EXPECT_LT(RelError(absl::MakeSpan(logits).subspan(t * vocab, vocab), want[t]), 1e-5)
        << "prefill position " << t;
  }
  // Greedy decode, each step checked against the naive forward over the whole sequence.
  int32_t next = Argmax(absl::MakeSpan(logits).subspan((prompt - 1) * vocab, vocab));
  for (int step = 0; step < 5; ++step) {
    seq.push_back(next);
    ASSERT_TRUE(b->Forward({Chain(1, {next})}, &logits).ok());
    ASSERT_TRUE(b->Commit(1, {0}).ok());
    want = ref.Forward(seq);
    EXPECT_LT(RelError(logits, want.back()), 1e-5) << "decode step " << step;
    next = Argmax(logits);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyTest, ::testing::ValuesIn(Families()),
                         [](const auto& info) { return info.param.name; });

// ---------------------------------------------------------------------------------------------
// Batch invariance and trees.

class CpuBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RandomCheckpointSpec spec;
    spec.num_heads = 6;
    spec.num_kv_heads = 2;
    spec.hidden_size = 48;
    spec.model_type = "qwen3";  // every op on the path: qk norm as well
    spec.seed = 11;
    dir_ = WriteModel(spec);
    backend_ = MakeBackend(dir_);
    ASSERT_NE(backend_, nullptr);
    vocab_ = backend_->config().vocab_size;
  }

  std::string dir_;
  std::unique_ptr<Backend> backend_;
  int vocab_ = 0;
  const std::vector<int32_t> prompt_ = {257, 10,  20,  30,  40,  50,  60,  70,  80,  90, 100,
                                        110, 120, 130, 140, 150, 160, 170, 180, 190, 200};
};

TEST_F(CpuBackendTest, ChainPrefillEqualsTokenByTokenDecodeBitForBit) {
  Backend& b = *backend_;
  ASSERT_TRUE(b.AddSequence(1).ok());
  std::vector<float> chain;
  ASSERT_TRUE(b.Forward({Chain(1, prompt_)}, &chain).ok());
  ASSERT_TRUE(b.AddSequence(2).ok());
  for (size_t t = 0; t < prompt_.size(); ++t) {
    std::vector<float> one;
    ASSERT_TRUE(b.Forward({Chain(2, {prompt_[t]})}, &one).ok());
    ASSERT_TRUE(b.Commit(2, {0}).ok());
    EXPECT_EQ(one, Row(chain, vocab_, static_cast<int>(t))) << "position " << t;
  }
}

// Long enough that attention runs on the thread pool, and spans many KV blocks.
TEST_F(CpuBackendTest, LongPromptInPiecesMatchesOnePieceAndTheNaiveForward) {
  Backend& b = *backend_;
  std::vector<int32_t> prompt(150);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 37 + 5) % 256);
  ASSERT_TRUE(b.AddSequence(1).ok());
  std::vector<float> whole;
  ASSERT_TRUE(b.Forward({Chain(1, prompt, false)}, &whole).ok());
  ASSERT_TRUE(b.AddSequence(2).ok());
  std::vector<float> part;
  for (auto [begin, end] : {std::pair<int, int>{0, 61}, {61, 149}, {149, 150}}) {
    ASSERT_TRUE(
        b.Forward(
             {Chain(2, std::vector<int32_t>(prompt.begin() + begin, prompt.begin() + end), false)},
             &part)
            .ok());
    ASSERT_TRUE(b.Commit(2, Iota(end - begin)).ok());
  }
  EXPECT_EQ(part, whole);
  NaiveModel ref(dir_);
  EXPECT_LT(RelError(whole, ref.Forward(prompt).back()), 1e-5);
}

TEST_F(CpuBackendTest, TreeNodesEqualTheirPathsDecodedAsChains) {
  Backend& b = *backend_;
  ASSERT_TRUE(b.AddSequence(1).ok());
  std::vector<float> logits;
  ASSERT_TRUE(b.Forward({Chain(1, prompt_, false)}, &logits).ok());
  ASSERT_TRUE(b.Commit(1, Iota(static_cast<int>(prompt_.size()))).ok());
  // Two roots; branches at depth 0 and 1; a chain of depth 4.
  //   0:a -> 1:b -> 3:d -> 6:g
  //       -> 2:c
  //   4:e -> 5:f
  //       1:b -> 7:h
  ForwardItem tree;
  tree.seq = 1;
  tree.tokens = {65, 66, 67, 68, 69, 70, 71, 72};
  tree.parents = {-1, 0, 0, 1, -1, 4, 3, 1};
  tree.logit_rows = {7, 0, 1, 2, 3, 4, 5, 6};  // any order
  std::vector<float> tree_logits;
  ASSERT_TRUE(b.Forward({tree}, &tree_logits).ok());
  ASSERT_EQ(tree_logits.size(), 8u * vocab_);
  for (int r = 0; r < 8; ++r) {
    const int node = tree.logit_rows[r];
    std::vector<int32_t> path;
    for (int n = node; n >= 0; n = tree.parents[n]) path.insert(path.begin(), tree.tokens[n]);
    std::vector<int32_t> full = prompt_;
    full.insert(full.end(), path.begin(), path.end());
    const std::vector<float> want = DecodeOneByOne(&b, 100 + node, full);
    EXPECT_EQ(Row(tree_logits, vocab_, r), want) << "node " << node;
  }
}

TEST_F(CpuBackendTest, CommitLeavesTheCacheAsIfThePathHadBeenDecoded) {
  Backend& b = *backend_;
  ASSERT_TRUE(b.AddSequence(1).ok());
  std::vector<float> logits;
  ASSERT_TRUE(b.Forward({Chain(1, prompt_, false)}, &logits).ok());
  ASSERT_TRUE(b.Commit(1, Iota(static_cast<int>(prompt_.size()))).ok());
  ForwardItem tree;
  tree.seq = 1;
  tree.tokens = {65, 66, 67, 68, 69, 70, 71};
  tree.parents = {-1, -1, 1, 0, 2, 2, 4};
  tree.logit_rows = {0};
  ASSERT_TRUE(b.Forward({tree}, &logits).ok());
  // A second Forward before the commit grows the same scratch tree.
  ForwardItem more = Chain(1, {80, 81}, true, 6);
  ASSERT_TRUE(b.Forward({more}, &logits).ok());
  const std::vector<int32_t> path = {1, 2, 4, 6, 7, 8};  // 66 67 69 71 80 81
  ASSERT_TRUE(b.Commit(1, path).ok());
  EXPECT_EQ(*b.CommittedLength(1), static_cast<int64_t>(prompt_.size() + path.size()));
  std::vector<int32_t> full = prompt_;
  for (int32_t p : {66, 67, 69, 71, 80, 81}) full.push_back(p);
  // Three more decode steps on both: the committed caches must be identical.
  std::vector<int32_t> probe_ref = full;
  ASSERT_TRUE(b.AddSequence(2).ok());
  ASSERT_TRUE(b.Forward({Chain(2, full, false)}, &logits).ok());
  ASSERT_TRUE(b.Commit(2, Iota(static_cast<int>(full.size()))).ok());
  for (int32_t tok : {5, 6, 7}) {
    std::vector<float> a, c;
    ASSERT_TRUE(b.Forward({Chain(1, {tok})}, &a).ok());
    ASSERT_TRUE(b.Forward({Chain(2, {tok})}, &c).ok());
    EXPECT_EQ(a, c) << "token " << tok;
    ASSERT_TRUE(b.Commit(1, {0}).ok());
    ASSERT_TRUE(b.Commit(2, {0}).ok());
  }
  // An empty commit drops the scratch region without changing the prefix.
  const int64_t len = *b.CommittedLength(1);
  ASSERT_TRUE(b.Forward({Chain(1, {9, 9, 9})}, &logits).ok());
  ASSERT_TRUE(b.Commit(1, {}).ok());
  EXPECT_EQ(*b.CommittedLength(1), len);
}

TEST_F(CpuBackendTest, BatchingSequencesTogetherGivesTheSameLogitsAsAlone) {
  // Alone: each sequence in its own backend (fresh cache, no neighbours).
  const std::vector<std::vector<int32_t>> prompts = {
      {257, 1, 2, 3}, {257, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 33}, {257, 200}};
  const std::vector<ForwardItem> trees = {{0, {5, 6, 7}, {-1, 0, 0}, {0, 1, 2}},
                                          {0, {8}, {-1}, {0}},
                                          {0, {11, 12, 13, 14, 15}, {-1, 0, 1, -1, 3}, {4, 2}}};
  std::vector<std::vector<float>> alone_prefill, alone_tree;
  for (size_t i = 0; i < prompts.size(); ++i) {
    std::unique_ptr<Backend> b = MakeBackend(dir_);
    ASSERT_TRUE(b->AddSequence(0).ok());
    std::vector<float> l;
    ASSERT_TRUE(b->Forward({Chain(0, prompts[i])}, &l).ok());
    alone_prefill.push_back(l);
    ASSERT_TRUE(b->Commit(0, Iota(static_cast<int>(prompts[i].size()))).ok());
    ASSERT_TRUE(b->Forward({trees[i]}, &l).ok());
    alone_tree.push_back(l);
  }
  Backend& b = *backend_;
  std::vector<ForwardItem> prefill, verify;
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(b.AddSequence(40 + i).ok());
    prefill.push_back(Chain(40 + i, prompts[i]));
    verify.push_back(trees[i]);
    verify.back().seq = 40 + i;
  }
  std::vector<float> l;
  ASSERT_TRUE(b.Forward(prefill, &l).ok());
  size_t off = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const size_t n = alone_prefill[i].size();
    EXPECT_EQ(std::vector<float>(l.begin() + off, l.begin() + off + n), alone_prefill[i]) << i;
    off += n;
    ASSERT_TRUE(b.Commit(40 + i, Iota(static_cast<int>(prompts[i].size()))).ok());
  }
  ASSERT_TRUE(b.Forward(verify, &l).ok());
  off = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const size_t n = alone_tree[i].size();
    EXPECT_EQ(std::vector<float>(l.begin() + off, l.begin() + off + n), alone_tree[i]) << i;
    off += n;
  }
  EXPECT_EQ(off, l.size());
}

TEST(CpuBackendThreadsTest, ThreadCountChangesNoBit) {
  // Large enough that every GEMM splits its columns over the pool (and attention runs on it).
  RandomCheckpointSpec spec;
  spec.hidden_size = 256;
  spec.intermediate_size = 384;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.vocab_size = 1000;
  spec.seed = 12;
  const std::string dir = WriteModel(spec);
  std::vector<int32_t> prompt(70);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(i * 7 % 256);
  const ForwardItem tree = {1, {5, 6, 7, 8, 9}, {-1, 0, 0, 1, 3}, {0, 1, 2, 3, 4}};
  std::vector<std::vector<float>> prefill, verify;
  for (int threads : {1, 2, 3, 5}) {
    std::unique_ptr<Backend> b = MakeBackend(dir, 1 << 16, threads);
    ASSERT_NE(b, nullptr);
    ASSERT_TRUE(b->AddSequence(1).ok());
    std::vector<float> l;
    ASSERT_TRUE(b->Forward({Chain(1, prompt)}, &l).ok());
    prefill.push_back(l);
    ASSERT_TRUE(b->Commit(1, Iota(static_cast<int>(prompt.size()))).ok());
    ASSERT_TRUE(b->Forward({tree}, &l).ok());
    verify.push_back(l);
  }
  for (size_t i = 1; i < prefill.size(); ++i) {
    EXPECT_EQ(prefill[i], prefill[0]) << "thread setting " << i;
    EXPECT_EQ(verify[i], verify[0]) << "thread setting " << i;
  }
}

TEST(CpuBackendThreadsTest, Bf16MatricesGiveTheFp32Bits) {
  // A bf16 checkpoint's matrices are kept as bf16 (BackendOptions::cpu_bf16_weights): the
  // logits must be those of the same weights widened to fp32, tied LM head or not, at one row
  // (decode), a few (a tree) and many (a prefill), also with the GEMMs split over threads.
  for (bool tied : {true, false}) {
    RandomCheckpointSpec spec;
    spec.model_type = "qwen2";  // QKV biases too
    spec.hidden_size = 96;
    spec.intermediate_size = 200;
    spec.num_heads = 4;
    spec.num_kv_heads = 2;
    spec.vocab_size = 700;
    spec.tie_word_embeddings = tied;
    spec.dtype = DType::kBF16;
    spec.seed = 21;
    const std::string dir = WriteModel(spec);
    std::vector<int32_t> prompt(40);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(i * 11 % 256);
    const ForwardItem tree = {1, {5, 6, 7, 8, 9}, {-1, 0, 0, 1, 3}, {0, 1, 2, 3, 4}};
    std::vector<std::vector<float>> logits[2];
    for (int packed = 0; packed < 2; ++packed) {
      for (int threads : {1, 3}) {
        BackendOptions opts;
        opts.kv_capacity_tokens = 1 << 12;
        opts.num_threads = threads;
        opts.cpu_bf16_weights = packed == 1;
        absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir, opts);
        ASSERT_TRUE(b.ok()) << b.status();
        ASSERT_TRUE((*b)->AddSequence(1).ok());
        std::vector<float> l;
        ASSERT_TRUE((*b)->Forward({Chain(1, prompt)}, &l).ok());
        logits[packed].push_back(l);
        ASSERT_TRUE((*b)->Commit(1, Iota(static_cast<int>(prompt.size()))).ok());
        ASSERT_TRUE((*b)->Forward({Chain(1, {3})}, &l).ok());
        logits[packed].push_back(l);
        ASSERT_TRUE((*b)->Commit(1, {}).ok());
        ASSERT_TRUE((*b)->Forward({tree}, &l).ok());
        logits[packed].push_back(l);
      }
    }
    ASSERT_EQ(logits[0].size(), logits[1].size());
    for (size_t i = 0; i < logits[0].size(); ++i) {
      EXPECT_EQ(logits[1][i], logits[0][i]) << "tied " << tied << ", forward " << i;
      EXPECT_EQ(logits[1][i], logits[1][i % 3]) << "tied " << tied << ", forward " << i;
    }
  }
}

TEST_F(CpuBackendTest, VerifyWithGreedySamplingReproducesPlainDecoding) {
  Backend& b = *backend_;
  const int kNew = 12;
  const std::vector<std::vector<int32_t>> prompts = {prompt_, {257, 3, 1, 4, 1, 5, 9, 2, 6}};
  // Target-only greedy decoding, one sequence at a time.
  std::vector<std::vector<int32_t>> greedy(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    const SeqId seq = static_cast<SeqId>(i);
    ASSERT_TRUE(b.AddSequence(seq).ok());
    std::vector<float> logits;
    ASSERT_TRUE(b.Forward({Chain(seq, prompts[i], false)}, &logits).ok());
    ASSERT_TRUE(b.Commit(seq, Iota(static_cast<int>(prompts[i].size()))).ok());
    greedy[i] = {Argmax(logits)};
    // Some beyond kNew, so that the last trees' guesses are right too (one sequence may run
    // ahead of the other by a few tokens).
    while (static_cast<int>(greedy[i].size()) < kNew + 16) {
      ASSERT_TRUE(b.Forward({Chain(seq, {greedy[i].back()})}, &logits).ok());
      ASSERT_TRUE(b.Commit(seq, {0}).ok());
      greedy[i].push_back(Argmax(logits));
    }
  }
  // Speculative, both sequences in every Verify call, with trees mixing right and wrong
  // guesses: a right chain of 3 with wrong siblings (3 accepted), a wrong first guess (none
  // accepted), a single right guess.
  std::vector<std::vector<int32_t>> out(prompts.size()), pending = prompts;
  for (size_t i = 0; i < prompts.size(); ++i) ASSERT_TRUE(b.AddSequence(10 + i).ok());
  for (int step = 0; static_cast<int>(std::min(out[0].size(), out[1].size())) < kNew; ++step) {
    std::vector<VerifyItem> items;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const size_t k = out[i].size();
      auto g = [&](size_t j) { return greedy[i].at(j); };
      VerifyItem item;
      item.seq = static_cast<SeqId>(10 + i);
      item.pending = pending[i];
      const int kind = (step + static_cast<int>(i)) % 3;
      if (kind == 0) {
        item.tree.tokens = {(g(k) + 1) % vocab_, g(k), g(k + 1), (g(k + 1) + 7) % vocab_, g(k + 2)};
        item.tree.parents = {-1, -1, 1, 1, 2};
      } else if (kind == 1) {
        item.tree = ChainTree({(g(k) + 3) % vocab_, g(k + 1)});
      } else {
        item.tree = ChainTree({g(k)});
      }
      items.push_back(item);
    }
    absl::StatusOr<std::vector<VerifyOutcome>> res = b.Verify(items);
    ASSERT_TRUE(res.ok()) << res.status();
    ASSERT_EQ(res->size(), prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      const VerifyOutcome& o = (*res)[i];
      const int kind = (step + static_cast<int>(i)) % 3;
      EXPECT_EQ(o.accepted_draft, static_cast<int>(o.tokens.size()) - 1);
      const std::vector<int32_t> want_nodes[] = {{1, 2, 4}, {}, {0}};
      EXPECT_EQ(o.accepted_nodes, want_nodes[kind]) << "step " << step << " sequence " << i;
      out[i].insert(out[i].end(), o.tokens.begin(), o.tokens.end());
      pending[i] = {o.tokens.back()};
      // The committed length is the prompt plus every emitted token but the pending one.
      EXPECT_EQ(*b.CommittedLength(10 + i),
                static_cast<int64_t>(prompts[i].size() + out[i].size() - 1));
    }
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    out[i].resize(kNew);
    greedy[i].resize(kNew);
    EXPECT_EQ(out[i], greedy[i]) << "sequence " << i;
  }
}

// ---------------------------------------------------------------------------------------------
// Errors.

TEST_F(CpuBackendTest, BadForwardInputsGiveClearErrors) {
  Backend& b = *backend_;
  ASSERT_TRUE(b.AddSequence(1).ok());
  EXPECT_EQ(b.AddSequence(1).code(), absl::StatusCode::kAlreadyExists);
  std::vector<float> logits;
  absl::Status s = b.Forward({Chain(7, {1})}, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("7"));
  s = b.Forward({Chain(1, {1, vocab_})}, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tokens[1]"));
  s = b.Forward({Chain(1, {-3})}, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  ForwardItem bad_parent = Chain(1, {1, 2});
  bad_parent.parents[1] = 1;
  s = b.Forward({bad_parent}, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("parents[1]"));
  bad_parent.parents = {-1};
  EXPECT_THAT(b.Forward({bad_parent}, &logits).message(), HasSubstr("parents"));
  ForwardItem bad_row = Chain(1, {1, 2});
  bad_row.logit_rows = {2};
  EXPECT_THAT(b.Forward({bad_row}, &logits).message(), HasSubstr("logit_rows"));
  EXPECT_EQ(b.Forward({Chain(1, {})}, &logits).code(), absl::StatusCode::kInvalidArgument);
  s = b.Forward({Chain(1, {1}), Chain(1, {2})}, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("twice"));
  // None of that touched the sequence.
  EXPECT_EQ(*b.CommittedLength(1), 0);
  EXPECT_EQ(*static_cast<CpuBackend&>(b).ScratchLength(1), 0);
  EXPECT_EQ(b.Usage().used_tokens, 0);

  ASSERT_TRUE(b.Forward({Chain(1, {1, 2, 3})}, &logits).ok());
  s = b.Commit(1, {0, 2});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("path[1]"));
  EXPECT_EQ(b.Commit(1, {5}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b.Commit(1, {1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b.Commit(9, {0}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(b.CommittedLength(9).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(b.RemoveSequence(9).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(b.Commit(1, {0, 1}).ok());
  EXPECT_EQ(*b.CommittedLength(1), 2);
  ASSERT_TRUE(b.RemoveSequence(1).ok());
  EXPECT_FALSE(b.HasSequence(1));
  EXPECT_EQ(b.Usage().sequences, 0);
}

TEST(CpuBackendErrorsTest, ContextBeyondMaxPositionEmbeddings) {
  RandomCheckpointSpec spec;
  spec.max_position_embeddings = 8;
  const std::string dir = WriteModel(spec);
  std::unique_ptr<Backend> b = MakeBackend(dir);
  ASSERT_TRUE(b->AddSequence(1).ok());
  std::vector<float> logits;
  absl::Status s = b->Forward({Chain(1, Iota(9))}, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("max_position_embeddings"));
  ASSERT_TRUE(b->Forward({Chain(1, Iota(8))}, &logits).ok());
  ASSERT_TRUE(b->Commit(1, Iota(8)).ok());
  EXPECT_EQ(b->Forward({Chain(1, {1})}, &logits).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuBackendErrorsTest, KvCapacityExhaustedIsResourceExhaustedAndRecoverable) {
  const std::string dir = WriteModel({});
  std::unique_ptr<Backend> b = MakeBackend(dir, /*capacity=*/40);  // 3 blocks of 16
  EXPECT_EQ(b->Usage().capacity_tokens, 48);
  ASSERT_TRUE(b->AddSequence(1).ok());
  ASSERT_TRUE(b->AddSequence(2).ok());
  std::vector<float> logits;
  ASSERT_TRUE(b->Forward({Chain(1, Iota(20))}, &logits).ok());  // 2 blocks
  absl::Status s = b->Forward({Chain(2, Iota(20))}, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("KV cache"));
  EXPECT_EQ(b->Usage().used_tokens, 20);
  ASSERT_TRUE(b->Forward({Chain(2, Iota(16))}, &logits).ok());  // the last block
  EXPECT_EQ(b->AddSequence(3).code(), absl::StatusCode::kResourceExhausted);
  // Committing a short path returns the blocks the scratch nodes held.
  ASSERT_TRUE(b->Commit(1, Iota(5)).ok());
  EXPECT_EQ(b->Usage().used_tokens, 5 + 16);
  ASSERT_TRUE(b->AddSequence(3).ok());
  ASSERT_TRUE(b->Forward({Chain(3, Iota(10))}, &logits).ok());
  ASSERT_TRUE(b->RemoveSequence(2).ok());
  ASSERT_TRUE(b->RemoveSequence(3).ok());
  ASSERT_TRUE(b->Forward({Chain(1, Iota(30), false, -1)}, &logits).ok());
}

TEST(CpuBackendErrorsTest, UnknownDeviceIsUnimplemented) {
  const std::string dir = WriteModel({});
  BackendOptions opts;
  opts.device = "tpu:0";
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir, opts);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(b.status().message(), HasSubstr("tpu:0"));
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
}

TEST(CpuBackendErrorsTest, BadCheckpointsNameTheFileAndTensor) {
  const std::string dir = WriteModel({});
  const std::string config = ReadFile(dir + "/config.json");
  BackendOptions opts;
  // A missing tensor: the config asks for a third layer the file does not have.
  {
    std::string c = config;
    c.replace(c.find("\"num_hidden_layers\": 2"), 22, "\"num_hidden_layers\": 3");
    WriteFile(dir + "/config.json", c);
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir, opts);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(b.status().message(), HasSubstr("model.layers.2."));
  }
  // A missing bias: qwen2 expects q/k/v biases that a llama checkpoint lacks.
  {
    std::string c = config;
    c.replace(c.find("\"attention_bias\": false"), 23, "\"attention_bias\": true");
    WriteFile(dir + "/config.json", c);
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir, opts);
    EXPECT_FALSE(b.ok());
    EXPECT_THAT(b.status().message(), HasSubstr("self_attn.q_proj.bias"));
  }
  // A wrong shape: intermediate_size disagrees with the MLP weights.
  {
    std::string c = config;
    c.replace(c.find("\"intermediate_size\": 160"), 24, "\"intermediate_size\": 161");
    WriteFile(dir + "/config.json", c);
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir, opts);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(b.status().message(), HasSubstr("mlp.gate_proj.weight"));
    EXPECT_THAT(b.status().message(), HasSubstr("model.safetensors"));
  }
  WriteFile(dir + "/config.json", config);
  ASSERT_TRUE(CreateBackend(dir, opts).ok());
  // A truncated weights file.
  const std::string weights = ReadFile(dir + "/model.safetensors");
  WriteFile(dir + "/model.safetensors", weights.substr(0, weights.size() / 2));
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir, opts);
  EXPECT_FALSE(b.ok());
  EXPECT_THAT(b.status().message(), HasSubstr("model.safetensors"));
  // No folder at all.
  EXPECT_FALSE(CreateBackend(dir + "/nope", opts).ok());
}

}  // namespace
}  // namespace specd
