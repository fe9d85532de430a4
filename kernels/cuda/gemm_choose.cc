// Gemm's row-invariant picks (specd/kernels/cuda/gemm.h, "Row invariance"): a shape family's
// base algorithm, chosen by measurement (ChooseBase), and a row class's algorithm, chosen by the
// self-check and timing (DecideClass).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <utility>

#include "kernels/cuda/gemm_internal.h"
#include "specd/kernels/cuda/gemm.h"
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

void Gemm::ChooseBase(const FamilyKey& fk, const GemmParams& p, cudaStream_t stream, bool capturing,
                      Family* family) {
  const int64_t n = std::get<0>(fk), k = std::get<1>(fk);
  const bool y_fp32 = std::get<2>(fk), has_bias = std::get<3>(fk);
  const int align_x = std::get<4>(fk), align_w = std::get<5>(fk), align_y = std::get<6>(fk),
            splits = std::get<7>(fk);
  const auto key_for = [&](int64_t m) {
    return Key{m, n, k, y_fp32, has_bias, align_x, align_w, align_y, splits};
  };
  // The timed row counts and their weights, and the largest of them.
  const GemmCostRows cost_rows = GemmBaseCostRows(invariant_rows_);
  const std::vector<int64_t>& timed_m = cost_rows.rows;
  const std::vector<double>& weights = cost_rows.weights;
  const int64_t max_timed = timed_m.back();
  std::vector<std::unique_ptr<Plan>> plans;
  Plan at_most;
  bool ok = MakeLayouts(key_for(invariant_rows_), &at_most) == CUBLAS_STATUS_SUCCESS;
  for (int64_t m : timed_m) {
    plans.push_back(std::make_unique<Plan>());
    ok = ok && MakeLayouts(key_for(m), plans.back().get()) == CUBLAS_STATUS_SUCCESS;
  }
  if (!ok) return;
  if (has_bias) {
    for (auto& plan : plans) {
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias,
                                     sizeof(p.bias));
    }
  }

  // cuBLASLt's candidates for m = 1, plan_rows, the timed row counts and
  // invariant_rows, one list each, in its order.
  std::vector<int64_t> list_rows;
  std::vector<int64_t> wanted = {1, plan_rows_};
  wanted.insert(wanted.end(), timed_m.begin(), timed_m.end());
  wanted.push_back(invariant_rows_);
  for (int64_t rows : wanted) {
    rows = std::min(rows, invariant_rows_);
    if (std::find(list_rows.begin(), list_rows.end(), rows) == list_rows.end())
      list_rows.push_back(rows);
  }
  std::vector<std::vector<cublasLtMatmulAlgo_t>> lists(list_rows.size());
  for (size_t l = 0; l < list_rows.size(); ++l) {
    Plan at_rows;
    if (MakeLayouts(key_for(list_rows[l]), &at_rows) == CUBLAS_STATUS_SUCCESS) {
      AppendCandidates(handle_, at_rows.desc, at_rows.a, at_rows.b, at_rows.d, workspace_bytes_,
                       align_x, align_w, align_y, &lists[l]);
    }
  }
  const auto list_of = [&](int64_t rows) {
    return static_cast<size_t>(std::find(list_rows.begin(), list_rows.end(), rows) -
                               list_rows.begin());
  };
  // A base must give fixed bits and run at every m of the range: at both ends
  // and at the timed row counts.
  const auto can_be_base = [&](const cublasLtMatmulAlgo_t& algo) {
    if (!DeterministicReduction(ReadConfig(algo)) || !AlgoFits(algo, at_most)) return false;
    for (const auto& plan : plans) {
      if (!AlgoFits(algo, *plan)) return false;
    }
    return true;
  };

  // The untimed choice: the first valid candidate for plan_rows, then for the
  // other row counts.
  std::vector<size_t> untimed_order = {list_of(std::min(plan_rows_, invariant_rows_))};
  for (size_t l = 0; l < lists.size(); ++l) {
    if (l != untimed_order[0]) untimed_order.push_back(l);
  }
  const cublasLtMatmulAlgo_t* first = nullptr;
  for (size_t l : untimed_order) {
    for (const cublasLtMatmulAlgo_t& algo : lists[l]) {
      if (can_be_base(algo)) {
        first = &algo;
        break;
      }
    }
    if (first != nullptr) break;
  }
  if (first == nullptr) return;  // not row-invariant
  family->found = true;
  family->base = *first;
  family->timed_rows = timed_m;
  if (capturing) {
    family->why = "untimed (first used while the stream captured a graph)";
    return;
  }
  if (!timed_picks_) {
    family->why = "untimed (timing off)";
    return;
  }

  // The pool: the untimed choice, then potential bases taken in turn from
  // the lists (m = 1 first), then as helpers cuBLASLt's first pick for each
  // timed row count.
  struct Member {
    cublasLtMatmulAlgo_t algo;
    AlgoConfig config;
    bool base;  // may be the base
  };
  std::vector<Member> pool;
  const auto in_pool = [&](const cublasLtMatmulAlgo_t& algo) {
    return std::any_of(pool.begin(), pool.end(),
                       [&](const Member& member) { return SameAlgo(member.algo, algo); });
  };
  pool.push_back({*first, ReadConfig(*first), true});
  for (size_t i = 0; i < static_cast<size_t>(kCandidates) && pool.size() < kMaxBases; ++i) {
    for (size_t l = 0; l < lists.size() && pool.size() < kMaxBases; ++l) {
      if (i < lists[l].size() && !in_pool(lists[l][i]) && can_be_base(lists[l][i])) {
        pool.push_back({lists[l][i], ReadConfig(lists[l][i]), true});
      }
    }
  }
  const size_t bases = pool.size();
  std::vector<int> pick(timed_m.size(), -1);  // cuBLASLt's pick, per timed m
  for (size_t t = 0; t < timed_m.size(); ++t) {
    for (const cublasLtMatmulAlgo_t& algo : lists[list_of(timed_m[t])]) {
      if (!AlgoFits(algo, *plans[t])) continue;
      for (size_t i = 0; i < pool.size(); ++i) {
        if (SameAlgo(pool[i].algo, algo)) pick[t] = static_cast<int>(i);
      }
      if (pick[t] < 0) {
        pick[t] = static_cast<int>(pool.size());
        pool.push_back({algo, ReadConfig(algo), false});
      }
      break;
    }
  }

  const size_t elem = y_fp32 ? sizeof(float) : sizeof(bf16);
  const size_t slots = pool.size() * timed_m.size();
  CheckScratch scratch(stream);
  if (!scratch.Allocate(static_cast<size_t>(max_timed * k) * sizeof(bf16),
                        static_cast<size_t>(splits * max_timed * n) * elem, 0, slots,
                        FlushBytes(n, k))) {
    family->why = "untimed (no device memory for the measurement)";
    return;
  }
  const float alpha = 1.0f, beta = 0.0f;
  const auto matmul = [&](const cublasLtMatmulAlgo_t& algo, const Plan& plan) {
    return cublasLtMatmul(handle_, plan.desc, &alpha, p.w, plan.a, scratch.x, plan.b, &beta,
                          scratch.y, plan.d, scratch.y, plan.d, &algo, workspace_, workspace_bytes_,
                          stream);
  };
  // Slot t * pool.size() + i: member i at timed_m[t].
  std::vector<char> usable(slots, 0);
  std::vector<unsigned long long> prints(slots, 0);
  ok = cudaMemsetAsync(scratch.count, 0, slots * sizeof(*scratch.count), stream) == cudaSuccess;
  for (size_t t = 0; t < timed_m.size() && ok; ++t) {
    // The input the timing will run on, too.
    ok = FillCheckRows(scratch.x, timed_m[t], k, std::min(kProbeRows, timed_m[t]), stream) ==
         cudaSuccess;
    for (size_t i = 0; i < pool.size() && ok; ++i) {
      const size_t slot = t * pool.size() + i;
      if (!AlgoFits(pool[i].algo, *plans[t])) continue;
      if (matmul(pool[i].algo, *plans[t]) != CUBLAS_STATUS_SUCCESS) {
        cudaGetLastError();  // see DecideClass
        continue;
      }
      usable[slot] = 1;
      ok = Fingerprint(scratch.y, y_fp32, splits * timed_m[t] * n, scratch.count + slot, stream) ==
           cudaSuccess;
    }
  }
  ok = ok &&
       cudaMemcpyAsync(prints.data(), scratch.count, slots * sizeof(*scratch.count),
                       cudaMemcpyDeviceToHost, stream) == cudaSuccess &&
       cudaStreamSynchronize(stream) == cudaSuccess;
  if (!ok) {
    cudaGetLastError();
    family->why = "untimed (a CUDA call of the measurement failed)";
    return;
  }
  std::vector<size_t> timed_slots;
  for (size_t slot = 0; slot < slots; ++slot) {
    if (usable[slot]) timed_slots.push_back(slot);
  }
  std::vector<float> times;
  if (!TimeLaunches(
          timed_slots.size(),
          [&](size_t j) {
            const size_t slot = timed_slots[j];
            return matmul(pool[slot % pool.size()].algo, *plans[slot / pool.size()]) ==
                   CUBLAS_STATUS_SUCCESS;
          },
          scratch, stream, &times)) {
    family->why = "untimed (timing failed)";
    return;
  }
  std::vector<float> us(slots, -1.0f);
  for (size_t j = 0; j < timed_slots.size(); ++j) us[timed_slots[j]] = times[j];

  // Member c is in b's group at timed_m[t] when both ran there with the same
  // K split and the same output.
  const auto same_at = [&](size_t b, size_t c, size_t t) {
    const size_t sb = t * pool.size() + b, sc = t * pool.size() + c;
    return usable[sb] && usable[sc] && prints[sb] == prints[sc] &&
           SameKSplit(pool[b].config, pool[c].config);
  };
  const auto group_us = [&](size_t b, size_t t) {
    float best = -1.0f;
    for (size_t c = 0; c < pool.size(); ++c) {
      const float u = us[t * pool.size() + c];
      if (same_at(b, c, t) && u >= 0.0f && (best < 0.0f || u < best)) best = u;
    }
    return best;
  };
  // Negative when b did not run at every timed m.
  const auto cost = [&](size_t b) {
    double sum = 0.0;
    for (size_t t = 0; t < timed_m.size(); ++t) {
      const float g = group_us(b, t);
      if (g < 0.0f) return -1.0;
      sum += weights[t] * g;
    }
    return sum;
  };
  std::vector<double> costs(bases);
  for (size_t b = 0; b < bases; ++b) costs[b] = cost(b);
  const int chosen = GemmPickCheapest(costs);
  const double chosen_cost = chosen >= 0 ? costs[static_cast<size_t>(chosen)] : 0.0;
  family->bases_timed = static_cast<int>(bases);
  family->helpers_timed = static_cast<int>(pool.size() - bases);
  family->first_cost_us = static_cast<float>(cost(0));
  if (pick[0] >= 0) family->m1_pick_us = us[pick[0]];
  if (chosen < 0) {
    family->why = "untimed (no candidate ran at every timed m)";
    return;
  }
  const size_t b = static_cast<size_t>(chosen);
  family->base = pool[b].algo;
  family->timed = true;
  family->why = b == 0 ? "timed; the untimed choice had the least cost" : "timed; least cost";
  family->cost_us = static_cast<float>(chosen_cost);
  for (size_t t = 0; t < timed_m.size(); ++t) {
    family->base_us.push_back(us[t * pool.size() + b]);
    family->group_us.push_back(group_us(b, t));
  }
  family->weights.assign(weights.begin(), weights.end());
  // The base's group, for the row classes' self-checks: members equal to it
  // wherever both ran.
  for (size_t c = 0; c < pool.size(); ++c) {
    bool same = c != b, ran = false;
    for (size_t t = 0; t < timed_m.size() && same; ++t) {
      if (!usable[t * pool.size() + c]) continue;
      ran = true;
      same = same_at(b, c, t);
    }
    if (same && ran) family->group.push_back(pool[c].algo);
  }
}

void Gemm::DecideClass(const FamilyKey& fk, Family* family, size_t c, const GemmParams& p,
                       cudaStream_t stream) {
  RowClass& rc = family->classes[c];
  // Plain variables, not a structured binding: the lambdas below capture them.
  const int64_t n = std::get<0>(fk), k = std::get<1>(fk);
  const bool y_fp32 = std::get<2>(fk), has_bias = std::get<3>(fk);
  const int align_x = std::get<4>(fk), align_w = std::get<5>(fk), align_y = std::get<6>(fk),
            splits = std::get<7>(fk);
  const auto decide = [&](bool own, const cublasLtMatmulAlgo_t* algo, const char* why) {
    rc.decided = true;
    rc.own = own;
    if (own) rc.algo = *algo;
    rc.why = why;
    ++(own ? own_classes_ : base_classes_);
    if (!own && rc.base_mismatch) ++self_check_failures_;
  };
  const auto key_for = [&](int64_t m) {
    return Key{m, n, k, y_fp32, has_bias, align_x, align_w, align_y, splits};
  };
  const int64_t lo = c == 0 ? 1 : class_hi_[c - 1] + 1, hi = class_hi_[c];
  const int64_t probe = std::min(kProbeRows, invariant_rows_);
  // Row counts checked: both ends of the class and its middle, so that the
  // first, a middle and the last tile count of the candidate are covered.
  std::vector<int64_t> rows = {lo};
  if ((lo + hi) / 2 > lo) rows.push_back((lo + hi) / 2);
  if (hi > rows.back()) rows.push_back(hi);

  Plan ref_plan;
  std::vector<std::unique_ptr<Plan>> plans;
  bool ok = MakeLayouts(key_for(probe), &ref_plan) == CUBLAS_STATUS_SUCCESS;
  for (int64_t m : rows) {
    plans.push_back(std::make_unique<Plan>());
    ok = ok && MakeLayouts(key_for(m), plans.back().get()) == CUBLAS_STATUS_SUCCESS;
  }
  if (!ok) {
    decide(false, nullptr, "base (cuBLASLt refused the check's layouts)");
    return;
  }
  if (has_bias) {
    cublasLtMatmulDescSetAttribute(ref_plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias,
                                   sizeof(p.bias));
    for (auto& plan : plans) {
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias,
                                     sizeof(p.bias));
    }
  }

  // cuBLASLt's preferences for the class's largest m, then its smallest, of
  // the base's K split; the base's timing group (ChooseBase); then the
  // preferences of another K split, set to the base's.
  const auto is_base = [&](const cublasLtMatmulAlgo_t& algo) {
    return SameAlgo(algo, family->base);
  };
  const AlgoConfig base_config = ReadConfig(family->base);
  std::vector<cublasLtMatmulAlgo_t> preferred, candidates;
  for (const Plan* plan : {plans.back().get(), plans.front().get()}) {
    AppendCandidates(handle_, plan->desc, plan->a, plan->b, plan->d, workspace_bytes_, align_x,
                     align_w, align_y, &preferred);
  }
  const auto add = [&](const cublasLtMatmulAlgo_t& algo) {
    if (!is_base(algo) && std::none_of(candidates.begin(), candidates.end(),
                                       [&](const auto& c) { return SameAlgo(c, algo); })) {
      candidates.push_back(algo);
    }
  };
  for (const cublasLtMatmulAlgo_t& algo : preferred) {
    if (SameKSplit(ReadConfig(algo), base_config)) add(algo);
  }
  for (const cublasLtMatmulAlgo_t& algo : family->group) add(algo);
  for (const cublasLtMatmulAlgo_t& algo : preferred) {
    cublasLtMatmulAlgo_t resplit = {};
    if (!SameKSplit(ReadConfig(algo), base_config) && WithKSplit(algo, base_config, &resplit) &&
        SameKSplit(ReadConfig(resplit), base_config)) {
      add(resplit);
    }
  }

  const size_t elem = y_fp32 ? sizeof(float) : sizeof(bf16);
  CheckScratch scratch(stream);
  if (!scratch.Allocate(static_cast<size_t>(hi * k) * sizeof(bf16),
                        static_cast<size_t>(splits * hi * n) * elem,
                        static_cast<size_t>(splits * probe * n) * elem, 1, FlushBytes(n, k))) {
    decide(false, nullptr, "base (no device memory for the self-check)");
    return;
  }
  const float alpha = 1.0f, beta = 0.0f;
  const auto matmul = [&](const cublasLtMatmulAlgo_t& algo, const Plan& plan, void* y) {
    return cublasLtMatmul(handle_, plan.desc, &alpha, p.w, plan.a, scratch.x, plan.b, &beta, y,
                          plan.d, y, plan.d, &algo, workspace_, workspace_bytes_, stream);
  };
  // Re-tiled candidates. For a few rows cuBLASLt's lists lean on wide tiles:
  // at the 8B's gate_up and 65 rows its picks run 256 weight rows a CTA (112
  // CTAs, 62-63 us), while the same kernels re-tiled to 128 rows, with the
  // class's token extent and another cluster shape, run in 59 us with the same
  // bits (bench/history/20-gpu-run-14.md). So in classes of up to
  // kRetileMaxRows rows every candidate is also tried at every tile width and
  // at the kRetileClusters shapes, and then every candidate is timed once at
  // the class's largest m and the list put in that order, so that the
  // self-check and the final timing below see the fastest first.
  if (retile_ && timed_picks_ && hi <= kRetileMaxRows) {
    const size_t sources = candidates.size();
    const int extent = static_cast<int>((hi + 7) / 8) - 1;
    for (size_t i = 0; i < sources; ++i) {
      for (const cublasLtMatmulTile_t tile : {kRetileTiles[0][extent], kRetileTiles[1][extent],
                                              kRetileTiles[2][extent], kRetileTiles[3][extent]}) {
        for (int c = -1; c < static_cast<int>(sizeof(kRetileClusters) / sizeof(kRetileClusters[0]));
             ++c) {
          cublasLtMatmulAlgo_t variant = candidates[i];
          const uint32_t t = tile;
          cublasLtMatmulAlgoConfigSetAttribute(&variant, CUBLASLT_ALGO_CONFIG_TILE_ID, &t,
                                               sizeof(t));
          if (c >= 0) {
            cublasLtMatmulAlgoConfigSetAttribute(&variant, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID,
                                                 &kRetileClusters[c], sizeof(kRetileClusters[c]));
          }
          bool fits = SameKSplit(ReadConfig(variant), base_config);
          for (const auto& plan : plans) fits = fits && AlgoFits(variant, *plan);
          if (fits) add(variant);
        }
      }
    }
    std::vector<float> quick;
    if (!candidates.empty() && TimeLaunches(
                                   candidates.size(),
                                   [&](size_t i) {
                                     return matmul(candidates[i], *plans.back(), scratch.y) ==
                                            CUBLAS_STATUS_SUCCESS;
                                   },
                                   scratch, stream, &quick)) {
      std::vector<size_t> order(candidates.size());
      std::iota(order.begin(), order.end(), size_t{0});
      std::stable_sort(order.begin(), order.end(),
                       [&](size_t a, size_t b) { return quick[a] < quick[b]; });
      std::vector<cublasLtMatmulAlgo_t> sorted;
      for (size_t i : order) sorted.push_back(candidates[i]);
      candidates.swap(sorted);
    }
    rc.retiled = true;
  }
  // The reference: the base algorithm on the probe rows alone.
  if (FillCheckRows(scratch.x, probe, k, probe, stream) != cudaSuccess ||
      matmul(family->base, ref_plan, scratch.ref) != CUBLAS_STATUS_SUCCESS) {
    cudaGetLastError();
    decide(false, nullptr, "base (the reference GEMM failed)");
    return;
  }
  enum class Check { kSame, kDiffers, kUnusable, kBroken };
  const auto check = [&](const cublasLtMatmulAlgo_t& algo) {
    for (const auto& plan : plans) {
      if (!AlgoFits(algo, *plan)) return Check::kUnusable;
    }
    if (cudaMemsetAsync(scratch.count, 0, sizeof(*scratch.count), stream) != cudaSuccess)
      return Check::kBroken;
    for (size_t i = 0; i < rows.size(); ++i) {
      if (FillCheckRows(scratch.x, rows[i], k, probe, stream) != cudaSuccess) return Check::kBroken;
      if (matmul(algo, *plans[i], scratch.y) != CUBLAS_STATUS_SUCCESS) {
        // A launch cuBLASLt reports as failed (say, too many resources) leaves
        // its CUDA error behind; the caller's next error check must not see it.
        cudaGetLastError();
        return Check::kUnusable;
      }
      // Each K range's slab against the same slab of the reference.
      for (int s = 0; s < splits; ++s) {
        if (CountMismatches(
                static_cast<char*>(scratch.y) + static_cast<size_t>(s * rows[i] * n) * elem,
                static_cast<char*>(scratch.ref) + static_cast<size_t>(s * probe * n) * elem, y_fp32,
                rows[i], n, probe, scratch.count, stream) != cudaSuccess)
          return Check::kBroken;
      }
    }
    unsigned long long mismatches = 0;
    if (cudaMemcpyAsync(&mismatches, scratch.count, sizeof(mismatches), cudaMemcpyDeviceToHost,
                        stream) != cudaSuccess ||
        cudaStreamSynchronize(stream) != cudaSuccess)
      return Check::kBroken;
    return mismatches == 0 ? Check::kSame : Check::kDiffers;
  };

  // The first few identical candidates, in the order above, then the base.
  std::vector<cublasLtMatmulAlgo_t> passed;
  for (const cublasLtMatmulAlgo_t& candidate : candidates) {
    if (passed.size() == kMaxTimed || rc.checked == kMaxChecked) break;
    const Check r = check(candidate);
    if (r == Check::kBroken) {
      decide(false, nullptr, "base (a CUDA call of the self-check failed)");
      return;
    }
    if (r == Check::kUnusable) continue;
    ++rc.checked;
    if (r == Check::kDiffers) {
      ++rc.mismatched;
      continue;
    }
    passed.push_back(candidate);
  }
  // The base through the same check: it competes in the timing, and if it
  // differs at these m its own invariance is broken here.
  const Check base_check = check(family->base);
  if (base_check == Check::kBroken) {
    decide(false, nullptr, "base (a CUDA call of the self-check failed)");
    return;
  }
  rc.base_mismatch = base_check == Check::kDiffers;
  if (base_check == Check::kSame) passed.push_back(family->base);
  rc.passed = static_cast<int>(passed.size());
  if (passed.empty()) {
    decide(false, nullptr,
           base_check == Check::kDiffers
               ? "base (no candidate passed; the base itself differs here)"
               : "base (no candidate passed)");
    return;
  }

  if (!timed_picks_) {
    decide(!is_base(passed.front()), &passed.front(), "first candidate that passed (timing off)");
    return;
  }
  // Time them at the class's smallest and largest m (input rows as the last
  // check left them).
  std::vector<size_t> timed_rows = {0};
  if (plans.size() > 1) timed_rows.push_back(plans.size() - 1);
  std::vector<float> times;
  const bool timed = TimeLaunches(
      passed.size() * timed_rows.size(),
      [&](size_t slot) {
        return matmul(passed[slot / timed_rows.size()],
                      *plans[timed_rows[slot % timed_rows.size()]],
                      scratch.y) == CUBLAS_STATUS_SUCCESS;
      },
      scratch, stream, &times);
  if (!timed) {
    decide(!is_base(passed.front()), &passed.front(),
           "first candidate that passed (timing failed)");
    return;
  }
  std::vector<std::vector<float>> best_us(passed.size(),
                                          std::vector<float>(timed_rows.size(), -1.0f));
  for (size_t slot = 0; slot < times.size(); ++slot)
    best_us[slot / timed_rows.size()][slot % timed_rows.size()] = times[slot];
  const auto total = [&](size_t a) {
    double sum = 0.0;
    for (float us : best_us[a]) sum += us;
    return sum;
  };
  size_t chosen = 0;
  for (size_t a = 1; a < passed.size(); ++a) {
    if (total(a) < kGemmDisplace * total(chosen)) chosen = a;
  }
  const bool own = !is_base(passed[chosen]);
  for (size_t t = 0; t < timed_rows.size(); ++t) {
    rc.us[t == 0 ? 0 : 1] = best_us[chosen][t];
    if (!rc.base_mismatch && base_check == Check::kSame)
      rc.base_us[t == 0 ? 0 : 1] = best_us[passed.size() - 1][t];
  }
  if (timed_rows.size() == 1) {
    rc.us[1] = rc.us[0];
    rc.base_us[1] = rc.base_us[0];
  }
  decide(own, &passed[chosen],
         own ? "own (fastest identical candidate)" : "base (fastest identical candidate)");
}

}  // namespace cuda
}  // namespace specd
