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

GemmCostRows GemmBaseCostRows(int64_t invariant_rows) {
  static constexpr int64_t kRows[] = {1, 64, 256};
  static constexpr double kWeights[] = {1.0, 0.5, 0.25};
  GemmCostRows out;
  for (size_t i = 0; i < sizeof(kRows) / sizeof(kRows[0]); ++i) {
    const int64_t m = std::min(kRows[i], invariant_rows);
    if (out.rows.empty() || m > out.rows.back()) {
      out.rows.push_back(m);
      out.weights.push_back(kWeights[i]);
    }
  }
  return out;
}

int GemmPickCheapest(const std::vector<double>& costs) {
  int chosen = -1;
  double chosen_cost = 0.0;
  for (size_t b = 0; b < costs.size(); ++b) {
    const double c = costs[b];
    if (c >= 0.0 && (chosen < 0 || c < kGemmDisplace * chosen_cost)) {
      chosen = static_cast<int>(b);
      chosen_cost = c;
    }
  }
  return chosen;
}

}  // namespace cuda
}  // namespace specd
