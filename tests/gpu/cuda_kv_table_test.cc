// The CUDA backends keep their sequences in engine/kv/PagedKvTable, as the CPU backend does: one
// GPU, and a tensor-parallel group of two (one table for both ranks). A script of good and bad
// calls gets the same statuses (code and message), KV usage and committed lengths from each CUDA
// backend as from the CPU backend on the same checkpoint; what only the CUDA backends refuse (a
// tree wider than the attention mask, a Verify() over uncommitted scratch nodes) is refused
// without changing anything.
#include <cuda_runtime.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "gmock/gmock.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kCapacity = 512;  // tokens: 32 blocks

class CudaKvTableTest : public gpu_test::GpuTest, public ::testing::WithParamInterface<int> {
 protected:
  void SetUp() override {
    gpu_test::GpuTest::SetUp();
    if (IsSkipped()) return;
    int n = 0;
    cudaGetDeviceCount(&n);
    if (n < GetParam()) GTEST_SKIP() << GetParam() << " GPUs needed; this host has " << n;
    dir_ = MakeTempDir("cuda_kv_table_");
    RandomCheckpointSpec spec;
    spec.vocab_size = 320;
    spec.hidden_size = 128;
    spec.intermediate_size = 256;
    spec.num_layers = 2;
    spec.num_heads = 4;
    spec.num_kv_heads = 2;
    spec.head_dim = 32;
    spec.max_position_embeddings = 4096;
    spec.dtype = DType::kBF16;
    ASSERT_TRUE(WriteRandomCheckpoint(dir_, spec).ok());
    cpu_ = Load("cpu", 1);
    gpu_ = Load("cuda:0", GetParam());
    ASSERT_NE(cpu_, nullptr);
    ASSERT_NE(gpu_, nullptr);
  }

  std::unique_ptr<Backend> Load(const std::string& device, int tp) {
    BackendOptions opts;
    opts.device = device;
    opts.tensor_parallel = tp;
    opts.kv_capacity_tokens = kCapacity;
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir_, opts);
    EXPECT_TRUE(b.ok()) << device << " tp " << tp << ": " << b.status();
    return b.ok() ? std::move(*b) : nullptr;
  }

  // The same call on both backends: equal statuses, usage and, for `seqs`, committed lengths.
  void Both(const std::string& what, const std::function<absl::Status(Backend&)>& call,
            const std::vector<SeqId>& seqs = {}) {
    SCOPED_TRACE(what);
    const absl::Status want = call(*cpu_);
    const absl::Status got = call(*gpu_);
    EXPECT_EQ(got, want);
    EXPECT_EQ(gpu_->Usage().used_tokens, cpu_->Usage().used_tokens);
    EXPECT_EQ(gpu_->Usage().capacity_tokens, cpu_->Usage().capacity_tokens);
    EXPECT_EQ(gpu_->Usage().sequences, cpu_->Usage().sequences);
    for (SeqId s : seqs) {
      EXPECT_EQ(gpu_->HasSequence(s), cpu_->HasSequence(s)) << s;
      EXPECT_EQ(gpu_->CommittedLength(s).status(), cpu_->CommittedLength(s).status()) << s;
      if (cpu_->CommittedLength(s).ok()) {
        EXPECT_EQ(*gpu_->CommittedLength(s), *cpu_->CommittedLength(s)) << s;
      }
    }
  }
  absl::Status Forward(Backend& b, const std::vector<ForwardItem>& items) {
    std::vector<float> logits;
    return b.Forward(items, &logits);
  }

  std::string dir_;
  std::unique_ptr<Backend> cpu_, gpu_;
};

ForwardItem Item(SeqId seq, std::vector<int32_t> tokens, std::vector<int32_t> parents,
                 std::vector<int32_t> rows = {}) {
  ForwardItem f;
  f.seq = seq;
  f.tokens = std::move(tokens);
  f.parents = std::move(parents);
  f.logit_rows = std::move(rows);
  return f;
}

ForwardItem ChainItem(SeqId seq, int n) {
  ForwardItem f;
  f.seq = seq;
  for (int j = 0; j < n; ++j) {
    f.tokens.push_back(10 + j % 300);
    f.parents.push_back(j - 1);
  }
  f.logit_rows = {n - 1};
  return f;
}

TEST_P(CudaKvTableTest, SequencesAndErrorsAsOnTheCpu) {
  const std::vector<SeqId> seqs = {1, 2, 3};
  Both(
      "add", [](Backend& b) { return b.AddSequence(1); }, seqs);
  Both(
      "add twice", [](Backend& b) { return b.AddSequence(1); }, seqs);
  Both(
      "remove unknown", [](Backend& b) { return b.RemoveSequence(2); }, seqs);
  Both(
      "forward unknown", [&](Backend& b) { return Forward(b, {ChainItem(2, 3)}); }, seqs);
  Both(
      "empty item", [&](Backend& b) { return Forward(b, {Item(1, {}, {})}); }, seqs);
  Both(
      "parents count",
      [&](Backend& b) {
        return Forward(b, {Item(1, {1, 2}, {-1})});
      },
      seqs);
  Both(
      "token outside the vocabulary",
      [&](Backend& b) {
        return Forward(b, {Item(1, {1, 320}, {-1, 0})});
      },
      seqs);
  Both(
      "later parent",
      [&](Backend& b) {
        return Forward(b, {Item(1, {1, 2}, {-1, 1})});
      },
      seqs);
  Both(
      "logit row", [&](Backend& b) { return Forward(b, {Item(1, {1}, {-1}, {1})}); }, seqs);
  Both(
      "seq twice",
      [&](Backend& b) {
        return Forward(b, {ChainItem(1, 2), ChainItem(1, 2)});
      },
      seqs);
  // A prefill, a commit path that is not a chain, then its commit.
  Both(
      "prefill", [&](Backend& b) { return Forward(b, {ChainItem(1, 21)}); }, seqs);
  Both(
      "bad path",
      [](Backend& b) {
        return b.Commit(1, {0, 2});
      },
      seqs);
  Both(
      "path beyond scratch",
      [](Backend& b) {
        return b.Commit(1, {0, 1, 21});
      },
      seqs);
  std::vector<int32_t> all(21);
  for (int j = 0; j < 21; ++j) all[j] = j;
  Both(
      "commit prefill", [&](Backend& b) { return b.Commit(1, all); }, seqs);
  // A tree, and the commit of one of its paths.
  Both(
      "tree",
      [&](Backend& b) {
        return Forward(b, {Item(1, {5, 6, 7, 8, 9}, {-1, 0, 0, 1, 2}, {0, 1, 2, 3, 4})});
      },
      seqs);
  Both(
      "commit tree path",
      [](Backend& b) {
        return b.Commit(1, {0, 2, 4});
      },
      seqs);
  // Capacity: 32 blocks of 16 slots; sequence 1 holds 2.
  Both(
      "add 2", [](Backend& b) { return b.AddSequence(2); }, seqs);
  Both(
      "too long", [&](Backend& b) { return Forward(b, {ChainItem(2, 600)}); }, seqs);
  Both(
      "fills the cache", [&](Backend& b) { return Forward(b, {ChainItem(2, 480)}); }, seqs);
  Both(
      "add 3 when full", [](Backend& b) { return b.AddSequence(3); }, seqs);
  Both(
      "drop the scratch", [](Backend& b) { return b.Commit(2, {}); }, seqs);
  Both(
      "add 3", [](Backend& b) { return b.AddSequence(3); }, seqs);
  Both(
      "batch",
      [&](Backend& b) {
        return Forward(b, {ChainItem(3, 40), ChainItem(2, 17)});
      },
      seqs);
  Both(
      "remove", [](Backend& b) { return b.RemoveSequence(3); }, seqs);
}

TEST_P(CudaKvTableTest, RefusalsOfTheCudaBackendChangeNothing) {
  ASSERT_TRUE(gpu_->AddSequence(1).ok());
  ASSERT_TRUE(Forward(*gpu_, {ChainItem(1, 4)}).ok());
  ASSERT_TRUE(gpu_->Commit(1, {0, 1, 2, 3}).ok());
  // A star of 300 children under one node: the children past the 256-bit mask are refused.
  ForwardItem star;
  star.seq = 1;
  star.tokens.assign(301, 3);
  star.parents.assign(301, 0);
  star.parents[0] = -1;
  star.logit_rows = {0};
  const KvUsage before = gpu_->Usage();
  const absl::Status wide = Forward(*gpu_, {star});
  EXPECT_EQ(wide.code(), absl::StatusCode::kUnimplemented) << wide;
  EXPECT_THAT(wide.message(), HasSubstr("masks at most 256"));
  EXPECT_EQ(gpu_->Usage().used_tokens, before.used_tokens);
  // The CPU backend has no mask: the same step runs there.
  ASSERT_TRUE(cpu_->AddSequence(1).ok());
  ASSERT_TRUE(Forward(*cpu_, {ChainItem(1, 4)}).ok());
  ASSERT_TRUE(cpu_->Commit(1, {0, 1, 2, 3}).ok());
  EXPECT_TRUE(Forward(*cpu_, {star}).ok());
  // Verify over uncommitted scratch nodes.
  ASSERT_TRUE(Forward(*gpu_, {ChainItem(1, 2)}).ok());
  VerifyItem item;
  item.seq = 1;
  item.pending = {4};
  absl::StatusOr<std::vector<VerifyOutcome>> v = gpu_->Verify({item});
  EXPECT_EQ(v.status().code(), absl::StatusCode::kFailedPrecondition) << v.status();
  EXPECT_EQ(gpu_->Usage().used_tokens, before.used_tokens + 2);
  // Once committed, the same verify step runs and commits its pending token and bonus path.
  ASSERT_TRUE(gpu_->Commit(1, {}).ok());
  v = gpu_->Verify({item});
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*gpu_->CommittedLength(1), 5);
}

INSTANTIATE_TEST_SUITE_P(OneGpuAndTwo, CudaKvTableTest, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return info.param == 1 ? std::string("OneGpu")
                                                  : std::string("TensorParallel2");
                         });

}  // namespace
}  // namespace specd
