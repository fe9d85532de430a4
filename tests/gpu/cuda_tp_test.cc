// The tensor-parallel CUDA backend (engine/cuda/cuda_tp_backend.h) on two GPUs of one host,
// against the fp32 CPU backend, the one-GPU CUDA backend and itself:
//  - logits of random checkpoints whose head counts 2 does not divide (7 query heads over 1 KV
//    head: uneven query split, the KV head replicated on both ranks; QKV bias, q/k norm,
//    head_dim 128, tied and untied vocabularies) within bf16 tolerance of the CPU, with the
//    custom all-reduce and with NCCL only;
//  - greedy continuations of the reference model at TP=2 equal to TP=1, except where TP=1's
//    own top-2 logit gap is a bf16 near-tie (reported, and the gap is checked);
//  - speculative decoding at TP=2 (draft model on GPU 0, trees verified over both GPUs) equal
//    token for token to target-only decoding at TP=2: greedy, seeded temperature sampling (the
//    per-rank candidate path) and seeded top-k/top-p sampling (the gathered-logits path).
// Skipped on a host with fewer than two GPUs.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/backend.h"
#include "engine/draft/draft_model_drafter.h"
#include "engine/spec/generator.h"
#include "nlohmann/json.hpp"
#include "tests/gpu/gpu_test_util.h"
#include "tests/testutil/hf_fixtures.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

namespace fs = std::filesystem;
using gpu_test::RandomTokens;
using gpu_test::RowsClose;
using nlohmann::json;

class CudaTpTest : public gpu_test::GpuTest {
 protected:
  void SetUp() override {
    gpu_test::GpuTest::SetUp();
    if (IsSkipped()) return;
    int n = 0;
    cudaGetDeviceCount(&n);
    if (n < 2) GTEST_SKIP() << "tensor parallelism needs two GPUs; this host has " << n;
  }

  // tp == 0: the CPU backend. custom_bytes: BackendOptions::cuda_custom_allreduce_max_bytes.
  static std::unique_ptr<Backend> Load(const std::string& dir, int tp,
                                       int64_t custom_bytes = -1) {
    BackendOptions opts;
    opts.device = tp == 0 ? "cpu" : "cuda:0";
    opts.tensor_parallel = std::max(tp, 1);
    opts.kv_capacity_tokens = 1 << 14;
    opts.cuda_custom_allreduce_max_bytes = custom_bytes;
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir, opts);
    EXPECT_TRUE(b.ok()) << "tp " << tp << ": " << b.status();
    return b.ok() ? std::move(*b) : nullptr;
  }
};

TEST_F(CudaTpTest, LogitsMatchCpuOnUnevenSplits) {
  struct Case {
    std::string name;
    RandomCheckpointSpec spec;
  };
  std::vector<Case> cases;
  RandomCheckpointSpec s;
  s.vocab_size = 320;
  s.hidden_size = 128;
  s.intermediate_size = 352;
  s.num_layers = 3;
  s.num_heads = 6;
  s.num_kv_heads = 2;
  s.head_dim = 64;
  s.dtype = DType::kBF16;
  s.model_type = "llama";
  s.llama3_rope_scaling = true;
  s.rope_theta = 500000.0f;
  cases.push_back({"llama3 6q/2kv", s});
  s.llama3_rope_scaling = false;
  s.model_type = "qwen2";
  s.num_heads = 7;
  s.num_kv_heads = 1;
  s.tie_word_embeddings = true;
  cases.push_back({"qwen2 7q/1kv tied", s});
  s.model_type = "qwen3";
  s.hidden_size = 256;
  s.num_heads = 6;
  s.num_kv_heads = 3;
  s.head_dim = 128;
  s.vocab_size = 333;  // shards of 192 and 141 rows
  s.tie_word_embeddings = false;
  cases.push_back({"qwen3 6q/3kv hd128", s});

  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string dir = MakeTempDir("cuda_tp_");
    ASSERT_TRUE(WriteRandomCheckpoint(dir, c.spec).ok());
    std::unique_ptr<Backend> cpu = Load(dir, 0);
    std::unique_ptr<Backend> custom = Load(dir, 2);
    std::unique_ptr<Backend> nccl = Load(dir, 2, /*custom_bytes=*/0);
    ASSERT_TRUE(cpu && custom && nccl);
    const int vocab = c.spec.vocab_size;
    std::mt19937_64 rng(7);
    const std::vector<int32_t> prompt = RandomTokens(41, vocab, rng);
    TokenTree tree;
    tree.tokens = RandomTokens(7, vocab, rng);
    tree.parents = {-1, 0, 1, -1, 3, 3, 2};
    std::vector<Backend*> all = {cpu.get(), custom.get(), nccl.get()};
    std::vector<std::vector<float>> logits(all.size());
    auto step = [&](const std::vector<ForwardItem>& items, const char* what) {
      for (size_t i = 0; i < all.size(); ++i) {
        absl::Status st = all[i]->Forward(items, &logits[i]);
        ASSERT_TRUE(st.ok()) << what << ": " << st;
      }
      const ::testing::AssertionResult custom_close = RowsClose(logits[1], logits[0], vocab, 2e-2);
      const ::testing::AssertionResult nccl_close = RowsClose(logits[2], logits[0], vocab, 2e-2);
      EXPECT_TRUE(custom_close) << what << " (custom all-reduce)";
      EXPECT_TRUE(nccl_close) << what << " (NCCL)";
      std::printf("%s, %s vs CPU: %s (custom), %s (NCCL)\n", c.name.c_str(), what,
                  custom_close.message(), nccl_close.message());
    };
    for (Backend* b : all) ASSERT_TRUE(b->AddSequence(1).ok());
    step({testutil::Chain(1, prompt, {0, 1, 2, 20, 40})}, "prefill");
    std::vector<int32_t> path(prompt.size());
    for (size_t i = 0; i < path.size(); ++i) path[i] = static_cast<int32_t>(i);
    for (Backend* b : all) ASSERT_TRUE(b->Commit(1, path).ok());
    ForwardItem tree_item;
    tree_item.seq = 1;
    tree_item.tokens = tree.tokens;
    tree_item.parents = tree.parents;
    tree_item.logit_rows = {0, 1, 2, 3, 4, 5, 6};
    step({tree_item}, "tree");
    for (Backend* b : all) ASSERT_TRUE(b->Commit(1, {3, 5}).ok());
    step({testutil::Chain(1, {tree.tokens[0]}, {0})}, "decode after commit");
  }
}

class CudaTpReferenceTest : public CudaTpTest {
 protected:
  void SetUp() override {
    CudaTpTest::SetUp();
    if (IsSkipped()) return;
    root_ = testutil::RepoRoot();
    ASSERT_FALSE(root_.empty());
    fixture_ = testutil::ReadJson(root_ / "tests" / "fixtures" / "reference_greedy.json");
    for (const json& c : fixture_["models"]["pycoder-target"]["cases"]) {
      prompts_.push_back(c["prompt_ids"].get<std::vector<int32_t>>());
    }
    ASSERT_GE(prompts_.size(), 6u);
  }
  fs::path root_;
  json fixture_;
  std::vector<std::vector<int32_t>> prompts_;
};

// The largest logit minus the runner-up of `b`'s next token after `tokens`.
double TopGap(Backend& b, SeqId seq, const std::vector<int32_t>& tokens) {
  std::vector<float> logits;
  EXPECT_TRUE(b.AddSequence(seq).ok());
  EXPECT_TRUE(
      b.Forward({testutil::Chain(seq, tokens, {static_cast<int32_t>(tokens.size()) - 1})}, &logits)
          .ok());
  EXPECT_TRUE(b.RemoveSequence(seq).ok());
  std::vector<float> top(logits);
  std::partial_sort(top.begin(), top.begin() + 2, top.end(), std::greater<float>());
  return static_cast<double>(top[0]) - top[1];
}

TEST_F(CudaTpReferenceTest, GreedyEqualsSingleGpu) {
  const std::string dir = (root_ / "models" / "pycoder-target").string();
  std::unique_ptr<Backend> one = Load(dir, 1);
  std::unique_ptr<Backend> two = Load(dir, 2);
  ASSERT_TRUE(one && two);
  constexpr int kSteps = 96;
  // A divergence is accepted only at a step whose TP=1 top-2 gap is below this: bf16 logits of
  // ~10-15 carry ~0.05 of rounding, and TP=2 sums its GEMMs in another order.
  constexpr double kNearTie = 0.1;
  int identical = 0;
  SeqId seq = 1;
  for (size_t i = 0; i < prompts_.size(); ++i) {
    const std::vector<int32_t> a = testutil::Greedy(*one, seq++, prompts_[i], kSteps);
    const std::vector<int32_t> b = testutil::Greedy(*two, seq++, prompts_[i], kSteps);
    ASSERT_EQ(a.size(), b.size());
    size_t k = 0;
    while (k < a.size() && a[k] == b[k]) ++k;
    if (k == a.size()) {
      ++identical;
      continue;
    }
    std::vector<int32_t> prefix = prompts_[i];
    prefix.insert(prefix.end(), a.begin(), a.begin() + k);
    const double gap = TopGap(*one, seq++, prefix);
    std::printf("prompt %zu: TP=2 diverges from TP=1 at step %zu, TP=1 top-2 gap %.4f\n", i, k,
                gap);
    EXPECT_LT(gap, kNearTie) << "prompt " << i << " diverges at step " << k
                             << " where the choice is not a near-tie";
  }
  std::printf("pycoder-target greedy, %d steps: TP=2 identical to TP=1 on %d of %zu prompts\n",
              kSteps, identical, prompts_.size());
}

TEST_F(CudaTpReferenceTest, SpeculativeEqualsTargetOnly) {
  std::unique_ptr<Backend> target = Load((root_ / "models" / "pycoder-target").string(), 2);
  std::unique_ptr<Backend> draft = Load((root_ / "models" / "pycoder-draft").string(), 1);
  ASSERT_TRUE(target && draft);
  DraftModelDrafter drafter(draft.get());
  absl::StatusOr<std::unique_ptr<Generator>> spec = Generator::Create(target.get(), &drafter);
  absl::StatusOr<std::unique_ptr<Generator>> plain = Generator::Create(target.get(), nullptr);
  ASSERT_TRUE(spec.ok() && plain.ok());
  struct Mode {
    const char* name;
    SamplingParams sampling;
  };
  std::vector<Mode> modes(3);
  modes[0].name = "greedy";
  modes[1].name = "temperature 0.8 (per-rank candidates)";
  modes[1].sampling.temperature = 0.8f;
  modes[1].sampling.seed = 11;
  modes[2].name = "top-k 20, top-p 0.9 (gathered logits)";
  modes[2].sampling.temperature = 1.0f;
  modes[2].sampling.top_k = 20;
  modes[2].sampling.top_p = 0.9f;
  modes[2].sampling.seed = 12;
  int64_t drafted = 0, accepted = 0;
  for (const Mode& m : modes) {
    std::vector<GenerationRequest> requests;
    for (const std::vector<int32_t>& p : prompts_) {
      GenerationRequest r;
      r.prompt = p;
      r.max_new_tokens = 48;
      r.ignore_eos = true;
      r.sampling = m.sampling;
      r.draft = {5, 3, 16};
      requests.push_back(r);
    }
    absl::StatusOr<std::vector<GenerationResult>> want = (*plain)->Generate(requests);
    absl::StatusOr<std::vector<GenerationResult>> got = (*spec)->Generate(requests);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    for (size_t i = 0; i < requests.size(); ++i) {
      EXPECT_EQ((*got)[i].tokens, (*want)[i].tokens) << m.name << ", request " << i;
      drafted += (*got)[i].stats.draft_tokens;
      accepted += (*got)[i].stats.accepted_tokens;
    }
    // One request alone (other buckets) gives the same tokens as in the batch.
    absl::StatusOr<std::vector<GenerationResult>> alone =
        (*spec)->Generate(absl::MakeConstSpan(&requests[0], 1));
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_EQ((*alone)[0].tokens, (*want)[0].tokens) << m.name << ", request 0 alone";
  }
  EXPECT_GT(accepted, 0);
  std::printf("TP=2 speculative vs target-only: %lld drafted, %lld accepted\n",
              static_cast<long long>(drafted), static_cast<long long>(accepted));
}

}  // namespace
}  // namespace specd
