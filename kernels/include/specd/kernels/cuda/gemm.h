// Linear layers on the GPU through cuBLASLt, bf16 inputs with fp32 accumulation: y = x w^T
// (+ bias), w in Hugging Face [out_features, in_features] layout (the CPU reference is
// specd/kernels/linear.h). The LM head is the same call with an fp32 output.
#ifndef SPECD_KERNELS_CUDA_GEMM_H_
#define SPECD_KERNELS_CUDA_GEMM_H_

#include <cublasLt.h>

#include <map>
#include <memory>
#include <tuple>

#include "specd/kernels/cuda/common.h"

namespace specd {
namespace cuda {

struct GemmParams {
  const bf16* x = nullptr;     // [m, k] bf16, device, row-major
  const bf16* w = nullptr;     // [n, k] bf16, device, row-major
  const bf16* bias = nullptr;  // [n] bf16, device, or null (only with a bf16 output)
  void* y = nullptr;           // [m, n] device, row-major: fp32 if y_fp32, else bf16
  bool y_fp32 = false;
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
};

// Owns a cuBLASLt handle, a workspace and, per problem shape, the algorithm cuBLASLt's
// heuristic picked (the heuristic query costs far more than a small GEMM). One thread uses
// an instance at a time.
class Gemm {
 public:
  // Allocates `workspace_bytes` of device memory on the current device.
  static cublasStatus_t Create(size_t workspace_bytes, std::unique_ptr<Gemm>* out);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // Enqueues y = x w^T (+ bias) on `stream`. CUBLAS_STATUS_INVALID_VALUE for bad params,
  // CUBLAS_STATUS_NOT_SUPPORTED when cuBLASLt offers no algorithm for the shape.
  cublasStatus_t Run(const GemmParams& p, cudaStream_t stream);

 private:
  struct Plan;
  // (m, n, k, y_fp32, has_bias, alignment of x, w, y in bytes, capped at 256)
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, int, int, int>;

  Gemm() = default;
  cublasStatus_t MakePlan(const Key& key, Plan* plan);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_GEMM_H_
