// The goodput policy's per-step decision (GoodputPolicy::Decide) as the router makes it: its
// time is router time added to every speculative step, so it must stay small next to a verify
// step even at the largest batch. Sequences carry acceptance estimates fed from a fixed random
// sequence of outcomes; the cost model has measured buckets as a served run leaves it.
// DecideNgram: the same batches under `auto` with n-gram proposals (every other sequence has
// one, 8 tokens long), which add the proposal's candidates to those sequences' search.
//
//   build/bench/policy_decide_bench [--benchmark_filter=Decide/128]
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "engine/spec/policy.h"

namespace specd {
namespace {

struct Fixture {
  GoodputPolicy policy;
  std::vector<AcceptanceEstimate> acceptance, ngram;
  std::vector<PolicySequence> batch;

  Fixture(int n, double rate, bool padded, bool with_ngram = false)
      : policy(Options(padded)), acceptance(n), ngram(n) {
    std::mt19937 rng(1234);
    std::bernoulli_distribution accept(rate);
    const PolicyOptions& options = policy.options();
    for (int i = 0; i < n; ++i) {
      for (int step = 0; step < 32; ++step) {
        const SpecShape chain{4, 1, 4};
        int accepted = 0;
        while (accepted < 4 && accept(rng)) ++accepted;
        acceptance[i].Observe(chain, accepted, options);
        accepted = 0;
        while (accepted < 8 && accept(rng)) ++accepted;
        ngram[i].Observe(SpecShape{8, 1, 8}, accepted, options);
      }
    }
    // Costs as a GPU run leaves them: a few measured verify buckets per batch size and draft
    // levels, so Decide interpolates as it does in serving.
    for (int rows : {1, 4, 16, 64, 128}) {
      for (int tokens_per_row : {1, 5, 9, 17}) {
        for (int k = 0; k < 3; ++k) {
          policy.costs().ObserveVerify(rows, rows * tokens_per_row,
                                       4.5e-3 + 2e-5 * rows * tokens_per_row);
        }
      }
      for (int k = 0; k < 3; ++k) policy.costs().ObserveDraft(rows, 4, rows * 4, rows, 2.5e-3);
    }
    batch.resize(n);
    for (int i = 0; i < n; ++i) {
      PolicySequence& s = batch[i];
      s.pending = 1;
      s.max_depth = 16;
      s.acceptance = &acceptance[i];
      s.steps_without_draft = i % 7;
      s.steps_without_ngram = i % 5;
      if (with_ngram) {
        s.ngram_acceptance = &ngram[i];
        s.ngram_depth = i % 2 ? 8 : 0;
      }
    }
  }

  static PolicyOptions Options(bool padded) {
    PolicyOptions o;
    o.padded_rows = padded;
    return o;
  }
};

// Args: sequences, acceptance per level (percent).
void BM_Decide(benchmark::State& state) {
  Fixture f(static_cast<int>(state.range(0)), state.range(1) / 100.0, /*padded=*/true);
  for (auto _ : state) {
    PolicyDecision d = f.policy.Decide(f.batch);
    for (size_t i = 0; i < d.shapes.size(); ++i) f.batch[i].previous = d.shapes[i];
    benchmark::DoNotOptimize(d);
  }
  state.counters["seqs"] = static_cast<double>(state.range(0));
}
BENCHMARK(BM_Decide)->ArgsProduct({{1, 16, 64, 128, 256}, {20, 80}})->Unit(benchmark::kMicrosecond);

void BM_DecideNgram(benchmark::State& state) {
  Fixture f(static_cast<int>(state.range(0)), state.range(1) / 100.0, /*padded=*/true,
            /*with_ngram=*/true);
  for (auto _ : state) {
    PolicyDecision d = f.policy.Decide(f.batch);
    for (size_t i = 0; i < d.shapes.size(); ++i) {
      f.batch[i].previous = d.shapes[i];
      f.batch[i].previous_ngram = d.ngram[i] != 0;
    }
    benchmark::DoNotOptimize(d);
  }
  state.counters["seqs"] = static_cast<double>(state.range(0));
}
BENCHMARK(BM_DecideNgram)
    ->ArgsProduct({{1, 16, 64, 128, 256}, {20, 80}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace specd

BENCHMARK_MAIN();
