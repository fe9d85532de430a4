// Gemm's row classes (specd/kernels/cuda/gemm_plan.h), which decide which row counts of a weight
// share one algorithm (and so give a row the same bits whatever else shares its GEMM). Host code,
// so these run on every machine; tests/gpu/gemm_invariance_test.cc checks the bits on a GPU.
#include "specd/kernels/cuda/gemm_plan.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace specd {
namespace {

TEST(GemmPlanTest, PlanRowsAreClampedToTheInvariantRange) {
  EXPECT_EQ(cuda::GemmPlanRows(1024, 16), 16);
  EXPECT_EQ(cuda::GemmPlanRows(8, 16), 8);
  EXPECT_EQ(cuda::GemmPlanRows(0, 16), 1);
  EXPECT_EQ(cuda::GemmPlanRows(1024, 0), 1);
  EXPECT_EQ(cuda::GemmPlanRows(1024, -3), 1);
}

TEST(GemmPlanTest, ClassesDoubleUpToTheInvariantRows) {
  EXPECT_EQ(cuda::GemmRowClassLimits(1024, 16, false),
            (std::vector<int64_t>{1, 16, 32, 64, 128, 256, 512, 1024}));
  // A verify step pads to the pending token plus 2^j nodes: each class ends one row later.
  EXPECT_EQ(cuda::GemmRowClassLimits(1024, 16, true),
            (std::vector<int64_t>{1, 17, 33, 65, 129, 257, 513, 1024}));
  // A bound past invariant_rows is capped to it.
  EXPECT_EQ(cuda::GemmRowClassLimits(100, 16, false), (std::vector<int64_t>{1, 16, 32, 64, 100}));
  EXPECT_EQ(cuda::GemmRowClassLimits(64, 16, true), (std::vector<int64_t>{1, 17, 33, 64}));
}

TEST(GemmPlanTest, SmallAndEmptyRanges) {
  EXPECT_TRUE(cuda::GemmRowClassLimits(0, 16, false).empty()) << "no invariance";
  EXPECT_TRUE(cuda::GemmRowClassLimits(-5, 16, true).empty());
  EXPECT_EQ(cuda::GemmRowClassLimits(1, 16, false), (std::vector<int64_t>{1}));
  EXPECT_EQ(cuda::GemmRowClassLimits(2, 16, false), (std::vector<int64_t>{1, 2}));
  // plan_rows 1 still leaves decode its own class: [1, 1], then [2, 2], [3, 4], ...
  EXPECT_EQ(cuda::GemmRowClassLimits(8, 1, false), (std::vector<int64_t>{1, 2, 4, 8}));
}

TEST(GemmPlanTest, ClassOfFindsTheFirstBoundAtOrAboveM) {
  const std::vector<int64_t> limits = cuda::GemmRowClassLimits(1024, 16, true);
  EXPECT_EQ(cuda::GemmRowClassOf(limits, 1), 0u);
  EXPECT_EQ(cuda::GemmRowClassOf(limits, 2), 1u);
  EXPECT_EQ(cuda::GemmRowClassOf(limits, 17), 1u);
  EXPECT_EQ(cuda::GemmRowClassOf(limits, 18), 2u);
  EXPECT_EQ(cuda::GemmRowClassOf(limits, 1024), limits.size() - 1);
  EXPECT_EQ(cuda::GemmRowClassOf(limits, 1025), limits.size()) << "past the invariant rows";
  // Every m in a class maps to it, and the classes tile [1, invariant_rows] without gaps.
  int64_t lo = 1;
  for (size_t c = 0; c < limits.size(); ++c) {
    for (int64_t m = lo; m <= limits[c]; ++m) EXPECT_EQ(cuda::GemmRowClassOf(limits, m), c) << m;
    lo = limits[c] + 1;
  }
}

// A base's cost weighs decode most (gemm.h): t(1) + 0.5 t(64) + 0.25 t(256), the row counts
// capped at invariant_rows and one capped onto an earlier one dropped with its weight.
TEST(GemmPlanTest, BaseCostRowsAreCappedAndDeduplicated) {
  cuda::GemmCostRows r = cuda::GemmBaseCostRows(1024);
  EXPECT_EQ(r.rows, (std::vector<int64_t>{1, 64, 256}));
  EXPECT_EQ(r.weights, (std::vector<double>{1.0, 0.5, 0.25}));
  r = cuda::GemmBaseCostRows(100);  // 256 capped to 100
  EXPECT_EQ(r.rows, (std::vector<int64_t>{1, 64, 100}));
  EXPECT_EQ(r.weights, (std::vector<double>{1.0, 0.5, 0.25}));
  r = cuda::GemmBaseCostRows(64);  // 256 capped onto 64: dropped
  EXPECT_EQ(r.rows, (std::vector<int64_t>{1, 64}));
  EXPECT_EQ(r.weights, (std::vector<double>{1.0, 0.5}));
  r = cuda::GemmBaseCostRows(1);
  EXPECT_EQ(r.rows, (std::vector<int64_t>{1}));
  EXPECT_EQ(r.weights, (std::vector<double>{1.0}));
}

// The first timed candidate stands unless a later one is more than 3% cheaper; untimed ones
// (negative costs) never win.
TEST(GemmPlanTest, PickCheapestNeedsAClearMarginToDisplace) {
  EXPECT_EQ(cuda::GemmPickCheapest({}), -1);
  EXPECT_EQ(cuda::GemmPickCheapest({-1.0, -1.0}), -1);
  EXPECT_EQ(cuda::GemmPickCheapest({10.0, 9.8}), 0) << "2% cheaper: noise";
  EXPECT_EQ(cuda::GemmPickCheapest({10.0, 9.6}), 1) << "4% cheaper";
  EXPECT_EQ(cuda::GemmPickCheapest({-1.0, 10.0, 12.0}), 1) << "the first with a cost";
  EXPECT_EQ(cuda::GemmPickCheapest({10.0, -1.0, 9.0, 8.9}), 2)
      << "displaced by 9, which 8.9 does not displace";
  EXPECT_EQ(cuda::GemmPickCheapest({10.0, 9.0, 8.0}), 2) << "each displacement from the last";
}

}  // namespace
}  // namespace specd
