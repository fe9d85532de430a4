// LinearCpu (specd's batch-invariant fp32 GEMM) against OpenBLAS sgemm on one thread, for the
// reference target's GEMM shapes (k x n: q/o 320x320, k/v 320x64, gate/up 320x864, down
// 864x320, LM head 320x8192) and m rows from decode to prefill. Three ways:
//   BM_Specd      LinearCpu, the kernel the backends use;
//   BM_Sgemm      one cblas_sgemm of all m rows (fast, but its bits depend on m);
//   BM_SgemmRows8 the backends' former path: sgemm on blocks of exactly 8 rows, the last one
//                 zero-padded (row-invariant in practice, but W is packed once per block).
// Run: OPENBLAS_NUM_THREADS=1 build/bench/linear_cpu_bench
#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "specd/kernels/linear.h"

namespace specd {
namespace {

struct Problem {
  int64_t k, n, m;
  std::vector<float> x, w, y;
  explicit Problem(const benchmark::State& state)
      : k(state.range(0)), n(state.range(1)), m(state.range(2)) {
    std::mt19937 rng(1);
    std::normal_distribution<float> d(0.0f, 0.05f);
    x.resize(m * k);
    w.resize(n * k);
    y.resize(m * n);
    for (float& v : x) v = d(rng);
    for (float& v : w) v = d(rng);
  }
};

void Finish(benchmark::State& state, const Problem& p) {
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * p.m * p.n * p.k * state.iterations() * 1e-9,
                                                 benchmark::Counter::kIsRate);
  state.SetLabel(LinearIsaName(LinearCpuIsa()));
}

void BM_Specd(benchmark::State& state) {
  Problem p(state);
  LinearParams lp;
  lp.x = p.x.data();
  lp.w = p.w.data();
  lp.y = p.y.data();
  lp.rows = p.m;
  lp.in_features = p.k;
  lp.out_features = p.n;
  for (auto _ : state) {
    LinearCpu(lp);
    benchmark::DoNotOptimize(p.y.data());
  }
  Finish(state, p);
}

void BM_Sgemm(benchmark::State& state) {
  openblas_set_num_threads(1);
  Problem p(state);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, p.m, p.n, p.k, 1.0f, p.x.data(), p.k,
                p.w.data(), p.k, 0.0f, p.y.data(), p.n);
    benchmark::DoNotOptimize(p.y.data());
  }
  Finish(state, p);
}

void BM_SgemmRows8(benchmark::State& state) {
  openblas_set_num_threads(1);
  Problem p(state);
  constexpr int64_t kBlock = 8;
  std::vector<float> xt(kBlock * p.k, 0.0f), yt(kBlock * p.n);
  for (auto _ : state) {
    const int64_t full = p.m / kBlock * kBlock;
    for (int64_t r = 0; r < full; r += kBlock) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, kBlock, p.n, p.k, 1.0f,
                  p.x.data() + r * p.k, p.k, p.w.data(), p.k, 0.0f, p.y.data() + r * p.n, p.n);
    }
    if (const int64_t tail = p.m - full; tail > 0) {
      std::fill(xt.begin(), xt.end(), 0.0f);
      std::memcpy(xt.data(), p.x.data() + full * p.k, sizeof(float) * tail * p.k);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, kBlock, p.n, p.k, 1.0f, xt.data(), p.k,
                  p.w.data(), p.k, 0.0f, yt.data(), p.n);
      std::memcpy(p.y.data() + full * p.n, yt.data(), sizeof(float) * tail * p.n);
    }
    benchmark::DoNotOptimize(p.y.data());
  }
  Finish(state, p);
}

}  // namespace
}  // namespace specd

// The three ways registered shape by shape, so that they run side by side in time.
int main(int argc, char** argv) {
  for (auto [k, n] :
       {std::pair<int, int>{320, 320}, {320, 64}, {320, 864}, {864, 320}, {320, 8192}}) {
    for (int m : {1, 5, 8, 17, 32, 64, 128, 512}) {
      for (auto [name, fn] :
           {std::pair<const char*, void (*)(benchmark::State&)>{"Specd", specd::BM_Specd},
            {"Sgemm", specd::BM_Sgemm},
            {"SgemmRows8", specd::BM_SgemmRows8}}) {
        benchmark::RegisterBenchmark(name, fn)
            ->ArgNames({"k", "n", "m"})
            ->Args({k, n, m})
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
