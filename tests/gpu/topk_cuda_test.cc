// kernels/cuda/topk.cu (one CTA a row, and the vocabulary split over CTAs) against engine/topk.h
// RowTopKLogprobs on the same fp32 rows: ids exactly, log-probabilities to fp32 rounding (only
// the order of the fp64 sum differs); and the CUDA
// backend's ForwardTopK against its own Forward() logits, and the drafter's trees with and
// without it, on the reference draft model.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "engine/backend.h"
#include "engine/draft/draft_model_drafter.h"
#include "engine/sampling.h"
#include "engine/topk.h"
#include "specd/kernels/cuda/topk.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/testutil/hf_fixtures.h"

namespace specd {
namespace {

using gpu_test::DeviceBuffer;

// Gaussian, coarsely quantised (ties everywhere) and near-constant rows with NaN and -inf.
std::vector<float> MakeRows(int rows, int vocab, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> out(static_cast<size_t>(rows) * vocab);
  for (int r = 0; r < rows; ++r) {
    float* row = &out[static_cast<size_t>(r) * vocab];
    for (int i = 0; i < vocab; ++i) {
      float x = normal(rng);
      if (r % 3 == 1) x = std::round(x);
      if (r % 3 == 2) x = (rng() % 8 == 0) ? std::round(x) : -1.0f;
      row[i] = x;
    }
    if (r % 3 == 2 && vocab > 4) {
      row[rng() % vocab] = std::numeric_limits<float>::quiet_NaN();
      row[rng() % vocab] = -std::numeric_limits<float>::infinity();
    }
  }
  return out;
}

class TopKCudaTest : public gpu_test::GpuTest {};

TEST_F(TopKCudaTest, EqualsTheHostForEveryKWithTies) {
  std::mt19937_64 rng(3);
  for (int vocab : {1, 2, 16, 17, 255, 320, 8192, 128256, 200000}) {
    const int rows = 6;
    // Rows sit at stride vocab + 3, in reverse order through row_index.
    const int64_t stride = vocab + 3;
    const std::vector<float> dense = MakeRows(rows, vocab, rng);
    std::vector<float> strided(static_cast<size_t>(rows * stride), 1e30f);
    std::vector<int32_t> index(rows);
    for (int r = 0; r < rows; ++r) {
      index[r] = rows - 1 - r;
      std::copy(dense.begin() + static_cast<size_t>(r) * vocab,
                dense.begin() + static_cast<size_t>(r + 1) * vocab,
                strided.begin() + static_cast<size_t>(index[r]) * stride);
    }
    DeviceBuffer<float> d_logits(strided);
    DeviceBuffer<int32_t> d_index(index);
    for (int k = 1; k <= std::min(vocab, cuda::kMaxTopK); ++k) {
      SCOPED_TRACE(testing::Message() << "vocab " << vocab << " k " << k);
      DeviceBuffer<int32_t> d_ids(static_cast<size_t>(rows * k));
      DeviceBuffer<float> d_lps(static_cast<size_t>(rows * k));
      cuda::TopKLogprobsParams p;
      p.logits = d_logits.get();
      p.logits_stride = stride;
      p.row_index = d_index.get();
      p.num_rows = rows;
      p.vocab_size = vocab;
      p.k = k;
      p.ids = d_ids.get();
      p.logprobs = d_lps.get();
      ASSERT_EQ(cuda::TopKLogprobsCuda(p, stream_), cudaSuccess);
      Sync();
      const std::vector<int32_t> ids = d_ids.Download();
      const std::vector<float> lps = d_lps.Download();
      for (int r = 0; r < rows; ++r) {
        std::vector<int32_t> want_ids(k);
        std::vector<float> want_lps(k);
        RowTopKLogprobs(
            absl::Span<const float>(dense).subspan(static_cast<size_t>(r) * vocab, vocab), k,
            want_ids.data(), want_lps.data());
        for (int j = 0; j < k; ++j) {
          ASSERT_EQ(ids[r * k + j], want_ids[j]) << "row " << r << " rank " << j;
          const float got = lps[r * k + j], want = want_lps[j];
          if (got == want) continue;  // also a -inf row's -inf, which fabs(got - want) makes NaN
          ASSERT_LE(std::fabs(got - want),
                    2.0f * std::numeric_limits<float>::epsilon() * std::max(1.0f, std::fabs(want)))
              << "row " << r << " rank " << j << ": " << got << " vs " << want;
        }
      }
    }
  }
}

// Runs TopKLogprobsCuda on `p` with `chunks` (0: TopKChunks' pick, with a workspace; 1: one
// CTA a row, without one), allocating the split path's workspace.
cudaError_t RunTopK(cuda::TopKLogprobsParams p, int chunks, cudaStream_t stream) {
  const int64_t bytes = cuda::TopKWorkspaceBytes(p.num_rows, p.vocab_size, p.k, chunks);
  DeviceBuffer<double> ws(static_cast<size_t>(std::max<int64_t>(bytes, 8) + 7) / 8);
  if (chunks != 1) {
    p.workspace = ws.get();
    p.workspace_bytes = bytes;
  }
  p.chunks = chunks;
  const cudaError_t e = cuda::TopKLogprobsCuda(p, stream);
  cudaStreamSynchronize(stream);  // before the workspace goes
  return e;
}

// The split path (each row's vocabulary over several CTAs, then a merge) against the host on
// rows with ties, NaN and -inf: vocabularies from 1 token (more chunks than tokens: empty
// chunks) to 200000, k 1..16 and 32, 1..128 rows, forced splits and TopKChunks' own; ids
// exactly, log-probabilities to fp32 rounding, and ids equal to the one-CTA path's.
TEST_F(TopKCudaTest, SplitEqualsTheHostAndTheOneCtaPath) {
  std::mt19937_64 rng(25);
  struct Case {
    int vocab, rows;
    std::vector<int> ks, chunks;
  };
  const std::vector<Case> cases = {
      {1, 3, {1}, {2, 64, 0}},
      {2, 5, {1, 2}, {2, 3, 0}},
      {17, 4, {1, 2, 3, 5, 8, 13, 16, 17}, {2, 5, 64}},
      {255, 37, {1, 4, 9, 16, 32}, {3, 17, 64, 0}},
      {1000, 1, {1, 2, 7, 16}, {2, 64}},
      {8192, 128, {1, 4, 16}, {0, 8}},
      {128256, 4, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 32}, {1, 0, 64}},
      {128256, 32, {4, 16}, {0}},
      {128256, 128, {4}, {0}},
      {200000, 7, {1, 16}, {0, 33}},
  };
  for (const Case& c : cases) {
    const int64_t stride = c.vocab + 1;
    const std::vector<float> dense = MakeRows(c.rows, c.vocab, rng);
    std::vector<float> strided(static_cast<size_t>(c.rows * stride), 1e30f);
    std::vector<int32_t> index(c.rows);
    for (int r = 0; r < c.rows; ++r) {
      index[r] = c.rows - 1 - r;
      std::copy(dense.begin() + static_cast<size_t>(r) * c.vocab,
                dense.begin() + static_cast<size_t>(r + 1) * c.vocab,
                strided.begin() + static_cast<size_t>(index[r]) * stride);
    }
    DeviceBuffer<float> d_logits(strided);
    DeviceBuffer<int32_t> d_index(index);
    for (int k : c.ks) {
      std::vector<int32_t> want_ids(static_cast<size_t>(c.rows) * k);
      std::vector<float> want_lps(static_cast<size_t>(c.rows) * k);
      for (int r = 0; r < c.rows; ++r) {
        RowTopKLogprobs(
            absl::Span<const float>(dense).subspan(static_cast<size_t>(r) * c.vocab, c.vocab), k,
            &want_ids[static_cast<size_t>(r) * k], &want_lps[static_cast<size_t>(r) * k]);
      }
      std::vector<int32_t> one_cta_ids;
      for (int chunks : c.chunks) {
        SCOPED_TRACE(testing::Message() << "vocab " << c.vocab << " rows " << c.rows << " k " << k
                                        << " chunks " << chunks);
        DeviceBuffer<int32_t> d_ids(static_cast<size_t>(c.rows * k));
        DeviceBuffer<float> d_lps(static_cast<size_t>(c.rows * k));
        cuda::TopKLogprobsParams p;
        p.logits = d_logits.get();
        p.logits_stride = stride;
        p.row_index = d_index.get();
        p.num_rows = c.rows;
        p.vocab_size = c.vocab;
        p.k = k;
        p.ids = d_ids.get();
        p.logprobs = d_lps.get();
        ASSERT_EQ(RunTopK(p, chunks, stream_), cudaSuccess);
        const std::vector<int32_t> ids = d_ids.Download();
        const std::vector<float> lps = d_lps.Download();
        if (chunks == 1) one_cta_ids = ids;
        if (!one_cta_ids.empty()) EXPECT_EQ(ids, one_cta_ids);
        for (size_t j = 0; j < ids.size(); ++j) {
          ASSERT_EQ(ids[j], want_ids[j]) << "row " << j / k << " rank " << j % k;
          const float got = lps[j], want = want_lps[j];
          if (got == want) continue;
          ASSERT_LE(std::fabs(got - want),
                    2.0f * std::numeric_limits<float>::epsilon() * std::max(1.0f, std::fabs(want)))
              << "row " << j / k << " rank " << j % k << ": " << got << " vs " << want;
        }
      }
    }
  }
}

// TopKChunks fills the GPU for few rows and stops splitting for many; the workspace it sizes
// for a row count covers every smaller one (a buffer reserved once serves every bucket).
TEST(TopKChunksTest, SplitsFewRowsAndBoundsTheWorkspace) {
  EXPECT_EQ(cuda::TopKChunks(4, 128256), cuda::kMaxTopKChunks);
  EXPECT_GT(cuda::TopKChunks(128, 128256), 1);
  EXPECT_EQ(cuda::TopKChunks(4096, 128256), 1);
  EXPECT_EQ(cuda::TopKChunks(4, 512), 1);  // a chunk is at least 1024 tokens
  EXPECT_EQ(cuda::TopKWorkspaceBytes(4, 512, 16), 0);
  for (int64_t vocab : {int64_t{2048}, int64_t{32000}, int64_t{128256}}) {
    const int64_t bound = cuda::TopKWorkspaceBytes(2048, vocab, 16);
    for (int64_t rows = 1; rows <= 2048; ++rows) {
      const int chunks = cuda::TopKChunks(rows, vocab);
      ASSERT_LE(cuda::TopKWorkspaceBytes(rows, vocab, 16, chunks), bound) << rows;
      ASSERT_LE(cuda::TopKWorkspaceBytes(rows, vocab, 3, chunks), bound) << rows;
      ASSERT_LE(cuda::TopKWorkspaceBytes(rows, vocab, 16, chunks),
                cuda::TopKWorkspaceBytes(rows, vocab, 16))
          << rows;
    }
  }
}

// Processed mode (temperature-scaled rows normalised over a kept set) with the sampled token's
// log-probability and rank: the split path equals the one-CTA path (ids and ranks exactly,
// log-probabilities to fp32 rounding).
TEST_F(TopKCudaTest, SplitEqualsOneCtaInProcessedMode) {
  std::mt19937_64 rng(52);
  const int rows = 6, vocab = 50000;
  const std::vector<float> logits = MakeRows(rows, vocab, rng);
  std::vector<cuda::SampleRowParams> sampling(rows);
  std::vector<uint64_t> lower(rows, 0);
  std::vector<int32_t> tokens(rows);
  // The host's sort key (kernels/cuda/device_utils.cuh SortKey), for the kept sets' thresholds.
  auto sort_key = [](float x, int id) {
    if (x != x) return static_cast<uint64_t>(0xffffffffu - static_cast<uint32_t>(id));
    if (x == 0.0f) x = 0.0f;
    uint32_t b;
    std::memcpy(&b, &x, sizeof(b));
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return (static_cast<uint64_t>(b) << 32) | (0xffffffffu - static_cast<uint32_t>(id));
  };
  for (int r = 0; r < rows; ++r) {
    const float* row = &logits[static_cast<size_t>(r) * vocab];
    sampling[r].temperature = r % 2 == 0 ? 0.7f : 0.0f;
    std::vector<uint64_t> keys(vocab);
    for (int i = 0; i < vocab; ++i) keys[i] = sort_key(row[i], i);
    std::sort(keys.begin(), keys.end(), std::greater<uint64_t>());
    if (r % 3 != 0) lower[r] = keys[r == 1 ? 40 : 3000];  // kept: the best 41 or 3001
    tokens[r] =
        static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(keys[r * 5] & 0xffffffffu));
  }
  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<cuda::SampleRowParams> d_sampling(sampling);
  DeviceBuffer<uint64_t> d_lower(lower);
  DeviceBuffer<int32_t> d_tokens(tokens);
  for (int k : {1, 16, 32}) {
    std::vector<int32_t> ref_ids, ref_ranks;
    std::vector<float> ref_lps, ref_token_lps;
    for (int chunks : {1, 0, 7}) {
      SCOPED_TRACE(testing::Message() << "k " << k << " chunks " << chunks);
      DeviceBuffer<int32_t> d_ids(static_cast<size_t>(rows * k)), d_ranks(rows);
      DeviceBuffer<float> d_lps(static_cast<size_t>(rows * k)), d_token_lps(rows);
      cuda::TopKLogprobsParams p;
      p.logits = d_logits.get();
      p.logits_stride = vocab;
      p.num_rows = rows;
      p.vocab_size = vocab;
      p.k = k;
      p.ids = d_ids.get();
      p.logprobs = d_lps.get();
      p.tokens = d_tokens.get();
      p.token_logprobs = d_token_lps.get();
      p.token_ranks = d_ranks.get();
      p.sampling = d_sampling.get();
      p.kept_lower = d_lower.get();
      ASSERT_EQ(RunTopK(p, chunks, stream_), cudaSuccess);
      const std::vector<int32_t> ids = d_ids.Download(), ranks = d_ranks.Download();
      const std::vector<float> lps = d_lps.Download(), token_lps = d_token_lps.Download();
      if (chunks == 1) {
        ref_ids = ids;
        ref_ranks = ranks;
        ref_lps = lps;
        ref_token_lps = token_lps;
        continue;
      }
      EXPECT_EQ(ids, ref_ids);
      EXPECT_EQ(ranks, ref_ranks);
      auto close = [](float got, float want) {
        return got == want || std::fabs(got - want) <= 4.0f *
                                                           std::numeric_limits<float>::epsilon() *
                                                           std::max(1.0f, std::fabs(want));
      };
      for (size_t j = 0; j < lps.size(); ++j) {
        EXPECT_TRUE(close(lps[j], ref_lps[j])) << j << ": " << lps[j] << " vs " << ref_lps[j];
      }
      for (int r = 0; r < rows; ++r) {
        EXPECT_TRUE(close(token_lps[r], ref_token_lps[r]))
            << r << ": " << token_lps[r] << " vs " << ref_token_lps[r];
      }
    }
  }
}

// The sampled token's log-probability and rank (the OpenAI API's logprobs, raw mode) against
// engine/sampling.h ComputeLogprobs on the same fp32 rows, with and without top lists (k = 0: the
// token only; up to 20 alternatives as the API allows, and kMaxTopK): ranks exactly (ties share
// the best rank), log-probabilities to fp32 rounding.
TEST_F(TopKCudaTest, TokenLogprobAndRankEqualComputeLogprobs) {
  std::mt19937_64 rng(28);
  for (int vocab : {1, 7, 320, 32000, 151936}) {
    const int rows = 8;
    const int64_t stride = vocab + 5;
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> dense(static_cast<size_t>(rows) * vocab);
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < vocab; ++i) {
        const float x = normal(rng);
        dense[static_cast<size_t>(r) * vocab + i] = r % 2 == 1 ? std::round(x) : x;  // ties
      }
      if (vocab > 3) dense[static_cast<size_t>(r) * vocab + 2] = -INFINITY;
    }
    // Rows sit at stride vocab + 5, read in reverse through row_index; tokens are indexed like
    // the logits rows. Row by row: the argmax, a -inf token, random ones.
    std::vector<float> strided(static_cast<size_t>(rows * stride), 1e30f);
    std::vector<int32_t> index(rows), tokens(rows);
    for (int r = 0; r < rows; ++r) {
      index[r] = rows - 1 - r;
      const float* row = &dense[static_cast<size_t>(r) * vocab];
      std::copy(row, row + vocab, strided.begin() + static_cast<size_t>(index[r]) * stride);
      int32_t token = static_cast<int32_t>(rng() % vocab);
      if (r == 0) token = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
      if (r == 1 && vocab > 3) token = 2;
      tokens[index[r]] = token;
    }
    DeviceBuffer<float> d_logits(strided);
    DeviceBuffer<int32_t> d_index(index);
    DeviceBuffer<int32_t> d_tokens(tokens);
    for (int k : {0, 1, 5, 20, cuda::kMaxTopK}) {
      if (k > vocab) continue;
      SCOPED_TRACE(testing::Message() << "vocab " << vocab << " k " << k);
      DeviceBuffer<int32_t> d_ids(static_cast<size_t>(rows * std::max(k, 1)));
      DeviceBuffer<float> d_lps(static_cast<size_t>(rows * std::max(k, 1)));
      DeviceBuffer<float> d_token_lps(rows);
      DeviceBuffer<int32_t> d_ranks(rows);
      cuda::TopKLogprobsParams p;
      p.logits = d_logits.get();
      p.logits_stride = stride;
      p.row_index = d_index.get();
      p.num_rows = rows;
      p.vocab_size = vocab;
      p.k = k;
      p.ids = k > 0 ? d_ids.get() : nullptr;
      p.logprobs = k > 0 ? d_lps.get() : nullptr;
      p.tokens = d_tokens.get();
      p.token_logprobs = d_token_lps.get();
      p.token_ranks = d_ranks.get();
      // Both paths: one CTA a row, and the vocabulary split over 5 CTAs a row.
      for (int chunks : {1, 5}) {
        if (chunks > vocab) continue;
        ASSERT_EQ(RunTopK(p, chunks, stream_), cudaSuccess);
        const std::vector<int32_t> ids = d_ids.Download(), ranks = d_ranks.Download();
        const std::vector<float> lps = d_lps.Download(), token_lps = d_token_lps.Download();
        auto close = [](float got, float want) {
          return got == want || std::fabs(got - want) <= 4.0f *
                                                             std::numeric_limits<float>::epsilon() *
                                                             std::max(1.0f, std::fabs(want));
        };
        for (int r = 0; r < rows; ++r) {
          const absl::Span<const float> row =
              absl::Span<const float>(dense).subspan(static_cast<size_t>(r) * vocab, vocab);
          const int32_t token = tokens[index[r]];
          const TokenLogprobs want = ComputeLogprobs(row, row, SamplingParams(), LogprobsMode::kRaw,
                                                     token, std::min(k, kMaxLogprobs));
          EXPECT_EQ(ranks[r], want.rank) << "row " << r << " token " << token;
          EXPECT_TRUE(close(token_lps[r], want.logprob))
              << "row " << r << ": " << token_lps[r] << " vs " << want.logprob;
          for (size_t j = 0; j < want.top.size(); ++j) {
            EXPECT_EQ(ids[r * k + j], want.top[j].token) << "row " << r << " rank " << j;
            EXPECT_TRUE(close(lps[r * k + j], want.top[j].logprob)) << "row " << r << " rank " << j;
          }
        }
      }
    }
  }
}

TEST_F(TopKCudaTest, RefusesBadParams) {
  DeviceBuffer<float> d_logits(std::vector<float>(16, 0.0f));
  DeviceBuffer<int32_t> d_ids(32);
  DeviceBuffer<float> d_lps(32);
  cuda::TopKLogprobsParams p;
  p.logits = d_logits.get();
  p.logits_stride = 16;
  p.num_rows = 1;
  p.vocab_size = 16;
  p.ids = d_ids.get();
  p.logprobs = d_lps.get();
  for (int k : {0, cuda::kMaxTopK + 1}) {
    p.k = k;
    EXPECT_EQ(cuda::TopKLogprobsCuda(p, stream_), cudaErrorInvalidValue) << k;
  }
  p.k = 4;
  p.vocab_size = 3;
  p.logits_stride = 3;
  EXPECT_EQ(cuda::TopKLogprobsCuda(p, stream_), cudaErrorInvalidValue);
  // The token outputs come all together or not at all.
  DeviceBuffer<int32_t> d_tokens(std::vector<int32_t>{0});
  p.vocab_size = 16;
  p.logits_stride = 16;
  p.tokens = d_tokens.get();
  EXPECT_EQ(cuda::TopKLogprobsCuda(p, stream_), cudaErrorInvalidValue);
  p.token_logprobs = d_lps.get();
  p.token_ranks = d_ids.get();
  EXPECT_EQ(cuda::TopKLogprobsCuda(p, stream_), cudaSuccess);
  p.k = 0;
  EXPECT_EQ(cuda::TopKLogprobsCuda(p, stream_), cudaSuccess);
  p.k = cuda::kMaxTopK + 1;
  EXPECT_EQ(cuda::TopKLogprobsCuda(p, stream_), cudaErrorInvalidValue);
  // A forced split needs a workspace of TopKWorkspaceBytes; chunks stay in [0, kMaxTopKChunks].
  p.k = 4;
  p.chunks = 2;
  EXPECT_EQ(cuda::TopKLogprobsCuda(p, stream_), cudaErrorInvalidValue);
  DeviceBuffer<double> ws(1024);
  p.workspace = ws.get();
  p.workspace_bytes = cuda::TopKWorkspaceBytes(1, 16, 4, 2) - 1;
  EXPECT_EQ(cuda::TopKLogprobsCuda(p, stream_), cudaErrorInvalidValue);
  p.workspace_bytes += 1;
  EXPECT_EQ(cuda::TopKLogprobsCuda(p, stream_), cudaSuccess);
  p.chunks = cuda::kMaxTopKChunks + 1;
  EXPECT_EQ(cuda::TopKLogprobsCuda(p, stream_), cudaErrorInvalidValue);
  p.chunks = -1;
  EXPECT_EQ(cuda::TopKLogprobsCuda(p, stream_), cudaErrorInvalidValue);
  Sync();
}

std::unique_ptr<Backend> LoadDraft() {
  BackendOptions opts;
  opts.device = "cuda:0";
  opts.kv_capacity_tokens = 8192;
  absl::StatusOr<std::unique_ptr<Backend>> b =
      CreateBackend((testutil::RepoRoot() / "models" / "pycoder-draft").string(), opts);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

// The backend's ForwardTopK returns the top-k of the very logits its Forward() returns for the
// same step (ids exactly), for a padded multi-sequence tree step.
TEST_F(TopKCudaTest, BackendTopKMatchesItsLogits) {
  std::unique_ptr<Backend> model = LoadDraft();
  ASSERT_NE(model, nullptr);
  const int vocab = model->config().vocab_size;
  std::vector<ForwardItem> items(3);
  for (int b = 0; b < 3; ++b) {
    ASSERT_TRUE(model->AddSequence(b + 1).ok());
    items[b].seq = b + 1;
    for (int i = 0; i < 3 + 2 * b; ++i) {
      items[b].tokens.push_back(40 + 7 * i + b);
      items[b].parents.push_back(i == 0 ? -1 : (i - 1) / 2);
      if (i % 2 == 0 || b == 1) items[b].logit_rows.push_back(i);
    }
  }
  std::vector<float> logits;
  ASSERT_TRUE(model->Forward(items, &logits).ok());
  const int64_t rows = static_cast<int64_t>(logits.size()) / vocab;
  for (int k : {1, 3, 16}) {
    for (int b = 0; b < 3; ++b) ASSERT_TRUE(model->Commit(b + 1, {}).ok());
    TopKRows top;
    ASSERT_TRUE(model->ForwardTopK(items, k, &top).ok());
    ASSERT_EQ(top.rows(), rows);
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<int32_t> ids(k);
      std::vector<float> lps(k);
      RowTopKLogprobs(absl::Span<const float>(logits).subspan(r * vocab, vocab), k, ids.data(),
                      lps.data());
      for (int j = 0; j < k; ++j) {
        EXPECT_EQ(top.ids[r * k + j], ids[j]) << "row " << r << " rank " << j;
        EXPECT_NEAR(
            top.logprobs[r * k + j], lps[j],
            2.0f * std::numeric_limits<float>::epsilon() * std::max(1.0f, std::fabs(lps[j])));
      }
    }
  }
}

// Trees grown from the backend's top-k equal those grown from full logits on the host (one
// backend, so both see the same GEMM algorithms).
TEST_F(TopKCudaTest, DrafterTreesMatchTheHostPath) {
  std::unique_ptr<Backend> model = LoadDraft();
  ASSERT_NE(model, nullptr);
  DraftModelDrafter device(model.get(), {true, false}), host(model.get(), {false, false});
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
  absl::StatusOr<std::vector<TokenTree>> got = device.Draft(on_device);
  absl::StatusOr<std::vector<TokenTree>> want = host.Draft(on_host);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(want.ok()) << want.status();
  for (size_t i = 0; i < on_device.size(); ++i) {
    EXPECT_EQ((*got)[i].tokens, (*want)[i].tokens) << i;
    EXPECT_EQ((*got)[i].parents, (*want)[i].parents) << i;
  }
}

}  // namespace
}  // namespace specd
