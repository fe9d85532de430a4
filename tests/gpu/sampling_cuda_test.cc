// GPU sampling and tree acceptance against engine/sampling.cc SampleToken and
// engine/backend.cc AcceptTree: the same fp32 logits and seeds must give the same tokens, and
// the same accepted paths, exactly.
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "absl/types/span.h"
#include "common/token_tree.h"
#include "engine/backend.h"
#include "engine/sampling.h"
#include "engine/tp/tp_plan.h"
#include "specd/kernels/cuda/sampling.h"
#include "specd/kernels/cuda/tree_accept.h"
#include "tests/gpu/gpu_test_util.h"

namespace specd {
namespace {

using gpu_test::DeviceBuffer;

class SamplingCudaTest : public gpu_test::GpuTest {
 protected:
  // Samples every row on the GPU; `split`: with a workspace, so that greedy and unfiltered rows
  // take the split-vocabulary path (the workspace is filled with garbage first: the launch must
  // not depend on its contents).
  std::vector<int32_t> SampleOnGpu(const std::vector<float>& logits, int vocab,
                                   const std::vector<cuda::SampleRowParams>& rows, bool split) {
    DeviceBuffer<float> d_logits(logits);
    DeviceBuffer<cuda::SampleRowParams> d_rows(rows);
    DeviceBuffer<int32_t> d_tokens(rows.size());
    const int64_t ws_bytes = cuda::SampleWorkspaceBytes(static_cast<int64_t>(rows.size()), vocab);
    DeviceBuffer<uint8_t> d_ws(split ? static_cast<size_t>(ws_bytes) : 0);
    if (split) {
      EXPECT_GT(ws_bytes, 0);
      EXPECT_EQ(cudaMemset(d_ws.get(), 0xa5, static_cast<size_t>(ws_bytes)), cudaSuccess);
    }
    cuda::SampleParams p;
    p.logits = d_logits.get();
    p.logits_stride = vocab;
    p.rows = d_rows.get();
    p.tokens = d_tokens.get();
    p.num_rows = static_cast<int64_t>(rows.size());
    p.vocab_size = vocab;
    p.workspace = split ? d_ws.get() : nullptr;
    EXPECT_EQ(cuda::SampleCuda(p, stream_), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return d_tokens.Download();
  }
};

cuda::SampleRowParams RowParams(const SamplingParams& s, int64_t position) {
  cuda::SampleRowParams r;
  r.seed = s.seed;
  r.position = position;
  r.temperature = s.temperature;
  r.top_p = s.top_p;
  r.top_k = s.top_k;
  r.min_p = s.min_p;
  return r;
}

// Logits of three kinds: smooth Gaussian, peaked, and coarsely quantised (many exact ties, so
// the lowest-id tie rules are exercised).
std::vector<float> MakeLogits(int rows, int vocab, std::mt19937_64& rng) {
  std::vector<float> logits(static_cast<size_t>(rows) * vocab);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int r = 0; r < rows; ++r) {
    float* row = &logits[static_cast<size_t>(r) * vocab];
    const int kind = r % 3;
    for (int i = 0; i < vocab; ++i) {
      float x = normal(rng);
      if (kind == 1) x *= 4.0f;
      if (kind == 2) x = std::round(x * 2.0f) * 0.5f;
      row[i] = x;
    }
  }
  return logits;
}

TEST_F(SamplingCudaTest, TokensMatchHostSampler) {
  std::mt19937_64 rng(31);
  // Parameter sets: greedy, plain temperature, top-k, top-p, both, min-p alone and with the
  // others (min-p first, so top-k may find fewer than k left), and extremes.
  std::vector<SamplingParams> settings;
  auto add = [&](float t, int k, float p, float min_p = 0.0f) {
    SamplingParams s;
    s.temperature = t;
    s.top_k = k;
    s.top_p = p;
    s.min_p = min_p;
    settings.push_back(s);
  };
  add(0.0f, 0, 1.0f);
  add(1.0f, 0, 1.0f);
  add(0.7f, 0, 1.0f);
  add(1.0f, 50, 1.0f);
  add(1.3f, 1, 1.0f);
  add(1.0f, 0, 0.83f);
  add(0.8f, 40, 0.61f);
  add(0.05f, 0, 1.0f);
  add(5.0f, 0, 0.97f);
  add(1.0f, 0, 0.013f);
  add(2.0f, 1000, 1.0f);
  add(1.0f, 0, 1.0f, 0.05f);
  add(0.7f, 0, 1.0f, 0.3f);
  add(1.0f, 40, 1.0f, 0.02f);
  add(1.0f, 0, 0.9f, 0.1f);
  add(0.9f, 60, 0.8f, 0.01f);
  add(0.0f, 0, 1.0f, 0.5f);  // greedy ignores min-p
  add(1.0f, 0, 1.0f, 1.0f);  // only the argmax (and its ties) survive
  for (int vocab : {320, 50257, 128256}) {
    const int rows = vocab > 100000 ? 66 : 132;
    const std::vector<float> logits = MakeLogits(rows, vocab, rng);
    std::vector<cuda::SampleRowParams> params;
    std::vector<int32_t> want;
    std::uniform_int_distribution<int64_t> position(0, 100000);
    for (int r = 0; r < rows; ++r) {
      SamplingParams s = settings[r % settings.size()];
      s.seed = rng();
      const int64_t pos = position(rng);
      params.push_back(RowParams(s, pos));
      want.push_back(SampleToken(absl::Span<const float>(&logits[static_cast<size_t>(r) * vocab],
                                                         static_cast<size_t>(vocab)),
                                 s, pos));
    }
    for (bool split : {false, true}) {
      const std::vector<int32_t> got = SampleOnGpu(logits, vocab, params, split);
      ASSERT_EQ(got.size(), want.size());
      int mismatches = 0;
      for (int r = 0; r < rows; ++r) {
        if (got[r] != want[r] && ++mismatches <= 5) {
          const cuda::SampleRowParams& p = params[r];
          ADD_FAILURE() << "vocab " << vocab << " split " << split << " row " << r << " (t "
                        << p.temperature << " k " << p.top_k << " p " << p.top_p << " min_p "
                        << p.min_p << "): gpu " << got[r] << " host " << want[r];
        }
      }
      EXPECT_EQ(mismatches, 0) << "vocab " << vocab << " split " << split;
    }
  }
}

// A row whose top logits are tied: greedy picks the lowest id, and top-k keeps the lowest ids.
TEST_F(SamplingCudaTest, TiesFollowTheHostOrder) {
  const int vocab = 1000;
  std::vector<float> logits(3 * vocab, -5.0f);
  for (int r = 0; r < 3; ++r) {
    for (int id : {700, 12, 999, 300}) logits[static_cast<size_t>(r) * vocab + id] = 2.0f;
  }
  std::vector<cuda::SampleRowParams> params(3);
  params[0].temperature = 0.0f;
  params[1].temperature = 1.0f;
  params[1].top_k = 2;
  params[1].seed = 7;
  params[2].temperature = 1.0f;
  params[2].top_p = 0.3f;
  params[2].seed = 9;
  for (bool split : {false, true}) {
    const std::vector<int32_t> got = SampleOnGpu(logits, vocab, params, split);
    for (int r = 0; r < 3; ++r) {
      SamplingParams s;
      s.temperature = params[r].temperature;
      s.top_k = params[r].top_k;
      s.top_p = params[r].top_p;
      s.seed = params[r].seed;
      EXPECT_EQ(got[r],
                SampleToken(absl::Span<const float>(&logits[static_cast<size_t>(r) * vocab], vocab),
                            s, params[r].position))
          << "row " << r << " split " << split;
    }
    EXPECT_EQ(got[0], 12);
  }
}

// Plain-temperature rows whose logits are tied everywhere, or span a chunk boundary of the
// split path with their best tokens (vocabularies just over a multiple of 4096), and a row of
// -inf logits except one token: the split path agrees with the host.
TEST_F(SamplingCudaTest, SplitPathEdgeRows) {
  for (int vocab : {4096, 4097, 8193, 128256}) {
    const int rows = 6;
    std::vector<float> logits(static_cast<size_t>(rows) * vocab, 0.0f);
    std::mt19937_64 rng(vocab);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (int i = 0; i < vocab; ++i) {
      logits[static_cast<size_t>(1) * vocab + i] = normal(rng);
      logits[static_cast<size_t>(2) * vocab + i] = -INFINITY;
      logits[static_cast<size_t>(3) * vocab + i] = std::round(normal(rng));
      logits[static_cast<size_t>(4) * vocab + i] = normal(rng) * 20.0f;  // window pruning
      logits[static_cast<size_t>(5) * vocab + i] = -1.0f;
    }
    logits[static_cast<size_t>(2) * vocab + vocab - 1] = 1.0f;  // the only finite logit
    logits[static_cast<size_t>(5) * vocab + vocab - 1] = 7.0f;  // greedy: the last token
    std::vector<cuda::SampleRowParams> params(rows);
    for (int r = 0; r < rows; ++r) {
      params[r].temperature = r == 5 ? 0.0f : 0.3f + 0.4f * r;
      params[r].seed = 1000 + r;
      params[r].position = 77 * r;
    }
    const std::vector<int32_t> got = SampleOnGpu(logits, vocab, params, true);
    for (int r = 0; r < rows; ++r) {
      SamplingParams s;
      s.temperature = params[r].temperature;
      s.seed = params[r].seed;
      EXPECT_EQ(got[r],
                SampleToken(absl::Span<const float>(&logits[static_cast<size_t>(r) * vocab], vocab),
                            s, params[r].position))
          << "vocab " << vocab << " row " << r;
    }
    EXPECT_EQ(got[2], vocab - 1);
    EXPECT_EQ(got[5], vocab - 1);
  }
}

// Random trees of the given shape; tokens from a small alphabet so that siblings repeat.
TokenTree MakeTree(int nodes, int shape, int alphabet, std::mt19937_64& rng) {
  TokenTree tree;
  std::uniform_int_distribution<int32_t> tok(0, alphabet - 1);
  for (int i = 0; i < nodes; ++i) {
    int32_t parent;
    switch (shape) {
      case 0:  // chain
        parent = i - 1;
        break;
      case 1:  // wide: every node a child of the root or of node 0
        parent = i < 4 ? -1 : 0;
        break;
      case 2:  // binary
        parent = i == 0 ? -1 : (i - 1) / 2;
        break;
      default: {  // random parent among earlier nodes
        std::uniform_int_distribution<int32_t> pick(-1, i - 1);
        parent = pick(rng);
      }
    }
    tree.parents.push_back(parent);
    tree.tokens.push_back(tok(rng));
  }
  return tree;
}

// Sampling of every row then acceptance, both on the GPU, against AcceptTree on the host, for
// a batch of trees of 1, 7 and 256 nodes and several shapes, greedy and sampled. Logits favour
// the tokens of the current node's children so that long paths get accepted.
TEST_F(SamplingCudaTest, AcceptedPathsMatchHost) {
  std::mt19937_64 rng(32);
  const int vocab = 64, alphabet = 6;
  struct Seq {
    TokenTree tree;
    SamplingParams sampling;
    int64_t first_position;
  };
  std::vector<Seq> seqs;
  int shape = 0;
  for (int nodes : {1, 7, 256, 0, 7, 256, 1, 40}) {
    for (float temperature : {0.0f, 0.9f}) {
      Seq s;
      s.tree = MakeTree(nodes, shape++ % 4, alphabet, rng);
      s.sampling.temperature = temperature;
      s.sampling.top_k = temperature > 0 && nodes == 7 ? 3 : 0;
      s.sampling.top_p = temperature > 0 && nodes == 256 ? 0.9f : 1.0f;
      s.sampling.seed = rng();
      s.first_position = static_cast<int64_t>(rng() % 5000);
      seqs.push_back(s);
    }
  }
  std::vector<float> logits;
  std::vector<cuda::SampleRowParams> row_params;
  std::vector<int32_t> sample_offset, node_offset, num_nodes, tree_tokens, tree_parents;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int max_nodes = 0;
  for (const Seq& s : seqs) {
    const int n = s.tree.size();
    max_nodes = std::max(max_nodes, n);
    sample_offset.push_back(static_cast<int32_t>(row_params.size()));
    node_offset.push_back(static_cast<int32_t>(tree_tokens.size()));
    num_nodes.push_back(n);
    tree_tokens.insert(tree_tokens.end(), s.tree.tokens.begin(), s.tree.tokens.end());
    tree_parents.insert(tree_parents.end(), s.tree.parents.begin(), s.tree.parents.end());
    const std::vector<int> depth = TreeDepths(s.tree);
    const std::vector<std::vector<int32_t>> children = TreeChildren(s.tree);
    for (int node = -1; node < n; ++node) {
      std::vector<float> row(vocab);
      for (float& x : row) x = normal(rng);
      for (int32_t c : children[node < 0 ? n : node]) row[s.tree.tokens[c]] += 3.0f;
      logits.insert(logits.end(), row.begin(), row.end());
      row_params.push_back(
          RowParams(s.sampling, s.first_position + (node < 0 ? 0 : depth[node] + 1)));
    }
  }
  // Sample on the GPU, then accept on the GPU from the device-resident samples.
  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<cuda::SampleRowParams> d_rows(row_params);
  DeviceBuffer<int32_t> d_sampled(row_params.size());
  cuda::SampleParams sp;
  sp.logits = d_logits.get();
  sp.logits_stride = vocab;
  sp.rows = d_rows.get();
  sp.tokens = d_sampled.get();
  sp.num_rows = static_cast<int64_t>(row_params.size());
  sp.vocab_size = vocab;
  DeviceBuffer<uint8_t> d_ws(
      static_cast<size_t>(cuda::SampleWorkspaceBytes(sp.num_rows, sp.vocab_size)));
  sp.workspace = d_ws.get();
  SPECD_CUDA_OK(cuda::SampleCuda(sp, stream_));
  const int num_seqs = static_cast<int>(seqs.size());
  const int out_stride = max_nodes + 1;
  DeviceBuffer<int32_t> d_sample_offset(sample_offset), d_node_offset(node_offset),
      d_num_nodes(num_nodes), d_tree_tokens(tree_tokens), d_tree_parents(tree_parents);
  DeviceBuffer<int32_t> d_out_tokens(static_cast<size_t>(num_seqs) * out_stride),
      d_out_nodes(static_cast<size_t>(num_seqs) * out_stride), d_accepted(num_seqs);
  cuda::TreeAcceptParams ap;
  ap.sampled = d_sampled.get();
  ap.sample_offset = d_sample_offset.get();
  ap.tree_tokens = d_tree_tokens.get();
  ap.tree_parents = d_tree_parents.get();
  ap.node_offset = d_node_offset.get();
  ap.num_nodes = d_num_nodes.get();
  ap.out_tokens = d_out_tokens.get();
  ap.out_nodes = d_out_nodes.get();
  ap.out_accepted = d_accepted.get();
  ap.out_stride = out_stride;
  ap.num_seqs = num_seqs;
  SPECD_CUDA_OK(cuda::TreeAcceptCuda(ap, stream_));
  Sync();
  const std::vector<int32_t> out_tokens = d_out_tokens.Download();
  const std::vector<int32_t> out_nodes = d_out_nodes.Download();
  const std::vector<int32_t> accepted = d_accepted.Download();
  int long_paths = 0;
  for (int b = 0; b < num_seqs; ++b) {
    const Seq& s = seqs[b];
    const int rows = s.tree.size() + 1;
    const VerifyOutcome want =
        AcceptTree(s.tree,
                   absl::Span<const float>(&logits[static_cast<size_t>(sample_offset[b]) * vocab],
                                           static_cast<size_t>(rows) * vocab),
                   vocab, s.sampling, s.first_position);
    ASSERT_EQ(accepted[b], want.accepted_draft) << "sequence " << b;
    const std::vector<int32_t> got_tokens(
        &out_tokens[static_cast<size_t>(b) * out_stride],
        &out_tokens[static_cast<size_t>(b) * out_stride] + accepted[b] + 1);
    const std::vector<int32_t> got_nodes(
        &out_nodes[static_cast<size_t>(b) * out_stride],
        &out_nodes[static_cast<size_t>(b) * out_stride] + accepted[b]);
    EXPECT_EQ(got_tokens, want.tokens) << "sequence " << b;
    EXPECT_EQ(got_nodes, want.accepted_nodes) << "sequence " << b;
    if (want.accepted_draft >= 3) ++long_paths;
  }
  EXPECT_GE(long_paths, 3) << "the logits should let some paths get accepted deep";
}

// ---- Vocabulary-parallel sampling: per-shard candidates and their reduction. ----

// Runs SampleCuda in candidate mode on each shard of `logits` ([rows, vocab], host), each shard
// copied to its own buffer as a rank holds it, writing rank r's candidates to row block r of one
// [world, rows] buffer (as an all-gather leaves them); returns the candidates and, via
// ReduceCandidatesCuda, the tokens.
struct ShardedResult {
  std::vector<cuda::SampleCandidate> candidates;  // [world, rows]
  std::vector<int32_t> tokens;                    // [rows]
};

class VocabParallelSamplingTest : public SamplingCudaTest {
 protected:
  ShardedResult SampleSharded(const std::vector<float>& logits, int vocab,
                              const std::vector<cuda::SampleRowParams>& rows,
                              const std::vector<TpRange>& shards, bool split) {
    const int64_t num_rows = static_cast<int64_t>(rows.size());
    const int world = static_cast<int>(shards.size());
    DeviceBuffer<cuda::SampleRowParams> d_rows(rows);
    DeviceBuffer<cuda::SampleCandidate> d_cands(static_cast<size_t>(world * num_rows));
    // Garbage first: every candidate must be written.
    EXPECT_EQ(cudaMemset(d_cands.get(), 0x5a, d_cands.size() * sizeof(cuda::SampleCandidate)),
              cudaSuccess);
    for (int r = 0; r < world; ++r) {
      const TpRange v = shards[r];
      std::vector<float> shard(static_cast<size_t>(num_rows * v.size()));
      for (int64_t row = 0; row < num_rows; ++row) {
        std::copy(logits.begin() + row * vocab + v.begin, logits.begin() + row * vocab + v.end,
                  shard.begin() + row * v.size());
      }
      DeviceBuffer<float> d_shard(shard);
      const int64_t ws_bytes = cuda::SampleWorkspaceBytes(num_rows, v.size());
      DeviceBuffer<uint8_t> d_ws(split ? static_cast<size_t>(ws_bytes) : 0);
      if (split)
        EXPECT_EQ(cudaMemset(d_ws.get(), 0xa5, static_cast<size_t>(ws_bytes)), cudaSuccess);
      cuda::SampleParams p;
      p.logits = d_shard.get();
      p.logits_stride = v.size();
      p.rows = d_rows.get();
      p.tokens = nullptr;  // candidate mode writes no tokens
      p.num_rows = num_rows;
      p.vocab_size = v.size();
      p.workspace = split ? d_ws.get() : nullptr;
      p.vocab_offset = v.begin;
      p.candidates = d_cands.get() + r * num_rows;
      EXPECT_EQ(cuda::SampleCuda(p, stream_), cudaSuccess) << "rank " << r;
      EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess) << "rank " << r;
    }
    DeviceBuffer<int32_t> d_tokens(rows.size());
    EXPECT_EQ(cudaMemset(d_tokens.get(), 0x7f, d_tokens.size() * sizeof(int32_t)), cudaSuccess);
    cuda::ReduceCandidatesParams rp;
    rp.candidates = d_cands.get();
    rp.world_size = world;
    rp.num_rows = num_rows;
    rp.tokens = d_tokens.get();
    EXPECT_EQ(cuda::ReduceCandidatesCuda(rp, stream_), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return {d_cands.Download(), d_tokens.Download()};
  }
};

SamplingParams HostParams(const cuda::SampleRowParams& r) {
  SamplingParams s;
  s.temperature = r.temperature;
  s.top_k = r.top_k;
  s.top_p = r.top_p;
  s.min_p = r.min_p;
  s.seed = r.seed;
  return s;
}

// Greedy and plain-temperature rows (many seeds and positions; Gaussian, peaked and tied logits)
// over a 50257-token vocabulary split into 3 and 7 uneven shards: each shard's candidate equals
// the host's ShardCandidate, and the reduced token equals SampleCuda on the full row and the
// host's SampleToken, on both the split and the one-CTA-per-row paths.
TEST_F(VocabParallelSamplingTest, CandidatesReduceToTheFullRowToken) {
  const int vocab = 50257, rows = 96;
  std::mt19937_64 rng(41);
  const std::vector<float> logits = MakeLogits(rows, vocab, rng);
  std::vector<cuda::SampleRowParams> params;
  std::uniform_int_distribution<int64_t> position(0, 200000);
  const float temps[] = {0.0f, 1.0f, 0.7f, 0.05f, 2.5f, 1.0f};
  for (int r = 0; r < rows; ++r) {
    SamplingParams s;
    s.temperature = temps[(r / 3) % 6];  // every temperature meets every logits kind
    // Greedy ignores top-k/top-p, so such greedy rows are allowed in candidate mode.
    if (s.temperature == 0.0f && r % 2 == 1) {
      s.top_k = 5;
      s.top_p = 0.5f;
    }
    s.seed = rng();
    params.push_back(RowParams(s, position(rng)));
  }
  std::vector<int32_t> want(rows);
  for (int r = 0; r < rows; ++r) {
    want[r] = SampleToken(absl::Span<const float>(&logits[static_cast<size_t>(r) * vocab], vocab),
                          HostParams(params[r]), params[r].position);
  }
  const std::vector<int32_t> full = SampleOnGpu(logits, vocab, params, true);
  for (int r = 0; r < rows; ++r) ASSERT_EQ(full[r], want[r]) << "full row " << r;

  for (int world : {3, 7}) {
    for (int64_t align : {int64_t{1}, int64_t{64}}) {
      const std::vector<TpRange> shards = SplitEvenly(vocab, world, align);
      for (bool split : {true, false}) {
        const ShardedResult got = SampleSharded(logits, vocab, params, shards, split);
        int mismatches = 0;
        for (int r = 0; r < rows; ++r) {
          const SamplingParams s = HostParams(params[r]);
          std::vector<VocabCandidate> host_cands;
          for (int k = 0; k < world; ++k) {
            const TpRange v = shards[k];
            const VocabCandidate hc = ShardCandidate(
                absl::Span<const float>(&logits[static_cast<size_t>(r) * vocab + v.begin],
                                        static_cast<size_t>(v.size())),
                v, s, params[r].position);
            host_cands.push_back(hc);
            const cuda::SampleCandidate& gc = got.candidates[static_cast<size_t>(k) * rows + r];
            if ((gc.token != hc.token ||
                 !(std::fabs(gc.score - hc.score) <= 1e-12 * (1.0 + std::fabs(hc.score)))) &&
                ++mismatches <= 5) {
              ADD_FAILURE() << "world " << world << " align " << align << " split " << split
                            << " row " << r << " (t " << s.temperature << ") rank " << k << " ["
                            << v.begin << ", " << v.end << "): gpu candidate (" << gc.score << ", "
                            << gc.token << ") host (" << hc.score << ", " << hc.token << ")";
            }
          }
          ASSERT_EQ(ReduceCandidates(host_cands).token, want[r]) << "host reduction, row " << r;
          if (got.tokens[r] != want[r] && ++mismatches <= 5) {
            ADD_FAILURE() << "world " << world << " align " << align << " split " << split
                          << " row " << r << " (t " << s.temperature << "): reduced "
                          << got.tokens[r] << " full row " << want[r];
          }
        }
        EXPECT_EQ(mismatches, 0) << "world " << world << " align " << align << " split " << split;
      }
    }
  }
}

// Ties across shard boundaries: the same best logit in several shards goes to the lowest id
// (greedy), and a row whose best tokens all sit in the last shard, with the other shards at
// -inf, still finds them.
TEST_F(VocabParallelSamplingTest, TiesAcrossShardsPickTheLowestId) {
  const int vocab = 10000;
  std::vector<float> logits(2 * vocab, -3.0f);
  for (int id : {9000, 6700, 3334}) logits[id] = 5.0f;  // 3334 is in shard 1 of 3
  for (int id = 0; id < vocab; ++id) logits[vocab + id] = id < 9000 ? -INFINITY : 0.25f;
  std::vector<cuda::SampleRowParams> params(4);
  params[0].temperature = 0.0f;
  params[1].temperature = 0.0f;
  params[2].temperature = 0.9f;
  params[2].seed = 3;
  params[2].position = 12;
  params[3].temperature = 1.0f;
  params[3].seed = 4;
  params[3].position = 13;
  std::vector<float> rows4(4 * static_cast<size_t>(vocab));
  std::copy(logits.begin(), logits.begin() + vocab, rows4.begin());
  std::copy(logits.begin() + vocab, logits.end(), rows4.begin() + vocab);
  std::copy(logits.begin(), logits.begin() + vocab, rows4.begin() + 2 * vocab);
  std::copy(logits.begin() + vocab, logits.end(), rows4.begin() + 3 * vocab);
  for (int world : {3, 7}) {
    for (bool split : {true, false}) {
      const ShardedResult got =
          SampleSharded(rows4, vocab, params, SplitEvenly(vocab, world), split);
      for (int r = 0; r < 4; ++r) {
        EXPECT_EQ(got.tokens[r], SampleToken(absl::Span<const float>(
                                                 &rows4[static_cast<size_t>(r) * vocab], vocab),
                                             HostParams(params[r]), params[r].position))
            << "world " << world << " split " << split << " row " << r;
      }
      EXPECT_EQ(got.tokens[0], 3334) << "world " << world << " split " << split;
      EXPECT_EQ(got.tokens[1], 9000) << "world " << world << " split " << split;
    }
  }
}

// Rows candidate mode cannot serve (top-k, top-p or min-p with a temperature) get the empty
// candidate, and ReduceCandidatesCuda reports -1 for them; their neighbours are unaffected.
TEST_F(VocabParallelSamplingTest, FilteredRowsGetEmptyCandidates) {
  const int vocab = 5000, rows = 5;
  std::mt19937_64 rng(43);
  const std::vector<float> logits = MakeLogits(rows, vocab, rng);
  std::vector<cuda::SampleRowParams> params(rows);
  for (int r = 0; r < rows; ++r) {
    params[r].seed = 100 + r;
    params[r].position = r;
    params[r].temperature = 1.0f;
  }
  params[1].top_k = 40;
  params[2].top_p = 0.9f;
  params[3].top_k = vocab;  // >= the shard: no-op for a full row, but still not allowed
  params[4].min_p = 0.1f;
  for (bool split : {true, false}) {
    const ShardedResult got = SampleSharded(logits, vocab, params, SplitEvenly(vocab, 3), split);
    for (int k = 0; k < 3; ++k) {
      for (int r = 1; r < rows; ++r) {
        const cuda::SampleCandidate& c = got.candidates[static_cast<size_t>(k) * rows + r];
        EXPECT_EQ(c.token, -1) << "split " << split << " rank " << k << " row " << r;
        EXPECT_TRUE(std::isinf(c.score) && c.score < 0)
            << "split " << split << " rank " << k << " row " << r << ": " << c.score;
      }
    }
    EXPECT_EQ(got.tokens[0],
              SampleToken(absl::Span<const float>(logits.data(), vocab), HostParams(params[0]), 0))
        << "split " << split;
    for (int r = 1; r < rows; ++r)
      EXPECT_EQ(got.tokens[r], -1) << "split " << split << " row " << r;
  }
}

// vocab_offset alone (the tokens path) draws over the shard with noise keyed by global ids and
// reports global ids: greedy and plain temperature equal ShardCandidate's token; top-k 1 and a
// tiny top-p keep only the shard's argmax.
TEST_F(SamplingCudaTest, VocabOffsetReportsGlobalIds) {
  const int vocab = 50257, rows = 48;
  std::mt19937_64 rng(44);
  const std::vector<float> logits = MakeLogits(rows, vocab, rng);
  const float temps[] = {0.0f, 1.0f, 0.6f, 1.0f, 1.0f, 3.0f};
  std::vector<cuda::SampleRowParams> params(rows);
  for (int r = 0; r < rows; ++r) {
    params[r].temperature = temps[(r / 3) % 6];
    params[r].seed = rng();
    params[r].position = static_cast<int64_t>(rng() % 100000);
    if ((r / 3) % 6 == 3) params[r].top_k = 1;
    if ((r / 3) % 6 == 4) params[r].top_p = 1e-6f;
  }
  for (const TpRange v : SplitEvenly(vocab, 3)) {
    std::vector<float> shard(static_cast<size_t>(rows * v.size()));
    for (int r = 0; r < rows; ++r) {
      std::copy(logits.begin() + static_cast<int64_t>(r) * vocab + v.begin,
                logits.begin() + static_cast<int64_t>(r) * vocab + v.end,
                shard.begin() + r * v.size());
    }
    DeviceBuffer<float> d_shard(shard);
    DeviceBuffer<cuda::SampleRowParams> d_rows(params);
    for (bool split : {true, false}) {
      DeviceBuffer<int32_t> d_tokens(rows);
      DeviceBuffer<uint8_t> d_ws(
          split ? static_cast<size_t>(cuda::SampleWorkspaceBytes(rows, v.size())) : 0);
      cuda::SampleParams p;
      p.logits = d_shard.get();
      p.logits_stride = v.size();
      p.rows = d_rows.get();
      p.tokens = d_tokens.get();
      p.num_rows = rows;
      p.vocab_size = v.size();
      p.workspace = split ? d_ws.get() : nullptr;
      p.vocab_offset = v.begin;
      SPECD_CUDA_OK(cuda::SampleCuda(p, stream_));
      Sync();
      const std::vector<int32_t> got = d_tokens.Download();
      for (int r = 0; r < rows; ++r) {
        const absl::Span<const float> row(&shard[static_cast<size_t>(r) * v.size()],
                                          static_cast<size_t>(v.size()));
        SamplingParams s = HostParams(params[r]);
        int32_t want;
        if (s.top_k == 1 || s.top_p < 1.0f) {
          SamplingParams g;  // greedy
          want = static_cast<int32_t>(v.begin) + SampleToken(row, g, 0);
        } else {
          want = ShardCandidate(row, v, s, params[r].position).token;
        }
        EXPECT_EQ(got[r], want) << "shard [" << v.begin << ", " << v.end << ") split " << split
                                << " row " << r << " (t " << s.temperature << " k " << s.top_k
                                << " p " << s.top_p << ")";
      }
    }
  }
}

TEST_F(SamplingCudaTest, BadParamsAreRejected) {
  cuda::SampleParams p;
  p.num_rows = 1;
  p.vocab_size = 10;
  p.logits_stride = 5;  // shorter than a row
  EXPECT_EQ(cuda::SampleCuda(p, stream_), cudaErrorInvalidValue);
  // Shard offsets, on launches with no rows (validated, then nothing to do).
  p.logits_stride = 10;
  p.num_rows = 0;
  p.vocab_offset = (int64_t{1} << 31) - 10;  // the last ids of int32
  EXPECT_EQ(cuda::SampleCuda(p, stream_), cudaSuccess);
  p.vocab_offset = (int64_t{1} << 31) - 5;  // ids past int32
  EXPECT_EQ(cuda::SampleCuda(p, stream_), cudaErrorInvalidValue);
  p.vocab_offset = -1;
  EXPECT_EQ(cuda::SampleCuda(p, stream_), cudaErrorInvalidValue);

  cuda::ReduceCandidatesParams rp;
  rp.num_rows = 1;
  rp.world_size = 0;
  EXPECT_EQ(cuda::ReduceCandidatesCuda(rp, stream_), cudaErrorInvalidValue);
  rp.world_size = 2;  // null pointers
  EXPECT_EQ(cuda::ReduceCandidatesCuda(rp, stream_), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace specd
