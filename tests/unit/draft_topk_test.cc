// Backend top-k (engine/topk.h, Backend::ForwardTopK) against a full sort of the row, and the
// draft-model drafter's two savings, backend top-k and kept KV, against its plain path: the same
// trees and outputs in speculative runs of the reference pair (models/) and of the transformers
// fixtures (tests/fixtures/models), verified by the real target; the draft KV bounded by the
// sequence's length.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/draft/draft_model_drafter.h"
#include "engine/topk.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/counting_backend.h"
#include "tests/testutil/hf_fixtures.h"

namespace specd {
namespace {

using ::testing::HasSubstr;

// The oracle: sort every id by (logit desc, id asc) with NaN as -inf, log-sum-exp in fp64 in id
// order (the drafter's host path before the backend top-k).
void SortTopK(absl::Span<const float> row, int k, std::vector<int32_t>* ids,
              std::vector<float>* lps) {
  auto key = [](float v) { return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v; };
  const int vocab = static_cast<int>(row.size());
  k = std::min(k, vocab);
  float max_l = -std::numeric_limits<float>::infinity();
  for (float v : row) max_l = std::max(max_l, key(v));
  double sum = 0;
  for (float v : row) sum += std::exp(static_cast<double>(key(v)) - max_l);
  const double log_z = max_l + std::log(sum);
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return key(row[a]) > key(row[b]); });
  ids->assign(order.begin(), order.begin() + k);
  lps->clear();
  for (int32_t i : *ids) lps->push_back(static_cast<float>(key(row[i]) - log_z));
}

// Rows of five kinds: Gaussian, coarsely quantised (many exact ties), mostly one value with a
// few NaN and -inf entries, spread over [-200, 30] (terms past fp32 exp's range), and all -inf.
std::vector<float> MakeRow(int vocab, int kind, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> row(vocab);
  for (float& x : row) {
    x = normal(rng);
    if (kind == 1) x = std::round(x);
    if (kind == 2) x = (rng() % 8 == 0) ? std::round(x) : -1.0f;
    if (kind == 3) x = -200.0f + 230.0f * static_cast<float>(rng() % 100000) / 100000.0f;
    if (kind == 4) x = -std::numeric_limits<float>::infinity();
  }
  if (kind == 2 && vocab > 4) {
    row[rng() % vocab] = std::numeric_limits<float>::quiet_NaN();
    row[rng() % vocab] = -std::numeric_limits<float>::infinity();
  }
  return row;
}

TEST(RowTopKTest, EqualsAFullSortWithTiesNanAndEveryK) {
  std::mt19937_64 rng(7);
  for (int vocab : {1, 2, 3, 15, 16, 17, 320, 8192, 128256, 200000}) {
    for (int kind = 0; kind < 5; ++kind) {
      const std::vector<float> row = MakeRow(vocab, kind, rng);
      for (int k = 1; k <= kMaxForwardTopK; ++k) {
        SCOPED_TRACE(testing::Message() << "vocab " << vocab << " kind " << kind << " k " << k);
        std::vector<int32_t> want_ids;
        std::vector<float> want_lps;
        SortTopK(row, k, &want_ids, &want_lps);
        std::vector<int32_t> ids(kMaxForwardTopK, -7);
        std::vector<float> lps(kMaxForwardTopK, 99.0f);
        RowTopKLogprobs(row, k, ids.data(), lps.data());
        const int n = std::min(k, vocab);
        ASSERT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + n), want_ids);
        for (int j = 0; j < n; ++j) {
          // The exp terms are fp32 (the oracle's fp64): log Z to fp32 rounding, the bound the
          // CUDA top-k is held to as well. Trees only compare logprobs of one function.
          if (std::memcmp(&lps[j], &want_lps[j], sizeof(float)) == 0) continue;  // -inf too
          if (std::isnan(lps[j]) && std::isnan(want_lps[j])) continue;           // an all -inf row
          ASSERT_LE(std::fabs(lps[j] - want_lps[j]), 2.0f * std::numeric_limits<float>::epsilon() *
                                                         std::max(1.0f, std::fabs(want_lps[j])))
              << j << ": " << lps[j] << " vs " << want_lps[j];
        }
        if (n < kMaxForwardTopK) EXPECT_EQ(ids[n], -7) << "wrote past min(k, vocab)";
      }
    }
  }
}

std::string ModelDir(const std::string& rel) { return (testutil::RepoRoot() / rel).string(); }

std::unique_ptr<Backend> Load(const std::string& dir) {
  BackendOptions options;
  options.num_threads = 2;
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir, options);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

// The CPU backend's own ForwardTopK (rows on the thread pool) equals the default one (Forward,
// then the host) and the oracle over its logits; k outside [1, 16] is INVALID_ARGUMENT naming k.
TEST(BackendTopKTest, CpuEqualsDefaultAndOracle) {
  std::unique_ptr<Backend> model = Load(ModelDir("models/pycoder-draft"));
  ASSERT_NE(model, nullptr);
  const int vocab = model->config().vocab_size;
  ASSERT_TRUE(model->AddSequence(1).ok());
  ASSERT_TRUE(model->AddSequence(2).ok());
  std::vector<ForwardItem> items(2);
  items[0].seq = 1;
  items[0].tokens = {10, 20, 30, 40};
  items[0].parents = {-1, 0, 1, 1};
  items[0].logit_rows = {3, 0, 2};
  items[1].seq = 2;
  items[1].tokens = {5};
  items[1].parents = {-1};
  items[1].logit_rows = {0};
  std::vector<float> logits;
  ASSERT_TRUE(model->Forward(items, &logits).ok());
  ASSERT_EQ(logits.size(), 4u * vocab);
  for (int k : {1, 4, 16}) {
    ASSERT_TRUE(model->Commit(1, {}).ok());
    ASSERT_TRUE(model->Commit(2, {}).ok());
    TopKRows native, fallback;
    ASSERT_TRUE(model->ForwardTopK(items, k, &native).ok());
    ASSERT_TRUE(model->Commit(1, {}).ok());
    ASSERT_TRUE(model->Commit(2, {}).ok());
    ASSERT_TRUE(model->Backend::ForwardTopK(items, k, &fallback).ok());
    ASSERT_EQ(native.k, k);
    ASSERT_EQ(native.rows(), 4);
    EXPECT_EQ(native.ids, fallback.ids);
    EXPECT_EQ(native.logprobs, fallback.logprobs);
    for (int r = 0; r < 4; ++r) {
      std::vector<int32_t> ids;
      std::vector<float> lps;
      SortTopK(absl::Span<const float>(logits).subspan(r * vocab, vocab), k, &ids, &lps);
      EXPECT_EQ(std::vector<int32_t>(native.ids.begin() + r * k, native.ids.begin() + (r + 1) * k),
                ids);
      EXPECT_EQ(std::vector<float>(native.logprobs.begin() + r * k,
                                   native.logprobs.begin() + (r + 1) * k),
                lps);
    }
  }
  TopKRows out;
  for (int k : {0, 17, -1}) {
    const absl::Status s = model->ForwardTopK(items, k, &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("k: "));
  }
}

// How the run tells the drafter the previous step's outcome.
enum class Outcome {
  kReported,  // accepted_node as the router sends it
  kUnknown,   // never: every step refeeds
  kWrong,     // another node: the drafter commits only what its tokens confirm
  kResync,    // every third step target-only; the next draft catches up without an outcome
};

struct SpecRun {
  std::vector<TokenTree> trees;
  std::vector<int32_t> output;
  int64_t fed = 0;       // tokens the drafter fed its model
  int accepted = 0;      // draft tokens the target accepted
  int64_t max_rows = 0;  // the most tokens one draft forward carried
};

// Greedy speculative decoding of `prompt` for `steps` steps: the drafter proposes, the target's
// Verify() accepts. Checks after every draft that the draft KV holds no more than the tokens
// sent so far plus the step's expanded nodes.
// The draft and target backends, shared by the runs (each run uses its own sequence and removes
// it at the end, so usage counts one sequence).
struct Models {
  std::unique_ptr<Backend> draft, target;
  SeqId next_seq = 1;
};

SpecRun Speculate(Models& models, const std::vector<int32_t>& prompt,
                  DraftModelDrafterOptions options, Outcome outcome, int steps,
                  const DraftParams& params) {
  SpecRun run;
  Backend* draft = models.draft.get();
  Backend* target = models.target.get();
  CountingBackend counter(draft);
  DraftModelDrafter drafter(&counter, options);
  const SeqId seq = models.next_seq++;
  EXPECT_TRUE(drafter.AddSequence(seq).ok());
  EXPECT_TRUE(target->AddSequence(seq).ok());
  std::vector<int32_t> tokens = prompt;
  size_t drafted = 0;  // tokens the drafter has been sent
  std::vector<int32_t> pending = prompt;
  int32_t accepted_node = DraftRequest::kNoOutcome;
  for (int step = 0; step < steps; ++step) {
    VerifyItem item;
    item.seq = seq;
    item.pending = pending;
    const bool target_only = outcome == Outcome::kResync && step % 3 == 2;
    if (!target_only) {
      DraftRequest r;
      r.seq = seq;
      r.new_tokens.assign(tokens.begin() + drafted, tokens.end());
      r.params = params;
      if (outcome != Outcome::kUnknown) r.accepted_node = accepted_node;
      absl::StatusOr<std::vector<TokenTree>> trees = drafter.Draft({r});
      EXPECT_TRUE(trees.ok()) << trees.status();
      if (!trees.ok()) return run;
      drafted = tokens.size();
      item.tree = (*trees)[0];
      run.trees.push_back(item.tree);
      const KvUsage usage = draft->Usage();
      EXPECT_LE(*draft->CommittedLength(seq), static_cast<int64_t>(tokens.size()));
      EXPECT_LE(usage.used_tokens,
                static_cast<int64_t>(tokens.size()) + (params.depth - 1) * params.top_k)
          << "step " << step;
    }
    absl::StatusOr<std::vector<VerifyOutcome>> v = target->Verify({item});
    EXPECT_TRUE(v.ok()) << v.status();
    if (!v.ok()) return run;
    const VerifyOutcome& o = (*v)[0];
    tokens.insert(tokens.end(), o.tokens.begin(), o.tokens.end());
    run.output.insert(run.output.end(), o.tokens.begin(), o.tokens.end());
    run.accepted += o.accepted_draft;
    pending = {o.tokens.back()};
    accepted_node = target_only                ? DraftRequest::kNoOutcome
                    : o.accepted_nodes.empty() ? -1
                                               : o.accepted_nodes.back();
    if (outcome == Outcome::kWrong && !item.tree.empty()) {
      // Another node: its path may share a prefix with the accepted one, or not.
      accepted_node = item.tree.size() > 1 ? (accepted_node + 1) % item.tree.size()
                      : accepted_node < 0  ? 0
                                           : DraftRequest::kNoOutcome;
    }
  }
  run.fed = counter.tokens();
  run.max_rows = counter.max_rows();
  EXPECT_TRUE(drafter.Release(seq).ok());
  EXPECT_TRUE(target->RemoveSequence(seq).ok());
  return run;
}

void ExpectSameTrees(const SpecRun& got, const SpecRun& want) {
  ASSERT_EQ(got.trees.size(), want.trees.size());
  for (size_t i = 0; i < got.trees.size(); ++i) {
    EXPECT_EQ(got.trees[i].tokens, want.trees[i].tokens) << "step " << i;
    EXPECT_EQ(got.trees[i].parents, want.trees[i].parents) << "step " << i;
    EXPECT_EQ(got.trees[i].draft_logprobs, want.trees[i].draft_logprobs) << "step " << i;
  }
  EXPECT_EQ(got.output, want.output);
}

struct Pair {
  std::string draft, target;
  std::vector<int32_t> prompt;
};

std::vector<Pair> Pairs() {
  std::vector<Pair> pairs;
  const nlohmann::json ref =
      testutil::ReadJson(testutil::RepoRoot() / "tests" / "fixtures" / "reference_greedy.json");
  const auto& cases = ref["models"]["pycoder-target"]["cases"];
  for (size_t c = 0; c < 1 && c < cases.size(); ++c) {
    pairs.push_back({"models/pycoder-draft", "models/pycoder-target",
                     cases[c]["prompt_ids"].get<std::vector<int32_t>>()});
  }
  pairs.push_back({"tests/fixtures/models/llama31",
                   "tests/fixtures/models/qwen3",
                   {17, 250, 3, 99, 42, 42, 7}});
  pairs.push_back(
      {"tests/fixtures/models/mistral", "tests/fixtures/models/mistral", {5, 6, 7, 8, 9, 10}});
  return pairs;
}

// The plain path (full logits to the host, refeeding accepted tokens) is the reference; backend
// top-k, kept KV and both give bit-identical trees and the same output, whatever the outcome
// reports do; the output is also target-only greedy decoding's (a draft model drafting for
// itself accepts everything, so the mistral pair exercises full acceptance).
TEST(DraftSavingsTest, SameTreesAndOutputsOnTheReferencePairAndFixtures) {
  const DraftParams params{4, 3, 12};
  constexpr int kSteps = 6;
  for (const Pair& pair : Pairs()) {
    SCOPED_TRACE(pair.draft + " drafting for " + pair.target);
    Models models{Load(ModelDir(pair.draft)), Load(ModelDir(pair.target))};
    ASSERT_TRUE(models.draft != nullptr && models.target != nullptr);
    const SpecRun plain =
        Speculate(models, pair.prompt, {false, false}, Outcome::kUnknown, kSteps, params);
    ASSERT_EQ(plain.trees.size(), static_cast<size_t>(kSteps));
    for (Outcome outcome :
         {Outcome::kReported, Outcome::kUnknown, Outcome::kWrong, Outcome::kResync}) {
      SCOPED_TRACE(static_cast<int>(outcome));
      const SpecRun plain_here =
          outcome == Outcome::kResync
              ? Speculate(models, pair.prompt, {false, false}, outcome, kSteps, params)
              : plain;
      std::vector<DraftModelDrafterOptions> configs = {{true, true}};
      if (outcome == Outcome::kReported) configs = {{true, false}, {false, true}, {true, true}};
      // The prompt's catch-up and the levels fed 3 tokens a forward: the same trees and output.
      configs.push_back({true, true, /*max_forward_rows=*/3});
      if (outcome == Outcome::kReported) configs.push_back({false, false, 3});
      for (DraftModelDrafterOptions options : configs) {
        SCOPED_TRACE(testing::Message()
                     << "backend_topk " << options.backend_topk << " reuse_kv " << options.reuse_kv
                     << " max_forward_rows " << options.max_forward_rows);
        const SpecRun got = Speculate(models, pair.prompt, options, outcome, kSteps, params);
        ExpectSameTrees(got, plain_here);
        EXPECT_LE(got.max_rows, options.max_forward_rows);
        // Every accepted first-level node was expanded (max_nodes leaves room), so any
        // acceptance saves feeding.
        if (options.reuse_kv && outcome == Outcome::kReported && plain.accepted > 0) {
          EXPECT_LT(got.fed, plain_here.fed) << "accepted tokens were fed again";
        } else if (options.reuse_kv && outcome != Outcome::kUnknown) {
          EXPECT_LE(got.fed, plain_here.fed);
        } else {
          EXPECT_EQ(got.fed, plain_here.fed);
        }
      }
    }
    // Target-only greedy decoding of as many tokens.
    const SeqId seq = models.next_seq++;
    ASSERT_TRUE(models.target->AddSequence(seq).ok());
    std::vector<int32_t> pending = pair.prompt, greedy;
    while (greedy.size() < plain.output.size()) {
      VerifyItem item;
      item.seq = seq;
      item.pending = pending;
      absl::StatusOr<std::vector<VerifyOutcome>> v = models.target->Verify({item});
      ASSERT_TRUE(v.ok());
      greedy.push_back((*v)[0].tokens[0]);
      pending = {greedy.back()};
    }
    EXPECT_EQ(plain.output, greedy);
    if (pair.draft == pair.target || pair.target == "models/pycoder-target") {
      EXPECT_GT(plain.accepted, 0) << "the pair should accept some drafts";
    }
  }
}

// A failed Draft() after the outcome was applied: the tokens it committed are skipped when the
// same request comes again, and a request that drops them is refused; a restarted sequence
// ignores a stale outcome.
TEST(DraftSavingsTest, RetryAfterAFailureSkipsWhatWasCommitted) {
  BackendOptions options;
  options.num_threads = 1;
  // Room for the prompt, one step's scratch and little more: the second step runs out.
  options.kv_capacity_tokens = 64;
  absl::StatusOr<std::unique_ptr<Backend>> b =
      CreateBackend(ModelDir("tests/fixtures/models/mistral"), options);
  ASSERT_TRUE(b.ok()) << b.status();
  std::unique_ptr<Backend> draft = *std::move(b);
  DraftModelDrafter drafter(draft.get());
  ASSERT_TRUE(drafter.AddSequence(1).ok());
  const DraftParams p{3, 2, 6};
  std::vector<int32_t> prompt(40);
  std::iota(prompt.begin(), prompt.end(), 3);
  absl::StatusOr<std::vector<TokenTree>> first = drafter.Draft({{1, prompt, p}});
  ASSERT_TRUE(first.ok()) << first.status();
  const TokenTree& tree = (*first)[0];
  ASSERT_GT(tree.size(), 0);
  // Node 0 accepted, then a bonus and many more tokens than fit: the feed fails.
  std::vector<int32_t> more = {tree.tokens[0]};
  for (int i = 0; i < 40; ++i) more.push_back(100 + i);
  DraftRequest r{1, more, p, 0};
  const absl::StatusOr<std::vector<TokenTree>> failed = drafter.Draft({r});
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(*draft->CommittedLength(1), static_cast<int64_t>(prompt.size()) + 1);
  DraftRequest dropped{1, {more.begin() + 1, more.end()}, p};
  EXPECT_EQ(drafter.CheckRequest(dropped).code(), absl::StatusCode::kFailedPrecondition);
  // Fits once most of it is gone: same first token, fewer after.
  DraftRequest retry{1, {more.begin(), more.begin() + 4}, p, 0};
  absl::StatusOr<std::vector<TokenTree>> ok = drafter.Draft({retry});
  ASSERT_TRUE(ok.ok()) << ok.status();
  // A fresh sequence fed everything at once grows the same tree.
  ASSERT_TRUE(drafter.Release(1).ok());
  ASSERT_TRUE(drafter.AddSequence(2).ok());
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), retry.new_tokens.begin(), retry.new_tokens.end());
  absl::StatusOr<std::vector<TokenTree>> whole = drafter.Draft({{2, all, p}});
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ((*ok)[0].tokens, (*whole)[0].tokens);
  EXPECT_EQ((*ok)[0].parents, (*whole)[0].parents);
  // A restarted sequence (released, added again) ignores a stale outcome.
  ASSERT_TRUE(drafter.Release(2).ok());
  ASSERT_TRUE(drafter.AddSequence(1).ok());
  absl::StatusOr<std::vector<TokenTree>> again = drafter.Draft({{1, all, p, 0}});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)[0].tokens, (*whole)[0].tokens);
  EXPECT_EQ(*draft->CommittedLength(1), 0);
}

// Overlap: every step pre-drafts below the guessed outcome of the tree being verified, and a
// hit verifies the pre-drafted tree next without drafting. Each tree verified equals the tree
// a plain drafter (refeeding everything, full logits) grows from the true history, so a hit's
// tree is exactly what drafting after the outcome would give; the output is target greedy.
// The target decodes greedily here; target_samples only changes which outcome is guessed. With
// a fan-out of 3 every further guess's tree also equals drafting from scratch after that guess,
// and a hit on one of them (its commit drops the others) keeps every later tree exact.
TEST(PreDraftTest, HitTreesEqualDraftingAfterTheOutcome) {
  const DraftParams params{4, 3, 12};
  constexpr int kSteps = 10;
  int later_hits = 0, later_guesses = 0;  // fan-out 3: hits on, and count of, guesses 2 and 3
  for (const int fan_out : {1, 3}) {
    for (const bool target_samples : {false, true}) {
      for (const Pair& pair : Pairs()) {
        SCOPED_TRACE(pair.draft + " drafting for " + pair.target);
        SCOPED_TRACE(testing::Message()
                     << "target_samples " << target_samples << ", fan-out " << fan_out);
        Models models{Load(ModelDir(pair.draft)), Load(ModelDir(pair.target))};
        ASSERT_TRUE(models.draft != nullptr && models.target != nullptr);
        DraftModelDrafter drafter(models.draft.get());
        DraftModelDrafter plain(models.draft.get(), {false, false});
        const SeqId seq = models.next_seq++, oracle = models.next_seq++;
        ASSERT_TRUE(drafter.AddSequence(seq).ok());
        ASSERT_TRUE(plain.AddSequence(oracle).ok());
        ASSERT_TRUE(models.target->AddSequence(seq).ok());
        std::vector<int32_t> tokens = pair.prompt, pending = pair.prompt;
        size_t drafted = 0, oracle_drafted = 0;
        int32_t accepted_node = DraftRequest::kNoOutcome;
        std::optional<TokenTree> hit_tree;
        std::vector<int32_t> confirmed;  // the last guess's tokens, once verify emitted them
        int hits = 0, misses = 0;
        for (int step = 0; step < kSteps; ++step) {
          SCOPED_TRACE(testing::Message() << "step " << step);
          TokenTree tree;
          if (hit_tree.has_value()) {
            tree = *std::move(hit_tree);
            hit_tree.reset();
          } else {
            DraftRequest r;
            r.seq = seq;
            r.new_tokens.assign(tokens.begin() + drafted, tokens.end());
            r.params = params;
            r.accepted_node = accepted_node;
            absl::StatusOr<std::vector<TokenTree>> trees = drafter.Draft({r});
            ASSERT_TRUE(trees.ok()) << trees.status();
            tree = (*trees)[0];
            drafted = tokens.size();
            confirmed.clear();
          }
          DraftRequest o;
          o.seq = oracle;
          o.new_tokens.assign(tokens.begin() + oracle_drafted, tokens.end());
          o.params = params;
          absl::StatusOr<std::vector<TokenTree>> want = plain.Draft({o});
          ASSERT_TRUE(want.ok()) << want.status();
          oracle_drafted = tokens.size();
          EXPECT_EQ(tree.tokens, (*want)[0].tokens);
          EXPECT_EQ(tree.parents, (*want)[0].parents);
          ASSERT_EQ(tree.draft_logprobs.size(), (*want)[0].draft_logprobs.size());
          for (size_t i = 0; i < tree.draft_logprobs.size(); ++i) {
            EXPECT_NEAR(tree.draft_logprobs[i], (*want)[0].draft_logprobs[i], 1e-4) << "node " << i;
          }

          DraftRequest p;
          p.seq = seq;
          p.new_tokens = confirmed;
          p.params = params;
          p.target_samples = target_samples;
          p.fan_out = fan_out;
          absl::StatusOr<std::vector<DraftModelDrafter::PreDraftResult>> pre =
              drafter.PreDraft({p});
          ASSERT_TRUE(pre.ok()) << pre.status();
          ASSERT_EQ((*pre)[0].consumed, static_cast<int>(confirmed.size()));
          ASSERT_LE((*pre)[0].more.size(), static_cast<size_t>(fan_out - 1));
          later_guesses += static_cast<int>((*pre)[0].more.size());
          for (const DraftModelDrafter::PreDraftGuess& guess : (*pre)[0].more) {
            // Drafting from scratch after this guess: the history and the guessed tokens.
            ASSERT_FALSE(guess.tree.empty());
            EXPECT_NE(guess.tokens, (*pre)[0].guess_tokens);
            const SeqId fresh = models.next_seq++;
            ASSERT_TRUE(plain.AddSequence(fresh).ok());
            DraftRequest f;
            f.seq = fresh;
            f.new_tokens = tokens;
            f.new_tokens.insert(f.new_tokens.end(), guess.tokens.begin(), guess.tokens.end());
            f.params = params;
            absl::StatusOr<std::vector<TokenTree>> after = plain.Draft({f});
            ASSERT_TRUE(after.ok()) << after.status();
            EXPECT_EQ(guess.tree.tokens, (*after)[0].tokens);
            EXPECT_EQ(guess.tree.parents, (*after)[0].parents);
            EXPECT_TRUE(plain.Release(fresh).ok());
          }
          drafted += confirmed.size();
          ASSERT_EQ(drafted, tokens.size());

          VerifyItem item;
          item.seq = seq;
          item.pending = pending;
          item.tree = tree;
          absl::StatusOr<std::vector<VerifyOutcome>> v = models.target->Verify({item});
          ASSERT_TRUE(v.ok()) << v.status();
          const VerifyOutcome& out = (*v)[0];
          tokens.insert(tokens.end(), out.tokens.begin(), out.tokens.end());
          pending = {out.tokens.back()};
          accepted_node = out.accepted_nodes.empty() ? -1 : out.accepted_nodes.back();
          ASSERT_FALSE((*pre)[0].tree.empty());
          const DraftModelDrafter::PreDraftGuess* later = nullptr;
          for (const DraftModelDrafter::PreDraftGuess& guess : (*pre)[0].more) {
            if (out.tokens == guess.tokens) later = &guess;
          }
          if (out.tokens == (*pre)[0].guess_tokens) {
            ++hits;
            hit_tree = (*pre)[0].tree;
            confirmed = out.tokens;
          } else if (later != nullptr) {
            ++hits;
            ++later_hits;
            hit_tree = later->tree;
            confirmed = out.tokens;
          } else {
            ++misses;
            confirmed.clear();
          }
        }
        // Target-only greedy decoding of as many tokens.
        const SeqId greedy_seq = models.next_seq++;
        ASSERT_TRUE(models.target->AddSequence(greedy_seq).ok());
        std::vector<int32_t> greedy_pending = pair.prompt, greedy;
        const size_t produced = tokens.size() - pair.prompt.size();
        while (greedy.size() < produced) {
          VerifyItem item;
          item.seq = greedy_seq;
          item.pending = greedy_pending;
          absl::StatusOr<std::vector<VerifyOutcome>> v = models.target->Verify({item});
          ASSERT_TRUE(v.ok());
          greedy.push_back((*v)[0].tokens[0]);
          greedy_pending = {greedy.back()};
        }
        EXPECT_EQ(std::vector<int32_t>(tokens.begin() + pair.prompt.size(), tokens.end()), greedy);
        if (pair.draft == pair.target && !target_samples) {
          // Drafting for itself, the draft's most likely outcome is the target's.
          EXPECT_EQ(misses, 0);
        }
        EXPECT_GT(hits + misses, 0);
        std::cout << pair.draft << (target_samples ? " (sampling guess" : " (greedy guess")
                  << ", fan-out " << fan_out << "): " << hits << " hits, " << misses << " misses\n";
        EXPECT_TRUE(drafter.Release(seq).ok());
        EXPECT_TRUE(plain.Release(oracle).ok());
        EXPECT_TRUE(models.target->RemoveSequence(seq).ok());
        EXPECT_TRUE(models.target->RemoveSequence(greedy_seq).ok());
      }
    }
  }
  std::cout << "fan-out 3: " << later_guesses << " further guesses, " << later_hits
            << " hits on them\n";
  EXPECT_GT(later_guesses, 0);
  EXPECT_GT(later_hits, 0);
}

// A top-1 chain ranks one token below each node, so its only outcome with a non-child bonus used
// to be "all accepted"; the runner-up each level's top-k ranks behind the child makes "accepted
// up to node a, then the target emits the draft's second choice at a's child" guessable. On the
// reference pair, with a fan-out of 4, guesses at inner nodes (and the root) are pre-drafted in
// the forwards of one guess, each is the draft's second-best token after its path, and some come
// true; every hit's tree is what drafting after the outcome grows, and the output is the
// target's greedy decoding.
TEST(PreDraftTest, AChainsInnerOutcomesAreGuessedWithTheRunnerUpAndHit) {
  // Each level asks one token more than its nodes' children (what the draft service's warm-up
  // asks too), within the backend's top-k limit.
  EXPECT_EQ(DraftModelDrafter::TopKAsked(1), 2);
  EXPECT_EQ(DraftModelDrafter::TopKAsked(kMaxForwardTopK - 1), kMaxForwardTopK);
  EXPECT_EQ(DraftModelDrafter::TopKAsked(kMaxForwardTopK), kMaxForwardTopK);
  const DraftParams chain{4, 1, 4};
  constexpr int kSteps = 24;
  const Pair pair = Pairs().front();
  Models models{Load(ModelDir(pair.draft)), Load(ModelDir(pair.target))};
  ASSERT_TRUE(models.draft != nullptr && models.target != nullptr);
  CountingBackend counter(models.draft.get());
  DraftModelDrafter drafter(&counter);
  DraftModelDrafter plain(models.draft.get(), {false, false});
  const SeqId seq = models.next_seq++;
  ASSERT_TRUE(drafter.AddSequence(seq).ok());
  ASSERT_TRUE(models.target->AddSequence(seq).ok());
  // The draft's two best tokens after `history` (a fresh sequence, one level of top-2).
  auto best_two = [&](const std::vector<int32_t>& history) {
    const SeqId fresh = models.next_seq++;
    EXPECT_TRUE(plain.AddSequence(fresh).ok());
    absl::StatusOr<std::vector<TokenTree>> t = plain.Draft({{fresh, history, {1, 2, 2}}});
    EXPECT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(plain.Release(fresh).ok());
    return t.ok() ? (*t)[0].tokens : std::vector<int32_t>();
  };
  std::vector<int32_t> tokens = pair.prompt, pending = pair.prompt, confirmed;
  size_t drafted = 0;
  int32_t accepted_node = DraftRequest::kNoOutcome;
  std::optional<TokenTree> hit_tree;
  int inner_guesses = 0, inner_hits = 0, hits = 0;
  for (int step = 0; step < kSteps; ++step) {
    SCOPED_TRACE(testing::Message() << "step " << step);
    TokenTree tree;
    if (hit_tree.has_value()) {
      tree = *std::move(hit_tree);
      hit_tree.reset();
    } else {
      DraftRequest r{seq, {tokens.begin() + drafted, tokens.end()}, chain, accepted_node};
      absl::StatusOr<std::vector<TokenTree>> trees = drafter.Draft({r});
      ASSERT_TRUE(trees.ok()) << trees.status();
      tree = (*trees)[0];
      drafted = tokens.size();
      confirmed.clear();
    }
    ASSERT_EQ(tree.size(), chain.depth);
    DraftRequest p;
    p.seq = seq;
    p.new_tokens = confirmed;
    p.params = chain;
    p.fan_out = 4;
    const int64_t calls = counter.calls();
    absl::StatusOr<std::vector<DraftModelDrafter::PreDraftResult>> pre = drafter.PreDraft({p});
    ASSERT_TRUE(pre.ok()) << pre.status();
    // The four guesses share their forwards: the leaf's top-1, the fed chains, then the levels.
    EXPECT_LE(counter.calls() - calls, chain.depth + 1);
    drafted += confirmed.size();
    const DraftModelDrafter::PreDraftResult& result = (*pre)[0];
    // The greedy path accepted whole comes first.
    EXPECT_EQ(result.guess_node, chain.depth - 1);
    EXPECT_EQ(result.more.size(), static_cast<size_t>(3));
    for (const DraftModelDrafter::PreDraftGuess& guess : result.more) {
      ASSERT_LT(guess.node, chain.depth - 1);
      ++inner_guesses;
      // The accepted path, then the draft's runner-up below its last node.
      ASSERT_EQ(guess.tokens.size(), static_cast<size_t>(guess.node + 2));
      std::vector<int32_t> history = tokens;
      history.insert(history.end(), guess.tokens.begin(), guess.tokens.end() - 1);
      const std::vector<int32_t> two = best_two(history);
      ASSERT_EQ(two.size(), 2u);
      EXPECT_EQ(guess.tokens.back(), two[1]);
      EXPECT_EQ(guess.tokens.front(), guess.node < 0 ? two[1] : tree.tokens[0]);
    }

    VerifyItem item;
    item.seq = seq;
    item.pending = pending;
    item.tree = tree;
    absl::StatusOr<std::vector<VerifyOutcome>> v = models.target->Verify({item});
    ASSERT_TRUE(v.ok()) << v.status();
    const VerifyOutcome& out = (*v)[0];
    tokens.insert(tokens.end(), out.tokens.begin(), out.tokens.end());
    pending = {out.tokens.back()};
    accepted_node = out.accepted_nodes.empty() ? -1 : out.accepted_nodes.back();
    const DraftModelDrafter::PreDraftGuess* inner = nullptr;
    for (const DraftModelDrafter::PreDraftGuess& guess : result.more) {
      if (out.tokens == guess.tokens) inner = &guess;
    }
    if (out.tokens == result.guess_tokens) {
      ++hits;
      hit_tree = result.tree;
      confirmed = out.tokens;
    } else if (inner != nullptr) {
      ++hits;
      ++inner_hits;
      EXPECT_EQ(inner->node, accepted_node);
      // The hit's tree is the one drafting after the outcome grows.
      const SeqId fresh = models.next_seq++;
      ASSERT_TRUE(plain.AddSequence(fresh).ok());
      absl::StatusOr<std::vector<TokenTree>> after = plain.Draft({{fresh, tokens, chain}});
      ASSERT_TRUE(after.ok()) << after.status();
      EXPECT_EQ(inner->tree.tokens, (*after)[0].tokens);
      EXPECT_TRUE(plain.Release(fresh).ok());
      hit_tree = inner->tree;
      confirmed = out.tokens;
    } else {
      confirmed.clear();
    }
  }
  std::cout << "chain of 4, fan-out 4: " << hits << " hits in " << kSteps << " steps, "
            << inner_hits << " of them at inner nodes (" << inner_guesses << " inner guesses)\n";
  EXPECT_GT(inner_guesses, 0);
  EXPECT_GT(inner_hits, 0);
  // Target-only greedy decoding of as many tokens.
  const SeqId greedy_seq = models.next_seq++;
  ASSERT_TRUE(models.target->AddSequence(greedy_seq).ok());
  std::vector<int32_t> greedy_pending = pair.prompt, greedy;
  while (greedy.size() < tokens.size() - pair.prompt.size()) {
    VerifyItem item;
    item.seq = greedy_seq;
    item.pending = greedy_pending;
    absl::StatusOr<std::vector<VerifyOutcome>> v = models.target->Verify({item});
    ASSERT_TRUE(v.ok());
    greedy.push_back((*v)[0].tokens[0]);
    greedy_pending = {greedy.back()};
  }
  EXPECT_EQ(std::vector<int32_t>(tokens.begin() + pair.prompt.size(), tokens.end()), greedy);
}

// A greedy target's measured acceptance (DraftRequest::chain_rates) ranks every outcome by one
// estimate: where the target almost never takes the draft's first token, the likeliest outcome
// is "nothing accepted, then the draft's runner-up", ahead of the whole chain; where it almost
// always takes every token, the whole chain; out of [0, 1] is never reached here (the draft
// service refuses it by field).
TEST(PreDraftTest, MeasuredAcceptanceRanksTheOutcomes) {
  const DraftParams chain{4, 1, 4};
  const Pair pair = Pairs().front();
  std::unique_ptr<Backend> draft = Load(ModelDir(pair.draft));
  ASSERT_NE(draft, nullptr);
  DraftModelDrafter drafter(draft.get());
  ASSERT_TRUE(drafter.AddSequence(1).ok());
  absl::StatusOr<std::vector<TokenTree>> tree = drafter.Draft({{1, pair.prompt, chain}});
  ASSERT_TRUE(tree.ok()) << tree.status();
  ASSERT_EQ((*tree)[0].size(), chain.depth);
  DraftModelDrafter plain(draft.get(), {false, false});
  ASSERT_TRUE(plain.AddSequence(2).ok());
  absl::StatusOr<std::vector<TokenTree>> two = plain.Draft({{2, pair.prompt, {1, 2, 2}}});
  ASSERT_TRUE(two.ok()) << two.status();
  ASSERT_EQ((*two)[0].size(), 2);
  auto first_guess = [&](std::vector<float> rates) {
    DraftRequest p;
    p.seq = 1;
    p.params = chain;
    p.fan_out = 2;
    p.chain_rates = std::move(rates);
    absl::StatusOr<std::vector<DraftModelDrafter::PreDraftResult>> pre = drafter.PreDraft({p});
    EXPECT_TRUE(pre.ok()) << pre.status();
    return pre.ok() ? (*pre)[0] : DraftModelDrafter::PreDraftResult();
  };
  // (Each call's empty new_tokens drops the previous call's guesses: the kept tree stays.)
  const DraftModelDrafter::PreDraftResult rejected = first_guess({0.01f});
  EXPECT_EQ(rejected.guess_node, -1);
  EXPECT_EQ(rejected.guess_tokens, std::vector<int32_t>{(*two)[0].tokens[1]});
  ASSERT_EQ(rejected.more.size(), 1u);
  EXPECT_EQ(rejected.more[0].node, 0);  // the next likeliest: rejected one node later
  const DraftModelDrafter::PreDraftResult accepted = first_guess({0.99f, 0.99f, 0.99f});
  EXPECT_EQ(accepted.guess_node, chain.depth - 1);
  EXPECT_EQ(std::vector<int32_t>(accepted.guess_tokens.begin(), accepted.guess_tokens.end() - 1),
            (*tree)[0].tokens);
  ASSERT_EQ(accepted.more.size(), 1u);
  EXPECT_LT(accepted.more[0].node, chain.depth - 1);  // a rejection, somewhere
  // Without rates the greedy path comes first whatever the draft's confidence.
  EXPECT_EQ(first_guess({}).guess_node, chain.depth - 1);
}

}  // namespace
}  // namespace specd
