// Gemm's row classes (specd/kernels/cuda/gemm_plan.h): plain C++, unit-tested without a GPU
// (tests/unit/gemm_plan_test.cc).
#include "specd/kernels/cuda/gemm_plan.h"

#include <algorithm>

namespace specd {
namespace cuda {

int64_t GemmPlanRows(int64_t invariant_rows, int64_t plan_rows) {
  return std::max<int64_t>(1, std::min(plan_rows, std::max<int64_t>(1, invariant_rows)));
}

std::vector<int64_t> GemmRowClassLimits(int64_t invariant_rows, int64_t plan_rows,
                                        bool bucket_classes) {
  std::vector<int64_t> limits;
  if (invariant_rows <= 0) return limits;
  const int64_t shift = bucket_classes ? 1 : 0;
  limits.push_back(1);
  for (int64_t hi = std::max<int64_t>(GemmPlanRows(invariant_rows, plan_rows), 2);
       limits.back() < invariant_rows; hi *= 2) {
    limits.push_back(std::min(hi + shift, invariant_rows));
  }
  return limits;
}

size_t GemmRowClassOf(const std::vector<int64_t>& limits, int64_t m) {
  return static_cast<size_t>(std::lower_bound(limits.begin(), limits.end(), m) - limits.begin());
}

}  // namespace cuda
}  // namespace specd
