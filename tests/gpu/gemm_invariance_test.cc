// Row invariance of the cuBLASLt GEMMs (specd/kernels/cuda/gemm.h): with
// invariant_rows set, each output row of y = x w^T has the same bits whatever
// the number of rows m in the call, the property that makes a token's logits
// independent of the rest of its batch. Gemm runs one algorithm per row class
// (m in [1, 1], [2, 16], [17, 32], ...), each admitted by a self-check against
// the base algorithm; these tests check the outcome against the truth that
// matters, the row computed alone (m = 1, a decode step), and print how each
// family's base was chosen and which classes got an algorithm of their own
// (Gemm::Summary). The base may split K (split-K with a deterministic
// reduction), which these tests check at many m like any other base.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "specd/kernels/cuda/gemm.h"
#include "tests/gpu/gpu_test_util.h"

namespace specd {
namespace {

using gpu_test::bf16;

// The cuBLASLt workspace the CUDA backend gives Gemm (engine/cuda/
// cuda_forward.cc): which split-K algorithms qualify as a base depends on it,
// so the tests use the same.
constexpr size_t kBackendWorkspace = size_t{128} << 20;

class GemmInvarianceTest
    : public gpu_test::GpuTest,
      public ::testing::WithParamInterface<std::tuple<int, int, bool>> {};

TEST_P(GemmInvarianceTest, RowsDoNotDependOnM) {
  const auto [n, k, y_fp32] = GetParam();
  constexpr int kMaxRows = 300;
  std::unique_ptr<cuda::Gemm> gemm;
  ASSERT_EQ(cuda::Gemm::Create(kBackendWorkspace, &gemm, kMaxRows),
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
  EXPECT_EQ(gemm->untimed_bases(), 0) << gemm->Summary();
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
  EXPECT_EQ(gemm->self_check_failures(), 0) << gemm->Summary();
  std::printf("%s", gemm->Summary().c_str());
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmInvarianceTest,
                         ::testing::Values(std::make_tuple(1024, 512, false),
                                           std::make_tuple(6144, 4096, false),
                                           std::make_tuple(4096, 14336, false),
                                           std::make_tuple(8192, 576, true),
                                           std::make_tuple(1000, 256, true)));

// Fast, reproducible uniform bf16 in (-scale, scale) (the LM head's weights
// are half a billion values).
std::vector<bf16> RandomBf16(size_t count, uint64_t seed, float scale) {
  std::vector<bf16> v(count);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (bf16 &e : v) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    const float u = static_cast<float>(s >> 40) * (2.0f / 16777216.0f) - 1.0f;
    e = __float2bfloat16(u * scale);
  }
  return v;
}

// The engine's configuration: invariant up to 1024 rows, base looked up at 16.
constexpr int kEngineRows = 1024;

// A weight (and bias), kEngineRows input rows of various magnitudes, and each
// row's output computed alone (m = 1, through aligned one-row buffers as a
// decode step has them): the bits every larger GEMM must reproduce.
class GemmRowClassTest : public gpu_test::GpuTest {
protected:
  void Prepare(int n, int k, bool y_fp32, bool bias, cuda::Gemm *gemm,
               int k_splits = 1) {
    Upload(n, k, y_fp32, bias, k_splits);
    ComputeReferences(gemm);
  }

  // The weight, bias and input rows, without running a GEMM. With k_splits >
  // 1 a row's output is its k_splits slabs' rows, side by side.
  void Upload(int n, int k, bool y_fp32, bool bias, int k_splits = 1) {
    n_ = n;
    k_ = k;
    splits_ = k_splits;
    elem_ = y_fp32 ? 4 : 2;
    std::vector<bf16> x =
        RandomBf16(static_cast<size_t>(kEngineRows) * k, n * 7 + k, 1.0f);
    // Rows of 2^-6 .. 2^6 times the base scale: activations vary that much.
    for (int r = 0; r < kEngineRows; ++r) {
      const float scale = std::ldexp(1.0f, (r * 5) % 13 - 6);
      for (int c = 0; c < k; ++c) {
        bf16 &v = x[static_cast<size_t>(r) * k + c];
        v = __float2bfloat16(__bfloat162float(v) * scale);
      }
    }
    x_.Upload(x);
    w_.Upload(RandomBf16(static_cast<size_t>(n) * k, n * 13 + k + 1,
                         1.0f / std::sqrt(static_cast<float>(k))));
    if (bias)
      bias_.Upload(RandomBf16(n, n + 5, 1.0f));
    y_.Resize(static_cast<size_t>(kEngineRows) * k_splits * n * elem_);
    row_x_.Resize(k);
    row_y_.Resize(static_cast<size_t>(k_splits) * n * elem_);
    p_ = cuda::GemmParams();
    p_.w = w_.get();
    p_.bias = bias ? bias_.get() : nullptr;
    p_.y_fp32 = y_fp32;
    p_.n = n;
    p_.k = k;
    p_.k_splits = k_splits;
  }

  // Each input row's output alone (m = 1), into ref_.
  void ComputeReferences(cuda::Gemm *gemm) {
    const size_t row_bytes = static_cast<size_t>(splits_) * n_ * elem_;
    gpu_test::DeviceBuffer<uint8_t> ref(static_cast<size_t>(kEngineRows) *
                                        row_bytes);
    cuda::GemmParams one = p_;
    one.x = row_x_.get();
    one.y = row_y_.get();
    one.m = 1;
    for (int r = 0; r < kEngineRows; ++r) {
      SPECD_CUDA_OK(cudaMemcpyAsync(
          row_x_.get(), x_.get() + static_cast<size_t>(r) * k_,
          k_ * sizeof(bf16), cudaMemcpyDeviceToDevice, stream_));
      ASSERT_EQ(gemm->Run(one, stream_), CUBLAS_STATUS_SUCCESS) << "row " << r;
      SPECD_CUDA_OK(cudaMemcpyAsync(ref.get() + r * row_bytes, row_y_.get(),
                                    row_bytes, cudaMemcpyDeviceToDevice,
                                    stream_));
    }
    Sync();
    ref_ = ref.Download();
  }

  // Captures one Run of `p` into a graph: the capture must survive it (a Run
  // that synchronized would end it).
  void CaptureRun(cuda::Gemm *gemm, const cuda::GemmParams &p,
                  cudaGraphExec_t *exec) {
    cudaGraph_t graph = nullptr;
    SPECD_CUDA_OK(
        cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    const cublasStatus_t captured = gemm->Run(p, stream_);
    const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
    ASSERT_EQ(captured, CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(ended, cudaSuccess)
        << cudaGetErrorString(ended)
        << " (did Run synchronize inside the capture?)";
    SPECD_CUDA_OK(cudaGraphInstantiate(exec, graph, 0));
    cudaGraphDestroy(graph);
  }

  // Poisons y_, replays `exec` (or runs `p` on `gemm` eagerly when exec is
  // null), and expects rows 0..m-1 to equal the m = 1 references.
  void ExpectRowsAlone(cudaGraphExec_t exec, cuda::Gemm *gemm,
                       const cuda::GemmParams &p, const char *what) {
    SPECD_CUDA_OK(
        cudaMemsetAsync(y_.get(), 0xff, p.m * splits_ * n_ * elem_, stream_));
    if (exec != nullptr) {
      SPECD_CUDA_OK(cudaGraphLaunch(exec, stream_));
    } else {
      ASSERT_EQ(gemm->Run(p, stream_), CUBLAS_STATUS_SUCCESS);
    }
    Sync();
    const std::string diff = CompareRows(DownloadRows(p.m), p.m);
    EXPECT_TRUE(diff.empty()) << what << ": " << diff;
  }

  // Runs `p` with `m` rows twice (the second call runs the plan cached after
  // the class's check) and expects rows 0..m-1 to equal the m = 1 references.
  void RunTwiceExpectRowsAlone(cuda::Gemm *gemm, cuda::GemmParams p,
                               int64_t m) {
    p.m = m;
    ASSERT_EQ(gemm->Run(p, stream_), CUBLAS_STATUS_SUCCESS) << "m " << m;
    ASSERT_EQ(gemm->Run(p, stream_), CUBLAS_STATUS_SUCCESS) << "m " << m;
    Sync();
    const std::string diff = CompareRows(DownloadRows(m), m);
    EXPECT_TRUE(diff.empty()) << "m " << m << ": " << diff;
  }

  // The first m rows of y_ on the host, each row's slabs side by side (the
  // layout of a one-row output).
  std::vector<uint8_t> DownloadRows(int64_t m) {
    std::vector<uint8_t> host(static_cast<size_t>(m) * splits_ * n_ * elem_);
    EXPECT_EQ(
        cudaMemcpy(host.data(), y_.get(), host.size(), cudaMemcpyDeviceToHost),
        cudaSuccess);
    if (splits_ == 1)
      return host;
    const size_t part = static_cast<size_t>(n_) * elem_;
    std::vector<uint8_t> rows(host.size());
    for (int64_t r = 0; r < m; ++r) {
      for (int s = 0; s < splits_; ++s) {
        std::memcpy(rows.data() + (r * splits_ + s) * part,
                    host.data() + (s * m + r) * part, part);
      }
    }
    return rows;
  }

  // Empty when rows 0..m-1 of `got` equal the m = 1 references bit for bit;
  // else which rows differ, and in how many elements.
  std::string CompareRows(const std::vector<uint8_t> &got, int64_t m) const {
    const int row_elems = splits_ * n_;
    const size_t row_bytes = static_cast<size_t>(row_elems) * elem_;
    int bad = 0;
    std::ostringstream detail;
    for (int64_t r = 0; r < m; ++r) {
      const uint8_t *g = got.data() + r * row_bytes,
                    *want = ref_.data() + r * row_bytes;
      if (std::memcmp(g, want, row_bytes) == 0)
        continue;
      if (bad < 5) {
        int elems = 0;
        for (int c = 0; c < row_elems; ++c) {
          elems += std::memcmp(g + c * elem_, want + c * elem_, elem_) != 0;
        }
        detail << " row " << r << " (" << elems << " of " << row_elems
               << " elements);";
      }
      ++bad;
    }
    if (bad == 0)
      return "";
    std::ostringstream out;
    out << bad << " of " << m
        << " rows differ from the same row alone:" << detail.str();
    return out.str();
  }

  int n_ = 0, k_ = 0, splits_ = 1;
  size_t elem_ = 2;
  gpu_test::DeviceBuffer<bf16> x_, w_, bias_, row_x_;
  gpu_test::DeviceBuffer<uint8_t> y_, row_y_;
  std::vector<uint8_t> ref_;
  cuda::GemmParams p_;
};

struct Shape {
  int n, k;
  bool y_fp32, bias;
  int k_splits = 1;
};

std::string ShapeName(const ::testing::TestParamInfo<Shape> &info) {
  const Shape &s = info.param;
  return "n" + std::to_string(s.n) + "_k" + std::to_string(s.k) +
         (s.y_fp32 ? "_fp32" : "_bf16") + (s.bias ? "_bias" : "") +
         (s.k_splits > 1 ? "_split" + std::to_string(s.k_splits) : "");
}

class GemmRowClassShapeTest : public GemmRowClassTest,
                              public ::testing::WithParamInterface<Shape> {};

// Each row of an m-row GEMM equals the row alone, for m at both sides of
// every row-class boundary, as the engine configures Gemm.
TEST_P(GemmRowClassShapeTest, EveryRowEqualsTheRowAlone) {
  const Shape s = GetParam();
  std::unique_ptr<cuda::Gemm> gemm;
  // The plain doubling classes, and the engine's (ending at the verify
  // buckets 2^j + 1).
  ASSERT_EQ(cuda::Gemm::Create(kBackendWorkspace, &gemm, kEngineRows),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(gemm->row_class_limits(),
            (std::vector<int64_t>{1, 16, 32, 64, 128, 256, 512, 1024}));
  ASSERT_EQ(cuda::Gemm::Create(kBackendWorkspace, &gemm, kEngineRows,
                               /*plan_rows=*/16, /*bucket_classes=*/true),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(gemm->row_class_limits(),
            (std::vector<int64_t>{1, 17, 33, 65, 129, 257, 513, 1024}));
  ASSERT_NO_FATAL_FAILURE(
      Prepare(s.n, s.k, s.y_fp32, s.bias, gemm.get(), s.k_splits));
  cuda::GemmParams p = p_;
  p.x = x_.get();
  p.y = y_.get();
  for (int64_t m : {1, 2, 3, 17, 18, 33, 34, 65, 66, 100, 129, 130, 257, 258,
                    513, 514, 700, 1024}) {
    ASSERT_NO_FATAL_FAILURE(RunTwiceExpectRowsAlone(gemm.get(), p, m));
  }
  EXPECT_EQ(gemm->non_invariant_shapes(), 0)
      << "cuBLASLt offered no row-invariant algorithm";
  EXPECT_EQ(gemm->untimed_bases(), 0)
      << "the base was first used eagerly, so it should have been timed\n"
      << gemm->Summary();
  EXPECT_EQ(gemm->self_check_failures(), 0) << gemm->Summary();
  // All 8 classes were used.
  EXPECT_EQ(gemm->own_algorithm_classes() + gemm->base_algorithm_classes(), 8)
      << gemm->Summary();
  std::printf("%d of 8 row classes run an algorithm of their own\n%s",
              gemm->own_algorithm_classes(), gemm->Summary().c_str());
}

INSTANTIATE_TEST_SUITE_P(
    Llama8bAndAwkward, GemmRowClassShapeTest,
    ::testing::Values(
        // Llama-3.1-8B: QKV, O, gate+up, down, LM head.
        Shape{6144, 4096, false, false}, Shape{4096, 4096, false, false},
        Shape{28672, 4096, false, false}, Shape{4096, 14336, false, false},
        Shape{128256, 4096, true, false},
        // The engine's sublayer outputs cut into K ranges (o_proj, down; the
        // 1B's o_proj), and an awkward one.
        Shape{4096, 4096, true, false, 2}, Shape{4096, 14336, true, false, 2},
        Shape{2048, 2048, true, false, 2}, Shape{1000, 384, true, false, 3},
        // A QKV bias (Qwen-style), and shapes of no tile size.
        Shape{6144, 4096, false, true}, Shape{1000, 256, true, false},
        Shape{1001, 136, false, true}, Shape{8192, 576, true, false},
        Shape{384, 72, false, false}),
    ShapeName);

// With timing off (SPECD_GEMM_TIMING=0 in the engine) the base is the untimed
// choice and each class runs the first candidate that passes its self-check:
// still row-invariant, and the same picks in every process.
TEST_F(GemmRowClassTest, UntimedPicksKeepRowInvariance) {
  std::unique_ptr<cuda::Gemm> gemm;
  ASSERT_EQ(cuda::Gemm::Create(kBackendWorkspace, &gemm, kEngineRows,
                               /*plan_rows=*/16, /*bucket_classes=*/true,
                               /*timed_picks=*/false),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_NO_FATAL_FAILURE(Prepare(4096, 14336, false, false, gemm.get()));
  cuda::GemmParams p = p_;
  p.x = x_.get();
  p.y = y_.get();
  for (int64_t m : {1, 17, 65}) {
    ASSERT_NO_FATAL_FAILURE(RunTwiceExpectRowsAlone(gemm.get(), p, m));
  }
  const std::string summary = gemm->Summary();
  EXPECT_EQ(gemm->untimed_bases(), 1) << summary;
  EXPECT_NE(summary.find("untimed (timing off)"), std::string::npos) << summary;
  EXPECT_EQ(gemm->self_check_failures(), 0) << summary;
  EXPECT_EQ(gemm->own_algorithm_classes() + gemm->base_algorithm_classes(), 3)
      << summary;
}

// A GEMM whose row class is new while the stream captures a CUDA graph does
// not synchronize (that would break the capture): it runs the base algorithm,
// and the next GEMM of that shape outside a capture decides the class. Both
// give the rows' bits alone.
TEST_F(GemmRowClassTest, CaptureDefersTheSelfCheck) {
  std::unique_ptr<cuda::Gemm> gemm;
  ASSERT_EQ(cuda::Gemm::Create(kBackendWorkspace, &gemm, kEngineRows),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_NO_FATAL_FAILURE(Prepare(4096, 4096, false, false, gemm.get()));
  const int decided =
      gemm->own_algorithm_classes() + gemm->base_algorithm_classes();
  EXPECT_EQ(decided, 1) << "only the m = 1 class should be decided\n"
                        << gemm->Summary();
  EXPECT_EQ(gemm->untimed_bases(), 0) << gemm->Summary();
  cuda::GemmParams p = p_;
  p.x = x_.get();
  p.y = y_.get();
  p.m = 65;

  cudaGraphExec_t exec = nullptr;
  ASSERT_NO_FATAL_FAILURE(CaptureRun(gemm.get(), p, &exec));
  EXPECT_EQ(gemm->own_algorithm_classes() + gemm->base_algorithm_classes(),
            decided)
      << "a class was decided during the capture";
  ExpectRowsAlone(exec, gemm.get(), p, "graph (base algorithm)");

  // Eager: the class is decided now.
  ExpectRowsAlone(nullptr, gemm.get(), p, "eager, after the check");
  EXPECT_EQ(gemm->own_algorithm_classes() + gemm->base_algorithm_classes(),
            decided + 1)
      << gemm->Summary();

  // The graph still runs what it captured, with the same bits.
  ExpectRowsAlone(exec, gemm.get(), p, "graph, again");
  cudaGraphExecDestroy(exec);
  EXPECT_EQ(gemm->self_check_failures(), 0) << gemm->Summary();
  std::printf("%s", gemm->Summary().c_str());
}

// A family whose first GEMM is captured into a CUDA graph cannot time its
// base candidates (that synchronizes): it takes the untimed base for good,
// and stays row-invariant.
TEST_F(GemmRowClassTest, FirstUseInACaptureTakesTheUntimedBase) {
  std::unique_ptr<cuda::Gemm> gemm;
  ASSERT_EQ(cuda::Gemm::Create(kBackendWorkspace, &gemm, kEngineRows),
            CUBLAS_STATUS_SUCCESS);
  Upload(4096, 4096, false, false);
  cuda::GemmParams p = p_;
  p.x = x_.get();
  p.y = y_.get();
  p.m = 65;

  cudaGraphExec_t exec = nullptr;
  ASSERT_NO_FATAL_FAILURE(CaptureRun(gemm.get(), p, &exec));
  EXPECT_EQ(gemm->untimed_bases(), 1) << gemm->Summary();

  // Eager one-row GEMMs now: the same (untimed) base, its [1, 1] class
  // decided against it.
  ASSERT_NO_FATAL_FAILURE(ComputeReferences(gemm.get()));
  EXPECT_EQ(gemm->untimed_bases(), 1) << gemm->Summary();
  ExpectRowsAlone(exec, gemm.get(), p, "graph");
  ExpectRowsAlone(nullptr, gemm.get(), p, "eager, after the check");
  cudaGraphExecDestroy(exec);
  EXPECT_EQ(gemm->self_check_failures(), 0) << gemm->Summary();
  std::printf("%s", gemm->Summary().c_str());
}

} // namespace
} // namespace specd
