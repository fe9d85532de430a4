// Linear layers on the GPU through cuBLASLt, bf16 inputs with fp32
// accumulation: y = x w^T
// (+ bias), w in Hugging Face [out_features, in_features] layout (the CPU
// reference is specd/kernels/linear.h). The LM head is the same call with an
// fp32 output.
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
  const bf16 *x = nullptr; // [m, k] bf16, device, row-major
  const bf16 *w = nullptr; // [n, k] bf16, device, row-major
  const bf16 *bias =
      nullptr;       // [n] bf16, device, or null (only with a bf16 output)
  void *y = nullptr; // [m, n] device, row-major: fp32 if y_fp32, else bf16
  bool y_fp32 = false;
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
};

// Owns a cuBLASLt handle, a workspace and, per problem shape, the algorithm
// cuBLASLt's heuristic picked (the heuristic query costs far more than a small
// GEMM). One thread uses an instance at a time.
//
// Row invariance. cuBLASLt's heuristic picks a different algorithm (tile shape,
// split-K) for different row counts m, so the same row of x can give different
// bits in a GEMM of 1 row and one of 40: a token's logits would then depend on
// what else shares its step, and speculative greedy output could drift from
// target-only greedy output after a near-tie. With `invariant_rows` > 0, every
// GEMM of m <= invariant_rows rows for one (n, k, output, bias, alignment) uses
// one algorithm: the first of cuBLASLt's candidates for m = `plan_rows` that it
// accepts for both 1 and invariant_rows rows within the workspace. A fixed
// algorithm cuts K and reduces partial sums the same way whatever m is, so each
// output row is a function of its input row alone
// (tests/gpu/gemm_invariance_test.cc checks this bit for bit).
class Gemm {
public:
  // Allocates `workspace_bytes` of device memory on the current device.
  static cublasStatus_t Create(size_t workspace_bytes,
                               std::unique_ptr<Gemm> *out,
                               int64_t invariant_rows = 0,
                               int64_t plan_rows = 16);

  int64_t invariant_rows() const { return invariant_rows_; }
  // Shape families (weights) for which cuBLASLt offered no candidate valid over
  // the whole row range; their GEMMs fall back to a per-shape pick and are not
  // row-invariant.
  int non_invariant_shapes() const { return non_invariant_shapes_; }
  ~Gemm();
  Gemm(const Gemm &) = delete;
  Gemm &operator=(const Gemm &) = delete;

  // Enqueues y = x w^T (+ bias) on `stream`. CUBLAS_STATUS_INVALID_VALUE for
  // bad params, CUBLAS_STATUS_NOT_SUPPORTED when cuBLASLt offers no algorithm
  // for the shape.
  cublasStatus_t Run(const GemmParams &p, cudaStream_t stream);

private:
  struct Plan;
  // (m, n, k, y_fp32, has_bias, alignment of x, w, y in bytes, capped at 256)
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, int, int, int>;

  // (n, k, y_fp32, has_bias, alignment of x, w, y): the shape family a pinned
  // algorithm serves.
  using FamilyKey = std::tuple<int64_t, int64_t, bool, bool, int, int, int>;
  struct Pinned {
    bool found = false;
    cublasLtMatmulAlgo_t algo = {};
  };

  Gemm() = default;
  cublasStatus_t MakePlan(const Key &key, Plan *plan);
  cublasStatus_t MakeLayouts(const Key &key, Plan *plan);
  // The pinned algorithm of `key`'s family, found on first use.
  const Pinned &PinnedFor(const Key &key);

  cublasLtHandle_t handle_ = nullptr;
  void *workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, std::unique_ptr<Plan>> plans_;
  int64_t invariant_rows_ = 0;
  int64_t plan_rows_ = 16;
  int non_invariant_shapes_ = 0;
  std::map<FamilyKey, Pinned> pinned_;
};

} // namespace cuda
} // namespace specd

#endif // SPECD_KERNELS_CUDA_GEMM_H_
