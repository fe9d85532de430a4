// cuBLASLt GEMMs, their special case: the params' checks. The results against the CPU reference
// LinearNaiveCpu (bf16 and fp32 outputs, bias, K splits, per-shape and row-class picks) are
// op-table cases (ops_cuda_test.cc); row invariance is gemm_invariance_test.cc's.
#include <memory>
#include <vector>

#include "specd/kernels/cuda/gemm.h"
#include "tests/gpu/gpu_test_util.h"

namespace specd {
namespace {

using gpu_test::bf16;
using gpu_test::DeviceBuffer;

class GemmCudaTest : public gpu_test::GpuTest {};

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
