// All-reduce latency on the GPUs of one host: the custom one-shot all-reduce over NVLink peer
// memory (specd/kernels/cuda/allreduce.h; plain in its push and barrier modes, and fused with
// residual add + RMSNorm) against NCCL's ncclAllReduce (bf16 sum, NVLink multicast off), for
// messages of 4 KiB .. 4 MiB.
//
// Method: one host thread per rank (as the verify service runs its ranks). For each size and
// method every rank captures a CUDA graph of 20 back-to-back calls (the custom calls alternate
// between two sites, as the engine does), replays it 3 times to warm up, then 50 times with a
// CUDA event between replays; a call's time is a replay's time / 20, and the table reports the
// median over the replays of the slowest rank's per-call time. Graph replays hide launch
// overhead, as in the engine's decode and verify graphs; "eager" below is the custom plain
// call launched directly, 20 calls per timed batch, for one size. A message of B bytes is
// [B / 2 / dim, dim] bf16 with dim = min(8192, B / 2).
//
// Run (GPU host):  cuda_allreduce_bench [--gpus N] [--replays 50]
// Needs about 10 s on 2 H200s (NCCL's setup is most of it).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cuda/custom_allreduce.h"
#include "engine/cuda/nccl_group.h"
#include "specd/kernels/cuda/allreduce.h"

namespace specd {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kCallsPerGraph = 20;
constexpr int kWarmReplays = 3;
constexpr int64_t kMaxBytes = int64_t{4} << 20;

#define BENCH_CUDA(expr)                                                 \
  do {                                                                   \
    const cudaError_t bench_err_ = (expr);                               \
    if (bench_err_ != cudaSuccess) {                                     \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(bench_err_));                      \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

#define BENCH_OK(expr)                                                   \
  do {                                                                   \
    const absl::Status bench_s_ = (expr);                                \
    if (!bench_s_.ok()) {                                                \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, \
                   bench_s_.ToString().c_str());                         \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A reusable barrier for the rank threads (C++17 has no std::barrier).
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t gen = generation_;
    if (++waiting_ == n_) {
      waiting_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != gen; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int n_;
  int waiting_ = 0;
  int64_t generation_ = 0;
};

// The custom kernel takes its push mode up to the group's push_max_bytes (256 KiB); "barrier
// plain" forces its barrier mode at every size, for comparison.
enum Method { kCustomPlain = 0, kCustomFused = 1, kNccl = 2, kBarrierPlain = 3, kNumMethods = 4 };
const char* kMethodNames[] = {"custom plain", "custom fused", "NCCL", "barrier plain"};

struct Shape {
  int64_t bytes, rows, dim;
};

struct Shared {
  std::vector<int> devices;
  std::vector<Shape> shapes;
  int replays = 50;
  CustomAllReduceGroup* custom = nullptr;  // null: no peer access
  NcclGroup* nccl = nullptr;               // null: no NCCL
  Barrier* barrier = nullptr;
  // per_call_us[method][shape][rank]: median per-call time of that rank.
  std::vector<std::vector<std::vector<double>>> per_call_us;
  int64_t eager_shape = 0;
  std::vector<double> eager_us;  // [rank]
};

void Rank(Shared* sh, int rank) {
  BENCH_CUDA(cudaSetDevice(sh->devices[rank]));
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int64_t elems = kMaxBytes / 2;
  bf16 *out = nullptr, *send = nullptr, *recv = nullptr;
  float *residual = nullptr, *weight = nullptr;
  BENCH_CUDA(cudaMalloc(&out, kMaxBytes));
  BENCH_CUDA(cudaMalloc(&weight, 8192 * sizeof(float)));
  BENCH_CUDA(cudaMalloc(&send, kMaxBytes));
  BENCH_CUDA(cudaMalloc(&recv, kMaxBytes));
  BENCH_CUDA(cudaMalloc(&residual, elems * sizeof(float)));
  // Small finite values everywhere (0x3c00 in each bf16 half: 0.0078125; the fp32 norm weight
  // 0x3c3c3c3c, about 0.0115), residual zero.
  BENCH_CUDA(cudaMemset(weight, 0x3c, 8192 * sizeof(float)));
  BENCH_CUDA(cudaMemset(send, 0x3c, kMaxBytes));
  BENCH_CUDA(cudaMemset(residual, 0, elems * sizeof(float)));
  if (sh->custom != nullptr) {
    for (int s = 0; s < 2; ++s) BENCH_CUDA(cudaMemset(sh->custom->input(rank, s), 0x3c, kMaxBytes));
  }
  BENCH_CUDA(cudaDeviceSynchronize());

  int site = 0;
  auto enqueue = [&](int method, const Shape& shape) {
    if (method == kNccl) {
      BENCH_OK(
          sh->nccl->AllReduceSum(rank, send, recv, static_cast<size_t>(shape.bytes / 2), stream));
      return;
    }
    cuda::AllReduceParams p = sh->custom->Params(rank, site);
    site ^= 1;
    p.rows = shape.rows;
    p.dim = shape.dim;
    p.out = out;
    if (method == kBarrierPlain) p.push_max_bytes = 0;
    if (method == kCustomFused) {
      p.residual = residual;
      p.norm_weight = weight;
    }
    BENCH_CUDA(cuda::AllReduceCuda(p, stream));
  };

  std::vector<cudaEvent_t> events(sh->replays + 1);
  for (cudaEvent_t& e : events) BENCH_CUDA(cudaEventCreate(&e));
  // Median over the replays of (events[i], events[i + 1]), per call of a batch.
  const auto median_us_per_call = [&] {
    std::vector<double> us;
    for (int i = 0; i < sh->replays; ++i) {
      float ms = 0;
      BENCH_CUDA(cudaEventElapsedTime(&ms, events[i], events[i + 1]));
      us.push_back(ms * 1e3 / kCallsPerGraph);
    }
    return Median(us);
  };
  for (int method = 0; method < kNumMethods; ++method) {
    const bool available = method == kNccl ? sh->nccl != nullptr : sh->custom != nullptr;
    if (!available) continue;
    for (size_t si = 0; si < sh->shapes.size(); ++si) {
      const Shape& shape = sh->shapes[si];
      // Eager calls first: NCCL connects lazily per algorithm, which must not happen during
      // capture; the custom kernels get loaded.
      for (int i = 0; i < 2; ++i) enqueue(method, shape);
      BENCH_CUDA(cudaStreamSynchronize(stream));
      sh->barrier->Wait();
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < kCallsPerGraph; ++i) enqueue(method, shape);
      BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
      BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      for (int i = 0; i < kWarmReplays; ++i) BENCH_CUDA(cudaGraphLaunch(exec, stream));
      BENCH_CUDA(cudaStreamSynchronize(stream));
      sh->barrier->Wait();
      BENCH_CUDA(cudaEventRecord(events[0], stream));
      for (int i = 0; i < sh->replays; ++i) {
        BENCH_CUDA(cudaGraphLaunch(exec, stream));
        BENCH_CUDA(cudaEventRecord(events[i + 1], stream));
      }
      BENCH_CUDA(cudaStreamSynchronize(stream));
      sh->per_call_us[method][si][rank] = median_us_per_call();
      BENCH_CUDA(cudaGraphExecDestroy(exec));
      BENCH_CUDA(cudaGraphDestroy(graph));
    }
  }

  if (sh->custom != nullptr) {
    // Custom plain, launched eagerly: batches of 20 calls between events.
    const Shape& shape = sh->shapes[sh->eager_shape];
    sh->barrier->Wait();
    BENCH_CUDA(cudaEventRecord(events[0], stream));
    for (int i = 0; i < sh->replays; ++i) {
      for (int c = 0; c < kCallsPerGraph; ++c) enqueue(kCustomPlain, shape);
      BENCH_CUDA(cudaEventRecord(events[i + 1], stream));
    }
    BENCH_CUDA(cudaStreamSynchronize(stream));
    sh->eager_us[rank] = median_us_per_call();
  }
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  cudaFree(out);
  cudaFree(weight);
  cudaFree(send);
  cudaFree(recv);
  cudaFree(residual);
  cudaStreamDestroy(stream);
}

double Slowest(const std::vector<double>& per_rank) {
  return *std::max_element(per_rank.begin(), per_rank.end());
}

int Main(int argc, char** argv) {
  int gpus = -1;
  int replays = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if ((flag == "--gpus" || flag == "--replays") && i + 1 < argc) {
      (flag == "--gpus" ? gpus : replays) = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--gpus N] [--replays R]\n", argv[0]);
      return 2;
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("no CUDA device; nothing to measure\n");
    return 0;
  }
  if (gpus < 0) gpus = std::min(count, cuda::kAllReduceMaxRanks);
  if (gpus < 1 || gpus > count || gpus > cuda::kAllReduceMaxRanks || replays < 1) {
    std::fprintf(stderr, "--gpus must be 1..%d and --replays >= 1\n",
                 std::min(count, cuda::kAllReduceMaxRanks));
    return 2;
  }
  Shared sh;
  sh.replays = replays;
  for (int r = 0; r < gpus; ++r) sh.devices.push_back(r);
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  bool all_peer = true;
  for (int a = 0; a < gpus; ++a) {
    for (int b = 0; b < gpus; ++b) {
      int can = 1;
      if (a != b) BENCH_CUDA(cudaDeviceCanAccessPeer(&can, a, b));
      all_peer = all_peer && can;
    }
  }
  std::printf("# All-reduce latency, bf16 sum\n\n");
  std::printf("%d x %s (%d visible), peer access between all of them: %s\n\n", gpus, prop.name,
              count, gpus == 1 ? "n/a (one GPU)" : (all_peer ? "yes" : "NO"));

  for (int64_t bytes = 4096; bytes <= kMaxBytes; bytes *= 2) {
    const int64_t elems = bytes / 2;
    const int64_t dim = std::min<int64_t>(8192, elems);
    sh.shapes.push_back({bytes, elems / dim, dim});
    if (bytes == 16384) sh.eager_shape = static_cast<int64_t>(sh.shapes.size()) - 1;
  }

  std::unique_ptr<CustomAllReduceGroup> custom;
  absl::StatusOr<std::unique_ptr<CustomAllReduceGroup>> c =
      CustomAllReduceGroup::Create(sh.devices, 2, kMaxBytes);
  if (c.ok()) {
    custom = std::move(*c);
    sh.custom = custom.get();
  } else {
    std::printf("custom all-reduce unavailable: %s\n\n", c.status().ToString().c_str());
  }
  std::unique_ptr<NcclGroup> nccl;
  absl::StatusOr<std::unique_ptr<NcclGroup>> g = NcclGroup::Create(sh.devices);
  if (g.ok()) {
    nccl = std::move(*g);
    sh.nccl = nccl.get();
  } else {
    std::printf("NCCL unavailable: %s\n\n", g.status().ToString().c_str());
  }
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  std::printf("NCCL_NVLS_ENABLE=%s; %d calls a graph, median of %d replays, slowest rank\n\n",
              nvls != nullptr ? nvls : "(unset)", kCallsPerGraph, replays);

  sh.per_call_us.assign(kNumMethods, std::vector<std::vector<double>>(
                                         sh.shapes.size(), std::vector<double>(gpus, 0.0)));
  sh.eager_us.assign(gpus, 0.0);
  Barrier barrier(gpus);
  sh.barrier = &barrier;
  std::vector<std::thread> threads;
  for (int r = 0; r < gpus; ++r) threads.emplace_back(Rank, &sh, r);
  for (std::thread& t : threads) t.join();

  std::printf(
      "| bytes | rows x dim | %s us | %s us | %s us | %s us | plain / NCCL | fused / NCCL |\n",
      kMethodNames[0], kMethodNames[3], kMethodNames[1], kMethodNames[2]);
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (size_t si = 0; si < sh.shapes.size(); ++si) {
    const Shape& s = sh.shapes[si];
    const double plain = Slowest(sh.per_call_us[kCustomPlain][si]);
    const double barrier = Slowest(sh.per_call_us[kBarrierPlain][si]);
    const double fused = Slowest(sh.per_call_us[kCustomFused][si]);
    const double ref = Slowest(sh.per_call_us[kNccl][si]);
    char bytes[32];
    if (s.bytes >= (1 << 20)) {
      std::snprintf(bytes, sizeof(bytes), "%lld MiB", static_cast<long long>(s.bytes >> 20));
    } else {
      std::snprintf(bytes, sizeof(bytes), "%lld KiB", static_cast<long long>(s.bytes >> 10));
    }
    auto cell = [](double us, bool have) {
      char buf[32];
      if (have) {
        std::snprintf(buf, sizeof(buf), "%.1f", us);
      } else {
        std::snprintf(buf, sizeof(buf), "-");
      }
      return std::string(buf);
    };
    auto ratio = [&](double a) {
      char buf[32];
      if (sh.custom != nullptr && sh.nccl != nullptr && ref > 0) {
        std::snprintf(buf, sizeof(buf), "%.2f", a / ref);
      } else {
        std::snprintf(buf, sizeof(buf), "-");
      }
      return std::string(buf);
    };
    std::printf("| %s | %lld x %lld | %s | %s | %s | %s | %s | %s |\n", bytes,
                static_cast<long long>(s.rows), static_cast<long long>(s.dim),
                cell(plain, sh.custom != nullptr).c_str(),
                cell(barrier, sh.custom != nullptr).c_str(),
                cell(fused, sh.custom != nullptr).c_str(), cell(ref, sh.nccl != nullptr).c_str(),
                ratio(plain).c_str(), ratio(fused).c_str());
  }
  if (sh.custom != nullptr) {
    const Shape& s = sh.shapes[sh.eager_shape];
    std::printf("\ncustom plain, eager launches (no graph), %lld KiB: %.1f us a call\n",
                static_cast<long long>(s.bytes >> 10), Slowest(sh.eager_us));
  }
  return 0;
}

}  // namespace
}  // namespace specd

int main(int argc, char** argv) { return specd::Main(argc, argv); }
