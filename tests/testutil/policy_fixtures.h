// Inputs for tests of the goodput policy (engine/spec/policy.h): acceptance estimates with a
// known rate and cost options of a known shape.
#ifndef SPECD_TESTS_TESTUTIL_POLICY_FIXTURES_H_
#define SPECD_TESTS_TESTUTIL_POLICY_FIXTURES_H_

#include <cmath>

#include "engine/spec/policy.h"

namespace specd::testutil {

// An estimate whose chain acceptance is `p` at every depth, as if observed many times.
inline AcceptanceEstimate Acceptance(double p, const PolicyOptions& options) {
  AcceptanceEstimate a;
  const SpecShape chain{8, 1, 8};
  for (int s = 0; s < 400; ++s) {
    // Evenly spread, unsorted samples: accepted = the deepest d with u < p^d.
    const double u = std::fmod(0.5 + s * 0.6180339887498949, 1.0);
    int accepted = 0;
    double reach = 1.0;
    for (int d = 1; d <= 8; ++d) {
      reach *= p;
      if (u < reach) accepted = d;
    }
    a.Observe(chain, accepted, options);
  }
  return a;
}

// GPU-like costs, not measured: verify nearly flat in tokens until the batch's tokens fill the
// device, then linear; a draft level cheap but not free.
inline PolicyOptions GpuLikeCosts() {
  PolicyOptions o;
  o.measure_costs = false;
  o.verify_fixed_s = 10e-3;
  o.verify_per_row_s = 0.0;
  o.verify_per_token_s = 0.05e-3;
  o.draft_fixed_s = 0.2e-3;
  o.draft_level_fixed_s = 0.5e-3;
  o.draft_level_per_token_s = 0.005e-3;
  return o;
}

// CPU-like costs, not measured: every token verify scores costs (a fixed part, then linear),
// a draft level and a catch-up token as the reference draft on one core.
inline PolicyOptions CpuLikeCosts() {
  PolicyOptions o;
  o.measure_costs = false;
  o.verify_fixed_s = 10e-3;
  o.verify_per_row_s = 0;
  o.verify_per_token_s = 0.3e-3;
  o.draft_fixed_s = 0.5e-3;
  o.draft_level_fixed_s = 0.5e-3;
  o.draft_level_per_token_s = 0.02e-3;
  o.draft_prefill_token_s = 80e-6;
  return o;
}

}  // namespace specd::testutil

#endif  // SPECD_TESTS_TESTUTIL_POLICY_FIXTURES_H_
