// The CUDA backend's warm-up (BackendOptions::cuda_warmup, engine/warmup.h): once it has run,
// prefills and decode and verify steps of any row count up to the invariant rows decide no
// further GEMM row class, i.e. no request pays for an algorithm decision; without it they do.
// The draft levels' warm-up captures the level graphs a draft service's first steps would.
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/draft/draft_model_drafter.h"
#include "engine/warmup.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

class CudaWarmUpTest : public gpu_test::GpuTest {
 protected:
  void SetUp() override {
    gpu_test::GpuTest::SetUp();
    if (IsSkipped()) return;
    dir_ = MakeTempDir("cuda_warmup_test");
    RandomCheckpointSpec spec;
    spec.vocab_size = 1000;
    spec.hidden_size = 256;
    spec.intermediate_size = 512;
    spec.num_heads = 4;
    spec.num_kv_heads = 2;
    spec.max_position_embeddings = 4096;
    spec.dtype = DType::kBF16;
    ASSERT_TRUE(WriteRandomCheckpoint(dir_, spec).ok());
  }

  std::unique_ptr<Backend> Load(bool warmup) {
    BackendOptions opts;
    opts.device = "cuda:0";
    opts.kv_capacity_tokens = 1 << 15;
    opts.cuda_warmup = warmup;
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir_, opts);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? std::move(*b) : nullptr;
  }

  // Prefills of several lengths, then decode steps of a batch of them: row counts spread over
  // the classes up to 1024.
  void Serve(Backend& b) {
    std::mt19937_64 rng(3);
    std::vector<float> logits;
    SeqId next = 1;
    for (int n : {5, 40, 300, 700, 1024}) {
      ForwardItem it;
      it.seq = next++;
      it.tokens = gpu_test::RandomTokens(n, b.config().vocab_size, rng);
      for (int j = 0; j < n; ++j) it.parents.push_back(j - 1);
      it.logit_rows = {n - 1};
      ASSERT_TRUE(b.AddSequence(it.seq).ok());
      ASSERT_TRUE(b.Forward({it}, &logits).ok());
      std::vector<int32_t> path(n);
      for (int j = 0; j < n; ++j) path[j] = j;
      ASSERT_TRUE(b.Commit(it.seq, path).ok());
    }
    for (int step = 0; step < 3; ++step) {
      std::vector<ForwardItem> items;
      for (SeqId s = 1; s < next; ++s) {
        ForwardItem it;
        it.seq = s;
        it.tokens = gpu_test::RandomTokens(9, b.config().vocab_size, rng);
        for (int j = 0; j < 9; ++j) {
          it.parents.push_back(j - 1);
          it.logit_rows.push_back(j);
        }
        items.push_back(it);
      }
      ASSERT_TRUE(b.Forward(items, &logits).ok());
      for (SeqId s = 1; s < next; ++s) ASSERT_TRUE(b.Commit(s, {0}).ok());
    }
    for (SeqId s = 1; s < next; ++s) ASSERT_TRUE(b.RemoveSequence(s).ok());
  }

  std::string dir_;
};

TEST_F(CudaWarmUpTest, NoClassIsDecidedWhileServingAfterWarmUp) {
  std::unique_ptr<Backend> warm = Load(/*warmup=*/true);
  ASSERT_NE(warm, nullptr);
  auto* cuda = dynamic_cast<CudaBackend*>(warm.get());
  ASSERT_NE(cuda, nullptr);
  const int decided = cuda->gemm_classes_decided();
  EXPECT_GT(decided, 0);
  EXPECT_EQ(warm->Usage().sequences, 0);
  EXPECT_EQ(warm->Usage().used_tokens, 0);
  Serve(*warm);
  EXPECT_EQ(cuda->gemm_classes_decided(), decided);

  // The control: a backend without the warm-up decides classes while it serves.
  std::unique_ptr<Backend> cold = Load(/*warmup=*/false);
  ASSERT_NE(cold, nullptr);
  auto* cold_cuda = dynamic_cast<CudaBackend*>(cold.get());
  const int before = cold_cuda->gemm_classes_decided();
  Serve(*cold);
  EXPECT_GT(cold_cuda->gemm_classes_decided(), before);
}

// The draft levels' warm-up (engine/warmup.h WarmUpDraftLevels) captures the level graphs of
// every batch it runs: the same trees afterwards replay them, capturing nothing, and no buffer
// growth drops them (a drop would show as captures again).
TEST_F(CudaWarmUpTest, DraftLevelGraphsAreCapturedBeforeServing) {
  std::unique_ptr<Backend> b = Load(/*warmup=*/true);
  ASSERT_NE(b, nullptr);
  auto* cuda = dynamic_cast<CudaBackend*>(b.get());
  ASSERT_NE(cuda, nullptr);
  const int64_t before = cuda->graphs_captured();
  DraftLevelWarmUp shape;
  shape.batches = DraftLevelWarmUpBatches(64);
  absl::StatusOr<WarmUpReport> report = WarmUpDraftLevels(*b, shape);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->rows, shape.batches);
  const int64_t captured = cuda->graphs_captured();
  // At least a level-0 graph and a children-level graph per batch bucket.
  EXPECT_GE(captured - before, 2 * static_cast<int64_t>(shape.batches.size()));
  const Backend::ExecutionCounts counts = b->execution_counts();
  shape.passes = 1;
  ASSERT_TRUE(WarmUpDraftLevels(*b, shape).ok());
  EXPECT_EQ(cuda->graphs_captured(), captured);
  EXPECT_EQ(b->execution_counts().eager_steps, counts.eager_steps);
  EXPECT_EQ(b->execution_counts().graph_replays,
            counts.graph_replays + shape.depth * static_cast<int64_t>(shape.batches.size()));
  EXPECT_EQ(b->Usage().sequences, 0);
  EXPECT_EQ(b->Usage().used_tokens, 0);
}

// The model drafter asks each level for one top-k more than its nodes' children (the runner-up a
// pre-draft guesses with, DraftModelDrafter::TopKAsked), and the draft service's warm-up asks
// the same k: a drafter's trees of the warmed shape afterwards replay the warmed graphs and
// capture none (warmed at top_k alone, their levels' k would have no graph yet).
TEST_F(CudaWarmUpTest, DrafterTreesAfterTheDraftLevelWarmUpCaptureNothing) {
  std::unique_ptr<Backend> b = Load(/*warmup=*/true);
  ASSERT_NE(b, nullptr);
  auto* cuda = dynamic_cast<CudaBackend*>(b.get());
  ASSERT_NE(cuda, nullptr);
  DraftLevelWarmUp shape;
  shape.batches = {1};
  shape.asked_k = DraftModelDrafter::TopKAsked(shape.top_k);
  ASSERT_TRUE(WarmUpDraftLevels(*b, shape).ok());
  const int64_t captured = cuda->graphs_captured();
  DraftModelDrafter drafter(b.get());
  ASSERT_TRUE(drafter.AddSequence(1).ok());
  // max_nodes out of the way: every level expands top_k nodes, the warm-up's shape.
  const DraftParams params{shape.depth, shape.top_k, 256};
  for (int32_t step = 0; step < 3; ++step) {
    absl::StatusOr<std::vector<TokenTree>> trees = drafter.Draft({{1, {7 + step}, params}});
    ASSERT_TRUE(trees.ok()) << trees.status();
    ASSERT_FALSE((*trees)[0].empty());
  }
  EXPECT_EQ(cuda->graphs_captured(), captured);
  EXPECT_TRUE(drafter.Release(1).ok());
}

}  // namespace
}  // namespace specd
