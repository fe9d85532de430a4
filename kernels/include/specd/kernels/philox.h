// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), a
// counter-based generator usable identically on the host and in CUDA kernels. specd keys it
// with the request seed and counts with (position, token index), so sampling is a pure function
// of (seed, position, logits): the property that makes seeded speculative sampling reproduce
// target-only sampling token for token.
#ifndef SPECD_KERNELS_PHILOX_H_
#define SPECD_KERNELS_PHILOX_H_

#include <stdint.h>

#if defined(__CUDACC__)
#define SPECD_HD __host__ __device__ __forceinline__
#else
#define SPECD_HD inline
#endif

namespace specd {

struct Philox4 {
  uint32_t v[4];
};

SPECD_HD void PhiloxMulHiLo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// Returns four 32-bit words for counter (c0..c3) under key (k0, k1).
SPECD_HD Philox4 Philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                               uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    PhiloxMulHiLo(0xD2511F53u, c0, &hi0, &lo0);
    PhiloxMulHiLo(0xCD9E8D57u, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  Philox4 out = {{c0, c1, c2, c3}};
  return out;
}

// A uniform double in the open interval (0, 1) for (seed, position, index): 53 random bits
// from the first two words, offset by half a step so neither end is reached.
SPECD_HD double PhiloxUniform01(uint64_t seed, uint64_t position, uint32_t index) {
  const Philox4 r = Philox4x32_10(static_cast<uint32_t>(position),
                                  static_cast<uint32_t>(position >> 32), index, 0x5eedu,
                                  static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint64_t bits = (static_cast<uint64_t>(r.v[0]) << 21) ^ (r.v[1] >> 11);
  const uint64_t m = bits & ((uint64_t{1} << 53) - 1);
  return (static_cast<double>(m) + 0.5) * (1.0 / 9007199254740992.0);
}

}  // namespace specd

#endif  // SPECD_KERNELS_PHILOX_H_
