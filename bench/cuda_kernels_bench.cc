// GPU kernel micro-benchmarks at Llama-3-8B shapes (32 query heads, 8 KV heads, head_dim 128,
// hidden 4096, vocab 128256, KV block 16): decode and tree-verify attention over the paged
// cache, RMSNorm with residual, the logits processors, sampling, the cuBLASLt GEMMs of one
// decode step, and the draft level's top-k. Times are CUDA-event times of back-to-back launches
// on one stream (launch overhead included, as in an eager forward pass), reported per launch;
// with BENCH_COLD=1, one launch at a time from a cold L2 (see ColdLaunches). Run:
// build/bench/cuda_kernels_bench
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "benchmark/benchmark.h"
#include "engine/cuda/cuda_tuning.h"
#include "engine/cuda/tree_mask.h"
#include "specd/kernels/cuda/gemm.h"
#include "specd/kernels/cuda/logits_processors.h"
#include "specd/kernels/cuda/rmsnorm.h"
#include "specd/kernels/cuda/sampling.h"
#include "specd/kernels/cuda/topk.h"
#include "specd/kernels/cuda/tree_attention.h"

namespace specd {
namespace {

using cuda::bf16;

constexpr int kHeads = 32, kKvHeads = 8, kHeadDim = 128, kBlock = 16, kHidden = 4096;
constexpr int kVocab = 128256;
constexpr int kLaunches = 20;  // launches per timed iteration

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::abort();
  }
}

template <typename T>
T* Alloc(size_t n, int byte = 0) {
  void* p = nullptr;
  Check(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc");
  Check(cudaMemset(p, byte, std::max<size_t>(n, 1) * sizeof(T)), "cudaMemset");
  return static_cast<T*>(p);
}

template <typename T>
T* Upload(const std::vector<T>& v) {
  T* p = Alloc<T>(v.size());
  Check(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return p;
}

// BENCH_COLD=1: every launch is timed alone, after a 256 MiB memset has pushed its data out of
// L2 (50 MiB on an H200). In a model step the KV cache and the weights come from HBM, since each
// step streams 16 GB of weights at the 8B shape; back to back, a kernel finds its inputs in L2
// (ninth run: cold adds 2-8 µs to attention, and keeps the order of the builds compared).
bool ColdLaunches() {
  static const bool cold = [] {
    const char* e = std::getenv("BENCH_COLD");
    return e != nullptr && e[0] == '1';
  }();
  return cold;
}

// Times `launch` (which enqueues on the stream) with CUDA events; returns the mean seconds per
// launch (Google Benchmark's rate counters divide by CPU time, which is not the GPU's).
template <typename F>
double TimeLaunches(benchmark::State& state, cudaStream_t stream, F&& launch) {
  double total = 0;
  int64_t launches = 0;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  constexpr size_t kFlushBytes = size_t{256} << 20;
  static unsigned char* flush = ColdLaunches() ? Alloc<unsigned char>(kFlushBytes) : nullptr;
  for (int i = 0; i < 3; ++i) launch();  // warm-up (and cuBLASLt plan creation)
  Check(cudaStreamSynchronize(stream), "warm-up");
  for (auto _ : state) {
    float ms = 0;
    if (flush == nullptr) {
      cudaEventRecord(start, stream);
      for (int i = 0; i < kLaunches; ++i) launch();
      cudaEventRecord(stop, stream);
      Check(cudaEventSynchronize(stop), "timing");
      cudaEventElapsedTime(&ms, start, stop);
    } else {
      for (int i = 0; i < kLaunches; ++i) {
        Check(cudaMemsetAsync(flush, i, kFlushBytes, stream), "flushing L2");
        cudaEventRecord(start, stream);
        launch();
        cudaEventRecord(stop, stream);
        Check(cudaEventSynchronize(stop), "timing");
        float one = 0;
        cudaEventElapsedTime(&one, start, stop);
        ms += one;
      }
    }
    state.SetIterationTime(ms / 1e3 / kLaunches);
    total += ms / 1e3;
    launches += kLaunches;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return launches > 0 ? total / launches : 0.0;
}

// Attention of `batch` sequences of `context` committed tokens plus, per sequence, a chain of
// one token (decode) or a tree of `nodes` nodes below one pending token: random parents (kRandom),
// a chain (kChain: each node's parent is the one before, so every query's keys are contiguous
// slots and the kernel needs no window loads) or a star (kStar: every node hangs from the first,
// so nearly every query needs a window) or 4-ary (kQuad: four roots below the pending token, node
// j > 3 below node j / 4 - 1, breadth first: the top-k draft tree that cuda_step_bench verifies).
// Without `masks` the mask pointers are null (allowed
// without trees, and for a chain, whose keys the masks do not change; the kernel is then built
// without the tree machinery).
#ifdef SPECD_ATTN_PROFILE
// Where the last launch's CTAs spent their time (profiling builds, TreeAttentionProfile), split
// into CTAs that ran window jobs and those that did not: how many, when they started after the
// first (waves), how long they took, and their cycles until the PDL wait, in plain jobs and in
// window jobs (µs at the SM clock). One line a class, on stdout.
void PrintAttentionProfile(const std::string& name, int64_t ctas) {
  static std::set<std::string> printed;  // a benchmark runs its case several times
  if (!printed.insert(name).second) return;
  ctas = std::min<int64_t>(ctas, cuda::kTreeAttentionProfileCtas);
  constexpr int kF = cuda::kTreeAttentionProfileFields;
  std::vector<unsigned long long> r(static_cast<size_t>(ctas) * kF);
  Check(cuda::TreeAttentionProfile(r.data(), ctas), "attention profile");
  int clock_khz = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  const double cyc_us = 1e3 / clock_khz;
  unsigned long long t0 = ~0ull, t1 = 0;
  for (int64_t c = 0; c < ctas; ++c) {
    t0 = std::min(t0, r[c * kF]);
    t1 = std::max(t1, r[c * kF + 1]);
  }
  const auto stats = [](std::vector<double> v) {
    if (v.empty()) return std::string("-");
    std::sort(v.begin(), v.end());
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.1f/%.1f/%.1f", v.front(), v[v.size() / 2], v.back());
    return std::string(buf);
  };
  std::printf("# profile %s: %lld CTAs, span %.2f us (min/median/max us)\n", name.c_str(),
              static_cast<long long>(ctas), (t1 - t0) * 1e-3);
  for (int win = 0; win < 2; ++win) {
    std::vector<double> v[10];
    for (int64_t c = 0; c < ctas; ++c) {
      const unsigned long long* x = &r[c * kF];
      if ((x[11] > 0) != (win == 1)) continue;
      v[0].push_back((x[0] - t0) * 1e-3);
      v[1].push_back((x[1] - x[0]) * 1e-3);
      for (int f = 3; f < 10; ++f) v[f - 1].push_back(x[f] * cyc_us);
      v[9].push_back(static_cast<double>(x[11]));
    }
    if (v[0].empty()) continue;
    std::printf(
        "#   %s %zu: start %s, duration %s, to PDL wait %s, plain %s, window %s "
        "(group %s, tables %s, load %s, passes %s), window sub-chunks %s\n",
        win ? "window CTAs" : "plain CTAs", v[0].size(), stats(v[0]).c_str(), stats(v[1]).c_str(),
        stats(v[2]).c_str(), stats(v[3]).c_str(), stats(v[4]).c_str(), stats(v[5]).c_str(),
        stats(v[6]).c_str(), stats(v[7]).c_str(), stats(v[8]).c_str(), stats(v[9]).c_str());
  }
}
#endif

enum TreeShape { kRandom = 0, kChain = 1, kStar = 2, kQuad = 3 };
void RunAttention(benchmark::State& state, int batch, int context, int nodes, bool masks = true,
                  TreeShape shape = kRandom) {
  std::mt19937_64 rng(1);
  const int per_seq_keys = context + 1 + nodes;
  const int blocks_per_seq = (per_seq_keys + kBlock - 1) / kBlock;
  const int num_blocks = batch * blocks_per_seq;
  std::vector<int32_t> pool(num_blocks);
  std::iota(pool.begin(), pool.end(), 0);
  // Scattered blocks; BENCH_ATTN_ORDERED=1 keeps each sequence's blocks in order, one after
  // another in memory, as the engine's allocator hands them out to a fresh sequence.
  if (const char* e = std::getenv("BENCH_ATTN_ORDERED"); e == nullptr || e[0] != '1') {
    std::shuffle(pool.begin(), pool.end(), rng);
  }
  std::vector<int32_t> query_seq, kv_end, mask_begin;
  std::vector<uint32_t> mask;
  const char* spine_env = std::getenv("BENCH_ATTN_SPINE");
  const bool spine_masks = spine_env != nullptr && spine_env[0] == '1';
  for (int s = 0; s < batch; ++s) {
    query_seq.push_back(s);
    kv_end.push_back(context + 1);
    mask_begin.push_back(context + 1);
    mask.insert(mask.end(), cuda::kTreeAttentionMaskWords, 0u);
    std::vector<int32_t> parents, depth;  // of the nodes; -1: the pending token
    for (int j = 0; j < nodes; ++j) {
      const int parent = j == 0            ? -1
                         : shape == kChain ? j - 1
                         : shape == kStar  ? 0
                         : shape == kQuad  ? (j < 4 ? -1 : j / 4 - 1)
                                           : static_cast<int>(rng() % j);
      parents.push_back(parent);
      depth.push_back(parent < 0 ? 0 : depth[parent] + 1);
      // mask_begin is the pending token's end for every node, unless BENCH_ATTN_SPINE=1: then,
      // as the engine encoded a tree before it shared one spine end a sequence
      // (engine/cuda/tree_mask.h), a node's leading ancestors that form the chain 0, 1, 2, ... from
      // the pending token are given by mask_begin instead of mask bits (the same keys), so that
      // mask_begin differs between the queries of a tile.
      const int32_t a = spine_masks ? SpineEnd(parents, depth, j) : -1;
      const int first = a + 1;  // the node's ancestors before node `first` lie on the spine
      std::vector<uint32_t> bits(cuda::kTreeAttentionMaskWords, 0u);
      SetTreeMaskBits(parents, j, a, absl::MakeSpan(bits));
      query_seq.push_back(s);
      kv_end.push_back(context + 1 + j + 1);
      mask_begin.push_back(context + 1 + first);
      mask.insert(mask.end(), bits.begin(), bits.end());
    }
  }
  const int num_queries = static_cast<int>(query_seq.size());
  int num_sms = 0;
  cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0);
  const cuda::TreeAttentionPlan plan = cuda::PlanTreeAttention(
      query_seq.data(), kv_end.data(), num_queries, kHeads, kKvHeads, num_sms);
  const int64_t kv_dim = kKvHeads * kHeadDim;
  const int64_t slots = int64_t{num_blocks} * kBlock;
  // 0x3c3c is bf16 0.0115: finite data, every score alike. BENCH_ATTN_RANDOM=1 fills q, K and V
  // with N(0, 1) values instead, as a model's are (to see whether the data changes the time).
  bf16* k = Alloc<bf16>(slots * kv_dim, 0x3c);
  bf16* v = Alloc<bf16>(slots * kv_dim, 0x3c);
  bf16* q = Alloc<bf16>(size_t(num_queries) * kHeads * kHeadDim, 0x3c);
  if (const char* e = std::getenv("BENCH_ATTN_RANDOM"); e != nullptr && e[0] == '1') {
    std::normal_distribution<float> normal;
    for (auto [ptr, n] : {std::pair<bf16*, size_t>{k, slots * kv_dim},
                          {v, slots * kv_dim},
                          {q, size_t(num_queries) * kHeads * kHeadDim}}) {
      std::vector<bf16> h(n);
      for (bf16& x : h) x = __float2bfloat16(normal(rng));
      Check(cudaMemcpy(ptr, h.data(), n * sizeof(bf16), cudaMemcpyHostToDevice), "upload");
    }
  }
  bf16* out = Alloc<bf16>(size_t(num_queries) * kHeads * kHeadDim);
  int32_t* d_tables = Upload(pool);
  int32_t *d_qs = Upload(query_seq), *d_end = Upload(kv_end), *d_mb = Upload(mask_begin);
  uint32_t* d_mask = Upload(mask);
  int32_t *d_tb = Upload(plan.tile_begin), *d_te = Upload(plan.tile_end);
  // As the engine sets it: the committed prefix of each sequence was written before the step.
  int32_t* d_stable = Upload(std::vector<int32_t>(batch, context));
  float* ws = Alloc<float>(
      cuda::TreeAttentionWorkspaceFloats(plan.num_splits, num_queries, kHeads, kHeadDim));
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  cuda::TreeAttentionParams p;
  p.q = q;
  p.q_stride = kHeads * kHeadDim;
  p.out = out;
  p.out_stride = kHeads * kHeadDim;
  p.kv.k_cache = k;
  p.kv.v_cache = v;
  p.kv.block_tables = d_tables;
  p.kv.max_blocks_per_seq = blocks_per_seq;
  p.kv.block_size = kBlock;
  p.query_seq = d_qs;
  p.kv_end = d_end;
  p.mask_begin = masks ? d_mb : nullptr;
  p.mask = masks ? d_mask : nullptr;
  // BENCH_ATTN_NO_EARLY=1: no kv_stable_end, so the first load waits for the PDL wait.
  const char* no_early = std::getenv("BENCH_ATTN_NO_EARLY");
  p.kv_stable_end = no_early != nullptr && no_early[0] == '1' ? nullptr : d_stable;
  p.tile_begin = d_tb;
  p.tile_end = d_te;
  p.num_tiles = static_cast<int64_t>(plan.tile_begin.size());
  p.num_splits = plan.num_splits;
  p.chunks_per_cta = plan.chunks_per_cta;
  // Experiment switches: BENCH_ATTN_UNSPLIT=1 runs one CTA per tile over every chunk;
  // BENCH_ATTN_CPC=c gives each split CTA c chunks.
  if (const char* e = std::getenv("BENCH_ATTN_UNSPLIT"); e != nullptr && e[0] == '1') {
    p.num_splits = 1;
    p.chunks_per_cta = 1;
  } else if (const char* c = std::getenv("BENCH_ATTN_CPC"); c != nullptr && p.num_splits > 1) {
    p.chunks_per_cta = std::max(1, std::min(p.num_splits, std::atoi(c)));
  }
  p.workspace = ws;
  p.num_queries = num_queries;
  p.num_heads = kHeads;
  p.num_kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.scale = 0.088f;
  const double sec =
      TimeLaunches(state, stream, [&] { Check(cuda::TreeAttentionCuda(p, stream), "attention"); });
  const double kv_bytes = double(batch) * per_seq_keys * kv_dim * 2 * sizeof(bf16);
  state.counters["kv_GBps"] = kv_bytes / 1e9 / sec;
  state.counters["splits"] = p.num_splits;
  state.counters["ctas"] = double(plan.tile_begin.size()) * kKvHeads *
                           ((p.num_splits + p.chunks_per_cta - 1) / p.chunks_per_cta);
#ifdef SPECD_ATTN_PROFILE
  PrintAttentionProfile(absl::StrCat("batch ", batch, " context ", context, " nodes ", nodes,
                                     " masks ", masks, " shape ", shape),
                        static_cast<int64_t>(state.counters["ctas"]));
#endif
  cudaStreamDestroy(stream);
  for (void* ptr : {static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(q),
                    static_cast<void*>(out), static_cast<void*>(d_tables), static_cast<void*>(d_qs),
                    static_cast<void*>(d_end), static_cast<void*>(d_mb), static_cast<void*>(d_mask),
                    static_cast<void*>(d_tb), static_cast<void*>(d_te),
                    static_cast<void*>(d_stable), static_cast<void*>(ws)}) {
    cudaFree(ptr);
  }
}

void BM_DecodeAttention(benchmark::State& state) {
  RunAttention(state, static_cast<int>(state.range(0)), static_cast<int>(state.range(1)), 0,
               state.range(2) != 0);
}
BENCHMARK(BM_DecodeAttention)
    ->ArgNames({"batch", "context", "masks"})
    ->ArgsProduct({{1, 8, 32}, {512, 2048, 8192}, {1, 0}})
    ->UseManualTime()
    ->MinTime(0.05);

void BM_VerifyAttention(benchmark::State& state) {
  RunAttention(state, 1, static_cast<int>(state.range(1)), static_cast<int>(state.range(0)));
}
BENCHMARK(BM_VerifyAttention)
    ->ArgNames({"nodes", "context"})
    ->ArgsProduct({{16, 64, 256}, {2048, 8192}})
    ->UseManualTime()
    ->MinTime(0.05);

// Where a verify step's attention time goes: the same node count as a random tree, a chain (no
// window loads; with masks, and without them as a prefill of the same tokens would run), a star
// (a window for nearly every node) and the step benchmark's 4-ary tree.
void BM_VerifyAttentionShape(benchmark::State& state) {
  const TreeShape shape = static_cast<TreeShape>(state.range(2));
  const bool masks = state.range(3) != 0;
  if (!masks && shape != kChain) {
    state.SkipWithError("only a chain runs without masks");
    return;
  }
  RunAttention(state, 1, static_cast<int>(state.range(1)), static_cast<int>(state.range(0)), masks,
               shape);
}
BENCHMARK(BM_VerifyAttentionShape)
    ->ArgNames({"nodes", "context", "shape", "masks"})
    ->Args({64, 512, kChain, 0})
    ->Args({64, 512, kChain, 1})
    ->Args({64, 512, kQuad, 1})
    ->Args({16, 512, kQuad, 1})
    ->Args({128, 512, kQuad, 1})
    ->Args({16, 2048, kQuad, 1})
    ->Args({64, 2048, kRandom, 1})
    ->Args({64, 2048, kChain, 1})
    ->Args({64, 2048, kChain, 0})
    ->Args({64, 2048, kStar, 1})
    ->Args({64, 2048, kQuad, 1})
    ->Args({256, 2048, kRandom, 1})
    ->Args({256, 2048, kChain, 1})
    ->Args({256, 2048, kChain, 0})
    ->Args({256, 2048, kStar, 1})
    ->Args({256, 2048, kQuad, 1})
    ->UseManualTime()
    ->MinTime(0.05);

// Several sequences verifying trees in one step (serving): per sequence a pending token and a
// tree of `nodes` nodes.
void BM_VerifyAttentionBatch(benchmark::State& state) {
  RunAttention(state, static_cast<int>(state.range(0)), static_cast<int>(state.range(2)),
               static_cast<int>(state.range(1)));
}
BENCHMARK(BM_VerifyAttentionBatch)
    ->ArgNames({"batch", "nodes", "context"})
    ->ArgsProduct({{4, 16}, {16, 64}, {2048}})
    ->UseManualTime()
    ->MinTime(0.05);

void BM_RmsNormResidual(benchmark::State& state) {
  const int rows = static_cast<int>(state.range(0));
  bf16* x = Alloc<bf16>(size_t(rows) * kHidden, 0x3c);
  float* w = Alloc<float>(kHidden, 0x3c);  // the fp32 norm weight
  bf16* out = Alloc<bf16>(size_t(rows) * kHidden);
  float* res = Alloc<float>(size_t(rows) * kHidden);
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  cuda::RmsNormParams p;
  p.x = x;
  p.residual = res;
  p.weight = w;
  p.out = out;
  p.rows = rows;
  p.dim = kHidden;
  const double sec =
      TimeLaunches(state, stream, [&] { Check(cuda::RmsNormCuda(p, stream), "rmsnorm"); });
  // x and out bf16, residual fp32 read and written.
  const double bytes = double(rows) * kHidden * (2 + 2 + 8);
  state.counters["GBps"] = bytes / 1e9 / sec;
  cudaStreamDestroy(stream);
  cudaFree(x);
  cudaFree(w);
  cudaFree(out);
  cudaFree(res);
}
BENCHMARK(BM_RmsNormResidual)->Arg(1)->Arg(64)->Arg(257)->UseManualTime()->MinTime(0.05);

// mode 0: greedy; 1: temperature 1; 2: temperature 0.8, top-k 50, top-p 0.9; 3: top-p 0.9.
void BM_Sample(benchmark::State& state) {
  const int rows = static_cast<int>(state.range(0));
  const int mode = static_cast<int>(state.range(1));
  std::mt19937_64 rng(2);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(size_t(rows) * kVocab);
  for (float& x : logits) x = normal(rng);
  std::vector<cuda::SampleRowParams> params(rows);
  for (int r = 0; r < rows; ++r) {
    params[r].seed = 42;
    params[r].position = 1000 + r;
    params[r].temperature = mode == 0 ? 0.0f : mode == 2 ? 0.8f : 1.0f;
    params[r].top_k = mode == 2 ? 50 : 0;
    params[r].top_p = mode >= 2 ? 0.9f : 1.0f;
  }
  float* d_logits = Upload(logits);
  cuda::SampleRowParams* d_params = Upload(params);
  int32_t* d_tokens = Alloc<int32_t>(rows);
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  cuda::SampleParams p;
  p.logits = d_logits;
  p.logits_stride = kVocab;
  p.rows = d_params;
  p.tokens = d_tokens;
  p.num_rows = rows;
  p.vocab_size = kVocab;
  // With the workspace, as the engine runs it: greedy and plain-temperature rows split the
  // vocabulary over many CTAs.
  void* ws = Alloc<uint8_t>(static_cast<size_t>(cuda::SampleWorkspaceBytes(rows, kVocab)));
  p.workspace = ws;
  TimeLaunches(state, stream, [&] { Check(cuda::SampleCuda(p, stream), "sample"); });
  cudaFree(ws);
  cudaStreamDestroy(stream);
  cudaFree(d_logits);
  cudaFree(d_params);
  cudaFree(d_tokens);
}
BENCHMARK(BM_Sample)
    ->ArgNames({"rows", "mode"})
    ->ArgsProduct({{1, 65, 257}, {0, 1, 2, 3}})
    ->UseManualTime()
    ->MinTime(0.05);

// The draft level's top-k log-probabilities (kernels/cuda/topk.cu) over `rows` rows of the
// vocabulary, k = `k`: split 0 is one CTA a row (no workspace), split 1 the vocabulary split
// over TopKChunks CTAs a row and merged (the engine's draft path). Side by side per shape.
void BM_TopK(benchmark::State& state) {
  const int rows = static_cast<int>(state.range(0));
  const int k = static_cast<int>(state.range(1));
  const bool split = state.range(2) != 0;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(size_t(rows) * kVocab);
  for (float& x : logits) x = normal(rng);
  float* d_logits = Upload(logits);
  int32_t* d_ids = Alloc<int32_t>(size_t(rows) * k);
  float* d_lps = Alloc<float>(size_t(rows) * k);
  const int64_t ws_bytes = cuda::TopKWorkspaceBytes(rows, kVocab, k);
  void* ws = Alloc<uint8_t>(static_cast<size_t>(ws_bytes));
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  cuda::TopKLogprobsParams p;
  p.logits = d_logits;
  p.logits_stride = kVocab;
  p.num_rows = rows;
  p.vocab_size = kVocab;
  p.k = k;
  p.ids = d_ids;
  p.logprobs = d_lps;
  if (split) {
    p.workspace = ws;
    p.workspace_bytes = ws_bytes;
  }
  TimeLaunches(state, stream, [&] { Check(cuda::TopKLogprobsCuda(p, stream), "top-k"); });
  state.counters["chunks"] = split ? cuda::TopKChunks(rows, kVocab) : 1;
  cudaStreamDestroy(stream);
  cudaFree(ws);
  cudaFree(d_logits);
  cudaFree(d_ids);
  cudaFree(d_lps);
}
BENCHMARK(BM_TopK)
    ->ArgNames({"rows", "k", "split"})
    ->ArgsProduct({{1, 4, 32, 128, 512}, {4, 16}, {0, 1}})
    ->UseManualTime()
    ->MinTime(0.05);

// The logits processors of one verify step (kernels/cuda/logits_processors.cu): `rows` rows of
// one sequence, row j continuing a chain of j tree nodes, with logit_bias (16 ids), min_tokens
// and the three penalties over a history of `history` distinct tokens (0: bias and min_tokens
// only). Includes the copy of every row into the processed buffer.
void BM_LogitsProcessors(benchmark::State& state) {
  const int rows = static_cast<int>(state.range(0));
  const int history = static_cast<int>(state.range(1));
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(size_t(rows) * kVocab);
  for (float& x : logits) x = normal(rng);
  cuda::LogitsProcessorSeq seq;
  if (history > 0) {
    seq.repetition_penalty = 1.2f;
    seq.presence_penalty = 0.5f;
    seq.frequency_penalty = 0.3f;
  }
  seq.min_tokens = 4;
  std::vector<int32_t> data;
  seq.history_begin = 0;
  seq.history_count = history;
  for (int i = 0; i < history; ++i) {
    // Sorted distinct ids spread over the vocabulary.
    data.insert(data.end(), {static_cast<int32_t>(i * (kVocab / std::max(history, 1))),
                             static_cast<int32_t>(rng() % 3), static_cast<int32_t>(rng() % 2)});
  }
  seq.bias_begin = static_cast<int32_t>(data.size());
  seq.bias_count = 16;
  for (int i = 0; i < 16; ++i) data.insert(data.end(), {i * 97, 0x40000000 /* 2.0f */});
  seq.stop_begin = static_cast<int32_t>(data.size());
  seq.stop_count = 2;
  data.insert(data.end(), {128001, 128009});
  std::vector<cuda::LogitsProcessorRow> row_params(rows);
  const int path_begin = static_cast<int>(data.size());
  for (int j = 0; j < rows; ++j) data.push_back(static_cast<int32_t>(rng() % kVocab));
  for (int r = 0; r < rows; ++r) {
    row_params[r].seq = 0;
    row_params[r].path_begin = path_begin;
    row_params[r].path_len = r;
  }
  float* d_in = Upload(logits);
  float* d_out = Alloc<float>(logits.size());
  cuda::LogitsProcessorSeq* d_seq = Upload(std::vector<cuda::LogitsProcessorSeq>{seq});
  cuda::LogitsProcessorRow* d_rows = Upload(row_params);
  int32_t* d_data = Upload(data);
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  cuda::LogitsProcessorsParams p;
  p.in = d_in;
  p.in_stride = kVocab;
  p.out = d_out;
  p.out_stride = kVocab;
  p.num_rows = rows;
  p.vocab_size = kVocab;
  p.rows = d_rows;
  p.seqs = d_seq;
  p.data = d_data;
  const double sec = TimeLaunches(
      state, stream, [&] { Check(cuda::LogitsProcessorsCuda(p, stream), "logits processors"); });
  state.counters["GBps"] = 2.0 * rows * kVocab * sizeof(float) / 1e9 / sec;
  cudaStreamDestroy(stream);
  for (void* ptr : {static_cast<void*>(d_in), static_cast<void*>(d_out), static_cast<void*>(d_seq),
                    static_cast<void*>(d_rows), static_cast<void*>(d_data)}) {
    cudaFree(ptr);
  }
}
BENCHMARK(BM_LogitsProcessors)
    ->ArgNames({"rows", "history"})
    ->ArgsProduct({{1, 65, 257}, {0, 4096}})
    ->UseManualTime()
    ->MinTime(0.05);

// One GEMM of a Llama-3.1-8B layer, [m, k] x [n, k]^T: QKV (n 6144), O (4096), gate+up (28672),
// down (n 4096, k 14336), and the LM head (n 128256, fp32 out); and an EAGLE-3 head's fc
// (n 4096, k 12288). `invariant` 1 configures
// cuda::Gemm as the CUDA backend does (row-invariant up to 1024 rows: one algorithm per row
// class, each checked bit-identical to the base), 0 lets cuBLASLt pick per shape. Weights are
// random (the row-class self-check compares bits, which constant data would make meaningless),
// and the launches cycle through enough copies of them (>= 256 MiB) that they stream from HBM as
// a model's distinct layers do rather than sit in the 50 MB L2. Counters: us per GEMM,
// weight_GBps = weight bytes / time, own_algo = 1 when m's row class runs an algorithm of its
// own (0: the base algorithm), self_check_fail = 1 if even the base gave other bits there.
void BM_Gemm(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  const bool invariant = state.range(3) != 0;
  // K ranges (GemmParams::k_splits): fp32 slabs, as the backend runs o_proj and down.
  const int splits = static_cast<int>(state.range(4));
  const bool lm_head = n == kVocab;
  const bool fp32_out = lm_head || splits > 1;
  const size_t w_elems = size_t(n) * k;
  const size_t w_stride = (w_elems * sizeof(bf16) + 255) / 256 * 256 / sizeof(bf16);
  const size_t w_bytes = w_stride * sizeof(bf16);
  const int copies = static_cast<int>(((size_t{256} << 20) + w_bytes - 1) / w_bytes);
  // A random block tiled over the weights and x; only the first copy's bits matter (the
  // self-check runs on the first call's weights).
  std::vector<bf16> block(size_t{1} << 22);
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> uniform(-0.05f, 0.05f);
  for (bf16& v : block) v = __float2bfloat16(uniform(rng));
  bf16* d_block = Upload(block);
  const auto tile = [&](bf16* dst, size_t elems) {
    for (size_t off = 0; off < elems; off += block.size()) {
      Check(cudaMemcpy(dst + off, d_block, std::min(block.size(), elems - off) * sizeof(bf16),
                       cudaMemcpyDeviceToDevice),
            "tiling");
    }
  };
  bf16* w = Alloc<bf16>(w_stride * copies);
  for (int c = 0; c < copies; ++c) tile(w + w_stride * c, w_elems);
  bf16* x = Alloc<bf16>(size_t(m) * k);
  tile(x, size_t(m) * k);
  void* y = fp32_out ? static_cast<void*>(Alloc<float>(size_t(splits) * m * n))
                     : static_cast<void*>(Alloc<bf16>(size_t(m) * n));
  std::unique_ptr<cuda::Gemm> gemm;
  // The CUDA backend's workspace and row classes (engine/cuda/cuda_forward.cc).
  if (cuda::Gemm::Create(size_t{128} << 20, &gemm, invariant ? 1024 : 0, /*plan_rows=*/16,
                         /*bucket_classes=*/true) != CUBLAS_STATUS_SUCCESS) {
    std::abort();
  }
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  cuda::GemmParams p;
  p.x = x;
  p.y = y;
  p.y_fp32 = fp32_out;
  p.k_splits = splits;
  p.m = m;
  p.n = n;
  p.k = k;
  int next = 0;
  const double sec = TimeLaunches(state, stream, [&] {
    p.w = w + w_stride * next;
    next = (next + 1) % copies;
    if (gemm->Run(p, stream) != CUBLAS_STATUS_SUCCESS) std::abort();
  });
  state.counters["us"] = sec * 1e6;
  state.counters["weight_GBps"] = double(w_elems) * sizeof(bf16) / 1e9 / sec;
  state.counters["own_algo"] = gemm->own_algorithm_classes();
  state.counters["self_check_fail"] = gemm->self_check_failures();
  if (invariant) {
    // The algorithm behind this figure: the family's base and m's row class.
    const std::string summary = gemm->Summary();
    std::string shown;
    for (size_t at = 0; at < summary.size();) {
      const size_t end = std::min(summary.find('\n', at), summary.size());
      const std::string line = summary.substr(at, end - at);
      if (line.find("not used yet") == std::string::npos) shown += "  " + line + "\n";
      at = end + 1;
    }
    std::fprintf(stderr, "BM_Gemm m %lld:\n%s", static_cast<long long>(m), shown.c_str());
  }
  cudaStreamDestroy(stream);
  gemm.reset();
  cudaFree(x);
  cudaFree(w);
  cudaFree(y);
  cudaFree(d_block);
}
BENCHMARK(BM_Gemm)
    ->ArgNames({"m", "n", "k", "invariant", "splits"})
    ->Apply([](benchmark::internal::Benchmark* b) {
      const int64_t shapes[][2] = {
          {6144, kHidden}, {4096, kHidden}, {28672, kHidden}, {4096, 14336}, {kVocab, kHidden}};
      for (const auto& shape : shapes) {
        for (int64_t invariant : {1, 0}) {
          for (int64_t m : {1, 16, 65, 129, 257}) b->Args({m, shape[0], shape[1], invariant, 1});
        }
        // Two K ranges, row-invariant (the backend's residual splits), for every shape but the
        // LM head.
        if (shape[0] != kVocab) {
          for (int64_t m : {1, 65}) b->Args({m, shape[0], shape[1], 1, 2});
        }
      }
      // An EAGLE-3 head's fc at the 8B shape, [rows, 3H] -> H, at the rows of a verify step's
      // committed tokens and of a 2048-token prompt (docs/eagle.md: fc in the verify service).
      for (int64_t m : {1, 5, 16, 64}) b->Args({m, kHidden, 3 * kHidden, 1, 1});
      b->Args({2048, kHidden, 3 * kHidden, 0, 1});
    })
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.05);

}  // namespace
}  // namespace specd

// The kernels launch as a backend would launch them: SPECD_PDL, SPECD_PDL_OFF and
// SPECD_SMEM_CARVEOUT apply here too (docs/tuning.md), for A/B runs of the kernels alone.
int main(int argc, char** argv) {
  specd::cuda::SetLaunchTuning(specd::CudaTuningFromEnvironment().launch);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
