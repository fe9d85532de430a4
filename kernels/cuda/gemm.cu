#include "specd/kernels/cuda/gemm.h"

#include <algorithm>
#include <utility>

namespace specd {
namespace cuda {
namespace {

int Alignment(const void *p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 1 && a % align != 0)
    align /= 2;
  return align;
}

// A heuristic query preference: at most `workspace` bytes, and the alignments
// (bytes) of X (operand B), W (operand A) and Y (C and D) this call has.
cublasStatus_t CreatePreference(uint64_t workspace, uint32_t align_x,
                                uint32_t align_w, uint32_t align_y,
                                cublasLtMatmulPreference_t *out) {
  cublasStatus_t st = cublasLtMatmulPreferenceCreate(out);
  if (st != CUBLAS_STATUS_SUCCESS)
    return st;
  cublasLtMatmulPreference_t pref = *out;
  const uint64_t ws = workspace;
  const uint32_t ax = align_x, aw = align_w, ay = align_y;
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aw, sizeof(aw));
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ax, sizeof(ax));
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ay, sizeof(ay));
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ay, sizeof(ay));
  return CUBLAS_STATUS_SUCCESS;
}

} // namespace

// cuBLAS is column-major; a row-major [r, c] matrix is a column-major [c, r]
// one. So y^T[n, m] = (w[n, k] row-major = col-major [k, n], transposed) * (x^T
// = col-major [k, m]).
struct Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo = {};

  ~Plan() {
    if (d != nullptr)
      cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr)
      cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr)
      cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr)
      cublasLtMatmulDescDestroy(desc);
  }
};

cublasStatus_t Gemm::Create(size_t workspace_bytes, std::unique_ptr<Gemm> *out,
                            int64_t invariant_rows, int64_t plan_rows) {
  std::unique_ptr<Gemm> g(new Gemm());
  g->invariant_rows_ = invariant_rows > 0 ? invariant_rows : 0;
  g->plan_rows_ = std::max<int64_t>(
      1, std::min(plan_rows, std::max<int64_t>(1, invariant_rows)));
  if (cublasStatus_t st = cublasLtCreate(&g->handle_);
      st != CUBLAS_STATUS_SUCCESS)
    return st;
  if (workspace_bytes > 0) {
    if (cudaMalloc(&g->workspace_, workspace_bytes) != cudaSuccess) {
      return CUBLAS_STATUS_ALLOC_FAILED;
    }
    g->workspace_bytes_ = workspace_bytes;
  }
  *out = std::move(g);
  return CUBLAS_STATUS_SUCCESS;
}

Gemm::~Gemm() {
  plans_.clear();
  if (workspace_ != nullptr)
    cudaFree(workspace_);
  if (handle_ != nullptr)
    cublasLtDestroy(handle_);
}

cublasStatus_t Gemm::MakeLayouts(const Key &key, Plan *plan) {
  const auto [m, n, k, y_fp32, has_bias, align_x, align_w, align_y] = key;
  (void)align_x;
  (void)align_w;
  (void)align_y;
  cublasStatus_t st =
      cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (st != CUBLAS_STATUS_SUCCESS)
    return st;
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                 &trans_a, sizeof(trans_a));
  cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                 &trans_b, sizeof(trans_b));
  if (has_bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = CUDA_R_16BF;
    cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                   &epilogue, sizeof(epilogue));
    cublasLtMatmulDescSetAttribute(plan->desc,
                                   CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                   &bias_type, sizeof(bias_type));
  }
  const cudaDataType_t y_type = y_fp32 ? CUDA_R_32F : CUDA_R_16BF;
  if ((st = cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, k, n, k)) !=
          CUBLAS_STATUS_SUCCESS ||
      (st = cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, k, m, k)) !=
          CUBLAS_STATUS_SUCCESS ||
      (st = cublasLtMatrixLayoutCreate(&plan->d, y_type, n, m, n)) !=
          CUBLAS_STATUS_SUCCESS) {
    return st;
  }
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t Gemm::MakePlan(const Key &key, Plan *plan) {
  const auto [m, n, k, y_fp32, has_bias, align_x, align_w, align_y] = key;
  (void)m;
  (void)n;
  (void)k;
  (void)y_fp32;
  (void)has_bias;
  cublasStatus_t st = MakeLayouts(key, plan);
  if (st != CUBLAS_STATUS_SUCCESS)
    return st;
  if (invariant_rows_ > 0 && std::get<0>(key) <= invariant_rows_) {
    const Pinned &pinned = PinnedFor(key);
    if (pinned.found) {
      cublasLtMatmulHeuristicResult_t check = {};
      if (cublasLtMatmulAlgoCheck(handle_, plan->desc, plan->a, plan->b,
                                  plan->d, plan->d, &pinned.algo,
                                  &check) == CUBLAS_STATUS_SUCCESS &&
          check.workspaceSize <= workspace_bytes_) {
        plan->algo = pinned.algo;
        return CUBLAS_STATUS_SUCCESS;
      }
    }
  }
  cublasLtMatmulPreference_t pref = nullptr;
  if ((st = CreatePreference(workspace_bytes_, align_x, align_w, align_y,
                             &pref)) != CUBLAS_STATUS_SUCCESS)
    return st;
  cublasLtMatmulHeuristicResult_t result = {};
  int returned = 0;
  st = cublasLtMatmulAlgoGetHeuristic(handle_, plan->desc, plan->a, plan->b,
                                      plan->d, plan->d, pref, 1, &result,
                                      &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS)
    return st;
  if (returned == 0)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  plan->algo = result.algo;
  return CUBLAS_STATUS_SUCCESS;
}

const Gemm::Pinned &Gemm::PinnedFor(const Key &key) {
  const auto [m, n, k, y_fp32, has_bias, align_x, align_w, align_y] = key;
  (void)m;
  const FamilyKey family{n, k, y_fp32, has_bias, align_x, align_w, align_y};
  auto found = pinned_.find(family);
  if (found != pinned_.end())
    return found->second;
  Pinned &pinned = pinned_[family];
  // Candidates for plan_rows_ rows; keep the first that cuBLASLt accepts at
  // both ends of the row range with the workspace this object has (a split-K
  // candidate whose workspace grows with m fails at invariant_rows and is
  // skipped).
  Plan at_plan, at_one, at_most;
  const Key plan_key{plan_rows_, n,       k,       y_fp32,
                     has_bias,   align_x, align_w, align_y};
  const Key one_key{1, n, k, y_fp32, has_bias, align_x, align_w, align_y};
  const Key most_key{invariant_rows_, n,       k,       y_fp32,
                     has_bias,        align_x, align_w, align_y};
  if (MakeLayouts(plan_key, &at_plan) == CUBLAS_STATUS_SUCCESS &&
      MakeLayouts(one_key, &at_one) == CUBLAS_STATUS_SUCCESS &&
      MakeLayouts(most_key, &at_most) == CUBLAS_STATUS_SUCCESS) {
    cublasLtMatmulPreference_t pref = nullptr;
    if (CreatePreference(workspace_bytes_, align_x, align_w, align_y, &pref) ==
        CUBLAS_STATUS_SUCCESS) {
      constexpr int kCandidates = 16;
      cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
      int returned = 0;
      if (cublasLtMatmulAlgoGetHeuristic(
              handle_, at_plan.desc, at_plan.a, at_plan.b, at_plan.d, at_plan.d,
              pref, kCandidates, results, &returned) == CUBLAS_STATUS_SUCCESS) {
        for (int i = 0; i < returned && !pinned.found; ++i) {
          bool ok = true;
          for (Plan *probe : {&at_one, &at_most}) {
            cublasLtMatmulHeuristicResult_t check = {};
            ok = ok &&
                 cublasLtMatmulAlgoCheck(handle_, probe->desc, probe->a,
                                         probe->b, probe->d, probe->d,
                                         &results[i].algo,
                                         &check) == CUBLAS_STATUS_SUCCESS &&
                 check.workspaceSize <= workspace_bytes_;
          }
          if (ok) {
            pinned.found = true;
            pinned.algo = results[i].algo;
          }
        }
      }
      cublasLtMatmulPreferenceDestroy(pref);
    }
  }
  if (!pinned.found)
    ++non_invariant_shapes_;
  return pinned;
}

cublasStatus_t Gemm::Run(const GemmParams &p, cudaStream_t stream) {
  if (p.m < 0 || p.n <= 0 || p.k <= 0 || (p.bias != nullptr && p.y_fp32)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (p.m == 0)
    return CUBLAS_STATUS_SUCCESS;
  if (p.x == nullptr || p.w == nullptr || p.y == nullptr)
    return CUBLAS_STATUS_INVALID_VALUE;
  const Key key{p.m,
                p.n,
                p.k,
                p.y_fp32,
                p.bias != nullptr,
                Alignment(p.x),
                Alignment(p.w),
                Alignment(p.y)};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    auto plan = std::make_unique<Plan>();
    if (cublasStatus_t st = MakePlan(key, plan.get());
        st != CUBLAS_STATUS_SUCCESS)
      return st;
    it = plans_.emplace(key, std::move(plan)).first;
  }
  Plan &plan = *it->second;
  if (p.bias != nullptr) {
    cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                   &p.bias, sizeof(p.bias));
  }
  const float alpha = 1.0f, beta = 0.0f;
  return cublasLtMatmul(handle_, plan.desc, &alpha, p.w, plan.a, p.x, plan.b,
                        &beta, p.y, plan.d, p.y, plan.d, &plan.algo, workspace_,
                        workspace_bytes_, stream);
}

} // namespace cuda
} // namespace specd
