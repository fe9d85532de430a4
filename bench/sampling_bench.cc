// Host cost of the sampling features a request can ask for, per emitted token, at the
// vocabulary sizes of the served families (Llama 3: 128256, Qwen2.5/3: 151936): the logits
// processors (penalties, bias, min_tokens) over a history of H distinct tokens, the sampler,
// and logprobs with the top 20. These run on the CPU backend's verify path once per row the tree
// walk reaches; a request that asks for none of them pays only SampleToken.
//
//   build/bench/sampling_bench --benchmark_repetitions=3 --benchmark_report_aggregates_only
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "engine/sampling.h"

namespace specd {
namespace {

std::vector<float> RandomRow(int vocab) {
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 3.0f);
  std::vector<float> row(vocab);
  for (float& v : row) v = n(rng);
  return row;
}

// args: vocab, distinct history tokens.
void BM_ProcessLogits(benchmark::State& state) {
  const int vocab = static_cast<int>(state.range(0));
  const int history_tokens = static_cast<int>(state.range(1));
  const std::vector<float> row = RandomRow(vocab);
  SamplingParams p;
  p.repetition_penalty = 1.1f;
  p.frequency_penalty = 0.3f;
  p.presence_penalty = 0.2f;
  p.logit_bias = {{1, 2.0f}, {2, -5.0f}};
  p.min_tokens = 1;
  p.min_tokens_stop_ids = {3};
  TokenHistory history;
  std::vector<int32_t> prompt, output;
  for (int i = 0; i < history_tokens; ++i) (i % 2 ? output : prompt).push_back(i * 37 % vocab);
  history.AddPrompt(prompt);
  history.AddOutput(output);
  const std::vector<int32_t> path = {5, 6, 7};
  std::vector<float> out;
  for (auto _ : state) {
    ProcessLogits(row, p, &history, path, &out);
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_ProcessLogits)
    ->Args({128256, 256})
    ->Args({128256, 4096})
    ->Args({151936, 4096})
    ->Unit(benchmark::kMicrosecond);

// args: vocab, greedy (1) or temperature 0.8 with top-p 0.9 (0).
void BM_SampleToken(benchmark::State& state) {
  const std::vector<float> row = RandomRow(static_cast<int>(state.range(0)));
  SamplingParams p;
  if (state.range(1) == 0) {
    p.temperature = 0.8f;
    p.top_p = 0.9f;
  }
  int64_t position = 0;
  for (auto _ : state) benchmark::DoNotOptimize(SampleToken(row, p, position++));
}
BENCHMARK(BM_SampleToken)
    ->Args({128256, 1})
    ->Args({128256, 0})
    ->Unit(benchmark::kMicrosecond);

// args: vocab, top n, raw (0) or processed with temperature and top-p (1).
void BM_ComputeLogprobs(benchmark::State& state) {
  const std::vector<float> row = RandomRow(static_cast<int>(state.range(0)));
  const int n = static_cast<int>(state.range(1));
  SamplingParams p;
  LogprobsMode mode = LogprobsMode::kRaw;
  if (state.range(2) == 1) {
    p.temperature = 0.8f;
    p.top_p = 0.9f;
    mode = LogprobsMode::kProcessed;
  }
  for (auto _ : state) {
    benchmark::DoNotOptimize(ComputeLogprobs(row, row, p, mode, 11, n));
  }
}
BENCHMARK(BM_ComputeLogprobs)
    ->Args({128256, 0, 0})
    ->Args({128256, 20, 0})
    ->Args({151936, 20, 0})
    ->Args({128256, 20, 1})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace specd

BENCHMARK_MAIN();
