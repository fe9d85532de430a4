#include "engine/topk.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace specd {

namespace {

inline float OrderKey(float v) {
  return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v;
}

constexpr int kLanes = 16;
constexpr float kExpFloor = -87.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
constexpr int32_t kRoundBits = 0x4B400000;
constexpr float kLn2Hi = 0.693359375f;  // ln 2 in two parts
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// exp(t) for t <= 0 in fp32 (Cephes' expf polynomial, within 2 ulp of the true value): no libm
// call. t below -87 is taken as -87 (2^-126 scale: ~1.6e-38, nothing beside the row's maximum,
// whose term is 1). The vector paths below do the same operations in the same order, one IEEE
// rounding each (topk.cc is built with -ffp-contract=off), so every ISA gives the same bits.
inline float ExpNonPositive(float t) {
  t = t < kExpFloor ? kExpFloor : t;
  const float shifted = t * kLog2e + kRound;
  const float n = shifted - kRound;
  int32_t shifted_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof(shifted_bits));
  const float r = (t - n * kLn2Hi) - n * kLn2Lo;
  float p = kP[0];
  for (int c = 1; c < 6; ++c) p = p * r + kP[c];
  p = p * (r * r) + r + 1.0f;
  const int32_t scale_bits = (shifted_bits - kRoundBits + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof(scale));
  return p * scale;
}

// The sums of exp(OrderKey(x) - max_l) over the row's first `n` tokens (a multiple of kLanes)
// into acc ([kLanes] fp64, host): token i into lane i % kLanes, each term in fp32, each lane's
// sum in fp64, so only the terms' own ~1e-7 errors reach log Z.
void SumExpScalar(const float* row, int64_t n, float max_l, double* acc) {
  for (int64_t i = 0; i < n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      acc[l] += static_cast<double>(ExpNonPositive(OrderKey(row[i + l]) - max_l));
    }
  }
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) void SumExpAvx512(const float* row, int64_t n, float max_l,
                                                     double* acc) {
  const __m512 max_v = _mm512_set1_ps(max_l), floor_v = _mm512_set1_ps(kExpFloor);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 log2e = _mm512_set1_ps(kLog2e), round = _mm512_set1_ps(kRound);
  const __m512 ln2_hi = _mm512_set1_ps(kLn2Hi), ln2_lo = _mm512_set1_ps(kLn2Lo);
  const __m512i bias = _mm512_set1_epi32(127 - kRoundBits);
  __m512d lo = _mm512_loadu_pd(acc), hi = _mm512_loadu_pd(acc + 8);
  for (int64_t i = 0; i < n; i += kLanes) {
    __m512 x = _mm512_loadu_ps(row + i);
    x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), neg_inf);
    const __m512 t = _mm512_max_ps(_mm512_sub_ps(x, max_v), floor_v);
    const __m512 shifted = _mm512_add_ps(_mm512_mul_ps(t, log2e), round);
    const __m512 nf = _mm512_sub_ps(shifted, round);
    const __m512 r =
        _mm512_sub_ps(_mm512_sub_ps(t, _mm512_mul_ps(nf, ln2_hi)), _mm512_mul_ps(nf, ln2_lo));
    __m512 p = _mm512_set1_ps(kP[0]);
    for (int c = 1; c < 6; ++c) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kP[c]));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r),
                      _mm512_set1_ps(1.0f));
    const __m512 scale = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_castps_si512(shifted), bias), 23));
    const __m512 e = _mm512_mul_ps(p, scale);
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    hi = _mm512_add_pd(
        hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
  }
  _mm512_storeu_pd(acc, lo);
  _mm512_storeu_pd(acc + 8, hi);
}
#endif  // __x86_64__

// Puts token i (order key v) into the sorted candidate list ([k] ids and keys, host), which
// holds `filled` entries: appended while it is not full, else in place of the last.
inline void Insert(int i, float v, int k, int* filled, int32_t* ids, float* keys) {
  int j = *filled < k ? (*filled)++ : k - 1;
  while (j > 0 && v > keys[j - 1]) {
    keys[j] = keys[j - 1];
    ids[j] = ids[j - 1];
    --j;
  }
  keys[j] = v;
  ids[j] = i;
}

#if defined(__x86_64__)
// The selection over row[begin, end) with a full list (k entries): 16 keys at a time against
// the list's last, and only those above it inserted, in id order, each checked again against
// the list as it is then, so the result is the scalar loop's. Returns where it stopped (the
// tail of fewer than 16 is the caller's); *max_l takes the keys' maximum.
__attribute__((target("avx512f"))) int SelectAvx512(const float* row, int begin, int end, int k,
                                                    int32_t* ids, float* keys, float* max_l) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 max_v = _mm512_set1_ps(*max_l);
  __m512 last = _mm512_set1_ps(keys[k - 1]);
  int filled = k;
  int i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    __m512 x = _mm512_loadu_ps(row + i);
    x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), neg_inf);
    max_v = _mm512_max_ps(max_v, x);
    __mmask16 above = _mm512_cmp_ps_mask(x, last, _CMP_GT_OQ);
    if (above == 0) continue;
    while (above != 0) {
      const int l = __builtin_ctz(above);
      above &= above - 1;
      const float v = OrderKey(row[i + l]);
      if (v > keys[k - 1]) Insert(i + l, v, k, &filled, ids, keys);
    }
    last = _mm512_set1_ps(keys[k - 1]);
  }
  *max_l = _mm512_reduce_max_ps(max_v);
  return i;
}
#endif  // __x86_64__

// Sum over the row of exp(OrderKey(x) - max_l), max_l finite: the lanes in order, then the tail.
double SumExp(absl::Span<const float> row, float max_l) {
  const int64_t vocab = static_cast<int64_t>(row.size());
  const int64_t body = vocab - vocab % kLanes;
  double acc[kLanes] = {};
#if defined(__x86_64__)
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512) {
    SumExpAvx512(row.data(), body, max_l, acc);
  } else {
    SumExpScalar(row.data(), body, max_l, acc);
  }
#else
  SumExpScalar(row.data(), body, max_l, acc);
#endif
  double sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  for (int64_t i = body; i < vocab; ++i) {
    sum += static_cast<double>(ExpNonPositive(OrderKey(row[i]) - max_l));
  }
  return sum;
}

}  // namespace

void RowTopKLogprobs(absl::Span<const float> row, int k, int32_t* ids, float* logprobs) {
  const int vocab = static_cast<int>(row.size());
  k = std::max(0, std::min(k, vocab));
  if (k == 0) return;
  // `ids`/`logprobs` double as the sorted candidate list (logprobs holding order keys until the
  // end). Ids are visited in increasing order, so a later id never displaces an equal key.
  int filled = 0;
  float max_l = -std::numeric_limits<float>::infinity();
  int i = 0;
  for (; i < vocab && filled < k; ++i) {
    const float v = OrderKey(row[i]);
    max_l = std::max(max_l, v);
    Insert(i, v, k, &filled, ids, logprobs);
  }
#if defined(__x86_64__)
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512) i = SelectAvx512(row.data(), i, vocab, k, ids, logprobs, &max_l);
#endif
  for (; i < vocab; ++i) {
    const float v = OrderKey(row[i]);
    max_l = std::max(max_l, v);
    if (v > logprobs[k - 1]) Insert(i, v, k, &filled, ids, logprobs);
  }
  double sum = 0;
  if (std::isfinite(max_l)) {
    // The draft service runs this on every level of every tree (8192-152064 tokens): exp in
    // double was ~12% of a CPU draft step. fp32 terms move log Z by ~1e-7, below what a
    // logprob's fp32 rounding already loses, and the order of the ids is the exact selection
    // above either way.
    sum = SumExp(row, max_l);
  } else {
    // A row of -inf/NaN (or +inf) keeps the fp64 arithmetic's NaN and -inf results.
    for (int i = 0; i < vocab; ++i) {
      sum += std::exp(static_cast<double>(OrderKey(row[i])) - max_l);
    }
  }
  const double log_z = max_l + std::log(sum);
  for (int j = 0; j < k; ++j) logprobs[j] = static_cast<float>(logprobs[j] - log_z);
}

}  // namespace specd
