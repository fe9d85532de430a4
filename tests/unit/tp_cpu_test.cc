// The CPU tensor-parallel backend (engine/tp/tp_cpu_backend.h) on real checkpoint folders whose
// head counts the world sizes do not divide: 7 query heads over 1 KV head (llama, llama3 rope
// scaling), 6 over 3 (qwen2 biases, tied embeddings; at N = 4 one KV head is replicated), 3 over
// 1 (qwen3 q/k norm, bf16 weights; N = 7 leaves ranks without heads), and Llama-3.1-70B's own
// 64 over 8 in miniature (head_dim 8; at N = 7 ranks hold 9 or 10 query heads and some hold two
// KV heads); FFN and vocabulary sizes that no N divides (the 64/8 model's FFN, like 70B's, is a
// multiple of 7). Against CpuBackend (TP = 1): logits to fp32 rounding through prefill,
// batches, tree verification and KV commits; greedy generation token-identical, speculative
// and target-only; and the properties verification relies on (a tree node's logits equal the
// same token decoded after its path, bit for bit, at the same N).
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "engine/backend.h"
#include "engine/draft/draft_model_drafter.h"
#include "engine/spec/generator.h"
#include "engine/tp/tp_backend.h"
#include "engine/tp/tp_cpu_backend.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testutil/extended_checkpoint.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

using ::testing::HasSubstr;

enum class Family { kLlama, kQwen2, kQwen3, kLlama70Heads };

const char* Name(Family f) {
  switch (f) {
    case Family::kLlama: return "llama_7q1kv";
    case Family::kQwen2: return "qwen2_6q3kv";
    case Family::kQwen3: return "qwen3_3q1kv";
    case Family::kLlama70Heads: return "llama_64q8kv";
  }
  return "?";
}

// Written once per process. The llama target is a 1-layer draft plus one appended layer
// (tests/testutil/extended_checkpoint.h), so the draft's proposals are often accepted.
struct Models {
  std::string root, llama_draft, llama, qwen2, qwen3, llama70;
  Models() {
    root = MakeTempDir("specd_tp_");
    llama70 = root + "/llama70";
    llama_draft = root + "/llama_draft";
    llama = root + "/llama";
    qwen2 = root + "/qwen2";
    qwen3 = root + "/qwen3";
    RandomCheckpointSpec a;
    a.model_type = "llama";
    a.vocab_size = 299;
    a.hidden_size = 40;
    a.intermediate_size = 44;
    a.num_layers = 1;
    a.num_heads = 7;
    a.num_kv_heads = 1;
    a.head_dim = 8;
    a.llama3_rope_scaling = true;
    a.init_std = 0.3f;
    a.seed = 61;
    EXPECT_TRUE(WriteRandomCheckpoint(llama_draft, a).ok());
    ExtendSpec extend;
    extend.extra_layers = 1;
    extend.output_scale = 0.15f;
    extend.init_std = 0.3f;
    extend.seed = 62;
    EXPECT_TRUE(WriteExtendedCheckpoint(llama_draft, llama, extend).ok());

    RandomCheckpointSpec b;
    b.model_type = "qwen2";
    b.vocab_size = 301;
    b.hidden_size = 48;
    b.intermediate_size = 50;
    b.num_layers = 2;
    b.num_heads = 6;
    b.num_kv_heads = 3;
    b.head_dim = 8;
    b.tie_word_embeddings = true;
    b.init_std = 0.3f;
    b.seed = 63;
    EXPECT_TRUE(WriteRandomCheckpoint(qwen2, b).ok());

    RandomCheckpointSpec c;
    c.model_type = "qwen3";
    c.vocab_size = 300;
    c.hidden_size = 32;
    c.intermediate_size = 37;
    c.num_layers = 1;
    c.num_heads = 3;
    c.num_kv_heads = 1;
    c.head_dim = 16;
    c.dtype = DType::kBF16;
    c.init_std = 0.3f;
    c.seed = 64;
    EXPECT_TRUE(WriteRandomCheckpoint(qwen3, c).ok());

    RandomCheckpointSpec d;  // Llama-3.1-70B's attention layout, narrow heads
    d.model_type = "llama";
    d.vocab_size = 503;
    d.hidden_size = 512;
    d.intermediate_size = 224;
    d.num_layers = 2;
    d.num_heads = 64;
    d.num_kv_heads = 8;
    d.head_dim = 8;
    d.llama3_rope_scaling = true;
    d.init_std = 0.15f;
    d.seed = 65;
    EXPECT_TRUE(WriteRandomCheckpoint(llama70, d).ok());
  }
  ~Models() {
    std::error_code ec;
    std::filesystem::remove_all(root, ec);
  }
  const std::string& Dir(Family f) const {
    switch (f) {
      case Family::kLlama: return llama;
      case Family::kQwen2: return qwen2;
      case Family::kQwen3: return qwen3;
      case Family::kLlama70Heads: break;
    }
    return llama70;
  }
};

Models& M() {
  static Models* models = new Models();
  return *models;
}

// tensor_parallel 1 is CpuBackend, the reference.
std::unique_ptr<Backend> Load(const std::string& dir, int tp) {
  BackendOptions options;
  options.tensor_parallel = tp;
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir, options);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

// fp32 tolerance relative to the row's scale: the row-parallel sums add the same products in a
// different grouping, so results differ by a few ulps of the largest terms.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, int vocab,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t row = 0; row * vocab < want.size(); ++row) {
    float scale = 0.0f, worst = 0.0f;
    for (int i = 0; i < vocab; ++i) {
      const float w = want[row * vocab + i], g = got[row * vocab + i];
      ASSERT_FALSE(std::isnan(g)) << what << " row " << row;
      scale = std::max(scale, std::abs(w));
      worst = std::max(worst, std::abs(g - w));
    }
    EXPECT_LE(worst, 1e-5f * std::max(scale, 1.0f)) << what << " row " << row;
  }
}

// ---------------------------------------------------------------------------------------------

TEST(InProcessAllReduceTest, SumsInRankOrderAndEveryRankGetsTheSameBits) {
  for (int world : {1, 2, 3, 5, 7}) {
    InProcessCommGroup group(world);
    // Several calls of different sizes in a row (including fewer elements than ranks and
    // none), so the result buffer's reuse across calls is exercised.
    const std::vector<int64_t> sizes = {1000, 3, 0, 1, 4097, 17};
    std::vector<std::vector<std::vector<float>>> data(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        TpCommunicator* comm = group.rank(r);
        EXPECT_EQ(comm->rank(), r);
        EXPECT_EQ(comm->world_size(), world);
        for (int64_t n : sizes) {
          std::vector<float> v(n);
          // Values of very different magnitudes, so a different order would change bits.
          for (int64_t i = 0; i < n; ++i) {
            v[i] = std::ldexp(1.0f + 0.37f * ((i * 7 + r * 13) % 11), ((i + r * 5) % 40) - 20) *
                   ((i + r) % 3 == 0 ? -1.0f : 1.0f);
          }
          std::vector<float> in = v;
          comm->AllReduceSum(v.data(), n);
          data[r].push_back(std::move(in));
          data[r].push_back(std::move(v));
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (size_t call = 0; call < sizes.size(); ++call) {
      for (int64_t i = 0; i < sizes[call]; ++i) {
        float want = data[0][2 * call][i];
        for (int r = 1; r < world; ++r) want += data[r][2 * call][i];
        for (int r = 0; r < world; ++r) {
          ASSERT_EQ(data[r][2 * call + 1][i], want)
              << "world " << world << " call " << call << " rank " << r << " element " << i;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------

struct TpCase {
  Family family;
  int tp;
};

class TpLogitsTest : public ::testing::TestWithParam<TpCase> {};

// One script of calls run on both backends, comparing every output: a batch of two prefills,
// then a tree for one sequence and a decode for the other in one batch, commits of a path
// that needs KV compaction, and a decode after it.
TEST_P(TpLogitsTest, MatchesSingleRankThroughPrefillTreeCommitAndDecode) {
  const std::string& dir = M().Dir(GetParam().family);
  std::unique_ptr<Backend> ref = Load(dir, 1);
  std::unique_ptr<Backend> tp = Load(dir, GetParam().tp);
  ASSERT_TRUE(ref && tp);
  const int vocab = ref->config().vocab_size;
  ASSERT_EQ(tp->config().vocab_size, vocab);
  const std::string what = absl::StrCat(Name(GetParam().family), " TP=", GetParam().tp);

  std::vector<std::vector<ForwardItem>> steps;
  ForwardItem a{1, {3, 250, 17, 42, 42, 9, 298, 100, 5}, {}, {}};
  ForwardItem b{2, {7, 7, 120, 64, 1}, {}, {}};
  for (ForwardItem* it : {&a, &b}) {
    for (int i = 0; i < static_cast<int>(it->tokens.size()); ++i) {
      it->parents.push_back(i - 1);
      it->logit_rows.push_back(i);
    }
  }
  std::reverse(b.logit_rows.begin(), b.logit_rows.end());  // rows in any order
  steps.push_back({a, b});
  steps.push_back({ForwardItem{1, {11, 12, 13, 14, 15}, {-1, 0, 0, 1, 2}, {4, 0, 1, 2, 3}},
                   ForwardItem{2, {77}, {-1}, {0}}});
  steps.push_back({ForwardItem{1, {200}, {-1}, {0}}});

  for (Backend* be : {ref.get(), tp.get()}) {
    ASSERT_TRUE(be->AddSequence(1).ok());
    ASSERT_TRUE(be->AddSequence(2).ok());
  }
  const std::vector<std::vector<std::pair<SeqId, std::vector<int32_t>>>> commits = {
      {{1, {0, 1, 2, 3, 4, 5, 6, 7, 8}}, {2, {0, 1, 2, 3, 4}}},
      {{1, {0, 2, 4}}, {2, {0}}},  // nodes 2 and 4 move down to scratch slots 1 and 2
      {{1, {0}}}};
  for (size_t s = 0; s < steps.size(); ++s) {
    std::vector<float> want, got;
    ASSERT_TRUE(ref->Forward(steps[s], &want).ok());
    ASSERT_TRUE(tp->Forward(steps[s], &got).ok());
    ExpectClose(got, want, vocab, absl::StrCat(what, " step ", s));
    for (const auto& [seq, path] : commits[s]) {
      ASSERT_TRUE(ref->Commit(seq, path).ok());
      ASSERT_TRUE(tp->Commit(seq, path).ok());
      EXPECT_EQ(*tp->CommittedLength(seq), *ref->CommittedLength(seq));
    }
    EXPECT_EQ(tp->Usage().used_tokens, ref->Usage().used_tokens);
  }
  ASSERT_TRUE(tp->RemoveSequence(1).ok());
  EXPECT_FALSE(tp->HasSequence(1));
  EXPECT_EQ(tp->Usage().sequences, 1);
}

std::vector<TpCase> LogitCases() {
  std::vector<TpCase> cases;
  for (Family f : {Family::kLlama, Family::kQwen2, Family::kQwen3}) {
    for (int tp : {2, 3, 4, 7}) cases.push_back({f, tp});
  }
  // The reference deployment's verify (7 ranks) and the whole 8-GPU host.
  for (int tp : {2, 7, 8}) cases.push_back({Family::kLlama70Heads, tp});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Models, TpLogitsTest, ::testing::ValuesIn(LogitCases()),
                         [](const ::testing::TestParamInfo<TpCase>& info) {
                           return absl::StrCat(Name(info.param.family), "_tp", info.param.tp);
                         });

// A rank count of 1 through the tensor-parallel machinery (one rank thread, no-op all-reduce)
// is the single-device model too.
TEST(TpCpuTest, OneRankThroughTheTensorParallelBackendMatchesCpuBackend) {
  BackendOptions options;
  options.tensor_parallel = 1;
  absl::StatusOr<std::unique_ptr<TensorParallelBackend>> tp =
      CreateTpCpuBackend(M().qwen2, options);
  ASSERT_TRUE(tp.ok()) << tp.status();
  std::unique_ptr<Backend> ref = Load(M().qwen2, 1);
  const ForwardItem item{5, {1, 2, 3, 250}, {-1, 0, 1, 2}, {0, 1, 2, 3}};
  std::vector<float> want, got;
  ASSERT_TRUE(ref->AddSequence(5).ok());
  ASSERT_TRUE((*tp)->AddSequence(5).ok());
  ASSERT_TRUE(ref->Forward({item}, &want).ok());
  ASSERT_TRUE((*tp)->Forward({item}, &got).ok());
  ExpectClose(got, want, ref->config().vocab_size, "TP=1");
}

// Verification relies on a tree node's logits being those of the same token decoded after its
// path (engine/cpu/cpu_backend.h, determinism); the sharded model keeps that, bit for bit.
TEST(TpCpuTest, TreeNodesEqualSequentialDecodeBitForBit) {
  for (int tp : {3, 7}) {
    std::unique_ptr<Backend> be = Load(M().llama, tp);
    ASSERT_TRUE(be);
    const int vocab = be->config().vocab_size;
    const std::vector<int32_t> prompt = {10, 20, 30, 40, 50, 60};
    ASSERT_TRUE(be->AddSequence(1).ok());
    ASSERT_TRUE(be->AddSequence(2).ok());
    std::vector<float> unused;
    for (SeqId s : {1, 2}) {
      ASSERT_TRUE(be->Forward({ForwardItem{s, prompt, {-1, 0, 1, 2, 3, 4}, {}}}, &unused).ok());
      ASSERT_TRUE(be->Commit(s, {0, 1, 2, 3, 4, 5}).ok());
    }
    // Tree: 0 -> {1, 2}, 2 -> 3. The path 0, 2, 3 is then decoded token by token.
    std::vector<float> tree;
    ASSERT_TRUE(be->Forward({ForwardItem{1, {7, 8, 9, 11}, {-1, 0, 0, 2}, {0, 2, 3}}}, &tree).ok());
    const std::vector<int32_t> path_tokens = {7, 9, 11};
    for (size_t j = 0; j < path_tokens.size(); ++j) {
      std::vector<float> one;
      ASSERT_TRUE(be->Forward({ForwardItem{2, {path_tokens[j]}, {-1}, {0}}}, &one).ok());
      ASSERT_TRUE(be->Commit(2, {0}).ok());
      for (int i = 0; i < vocab; ++i) {
        ASSERT_EQ(one[i], tree[j * vocab + i]) << "TP=" << tp << " path node " << j;
      }
    }
    // Committing the tree's path leaves sequence 1 exactly where sequence 2 is.
    ASSERT_TRUE(be->Commit(1, {0, 2, 3}).ok());
    std::vector<float> next;
    ASSERT_TRUE(
        be->Forward({ForwardItem{1, {5}, {-1}, {0}}, ForwardItem{2, {5}, {-1}, {0}}}, &next).ok());
    EXPECT_TRUE(std::equal(next.begin(), next.begin() + vocab, next.begin() + vocab))
        << "TP=" << tp;
  }
}

// ForwardTopK ranks the rows on the rank threads over the logits the ranks wrote together; it
// must equal Forward() followed by the host top-k (Backend::ForwardTopK) bit for bit, for a
// batch of a prefill chain, a tree and a row-less item, and k up to kMaxForwardTopK.
TEST(TpCpuTest, ForwardTopKEqualsForwardAndHostTopK) {
  for (int tp : {2, 7}) {
    std::unique_ptr<Backend> be = Load(M().llama, tp);
    ASSERT_TRUE(be);
    for (SeqId s : {1, 2, 3}) ASSERT_TRUE(be->AddSequence(s).ok());
    const std::vector<ForwardItem> items = {
        ForwardItem{1, {10, 20, 30, 40, 50}, {-1, 0, 1, 2, 3}, {4, 0}},
        ForwardItem{2, {7, 8, 9, 11, 12}, {-1, 0, 0, 2, 2}, {1, 2, 3, 4}},
        ForwardItem{3, {5}, {-1}, {}}};
    for (int k : {1, 4, kMaxForwardTopK}) {
      TopKRows got, want;
      ASSERT_TRUE(be->ForwardTopK(items, k, &got).ok());
      for (SeqId s : {1, 2, 3}) ASSERT_TRUE(be->Commit(s, {}).ok());
      ASSERT_TRUE(be->Backend::ForwardTopK(items, k, &want).ok());
      for (SeqId s : {1, 2, 3}) ASSERT_TRUE(be->Commit(s, {}).ok());
      EXPECT_EQ(got.k, k);
      EXPECT_EQ(got.rows(), 6);
      EXPECT_EQ(got.ids, want.ids) << "TP=" << tp << " k=" << k;
      ASSERT_EQ(got.logprobs.size(), want.logprobs.size());
      for (size_t i = 0; i < want.logprobs.size(); ++i) {
        EXPECT_EQ(absl::bit_cast<uint32_t>(got.logprobs[i]),
                  absl::bit_cast<uint32_t>(want.logprobs[i]))
            << "TP=" << tp << " k=" << k << " entry " << i;
      }
    }
    TopKRows out;
    for (int k : {0, kMaxForwardTopK + 1}) {
      const absl::Status s = be->ForwardTopK(items, k, &out);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("k"));
    }
    // A bad item leaves every sequence as it was.
    std::vector<ForwardItem> bad = items;
    bad[2].tokens = {100000};
    EXPECT_EQ(be->ForwardTopK(bad, 2, &out).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(*static_cast<TensorParallelBackend*>(be.get())->ScratchLength(1), 0);
  }
}

// Verify chooses tokens from per-rank vocabulary candidates (no gathered logits) for greedy
// and unfiltered temperature sampling; its outcomes must equal the host acceptance on the
// gathered logits of the same sharded model (Backend::Verify), and top-k/top-p fall back to it.
TEST(TpCpuTest, VerifyFromVocabCandidatesEqualsAcceptanceOnGatheredLogits) {
  for (int tp : {2, 7}) {
    std::unique_ptr<Backend> a = Load(M().qwen2, tp), b = Load(M().qwen2, tp);
    ASSERT_TRUE(a && b);
    std::vector<SamplingParams> params(4);
    params[1].temperature = 0.8f;
    params[1].seed = 3;
    params[2].temperature = 1.5f;
    params[2].seed = 4;
    params[3].temperature = 1.0f;
    params[3].top_k = 5;
    params[3].seed = 5;
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_TRUE(a->AddSequence(i).ok());
      ASSERT_TRUE(b->AddSequence(i).ok());
    }
    std::vector<VerifyItem> items(params.size());
    for (size_t i = 0; i < items.size(); ++i) {
      items[i].seq = i;
      items[i].pending = {static_cast<int32_t>(10 + i), 20, 30};
      items[i].sampling = params[i];
    }
    for (int step = 0; step < 6; ++step) {
      for (size_t i = 0; i < items.size(); ++i) {
        TokenTree& t = items[i].tree;
        t.tokens = {static_cast<int32_t>((step * 31 + i * 7) % 301), 5, 6, 7};
        t.parents = {-1, -1, 0, 0};
      }
      absl::StatusOr<std::vector<VerifyOutcome>> got = a->Verify(items);
      absl::StatusOr<std::vector<VerifyOutcome>> want = b->Backend::Verify(items);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_TRUE(want.ok()) << want.status();
      for (size_t i = 0; i < items.size(); ++i) {
        EXPECT_EQ((*got)[i].tokens, (*want)[i].tokens) << "TP=" << tp << " step " << step;
        EXPECT_EQ((*got)[i].accepted_nodes, (*want)[i].accepted_nodes);
        EXPECT_EQ(*a->CommittedLength(i), *b->CommittedLength(i));
        items[i].pending = {(*want)[i].tokens.back()};
      }
    }
    EXPECT_EQ(a->Usage().used_tokens, b->Usage().used_tokens);
    // The top-k item sends every batch of the loop to the gathered logits.
    EXPECT_EQ(static_cast<TensorParallelBackend*>(a.get())->gathered_verify_calls(), 6);
  }
}

// Log-probabilities in the vocabulary-parallel path come from per-rank statistics (log-sum-exp
// and top-n of each rank's vocabulary slice, merged): the same emitted tokens, ranks and top ids
// as TP = 1 (CpuBackend) and as the host's ComputeLogprobs on this N's gathered logits
// (Backend::Verify), raw and processed, greedy and sampled, for emitted rows at several depths
// of accepted chains. The values are within 1e-6 of the gathered ones (the merge's only error
// is double rounding) and within 1e-4 of TP = 1's (the bound against transformers):
// those logits differ by fp32 rounding of the row-parallel sums (ExpectClose above, up to
// 1e-5 of the row's largest logit), which reaches 3e-5 in a logprob on these models.
TEST(TpCpuTest, VerifyLogprobsFromRankStatisticsEqualSingleRank) {
  for (Family family : {Family::kQwen2, Family::kLlama70Heads}) {
    for (int tp : {2, 7}) {
      std::unique_ptr<Backend> ranks = Load(M().Dir(family), tp);
      std::unique_ptr<Backend> gathered = Load(M().Dir(family), tp);
      std::unique_ptr<Backend> single = Load(M().Dir(family), 1);
      ASSERT_TRUE(ranks && gathered && single);
      const int vocab = single->config().vocab_size;
      struct Case {
        float temperature;
        LogprobsMode mode;
        int logprobs;
      };
      const std::vector<Case> cases = {{0.0f, LogprobsMode::kRaw, 5},
                                       {0.0f, LogprobsMode::kProcessed, kMaxLogprobs},
                                       {0.8f, LogprobsMode::kProcessed, 3},
                                       {1.5f, LogprobsMode::kRaw, 0},
                                       {1.0f, LogprobsMode::kRaw, -1}};
      std::vector<VerifyItem> items(cases.size());
      std::vector<std::vector<int32_t>> history(cases.size());
      // Greedy continuations of a history, decoded one by one on a TP = 1 model of its own.
      std::unique_ptr<Backend> oracle = Load(M().Dir(family), 1);
      ASSERT_TRUE(oracle);
      SeqId oracle_id = 100;
      auto greedy = [&](const std::vector<int32_t>& prefix, int n) {
        const SeqId id = oracle_id++;
        EXPECT_TRUE(oracle->AddSequence(id).ok());
        std::vector<int32_t> out;
        VerifyItem item{id, prefix, {}, {}};
        for (int i = 0; i < n; ++i) {
          absl::StatusOr<std::vector<VerifyOutcome>> o = oracle->Verify({item});
          EXPECT_TRUE(o.ok()) << o.status();
          if (!o.ok()) break;
          out.push_back((*o)[0].tokens[0]);
          item.pending = {out.back()};
        }
        EXPECT_TRUE(oracle->RemoveSequence(id).ok());
        return out;
      };
      for (size_t i = 0; i < items.size(); ++i) {
        for (Backend* be : {ranks.get(), gathered.get(), single.get()}) {
          ASSERT_TRUE(be->AddSequence(i).ok());
        }
        items[i].seq = i;
        items[i].pending = {static_cast<int32_t>(10 + i), 20, 30};
        items[i].sampling.temperature = cases[i].temperature;
        items[i].sampling.seed = 7 + i;
        items[i].logprobs = cases[i].logprobs;
        items[i].logprobs_mode = cases[i].mode;
        history[i] = items[i].pending;
      }
      int compared = 0, deep = 0;
      for (int step = 0; step < 5; ++step) {
        for (size_t i = 0; i < items.size(); ++i) {
          // Greedy items get their true continuation as a chain of 2 with a wrong sibling at
          // each level, so rows below the root emit; the sampled ones a fixed small tree.
          TokenTree& t = items[i].tree;
          if (items[i].sampling.greedy()) {
            const std::vector<int32_t> next = greedy(history[i], 2);
            ASSERT_EQ(next.size(), 2u);
            t.tokens = {(next[0] + 1) % vocab, next[0], (next[1] + 1) % vocab, next[1]};
            t.parents = {-1, -1, 1, 1};
          } else {
            t.tokens = {static_cast<int32_t>((step * 31 + i * 7) % vocab), 5, 6, 7};
            t.parents = {-1, -1, 0, 0};
          }
        }
        absl::StatusOr<std::vector<VerifyOutcome>> got = ranks->Verify(items);
        absl::StatusOr<std::vector<VerifyOutcome>> host = gathered->Backend::Verify(items);
        absl::StatusOr<std::vector<VerifyOutcome>> one = single->Verify(items);
        ASSERT_TRUE(got.ok()) << got.status();
        ASSERT_TRUE(host.ok()) << host.status();
        ASSERT_TRUE(one.ok()) << one.status();
        for (size_t i = 0; i < items.size(); ++i) {
          const std::string what =
              absl::StrCat(Name(family), " TP=", tp, " step ", step, " item ", i);
          const VerifyOutcome& g = (*got)[i];
          ASSERT_EQ(g.tokens, (*one)[i].tokens) << what;
          ASSERT_EQ(g.tokens, (*host)[i].tokens) << what;
          if (items[i].logprobs < 0) {
            EXPECT_TRUE(g.logprobs.empty()) << what;
            continue;
          }
          ASSERT_EQ(g.logprobs.size(), g.tokens.size()) << what;
          for (const std::vector<VerifyOutcome>* want : {&*one, &*host}) {
            ASSERT_EQ((*want)[i].logprobs.size(), g.tokens.size()) << what;
            for (size_t t = 0; t < g.tokens.size(); ++t) {
              const TokenLogprobs& a = g.logprobs[t];
              const TokenLogprobs& b = (*want)[i].logprobs[t];
              const std::string at =
                  absl::StrCat(what, " token ", t, want == &*one ? " vs TP=1" : " vs gathered");
              const double tolerance = want == &*one ? 1e-4 : 1e-6;
              EXPECT_NEAR(a.logprob, b.logprob, tolerance) << at;
              EXPECT_EQ(a.rank, b.rank) << at;
              ASSERT_EQ(a.top.size(), b.top.size()) << at;
              EXPECT_EQ(a.top.size(), static_cast<size_t>(items[i].logprobs)) << at;
              for (size_t k = 0; k < a.top.size(); ++k) {
                EXPECT_EQ(a.top[k].token, b.top[k].token) << at << " top " << k;
                EXPECT_NEAR(a.top[k].logprob, b.top[k].logprob, tolerance) << at << " top " << k;
              }
              ++compared;
            }
          }
          deep += g.accepted_draft;
        }
        for (size_t i = 0; i < items.size(); ++i) {
          const std::vector<int32_t>& emitted = (*got)[i].tokens;
          history[i].insert(history[i].end(), emitted.begin(), emitted.end());
          items[i].pending = {emitted.back()};
        }
      }
      // Both greedy items accept their 2-token chains at every step.
      EXPECT_GE(deep, 2 * 2 * 5) << Name(family) << " TP=" << tp;
      EXPECT_GE(compared, 2 * (4 * 5 + deep)) << Name(family) << " TP=" << tp;
      // Every batch took the per-rank path (none gathered its logits).
      EXPECT_EQ(static_cast<TensorParallelBackend*>(ranks.get())->gathered_verify_calls(), 0);
    }
  }
}

// ---------------------------------------------------------------------------------------------

std::vector<GenerationRequest> Requests(int vocab) {
  std::vector<GenerationRequest> reqs;
  for (int p = 0; p < 6; ++p) {
    GenerationRequest r;
    for (int i = 0; i < 3 + p; ++i) r.prompt.push_back((p * 37 + i * 11 + 5) % vocab);
    r.max_new_tokens = 14;
    r.ignore_eos = true;
    r.draft.depth = 3;
    r.draft.top_k = 2;
    r.draft.max_nodes = 6;
    reqs.push_back(r);
  }
  return reqs;
}

std::vector<GenerationResult> Generate(Backend* target, Drafter* drafter, int vocab) {
  absl::StatusOr<std::unique_ptr<Generator>> gen = Generator::Create(target, drafter);
  EXPECT_TRUE(gen.ok()) << gen.status();
  if (!gen.ok()) return {};
  absl::StatusOr<std::vector<GenerationResult>> out = (*gen)->Generate(Requests(vocab));
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : std::vector<GenerationResult>();
}

TEST(TpCpuTest, GreedyGenerationIsTokenIdenticalAtEveryRankCount) {
  struct Pair {
    Family family;
    std::string draft_dir;  // a standalone draft model of the same vocabulary
  };
  // The qwen and 64/8 models draft for themselves (every draft token is the target's favourite, so
  // the longest paths get accepted); the llama target has its related 1-layer draft.
  for (const Pair& pair :
       {Pair{Family::kLlama, M().llama_draft}, Pair{Family::kQwen2, M().qwen2},
        Pair{Family::kQwen3, M().qwen3}, Pair{Family::kLlama70Heads, M().llama70}}) {
    std::unique_ptr<Backend> draft_model = Load(pair.draft_dir, 1);
    ASSERT_TRUE(draft_model);
    DraftModelDrafter drafter(draft_model.get());
    const int vocab = draft_model->config().vocab_size;
    std::vector<GenerationResult> want_plain, want_spec;
    for (int tp : {1, 2, 3, 7}) {
      std::unique_ptr<Backend> target = Load(M().Dir(pair.family), tp);
      ASSERT_TRUE(target);
      const std::vector<GenerationResult> plain = Generate(target.get(), nullptr, vocab);
      const std::vector<GenerationResult> spec = Generate(target.get(), &drafter, vocab);
      ASSERT_EQ(plain.size(), 6u);
      ASSERT_EQ(spec.size(), 6u);
      if (tp == 1) {
        want_plain = plain;
        want_spec = spec;
      }
      for (size_t i = 0; i < plain.size(); ++i) {
        const std::string what = absl::StrCat(Name(pair.family), " TP=", tp, " request ", i);
        EXPECT_EQ(plain[i].tokens.size(), 14u) << what;
        EXPECT_EQ(plain[i].tokens, want_plain[i].tokens) << what;
        EXPECT_EQ(spec[i].tokens, want_plain[i].tokens) << what << " (speculative)";
        // Same logits up to rounding, so the same draft tokens get accepted at every N.
        EXPECT_EQ(spec[i].stats.accepted_tokens, want_spec[i].stats.accepted_tokens) << what;
        EXPECT_EQ(spec[i].stats.steps, want_spec[i].stats.steps) << what;
      }
    }
    int64_t accepted = 0;
    for (const GenerationResult& r : want_spec) accepted += r.stats.accepted_tokens;
    EXPECT_GT(accepted, 0) << Name(pair.family) << ": the test needs accepted drafts";
  }
}

// ---------------------------------------------------------------------------------------------

// Both backends refuse the same bad calls the same way and leave the state unchanged.
TEST(TpCpuTest, BadCallsFailLikeCpuBackend) {
  BackendOptions options;
  options.kv_capacity_tokens = 32;
  std::vector<std::unique_ptr<Backend>> backends;
  for (int tp : {1, 3}) {
    options.tensor_parallel = tp;
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(M().qwen3, options);
    ASSERT_TRUE(b.ok()) << b.status();
    backends.push_back(*std::move(b));
  }
  std::vector<absl::Status> first;
  for (size_t k = 0; k < backends.size(); ++k) {
    Backend& be = *backends[k];
    std::vector<absl::Status> got;
    got.push_back(be.AddSequence(1));
    got.push_back(be.AddSequence(1));
    std::vector<int32_t> many(40, 3), parents(40);
    for (int i = 0; i < 40; ++i) parents[i] = i - 1;
    std::vector<float> logits;
    got.push_back(be.Forward({ForwardItem{1, many, parents, {0}}}, &logits));
    got.push_back(be.Forward({ForwardItem{1, {300}, {-1}, {0}}}, &logits));
    got.push_back(be.Forward({ForwardItem{1, {3}, {0}, {0}}}, &logits));
    got.push_back(be.Forward({ForwardItem{9, {3}, {-1}, {0}}}, &logits));
    got.push_back(be.Commit(1, {0}));
    got.push_back(be.RemoveSequence(4));
    EXPECT_EQ(*be.CommittedLength(1), 0);
    EXPECT_EQ(be.Usage().used_tokens, 0);
    if (k == 0) {
      first = got;
      continue;
    }
    ASSERT_EQ(got.size(), first.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].code(), first[i].code()) << "call " << i << ": " << got[i];
      EXPECT_EQ(got[i].message(), first[i].message()) << "call " << i;
    }
  }
  EXPECT_EQ(first[1].code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(first[2].code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(first[3].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(first[5].code(), absl::StatusCode::kNotFound);
}

void EditConfig(const std::string& dir, const std::string& key, int value) {
  nlohmann::json j;
  {
    std::ifstream in(dir + "/config.json");
    in >> j;
  }
  j[key] = value;
  std::ofstream(dir + "/config.json", std::ios::trunc) << j.dump(2);
}

TEST(TpCpuTest, LoadErrorsNameTheFieldTheFileAndTheTensor) {
  BackendOptions options;
  options.tensor_parallel = 0;
  absl::StatusOr<std::unique_ptr<Backend>> zero = CreateBackend(M().qwen3, options);
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(zero.status().message(), HasSubstr("tensor_parallel"));

  options.tensor_parallel = 3;
  const std::string dir = MakeTempDir("specd_tp_bad_");
  RandomCheckpointSpec spec;
  spec.num_layers = 1;
  spec.num_heads = 3;
  spec.num_kv_heads = 1;
  spec.head_dim = 8;
  spec.hidden_size = 24;
  spec.intermediate_size = 20;
  ASSERT_TRUE(WriteRandomCheckpoint(dir, spec).ok());
  EditConfig(dir, "intermediate_size", 21);
  absl::StatusOr<std::unique_ptr<Backend>> shape = CreateBackend(dir, options);
  EXPECT_EQ(shape.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(shape.status().message(), HasSubstr("mlp.gate_proj.weight"));
  EXPECT_THAT(shape.status().message(), HasSubstr("model.safetensors"));

  EditConfig(dir, "intermediate_size", 20);
  EditConfig(dir, "num_hidden_layers", 2);
  absl::StatusOr<std::unique_ptr<Backend>> missing = CreateBackend(dir, options);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("model.layers.1."));
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace
}  // namespace specd
