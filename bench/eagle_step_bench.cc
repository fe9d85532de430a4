// The EAGLE drafter's step on the CPU head with the reference head (models/pycoder-eagle3: one
// layer, hidden 320, LM head over the whole 8192 vocabulary, taps 3 x 256 wide) at 1, 4 and 16
// sequences and the default tree shape (depth 4, top_k 4, max_nodes 16), with the head's GEMM
// matrices kept as bf16 (EagleHeadOptions::cpu_bf16_weights, the default: the same bits at half
// the bytes) or as fp32. The taps are random (the step's cost does not
// depend on their values: every level expands top_k nodes). Every step applies the same
// simulated outcome as bench/draft_step_bench.cc: the best child of the root and its best
// child accepted, then a bonus token, so the sequence grows by 3 and the next step's chain feeds
// 3 pairs. Counters: head forwards per step, pairs fed per step. One head thread; on a shared
// machine the CPU time column is the step's cost, the real time also counts waiting for a core.
//
// BM_EagleForward: one EagleHead::ForwardTopK (the drafter's call) of `rows` hidden-input nodes
// of one sequence with every row's output asked for, a tree level, over a 256-pair context.
//
// Run (the cases interleaved, so that a loaded machine's drift falls on all of them alike):
//   build/bench/eagle_step_bench --benchmark_repetitions=7
//       --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "engine/draft/eagle_drafter.h"
#include "engine/draft/eagle_head.h"
#include "engine/topk.h"
#include "tests/testutil/hf_fixtures.h"

namespace specd {
namespace {

constexpr int kPrompt = 64;
constexpr int kMaxLength = 640;  // well inside the head's 1024 positions

std::unique_ptr<EagleHead> LoadHead(bool bf16) {
  const std::string root = testutil::RepoRoot().string();
  EagleHeadOptions options;
  options.num_threads = 1;
  options.cpu_bf16_weights = bf16;
  absl::StatusOr<std::unique_ptr<EagleHead>> head =
      CreateEagleHead(root + "/models/pycoder-eagle3", root + "/models/pycoder-target", options);
  if (!head.ok()) return nullptr;
  return *std::move(head);
}

std::vector<float> RandomRows(int64_t rows, int64_t width, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(rows * width));
  for (float& x : v) x = normal(rng);
  return v;
}

int32_t Token(int64_t s, int64_t i) {
  return static_cast<int32_t>((s * 131 + i * 37 + 11) % 8000 + 100);
}

// state.range(0): sequences; state.range(1): 1 = bf16 matrices, 0 = fp32.
void BM_EagleStep(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  std::unique_ptr<EagleHead> head = LoadHead(state.range(1) == 1);
  if (head == nullptr) {
    state.SkipWithError("cannot load models/pycoder-eagle3");
    return;
  }
  const int64_t f = head->config().feature_size();
  EagleDrafter drafter(head.get());
  const DraftParams params{4, 4, 16};
  std::vector<DraftRequest> requests(batch);
  std::vector<int64_t> length(batch);
  // The taps of a request's new tokens: the verify step sends the rows of the pairs that end at
  // them, i.e. positions [length - n - 1, length - 1) once the sequence has a tree.
  auto restart = [&](int s) {
    if (drafter.HasSequence(s)) (void)drafter.Release(s);
    if (!drafter.AddSequence(s).ok()) std::abort();
    DraftRequest& r = requests[s];
    r = DraftRequest();
    r.seq = s;
    r.params = params;
    for (int i = 0; i < kPrompt; ++i) r.new_tokens.push_back(Token(s, i));
    r.taps = RandomRows(kPrompt, f, s);
    r.taps_first_position = 0;
    length[s] = kPrompt;
  };
  for (int s = 0; s < batch; ++s) restart(s);
  // Prefill: the prompt's tokens, then the first sampled token with all prompt taps.
  absl::StatusOr<std::vector<TokenTree>> trees = drafter.Draft(requests);
  if (!trees.ok()) std::abort();
  int64_t steps = 0, fed0 = 0;
  for (auto _ : state) {
    state.PauseTiming();
    for (int s = 0; s < batch; ++s) {
      const TokenTree& t = (*trees)[s];
      if (length[s] + 3 + params.max_nodes > kMaxLength) {
        restart(s);
        continue;
      }
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
      next.push_back(Token(s, length[s] * 7919));
      DraftRequest& r = requests[s];
      r.new_tokens = next;
      r.accepted_node = node;
      // Taps of the root and the accepted nodes: positions length-1 .. length-2+|next|.
      const int64_t n = static_cast<int64_t>(next.size());
      r.taps = RandomRows(n, f, static_cast<uint64_t>(s * 100003 + length[s]));
      r.taps_first_position = length[s] - 1;
      length[s] += n;
    }
    fed0 = drafter.fed_tokens();
    state.ResumeTiming();
    trees = drafter.Draft(requests);
    if (!trees.ok()) {
      state.SkipWithError(std::string(trees.status().message()).c_str());
      return;
    }
    state.PauseTiming();
    state.counters["fed"] += static_cast<double>(drafter.fed_tokens() - fed0);
    ++steps;
    state.ResumeTiming();
  }
  state.counters["fed"] /= static_cast<double>(std::max<int64_t>(steps, 1));
}
BENCHMARK(BM_EagleStep)
    ->ArgNames({"seqs", "bf16"})
    ->ArgsProduct({{1, 4, 16}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

// state.range(0): rows (tree nodes of one level); state.range(1): 1 = bf16 matrices, 0 = fp32.
void BM_EagleForward(benchmark::State& state) {
  const int rows = static_cast<int>(state.range(0));
  std::unique_ptr<EagleHead> head = LoadHead(state.range(1) == 1);
  if (head == nullptr) {
    state.SkipWithError("cannot load models/pycoder-eagle3");
    return;
  }
  const int64_t f = head->config().feature_size(), h = head->config().head.hidden_size;
  // A sequence holding a 256-pair chain, the context the level's nodes attend to.
  if (!head->AddSequence(0).ok()) std::abort();
  EagleHeadItem chain;
  chain.seq = 0;
  for (int i = 0; i < 256; ++i) chain.tokens.push_back(Token(0, i));
  chain.parents.resize(256);
  std::iota(chain.parents.begin(), chain.parents.end(), -1);
  const std::vector<float> taps = RandomRows(256, f, 1);
  chain.inputs = taps;
  EagleHeadOutputs out;
  if (!head->Forward({chain}, &out).ok()) std::abort();
  std::vector<int32_t> path(256);
  std::iota(path.begin(), path.end(), 0);
  if (!head->Commit(0, path).ok()) std::abort();

  EagleHeadItem level;
  level.seq = 0;
  level.input = EagleInput::kHidden;
  for (int i = 0; i < rows; ++i) level.tokens.push_back(Token(1, i));
  level.parents.assign(rows, -1);
  level.output_rows.resize(rows);
  std::iota(level.output_rows.begin(), level.output_rows.end(), 0);
  const std::vector<float> hidden = RandomRows(rows, h, 2);
  level.inputs = hidden;
  TopKRows top;
  for (auto _ : state) {
    if (!head->ForwardTopK({level}, 4, &out, &top).ok()) std::abort();
    state.PauseTiming();
    (void)head->Commit(0, {});
    state.ResumeTiming();
  }
}
BENCHMARK(BM_EagleForward)
    ->ArgNames({"rows", "bf16"})
    ->ArgsProduct({{1, 4, 16, 64}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace specd

BENCHMARK_MAIN();
