// Whole-step benchmark of the CUDA backend on one GPU: batch-1 decode step time
// against the memory-bandwidth floor (weight bytes / measured device copy
// bandwidth), and verify step time for trees of 1, 16, 64, 128 and 256 nodes at
// contexts 512, 2048 and 8192, with CUDA graphs on and off. A step is
// Backend::Verify() as the verify service calls it, timed on the host (metadata
// upload, forward pass, sampling, acceptance, KV compaction and the copy of the
// outcomes back); medians of --runs steps after 3 warm-up steps (a bucket's
// graph is captured on its second use).
//
// Run (GPU host, random bf16 checkpoints from
// bench/tools/make_random_checkpoint.py):
//   cuda_step_bench --model /tmp/specd-llama-3.1-8b [--label 8B] [--runs 20]
//       [--contexts 512,2048,8192] [--trees 1,16,64,128,256]
//       [--tp N] [--custom_bytes B] [--graphs both|on|off] [--profile NODES]
//       [--phases 1] [--trace NODES] [--trace_csv PREFIX]
//       [--prefill N1,N2,..] [--prefill_batch B1,B2,..] [--prefill_trace 1]
//       [--taps send,hold] [--tap_layers L1,L2,..]
// --taps adds rows of verify steps that export EAGLE taps (--tap_layers, default the final
// norm's output, num_layers + 1): `send` copies the committed rows to the host after the
// acceptance round trip, as steps that draft do; `hold` keeps them on the device
// (VerifyItem::hold_tap_rows), as the verify service does for plain steps of EAGLE sequences.
// --prefill adds a table of prompt prefills: B fresh sequences of N tokens each in one
// Backend::Forward (the logits of each one's last token only, as the verify service's prefill
// and the draft service's catch-up ask), timed on the host, against the compute floor
// 2 x parameters (embedding and LM head left out) x tokens at the device's dense bf16 rate (--peak_tflops, default 989, H100/H200
// SXM). It is what a request's time to first token and a draft's catch-up are made of.
// --prefill_trace 1 prints the kernel timeline of the last timed prefill of each case.
// --tp N shards the model over GPUs 0..N-1 (engine/cuda/cuda_tp_backend.h);
// the floor is then one rank's weight bytes / the copy bandwidth, and
// --custom_bytes is BackendOptions::cuda_custom_allreduce_max_bytes (0: NCCL
// only, the A/B against the custom all-reduce). --profile NODES brackets the
// last timed step of that tree size (0: decode) with cudaProfilerStart/Stop, so that
// `ncu --profile-from-start off` times exactly one step's kernels (graph nodes
// one by one) and none of the load-time GEMM algorithm search. --phases 1 (TP=1)
// adds a line per case with the medians of where the step's wall time went
// (CudaBackend::VerifyPhases): host preparation, launch, waiting, finishing, and
// the device's own time from the metadata upload to the outcomes' copy.
// --trace NODES (builds with CUPTI) prints the kernel timeline of the last timed step of that
// tree size (0: decode) as it really ran, graph replays included (bench/kernel_trace.h): its
// span, busy and idle time, the time by kernel and the idle time by the pair of kernels around
// it; --trace_csv PREFIX also writes it to PREFIX<graphs|eager>_<nodes>_<context>.csv.
// gpt-fast and transformers at the same shapes: a later session adds them to
// this table (bench/hf_baseline.py has the transformers harness).
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_tp_backend.h"
#ifdef SPECD_HAVE_CUPTI
#include "bench/kernel_trace.h"
#endif

namespace specd {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Device-to-device copy of 4 GiB: bytes read plus bytes written per second.
double CopyBandwidth() {
  const size_t bytes = size_t{4} << 30;
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess ||
      cudaMalloc(&b, bytes) != cudaSuccess)
    return 0;
  cudaMemset(a, 1, bytes);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> s;
  for (int i = 0; i < 7; ++i) {
    cudaEventRecord(start);
    cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i > 0)
      s.push_back(2.0 * bytes / (ms * 1e-3));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(a);
  cudaFree(b);
  return Median(s);
}

// A 4-ary tree in breadth-first order, like a top-k draft tree.
TokenTree Tree(int n, int vocab, std::mt19937_64 &rng) {
  TokenTree t;
  for (int i = 0; i < n; ++i) {
    t.parents.push_back(i < 4 ? -1 : i / 4 - 1);
    t.tokens.push_back(static_cast<int32_t>(rng() % vocab));
  }
  return t;
}

std::vector<int> Ints(const std::string &s) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(s, ',')) {
    int v = 0;
    if (absl::SimpleAtoi(part, &v))
      out.push_back(v);
  }
  return out;
}

int Main(int argc, char **argv) {
  std::string model, label = "model";
  int runs = 20, tp = 1;
  int64_t custom_bytes = -1;
  std::string graphs_mode = "both";
  int profile_nodes = -1;
  bool phases = false;
  int trace_nodes = -1;
  std::string trace_csv;
  std::vector<int> contexts = {512, 2048, 8192}, trees = {1, 16, 64, 128, 256};
  std::vector<int> prefill_lengths, prefill_batches = {1};
  bool prefill_trace = false;
  double peak_tflops = 989;
  // --taps: verify steps that also export EAGLE taps (send: copied to the host after
  // acceptance; hold: kept on the device, VerifyItem::hold_tap_rows), one row per mode.
  std::vector<std::string> tap_modes = {""};
  std::vector<int> tap_layers;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--model")
      model = value;
    else if (flag == "--label")
      label = value;
    else if (flag == "--runs")
      runs = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--contexts")
      contexts = Ints(value);
    else if (flag == "--trees")
      trees = Ints(value);
    else if (flag == "--tp")
      tp = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--custom_bytes")
      custom_bytes = std::atoll(value.c_str());
    else if (flag == "--graphs")
      graphs_mode = value;
    else if (flag == "--profile")
      profile_nodes = std::atoi(value.c_str());
    else if (flag == "--phases")
      phases = value == "1";
    else if (flag == "--trace")
      trace_nodes = std::atoi(value.c_str());
    else if (flag == "--trace_csv")
      trace_csv = value;
    else if (flag == "--prefill")
      prefill_lengths = Ints(value);
    else if (flag == "--prefill_batch")
      prefill_batches = Ints(value);
    else if (flag == "--prefill_trace")
      prefill_trace = value == "1";
    else if (flag == "--peak_tflops")
      peak_tflops = std::atof(value.c_str());
    else if (flag == "--taps")
      tap_modes = absl::StrSplit(value, ',', absl::SkipEmpty());
    else if (flag == "--tap_layers")
      tap_layers = Ints(value);
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (model.empty()) {
    std::fprintf(stderr,
                 "usage: cuda_step_bench --model DIR [--label L] [--runs N] "
                 "[--contexts a,b,..] [--trees a,b,..] [--tp N] "
                 "[--custom_bytes B] [--graphs both|on|off] [--profile NODES] "
                 "[--phases 1] [--trace NODES] [--trace_csv PREFIX] "
                 "[--prefill N,..] [--prefill_batch B,..] [--prefill_trace 1] "
                 "[--peak_tflops T] [--taps send,hold] [--tap_layers L,..]\n");
    return 2;
  }
#ifdef SPECD_HAVE_CUPTI
  bench::KernelTrace trace;
  if (trace_nodes >= 0 || prefill_trace) {
    // Before the backend exists, so that every kernel, graph replays included, is recorded.
    if (absl::Status s = trace.Enable(); !s.ok()) {
      std::fprintf(stderr, "--trace: %s\n", s.ToString().c_str());
      return 1;
    }
  }
#else
  if (trace_nodes >= 0 || prefill_trace) {
    std::fprintf(stderr, "--trace: this build has no CUPTI\n");
    return 2;
  }
#endif
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const double copy_bw = CopyBandwidth();
  BackendOptions opts;
  opts.device = "cuda:0";
  int max_context = 0;
  for (int c : contexts)
    max_context = std::max(max_context, c);
  for (int n : prefill_lengths)
    for (int bsz : prefill_batches)
      max_context = std::max(max_context, n * bsz);
  opts.kv_capacity_tokens = max_context + 4096;
  opts.tensor_parallel = tp;
  opts.cuda_custom_allreduce_max_bytes = custom_bytes;
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<Backend>> loaded = CreateBackend(model, opts);
  if (!loaded.ok()) {
    std::fprintf(stderr, "loading %s: %s\n", model.c_str(),
                 loaded.status().ToString().c_str());
    return 1;
  }
  Backend &b = **loaded;
  auto *one = dynamic_cast<CudaBackend *>(&b);
  auto *group = dynamic_cast<CudaTensorParallelBackend *>(&b);
  if (phases && one != nullptr)
    one->SetPhaseTiming(true);
  const auto set_graphs = [&](bool on) {
    if (one != nullptr)
      one->SetGraphsEnabled(on);
    if (group != nullptr)
      group->SetGraphsEnabled(on);
  };
  const double load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  const ModelConfig &c = b.config();
  for (const std::string &m : tap_modes) {
    if (!m.empty() && m != "send" && m != "hold") {
      std::fprintf(stderr, "--taps: send or hold, got %s\n", m.c_str());
      return 2;
    }
  }
  if (tap_layers.empty())
    tap_layers = {FinalNormTap(c.num_layers)}; // an EAGLE-1/2 head's feature
  const double weight_bytes = 2.0 * static_cast<double>(c.ParameterCount());
  const double floor_ms = weight_bytes / tp / copy_bw * 1e3;
  std::printf("# %s: %s x%d (tensor parallel %d, all-reduce: %s), %.2f GB of "
              "bf16 weights, %d layers, loaded in %.1f s\n",
              label.c_str(), prop.name, tp, tp,
              tp == 1 ? "none"
              : group != nullptr && group->custom_allreduce() && custom_bytes != 0
                  ? "custom one-shot"
                  : "NCCL",
              weight_bytes / 1e9, c.num_layers, load_s);
  std::printf("# device copy bandwidth %.0f GB/s (read + write); decode floor "
              "= weights / that "
              "= %.3f ms%s\n",
              copy_bw / 1e9, floor_ms, tp > 1 ? " (one rank's share)" : "");
  std::printf("| shape | TP | graphs | context | tree nodes | step ms (median "
              "of %d) | ms a layer | vs floor |\n",
              runs);
  std::printf("|---|---|---|---|---|---|---|---|\n");

  std::mt19937_64 rng(5);
  SeqId next = 1;
  if (!prefill_lengths.empty()) {
    std::printf("| shape | TP | prefill | tokens | ms (median of %d) | tokens/s | vs compute "
                "floor |\n|---|---|---|---|---|---|---|\n",
                runs);
    // The embedding table and the LM head do no per-token work in a prefill (one row of logits
    // per sequence), so they stay out of the floor.
    const double embed = double{1} * c.vocab_size * c.hidden_size;
    const double flops_per_token =
        2.0 * (static_cast<double>(c.ParameterCount()) - embed * (c.tie_word_embeddings ? 1 : 2));
    for (int bsz : prefill_batches) {
      for (int n : prefill_lengths) {
        std::vector<double> ms;
        for (int r = 0; r < runs + 2; ++r) {
          std::vector<ForwardItem> items(bsz);
          for (int i = 0; i < bsz; ++i) {
            items[i].seq = next++;
            if (!b.AddSequence(items[i].seq).ok())
              return 1;
            for (int j = 0; j < n; ++j) {
              items[i].tokens.push_back(static_cast<int32_t>(rng() % c.vocab_size));
              items[i].parents.push_back(j - 1);
            }
            items[i].logit_rows = {n - 1};
          }
          const bool traced = prefill_trace && r == runs + 1;
#ifdef SPECD_HAVE_CUPTI
          const uint64_t trace_t0 = traced ? bench::KernelTrace::Now() : 0;
#endif
          std::vector<float> logits;
          const auto s0 = std::chrono::steady_clock::now();
          absl::Status st = b.Forward(items, &logits);
          const double dt =
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0)
                  .count();
#ifdef SPECD_HAVE_CUPTI
          if (traced) {
            bench::KernelTrace::Summarize(absl::StrCat("prefill ", bsz, " x ", n),
                                          trace.Window(trace_t0, bench::KernelTrace::Now()),
                                          stdout);
          }
#else
          (void)traced;
#endif
          if (!st.ok()) {
            std::fprintf(stderr, "prefill %d x %d: %s\n", bsz, n, st.ToString().c_str());
            return 1;
          }
          for (const ForwardItem &it : items)
            (void)b.RemoveSequence(it.seq);
          if (r >= 2)
            ms.push_back(dt);
        }
        const double med = Median(ms), tokens = double{1} * bsz * n;
        const double floor_ms = flops_per_token * tokens / tp / (peak_tflops * 1e12) * 1e3;
        std::printf("| %s | %d | %d x %d | %.0f | %.3f | %.0f | %.2fx |\n", label.c_str(), tp,
                    bsz, n, tokens, med, tokens / (med * 1e-3), med / floor_ms);
        std::fflush(stdout);
      }
    }
  }
  for (int context : contexts) {
    const SeqId seq = next++;
    if (!b.AddSequence(seq).ok())
      return 1;
    // Prefill in chunks (eager; the graphs' buckets cover decode and verify
    // steps only).
    std::vector<float> logits;
    for (int done = 0; done < context;) {
      const int n = std::min(2048, context - done);
      ForwardItem it;
      it.seq = seq;
      for (int j = 0; j < n; ++j) {
        it.tokens.push_back(static_cast<int32_t>(rng() % c.vocab_size));
        it.parents.push_back(j - 1);
      }
      it.logit_rows = {n - 1};
      if (absl::Status s = b.Forward({it}, &logits); !s.ok()) {
        std::fprintf(stderr, "prefill: %s\n", s.ToString().c_str());
        return 1;
      }
      std::vector<int32_t> path(n);
      for (int j = 0; j < n; ++j)
        path[j] = j;
      if (!b.Commit(seq, path).ok())
        return 1;
      done += n;
    }
    int32_t pending = static_cast<int32_t>(rng() % c.vocab_size);
    std::vector<bool> graph_modes;
    if (graphs_mode != "off")
      graph_modes.push_back(true);
    if (graphs_mode != "on")
      graph_modes.push_back(false);
    for (bool graphs : graph_modes) {
      set_graphs(graphs);
      std::vector<int> sizes = {0};
      sizes.insert(sizes.end(), trees.begin(), trees.end());
      for (int nodes : sizes) {
        for (const std::string &tap_mode : tap_modes) {
          const std::string shape =
              tap_mode.empty() ? label : absl::StrCat(label, " taps ", tap_mode);
          std::vector<double> ms;
          // Per timed step: prepare, launch, wait, finish, device (µs).
          std::vector<double> phase[5];
          for (int r = 0; r < runs + 3; ++r) {
            VerifyItem it;
            it.seq = seq;
            it.pending = {pending};
            it.tree = Tree(nodes, c.vocab_size, rng);
            if (!tap_mode.empty()) {
              it.tap_layers = tap_layers;
              it.hold_tap_rows = tap_mode == "hold" ? int64_t{1} << 20 : 0;
            }
            const bool profiled = nodes == profile_nodes && r == runs + 2;
            const bool traced = nodes == trace_nodes && r == runs + 2;
            if (profiled)
              cudaProfilerStart();
#ifdef SPECD_HAVE_CUPTI
            const uint64_t trace_t0 = traced ? bench::KernelTrace::Now() : 0;
#endif
            const auto s0 = std::chrono::steady_clock::now();
            absl::StatusOr<std::vector<VerifyOutcome>> out = b.Verify({it});
            if (profiled)
              cudaProfilerStop();
#ifdef SPECD_HAVE_CUPTI
            if (traced) {
              // Verify returns once the outcomes are on the host: every kernel of the step has
              // started (and ended) before this.
              const std::vector<bench::KernelTrace::Kernel> ks =
                  trace.Window(trace_t0, bench::KernelTrace::Now());
              const std::string name =
                  absl::StrCat(graphs ? "graphs" : "eager", " ",
                               nodes == 0 ? "decode" : absl::StrCat(nodes, " nodes"),
                               " context ", context);
              bench::KernelTrace::Summarize(name, ks, stdout);
              if (!trace_csv.empty()) {
                const std::string path =
                    absl::StrCat(trace_csv, graphs ? "graphs" : "eager", "_", nodes, "_",
                                 context, ".csv");
                if (absl::Status s = bench::KernelTrace::WriteCsv(ks, path); !s.ok())
                  std::fprintf(stderr, "--trace_csv: %s\n", s.ToString().c_str());
              }
            }
#else
            (void)traced;
#endif
            const double dt = std::chrono::duration<double, std::milli>(
                                  std::chrono::steady_clock::now() - s0)
                                  .count();
            if (!out.ok()) {
              std::fprintf(stderr, "verify: %s\n",
                           out.status().ToString().c_str());
              return 1;
            }
            pending = (*out)[0].tokens.back();
            if (r >= 3)
              ms.push_back(dt);
            if (r >= 3 && phases && one != nullptr) {
              const CudaBackend::VerifyPhases &v = one->last_verify_phases();
              const double values[5] = {v.prepare_us, v.launch_us, v.wait_us,
                                        v.finish_us, v.device_us};
              for (int i = 0; i < 5; ++i)
                phase[i].push_back(values[i]);
            }
          }
          const double med = Median(ms);
          std::printf("| %s | %d | %s | %d | %s | %.3f | %.4f | %.2fx |\n",
                      shape.c_str(), tp, graphs ? "on" : "off", context,
                      nodes == 0 ? "decode" : std::to_string(nodes).c_str(), med,
                      med / std::max(1, c.num_layers), med / floor_ms);
          if (!phase[0].empty()) {
            // Wall time the device does not account for: host work before the
            // upload and after the outcomes arrive, and the gaps between.
            std::printf("# phases %s %s context %d, µs (median): prepare %.1f, "
                        "launch %.1f, wait %.1f, finish %.1f; device %.1f; "
                        "step %.1f\n",
                        graphs ? "graphs" : "eager",
                        nodes == 0 ? "decode" : (std::to_string(nodes) + " nodes").c_str(),
                        context, Median(phase[0]), Median(phase[1]),
                        Median(phase[2]), Median(phase[3]), Median(phase[4]),
                        1e3 * med);
          }
          std::fflush(stdout);
          if (tap_mode == "hold")
            (void)b.TakeHeldTaps(seq); // drained outside the timed steps
        }
      }
    }
    (void)b.RemoveSequence(seq);
  }
  if (one != nullptr) {
    std::printf("# graphs captured %lld, graph launches %lld; "
                "non-row-invariant GEMM shapes: %d\n",
                static_cast<long long>(one->graphs_captured()),
                static_cast<long long>(one->graph_launches()),
                one->non_invariant_gemm_shapes());
  }
  return 0;
}

} // namespace
} // namespace specd

int main(int argc, char **argv) { return specd::Main(argc, argv); }
