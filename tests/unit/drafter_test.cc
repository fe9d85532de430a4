// Drafters on real checkpoint folders: tree validity and shape limits, children equal to the
// draft model's own top-k (checked against Backend::Forward directly), cumulative log-probs,
// the max_nodes cut, KV continuity across steps, batching, errors, and n-gram lookup against
// hand-computed continuations.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "engine/draft/draft_model_drafter.h"
#include "engine/draft/ngram_drafter.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/counting_backend.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class DraftModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(MakeTempDir("specd_drafter_"));
    RandomCheckpointSpec spec;
    spec.vocab_size = 300;
    spec.hidden_size = 32;
    spec.intermediate_size = 64;
    spec.num_layers = 1;
    spec.num_heads = 4;
    spec.num_kv_heads = 2;
    spec.init_std = 0.3f;
    spec.seed = 11;
    ASSERT_TRUE(WriteRandomCheckpoint(*dir_, spec).ok());
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*dir_, ec);
    delete dir_;
  }

  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> d = CreateBackend(*dir_, BackendOptions());
    ASSERT_TRUE(d.ok()) << d.status();
    draft_ = *std::move(d);
    absl::StatusOr<std::unique_ptr<Backend>> r = CreateBackend(*dir_, BackendOptions());
    ASSERT_TRUE(r.ok()) << r.status();
    reference_ = *std::move(r);
    drafter_ = std::make_unique<DraftModelDrafter>(draft_.get());
  }

  // Next-token logits of the draft model after `tokens`, computed on an independent backend.
  std::vector<float> RefLogits(const std::vector<int32_t>& tokens) {
    const SeqId id = 1000000 + next_ref_++;
    EXPECT_TRUE(reference_->AddSequence(id).ok());
    ForwardItem item;
    item.seq = id;
    item.tokens = tokens;
    item.parents.resize(tokens.size());
    std::iota(item.parents.begin(), item.parents.end(), -1);
    item.logit_rows = {static_cast<int32_t>(tokens.size()) - 1};
    std::vector<float> logits;
    EXPECT_TRUE(reference_->Forward({item}, &logits).ok());
    EXPECT_TRUE(reference_->RemoveSequence(id).ok());
    return logits;
  }

  static std::vector<int32_t> PathTokens(const TokenTree& t, int node) {
    std::vector<int32_t> path;
    for (int n = node; n >= 0; n = t.parents[n]) path.push_back(t.tokens[n]);
    std::reverse(path.begin(), path.end());
    return path;
  }

  TokenTree DraftOne(SeqId seq, const std::vector<int32_t>& new_tokens, const DraftParams& p) {
    absl::StatusOr<std::vector<TokenTree>> trees = drafter_->Draft({{seq, new_tokens, p}});
    EXPECT_TRUE(trees.ok()) << trees.status();
    return trees.ok() ? (*trees)[0] : TokenTree();
  }

  static std::string* dir_;
  std::unique_ptr<Backend> draft_, reference_;
  std::unique_ptr<DraftModelDrafter> drafter_;
  int next_ref_ = 0;
};

std::string* DraftModelTest::dir_ = nullptr;

TEST(DraftParamsTest, ValidationNamesTheField) {
  DraftParams p;
  EXPECT_TRUE(ValidateDraftParams(p).ok());
  p.depth = 0;
  EXPECT_THAT(ValidateDraftParams(p).message(), HasSubstr("depth"));
  p = {};
  p.top_k = 0;
  EXPECT_THAT(ValidateDraftParams(p).message(), HasSubstr("top_k"));
  p = {};
  p.max_nodes = kMaxTreeNodes + 1;
  EXPECT_EQ(ValidateDraftParams(p).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ValidateDraftParams(p).message(), HasSubstr("max_nodes"));
  p.max_nodes = 0;
  EXPECT_THAT(ValidateDraftParams(p).message(), HasSubstr("max_nodes"));
  p.max_nodes = kMaxTreeNodes;
  EXPECT_TRUE(ValidateDraftParams(p).ok());
}

// Every node's children are a best-first prefix of the draft model's top-k after the node's
// path, with cumulative log-probabilities; the shape respects depth, top_k and max_nodes.
TEST_F(DraftModelTest, ChildrenAreTheDraftModelsTopK) {
  const std::vector<int32_t> prompt = {72, 101, 108, 108, 111, 44, 32};
  struct Shape {
    int depth, top_k, max_nodes;
  };
  SeqId seq = 1;
  for (const Shape& s :
       std::vector<Shape>{{3, 3, 256}, {4, 2, 10}, {1, 5, 256}, {5, 4, 31}, {2, 8, 64}}) {
    SCOPED_TRACE(testing::Message()
                 << "depth " << s.depth << " top_k " << s.top_k << " max_nodes " << s.max_nodes);
    ASSERT_TRUE(drafter_->AddSequence(seq).ok());
    const DraftParams p{s.depth, s.top_k, s.max_nodes};
    const TokenTree tree = DraftOne(seq, prompt, p);
    ASSERT_TRUE(ValidateTree(tree, 300, s.max_nodes).ok()) << ValidateTree(tree, 300).message();
    ASSERT_EQ(tree.draft_logprobs.size(), tree.tokens.size());
    EXPECT_GT(tree.size(), 0);
    const std::vector<int> depths = TreeDepths(tree);
    for (int d : depths) EXPECT_LT(d, s.depth);
    const std::vector<std::vector<int32_t>> children = TreeChildren(tree);
    for (int node = -1; node < tree.size(); ++node) {
      const std::vector<int32_t>& kids = children[node < 0 ? tree.size() : node];
      EXPECT_LE(static_cast<int>(kids.size()), s.top_k);
      if (kids.empty()) continue;
      std::vector<int32_t> context = prompt;
      if (node >= 0) {
        const std::vector<int32_t> path = PathTokens(tree, node);
        context.insert(context.end(), path.begin(), path.end());
      }
      const std::vector<float> logits = RefLogits(context);
      std::vector<int32_t> order(logits.size());
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
      double z = 0;
      const float max_l = logits[order[0]];
      for (float l : logits) z += std::exp(static_cast<double>(l) - max_l);
      const double base = node < 0 ? 0.0 : tree.draft_logprobs[node];
      for (size_t j = 0; j < kids.size(); ++j) {
        EXPECT_EQ(tree.tokens[kids[j]], order[j]) << "child " << j << " of node " << node;
        const double expect = base + logits[order[j]] - max_l - std::log(z);
        EXPECT_NEAR(tree.draft_logprobs[kids[j]], expect, 1e-3);
        EXPECT_LE(tree.draft_logprobs[kids[j]], base + 1e-6);
      }
    }
    ASSERT_TRUE(drafter_->Release(seq).ok());
    ++seq;
  }
}

// With room for every node, level 0 holds top_k nodes and each later level top_k * top_k:
// the top_k best nodes of each level (by cumulative log-prob) are the ones expanded.
TEST_F(DraftModelTest, ExpandsTheBestNodesOfEachLevel) {
  const std::vector<int32_t> prompt = {5, 6, 7, 8, 9};
  ASSERT_TRUE(drafter_->AddSequence(1).ok());
  const int k = 3, depth = 4;
  const TokenTree tree = DraftOne(1, prompt, {depth, k, 256});
  const std::vector<int> depths = TreeDepths(tree);
  std::map<int, std::vector<int>> by_level;
  for (int i = 0; i < tree.size(); ++i) by_level[depths[i]].push_back(i);
  ASSERT_EQ(by_level.size(), static_cast<size_t>(depth));
  EXPECT_EQ(by_level[0].size(), static_cast<size_t>(k));
  const std::vector<std::vector<int32_t>> children = TreeChildren(tree);
  for (int level = 1; level < depth; ++level) {
    EXPECT_EQ(by_level[level].size(), static_cast<size_t>(k * k));
    std::vector<int> prev = by_level[level - 1];
    std::sort(prev.begin(), prev.end(),
              [&](int a, int b) { return tree.draft_logprobs[a] > tree.draft_logprobs[b]; });
    for (size_t r = 0; r < prev.size(); ++r) {
      EXPECT_EQ(children[prev[r]].size(), r < static_cast<size_t>(k) ? size_t{k} : size_t{0})
          << "level " << level - 1 << " rank " << r;
    }
  }
}

// A smaller max_nodes keeps exactly the best nodes of the unbounded tree.
TEST_F(DraftModelTest, MaxNodesKeepsTheBestNodes) {
  const std::vector<int32_t> prompt = {40, 41, 42, 40, 41};
  ASSERT_TRUE(drafter_->AddSequence(1).ok());
  const TokenTree full = DraftOne(1, prompt, {4, 4, 256});
  std::vector<std::pair<float, std::vector<int32_t>>> ranked;
  for (int i = 0; i < full.size(); ++i) {
    ranked.push_back({full.draft_logprobs[i], PathTokens(full, i)});
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second.size() < b.second.size());
  });
  for (int m : {1, 2, 5, 9, 20}) {
    SCOPED_TRACE(m);
    const SeqId seq = 100 + m;
    ASSERT_TRUE(drafter_->AddSequence(seq).ok());
    const TokenTree cut = DraftOne(seq, prompt, {4, 4, m});
    ASSERT_EQ(cut.size(), m);
    ASSERT_TRUE(ValidateTree(cut, 300, m).ok());
    std::set<std::vector<int32_t>> got, want;
    for (int i = 0; i < cut.size(); ++i) got.insert(PathTokens(cut, i));
    for (int i = 0; i < m; ++i) want.insert(ranked[i].second);
    EXPECT_EQ(got, want);
  }
}

TEST_F(DraftModelTest, SingleNodeAndChains) {
  const std::vector<int32_t> prompt = {1, 2, 3, 4};
  ASSERT_TRUE(drafter_->AddSequence(1).ok());
  const TokenTree one = DraftOne(1, prompt, {1, 4, 1});
  ASSERT_EQ(one.size(), 1);
  const std::vector<float> l = RefLogits(prompt);
  EXPECT_EQ(one.tokens[0], std::max_element(l.begin(), l.end()) - l.begin());
  EXPECT_EQ(one.parents[0], -1);

  // Greedy continuation of the draft model, token by token on the reference backend.
  std::vector<int32_t> context = prompt;
  std::vector<int32_t> greedy;
  for (int i = 0; i < 6; ++i) {
    const std::vector<float> logits = RefLogits(context);
    greedy.push_back(std::max_element(logits.begin(), logits.end()) - logits.begin());
    context.push_back(greedy.back());
  }
  for (int d = 1; d <= 6; ++d) {
    const SeqId seq = 10 + d;
    ASSERT_TRUE(drafter_->AddSequence(seq).ok());
    const TokenTree chain = DraftOne(seq, prompt, {d, 1, 256});
    EXPECT_EQ(chain.tokens, std::vector<int32_t>(greedy.begin(), greedy.begin() + d));
    EXPECT_EQ(chain.parents, ChainTree(chain.tokens).parents);
  }
}

// Feeding a sequence step by step gives the same trees as feeding everything at once: the
// fed chain stays in the draft KV cache and, without a reported outcome, the speculative nodes
// do not.
TEST_F(DraftModelTest, StepsKeepTheFedChainOnly) {
  const std::vector<int32_t> prompt = {10, 20, 30, 40, 50, 60};
  const DraftParams p{3, 3, 12};
  ASSERT_TRUE(drafter_->AddSequence(1).ok());
  std::vector<int32_t> all = prompt;
  DraftOne(1, prompt, p);
  for (const std::vector<int32_t>& more :
       std::vector<std::vector<int32_t>>{{7}, {8, 9, 10}, {11, 12}}) {
    const TokenTree stepped = DraftOne(1, more, p);
    all.insert(all.end(), more.begin(), more.end());
    // The step's chain stays in the scratch region (with the tree's nodes) until the next step
    // reports what was accepted; everything fed before is committed.
    EXPECT_EQ(*draft_->CommittedLength(1), static_cast<int64_t>(all.size() - more.size()));
    const SeqId fresh = 50 + static_cast<SeqId>(all.size());
    ASSERT_TRUE(drafter_->AddSequence(fresh).ok());
    const TokenTree whole = DraftOne(fresh, all, p);
    EXPECT_EQ(stepped.tokens, whole.tokens);
    EXPECT_EQ(stepped.parents, whole.parents);
    ASSERT_TRUE(drafter_->Release(fresh).ok());
  }
}

// Ingest() feeds a sequence without drafting it (the router's ingest-only steps): after any mix
// of drafted and ingested steps, including an ingest that reports the accepted node of the tree
// drafted before it, the next tree equals that of a fresh sequence fed everything at once, and
// the draft KV holds exactly the tokens fed.
TEST_F(DraftModelTest, IngestThenDraftEqualsDraftingEverything) {
  const DraftParams p{3, 3, 12};
  ASSERT_TRUE(drafter_->AddSequence(1).ok());
  std::vector<int32_t> all = {10, 20, 30, 40, 50, 60};
  const TokenTree first = DraftOne(1, all, p);
  ASSERT_FALSE(first.empty());
  // The verifier accepted the first tree's node 0 and emitted a bonus token; the policy then
  // drafts nothing for two steps, whose tokens are ingested, the first with the outcome.
  const std::vector<int32_t> accepted = {first.tokens[0], 77};
  ASSERT_TRUE(drafter_->Ingest({{1, accepted, p, /*accepted_node=*/0}}).ok());
  all.insert(all.end(), accepted.begin(), accepted.end());
  EXPECT_EQ(*draft_->CommittedLength(1), static_cast<int64_t>(all.size()));
  const std::vector<int32_t> more = {5, 6, 7};
  ASSERT_TRUE(drafter_->Ingest({{1, more, p}}).ok());
  all.insert(all.end(), more.begin(), more.end());
  EXPECT_EQ(*draft_->CommittedLength(1), static_cast<int64_t>(all.size()));
  const TokenTree resumed = DraftOne(1, {8}, p);
  all.push_back(8);
  ASSERT_TRUE(drafter_->AddSequence(2).ok());
  const TokenTree whole = DraftOne(2, all, p);
  EXPECT_EQ(resumed.tokens, whole.tokens);
  EXPECT_EQ(resumed.parents, whole.parents);
  // Requests are checked as Draft() checks them, before anything changes.
  EXPECT_EQ(drafter_->Ingest({{99, {1}, p}}).code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(drafter_->Ingest({{1, {}, p}}).message(), HasSubstr("new_tokens"));
}

TEST_F(DraftModelTest, BatchEqualsOneByOne) {
  std::mt19937 rng(5);
  std::vector<DraftRequest> batch;
  std::vector<TokenTree> alone;
  for (int i = 0; i < 5; ++i) {
    DraftRequest r;
    r.seq = 200 + i;
    const int len = 1 + i * 3;
    for (int j = 0; j < len; ++j) r.new_tokens.push_back(rng() % 256);
    r.params = {1 + i, 1 + (i % 3), 4 + 10 * i};
    batch.push_back(r);
    ASSERT_TRUE(drafter_->AddSequence(300 + i).ok());
    alone.push_back(DraftOne(300 + i, r.new_tokens, r.params));
    ASSERT_TRUE(drafter_->AddSequence(r.seq).ok());
  }
  absl::StatusOr<std::vector<TokenTree>> trees = drafter_->Draft(batch);
  ASSERT_TRUE(trees.ok()) << trees.status();
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ((*trees)[i].tokens, alone[i].tokens) << i;
    EXPECT_EQ((*trees)[i].parents, alone[i].parents) << i;
  }
}

// What a scripted mix of batched Draft(), PreDraft() and Ingest() calls returned, and what it
// cost the draft model.
struct ScriptRun {
  std::vector<TokenTree> trees;  // every tree returned, pre-drafted ones included, in order
  std::vector<std::vector<int32_t>> guesses;
  int64_t fed = 0;
  int64_t max_rows = 0;  // the most tokens one forward carried
};

// Three sequences whose catch-ups (40, 7 and 25 tokens) share the first forward, then steps
// with reported outcomes, a pre-draft with two guesses, a hit and a miss, an ingest-only step
// and a step after it.
ScriptRun RunChunkScript(const std::string& dir, DraftModelDrafterOptions options) {
  ScriptRun run;
  absl::StatusOr<std::unique_ptr<Backend>> model = CreateBackend(dir, BackendOptions());
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return run;
  CountingBackend counter(model->get());
  DraftModelDrafter drafter(&counter, options);
  std::mt19937 rng(29);
  const DraftParams p{3, 3, 12};
  std::vector<DraftRequest> batch;
  for (int len : {40, 7, 25}) {
    DraftRequest& r = batch.emplace_back();
    r.seq = static_cast<SeqId>(batch.size());
    for (int j = 0; j < len; ++j) r.new_tokens.push_back(static_cast<int32_t>(rng() % 300));
    r.params = p;
    EXPECT_TRUE(drafter.AddSequence(r.seq).ok());
  }
  auto draft = [&](const std::vector<DraftRequest>& requests) {
    absl::StatusOr<std::vector<TokenTree>> trees = drafter.Draft(requests);
    EXPECT_TRUE(trees.ok()) << trees.status();
    if (trees.ok()) run.trees.insert(run.trees.end(), trees->begin(), trees->end());
    return trees.ok() ? *trees : std::vector<TokenTree>(requests.size());
  };
  // The outcome "first node accepted, then a bonus token", or only a bonus for an empty tree.
  auto outcome = [&](SeqId seq, const TokenTree& tree) {
    DraftRequest r;
    r.seq = seq;
    r.params = p;
    r.accepted_node = tree.empty() ? -1 : 0;
    if (!tree.empty()) r.new_tokens.push_back(tree.tokens[0]);
    r.new_tokens.push_back(static_cast<int32_t>(rng() % 300));
    return r;
  };
  std::vector<TokenTree> trees = draft(batch);
  for (int step = 0; step < 2; ++step) {
    std::vector<DraftRequest> next;
    for (size_t b = 0; b < batch.size(); ++b) next.push_back(outcome(batch[b].seq, trees[b]));
    trees = draft(next);
  }
  // Pre-draft every sequence's outcome; sequence 1 hits its first guess, 2 misses, 3 is
  // ingested without a tree.
  std::vector<DraftRequest> pre;
  for (const DraftRequest& r : batch) {
    DraftRequest q;
    q.seq = r.seq;
    q.params = p;
    q.fan_out = 2;
    pre.push_back(q);
  }
  absl::StatusOr<std::vector<DraftModelDrafter::PreDraftResult>> guessed = drafter.PreDraft(pre);
  EXPECT_TRUE(guessed.ok()) << guessed.status();
  if (!guessed.ok()) return run;
  for (const DraftModelDrafter::PreDraftResult& g : *guessed) {
    run.trees.push_back(g.tree);
    run.guesses.push_back(g.guess_tokens);
    for (const DraftModelDrafter::PreDraftGuess& more : g.more) {
      run.trees.push_back(more.tree);
      run.guesses.push_back(more.tokens);
    }
  }
  std::vector<DraftRequest> next;
  DraftRequest hit = outcome(1, trees[0]);
  if (!(*guessed)[0].guess_tokens.empty()) {
    hit.new_tokens = (*guessed)[0].guess_tokens;
    hit.new_tokens.push_back(5);
    hit.accepted_node = -1;  // of the pre-drafted tree: only the bonus token after the guess
  }
  next.push_back(hit);
  next.push_back(outcome(2, trees[1]));
  EXPECT_TRUE(drafter.Ingest({outcome(3, trees[2])}).ok());
  trees = draft(next);
  DraftRequest resumed;
  resumed.seq = 3;
  resumed.params = p;
  for (int j = 0; j < 9; ++j) resumed.new_tokens.push_back(static_cast<int32_t>(rng() % 300));
  next = {outcome(1, trees[0]), outcome(2, trees[1]), resumed};
  draft(next);
  run.fed = counter.tokens();
  run.max_rows = counter.max_rows();
  return run;
}

// A catch-up or level longer than max_forward_rows is fed as several forwards of at most that
// many tokens, and every tree, guess and fed count is the one a single forward gives.
TEST_F(DraftModelTest, ChunkedForwardsGiveTheSameTrees) {
  DraftModelDrafterOptions unlimited;
  unlimited.max_forward_rows = 0;
  const ScriptRun want = RunChunkScript(*dir_, unlimited);
  ASSERT_GE(want.trees.size(), 14u);
  EXPECT_GE(want.max_rows, 72) << "the first forward should carry every catch-up";
  for (bool backend_topk : {true, false}) {
    for (int64_t max_rows : {kDefaultGemmInvariantRows, int64_t{16}, int64_t{3}, int64_t{1}}) {
      SCOPED_TRACE(testing::Message()
                   << "max_forward_rows " << max_rows << " backend_topk " << backend_topk);
      DraftModelDrafterOptions options;
      options.backend_topk = backend_topk;
      options.max_forward_rows = max_rows;
      const ScriptRun got = RunChunkScript(*dir_, options);
      ASSERT_EQ(got.trees.size(), want.trees.size());
      for (size_t i = 0; i < want.trees.size(); ++i) {
        EXPECT_EQ(got.trees[i].tokens, want.trees[i].tokens) << "tree " << i;
        EXPECT_EQ(got.trees[i].parents, want.trees[i].parents) << "tree " << i;
        EXPECT_EQ(got.trees[i].draft_logprobs, want.trees[i].draft_logprobs) << "tree " << i;
      }
      EXPECT_EQ(got.guesses, want.guesses);
      EXPECT_EQ(got.fed, want.fed);
      EXPECT_LE(got.max_rows, max_rows);
    }
  }
}

TEST_F(DraftModelTest, BadRequestsFailWithoutChangingState) {
  ASSERT_TRUE(drafter_->AddSequence(1).ok());
  EXPECT_EQ(drafter_->AddSequence(1).code(), absl::StatusCode::kAlreadyExists);
  const DraftParams p{2, 2, 4};
  EXPECT_EQ(drafter_->Draft({{99, {1}, p}}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(drafter_->Draft({{1, {}, p}}).status().message(), HasSubstr("new_tokens"));
  EXPECT_THAT(drafter_->Draft({{1, {1, 300}, p}}).status().message(), HasSubstr("new_tokens[1]"));
  EXPECT_THAT(drafter_->Draft({{1, {1}, {2, 0, 4}}}).status().message(), HasSubstr("top_k"));
  EXPECT_THAT(drafter_->Draft({{1, {1}, p}, {1, {2}, p}}).status().message(), HasSubstr("twice"));
  // A good request next to a bad one fails the batch and leaves the good one untouched.
  ASSERT_TRUE(drafter_->AddSequence(2).ok());
  EXPECT_FALSE(drafter_->Draft({{2, {5, 6}, p}, {1, {}, p}}).ok());
  EXPECT_EQ(*draft_->CommittedLength(2), 0);
  EXPECT_TRUE(drafter_->CheckRequest({2, {5, 6}, p}).ok());
  EXPECT_TRUE(drafter_->Draft({{2, {5, 6}, p}}).ok());
  // The chain waits in the scratch region for the step's outcome; the next step commits it.
  EXPECT_EQ(*draft_->CommittedLength(2), 0);
  EXPECT_TRUE(drafter_->Draft({{2, {7}, p, -1}}).ok());
  EXPECT_EQ(*draft_->CommittedLength(2), 2);
  EXPECT_TRUE(drafter_->Release(2).ok());
  EXPECT_FALSE(drafter_->HasSequence(2));
  EXPECT_EQ(drafter_->Release(2).code(), absl::StatusCode::kNotFound);
}

std::unique_ptr<NgramDrafter> MakeNgram(int min_n = 1, int max_n = 3) {
  absl::StatusOr<std::unique_ptr<NgramDrafter>> d = NgramDrafter::Create(300, {min_n, max_n, 64});
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

TEST(NgramDrafterTest, OptionsValidation) {
  EXPECT_THAT(NgramDrafter::Create(300, {0, 3, 64}).status().message(), HasSubstr("min_n"));
  EXPECT_THAT(NgramDrafter::Create(300, {3, 2, 64}).status().message(), HasSubstr("max_n"));
  EXPECT_THAT(NgramDrafter::Create(300, {1, 3, 0}).status().message(), HasSubstr("max_matches"));
}

// History 1 2 3 4 1 2 3 5 1 2 3: the suffix 1 2 3 occurred twice before; the most recent was
// followed by 5 1 2 3, the older by 4 1 2 3.
TEST(NgramDrafterTest, BranchesPerDistinctContinuation) {
  auto d = MakeNgram();
  const std::vector<int32_t> h = {1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3};
  TokenTree t = d->Propose(h, {4, 4, 16});
  EXPECT_THAT(t.tokens, ElementsAre(5, 1, 2, 3, 4, 1, 2, 3));
  EXPECT_THAT(t.parents, ElementsAre(-1, 0, 1, 2, -1, 4, 5, 6));
  for (float lp : t.draft_logprobs) EXPECT_NEAR(lp, std::log(0.5), 1e-6);
  EXPECT_TRUE(ValidateTree(t, 300).ok());

  t = d->Propose(h, {4, 1, 16});  // one child a node: only the most recent continuation
  EXPECT_THAT(t.tokens, ElementsAre(5, 1, 2, 3));
  t = d->Propose(h, {2, 4, 16});  // depth 2
  EXPECT_THAT(t.tokens, ElementsAre(5, 1, 4, 1));
  EXPECT_THAT(t.parents, ElementsAre(-1, 0, -1, 2));
  t = d->Propose(h, {4, 4, 5});  // node budget
  EXPECT_THAT(t.tokens, ElementsAre(5, 1, 2, 3, 4));
}

TEST(NgramDrafterTest, SharedPrefixesMergeAndCount) {
  auto d = MakeNgram(1, 2);
  // Suffix "9 7" occurred three times, followed by 1 2 / 1 3 / 1 2 (most recent first: 1 2).
  const std::vector<int32_t> h = {9, 7, 1, 2, 0, 9, 7, 1, 3, 0, 9, 7, 1, 2, 0, 9, 7};
  const TokenTree t = d->Propose(h, {3, 4, 16});
  EXPECT_THAT(t.tokens, ElementsAre(1, 2, 0, 3, 0));
  EXPECT_THAT(t.parents, ElementsAre(-1, 0, 1, 0, 3));
  EXPECT_NEAR(t.draft_logprobs[0], 0.0, 1e-6);
  EXPECT_NEAR(t.draft_logprobs[1], std::log(2.0 / 3), 1e-6);
  EXPECT_NEAR(t.draft_logprobs[3], std::log(1.0 / 3), 1e-6);
}

TEST(NgramDrafterTest, FallsBackToShorterNgramsAndEmpty) {
  auto d = MakeNgram(1, 3);
  // No earlier "9 8" or "8 9 8"; the unigram "8" occurred at 1, followed by 9 8.
  TokenTree t = d->Propose(std::vector<int32_t>{7, 8, 9, 8}, {3, 4, 16});
  EXPECT_THAT(t.tokens, ElementsAre(9, 8));
  t = d->Propose(std::vector<int32_t>{1, 2, 3, 4}, {3, 4, 16});
  EXPECT_TRUE(t.empty());
  auto strict = MakeNgram(2, 3);
  EXPECT_TRUE(strict->Propose(std::vector<int32_t>{7, 8, 9, 8}, {3, 4, 16}).empty());
  EXPECT_TRUE(d->Propose(std::vector<int32_t>{5}, {3, 4, 16}).empty());
}

// max_history: only the last tokens are searched (the router bounds its lookups with it).
TEST(NgramDrafterTest, MaxHistoryBoundsTheSearch) {
  // "5" occurred at 1 (followed by 6) and at 4 (followed by 7); the suffix is "5".
  const std::vector<int32_t> h = {4, 5, 6, 0, 5, 7, 1, 2, 5};
  NgramOptions all{1, 1, 64};
  NgramOptions recent = all;
  recent.max_history = 5;  // 5 7 1 2 5: only the occurrence at 4
  auto d = *NgramDrafter::Create(300, all);
  EXPECT_THAT(d->Propose(h, {2, 4, 16}).tokens, ElementsAre(7, 1, 6, 0));
  auto bounded = *NgramDrafter::Create(300, recent);
  EXPECT_THAT(bounded->Propose(h, {2, 4, 16}).tokens, ElementsAre(7, 1));
  recent.max_history = 3;  // 1 2 5: no earlier 5
  EXPECT_TRUE((*NgramDrafter::Create(300, recent))->Propose(h, {2, 4, 16}).empty());
  recent.max_history = -1;
  EXPECT_THAT(NgramDrafter::Create(300, recent).status().message(), HasSubstr("max_history"));
}

TEST(NgramDrafterTest, DraftAppendsHistoryAcrossSteps) {
  auto d = MakeNgram();
  ASSERT_TRUE(d->AddSequence(1).ok());
  ASSERT_TRUE(d->AddSequence(2).ok());
  const DraftParams p{4, 2, 8};
  absl::StatusOr<std::vector<TokenTree>> trees = d->Draft({{1, {1, 2, 3, 4}, p}, {2, {6, 6}, p}});
  ASSERT_TRUE(trees.ok());
  EXPECT_TRUE((*trees)[0].empty());
  EXPECT_THAT((*trees)[1].tokens, ElementsAre(6));
  trees = d->Draft({{1, {1, 2}, p}});
  ASSERT_TRUE(trees.ok());
  EXPECT_THAT((*trees)[0].tokens, ElementsAre(3, 4, 1, 2));
  EXPECT_EQ(d->Draft({{3, {1}, p}}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(d->Draft({{1, {-1}, p}}).status().message(), HasSubstr("new_tokens[0]"));
  EXPECT_THAT(d->Draft({{1, {}, p}}).status().message(), HasSubstr("new_tokens"));
  EXPECT_THAT(d->Draft({{1, {1}, {0, 1, 1}}}).status().message(), HasSubstr("depth"));
  EXPECT_TRUE(d->Release(1).ok());
  EXPECT_EQ(d->Release(1).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace specd
