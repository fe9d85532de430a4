// The CUDA backend's Verify() with the logits processors (logit_bias, the penalties,
// min_tokens: kernels/cuda/logits_processors.cu), min_p and logprobs (raw from the logits,
// processed from the sampled rows over the sampler's kept set: kernels/cuda/topk.cu), all on the
// device, alone and in batches that mix them with plain items, held against three oracles:
//  - the host reference over the same GPU's logits: a twin sequence fed the same steps through
//    Forward() and AcceptTreeOnHost() (engine/sampling.cc's ProcessLogits, SampleToken and
//    ComputeLogprobs) must give the same tokens, accepted nodes and ranks, and logprobs within
//    1e-4;
//  - target-only decoding on the GPU (trees of no node): speculation with trees drafted from it
//    must emit the same tokens and log-probabilities, greedy and seeded (lossless verification,
//    penalties counting each node's own path);
//  - the fp32 CPU backend fed the same steps: its logit rows within bf16 accuracy of the GPU's,
//    the same greedy choices except where the processed logits are within twice the rows'
//    largest difference, and, where both pick the same tokens, logprobs within what that
//    difference implies.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/token_tree.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_tp_backend.h"
#include "engine/sampling.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

using gpu_test::RandomTokens;

std::unique_ptr<Backend> Load(const std::string& dir, const std::string& device) {
  BackendOptions opts;
  opts.device = device;
  opts.kv_capacity_tokens = 8192;
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir, opts);
  EXPECT_TRUE(b.ok()) << device << ": " << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

// One request of a batch: its sampling and what it asks of logprobs.
struct Spec {
  std::string name;
  SamplingParams sampling;
  int logprobs = -1;
  LogprobsMode mode = LogprobsMode::kRaw;
};

struct Batch {
  std::string name;
  std::vector<Spec> specs;
};

constexpr int kVocab = 320;
constexpr int kEos = 256;  // WriteRandomCheckpoint's <|eos|>

std::vector<Batch> Batches() {
  SamplingParams greedy;
  SamplingParams seeded;
  seeded.temperature = 0.8f;
  seeded.seed = 77;
  auto with = [](SamplingParams p, auto edit) {
    edit(p);
    return p;
  };
  const SamplingParams bias = with(greedy, [](SamplingParams& p) {
    p.logit_bias = {{5, 6.0f}, {17, -100.0f}, {200, 3.5f}, {41, 2.0f}};
  });
  const SamplingParams penalties = with(greedy, [](SamplingParams& p) {
    p.repetition_penalty = 1.4f;
    p.presence_penalty = 0.6f;
    p.frequency_penalty = 0.4f;
  });
  // min_tokens masks the EOS and two ids, one of them biased to be every row's argmax, so the
  // mask decides the first nine tokens (counted along each node's path) and the bias the rest.
  const SamplingParams min_tokens = with(greedy, [](SamplingParams& p) {
    p.min_tokens = 9;
    p.min_tokens_stop_ids = {kEos, 7, 8};
    p.logit_bias = {{7, 8.0f}};
  });
  const SamplingParams min_p = with(seeded, [](SamplingParams& p) {
    p.min_p = 0.08f;
    p.top_k = 50;
  });
  const SamplingParams seeded_all = with(seeded, [](SamplingParams& p) {
    p.temperature = 0.7f;
    p.top_p = 0.9f;
    p.min_p = 0.02f;
    p.repetition_penalty = 1.2f;
    p.frequency_penalty = 0.5f;
    p.logit_bias = {{9, 4.0f}, {123, -3.0f}};
  });
  const SamplingParams seeded_plain = with(seeded, [](SamplingParams& p) { p.top_k = 40; });
  using M = LogprobsMode;
  const SamplingParams min_p_only = with(seeded, [](SamplingParams& p) { p.min_p = 0.2f; });
  return {
      // Logits processors.
      {"logit_bias", {{"greedy", bias}}},
      {"penalties", {{"greedy", penalties}}},
      {"min_tokens", {{"greedy", min_tokens}}},
      {"seeded_processors", {{"seeded", seeded_all}}},
      // Sampling without processors (min_p too), with raw logprobs, or processed ones of greedy
      // rows.
      {"min_p", {{"seeded", min_p}}},
      {"min_p_only_logprobs_raw", {{"seeded", min_p_only, 3, M::kRaw}}},
      {"logprobs_raw_greedy", {{"plain", greedy, 5, M::kRaw}}},
      {"logprobs_raw_seeded_plain", {{"plain", seeded_plain, 20, M::kRaw}}},
      {"logprobs_processed_greedy_plain", {{"plain", greedy, 20, M::kProcessed}}},
      {"logprobs_token_only_plain", {{"plain", seeded, 0, M::kRaw}}},
      // Logprobs with processors, and processed ones of sampled rows.
      {"logprobs_raw_seeded", {{"penalties", seeded_all, 20, M::kRaw}}},
      {"logprobs_processed_greedy", {{"penalties", penalties, 4, M::kProcessed}}},
      {"logprobs_processed_seeded", {{"min_p", min_p, 7, M::kProcessed}}},
      {"logprobs_token_only", {{"bias", bias, 0, M::kProcessed}}},
      {"mixed",
       {{"plain_greedy", greedy},
        {"plain_greedy_logprobs", greedy, 2, M::kProcessed},
        {"plain_seeded_logprobs", seeded_plain, 6, M::kRaw},
        {"plain_seeded_processed_logprobs", seeded_plain, 1, M::kProcessed},
        {"bias_raw", bias, 3, M::kRaw},
        {"plain_seeded", seeded_plain},
        {"min_p", min_p},
        {"seeded_processed", seeded_all, 5, M::kProcessed},
        {"penalties", penalties},
        {"plain_greedy_2", greedy}}},
  };
}

// The per-position log-probability records of `a` and `b` agree: ranks exactly (when
// `exact_ranks`), values within `tol`, and the listed ids wherever the listed values are apart by
// more than 2 tol (closer ones may trade places).
void ExpectLogprobsNear(const std::vector<TokenLogprobs>& a, const std::vector<TokenLogprobs>& b,
                        double tol, bool exact_ranks, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE(what + " position " + std::to_string(i));
    EXPECT_NEAR(a[i].logprob, b[i].logprob, tol);
    // Different logits (not exact_ranks) may keep a token more or less at min_p's boundary.
    const size_t listed = std::min(a[i].top.size(), b[i].top.size());
    if (exact_ranks) {
      EXPECT_EQ(a[i].rank, b[i].rank);
      ASSERT_EQ(a[i].top.size(), b[i].top.size());
    }
    for (size_t j = 0; j < listed; ++j) {
      EXPECT_NEAR(a[i].top[j].logprob, b[i].top[j].logprob, tol) << "top " << j;
      // An id is compared where its neighbours on both sides are known and further apart than
      // the error (the last listed one's successor is not known).
      const float v = b[i].top[j].logprob;
      const bool apart = j + 1 < listed && v - b[i].top[j + 1].logprob > 2 * tol &&
                         (j == 0 || b[i].top[j - 1].logprob - v > 2 * tol);
      if (exact_ranks || apart) EXPECT_EQ(a[i].top[j].token, b[i].top[j].token) << "top " << j;
    }
  }
}

// Whether the greedy choice of `row` (processed by `item`'s processors along `node`'s path) could
// be `other` instead of `chosen` under a logit error of `delta`: the processed logits' gap is at
// most 2 delta (a repetition penalty scales a logit's error by at most the penalty).
bool GreedyNearTie(const VerifyItem& item, absl::Span<const float> row, int node, int32_t chosen,
                   int32_t other, double delta) {
  std::vector<int32_t> path;
  for (int n = node; n >= 0; n = item.tree.parents[n]) path.push_back(item.tree.tokens[n]);
  std::vector<float> l;
  ProcessLogits(row, item.sampling, item.history, path, &l);
  delta *= std::max(1.0f, item.sampling.repetition_penalty);
  return l[chosen] - l[other] <= 2 * delta + 1e-6;
}

class CudaVerifySamplingTest : public gpu_test::GpuTest {};

// cuda_backend_test's llama3 model, whose rows it holds to the CPU's within 2e-2 (drafts of the
// target-only continuation get accepted however flat the distributions are).
std::string WriteModel() {
  RandomCheckpointSpec spec;
  spec.vocab_size = kVocab;
  spec.hidden_size = 128;
  spec.intermediate_size = 352;
  spec.num_layers = 3;
  spec.num_heads = 6;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.dtype = DType::kBF16;
  spec.init_std = 0.08f;
  spec.llama3_rope_scaling = true;
  spec.rope_theta = 500000.0f;
  spec.model_type = "llama";
  const std::string dir = MakeTempDir("cuda_verify_sampling_");
  EXPECT_TRUE(WriteRandomCheckpoint(dir, spec).ok());
  return dir;
}

// Every batch of Batches() through `gpu`'s Verify(), against the three oracles.
void CheckAgainstOracles(Backend* gpu, Backend* cpu) {
  const VerifyFeatures features = gpu->verify_features();
  EXPECT_TRUE(features.logits_processors);
  EXPECT_TRUE(features.logprobs);

  std::mt19937_64 rng(2028);
  const std::vector<int32_t> prompt = RandomTokens(23, kVocab, rng);
  constexpr int kTargetTokens = 26;
  constexpr int kMaxSteps = 8;
  SeqId next_seq = 1;
  int batches_with_acceptance = 0;
  for (const Batch& batch : Batches()) {
    SCOPED_TRACE(batch.name);
    const size_t n = batch.specs.size();

    // Target-only decoding on the GPU (trees of no node), one batch a step.
    std::vector<std::vector<int32_t>> ref(n);
    std::vector<std::vector<TokenLogprobs>> ref_logprobs(n);
    {
      std::vector<SeqId> seqs(n);
      std::vector<TokenHistory> history(n);
      std::vector<std::vector<int32_t>> pending(n, prompt);
      for (size_t i = 0; i < n; ++i) {
        seqs[i] = next_seq++;
        ASSERT_TRUE(gpu->AddSequence(seqs[i]).ok());
        history[i].AddPrompt(prompt);
      }
      for (int t = 0; t < kTargetTokens; ++t) {
        std::vector<VerifyItem> items(n);
        for (size_t i = 0; i < n; ++i) {
          items[i].seq = seqs[i];
          items[i].pending = pending[i];
          items[i].sampling = batch.specs[i].sampling;
          items[i].history = &history[i];
          items[i].logprobs = batch.specs[i].logprobs;
          items[i].logprobs_mode = batch.specs[i].mode;
        }
        absl::StatusOr<std::vector<VerifyOutcome>> out = gpu->Verify(items);
        ASSERT_TRUE(out.ok()) << out.status();
        for (size_t i = 0; i < n; ++i) {
          const VerifyOutcome& o = (*out)[i];
          ASSERT_EQ(o.tokens.size(), 1u);
          ref[i].push_back(o.tokens[0]);
          history[i].AddOutput(o.tokens);
          if (batch.specs[i].logprobs >= 0) {
            ASSERT_EQ(o.logprobs.size(), 1u);
            ref_logprobs[i].push_back(o.logprobs[0]);
          } else {
            EXPECT_TRUE(o.logprobs.empty());
          }
          pending[i] = o.tokens;
        }
      }
      for (SeqId s : seqs) ASSERT_TRUE(gpu->RemoveSequence(s).ok());
    }

    // Speculation: seq[i] through Verify(), twin[i] through Forward() + AcceptTreeOnHost() on
    // the same GPU, and cpu_seq[i] on the CPU backend, which commits the GPU's path so all three
    // see the same prefix at every step.
    std::vector<SeqId> seq(n), twin(n), cpu_seq(n);
    std::vector<TokenHistory> history(n);
    std::vector<std::vector<int32_t>> pending(n, prompt), emitted(n);
    std::vector<std::vector<TokenLogprobs>> emitted_logprobs(n);
    for (size_t i = 0; i < n; ++i) {
      seq[i] = next_seq++;
      twin[i] = next_seq++;
      cpu_seq[i] = seq[i];
      ASSERT_TRUE(gpu->AddSequence(seq[i]).ok());
      ASSERT_TRUE(gpu->AddSequence(twin[i]).ok());
      ASSERT_TRUE(cpu->AddSequence(cpu_seq[i]).ok());
      history[i].AddPrompt(prompt);
    }
    int accepted_total = 0;
    int cpu_divergences = 0;
    for (int stepno = 0; stepno < kMaxSteps; ++stepno) {
      std::vector<VerifyItem> items(n);
      bool room = true;
      for (size_t i = 0; i < n; ++i) {
        const size_t at = emitted[i].size();
        if (at + 8 > ref[i].size()) room = false;
        if (!room) break;
        // A chain of the target-only continuation (one wrong token at depth 3 on odd steps),
        // each node with a random sibling, and a random second branch of two.
        TokenTree tree;
        int last = -1;
        for (int d = 0; d < 5; ++d) {
          int32_t tok = ref[i][at + d];
          if (stepno % 2 == 1 && d == 3) tok = (tok + 1) % kVocab;
          tree.tokens.push_back(tok);
          tree.parents.push_back(last);
          last = tree.size() - 1;
          tree.tokens.push_back(RandomTokens(1, kVocab, rng)[0]);
          tree.parents.push_back(d == 0 ? -1 : tree.parents[last]);
        }
        tree.tokens.push_back(RandomTokens(1, kVocab, rng)[0]);
        tree.parents.push_back(-1);
        tree.tokens.push_back(RandomTokens(1, kVocab, rng)[0]);
        tree.parents.push_back(tree.size() - 2);
        ASSERT_TRUE(ValidateTree(tree, kVocab).ok());
        items[i].seq = seq[i];
        items[i].pending = pending[i];
        items[i].tree = tree;
        items[i].sampling = batch.specs[i].sampling;
        items[i].history = &history[i];
        items[i].logprobs = batch.specs[i].logprobs;
        items[i].logprobs_mode = batch.specs[i].mode;
      }
      if (!room) break;

      // The twins' and the CPU's rows of the same step.
      std::vector<ForwardItem> twin_forward(n), cpu_forward(n);
      std::vector<int64_t> first_position(n);
      for (size_t i = 0; i < n; ++i) {
        VerifyItem t = items[i];
        t.seq = twin[i];
        absl::StatusOr<int64_t> first = MakeVerifyForward(*gpu, t, i, &twin_forward[i]);
        ASSERT_TRUE(first.ok()) << first.status();
        first_position[i] = *first;
        t.seq = cpu_seq[i];
        ASSERT_TRUE(MakeVerifyForward(*cpu, t, i, &cpu_forward[i]).ok());
      }
      std::vector<float> twin_rows, cpu_rows;
      ASSERT_TRUE(gpu->Forward(twin_forward, &twin_rows).ok());
      ASSERT_TRUE(cpu->Forward(cpu_forward, &cpu_rows).ok());

      absl::StatusOr<std::vector<VerifyOutcome>> out = gpu->Verify(items);
      ASSERT_TRUE(out.ok()) << out.status();
      ASSERT_EQ(out->size(), n);

      size_t row = 0;
      for (size_t i = 0; i < n; ++i) {
        SCOPED_TRACE(batch.specs[i].name + " step " + std::to_string(stepno));
        const VerifyOutcome& got = (*out)[i];
        const size_t nrows = twin_forward[i].logit_rows.size();
        const absl::Span<const float> gpu_rows =
            absl::Span<const float>(twin_rows).subspan(row * kVocab, nrows * kVocab);
        const absl::Span<const float> c_rows =
            absl::Span<const float>(cpu_rows).subspan(row * kVocab, nrows * kVocab);
        row += nrows;

        // 1. The host reference over this GPU's own rows.
        const VerifyOutcome want = AcceptTreeOnHost(items[i], gpu_rows, kVocab, first_position[i]);
        EXPECT_EQ(got.tokens, want.tokens);
        EXPECT_EQ(got.accepted_nodes, want.accepted_nodes);
        EXPECT_EQ(got.accepted_draft, static_cast<int>(got.accepted_nodes.size()));
        ExpectLogprobsNear(got.logprobs, want.logprobs, 1e-4, /*exact_ranks=*/true,
                           "host reference");
        ASSERT_TRUE(gpu->Commit(twin[i], AcceptedScratchPath(
                                             static_cast<int>(items[i].pending.size()), want))
                        .ok());

        // 2. The CPU backend: its rows within bf16 accuracy of the GPU's (the tolerance of
        // cuda_backend_test), and then, where both pick the same tokens, logprobs within what
        // the rows' largest difference implies; greedy choices may differ only where the
        // processed logits are that close. (Sampled choices are functions of the rows that the
        // host reference above already checks on the GPU's rows.)
        EXPECT_TRUE(gpu_test::RowsClose(std::vector<float>(gpu_rows.begin(), gpu_rows.end()),
                                        std::vector<float>(c_rows.begin(), c_rows.end()), kVocab,
                                        2e-2));
        double delta = 0;
        for (size_t k = 0; k < gpu_rows.size(); ++k) {
          delta = std::max<double>(delta, std::fabs(gpu_rows[k] - c_rows[k]));
        }
        const VerifyOutcome on_cpu = AcceptTreeOnHost(items[i], c_rows, kVocab, first_position[i]);
        const SamplingParams& p = items[i].sampling;
        if (on_cpu.tokens == got.tokens) {
          const bool scaled = batch.specs[i].mode == LogprobsMode::kProcessed && !p.greedy();
          // |log_softmax error| <= 2 x the logits' (a repetition penalty scales it by at most
          // the penalty); sampled processed rows also divide by the temperature, and a token
          // that min_p keeps on one side only moves the normaliser by at most min_p.
          const double d = batch.specs[i].mode == LogprobsMode::kProcessed
                               ? delta * std::max(1.0f, p.repetition_penalty)
                               : delta;
          const double tol = 1e-3 + (scaled ? 2 * d / p.temperature + p.min_p : 2 * d);
          if (!scaled || (p.top_k == 0 && p.top_p >= 1.0f)) {
            ExpectLogprobsNear(got.logprobs, on_cpu.logprobs, tol, /*exact_ranks=*/false, "cpu");
          }
        } else {
          ++cpu_divergences;
          size_t k = 0;
          while (k < got.tokens.size() && k < on_cpu.tokens.size() &&
                 got.tokens[k] == on_cpu.tokens[k]) {
            ++k;
          }
          ASSERT_LT(k, std::min(got.tokens.size(), on_cpu.tokens.size()));
          const int node = k == 0 ? -1 : got.accepted_nodes[k - 1];
          if (p.greedy()) {
            EXPECT_TRUE(GreedyNearTie(items[i], c_rows.subspan((node + 1) * kVocab, kVocab), node,
                                      on_cpu.tokens[k], got.tokens[k], delta))
                << "the CPU picks " << on_cpu.tokens[k] << ", the GPU " << got.tokens[k]
                << " at output position " << k << " (row error " << delta << ")";
          }
        }
        ASSERT_TRUE(cpu->Commit(cpu_seq[i],
                                AcceptedScratchPath(static_cast<int>(items[i].pending.size()), got))
                        .ok());

        accepted_total += got.accepted_draft;
        emitted[i].insert(emitted[i].end(), got.tokens.begin(), got.tokens.end());
        emitted_logprobs[i].insert(emitted_logprobs[i].end(), got.logprobs.begin(),
                                   got.logprobs.end());
        history[i].AddOutput(got.tokens);
        pending[i] = {got.tokens.back()};
      }
    }

    // 3. Lossless: speculation emitted what target-only decoding did.
    for (size_t i = 0; i < n; ++i) {
      SCOPED_TRACE(batch.specs[i].name);
      ASSERT_GE(emitted[i].size(), 8u);
      ASSERT_LE(emitted[i].size(), ref[i].size());
      EXPECT_EQ(emitted[i],
                std::vector<int32_t>(ref[i].begin(), ref[i].begin() + emitted[i].size()));
      if (batch.specs[i].logprobs >= 0) {
        const std::vector<TokenLogprobs> want(ref_logprobs[i].begin(),
                                              ref_logprobs[i].begin() + emitted[i].size());
        ExpectLogprobsNear(emitted_logprobs[i], want, 1e-4, /*exact_ranks=*/true, "target-only");
      }
      ASSERT_TRUE(gpu->RemoveSequence(seq[i]).ok());
      ASSERT_TRUE(gpu->RemoveSequence(twin[i]).ok());
      ASSERT_TRUE(cpu->RemoveSequence(cpu_seq[i]).ok());
    }
    if (accepted_total > 0) ++batches_with_acceptance;
    std::printf("%s: %d accepted draft tokens; %d item steps differ from the CPU backend's\n",
                batch.name.c_str(), accepted_total, cpu_divergences);
  }
  // Drafts of the target-only continuation must get accepted, or the trees test nothing.
  EXPECT_GE(batches_with_acceptance, static_cast<int>(Batches().size()) - 1);
}

TEST_F(CudaVerifySamplingTest, MatchesHostReferenceTargetOnlyAndCpu) {
  const std::string dir = WriteModel();
  std::unique_ptr<Backend> gpu = Load(dir, "cuda:0");
  std::unique_ptr<Backend> cpu = Load(dir, "cpu");
  ASSERT_NE(gpu, nullptr);
  ASSERT_NE(cpu, nullptr);
  CheckAgainstOracles(gpu.get(), cpu.get());
}

// The tensor-parallel CUDA backend over two GPUs (one where the host has one: the same split of
// the batch, and the ranks' device path, with a group of one).
TEST_F(CudaVerifySamplingTest, TensorParallelMatchesHostReferenceTargetOnlyAndCpu) {
  int n = 0;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  const std::string dir = WriteModel();
  BackendOptions options;
  options.device = "cuda:0";
  options.kv_capacity_tokens = 8192;
  CudaTpOptions tp;
  for (int d = 0; d < std::min(n, 2); ++d) tp.devices.push_back(d);
  absl::StatusOr<std::unique_ptr<CudaTensorParallelBackend>> gpu =
      CudaTensorParallelBackend::Create(dir, options, tp);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  std::unique_ptr<Backend> cpu = Load(dir, "cpu");
  ASSERT_NE(cpu, nullptr);
  std::printf("tensor parallel over %zu GPU(s)\n", tp.devices.size());
  CheckAgainstOracles(gpu->get(), cpu.get());
}

// Bad input names the field and changes nothing: a logit_bias id outside the vocabulary, in a
// batch with a valid plain item, is INVALID_ARGUMENT and leaves both sequences as they were.
TEST_F(CudaVerifySamplingTest, BadProcessorInputIsRejectedBeforeAnyStep) {
  RandomCheckpointSpec spec;
  spec.vocab_size = kVocab;
  spec.dtype = DType::kBF16;
  const std::string dir = MakeTempDir("cuda_verify_sampling_bad_");
  ASSERT_TRUE(WriteRandomCheckpoint(dir, spec).ok());
  std::unique_ptr<Backend> gpu = Load(dir, "cuda:0");
  ASSERT_NE(gpu, nullptr);
  ASSERT_TRUE(gpu->AddSequence(1).ok());
  ASSERT_TRUE(gpu->AddSequence(2).ok());
  VerifyItem plain;
  plain.seq = 1;
  plain.pending = {1, 2, 3};
  VerifyItem bad = plain;
  bad.seq = 2;
  bad.sampling.logit_bias = {{kVocab + 4, 1.0f}};
  absl::StatusOr<std::vector<VerifyOutcome>> out = gpu->Verify({plain, bad});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("logit_bias"), std::string::npos) << out.status();
  EXPECT_EQ(gpu->CommittedLength(1).value(), 0);
  EXPECT_EQ(gpu->CommittedLength(2).value(), 0);
  // A processor item that needs the history and has none.
  VerifyItem no_history = plain;
  no_history.seq = 2;
  no_history.sampling.presence_penalty = 1.0f;
  out = gpu->Verify({plain, no_history});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu->CommittedLength(1).value(), 0);
}

}  // namespace
}  // namespace specd
