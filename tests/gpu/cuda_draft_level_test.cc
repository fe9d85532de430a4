// A draft level on the CUDA backend as one launch chain (CudaBackend::ForwardTopK): the forward
// and the rows' top-k captured in one CUDA graph per (bucket, k), one metadata copy up, one copy
// of [rows, k] down. Against the references:
//  - the same levels with graphs off (eager, unpadded) give the same ids and log-probabilities
//    bit for bit, and so does every pass with graphs on (first use eager, capture, replays);
//  - each level's top-k equals the host top-k (engine/topk.h) of the logits Forward() returns
//    for the same level in the same state (ids exactly, log-probabilities to fp32 rounding:
//    the fp64 sums run in another order);
//  - repeated draft levels replay graphs (execution_counts()) and launch nothing eagerly;
//  - the tensor-parallel group (two GPUs, skipped on a smaller host) ranks the gathered rows on
//    rank 0 with the same results as its own Forward() and a host top-k, graphs replayed too,
//    and the drafter's trees over it equal those of the host path, step after step.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/casts.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/draft/draft_model_drafter.h"
#include "engine/topk.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/testutil/hf_fixtures.h"

namespace specd {
namespace {

constexpr int kSeqs = 3;
constexpr int kDepth = 4;
constexpr int kWidth = 4;  // children a level expands per sequence

std::string DraftDir() { return (testutil::RepoRoot() / "models" / "pycoder-draft").string(); }

// One pass of draft levels over sequences 1..kSeqs (their prompts committed): level 0 is the
// last fed token (one row a sequence), level d > 0 expands kWidth children of the previous
// level's first node (kWidth rows a sequence), as a drafter's levels grow a tree. Fixed tokens,
// so that every pass lays out the same steps. With `logits`, each level runs Forward() and
// its rows are appended; else ForwardTopK(k) and its rows go to `tops`. The scratch region is
// dropped at the end, so the next pass starts from the same state.
void RunLevels(Backend* model, int k, std::vector<TopKRows>* tops,
               std::vector<std::vector<float>>* logits) {
  std::vector<int32_t> scratch(kSeqs, 0);      // scratch nodes appended per sequence
  std::vector<int32_t> first_prev(kSeqs, -1);  // first node of the previous level
  for (int d = 0; d < kDepth; ++d) {
    std::vector<ForwardItem> items(kSeqs);
    for (int s = 0; s < kSeqs; ++s) {
      ForwardItem& it = items[s];
      it.seq = s + 1;
      const int width = d == 0 ? 1 : kWidth;
      for (int j = 0; j < width; ++j) {
        it.tokens.push_back(100 + 37 * d + 11 * j + 5 * s);
        it.parents.push_back(d == 0 ? -1 : first_prev[s]);
        it.logit_rows.push_back(j);
      }
      first_prev[s] = scratch[s];
      scratch[s] += width;
    }
    if (logits != nullptr) {
      std::vector<float>& rows = logits->emplace_back();
      ASSERT_TRUE(model->Forward(items, &rows).ok()) << "level " << d;
    } else {
      TopKRows& top = tops->emplace_back();
      const absl::Status s = model->ForwardTopK(items, k, &top);
      ASSERT_TRUE(s.ok()) << "level " << d << ": " << s;
      ASSERT_EQ(top.rows(), kSeqs * (d == 0 ? 1 : kWidth)) << "level " << d;
    }
  }
  for (int s = 0; s < kSeqs; ++s) ASSERT_TRUE(model->Commit(s + 1, {}).ok());
}

void AddSequences(Backend* model) {
  for (int s = 0; s < kSeqs; ++s) {
    ForwardItem prompt{s + 1, {}, {}, {}};
    for (int i = 0; i < 20 + 9 * s; ++i) {
      prompt.tokens.push_back(50 + (13 * i + 7 * s) % 4000);
      prompt.parents.push_back(i - 1);
    }
    std::vector<int32_t> path(prompt.tokens.size());
    for (size_t i = 0; i < path.size(); ++i) path[i] = static_cast<int32_t>(i);
    ASSERT_TRUE(model->AddSequence(s + 1).ok());
    std::vector<float> unused;
    ASSERT_TRUE(model->Forward({prompt}, &unused).ok());
    ASSERT_TRUE(model->Commit(s + 1, path).ok());
  }
}

void ExpectBitEqual(const std::vector<TopKRows>& got, const std::vector<TopKRows>& want,
                    const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t d = 0; d < want.size(); ++d) {
    EXPECT_EQ(got[d].k, want[d].k) << what << " level " << d;
    EXPECT_EQ(got[d].ids, want[d].ids) << what << " level " << d;
    ASSERT_EQ(got[d].logprobs.size(), want[d].logprobs.size()) << what << " level " << d;
    for (size_t i = 0; i < want[d].logprobs.size(); ++i) {
      EXPECT_EQ(absl::bit_cast<uint32_t>(got[d].logprobs[i]),
                absl::bit_cast<uint32_t>(want[d].logprobs[i]))
          << what << " level " << d << " entry " << i;
    }
  }
}

// Each level's top-k against the host top-k of that level's Forward() rows.
void ExpectHostTopK(const std::vector<TopKRows>& tops,
                    const std::vector<std::vector<float>>& logits, int vocab,
                    const std::string& what) {
  ASSERT_EQ(tops.size(), logits.size()) << what;
  for (size_t d = 0; d < tops.size(); ++d) {
    const int k = tops[d].k;
    const int64_t rows = static_cast<int64_t>(logits[d].size()) / vocab;
    ASSERT_EQ(tops[d].rows(), rows) << what << " level " << d;
    std::vector<int32_t> ids(k);
    std::vector<float> lps(k);
    for (int64_t r = 0; r < rows; ++r) {
      RowTopKLogprobs(absl::Span<const float>(logits[d]).subspan(r * vocab, vocab), k, ids.data(),
                      lps.data());
      for (int j = 0; j < k; ++j) {
        EXPECT_EQ(tops[d].ids[r * k + j], ids[j]) << what << " level " << d << " row " << r;
        EXPECT_NEAR(
            tops[d].logprobs[r * k + j], lps[j],
            2.0f * std::numeric_limits<float>::epsilon() * std::max(1.0f, std::fabs(lps[j])))
            << what << " level " << d << " row " << r;
      }
    }
  }
}

class CudaDraftLevelTest : public gpu_test::GpuTest {};

std::unique_ptr<CudaBackend> LoadCuda(bool graphs) {
  BackendOptions opts;
  opts.device = "cuda:0";
  opts.kv_capacity_tokens = 8192;
  opts.cuda_graphs = graphs;
  absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create(DraftDir(), 0, opts);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

TEST_F(CudaDraftLevelTest, OneGraphPerLevelMatchesEagerAndTheHostTopK) {
  std::unique_ptr<CudaBackend> graphs = LoadCuda(true), eager = LoadCuda(false);
  ASSERT_TRUE(graphs && eager);
  ASSERT_TRUE(graphs->graphs_enabled());
  AddSequences(graphs.get());
  AddSequences(eager.get());
  const int vocab = graphs->config().vocab_size;
  for (int k : {1, 4, kMaxForwardTopK}) {
    SCOPED_TRACE(k);
    // Passes 1 and 2 use each level's bucket for the first and second time (eager, then
    // captured); from pass 3 on every level replays its graph.
    std::vector<TopKRows> pass[4];
    for (int p = 0; p < 3; ++p) RunLevels(graphs.get(), k, &pass[p], nullptr);
    const Backend::ExecutionCounts before = graphs->execution_counts();
    RunLevels(graphs.get(), k, &pass[3], nullptr);
    const Backend::ExecutionCounts after = graphs->execution_counts();
    EXPECT_EQ(after.graph_replays - before.graph_replays, kDepth);
    EXPECT_EQ(after.graph_captures, before.graph_captures);
    EXPECT_EQ(after.eager_steps, before.eager_steps);
    for (int p = 0; p < 3; ++p) ExpectBitEqual(pass[p], pass[3], "pass " + std::to_string(p));

    std::vector<TopKRows> unpadded;
    RunLevels(eager.get(), k, &unpadded, nullptr);
    EXPECT_EQ(eager->execution_counts().graph_replays, 0);
    ExpectBitEqual(unpadded, pass[3], "graphs off");

    std::vector<std::vector<float>> logits;
    RunLevels(graphs.get(), k, nullptr, &logits);
    ExpectHostTopK(pass[3], logits, vocab, "graphs on");
  }
}

// Bad calls leave the sequences as they were, graphs or not.
TEST_F(CudaDraftLevelTest, BadCallsFailWithoutChangingState) {
  std::unique_ptr<CudaBackend> model = LoadCuda(true);
  ASSERT_TRUE(model);
  AddSequences(model.get());
  TopKRows out;
  const std::vector<ForwardItem> items = {ForwardItem{1, {5, 6}, {-1, 0}, {0, 1}}};
  for (int k : {0, kMaxForwardTopK + 1}) {
    EXPECT_EQ(model->ForwardTopK(items, k, &out).code(), absl::StatusCode::kInvalidArgument);
  }
  const KvUsage usage = model->Usage();
  std::vector<ForwardItem> bad = items;
  bad.push_back(ForwardItem{2, {model->config().vocab_size}, {-1}, {0}});
  EXPECT_EQ(model->ForwardTopK(bad, 2, &out).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model->Usage().used_tokens, usage.used_tokens);
  for (int s = 0; s < kSeqs; ++s) EXPECT_EQ(*model->CommittedLength(s + 1), 20 + 9 * s);
  // The same items then run.
  EXPECT_TRUE(model->ForwardTopK(items, 2, &out).ok());
  EXPECT_EQ(out.rows(), 2);
}

// ---------------------------------------------------------------------------------------------
// The tensor-parallel group: rank 0 ranks the gathered rows.

class CudaTpDraftLevelTest : public gpu_test::GpuTest {
 protected:
  void SetUp() override {
    gpu_test::GpuTest::SetUp();
    if (IsSkipped()) return;
    int n = 0;
    cudaGetDeviceCount(&n);
    if (n < 2) GTEST_SKIP() << "tensor parallelism needs two GPUs; this host has " << n;
  }
};

TEST_F(CudaTpDraftLevelTest, RankZeroRanksTheGatheredRows) {
  BackendOptions opts;
  opts.device = "cuda:0";
  opts.tensor_parallel = 2;
  opts.kv_capacity_tokens = 8192;
  absl::StatusOr<std::unique_ptr<Backend>> loaded = CreateBackend(DraftDir(), opts);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  Backend* model = loaded->get();
  AddSequences(model);
  const int vocab = model->config().vocab_size;
  for (int k : {1, 4, kMaxForwardTopK}) {
    SCOPED_TRACE(k);
    std::vector<TopKRows> pass[4];
    for (int p = 0; p < 3; ++p) RunLevels(model, k, &pass[p], nullptr);
    const Backend::ExecutionCounts before = model->execution_counts();
    RunLevels(model, k, &pass[3], nullptr);
    const Backend::ExecutionCounts after = model->execution_counts();
    EXPECT_EQ(after.graph_replays - before.graph_replays, kDepth);
    EXPECT_EQ(after.eager_steps, before.eager_steps);
    for (int p = 0; p < 3; ++p) ExpectBitEqual(pass[p], pass[3], "pass " + std::to_string(p));
    std::vector<std::vector<float>> logits;
    RunLevels(model, k, nullptr, &logits);
    ExpectHostTopK(pass[3], logits, vocab, "tp 2");
  }
}

// The drafter's trees over the group: from the ranks' device top-k (backend_topk) equal to
// those from the group's full rows and a host top-k, on the same backend.
TEST_F(CudaTpDraftLevelTest, DrafterTreesMatchTheHostPath) {
  BackendOptions opts;
  opts.device = "cuda:0";
  opts.tensor_parallel = 2;
  opts.kv_capacity_tokens = 8192;
  absl::StatusOr<std::unique_ptr<Backend>> loaded = CreateBackend(DraftDir(), opts);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  DraftModelDrafter device(loaded->get(), {true, true}), host(loaded->get(), {false, true});
  std::vector<DraftRequest> on_device, on_host;
  for (int s = 0; s < 8; ++s) {
    DraftRequest r;
    r.seq = s + 1;
    for (int i = 0; i < 5 + s; ++i) r.new_tokens.push_back(100 + 13 * i + s);
    r.params = {4, 1 + s % 4, 4 + 3 * s};
    on_device.push_back(r);
    ASSERT_TRUE(device.AddSequence(r.seq).ok());
    r.seq += 100;
    on_host.push_back(r);
    ASSERT_TRUE(host.AddSequence(r.seq).ok());
  }
  for (int step = 0; step < 3; ++step) {
    absl::StatusOr<std::vector<TokenTree>> got = device.Draft(on_device);
    absl::StatusOr<std::vector<TokenTree>> want = host.Draft(on_host);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(want.ok()) << want.status();
    for (size_t i = 0; i < on_device.size(); ++i) {
      EXPECT_EQ((*got)[i].tokens, (*want)[i].tokens) << "step " << step << " seq " << i;
      EXPECT_EQ((*got)[i].parents, (*want)[i].parents) << "step " << step << " seq " << i;
      // The next step: the first root child accepted, then a bonus token.
      const int32_t node = (*want)[i].tokens.empty() ? -1 : 0;
      std::vector<int32_t> next;
      if (node == 0) next.push_back((*want)[i].tokens[0]);
      next.push_back(200 + 17 * step + static_cast<int32_t>(i));
      on_device[i].new_tokens = on_host[i].new_tokens = next;
      on_device[i].accepted_node = on_host[i].accepted_node = node;
    }
  }
}

}  // namespace
}  // namespace specd
