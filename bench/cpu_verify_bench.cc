// The CPU backend's whole verify step (Backend::Verify), one engine thread, on a random bf16 model
// of the shape of models/pycoder-target (H 320, FFN 864, 5 layers, 5 query heads and 1 KV head of
// 64, vocab 8192, tied; stored as bf16 as that model is), one sequence with a 256-token context,
// greedy. The last argument of BM_BackendVerify and BM_ForwardRows is
// BackendOptions::cpu_bf16_weights (1: matrices kept as bf16, the default; 0: fp32).
//  - BM_VerifyStep/nodes/accept: a plain step (nodes 0) or a chain of `nodes` draft tokens, of
//    which the first `accept` are the target's own greedy tokens (so accepted) and the rest are
//    not. Counters split the step into its phases, µs a step: prep (MakeVerifyForward), forward
//    (Backend::Forward, every row's logits), accept (AcceptTreeOnHost), commit (Commit).
//  - BM_ForwardRows/nodes/rows: Forward() of the same 1 + nodes tokens with logits of only the
//    last `rows` of them: what the LM head of the other rows costs.
// Run: build/bench/cpu_verify_bench --benchmark_min_time=0.5 --benchmark_repetitions=5
//          --benchmark_report_aggregates_only=true
#include <chrono>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "engine/backend.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

constexpr int kContext = 256;
constexpr SeqId kSeq = 1;

const std::string& PycoderDir() {
  static const std::string* dir = [] {
    RandomCheckpointSpec spec = PycoderTargetShape();
    spec.max_position_embeddings = 4096;
    spec.dtype = DType::kBF16;
    auto* d = new std::string(MakeTempDir("cpu_verify_bench_"));
    if (!WriteRandomCheckpoint(*d, spec).ok()) std::abort();
    return d;
  }();
  return *dir;
}

std::unique_ptr<Backend> Load(bool bf16_weights = true) {
  BackendOptions options;
  options.num_threads = 1;
  options.cpu_bf16_weights = bf16_weights;
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(PycoderDir(), options);
  if (!b.ok()) std::abort();
  return std::move(*b);
}

// A fresh sequence whose committed prefix is kContext tokens; returns the pending token.
int32_t Reset(Backend* b) {
  if (b->HasSequence(kSeq)) b->RemoveSequence(kSeq).IgnoreError();
  ForwardItem prefix;
  prefix.seq = kSeq;
  for (int i = 0; i < kContext; ++i) {
    prefix.tokens.push_back((7 + 31 * i) % 256);
    prefix.parents.push_back(i - 1);
  }
  prefix.logit_rows.push_back(kContext - 1);
  std::vector<float> logits;
  if (!b->AddSequence(kSeq).ok() || !b->Forward({prefix}, &logits).ok()) std::abort();
  std::vector<int32_t> path(kContext);
  std::iota(path.begin(), path.end(), 0);
  if (!b->Commit(kSeq, path).ok()) std::abort();
  return 42;
}

// The target's next `n` greedy tokens after `pending` (computed on a scratch chain, dropped).
std::vector<int32_t> GreedyContinuation(Backend* b, int32_t pending, int n) {
  std::vector<int32_t> out;
  ForwardItem f;
  f.seq = kSeq;
  f.tokens = {pending};
  f.parents = {-1};
  f.logit_rows = {0};
  const int vocab = b->config().vocab_size;
  std::vector<float> logits;
  for (int i = 0; i < n; ++i) {
    if (!b->Forward({f}, &logits).ok()) std::abort();
    const int32_t y = SampleToken(absl::Span<const float>(logits).first(vocab), {}, 0);
    out.push_back(y);
    f.tokens = {y};
    f.parents = {i};
  }
  b->Commit(kSeq, {}).IgnoreError();
  return out;
}

// The step's item: `nodes` chain nodes after `pending`, the first `accept` of them greedy.
VerifyItem MakeItem(Backend* b, int32_t pending, int nodes, int accept) {
  VerifyItem item;
  item.seq = kSeq;
  item.pending = {pending};
  const std::vector<int32_t> greedy = GreedyContinuation(b, pending, nodes);
  for (int i = 0; i < nodes; ++i) {
    // A token the target does not choose: the greedy one shifted.
    item.tree.tokens.push_back(i < accept ? greedy[i] : (greedy[i] + 1) % 256);
    item.tree.parents.push_back(i - 1);
  }
  return item;
}

double Micros(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

void BM_VerifyStep(benchmark::State& state) {
  std::unique_ptr<Backend> b = Load();
  const int nodes = static_cast<int>(state.range(0));
  const int accept = static_cast<int>(state.range(1));
  const int vocab = b->config().vocab_size;
  int32_t pending = Reset(b.get());
  int64_t committed = kContext;
  double prep = 0, forward = 0, walk = 0, commit = 0;
  for (auto _ : state) {
    // Each step commits 1 + accept tokens; the context is set back to kContext now and then.
    state.PauseTiming();
    if (committed > kContext + 256) {
      pending = Reset(b.get());
      committed = kContext;
    }
    const VerifyItem item = MakeItem(b.get(), pending, nodes, accept);
    state.ResumeTiming();
    const auto t0 = std::chrono::steady_clock::now();
    ForwardItem f;
    absl::StatusOr<int64_t> first = MakeVerifyForward(*b, item, 0, &f);
    if (!first.ok()) std::abort();
    const auto t1 = std::chrono::steady_clock::now();
    std::vector<float> logits;
    if (!b->Forward({f}, &logits).ok()) std::abort();
    const auto t2 = std::chrono::steady_clock::now();
    const VerifyOutcome out = AcceptTreeOnHost(item, logits, vocab, *first);
    const auto t3 = std::chrono::steady_clock::now();
    if (!b->Commit(kSeq, AcceptedScratchPath(1, out)).ok()) std::abort();
    const auto t4 = std::chrono::steady_clock::now();
    prep += Micros(t0, t1);
    forward += Micros(t1, t2);
    walk += Micros(t2, t3);
    commit += Micros(t3, t4);
    if (out.accepted_draft != accept) state.SkipWithError("unexpected acceptance");
    pending = out.tokens.back();
    committed += 1 + out.accepted_draft;
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["prep_us"] = prep / n;
  state.counters["forward_us"] = forward / n;
  state.counters["accept_us"] = walk / n;
  state.counters["commit_us"] = commit / n;
}
BENCHMARK(BM_VerifyStep)
    ->ArgNames({"nodes", "accept"})
    ->Args({0, 0})
    ->Args({4, 0})
    ->Args({4, 2})
    ->Args({4, 4})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Backend::Verify as the verify service calls it (the same step, timed whole).
void BM_BackendVerify(benchmark::State& state) {
  std::unique_ptr<Backend> b = Load(state.range(2) != 0);
  const int nodes = static_cast<int>(state.range(0));
  const int accept = static_cast<int>(state.range(1));
  int32_t pending = Reset(b.get());
  int64_t committed = kContext;
  for (auto _ : state) {
    state.PauseTiming();
    if (committed > kContext + 256) {
      pending = Reset(b.get());
      committed = kContext;
    }
    const VerifyItem item = MakeItem(b.get(), pending, nodes, accept);
    state.ResumeTiming();
    absl::StatusOr<std::vector<VerifyOutcome>> out = b->Verify({item});
    if (!out.ok()) std::abort();
    pending = (*out)[0].tokens.back();
    committed += 1 + (*out)[0].accepted_draft;
  }
}
BENCHMARK(BM_BackendVerify)
    ->ArgNames({"nodes", "accept", "bf16"})
    ->Args({0, 0, 1})
    ->Args({4, 2, 1})
    ->Args({4, 4, 1})
    ->Args({0, 0, 0})
    ->Args({4, 2, 0})
    ->Args({4, 4, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_ForwardRows(benchmark::State& state) {
  std::unique_ptr<Backend> b = Load(state.range(2) != 0);
  const int nodes = static_cast<int>(state.range(0));
  const int rows = static_cast<int>(state.range(1));
  Reset(b.get());
  ForwardItem f;
  f.seq = kSeq;
  for (int i = 0; i <= nodes; ++i) {
    f.tokens.push_back((5 + 13 * i) % 256);
    f.parents.push_back(i - 1);
  }
  for (int i = nodes + 1 - rows; i <= nodes; ++i) f.logit_rows.push_back(i);
  std::vector<float> logits;
  for (auto _ : state) {
    if (!b->Forward({f}, &logits).ok()) std::abort();
    b->Commit(kSeq, {}).IgnoreError();
  }
}
BENCHMARK(BM_ForwardRows)
    ->ArgNames({"nodes", "rows", "bf16"})
    ->Args({0, 1, 1})
    ->Args({4, 1, 1})
    ->Args({4, 5, 1})
    ->Args({0, 1, 0})
    ->Args({4, 1, 0})
    ->Args({4, 5, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace specd

BENCHMARK_MAIN();
