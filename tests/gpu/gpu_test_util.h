// Helpers for the GPU op tests: skip without a device, device buffers, bf16 conversion, and
// comparisons that fail on NaN.
#ifndef SPECD_TESTS_GPU_GPU_TEST_UTIL_H_
#define SPECD_TESTS_GPU_GPU_TEST_UTIL_H_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace specd {
namespace gpu_test {

using bf16 = __nv_bfloat16;

inline bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Every GPU test derives from this: without a usable device the test is skipped, so the
// suite passes in CI (which compiles these tests) and runs in full on a GPU host.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  void Sync() { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }

  cudaStream_t stream_ = nullptr;
};

#define SPECD_CUDA_OK(expr)                                                                \
  do {                                                                                     \
    const cudaError_t specd_err_ = (expr);                                                 \
    ASSERT_EQ(specd_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(specd_err_); \
  } while (0)

// A typed device allocation.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) { Resize(n); }
  explicit DeviceBuffer(const std::vector<T>& host) { Upload(host); }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void Resize(size_t n) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    size_ = n;
    if (n > 0 && cudaMalloc(&ptr_, n * sizeof(T)) != cudaSuccess) ptr_ = nullptr;
    if (ptr_ != nullptr) cudaMemset(ptr_, 0, n * sizeof(T));
  }
  void Upload(const std::vector<T>& host) {
    Resize(host.size());
    if (!host.empty()) {
      cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
    }
  }
  std::vector<T> Download() const {
    std::vector<T> host(size_);
    if (size_ > 0) cudaMemcpy(host.data(), ptr_, size_ * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }
  T* get() const { return static_cast<T*>(ptr_); }
  size_t size() const { return size_; }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

inline std::vector<bf16> ToBf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(v[i]);
  return out;
}

inline std::vector<float> ToFloat(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

// Values rounded to bf16 and back: what the GPU sees, to feed the fp32 CPU reference.
inline std::vector<float> RoundBf16(const std::vector<float>& v) { return ToFloat(ToBf16(v)); }

inline std::vector<float> RandomNormal(size_t n, std::mt19937_64& rng, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// |actual - expected| <= atol + rtol * |expected| elementwise; NaN or Inf in either never
// passes (the comparison is written so that any NaN makes it false).
inline ::testing::AssertionResult AllClose(const std::vector<float>& actual,
                                           const std::vector<float>& expected, float atol,
                                           float rtol) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << "sizes differ: " << actual.size() << " vs " << expected.size();
  }
  size_t bad = 0;
  double worst = 0;
  size_t worst_i = 0;
  std::ostringstream first;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double a = actual[i], e = expected[i];
    const double err = std::fabs(a - e);
    const bool ok = std::isfinite(a) && std::isfinite(e) && err <= atol + rtol * std::fabs(e);
    if (!ok) {
      if (bad < 5) first << "  [" << i << "] got " << a << " want " << e << "\n";
      ++bad;
    }
    if (!(err <= worst)) {
      worst = err;
      worst_i = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << actual.size() << " elements differ (worst |err| " << worst << " at "
         << worst_i << "):\n"
         << first.str();
}

// n token ids drawn uniformly from [0, vocab).
inline std::vector<int32_t> RandomTokens(int n, int vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> pick(0, vocab - 1);
  std::vector<int32_t> v(n);
  for (int32_t& t : v) t = pick(rng);
  return v;
}

// Logit rows ([rows, vocab] fp32, host) of a backend against a reference: per row,
// ||got - want|| / ||want|| <= tol (a NaN fails). The success message names the worst row's
// relative error.
inline ::testing::AssertionResult RowsClose(const std::vector<float>& got,
                                            const std::vector<float>& want, int vocab,
                                            double tol) {
  if (got.size() != want.size() || want.empty()) {
    return ::testing::AssertionFailure() << "sizes " << got.size() << " vs " << want.size();
  }
  double worst = 0;
  for (size_t r = 0; r < want.size() / vocab; ++r) {
    double diff = 0, norm = 0;
    for (int i = 0; i < vocab; ++i) {
      const double d = got[r * vocab + i] - want[r * vocab + i];
      diff += d * d;
      norm += static_cast<double>(want[r * vocab + i]) * want[r * vocab + i];
    }
    const double rel = std::sqrt(diff / norm);
    if (!(rel <= tol)) {
      return ::testing::AssertionFailure() << "row " << r << ": relative error " << rel;
    }
    worst = std::max(worst, rel);
  }
  return ::testing::AssertionSuccess() << "worst relative error " << worst;
}

}  // namespace gpu_test
}  // namespace specd

#endif  // SPECD_TESTS_GPU_GPU_TEST_UTIL_H_
