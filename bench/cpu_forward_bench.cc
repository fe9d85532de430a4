// CPU backend forward passes, one engine thread (num_threads = 1), on random fp32 models:
//  - BM_Prefill, BM_Decode, BM_VerifyTree: a Llama of ~15 M parameters (H 384, 6 layers);
//  - BM_Pycoder*: the shape of the project's reference target, models/pycoder-target (H 320,
//    FFN 864, 5 layers, 5 query heads and 1 KV head of 64, vocab 8192, tied): decode of 1-64
//    sequences, chains of 5 and binary trees of 17 verified at 1 and 16 sequences, each with all
//    rows' logits (what a verify step asks for).
// Run: OPENBLAS_NUM_THREADS=1 build/bench/cpu_forward_bench
#include <filesystem>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "engine/backend.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

const std::string& ModelDir() {
  static const std::string* dir = [] {
    RandomCheckpointSpec spec;
    spec.vocab_size = 8192;
    spec.hidden_size = 384;
    spec.intermediate_size = 1024;
    spec.num_layers = 6;
    spec.num_heads = 6;
    spec.num_kv_heads = 2;
    auto* d = new std::string(MakeTempDir("cpu_bench_"));
    if (!WriteRandomCheckpoint(*d, spec).ok()) std::abort();
    return d;
  }();
  return *dir;
}

const std::string& PycoderDir() {
  static const std::string* dir = [] {
    RandomCheckpointSpec spec = PycoderTargetShape();
    spec.max_position_embeddings = 1024;
    auto* d = new std::string(MakeTempDir("cpu_bench_pycoder_"));
    if (!WriteRandomCheckpoint(*d, spec).ok()) std::abort();
    return d;
  }();
  return *dir;
}

std::unique_ptr<Backend> Load(const std::string& dir = ModelDir()) {
  BackendOptions options;
  options.num_threads = 1;
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir, options);
  if (!b.ok()) std::abort();
  return std::move(*b);
}

ForwardItem Chain(SeqId seq, int n, int32_t first_token, bool all_rows) {
  ForwardItem it;
  it.seq = seq;
  for (int i = 0; i < n; ++i) {
    it.tokens.push_back((first_token + 31 * i) % 256);
    it.parents.push_back(i - 1);
    if (all_rows || i == n - 1) it.logit_rows.push_back(i);
  }
  return it;
}

void Prefix(Backend* b, SeqId seq, int len) {
  std::vector<float> logits;
  if (!b->AddSequence(seq).ok() || !b->Forward({Chain(seq, len, 7, false)}, &logits).ok()) {
    std::abort();
  }
  std::vector<int32_t> path(len);
  std::iota(path.begin(), path.end(), 0);
  if (!b->Commit(seq, path).ok()) std::abort();
}

void BM_Prefill(benchmark::State& state) {
  std::unique_ptr<Backend> b = Load();
  const int n = static_cast<int>(state.range(0));
  std::vector<float> logits;
  for (auto _ : state) {
    if (!b->AddSequence(1).ok() || !b->Forward({Chain(1, n, 3, false)}, &logits).ok()) {
      state.SkipWithError("forward failed");
    }
    b->RemoveSequence(1).IgnoreError();
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(n) * state.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Prefill)->Arg(32)->Arg(128)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime();

// `batch` sequences with a 256-token context each decode one token (scratch dropped after).
void BM_Decode(benchmark::State& state) {
  std::unique_ptr<Backend> b = Load();
  const int batch = static_cast<int>(state.range(0));
  std::vector<ForwardItem> items;
  for (int s = 0; s < batch; ++s) {
    Prefix(b.get(), s, 256);
    items.push_back(Chain(s, 1, 42 + s, true));
  }
  std::vector<float> logits;
  for (auto _ : state) {
    if (!b->Forward(items, &logits).ok()) state.SkipWithError("forward failed");
    for (int s = 0; s < batch; ++s) b->Commit(s, {}).IgnoreError();
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(batch) * state.iterations(),
                                                  benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Decode)->Arg(1)->Arg(4)->Arg(16)->Unit(benchmark::kMillisecond)->UseRealTime();

// One sequence (256-token context) verifies a tree: `nodes` nodes, a binary tree in BFS order.
void BM_VerifyTree(benchmark::State& state) {
  std::unique_ptr<Backend> b = Load();
  const int nodes = static_cast<int>(state.range(0));
  Prefix(b.get(), 1, 256);
  ForwardItem tree;
  tree.seq = 1;
  for (int i = 0; i < nodes; ++i) {
    tree.tokens.push_back((i * 13) % 256);
    tree.parents.push_back(i == 0 ? -1 : (i - 1) / 2);
    tree.logit_rows.push_back(i);
  }
  std::vector<float> logits;
  for (auto _ : state) {
    if (!b->Forward({tree}, &logits).ok()) state.SkipWithError("forward failed");
    b->Commit(1, {}).IgnoreError();
  }
  state.counters["nodes/s"] = benchmark::Counter(static_cast<double>(nodes) * state.iterations(),
                                                 benchmark::Counter::kIsRate);
}
BENCHMARK(BM_VerifyTree)
    ->Arg(1)
    ->Arg(8)
    ->Arg(32)
    ->Arg(64)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// `seqs` sequences with a 256-token context each run a forward item of `nodes` rows with every
// row's logits: shape 0 a chain (the verify step of a depth-(nodes - 1) chain), 1 a binary tree
// in BFS order, 2 one token (decode). The scratch is dropped after each step.
void PycoderStep(benchmark::State& state, int shape) {
  std::unique_ptr<Backend> b = Load(PycoderDir());
  const int seqs = static_cast<int>(state.range(0));
  const int nodes = shape == 2 ? 1 : static_cast<int>(state.range(1));
  std::vector<ForwardItem> items;
  for (int s = 0; s < seqs; ++s) {
    Prefix(b.get(), s, 256);
    ForwardItem it;
    it.seq = s;
    for (int i = 0; i < nodes; ++i) {
      it.tokens.push_back((s * 17 + i * 13) % 256);
      it.parents.push_back(i == 0 ? -1 : shape == 0 ? i - 1 : (i - 1) / 2);
      it.logit_rows.push_back(i);
    }
    items.push_back(std::move(it));
  }
  std::vector<float> logits;
  for (auto _ : state) {
    if (!b->Forward(items, &logits).ok()) state.SkipWithError("forward failed");
    for (int s = 0; s < seqs; ++s) b->Commit(s, {}).IgnoreError();
  }
  state.counters["rows"] = seqs * nodes;
  state.counters["rows/s"] = benchmark::Counter(
      static_cast<double>(seqs) * nodes * state.iterations(), benchmark::Counter::kIsRate);
}

void BM_PycoderDecode(benchmark::State& state) { PycoderStep(state, 2); }
BENCHMARK(BM_PycoderDecode)
    ->ArgName("seqs")
    ->Arg(1)
    ->Arg(4)
    ->Arg(16)
    ->Arg(64)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_PycoderChain(benchmark::State& state) { PycoderStep(state, 0); }
BENCHMARK(BM_PycoderChain)
    ->ArgNames({"seqs", "nodes"})
    ->Args({1, 5})
    ->Args({16, 5})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_PycoderTree(benchmark::State& state) { PycoderStep(state, 1); }
BENCHMARK(BM_PycoderTree)
    ->ArgNames({"seqs", "nodes"})
    ->Args({1, 17})
    ->Args({16, 17})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace specd

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  std::error_code ec;
  std::filesystem::remove_all(specd::ModelDir(), ec);
  std::filesystem::remove_all(specd::PycoderDir(), ec);
  return 0;
}
