// The draft step on a CUDA device (issue 25's target: a draft level costs the model's forward
// plus at most 10%). For each batch of --seqs sequences (a --context token prompt each, random
// tokens) it times:
//
// 1. Per level, the drafter's forwards of a depth --depth tree as DraftModelDrafter issues them:
//    level 0 feeds the bonus token (one row a sequence), levels 1 .. depth-1 expand --top_k
//    nodes a sequence (top_k tokens and rows a sequence, each a child of a node of the level
//    before). Each level runs as Backend::ForwardTopK(top_k) (forward and top-k in one graph,
//    [rows, k] to the host) and as Backend::Forward ([rows, vocab] fp32 logits to the host, the
//    path before issue 25) at the same rows and state; host wall time of the call, medians of
//    --runs passes after 3 warm-up passes (a bucket's graph is captured on its second use). The
//    top-k kernel alone on [rows, vocab] random logits (CUDA events) is printed beside them:
//    the model's forward is the ForwardTopK time less that, and "topk %" is the kernel's share
//    of it, the number the 10% target reads.
// 2. The whole draft step (DraftModelDrafter::Draft, --max_nodes nodes) with backend top-k and
//    kept KV against the plain path (host top-k over full rows, accepted tokens fed again),
//    every step applying the same simulated outcome (the best root child and its best child
//    accepted, then a bonus token), as bench/draft_step_bench.cc does on the CPU.
//
// --graphs both|on|off runs each table with CUDA graphs on and/or off; --tp N shards the model
// over GPUs 0..N-1 (rank 0 ranks the gathered rows). --device cpu runs the same tables on the
// CPU backend (a check of the harness; the kernel column is then 0).
//
// Run (GPU host; a random 1B checkpoint from bench/tools/make_random_checkpoint.py or the draft
// of `specd-make-synthetic-pair --shape llama-3.2-1b`):
//   cuda_draft_step_bench --model /tmp/specd-llama-3.2-1b [--seqs 1,8,32] [--depth 4]
//       [--top_k 4] [--max_nodes 16] [--context 512] [--runs 20] [--graphs both|on|off] [--tp N]
//       [--device cuda:0|cpu]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_tp_backend.h"
#include "engine/draft/draft_model_drafter.h"
#include "specd/kernels/cuda/topk.h"

namespace specd {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

std::vector<int> Ints(const std::string& s) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(s, ',')) {
    int v = 0;
    if (absl::SimpleAtoi(part, &v)) out.push_back(v);
  }
  return out;
}

struct Config {
  int depth = 4, top_k = 4, max_nodes = 16, context = 512, runs = 20;
  bool gpu = true;  // the top-k kernel column is measured on CUDA device 0
};

// The top-k kernel alone over [rows, vocab] random fp32 logits: median device milliseconds; with
// `split`, the engine's path (the vocabulary split over CTAs, cuda::TopKChunks), else one CTA a
// row.
double TopKKernelMs(int64_t rows, int64_t vocab, int k, bool split) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> host(rows * vocab);
  for (float& x : host) x = normal(rng);
  float* logits = nullptr;
  int32_t* ids = nullptr;
  float* lps = nullptr;
  cudaMalloc(&logits, host.size() * sizeof(float));
  cudaMalloc(&ids, rows * k * sizeof(int32_t));
  cudaMalloc(&lps, rows * k * sizeof(float));
  cudaMemcpy(logits, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice);
  const int64_t ws_bytes = cuda::TopKWorkspaceBytes(rows, vocab, k);
  void* ws = nullptr;
  if (split && ws_bytes > 0) cudaMalloc(&ws, ws_bytes);
  cuda::TopKLogprobsParams p;
  p.workspace = ws;
  p.workspace_bytes = ws_bytes;
  p.logits = logits;
  p.logits_stride = vocab;
  p.num_rows = rows;
  p.vocab_size = vocab;
  p.k = k;
  p.ids = ids;
  p.logprobs = lps;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> ms;
  for (int i = 0; i < 23; ++i) {
    cudaEventRecord(start);
    cuda::TopKLogprobsCuda(p, nullptr);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    if (i >= 3) ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(logits);
  cudaFree(ids);
  cudaFree(lps);
  if (ws != nullptr) cudaFree(ws);
  return Median(ms);
}

std::vector<int32_t> RandomTokens(int n, int vocab, std::mt19937& rng) {
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

// Adds sequences first .. first + seqs - 1 with committed random prompts.
bool AddPrompts(Backend* b, SeqId first, int seqs, int context) {
  std::mt19937 rng(static_cast<uint32_t>(first));
  for (int s = 0; s < seqs; ++s) {
    ForwardItem prompt{first + s, RandomTokens(context, b->config().vocab_size, rng), {}, {}};
    std::vector<int32_t> path(context);
    for (int i = 0; i < context; ++i) {
      prompt.parents.push_back(i - 1);
      path[i] = i;
    }
    std::vector<float> unused;
    if (!b->AddSequence(first + s).ok() || !b->Forward({prompt}, &unused).ok() ||
        !b->Commit(first + s, path).ok()) {
      return false;
    }
  }
  return true;
}

// One pass of levels; per level the call's wall milliseconds go to ms[level]. The scratch
// region is dropped after the pass.
bool RunLevels(Backend* b, SeqId first, int seqs, const Config& c, bool topk,
               std::vector<std::vector<double>>* ms, std::vector<int64_t>* rows) {
  const int vocab = b->config().vocab_size;
  std::vector<int32_t> prev_first(seqs, -1), used(seqs, 0);
  std::vector<float> logits;
  TopKRows top;
  rows->assign(c.depth, 0);
  for (int d = 0; d < c.depth; ++d) {
    std::vector<ForwardItem> items(seqs);
    for (int s = 0; s < seqs; ++s) {
      ForwardItem& it = items[s];
      it.seq = first + s;
      const int width = d == 0 ? 1 : c.top_k;
      for (int j = 0; j < width; ++j) {
        it.tokens.push_back(static_cast<int32_t>((1009 * d + 31 * j + 7 * s + 11) % vocab));
        it.parents.push_back(d == 0 ? -1 : prev_first[s] + (d == 1 ? 0 : j));
        it.logit_rows.push_back(j);
      }
      prev_first[s] = used[s];
      used[s] += width;
      (*rows)[d] += width;
    }
    const auto t0 = Clock::now();
    const absl::Status st =
        topk ? b->ForwardTopK(items, c.top_k, &top) : b->Forward(items, &logits);
    const auto t1 = Clock::now();
    if (!st.ok()) {
      std::fprintf(stderr, "level %d: %s\n", d, st.ToString().c_str());
      return false;
    }
    (*ms)[d].push_back(Ms(t0, t1));
  }
  for (int s = 0; s < seqs; ++s) {
    if (!b->Commit(first + s, {}).ok()) return false;
  }
  return true;
}

bool LevelTable(Backend* b, SeqId first, int seqs, const Config& c, const char* graphs) {
  const int vocab = b->config().vocab_size;
  std::vector<std::vector<double>> topk_ms(c.depth), plain_ms(c.depth), unused(c.depth);
  std::vector<int64_t> rows;
  for (int r = 0; r < 3 + c.runs; ++r) {
    const bool timed = r >= 3;
    if (!RunLevels(b, first, seqs, c, true, timed ? &topk_ms : &unused, &rows)) return false;
    if (!RunLevels(b, first, seqs, c, false, timed ? &plain_ms : &unused, &rows)) return false;
  }
  for (int d = 0; d < c.depth; ++d) {
    const double kernel = c.gpu ? TopKKernelMs(rows[d], vocab, c.top_k, true) : 0.0;
    const double one_cta = c.gpu ? TopKKernelMs(rows[d], vocab, c.top_k, false) : 0.0;
    const double t = Median(topk_ms[d]), f = Median(plain_ms[d]);
    const double model = std::max(t - kernel, 1e-9);
    std::printf("| %s | %d | %d | %lld | %.3f | %.3f | %.3f | %.3f | %.1f%% | %.2fx |\n", graphs,
                seqs, d, static_cast<long long>(rows[d]), f, t, kernel, one_cta,
                100.0 * kernel / model, f / t);
  }
  return true;
}

// The best root child and its best child (children are listed best first), then a bonus.
std::vector<int32_t> Outcome(const TokenTree& t, int64_t length, int vocab, int32_t* node) {
  std::vector<int32_t> next;
  *node = -1;
  for (int depth = 0; depth < 2; ++depth) {
    int32_t child = -1;
    for (int i = 0; i < t.size() && child < 0; ++i) {
      if (t.parents[i] == *node) child = i;
    }
    if (child < 0) break;
    *node = child;
    next.push_back(t.tokens[child]);
  }
  next.push_back(static_cast<int32_t>((length * 7919) % vocab));
  return next;
}

bool StepTable(Backend* b, SeqId first, int seqs, const Config& c, const char* graphs) {
  const int vocab = b->config().vocab_size;
  double step_ms[2] = {0, 0};
  for (int saving : {0, 1}) {
    DraftModelDrafter drafter(b, {saving != 0, saving != 0});
    const DraftParams params{c.depth, c.top_k, c.max_nodes};
    std::mt19937 rng(static_cast<uint32_t>(first + saving));
    std::vector<DraftRequest> requests(seqs);
    std::vector<int64_t> length(seqs);
    for (int s = 0; s < seqs; ++s) {
      if (!drafter.AddSequence(first + s).ok()) return false;
      requests[s] = {first + s, RandomTokens(c.context, vocab, rng), params};
      length[s] = c.context;
    }
    absl::StatusOr<std::vector<TokenTree>> trees = drafter.Draft(requests);
    if (!trees.ok()) {
      std::fprintf(stderr, "draft: %s\n", trees.status().ToString().c_str());
      return false;
    }
    std::vector<double> ms;
    for (int r = 0; r < 3 + c.runs; ++r) {
      for (int s = 0; s < seqs; ++s) {
        int32_t node = -1;
        std::vector<int32_t> next = Outcome((*trees)[s], length[s], vocab, &node);
        length[s] += static_cast<int64_t>(next.size());
        requests[s] = {first + s, std::move(next), params, node};
      }
      const auto t0 = Clock::now();
      trees = drafter.Draft(requests);
      const auto t1 = Clock::now();
      if (!trees.ok()) {
        std::fprintf(stderr, "draft: %s\n", trees.status().ToString().c_str());
        return false;
      }
      if (r >= 3) ms.push_back(Ms(t0, t1));
    }
    for (int s = 0; s < seqs; ++s) (void)drafter.Release(first + s);
    step_ms[saving] = Median(ms);
  }
  std::printf("| %s | %d | %.3f | %.3f | %.2fx |\n", graphs, seqs, step_ms[0], step_ms[1],
              step_ms[0] / step_ms[1]);
  return true;
}

int Main(int argc, char** argv) {
  std::string model, graphs_mode = "both", device = "cuda:0";
  std::vector<int> seqs = {1, 8, 32};
  int tp = 1;
  Config c;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--model") {
      model = value;
    } else if (flag == "--seqs") {
      seqs = Ints(value);
    } else if (flag == "--depth") {
      c.depth = std::max(1, std::atoi(value.c_str()));
    } else if (flag == "--top_k") {
      c.top_k = std::clamp(std::atoi(value.c_str()), 1, kMaxForwardTopK);
    } else if (flag == "--max_nodes") {
      c.max_nodes = std::max(1, std::atoi(value.c_str()));
    } else if (flag == "--context") {
      c.context = std::max(1, std::atoi(value.c_str()));
    } else if (flag == "--runs") {
      c.runs = std::max(1, std::atoi(value.c_str()));
    } else if (flag == "--graphs") {
      graphs_mode = value;
    } else if (flag == "--device") {
      device = value;
    } else if (flag == "--tp") {
      tp = std::max(1, std::atoi(value.c_str()));
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (model.empty() || seqs.empty()) {
    std::fprintf(stderr,
                 "usage: cuda_draft_step_bench --model DIR [--seqs 1,8,32] [--depth 4] "
                 "[--top_k 4] [--max_nodes 16] [--context 512] [--runs 20] "
                 "[--graphs both|on|off] [--tp N] [--device cuda:0|cpu]\n");
    return 2;
  }
  const int most = *std::max_element(seqs.begin(), seqs.end());
  BackendOptions opts;
  opts.device = device;
  c.gpu = device != "cpu";
  opts.tensor_parallel = tp;
  // The level table's sequences and the step table's, which grow by 3 tokens a step.
  opts.kv_capacity_tokens =
      static_cast<int64_t>(most) * (2 * c.context + 4 * (c.runs + 4) + 2 * c.max_nodes + 512);
  absl::StatusOr<std::unique_ptr<Backend>> loaded = CreateBackend(model, opts);
  if (!loaded.ok()) {
    std::fprintf(stderr, "loading %s: %s\n", model.c_str(), loaded.status().ToString().c_str());
    return 1;
  }
  Backend& b = **loaded;
  auto* one = dynamic_cast<CudaBackend*>(&b);
  auto* group = dynamic_cast<CudaTensorParallelBackend*>(&b);
  const auto set_graphs = [&](bool on) {
    if (one != nullptr) one->SetGraphsEnabled(on);
    if (group != nullptr) group->SetGraphsEnabled(on);
  };
  std::vector<bool> modes;
  if (graphs_mode != "off") modes.push_back(true);
  if (graphs_mode != "on") modes.push_back(false);
  cudaDeviceProp prop{};
  if (c.gpu) cudaGetDeviceProperties(&prop, 0);
  const ModelConfig& m = b.config();
  std::printf("# %s, %s, TP=%d: %d layers, hidden %lld, vocab %d; context %d, depth %d, top_k %d\n",
              model.c_str(), c.gpu ? prop.name : "cpu", tp, m.num_layers,
              static_cast<long long>(m.hidden_size), m.vocab_size, c.context, c.depth, c.top_k);
  std::printf(
      "\n## Per level (ms, medians of %d): Forward = full rows to the host, ForwardTopK = forward "
      "and top-k in one graph, kernel = the top-k alone (split: the engine's; one CTA: a CTA a "
      "row, before)\n\n",
      c.runs);
  std::printf(
      "| graphs | seqs | level | rows | Forward | ForwardTopK | top-k kernel split | one CTA | "
      "topk %% of model | Forward / ForwardTopK |\n|---|---|---|---|---|---|---|---|---|---|\n");
  SeqId next = 1;
  for (bool on : modes) {
    set_graphs(on);
    for (int n : seqs) {
      if (!AddPrompts(&b, next, n, c.context)) {
        std::fprintf(stderr, "adding %d prompts failed\n", n);
        return 1;
      }
      if (!LevelTable(&b, next, n, c, on ? "on" : "off")) return 1;
      for (int s = 0; s < n; ++s) (void)b.RemoveSequence(next + s);
      next += n;
    }
  }
  std::printf(
      "\n## Draft step (ms, medians of %d; max_nodes %d): plain = host top-k and accepted "
      "tokens fed again, saving = ForwardTopK and kept KV\n\n| graphs | seqs | plain | saving | "
      "plain / saving |\n|---|---|---|---|---|\n",
      c.runs, c.max_nodes);
  for (bool on : modes) {
    set_graphs(on);
    for (int n : seqs) {
      if (!StepTable(&b, next, n, c, on ? "on" : "off")) return 1;
      next += n;
    }
  }
  return 0;
}

}  // namespace
}  // namespace specd

int main(int argc, char** argv) { return specd::Main(argc, argv); }
