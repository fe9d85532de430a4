// CUDA graphs in the CUDA backend: a backend that pads decode and verify steps
// to buckets and replays captured graphs gives bit-identical logits and verify
// outcomes to one that runs every step eagerly and unpadded, over many steps
// whose batch composition, tree shapes, sampling parameters and context lengths
// (past the attention's key-range split) keep changing.
#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_tuning.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

std::unique_ptr<CudaBackend> Load(const std::string& dir, bool graphs) {
  BackendOptions opts;
  opts.device = "cuda:0";
  opts.kv_capacity_tokens = 1 << 16;
  opts.cuda_graphs = graphs;
  absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create(dir, 0, opts);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

// A random tree of n nodes: many children of the committed end (so that some
// are accepted, exercising acceptance and KV compaction), chains and bushes
// below them.
TokenTree RandomTree(int n, int vocab, std::mt19937_64& rng) {
  TokenTree t;
  std::uniform_int_distribution<int32_t> tok(0, vocab - 1);
  for (int i = 0; i < n; ++i) {
    int32_t parent = -1;
    if (i > 0 && rng() % 3 != 0) parent = static_cast<int32_t>(rng() % i);
    if (i > 0 && rng() % 4 == 0) parent = i - 1;  // chains
    t.parents.push_back(parent);
    t.tokens.push_back(tok(rng));
  }
  return t;
}

class CudaGraphTest : public gpu_test::GpuTest {};

TEST_F(CudaGraphTest, GraphsAreBitIdenticalToEagerSteps) {
  if (!CudaTuningFromEnvironment().cuda_graphs) {
    GTEST_SKIP() << "SPECD_CUDA_GRAPHS=0 turns graphs off";
  }
  const std::string dir = MakeTempDir("cuda_graph_test");
  RandomCheckpointSpec spec;
  spec.vocab_size = 320;
  spec.hidden_size = 256;
  spec.intermediate_size = 512;
  spec.num_layers = 2;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.init_std = 0.15f;
  spec.max_position_embeddings = 8192;
  spec.seed = 7;
  ASSERT_TRUE(WriteRandomCheckpoint(dir, spec).ok());
  std::unique_ptr<CudaBackend> eager = Load(dir, false), graphs = Load(dir, true);
  ASSERT_NE(eager, nullptr);
  ASSERT_NE(graphs, nullptr);
  ASSERT_FALSE(eager->graphs_enabled());
  ASSERT_TRUE(graphs->graphs_enabled());
  const int vocab = spec.vocab_size;

  std::mt19937_64 rng(11);
  struct Live {
    SeqId id;
    std::vector<int32_t> pending;
  };
  std::vector<Live> live;
  SeqId next = 1;
  const auto add = [&](int prompt_len) {
    Live l{next++, {}};
    std::uniform_int_distribution<int32_t> tok(0, vocab - 1);
    for (int i = 0; i < prompt_len; ++i) l.pending.push_back(tok(rng));
    ASSERT_TRUE(eager->AddSequence(l.id).ok());
    ASSERT_TRUE(graphs->AddSequence(l.id).ok());
    live.push_back(l);
  };
  for (int i = 0; i < 5; ++i) add(1 + static_cast<int>(rng() % 40));

  const int kTreeSizes[] = {0, 1, 2, 3, 7, 8, 16, 31, 64, 100, 128, 200, 255};
  int64_t accepted_total = 0;
  for (int step = 0; step < 80; ++step) {
    // Retire long sequences and start new ones, so the batch keeps changing.
    for (size_t i = 0; i < live.size();) {
      absl::StatusOr<int64_t> len = eager->CommittedLength(live[i].id);
      ASSERT_TRUE(len.ok());
      if (*len > 3000 || rng() % 25 == 0) {
        ASSERT_TRUE(eager->RemoveSequence(live[i].id).ok());
        ASSERT_TRUE(graphs->RemoveSequence(live[i].id).ok());
        live.erase(live.begin() + i);
      } else {
        ++i;
      }
    }
    while (live.size() < 2 || (live.size() < 9 && rng() % 3 == 0)) add(1 + rng() % 30);
    // A random subset, in a random order.
    std::vector<size_t> pick(live.size());
    for (size_t i = 0; i < pick.size(); ++i) pick[i] = i;
    std::shuffle(pick.begin(), pick.end(), rng);
    pick.resize(1 + rng() % pick.size());

    if (step % 5 == 4) {
      // A decode step through Forward(): logits must match bit for bit.
      std::vector<ForwardItem> items;
      for (size_t i : pick) {
        ForwardItem it;
        it.seq = live[i].id;
        it.tokens = live[i].pending;
        for (size_t j = 0; j < it.tokens.size(); ++j) {
          it.parents.push_back(static_cast<int32_t>(j) - 1);
        }
        it.logit_rows = {static_cast<int32_t>(it.tokens.size()) - 1};
        items.push_back(it);
      }
      std::vector<float> a, b;
      ASSERT_TRUE(eager->Forward(items, &a).ok());
      ASSERT_TRUE(graphs->Forward(items, &b).ok());
      ASSERT_EQ(a.size(), b.size());
      ASSERT_TRUE(std::equal(a.begin(), a.end(), b.begin())) << "step " << step;
      for (size_t k = 0; k < pick.size(); ++k) {
        Live& l = live[pick[k]];
        std::vector<int32_t> path(l.pending.size());
        for (size_t j = 0; j < path.size(); ++j) path[j] = static_cast<int32_t>(j);
        ASSERT_TRUE(eager->Commit(l.id, path).ok());
        ASSERT_TRUE(graphs->Commit(l.id, path).ok());
        const float* row = a.data() + k * vocab;
        l.pending = {static_cast<int32_t>(std::max_element(row, row + vocab) - row)};
      }
      continue;
    }
    std::vector<VerifyItem> items;
    for (size_t i : pick) {
      VerifyItem it;
      it.seq = live[i].id;
      it.pending = live[i].pending;
      it.tree = RandomTree(kTreeSizes[rng() % std::size(kTreeSizes)], vocab, rng);
      if (rng() % 2 == 0) {
        it.sampling.temperature = 0.7f + 0.1f * static_cast<float>(rng() % 5);
        it.sampling.top_k = static_cast<int>(rng() % 3) * 20;
        it.sampling.top_p = rng() % 2 ? 1.0f : 0.9f;
        it.sampling.seed = rng();
      }
      items.push_back(it);
    }
    absl::StatusOr<std::vector<VerifyOutcome>> a = eager->Verify(items);
    absl::StatusOr<std::vector<VerifyOutcome>> b = graphs->Verify(items);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(a->size(), b->size());
    for (size_t k = 0; k < a->size(); ++k) {
      ASSERT_EQ((*a)[k].tokens, (*b)[k].tokens) << "step " << step << " item " << k;
      ASSERT_EQ((*a)[k].accepted_nodes, (*b)[k].accepted_nodes) << "step " << step;
      live[pick[k]].pending = {(*a)[k].tokens.back()};
      accepted_total += (*a)[k].accepted_draft;
      ASSERT_EQ(eager->CommittedLength(items[k].seq).value(),
                graphs->CommittedLength(items[k].seq).value());
    }
  }
  // The comparison above means something only if graphs ran and trees were
  // accepted into.
  EXPECT_GT(graphs->graphs_captured(), 0);
  EXPECT_GT(graphs->graph_launches(), 10);
  EXPECT_EQ(eager->graph_launches(), 0);
  EXPECT_GT(accepted_total, 0);
  std::printf("graphs captured %lld, graph launches %lld, accepted draft tokens %lld\n",
              static_cast<long long>(graphs->graphs_captured()),
              static_cast<long long>(graphs->graph_launches()),
              static_cast<long long>(accepted_total));
}

// The step buffers are sized at start for the warmed row classes (ReservedStepShape), and the
// top-k buffer outside the captured launches grows without touching the graphs: forwards and
// top-k calls of up to kDefaultGemmInvariantRows rows between decode steps leave the decode
// step's graph captured once and replayed, where buffers grown on demand used to drop it.
TEST_F(CudaGraphTest, ForwardsUpToTheReservedRowsKeepTheGraphs) {
  if (!CudaTuningFromEnvironment().cuda_graphs) {
    GTEST_SKIP() << "SPECD_CUDA_GRAPHS=0 turns graphs off";
  }
  const std::string dir = MakeTempDir("cuda_graph_reserve_test");
  RandomCheckpointSpec spec;
  spec.vocab_size = 320;
  spec.hidden_size = 256;
  spec.intermediate_size = 512;
  spec.num_layers = 2;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.init_std = 0.15f;
  spec.max_position_embeddings = 4096;
  spec.seed = 29;
  ASSERT_TRUE(WriteRandomCheckpoint(dir, spec).ok());
  std::unique_ptr<CudaBackend> backend = Load(dir, true);
  ASSERT_NE(backend, nullptr);
  ASSERT_TRUE(backend->graphs_enabled());
  ASSERT_TRUE(backend->AddSequence(1).ok());
  int32_t next = 7;
  auto decode = [&](int steps) {
    for (int i = 0; i < steps; ++i) {
      VerifyItem item;
      item.seq = 1;
      item.pending = {next};
      absl::StatusOr<std::vector<VerifyOutcome>> v = backend->Verify({item});
      ASSERT_TRUE(v.ok()) << v.status();
      next = (*v)[0].tokens.back();
    }
  };
  decode(4);
  const Backend::ExecutionCounts before = backend->execution_counts();
  ASSERT_GE(before.graph_captures, 1);
  ASSERT_GE(before.graph_replays, 1);
  std::mt19937 rng(5);
  for (int64_t rows : {int64_t{300}, int64_t{700}, kDefaultGemmInvariantRows}) {
    SCOPED_TRACE(rows);
    ForwardItem item;
    item.seq = 2;
    for (int64_t t = 0; t < rows; ++t) {
      item.tokens.push_back(static_cast<int32_t>(rng() % spec.vocab_size));
      item.parents.push_back(static_cast<int32_t>(t) - 1);
      item.logit_rows.push_back(static_cast<int32_t>(t));
    }
    ASSERT_TRUE(backend->AddSequence(2).ok());
    TopKRows top;
    ASSERT_TRUE(backend->ForwardTopK({item}, kMaxForwardTopK, &top).ok());
    EXPECT_EQ(top.rows(), rows);
    ASSERT_TRUE(backend->RemoveSequence(2).ok());
    ASSERT_TRUE(backend->AddSequence(2).ok());
    std::vector<float> logits;
    ASSERT_TRUE(backend->Forward({item}, &logits).ok());
    ASSERT_TRUE(backend->RemoveSequence(2).ok());
    decode(2);
  }
  const Backend::ExecutionCounts after = backend->execution_counts();
  EXPECT_EQ(after.graph_captures, before.graph_captures) << "a decode graph was captured again";
  EXPECT_GE(after.graph_replays, before.graph_replays + 6);
}

}  // namespace
}  // namespace specd
