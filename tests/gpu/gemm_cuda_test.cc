// cuBLASLt GEMMs against the CPU reference LinearNaiveCpu (double accumulation) on the same
// bf16-rounded inputs: bf16 and fp32 (LM head) outputs, with and without bias, awkward shapes.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "specd/kernels/cuda/gemm.h"
#include "specd/kernels/linear.h"
#include "tests/gpu/gpu_test_util.h"

namespace specd {
namespace {

using gpu_test::AllClose;
using gpu_test::bf16;
using gpu_test::DeviceBuffer;
using gpu_test::RandomNormal;
using gpu_test::RoundBf16;
using gpu_test::ToBf16;
using gpu_test::ToFloat;

// Row-major bf16-rounded GEMM inputs: x [m, k] and w [n, k], scaled so that the products are
// O(1) whatever k is.
struct Operands {
  std::vector<float> x, w;
};
Operands RandomOperands(int m, int n, int k, std::mt19937_64& rng) {
  Operands o;
  o.x = RoundBf16(RandomNormal(static_cast<size_t>(m) * k, rng));
  o.w = RoundBf16(RandomNormal(static_cast<size_t>(n) * k, rng, 1.0f / std::sqrt(float(k))));
  return o;
}

// The CPU reference y [m, n] = x [m, k] · w [n, k]ᵀ (+ bias [n] where not null), host fp32.
std::vector<float> CpuProduct(const float* x, const float* w, const float* bias, int m, int n,
                              int k) {
  std::vector<float> y(static_cast<size_t>(m) * n);
  LinearParams ref;
  ref.x = x;
  ref.w = w;
  ref.bias = bias;
  ref.y = y.data();
  ref.rows = m;
  ref.in_features = k;
  ref.out_features = n;
  LinearNaiveCpu(ref);
  return y;
}

// Per-shape picks (invariant_rows 0) and, as the engine runs it, one algorithm per row class
// (invariant_rows 1024; each class's algorithm is then first used, and self-checked, here).
class GemmCudaTest : public gpu_test::GpuTest {};
// The CUDA backend's cuBLASLt workspace (engine/cuda/cuda_backend.cc).
constexpr size_t kBackendWorkspace = size_t{128} << 20;
class GemmCudaRowsTest : public gpu_test::GpuTest,
                         public ::testing::WithParamInterface<int64_t> {};

TEST_P(GemmCudaRowsTest, MatchesReference) {
  const int64_t invariant_rows = GetParam();
  std::unique_ptr<cuda::Gemm> gemm;
  ASSERT_EQ(cuda::Gemm::Create(kBackendWorkspace, &gemm, invariant_rows), CUBLAS_STATUS_SUCCESS);
  std::mt19937_64 rng(41);
  struct Case {
    int m, n, k;
    bool y_fp32, bias;
  };
  for (const Case c : {Case{1, 384, 256, false, false}, Case{7, 1000, 136, false, true},
                       Case{64, 320, 64, true, false}, Case{257, 1001, 200, false, false},
                       Case{3, 4096, 1024, true, false}, Case{1, 1001, 136, true, false},
                       Case{65, 2048, 512, false, true}, Case{1024, 512, 256, true, false}}) {
    const auto [x, w] = RandomOperands(c.m, c.n, c.k, rng);
    const std::vector<float> bias = RoundBf16(RandomNormal(c.n, rng));
    DeviceBuffer<bf16> d_x(ToBf16(x)), d_w(ToBf16(w)), d_bias(ToBf16(bias));
    DeviceBuffer<bf16> d_y16(static_cast<size_t>(c.m) * c.n);
    DeviceBuffer<float> d_y32(static_cast<size_t>(c.m) * c.n);
    cuda::GemmParams p;
    p.x = d_x.get();
    p.w = d_w.get();
    p.bias = c.bias ? d_bias.get() : nullptr;
    p.y = c.y_fp32 ? static_cast<void*>(d_y32.get()) : static_cast<void*>(d_y16.get());
    p.y_fp32 = c.y_fp32;
    p.m = c.m;
    p.n = c.n;
    p.k = c.k;
    // Twice: the second call reuses the cached plan.
    for (int rep = 0; rep < 2; ++rep) {
      ASSERT_EQ(gemm->Run(p, stream_), CUBLAS_STATUS_SUCCESS)
          << "m " << c.m << " n " << c.n << " k " << c.k;
    }
    Sync();
    const std::vector<float> want =
        CpuProduct(x.data(), w.data(), c.bias ? bias.data() : nullptr, c.m, c.n, c.k);
    const std::vector<float> got = c.y_fp32 ? d_y32.Download() : ToFloat(d_y16.Download());
    // fp32 accumulation of O(1) sums; a bf16 output adds its rounding.
    EXPECT_TRUE(AllClose(got, want, c.y_fp32 ? 1e-3f : 1e-2f, c.y_fp32 ? 1e-3f : 1.0f / 128))
        << "m " << c.m << " n " << c.n << " k " << c.k << (c.bias ? " bias" : "")
        << (c.y_fp32 ? " fp32 out" : "") << " invariant_rows " << invariant_rows;
  }
  EXPECT_EQ(gemm->self_check_failures(), 0) << gemm->Summary();
  EXPECT_EQ(gemm->untimed_bases(), 0) << gemm->Summary();
}

INSTANTIATE_TEST_SUITE_P(InvariantRows, GemmCudaRowsTest, ::testing::Values(0, 1024));

// A K-split GEMM (GemmParams::k_splits): slab s is the product over the K range s alone.
TEST_P(GemmCudaRowsTest, KSplitSlabsAreTheRangesProducts) {
  const int64_t invariant_rows = GetParam();
  std::unique_ptr<cuda::Gemm> gemm;
  ASSERT_EQ(cuda::Gemm::Create(kBackendWorkspace, &gemm, invariant_rows), CUBLAS_STATUS_SUCCESS);
  std::mt19937_64 rng(43);
  struct Case {
    int m, n, k, splits;
  };
  for (const Case c : {Case{1, 4096, 1024, 2}, Case{65, 1000, 512, 2}, Case{7, 384, 768, 4},
                       Case{3, 320, 384, 3}, Case{257, 512, 256, 2}}) {
    const auto [x, w] = RandomOperands(c.m, c.n, c.k, rng);
    DeviceBuffer<bf16> d_x(ToBf16(x)), d_w(ToBf16(w));
    DeviceBuffer<float> d_y(static_cast<size_t>(c.splits) * c.m * c.n);
    cuda::GemmParams p;
    p.x = d_x.get();
    p.w = d_w.get();
    p.y = d_y.get();
    p.y_fp32 = true;
    p.m = c.m;
    p.n = c.n;
    p.k = c.k;
    p.k_splits = c.splits;
    for (int rep = 0; rep < 2; ++rep) {
      ASSERT_EQ(gemm->Run(p, stream_), CUBLAS_STATUS_SUCCESS)
          << "m " << c.m << " n " << c.n << " k " << c.k << " splits " << c.splits;
    }
    Sync();
    const std::vector<float> got = d_y.Download();
    const int part = c.k / c.splits;
    for (int s = 0; s < c.splits; ++s) {
      // The K range s of x and w as matrices of their own.
      std::vector<float> xs(static_cast<size_t>(c.m) * part), ws(static_cast<size_t>(c.n) * part);
      for (int r = 0; r < c.m; ++r)
        std::copy_n(x.begin() + r * c.k + s * part, part, xs.begin() + r * part);
      for (int r = 0; r < c.n; ++r)
        std::copy_n(w.begin() + r * c.k + s * part, part, ws.begin() + r * part);
      const std::vector<float> want = CpuProduct(xs.data(), ws.data(), nullptr, c.m, c.n, part);
      const std::vector<float> slab(got.begin() + static_cast<size_t>(s) * c.m * c.n,
                                    got.begin() + static_cast<size_t>(s + 1) * c.m * c.n);
      EXPECT_TRUE(AllClose(slab, want, 1e-3f, 1e-3f))
          << "slab " << s << " of m " << c.m << " n " << c.n << " k " << c.k << " splits "
          << c.splits << " invariant_rows " << invariant_rows;
    }
  }
  EXPECT_EQ(gemm->self_check_failures(), 0) << gemm->Summary();
  EXPECT_EQ(gemm->untimed_bases(), 0) << gemm->Summary();
}

TEST_F(GemmCudaTest, BadParamsAreRejected) {
  std::unique_ptr<cuda::Gemm> gemm;
  ASSERT_EQ(cuda::Gemm::Create(0, &gemm), CUBLAS_STATUS_SUCCESS);
  cuda::GemmParams p;
  p.m = 1;
  p.n = 0;
  p.k = 4;
  EXPECT_EQ(gemm->Run(p, stream_), CUBLAS_STATUS_INVALID_VALUE);
  // A K split needs an fp32 output, 16-byte aligned K ranges and no bias.
  DeviceBuffer<bf16> x(64), w(64 * 8), bias(8);
  DeviceBuffer<float> y(4 * 8);
  p.x = x.get();
  p.w = w.get();
  p.y = y.get();
  p.y_fp32 = true;
  p.n = 8;
  p.k = 64;
  p.k_splits = 0;
  EXPECT_EQ(gemm->Run(p, stream_), CUBLAS_STATUS_INVALID_VALUE);
  p.k_splits = 3;  // 64 is not a multiple of 24
  EXPECT_EQ(gemm->Run(p, stream_), CUBLAS_STATUS_INVALID_VALUE);
  p.k_splits = 2;
  p.y_fp32 = false;
  EXPECT_EQ(gemm->Run(p, stream_), CUBLAS_STATUS_INVALID_VALUE);
  p.y_fp32 = true;
  p.bias = bias.get();
  EXPECT_EQ(gemm->Run(p, stream_), CUBLAS_STATUS_INVALID_VALUE);
  p.bias = nullptr;
  EXPECT_EQ(gemm->Run(p, stream_), CUBLAS_STATUS_SUCCESS);
  Sync();
}

}  // namespace
}  // namespace specd
