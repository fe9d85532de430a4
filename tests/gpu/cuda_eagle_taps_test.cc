// Residual-stream taps (Backend::ForwardWithTaps, VerifyItem::tap_layers) of the CUDA backend
// and of the tensor-parallel CUDA backend at TP=2, against the fp32 CPU backend on the same
// random bf16 checkpoint, within bf16 tolerance:
//  - ForwardWithTaps of a prefill chain and of a tree, two sequences a step, layers asked for out
//    of order (and the last layer's output, id num_layers, and the final norm's output,
//    FinalNormTap = num_layers + 1, an EAGLE-1/2 head's feature: the bf16 rows the LM head reads,
//    against the CPU's fp32 ones);
//  - Verify() steps (prefill through Verify, then trees holding the backend's own greedy path
//    beside wrong siblings, repeated so that the tree bucket's CUDA graph is captured and
//    replayed): each sequence's taps are the rows of exactly the tokens the step committed (the
//    pending tokens, then the accepted nodes), compared with the CPU's taps of a plain chain of
//    those tokens; sequences in one batch ask for different layers or none (one for the final
//    norm's output alone, as an EAGLE-1/2 drafter does); one sequence has a logits processor and
//    so takes the host acceptance path (VerifySplit) over the device ForwardWithTaps.
//  - held taps (VerifyItem::hold_tap_rows): each of several sequences whose steps hold their rows
//    on the device (their copies issued together, runs of rows differing between them) gets back
//    from TakeHeldTaps() the rows a twin sequence in the same batches was returned
//    step by step; past its bound the older half is gone; RemoveSequence() drops them.
// TP=2 is skipped on a host with fewer than two GPUs.
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/backend.h"
#include "engine/sampling.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/testutil/hf_fixtures.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

using gpu_test::RandomTokens;
using gpu_test::RowsClose;

constexpr int kLayers = 4;
constexpr int kHidden = 128;
constexpr int kVocab = 320;
// The residual stream of a bf16 forward against the fp32 one, per tap row: bf16 rounding
// compounded over four layers of weights at init_std 0.15 reaches a few percent (the logits of
// the same forward as much), while a wrong row, layer or position is off by order one.
constexpr double kTapTol = 5e-2;
constexpr int kFinalNorm = kLayers + 1;  // FinalNormTap(kLayers)

RandomCheckpointSpec Spec() {
  RandomCheckpointSpec s;
  s.vocab_size = kVocab;
  s.hidden_size = kHidden;
  s.intermediate_size = 352;
  s.num_layers = kLayers;
  s.num_heads = 4;
  s.num_kv_heads = 2;
  s.head_dim = 32;
  s.dtype = DType::kBF16;
  s.init_std = 0.15f;
  return s;
}

class CudaEagleTapsTest : public gpu_test::GpuTest, public ::testing::WithParamInterface<int> {
 protected:
  void SetUp() override {
    gpu_test::GpuTest::SetUp();
    if (IsSkipped()) return;
    int n = 0;
    cudaGetDeviceCount(&n);
    if (GetParam() > n) GTEST_SKIP() << "TP=" << GetParam() << " needs that many GPUs; " << n;
    dir_ = MakeTempDir("cuda_eagle_taps_");
    ASSERT_TRUE(WriteRandomCheckpoint(dir_, Spec()).ok());
    cpu_ = Load("cpu", 1);
    cuda_ = Load("cuda:0", GetParam());
    ASSERT_TRUE(cpu_ && cuda_);
  }

  std::unique_ptr<Backend> Load(const std::string& device, int tp) {
    BackendOptions opts;
    opts.device = device;
    opts.tensor_parallel = tp;
    opts.kv_capacity_tokens = 1 << 14;
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir_, opts);
    EXPECT_TRUE(b.ok()) << device << " tp " << tp << ": " << b.status();
    return b.ok() ? std::move(*b) : nullptr;
  }

  // The CPU's taps of `tokens` appended to `seq` as a chain and committed: the reference for
  // whatever rows the CUDA backend returned for the same committed tokens.
  std::vector<float> CpuChainTaps(SeqId seq, const std::vector<int32_t>& tokens,
                                  const std::vector<int>& layers) {
    std::vector<float> logits, taps;
    absl::Status s =
        cpu_->ForwardWithTaps({testutil::Chain(seq, tokens, {})}, layers, &logits, &taps);
    EXPECT_TRUE(s.ok()) << s;
    std::vector<int32_t> path(tokens.size());
    for (size_t i = 0; i < path.size(); ++i) path[i] = static_cast<int32_t>(i);
    EXPECT_TRUE(cpu_->Commit(seq, path).ok());
    return taps;
  }

  std::string dir_;
  std::unique_ptr<Backend> cpu_, cuda_;
};

TEST_P(CudaEagleTapsTest, ForwardWithTapsMatchesCpu) {
  ASSERT_TRUE(cuda_->verify_features().taps);
  ASSERT_TRUE(cuda_->verify_features().final_norm_tap);
  ASSERT_EQ(FinalNormTap(kLayers), kFinalNorm);
  std::mt19937_64 rng(11);
  const std::vector<int32_t> a = RandomTokens(37, kVocab, rng), b = RandomTokens(9, kVocab, rng);
  // Not sorted; kLayers: the last layer's output before the final norm, kFinalNorm after it.
  const std::vector<int> layers = {kLayers, 0, kFinalNorm, 2};
  const int64_t width = static_cast<int64_t>(layers.size()) * kHidden;
  std::vector<Backend*> both = {cpu_.get(), cuda_.get()};
  std::vector<std::vector<float>> logits(2), taps(2);
  for (Backend* be : both) {
    ASSERT_TRUE(be->AddSequence(1).ok());
    ASSERT_TRUE(be->AddSequence(2).ok());
  }
  const auto step = [&](const std::vector<ForwardItem>& items, const char* what) {
    int64_t tokens = 0;
    for (const ForwardItem& it : items) tokens += static_cast<int64_t>(it.tokens.size());
    for (int i = 0; i < 2; ++i) {
      absl::Status s = both[i]->ForwardWithTaps(items, layers, &logits[i], &taps[i]);
      ASSERT_TRUE(s.ok()) << what << ": " << s;
      ASSERT_EQ(static_cast<int64_t>(taps[i].size()), tokens * width) << what;
    }
    // Per tap row (one layer of one token): a tap is a hidden-size vector.
    const ::testing::AssertionResult close = RowsClose(taps[1], taps[0], kHidden, kTapTol);
    EXPECT_TRUE(close) << what;
    std::printf("TP=%d %s taps vs CPU: %s\n", GetParam(), what, close.message());
    EXPECT_TRUE(RowsClose(logits[1], logits[0], kVocab, kTapTol)) << what << " logits";
  };
  step({testutil::Chain(1, a, {36}), testutil::Chain(2, b, {0, 8})}, "prefill of two sequences");
  for (Backend* be : both) {
    std::vector<int32_t> pa(a.size()), pb(b.size());
    for (size_t i = 0; i < pa.size(); ++i) pa[i] = static_cast<int32_t>(i);
    for (size_t i = 0; i < pb.size(); ++i) pb[i] = static_cast<int32_t>(i);
    ASSERT_TRUE(be->Commit(1, pa).ok());
    ASSERT_TRUE(be->Commit(2, pb).ok());
  }
  ForwardItem tree;
  tree.seq = 1;
  tree.tokens = RandomTokens(6, kVocab, rng);
  tree.parents = {-1, 0, 0, 1, -1, 4};
  tree.logit_rows = {0, 3, 5};
  step({testutil::Chain(2, {b[0]}, {0}), tree}, "decode and tree");
  for (Backend* be : both) {
    ASSERT_TRUE(be->Commit(1, {}).ok());
    ASSERT_TRUE(be->Commit(2, {0}).ok());
  }
  // Arguments are checked before anything runs.
  std::vector<float> lg, tp;
  const std::vector<ForwardItem> one = {testutil::Chain(1, {a[0]}, {0})};
  absl::Status s = cuda_->ForwardWithTaps(one, {1, 1}, &lg, &tp);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("tap_layers"), std::string::npos) << s;
  s = cuda_->ForwardWithTaps(one, {kFinalNorm + 1}, &lg, &tp);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = cuda_->ForwardWithTaps(one, {-1}, &lg, &tp);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = cuda_->ForwardWithTaps(one, {1}, &lg, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(*cuda_->CommittedLength(1), static_cast<int64_t>(a.size()));
}

TEST_P(CudaEagleTapsTest, VerifyTapsAreTheCommittedTokensRows) {
  std::mt19937_64 rng(5);
  // Sequence 1 asks for three layers, 2 for the final norm's output alone (an EAGLE-1/2
  // drafter), 3 for none; 4 has a repetition penalty (the host acceptance path) and asks for
  // three, the final norm's output among them.
  const std::vector<std::vector<int>> want = {
      {1, 2, kLayers}, {kFinalNorm}, {}, {kLayers, kFinalNorm, 1}};
  const int n = static_cast<int>(want.size());
  std::vector<std::vector<int32_t>> prompt(n), pending(n);
  std::vector<TokenHistory> history(n);
  for (int i = 0; i < n; ++i) {
    prompt[i] = RandomTokens(12 + 5 * i, kVocab, rng);
    pending[i] = prompt[i];
    history[i].AddPrompt(prompt[i]);
    ASSERT_TRUE(cuda_->AddSequence(i + 1).ok());
    ASSERT_TRUE(cpu_->AddSequence(i + 1).ok());
  }
  // Greedy continuations decoded alone by the same backend without taps (sequences 101..): the
  // trees below hold them, so the steps accept several nodes.
  std::vector<std::vector<int32_t>> greedy(n);
  for (int i = 0; i < n; ++i) greedy[i] = testutil::Greedy(*cuda_, 101 + i, prompt[i], 24);
  std::vector<int> done(n, 0);  // greedy tokens committed so far
  int accepted = 0;
  const Backend::ExecutionCounts before = cuda_->execution_counts();
  for (int step = 0; step < 5; ++step) {
    std::vector<VerifyItem> items(n);
    for (int i = 0; i < n; ++i) {
      VerifyItem& it = items[i];
      it.seq = i + 1;
      it.pending = pending[i];
      it.tap_layers = want[i];
      if (i == 3) {
        it.sampling.repetition_penalty = 1.05f;
        it.history = &history[i];
      }
      if (step > 0) {
        // Pending is the bonus greedy[done - 1]; the tree: the next three greedy tokens as a
        // chain with a wrong sibling at each depth (the same shape every step, so one graph
        // bucket).
        const int d = done[i];
        const auto g = [&](int j) { return greedy[i][std::min(d + j, 23)]; };
        it.tree.tokens = {g(0), (g(0) + 1) % kVocab, g(1), (g(1) + 1) % kVocab, g(2)};
        it.tree.parents = {-1, -1, 0, 0, 2};
      }
    }
    absl::StatusOr<std::vector<VerifyOutcome>> out = cuda_->Verify(items);
    ASSERT_TRUE(out.ok()) << "step " << step << ": " << out.status();
    for (int i = 0; i < n; ++i) {
      SCOPED_TRACE(::testing::Message() << "step " << step << " sequence " << i + 1);
      const VerifyOutcome& o = (*out)[i];
      // The committed tokens: the pending ones, then the accepted nodes' tokens.
      std::vector<int32_t> committed = pending[i];
      for (int32_t node : o.accepted_nodes) committed.push_back(items[i].tree.tokens[node]);
      const std::vector<float> ref = CpuChainTaps(i + 1, committed, want[i]);
      if (want[i].empty()) {
        EXPECT_TRUE(o.taps.empty());
      } else {
        ASSERT_EQ(o.taps.size(), committed.size() * want[i].size() * kHidden);
        const ::testing::AssertionResult close = RowsClose(o.taps, ref, kHidden, kTapTol);
        EXPECT_TRUE(close);
        if (step < 2)
          std::printf("TP=%d step %d seq %d: %s\n", GetParam(), step, i + 1, close.message());
      }
      accepted += o.accepted_draft;
      if (step > 0) done[i] += o.accepted_draft;
      done[i] += 1;  // the bonus
      history[i].AddOutput(o.tokens);
      pending[i] = {o.tokens.back()};
    }
  }
  // The trees held the backend's own greedy path: most steps accept some of it.
  EXPECT_GT(accepted, 0);
  // Four tree steps of one bucket: the padded device batch (sequences 1-3) was captured on its
  // second use and replayed after, with its taps' copies.
  const Backend::ExecutionCounts after = cuda_->execution_counts();
  std::printf("TP=%d graphs: %lld captured, %lld replays, %lld eager steps\n", GetParam(),
              static_cast<long long>(after.graph_captures - before.graph_captures),
              static_cast<long long>(after.graph_replays - before.graph_replays),
              static_cast<long long>(after.eager_steps - before.eager_steps));
  EXPECT_GT(after.graph_replays, before.graph_replays);
}

TEST_P(CudaEagleTapsTest, HeldTapsAreTheRowsTheStepsWouldHaveReturned) {
  ASSERT_TRUE(cuda_->verify_features().held_taps);
  std::mt19937_64 rng(23);
  const std::vector<int> layers = {1, kFinalNorm};
  const int64_t width = static_cast<int64_t>(layers.size()) * kHidden;
  const std::vector<int32_t> prompt = RandomTokens(14, kVocab, rng);
  const std::vector<int32_t> long_prompt = RandomTokens(20, kVocab, rng);
  const std::vector<int32_t> greedy = testutil::Greedy(*cuda_, 100, prompt, 16);
  // Pairs of a sequence that holds its rows (bound far off) and its twin whose rows come back
  // every step: pair 0 is sequences 1 and 2, pair k > 0 is 10 + k and 20 + k. Each pair's tree
  // puts the greedy tokens elsewhere, so that the committed rows of a step form different runs
  // (pending row p, nodes at p + 1 + i): pair 0 accepts nodes 0, 2 (runs [p, p + 1], [p + 3]),
  // pair 1 nodes 1, 2 ([p], [p + 2, p + 3]), pair 2 nodes 0, 1 (one run [p, p + 2]). With more
  // pairs than kinds of tree, several sequences' copies of a step go to the device together.
  // 3 holds with a bound of 8 rows, 4 holds and is removed.
  constexpr int kPairs = 6;
  const auto held_seq = [](int k) -> SeqId { return k == 0 ? 1 : 10 + k; };
  const auto twin_seq = [](int k) -> SeqId { return k == 0 ? 2 : 20 + k; };
  for (int k = 0; k < kPairs; ++k) {
    ASSERT_TRUE(cuda_->AddSequence(held_seq(k)).ok());
    ASSERT_TRUE(cuda_->AddSequence(twin_seq(k)).ok());
  }
  for (SeqId s : {3, 4}) ASSERT_TRUE(cuda_->AddSequence(s).ok());
  std::vector<std::vector<float>> returned(kPairs);  // each twin's rows, step after step
  std::vector<int32_t> pending = prompt;
  int done = 0, accepted = 0;
  for (int step = 0; step < 5; ++step) {
    std::vector<VerifyItem> items(2 * kPairs);
    for (int i = 0; i < 2 * kPairs; ++i) {
      const int k = i / 2;
      items[i].seq = i % 2 == 0 ? held_seq(k) : twin_seq(k);
      items[i].pending = pending;
      items[i].tap_layers = layers;
      if (i % 2 == 0) items[i].hold_tap_rows = 1000;
      if (step > 0) {
        const auto g = [&](int j) { return greedy[std::min(done + j, 15)]; };
        const int32_t wrong = (g(0) + 1) % kVocab;
        switch (k % 3) {
          case 0:
            items[i].tree.tokens = {g(0), wrong, g(1)};
            items[i].tree.parents = {-1, -1, 0};
            break;
          case 1:
            items[i].tree.tokens = {wrong, g(0), g(1)};
            items[i].tree.parents = {-1, -1, 1};
            break;
          default:
            items[i].tree.tokens = {g(0), g(1), wrong};
            items[i].tree.parents = {-1, 0, -1};
            break;
        }
      }
    }
    if (step == 0) {
      for (SeqId s : {3, 4}) {
        VerifyItem& it = items.emplace_back();
        it.seq = s;
        it.pending = long_prompt;
        it.tap_layers = layers;
        it.hold_tap_rows = 8;
      }
    }
    absl::StatusOr<std::vector<VerifyOutcome>> out = cuda_->Verify(items);
    ASSERT_TRUE(out.ok()) << "step " << step << ": " << out.status();
    for (int k = 0; k < kPairs; ++k) {
      const VerifyOutcome& held = (*out)[2 * k];
      const VerifyOutcome& twin = (*out)[2 * k + 1];
      EXPECT_EQ(held.tokens, twin.tokens) << "step " << step << " pair " << k;
      EXPECT_EQ(twin.tokens, (*out)[1].tokens) << "step " << step << " pair " << k;
      EXPECT_TRUE(held.taps.empty()) << "step " << step << " pair " << k << ": held rows returned";
      ASSERT_FALSE(twin.taps.empty()) << "step " << step << " pair " << k;
      returned[k].insert(returned[k].end(), twin.taps.begin(), twin.taps.end());
    }
    accepted += (*out)[1].accepted_draft;
    if (step > 0) done += (*out)[1].accepted_draft;
    done += 1;
    pending = {(*out)[1].tokens.back()};
  }
  EXPECT_GT(accepted, 0);
  for (int k = 0; k < kPairs; ++k) {
    absl::StatusOr<HeldTapRows> held = cuda_->TakeHeldTaps(held_seq(k));
    ASSERT_TRUE(held.ok()) << held.status();
    EXPECT_EQ(held->first_position, 0);
    EXPECT_EQ(held->layers, layers);
    ASSERT_EQ(held->rows.size(), returned[k].size()) << "pair " << k;
    // The same tokens at the same positions in the same batches: the same rows.
    const ::testing::AssertionResult same = RowsClose(held->rows, returned[k], kHidden, 1e-5);
    EXPECT_TRUE(same) << "pair " << k;
    std::printf("TP=%d pair %d held rows against returned ones (%zu rows): %s, bitwise %s\n",
                GetParam(), k, returned[k].size() / width, same.message(),
                held->rows == returned[k] ? "equal" : "different");
    held = cuda_->TakeHeldTaps(held_seq(k));  // taken: nothing left
    ASSERT_TRUE(held.ok());
    EXPECT_TRUE(held->rows.empty());
  }
  absl::StatusOr<HeldTapRows> held;

  // 20 rows held under a bound of 8: the newest 4 stay, from position 16.
  held = cuda_->TakeHeldTaps(3);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->first_position, 16);
  ASSERT_EQ(static_cast<int64_t>(held->rows.size()), 4 * width);
  ASSERT_TRUE(cpu_->AddSequence(3).ok());
  const std::vector<float> ref = CpuChainTaps(3, long_prompt, layers);
  ASSERT_EQ(static_cast<int64_t>(ref.size()), 20 * width);
  EXPECT_TRUE(RowsClose(held->rows, std::vector<float>(ref.begin() + 16 * width, ref.end()),
                        kHidden, kTapTol));

  // Removing a sequence drops its rows.
  ASSERT_TRUE(cuda_->RemoveSequence(4).ok());
  held = cuda_->TakeHeldTaps(4);
  ASSERT_TRUE(held.ok());
  EXPECT_TRUE(held->rows.empty());
}

INSTANTIATE_TEST_SUITE_P(Tp, CudaEagleTapsTest, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "tp" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace specd
