// Gemm's row classes (specd/kernels/cuda/gemm.h, "Row invariance"): which row counts share one
// algorithm. Plain C++ with no CUDA header, so that a build without the CUDA toolkit compiles and
// tests it.
#ifndef SPECD_KERNELS_CUDA_GEMM_PLAN_H_
#define SPECD_KERNELS_CUDA_GEMM_PLAN_H_

#include <stddef.h>
#include <stdint.h>

#include <vector>

namespace specd {
namespace cuda {

// The row count whose heuristic pick is a family's untimed base: plan_rows clamped to
// [1, max(1, invariant_rows)].
int64_t GemmPlanRows(int64_t invariant_rows, int64_t plan_rows);

// The row classes' upper bounds, ascending (the first class starts at 1): [1, 1] (decode of one
// sequence), [2, GemmPlanRows(...)], then doubling ranges up to invariant_rows; with
// bucket_classes each bound after the first is one row later (plan_rows + 1, then 2^j + 1), the
// last capped at invariant_rows. Empty when invariant_rows <= 0 (no invariance).
std::vector<int64_t> GemmRowClassLimits(int64_t invariant_rows, int64_t plan_rows,
                                        bool bucket_classes);

// The index of the class of m in `limits` (GemmRowClassLimits): the first whose bound is >= m;
// limits.size() when m is past the last.
size_t GemmRowClassOf(const std::vector<int64_t>& limits, int64_t m);

// The row counts at which a family's candidate bases are timed, and their weights in a base's
// cost (gemm.h: cost = t(1) + 0.5 t(64) + 0.25 t(256)): each row count capped at invariant_rows,
// one capped onto an earlier one dropped with its weight.
struct GemmCostRows {
  std::vector<int64_t> rows;
  std::vector<double> weights;
};
GemmCostRows GemmBaseCostRows(int64_t invariant_rows);

// A later candidate displaces the one chosen so far only when it costs less than this fraction of
// the chosen one's cost: timing noise should not flip the choice from run to run.
inline constexpr double kGemmDisplace = 0.97;

// The candidate a timed pick takes, by index into `costs` (candidate order, negative: not timed):
// the first with a cost, displaced by each later one that costs less than kGemmDisplace times the
// chosen one's cost; -1 when none has a cost.
int GemmPickCheapest(const std::vector<double>& costs);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_GEMM_PLAN_H_
