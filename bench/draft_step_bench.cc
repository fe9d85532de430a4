// The draft-model drafter's step on the CPU backend with the reference draft
// (models/pycoder-draft: 3 layers, hidden 128, vocabulary 8192), at 1, 8 and 32 sequences and
// the default tree shape (depth 4, top_k 4, max_nodes 16): the plain path (full logit rows to
// the host, then a host top-k; accepted tokens fed again next step) against the path with
// Backend::ForwardTopK and kept KV. Every step applies the same simulated outcome: the best
// child of the root and its best child accepted, then a bonus token, so the sequence grows by 3.
// Counters: forwards per step (levels), tokens fed per step. One backend thread; on a shared
// machine the CPU time column is the step's cost, the real time also counts waiting for a core.
//
// BM_HostTopK_*: one [vocab] row's top-k on the host, the full-sort selection the drafter used
// before (an id array partially sorted) against the one-pass RowTopKLogprobs.
//
// Run (the modes interleaved, so that a loaded machine's drift falls on all of them alike):
//   build/bench/draft_step_bench --benchmark_filter=BM_DraftStep --benchmark_repetitions=7
//       --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "engine/backend.h"
#include "engine/draft/draft_model_drafter.h"
#include "engine/topk.h"
#include "tests/testutil/counting_backend.h"
#include "tests/testutil/hf_fixtures.h"

namespace specd {
namespace {

constexpr int kPrompt = 64;
constexpr int kMaxLength = 640;  // well inside the draft's 1024 positions

std::vector<int32_t> Prompt(int s) {
  std::vector<int32_t> p(kPrompt);
  for (int i = 0; i < kPrompt; ++i) p[i] = (s * 131 + i * 37 + 11) % 8000 + 100;
  return p;
}

// state.range(0): sequences; state.range(1): 1 = backend top-k and kept KV, 0 = plain; 2 =
// backend top-k only, 3 = kept KV only (which of the two a difference comes from).
void BM_DraftStep(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const int64_t mode = state.range(1);
  const bool topk = mode == 1 || mode == 2, kept = mode == 1 || mode == 3;
  const std::string dir = (testutil::RepoRoot() / "models" / "pycoder-draft").string();
  // One thread: the step's CPU time is then its cost, whatever else the machine runs.
  BackendOptions options;
  options.num_threads = 1;
  absl::StatusOr<std::unique_ptr<Backend>> loaded = CreateBackend(dir, options);
  if (!loaded.ok()) {
    state.SkipWithError(std::string(loaded.status().message()).c_str());
    return;
  }
  CountingBackend model(loaded->get());
  DraftModelDrafter drafter(&model, {topk, kept});
  const DraftParams params{4, 4, 16};
  std::vector<DraftRequest> requests(batch);
  std::vector<int64_t> length(batch);
  auto restart = [&](int s) {
    if (drafter.HasSequence(s)) (void)drafter.Release(s);
    if (!drafter.AddSequence(s).ok()) std::abort();
    requests[s] = {s, Prompt(s), params};
    length[s] = kPrompt;
  };
  for (int s = 0; s < batch; ++s) restart(s);
  // The first step feeds the prompts; time the steady state after it.
  absl::StatusOr<std::vector<TokenTree>> trees = drafter.Draft(requests);
  if (!trees.ok()) std::abort();
  int64_t steps = 0, calls0 = 0, tokens0 = 0;
  for (auto _ : state) {
    state.PauseTiming();
    for (int s = 0; s < batch; ++s) {
      const TokenTree& t = (*trees)[s];
      if (length[s] + 3 + params.max_nodes > kMaxLength) {
        restart(s);
        continue;
      }
      // The best root child and its best child (children are listed best first), then a bonus.
      std::vector<int32_t> next;
      int32_t node = -1;
      for (int depth = 0; depth < 2; ++depth) {
        int32_t child = -1;
        for (int i = 0; i < t.size() && child < 0; ++i) {
          if (t.parents[i] == node) child = i;
        }
        if (child < 0) break;
        node = child;
        next.push_back(t.tokens[child]);
      }
      next.push_back(static_cast<int32_t>((length[s] * 7919) % 8000 + 100));
      requests[s] = {s, next, params, node};
      length[s] += static_cast<int64_t>(next.size());
    }
    calls0 = model.calls();
    tokens0 = model.tokens();
    state.ResumeTiming();
    trees = drafter.Draft(requests);
    if (!trees.ok()) {
      state.SkipWithError(std::string(trees.status().message()).c_str());
      return;
    }
    state.PauseTiming();
    state.counters["forwards"] += static_cast<double>(model.calls() - calls0);
    state.counters["fed"] += static_cast<double>(model.tokens() - tokens0);
    ++steps;
    state.ResumeTiming();
  }
  state.counters["forwards"] /= static_cast<double>(std::max<int64_t>(steps, 1));
  state.counters["fed"] /= static_cast<double>(std::max<int64_t>(steps, 1));
}
BENCHMARK(BM_DraftStep)
    ->ArgNames({"seqs", "mode"})
    ->ArgsProduct({{1, 8, 32}, {0, 1, 2, 3}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

std::vector<float> Row(int vocab) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> row(vocab);
  for (float& x : row) x = normal(rng);
  return row;
}

// The drafter's host top-k before Backend::ForwardTopK: an id array, partial_sort, two passes.
void BM_HostTopK_PartialSort(benchmark::State& state) {
  const std::vector<float> row = Row(static_cast<int>(state.range(0)));
  const int k = 4;
  for (auto _ : state) {
    std::vector<int32_t> ids(row.size());
    std::iota(ids.begin(), ids.end(), 0);
    float max_l = -std::numeric_limits<float>::infinity();
    for (float v : row) max_l = std::max(max_l, v);
    double sum = 0;
    for (float v : row) sum += std::exp(static_cast<double>(v) - max_l);
    const double log_z = max_l + std::log(sum);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
      return row[a] > row[b] || (row[a] == row[b] && a < b);
    });
    float out = static_cast<float>(row[ids[0]] - log_z);
    benchmark::DoNotOptimize(out);
  }
}
BENCHMARK(BM_HostTopK_PartialSort)->Arg(8192)->Arg(128256)->Unit(benchmark::kMicrosecond);

void BM_HostTopK_OnePass(benchmark::State& state) {
  const std::vector<float> row = Row(static_cast<int>(state.range(0)));
  int32_t ids[4];
  float lps[4];
  for (auto _ : state) {
    RowTopKLogprobs(row, 4, ids, lps);
    benchmark::DoNotOptimize(lps[0]);
  }
}
BENCHMARK(BM_HostTopK_OnePass)->Arg(8192)->Arg(128256)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace specd

BENCHMARK_MAIN();
