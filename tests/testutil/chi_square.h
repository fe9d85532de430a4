// Chi-square helpers for the distribution tests of sampled outputs (speculation, overlap).
#ifndef SPECD_TESTS_TESTUTIL_CHI_SQUARE_H_
#define SPECD_TESTS_TESTUTIL_CHI_SQUARE_H_

#include <cmath>
#include <cstddef>
#include <utility>
#include <vector>

namespace specd {

// Chi-square critical value at p = 0.001 (Wilson-Hilferty approximation, good to a few
// percent for df >= 3).
inline double ChiSquareCritical001(int df) {
  const double z = 3.090232;  // standard normal quantile at 0.999
  const double a = 2.0 / (9.0 * df);
  return df * std::pow(1 - a + z * std::sqrt(a), 3);
}

// Two equal-sized samples from one distribution, binned alike: sum (a - b)^2 / (a + b),
// chi-square with (non-empty bins - 1) degrees of freedom. Returns {statistic, df}.
inline std::pair<double, int> TwoSampleChiSquare(const std::vector<int>& a,
                                                 const std::vector<int>& b) {
  double chi2 = 0;
  int bins = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] + b[i] == 0) continue;
    ++bins;
    chi2 += static_cast<double>(a[i] - b[i]) * (a[i] - b[i]) / (a[i] + b[i]);
  }
  return {chi2, bins - 1};
}

}  // namespace specd

#endif  // SPECD_TESTS_TESTUTIL_CHI_SQUARE_H_
