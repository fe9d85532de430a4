// Row invariance of the cuBLASLt GEMMs (specd/kernels/cuda/gemm.h): with
// invariant_rows set, each output row of y = x w^T has the same bits whatever
// the number of rows m in the call, the property that makes a token's logits
// independent of the rest of its batch.
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "specd/kernels/cuda/gemm.h"
#include "tests/gpu/gpu_test_util.h"

namespace specd {
namespace {

using gpu_test::bf16;

class GemmInvarianceTest
    : public gpu_test::GpuTest,
      public ::testing::WithParamInterface<std::tuple<int, int, bool>> {};

TEST_P(GemmInvarianceTest, RowsDoNotDependOnM) {
  const auto [n, k, y_fp32] = GetParam();
  constexpr int kMaxRows = 300;
  std::unique_ptr<cuda::Gemm> gemm;
  ASSERT_EQ(cuda::Gemm::Create(size_t{32} << 20, &gemm, kMaxRows),
            CUBLAS_STATUS_SUCCESS);
  std::mt19937_64 rng(n * 31 + k);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<bf16> x(static_cast<size_t>(kMaxRows) * k),
      w(static_cast<size_t>(n) * k);
  for (bf16 &v : x)
    v = __float2bfloat16(dist(rng));
  for (bf16 &v : w)
    v = __float2bfloat16(0.05f * dist(rng));
  gpu_test::DeviceBuffer<bf16> dx(x), dw(w);
  const size_t elem = y_fp32 ? 4 : 2;
  gpu_test::DeviceBuffer<uint8_t> full(static_cast<size_t>(kMaxRows) * n *
                                       elem),
      part(static_cast<size_t>(kMaxRows) * n * elem);
  cuda::GemmParams p;
  p.x = dx.get();
  p.w = dw.get();
  p.y = full.get();
  p.y_fp32 = y_fp32;
  p.m = kMaxRows;
  p.n = n;
  p.k = k;
  ASSERT_EQ(gemm->Run(p, stream_), CUBLAS_STATUS_SUCCESS);
  Sync();
  const std::vector<uint8_t> want = full.Download();
  EXPECT_EQ(gemm->non_invariant_shapes(), 0)
      << "cuBLASLt offered no row-invariant algorithm";
  for (int m : {1, 2, 3, 7, 16, 17, 33, 64, 65, 129, 257, kMaxRows - 1}) {
    p.y = part.get();
    p.m = m;
    ASSERT_EQ(gemm->Run(p, stream_), CUBLAS_STATUS_SUCCESS);
    Sync();
    const std::vector<uint8_t> got = part.Download();
    EXPECT_EQ(
        std::memcmp(got.data(), want.data(), static_cast<size_t>(m) * n * elem),
        0)
        << "m = " << m << " differs from the first m rows of m = " << kMaxRows;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmInvarianceTest,
                         ::testing::Values(std::make_tuple(1024, 512, false),
                                           std::make_tuple(6144, 4096, false),
                                           std::make_tuple(4096, 14336, false),
                                           std::make_tuple(8192, 576, true),
                                           std::make_tuple(1000, 256, true)));

} // namespace
} // namespace specd
