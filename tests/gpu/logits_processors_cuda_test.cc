// kernels/cuda/logits_processors.cu against engine/sampling.h ProcessLogits on the same fp32
// rows, bit for bit (min_tokens, logit_bias and the three penalties, each row counting the
// sequence's history plus its own path, repeated tokens and tokens of both included); and the
// processed log-probabilities of sampled rows (SampleCuda's kept sets feeding TopKLogprobsCuda)
// against ComputeLogprobs in processed mode: ranks and listed ids exactly, values to fp32
// rounding.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/sampling.h"
#include "specd/kernels/cuda/logits_processors.h"
#include "specd/kernels/cuda/sampling.h"
#include "specd/kernels/cuda/topk.h"
#include "tests/gpu/gpu_test_util.h"

namespace specd {
namespace {

using gpu_test::DeviceBuffer;

class LogitsProcessorsCudaTest : public gpu_test::GpuTest {};

// One sequence of the test: its processors and history.
struct Seq {
  SamplingParams params;
  TokenHistory history;
};

// One row: its sequence (-1: none) and its path's tokens.
struct Row {
  int seq = -1;
  std::vector<int32_t> path;
};

// The launcher's lists for `seqs` and `rows`, laid out as its header says.
void Pack(const std::vector<Seq>& seqs, const std::vector<Row>& rows,
          std::vector<cuda::LogitsProcessorSeq>* out_seqs,
          std::vector<cuda::LogitsProcessorRow>* out_rows, std::vector<int32_t>* data) {
  for (const Seq& s : seqs) {
    cuda::LogitsProcessorSeq& d = out_seqs->emplace_back();
    d.repetition_penalty = s.params.repetition_penalty;
    d.presence_penalty = s.params.presence_penalty;
    d.frequency_penalty = s.params.frequency_penalty;
    d.min_tokens = s.params.min_tokens;
    d.output_length = s.history.output_length();
    std::vector<std::pair<int32_t, TokenHistory::Counts>> entries(s.history.tokens().begin(),
                                                                  s.history.tokens().end());
    std::sort(entries.begin(), entries.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    d.history_begin = static_cast<int32_t>(data->size());
    d.history_count = static_cast<int32_t>(entries.size());
    for (const auto& [id, c] : entries) data->insert(data->end(), {id, c.output, c.in_prompt});
    d.bias_begin = static_cast<int32_t>(data->size());
    d.bias_count = static_cast<int32_t>(s.params.logit_bias.size());
    for (const auto& [id, bias] : s.params.logit_bias) {
      int32_t bits;
      std::memcpy(&bits, &bias, sizeof(bits));
      data->insert(data->end(), {id, bits});
    }
    d.stop_begin = static_cast<int32_t>(data->size());
    d.stop_count = static_cast<int32_t>(s.params.min_tokens_stop_ids.size());
    data->insert(data->end(), s.params.min_tokens_stop_ids.begin(),
                 s.params.min_tokens_stop_ids.end());
  }
  for (const Row& r : rows) {
    cuda::LogitsProcessorRow& d = out_rows->emplace_back();
    d.seq = r.seq;
    d.path_begin = static_cast<int32_t>(data->size());
    d.path_len = static_cast<int32_t>(r.path.size());
    data->insert(data->end(), r.path.begin(), r.path.end());
  }
  if (data->empty()) data->push_back(0);  // a valid pointer for an empty list
}

std::vector<int32_t> Draw(int n, int vocab, std::mt19937_64& rng) {
  std::vector<int32_t> out(n);
  for (int32_t& t : out) t = static_cast<int32_t>(rng() % vocab);
  return out;
}

TEST_F(LogitsProcessorsCudaTest, EqualsProcessLogitsBitForBit) {
  std::mt19937_64 rng(28);
  for (int vocab : {7, 320, 32000, 151936}) {
    SCOPED_TRACE(testing::Message() << "vocab " << vocab);
    std::vector<Seq> seqs(6);
    // 0: bias only (no history needed). 1: all three penalties over a long history. 2: min_tokens
    // still masking, with bias on a stop id. 3: min_tokens no longer masking (history long
    // enough for some paths only), penalties below 1 / negative. 4: repetition only.
    // 5: everything at once, with a history of many repeats.
    seqs[0].params.logit_bias = {{0, 5.5f}, {static_cast<int32_t>(vocab - 1), -100.0f}};
    seqs[1].params.repetition_penalty = 1.3f;
    seqs[1].params.presence_penalty = 0.5f;
    seqs[1].params.frequency_penalty = 0.7f;
    seqs[2].params.min_tokens = 40;
    seqs[2].params.min_tokens_stop_ids = {1, 2, 2, static_cast<int32_t>(vocab / 2)};
    seqs[2].params.logit_bias = {{1, 9.0f}, {3, 0.25f}};
    seqs[3].params.min_tokens = 5;
    seqs[3].params.min_tokens_stop_ids = {static_cast<int32_t>(vocab / 3)};
    seqs[3].params.repetition_penalty = 0.8f;
    seqs[3].params.presence_penalty = -1.5f;
    seqs[3].params.frequency_penalty = -0.3f;
    seqs[4].params.repetition_penalty = 1.7f;
    seqs[5].params = seqs[1].params;
    seqs[5].params.logit_bias = {{2, -3.0f}, {4, 7.0f}};
    seqs[5].params.min_tokens = 3;
    seqs[5].params.min_tokens_stop_ids = {5};
    for (int s = 1; s < 6; ++s) {
      seqs[s].history.AddPrompt(Draw(30, vocab, rng));
      std::vector<int32_t> output = Draw(s == 3 ? 3 : 25, std::min(vocab, s == 5 ? 9 : vocab), rng);
      seqs[s].history.AddOutput(output);
    }
    std::vector<Row> rows;
    rows.push_back({-1, {}});
    for (int s = 0; s < 6; ++s) {
      for (int len : {0, 1, 2, 5, 17}) {
        // Paths mix fresh tokens, repeats and the history's tokens.
        std::vector<int32_t> path = Draw(len, vocab, rng);
        if (len >= 2) path[1] = path[0];
        if (len >= 5 && !seqs[s].history.tokens().empty()) {
          path[3] = seqs[s].history.tokens().begin()->first;
        }
        rows.push_back({s, path});
      }
    }
    rows.push_back({-1, {3, 4}});
    const int n = static_cast<int>(rows.size());
    const int64_t in_stride = vocab + 3, out_stride = vocab + 1;
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> in(static_cast<size_t>(n * in_stride), 1e30f);
    for (int r = 0; r < n; ++r) {
      for (int i = 0; i < vocab; ++i) in[r * in_stride + i] = normal(rng);
    }
    std::vector<cuda::LogitsProcessorSeq> d_seq_host;
    std::vector<cuda::LogitsProcessorRow> d_row_host;
    std::vector<int32_t> data;
    Pack(seqs, rows, &d_seq_host, &d_row_host, &data);
    DeviceBuffer<float> d_in(in);
    DeviceBuffer<float> d_out(static_cast<size_t>(n * out_stride));
    DeviceBuffer<cuda::LogitsProcessorSeq> d_seqs(d_seq_host);
    DeviceBuffer<cuda::LogitsProcessorRow> d_rows(d_row_host);
    DeviceBuffer<int32_t> d_data(data);
    cuda::LogitsProcessorsParams p;
    p.in = d_in.get();
    p.in_stride = in_stride;
    p.out = d_out.get();
    p.out_stride = out_stride;
    p.num_rows = n;
    p.vocab_size = vocab;
    p.rows = d_rows.get();
    p.seqs = d_seqs.get();
    p.data = d_data.get();
    SPECD_CUDA_OK(cuda::LogitsProcessorsCuda(p, stream_));
    Sync();
    const std::vector<float> out = d_out.Download();
    int changed_rows = 0;
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE(testing::Message() << "row " << r << " seq " << rows[r].seq);
      const absl::Span<const float> raw = absl::Span<const float>(in).subspan(r * in_stride, vocab);
      std::vector<float> want(raw.begin(), raw.end());
      if (rows[r].seq >= 0) {
        const Seq& s = seqs[rows[r].seq];
        ProcessLogits(raw, s.params, &s.history, rows[r].path, &want);
      }
      int mismatches = 0;
      for (int i = 0; i < vocab; ++i) {
        const float got = out[r * out_stride + i];
        if (std::memcmp(&got, &want[i], sizeof(float)) != 0 && ++mismatches <= 3) {
          ADD_FAILURE() << "token " << i << ": " << got << " vs the host's " << want[i];
        }
      }
      EXPECT_EQ(mismatches, 0);
      changed_rows += !std::equal(want.begin(), want.end(), raw.begin());
    }
    // Every sequence's rows edit something, so the comparison is not of copies only.
    EXPECT_GE(changed_rows, 6 * 5 - 2);
  }
}

// Processed log-probabilities of sampled rows: SampleCuda reports each row's kept set and
// TopKLogprobsCuda normalises the row scaled by 1 / temperature over it, as ComputeLogprobs does;
// with the raw rows' log-probabilities for contrast (they must differ where filters cut).
TEST_F(LogitsProcessorsCudaTest, ProcessedLogprobsEqualComputeLogprobs) {
  std::mt19937_64 rng(7);
  for (int vocab : {320, 32000, 151936}) {
    std::vector<SamplingParams> params(7);
    params[1].temperature = 0.7f;  // unfiltered: the split path, every token kept
    params[2].temperature = 0.8f;
    params[2].top_k = 40;
    params[3].temperature = 1.3f;
    params[3].top_p = 0.9f;
    params[4].temperature = 0.6f;
    params[4].min_p = 0.05f;
    params[5].temperature = 0.9f;
    params[5].min_p = 0.01f;
    params[5].top_k = 100;
    params[5].top_p = 0.8f;
    params[6].temperature = 2.0f;
    params[6].top_k = 3;
    const int n = static_cast<int>(params.size());
    std::vector<cuda::SampleRowParams> row_params(n);
    for (int r = 0; r < n; ++r) {
      params[r].seed = 1000 + r;
      row_params[r].seed = params[r].seed;
      row_params[r].position = 50 + r;
      row_params[r].temperature = params[r].temperature;
      row_params[r].top_k = params[r].top_k;
      row_params[r].top_p = params[r].top_p;
      row_params[r].min_p = params[r].min_p;
    }
    std::normal_distribution<float> normal(0.0f, 2.5f);
    std::vector<float> logits(static_cast<size_t>(n) * vocab);
    for (float& x : logits) x = normal(rng);
    DeviceBuffer<float> d_logits(logits);
    DeviceBuffer<cuda::SampleRowParams> d_params(row_params);
    DeviceBuffer<int32_t> d_tokens(n);
    DeviceBuffer<uint64_t> d_kept(n);
    DeviceBuffer<char> d_ws(cuda::SampleWorkspaceBytes(n, vocab));
    cuda::SampleParams sp;
    sp.logits = d_logits.get();
    sp.logits_stride = vocab;
    sp.rows = d_params.get();
    sp.tokens = d_tokens.get();
    sp.num_rows = n;
    sp.vocab_size = vocab;
    sp.workspace = d_ws.get();
    sp.kept_lower = d_kept.get();
    SPECD_CUDA_OK(cuda::SampleCuda(sp, stream_));
    for (int k : {0, 5, 20}) {
      SCOPED_TRACE(testing::Message() << "vocab " << vocab << " k " << k);
      DeviceBuffer<int32_t> d_ids(static_cast<size_t>(n * std::max(k, 1)));
      DeviceBuffer<float> d_lps(static_cast<size_t>(n * std::max(k, 1)));
      DeviceBuffer<float> d_token_lps(n);
      DeviceBuffer<int32_t> d_ranks(n);
      cuda::TopKLogprobsParams p;
      p.logits = d_logits.get();
      p.logits_stride = vocab;
      p.num_rows = n;
      p.vocab_size = vocab;
      p.k = k;
      p.ids = k > 0 ? d_ids.get() : nullptr;
      p.logprobs = k > 0 ? d_lps.get() : nullptr;
      p.tokens = d_tokens.get();
      p.token_logprobs = d_token_lps.get();
      p.token_ranks = d_ranks.get();
      p.sampling = d_params.get();
      p.kept_lower = d_kept.get();
      SPECD_CUDA_OK(cuda::TopKLogprobsCuda(p, stream_));
      Sync();
      const std::vector<int32_t> tokens = d_tokens.Download(), ids = d_ids.Download(),
                                 ranks = d_ranks.Download();
      const std::vector<float> lps = d_lps.Download(), token_lps = d_token_lps.Download();
      auto close = [](float got, float want) {
        return got == want || std::fabs(got - want) <= 8.0f *
                                                           std::numeric_limits<float>::epsilon() *
                                                           std::max(1.0f, std::fabs(want));
      };
      for (int r = 0; r < n; ++r) {
        SCOPED_TRACE(testing::Message() << "row " << r);
        const absl::Span<const float> row =
            absl::Span<const float>(logits).subspan(static_cast<size_t>(r) * vocab, vocab);
        ASSERT_EQ(tokens[r], SampleToken(row, params[r], row_params[r].position));
        const TokenLogprobs want =
            ComputeLogprobs(row, row, params[r], LogprobsMode::kProcessed, tokens[r], k);
        EXPECT_EQ(ranks[r], want.rank);
        EXPECT_TRUE(close(token_lps[r], want.logprob)) << token_lps[r] << " vs " << want.logprob;
        // The host lists only tokens of non-zero probability; the device lists k, the rest at
        // -inf (which the backend drops).
        int listed = 0;
        while (listed < k && !std::isinf(lps[r * k + listed])) ++listed;
        ASSERT_EQ(listed, static_cast<int>(want.top.size()));
        for (int j = 0; j < listed; ++j) {
          EXPECT_EQ(ids[r * k + j], want.top[j].token) << "rank " << j;
          EXPECT_TRUE(close(lps[r * k + j], want.top[j].logprob)) << "rank " << j;
        }
        if (params[r].top_k == 3 && k >= 5) EXPECT_EQ(listed, 3);
      }
    }
  }
}

TEST_F(LogitsProcessorsCudaTest, RefusesBadParams) {
  DeviceBuffer<float> in(64), out(64);
  // Rows without processors (seq -1): a zeroed row would name sequence 0 of a null list.
  DeviceBuffer<cuda::LogitsProcessorRow> rows(std::vector<cuda::LogitsProcessorRow>(2));
  cuda::LogitsProcessorsParams p;
  p.in = in.get();
  p.in_stride = 32;
  p.out = out.get();
  p.out_stride = 32;
  p.num_rows = 2;
  p.vocab_size = 32;
  p.rows = rows.get();
  EXPECT_EQ(cuda::LogitsProcessorsCuda(p, stream_), cudaSuccess);
  Sync();
  auto refused = [&](auto edit) {
    cuda::LogitsProcessorsParams q = p;
    edit(q);
    return cuda::LogitsProcessorsCuda(q, stream_) == cudaErrorInvalidValue;
  };
  EXPECT_TRUE(refused([](auto& q) { q.vocab_size = 0; }));
  EXPECT_TRUE(refused([](auto& q) { q.in_stride = 31; }));
  EXPECT_TRUE(refused([](auto& q) { q.out_stride = 31; }));
  EXPECT_TRUE(refused([](auto& q) { q.rows = nullptr; }));
  EXPECT_TRUE(refused([](auto& q) { q.num_rows = -1; }));

  // Processed log-probabilities need both the rows' sampling and their kept sets; the kept sets
  // are not reported in candidate mode.
  DeviceBuffer<int32_t> ids(2);
  DeviceBuffer<float> lps(2);
  DeviceBuffer<cuda::SampleRowParams> params(2);
  cuda::TopKLogprobsParams t;
  t.logits = in.get();
  t.logits_stride = 32;
  t.num_rows = 2;
  t.vocab_size = 32;
  t.k = 1;
  t.ids = ids.get();
  t.logprobs = lps.get();
  t.sampling = params.get();
  EXPECT_EQ(cuda::TopKLogprobsCuda(t, stream_), cudaErrorInvalidValue);
  DeviceBuffer<cuda::SampleCandidate> candidates(2);
  DeviceBuffer<uint64_t> kept(2);
  cuda::SampleParams s;
  s.logits = in.get();
  s.logits_stride = 32;
  s.rows = params.get();
  s.num_rows = 2;
  s.vocab_size = 32;
  s.candidates = candidates.get();
  s.kept_lower = kept.get();
  EXPECT_EQ(cuda::SampleCuda(s, stream_), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace specd
