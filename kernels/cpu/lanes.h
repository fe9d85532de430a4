// The fixed horizontal reductions the CPU kernels share (linear.cc, tree_attention.cc): every
// accumulator of a given ISA is reduced by one tree, so results do not depend on which kernel
// variant or tile produced the accumulator. 8 lanes: s4[i] = v[i] + v[i + 4];
// s2[i] = s4[i] + s4[i + 2]; s2[0] + s2[1]. 16 lanes first fold to 8 with v[i] + v[i + 8].
#ifndef SPECD_KERNELS_CPU_LANES_H_
#define SPECD_KERNELS_CPU_LANES_H_

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPECD_KERNELS_X86 1
#endif

namespace specd {
namespace lanes {

// v: [8] fp32, host.
inline float Reduce8Scalar(const float* v) {
  const float s0 = v[0] + v[4], s1 = v[1] + v[5], s2 = v[2] + v[6], s3 = v[3] + v[7];
  const float t0 = s0 + s2, t1 = s1 + s3;
  return t0 + t1;
}

#ifdef SPECD_KERNELS_X86
__attribute__((target("avx2,fma"))) inline float Reduce8Avx2(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

__attribute__((target("avx512f"))) inline float Reduce16Avx512(__m512 v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 e = _mm256_add_ps(lo, hi);
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(e), _mm256_extractf128_ps(e, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#endif  // SPECD_KERNELS_X86

}  // namespace lanes
}  // namespace specd

#endif  // SPECD_KERNELS_CPU_LANES_H_
