// The Gemm class (specd/kernels/cuda/gemm.h): plans per shape, the per-shape pick, Run and
// Summary; the row-invariant picks are gemm_choose.cc's.
#include "specd/kernels/cuda/gemm.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <utility>

#include "kernels/cuda/gemm_internal.h"
#include "specd/kernels/cuda/gemm_plan.h"

namespace specd {
namespace cuda {
namespace {

using internal::AlgoConfig;
using internal::Alignment;
using internal::AppendCandidates;
using internal::CheckScratch;
using internal::ConfigString;
using internal::CountMismatches;
using internal::CreatePreference;
using internal::DeterministicReduction;
using internal::FillCheckRows;
using internal::Fingerprint;
using internal::FlushBytes;
using internal::kCandidates;
using internal::kMaxBases;
using internal::kMaxChecked;
using internal::kMaxTimed;
using internal::kProbeRows;
using internal::kRetileClusters;
using internal::kRetileMaxRows;
using internal::kRetileTiles;
using internal::ReadConfig;
using internal::SameAlgo;
using internal::SameKSplit;
using internal::TimeLaunches;
using internal::WithKSplit;

}  // namespace

cublasStatus_t Gemm::Create(size_t workspace_bytes, std::unique_ptr<Gemm>* out,
                            int64_t invariant_rows, int64_t plan_rows, bool bucket_classes,
                            bool timed_picks, bool retile) {
  std::unique_ptr<Gemm> g(new Gemm());
  g->timed_picks_ = timed_picks;
  g->retile_ = retile;
  g->invariant_rows_ = invariant_rows > 0 ? invariant_rows : 0;
  g->plan_rows_ = GemmPlanRows(invariant_rows, plan_rows);
  g->class_hi_ = GemmRowClassLimits(invariant_rows, plan_rows, bucket_classes);
  if (cublasStatus_t st = cublasLtCreate(&g->handle_); st != CUBLAS_STATUS_SUCCESS) return st;
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
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

cublasStatus_t Gemm::MakeLayouts(const Key& key, Plan* plan) {
  const auto [m, n, k, y_fp32, has_bias, align_x, align_w, align_y, splits] = key;
  (void)align_x;
  (void)align_w;
  (void)align_y;
  cublasStatus_t st = cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                 sizeof(trans_a));
  cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                 sizeof(trans_b));
  if (has_bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = CUDA_R_16BF;
    cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                   sizeof(epilogue));
    cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                   sizeof(bias_type));
  }
  const cudaDataType_t y_type = y_fp32 ? CUDA_R_32F : CUDA_R_16BF;
  // A K split is a strided batch: batch s reads the K range [s k/S, (s+1) k/S)
  // of w and x in place (leading dimension k, batch offset k/S elements) and
  // writes its own [m, n] slab of y.
  const int64_t part = k / splits;
  if ((st = cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, part, n, k)) !=
          CUBLAS_STATUS_SUCCESS ||
      (st = cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, part, m, k)) !=
          CUBLAS_STATUS_SUCCESS ||
      (st = cublasLtMatrixLayoutCreate(&plan->d, y_type, n, m, n)) != CUBLAS_STATUS_SUCCESS) {
    return st;
  }
  if (splits > 1) {
    const int32_t count = splits;
    const int64_t slab = m * n;
    for (const auto& [layout, offset] :
         {std::pair{plan->a, part}, std::pair{plan->b, part}, std::pair{plan->d, slab}}) {
      if ((st = cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                 sizeof(count))) != CUBLAS_STATUS_SUCCESS ||
          (st = cublasLtMatrixLayoutSetAttribute(
               layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &offset, sizeof(offset))) !=
              CUBLAS_STATUS_SUCCESS) {
        return st;
      }
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

bool Gemm::AlgoFits(const cublasLtMatmulAlgo_t& algo, const Plan& plan) {
  cublasLtMatmulHeuristicResult_t check = {};
  return cublasLtMatmulAlgoCheck(handle_, plan.desc, plan.a, plan.b, plan.d, plan.d, &algo,
                                 &check) == CUBLAS_STATUS_SUCCESS &&
         check.workspaceSize <= workspace_bytes_;
}

size_t Gemm::ClassOf(int64_t m) const { return GemmRowClassOf(class_hi_, m); }

cublasStatus_t Gemm::ChooseAlgo(const Key& key, const GemmParams& p, cudaStream_t stream,
                                Plan* plan) {
  const auto [m, n, k, y_fp32, has_bias, align_x, align_w, align_y, splits] = key;
  plan->provisional = false;
  if (invariant_rows_ > 0 && m <= invariant_rows_) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
      cudaGetLastError();
      capture = cudaStreamCaptureStatusActive;  // unknown: do not sync
    }
    const bool capturing = capture != cudaStreamCaptureStatusNone;
    Family& family = FamilyFor(key, p, stream, capturing);
    if (family.found) {
      const size_t c = ClassOf(m);
      RowClass& rc = family.classes[c];
      if (!rc.decided && !capturing) {
        const auto start = std::chrono::steady_clock::now();
        DecideClass(FamilyKey{n, k, y_fp32, has_bias, align_x, align_w, align_y, splits}, &family,
                    c, p, stream);
        rc.decide_ms =
            std::chrono::duration<float, std::milli>(std::chrono::steady_clock::now() - start)
                .count();
      }
      if (rc.decided && rc.own && AlgoFits(rc.algo, *plan)) {
        plan->algo = rc.algo;
        return CUBLAS_STATUS_SUCCESS;
      }
      if (AlgoFits(family.base, *plan)) {
        plan->algo = family.base;
        plan->provisional = !rc.decided;
        return CUBLAS_STATUS_SUCCESS;
      }
    }
  }
  cublasLtMatmulPreference_t pref = nullptr;
  cublasStatus_t st = CreatePreference(workspace_bytes_, align_x, align_w, align_y, &pref);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  cublasLtMatmulHeuristicResult_t result = {};
  int returned = 0;
  st = cublasLtMatmulAlgoGetHeuristic(handle_, plan->desc, plan->a, plan->b, plan->d, plan->d, pref,
                                      1, &result, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  if (returned == 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  plan->algo = result.algo;
  return CUBLAS_STATUS_SUCCESS;
}

Gemm::Family& Gemm::FamilyFor(const Key& key, const GemmParams& p, cudaStream_t stream,
                              bool capturing) {
  const auto [m, n, k, y_fp32, has_bias, align_x, align_w, align_y, splits] = key;
  (void)m;
  const FamilyKey fk{n, k, y_fp32, has_bias, align_x, align_w, align_y, splits};
  auto found = families_.find(fk);
  if (found != families_.end()) return found->second;
  Family& family = families_[fk];
  family.classes.resize(class_hi_.size());
  const auto start = std::chrono::steady_clock::now();
  ChooseBase(fk, p, stream, capturing, &family);
  family.choose_ms =
      std::chrono::duration<float, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (!family.found)
    ++non_invariant_shapes_;
  else if (!family.timed)
    ++untimed_bases_;
  return family;
}

std::string Gemm::Summary() const {
  std::string out;
  char buf[256];
  for (const auto& [fk, family] : families_) {
    const auto [n, k, y_fp32, has_bias, align_x, align_w, align_y, splits] = fk;
    std::snprintf(
        buf, sizeof(buf), "n %lld k %lld%s %s%s align x/w/y %d/%d/%d: ", static_cast<long long>(n),
        static_cast<long long>(k),
        splits > 1 ? (" in " + std::to_string(splits) + " K ranges").c_str() : "",
        y_fp32 ? "fp32 out" : "bf16 out", has_bias ? " +bias" : "", align_x, align_w, align_y);
    out += buf;
    if (!family.found) {
      out += "no base algorithm (not row-invariant)\n";
      continue;
    }
    out += "base " + ConfigString(family.base) + "\n    " + family.why;
    if (family.timed) {
      // The cost and its terms: the base's group's time at each timed m
      // (the base's own in parentheses), then the untimed choice's cost and
      // cuBLASLt's m = 1 pick (a per-shape decode) for comparison.
      std::snprintf(buf, sizeof(buf), ": cost %.1f us =", family.cost_us);
      out += buf;
      for (size_t t = 0; t < family.timed_rows.size(); ++t) {
        std::snprintf(buf, sizeof(buf), "%s %.2f x %.1f (base %.1f) at m %lld", t == 0 ? "" : " +",
                      family.weights[t], family.group_us[t], family.base_us[t],
                      static_cast<long long>(family.timed_rows[t]));
        out += buf;
      }
      std::snprintf(buf, sizeof(buf),
                    "; untimed choice's cost %.1f us; cuBLASLt's m 1 pick "
                    "%.1f us; %d bases, %d helpers timed, %zu in the group",
                    family.first_cost_us, family.m1_pick_us, family.bases_timed,
                    family.helpers_timed, family.group.size());
      out += buf;
    }
    std::snprintf(buf, sizeof(buf), " (%.1f ms)", family.choose_ms);
    out += buf;
    out += "\n";
    for (size_t c = 0; c < family.classes.size(); ++c) {
      const RowClass& rc = family.classes[c];
      const long long lo = c == 0 ? 1 : class_hi_[c - 1] + 1, hi = class_hi_[c];
      std::snprintf(buf, sizeof(buf), "  rows [%lld, %lld]: ", lo, hi);
      out += buf;
      if (!rc.decided) {
        out += "not used yet\n";
        continue;
      }
      std::snprintf(buf, sizeof(buf),
                    "%s; %d candidates checked%s, %d differed, %d timed "
                    "(base included when it passed)",
                    rc.why, rc.checked, rc.retiled ? " (re-tiled ones too, fastest first)" : "",
                    rc.mismatched, rc.passed);
      out += buf;
      if (rc.us[0] >= 0.0f) {
        std::snprintf(buf, sizeof(buf), "; %.1f / %.1f us at m %lld / %lld", rc.us[0], rc.us[1], lo,
                      hi);
        out += buf;
      }
      if (rc.own && rc.base_us[0] >= 0.0f) {
        std::snprintf(buf, sizeof(buf), " (base %.1f / %.1f us)", rc.base_us[0], rc.base_us[1]);
        out += buf;
      }
      if (rc.own) out += ": " + ConfigString(rc.algo);
      std::snprintf(buf, sizeof(buf), " (%.1f ms)", rc.decide_ms);
      out += buf;
      out += "\n";
    }
  }
  return out;
}

cublasStatus_t Gemm::Run(const GemmParams& p, cudaStream_t stream) {
  if (p.m < 0 || p.n <= 0 || p.k <= 0 || (p.bias != nullptr && p.y_fp32) || p.k_splits < 1 ||
      (p.k_splits > 1 && (!p.y_fp32 || !KSplitFits(p.k, p.k_splits)))) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (p.m == 0) return CUBLAS_STATUS_SUCCESS;
  if (p.x == nullptr || p.w == nullptr || p.y == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  // With a K split, the alignments cuBLASLt may assume hold for every batch's
  // pointers: a K range starts k/S elements after its predecessor in x and w,
  // a slab m n elements after its predecessor in y (taken as a multiple of n,
  // so that the alignment, and with it the family, does not depend on m).
  const int64_t part_bytes = p.k / p.k_splits * static_cast<int64_t>(sizeof(bf16));
  const int64_t slab_bytes = p.n * static_cast<int64_t>(sizeof(float));
  const auto align = [&](const void* ptr, int64_t step) {
    int a = Alignment(ptr);
    while (p.k_splits > 1 && a > 1 && step % a != 0) a /= 2;
    return a;
  };
  const Key key{p.m,
                p.n,
                p.k,
                p.y_fp32,
                p.bias != nullptr,
                align(p.x, part_bytes),
                align(p.w, part_bytes),
                align(p.y, slab_bytes),
                p.k_splits};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    auto plan = std::make_unique<Plan>();
    if (cublasStatus_t st = MakeLayouts(key, plan.get()); st != CUBLAS_STATUS_SUCCESS) return st;
    if (cublasStatus_t st = ChooseAlgo(key, p, stream, plan.get()); st != CUBLAS_STATUS_SUCCESS)
      return st;
    it = plans_.emplace(key, std::move(plan)).first;
  } else if (it->second->provisional) {
    // The class's check was deferred by a capture; try again. On failure the
    // plan keeps the base algorithm it has.
    Plan& plan = *it->second;
    const cublasLtMatmulAlgo_t kept = plan.algo;
    if (ChooseAlgo(key, p, stream, &plan) != CUBLAS_STATUS_SUCCESS) {
      plan.algo = kept;
      plan.provisional = true;
    }
  }
  Plan& plan = *it->second;
  if (p.bias != nullptr) {
    cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias,
                                   sizeof(p.bias));
  }
  const float alpha = 1.0f, beta = 0.0f;
  return cublasLtMatmul(handle_, plan.desc, &alpha, p.w, plan.a, p.x, plan.b, &beta, p.y, plan.d,
                        p.y, plan.d, &plan.algo, workspace_, workspace_bytes_, stream);
}

}  // namespace cuda
}  // namespace specd
