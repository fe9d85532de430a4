#include "specd/kernels/linear.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/lanes.h"

namespace specd {
namespace {

// Rows of x per chunk are chosen so that the chunk (chunk rows x k fp32) stays in L2 while the
// column tiles of W sweep over it; W is then read once per chunk.
constexpr int64_t kChunkBytes = 256 * 1024;

// A column tile's NR weight rows are only k floats each (a few dozen cache lines), too short
// for the hardware prefetchers to train on before the tile is done, and at a few rows the
// FMAs then wait on memory. The first row tile of a chunk therefore prefetches the weights of
// the column tile this many tiles ahead, a cache line a row per k step.
constexpr int64_t kPrefetchTiles = 4;

// One tile: outputs y[r, c] for r < MR, c < NR. x: [MR, k] fp32 at row stride k; w: [NR, k] of W
// (fp32, or bf16 bit patterns widened exactly on load) at row stride k; bias: [NR] fp32 or null;
// y: [MR, ldy] fp32 (the first NR columns written). All host memory.
template <typename W>
struct TileArgs {
  const float* x;
  const W* w;
  int64_t k;
  const float* bias;
  float* y;
  int64_t ldy;
  // [NR, k] of W at row stride k, host, or null: weight rows a later tile reads, touched with
  // prefetches as this tile's k loop runs (see kPrefetchTiles). Never changes the arithmetic.
  const W* prefetch = nullptr;
};

// Whether the k loop's step at element i starts a new cache line of a weight row.
template <typename W>
inline bool LineStart(int64_t i) {
  return ((i * static_cast<int64_t>(sizeof(W))) & 63) == 0;
}

// A weight as fp32: bf16 is the high half of an fp32, so widening is exact.
inline float WeightValue(float w) { return w; }
inline float WeightValue(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The portable path: the AVX2 arithmetic lane by lane (std::fma rounds once, as vfmadd does).
template <int MR, int NR>
struct ScalarTile {
  template <typename W>
  static void Run(const TileArgs<W>& a) {
    float acc[MR][NR][8] = {};
    const int64_t k = a.k;
    for (int64_t i = 0; i < k; i += 8) {
      for (int r = 0; r < MR; ++r) {
        for (int c = 0; c < NR; ++c) {
          for (int l = 0; l < 8; ++l) {
            // Lanes past k are the zeros a masked load gives: fma(0, 0, acc).
            const bool in = i + l < k;
            const float xv = in ? a.x[r * k + i + l] : 0.0f;
            const float wv = in ? WeightValue(a.w[c * k + i + l]) : 0.0f;
            acc[r][c][l] = std::fma(xv, wv, acc[r][c][l]);
          }
        }
      }
    }
    for (int r = 0; r < MR; ++r) {
      for (int c = 0; c < NR; ++c) {
        float s = lanes::Reduce8Scalar(acc[r][c]);
        if (a.bias != nullptr) s += a.bias[c];
        a.y[r * a.ldy + c] = s;
      }
    }
  }
};

#ifdef SPECD_KERNELS_X86
// 8 weights from p (n of them in the tail, the other lanes 0) as fp32.
__attribute__((target("avx2,fma"))) inline __m256 Load8(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma"))) inline __m256 Load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx2,fma"))) inline __m256 Load8Tail(const float* p, int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane);
  return _mm256_maskload_ps(p, mask);
}
__attribute__((target("avx2,fma"))) inline __m256 Load8Tail(const uint16_t* p, int64_t n) {
  uint16_t tail[8] = {};
  std::memcpy(tail, p, static_cast<size_t>(n) * sizeof(uint16_t));
  return Load8(tail);
}

// 16 weights from p (n of them in the tail, the other lanes 0) as fp32.
__attribute__((target("avx512f"))) inline __m512 Load16(const float* p) {
  return _mm512_loadu_ps(p);
}
__attribute__((target("avx512f"))) inline __m512 Load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx512f"))) inline __m512 Load16Tail(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
}
__attribute__((target("avx512f"))) inline __m512 Load16Tail(const uint16_t* p, int64_t n) {
  uint16_t tail[16] = {};
  std::memcpy(tail, p, static_cast<size_t>(n) * sizeof(uint16_t));
  return Load16(tail);
}

template <int MR, int NR>
struct Avx2Tile {
  template <typename W>
  __attribute__((target("avx2,fma"))) static void Run(const TileArgs<W>& a) {
    __m256 acc[MR][NR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps();
    }
    const int64_t k = a.k, kv = k & ~int64_t{7};
    for (int64_t i = 0; i < kv; i += 8) {
      __m256 wv[NR];
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) wv[c] = Load8(a.w + c * k + i);
      if (a.prefetch != nullptr && LineStart<W>(i)) {
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) {
          _mm_prefetch(reinterpret_cast<const char*>(a.prefetch + c * k + i), _MM_HINT_T0);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m256 xv = _mm256_loadu_ps(a.x + r * k + i);
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    }
    if (kv < k) {
      __m256 wv[NR];
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) wv[c] = Load8Tail(a.w + c * k + kv, k - kv);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m256 xv = Load8Tail(a.x + r * k + kv, k - kv);
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) {
        float s = lanes::Reduce8Avx2(acc[r][c]);
        if (a.bias != nullptr) s += a.bias[c];
        a.y[r * a.ldy + c] = s;
      }
    }
  }
};

template <int MR, int NR>
struct Avx512Tile {
  template <typename W>
  __attribute__((target("avx512f"))) static void Run(const TileArgs<W>& a) {
    __m512 acc[MR][NR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
    }
    const int64_t k = a.k, kv = k & ~int64_t{15};
    for (int64_t i = 0; i < kv; i += 16) {
      __m512 wv[NR];
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) wv[c] = Load16(a.w + c * k + i);
      if (a.prefetch != nullptr && LineStart<W>(i)) {
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) {
          _mm_prefetch(reinterpret_cast<const char*>(a.prefetch + c * k + i), _MM_HINT_T0);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 xv = _mm512_loadu_ps(a.x + r * k + i);
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    }
    if (kv < k) {
      __m512 wv[NR];
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) wv[c] = Load16Tail(a.w + c * k + kv, k - kv);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 xv = Load16Tail(a.x + r * k + kv, k - kv);
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) {
        float s = lanes::Reduce16Avx512(acc[r][c]);
        if (a.bias != nullptr) s += a.bias[c];
        a.y[r * a.ldy + c] = s;
      }
    }
  }
};

#endif  // SPECD_KERNELS_X86

// Runs Tile<mr, nr> for 1 <= mr <= MR, 1 <= nr <= NR: the remainder tiles of a sweep.
template <template <int, int> class Tile, int MR, int NR, typename W>
void RunTile(int mr, int nr, const TileArgs<W>& a) {
  if constexpr (MR > 1) {
    if (mr < MR) return RunTile<Tile, MR - 1, NR>(mr, nr, a);
  }
  if constexpr (NR > 1) {
    if (nr < NR) return RunTile<Tile, MR, NR - 1>(mr, nr, a);
  }
  Tile<MR, NR>::Run(a);
}

// Column tiles of NR weight rows (in L1) sweep the row tiles of MR rows of each chunk.
template <template <int, int> class Tile, int MR, int NR, typename W>
void Sweep(const LinearParams& p, const W* weights, int64_t col_begin, int64_t col_end) {
  const int64_t k = p.in_features, n = p.out_features;
  const int64_t chunk = std::max<int64_t>(
      MR, kChunkBytes / (std::max<int64_t>(k, 1) * static_cast<int64_t>(sizeof(float))) / MR * MR);
  for (int64_t r0 = 0; r0 < p.rows; r0 += chunk) {
    const int64_t r1 = std::min(p.rows, r0 + chunk);
    for (int64_t j = col_begin; j < col_end; j += NR) {
      const int nr = static_cast<int>(std::min<int64_t>(NR, col_end - j));
      TileArgs<W> a;
      a.w = weights + j * k;
      a.k = k;
      a.bias = p.bias != nullptr ? p.bias + j : nullptr;
      a.ldy = n;
      // The first row tile of the chunk fetches the weights from memory; it asks for a tile
      // kPrefetchTiles ahead (the last full tile of the range near its end).
      const int64_t ahead = std::min(j + kPrefetchTiles * NR, col_end - NR);
      a.prefetch = ahead > j ? weights + ahead * k : nullptr;
      for (int64_t r = r0; r < r1; r += MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MR, r1 - r));
        a.x = p.x + r * k;
        a.y = p.y + r * n + j;
        RunTile<Tile, MR, NR>(mr, nr, a);
        a.prefetch = nullptr;
      }
    }
  }
}

LinearIsa ChooseIsa() {
  if (LinearIsaSupported(LinearIsa::kAvx512)) return LinearIsa::kAvx512;
  if (LinearIsaSupported(LinearIsa::kAvx2)) return LinearIsa::kAvx2;
  return LinearIsa::kScalar;
}

}  // namespace

bool LinearIsaSupported(LinearIsa isa) {
  switch (isa) {
    case LinearIsa::kScalar: return true;
#ifdef SPECD_KERNELS_X86
    case LinearIsa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case LinearIsa::kAvx512: return __builtin_cpu_supports("avx512f");
#else
    case LinearIsa::kAvx2:
    case LinearIsa::kAvx512: return false;
#endif
  }
  return false;
}

const char* LinearIsaName(LinearIsa isa) {
  switch (isa) {
    case LinearIsa::kScalar: return "scalar";
    case LinearIsa::kAvx2: return "avx2";
    case LinearIsa::kAvx512: return "avx512";
  }
  return "?";
}

LinearIsa LinearCpuIsa() {
  static const LinearIsa isa = ChooseIsa();
  return isa;
}

template <typename W>
void SweepIsa(const LinearParams& p, const W* weights, int64_t col_begin, int64_t col_end,
              LinearIsa isa) {
  switch (isa) {
#ifdef SPECD_KERNELS_X86
    case LinearIsa::kAvx512:
      // 24 accumulators + 4 weight vectors + 1 row vector of the 32 zmm registers. Six rows,
      // so that a depth-4 chain's 5 rows run as one tile rather than 4 + a latency-bound 1.
      return Sweep<Avx512Tile, 6, 4>(p, weights, col_begin, col_end);
    case LinearIsa::kAvx2:
      // 12 accumulators + 3 weight vectors + 1 row vector: the 16 ymm registers.
      return Sweep<Avx2Tile, 4, 3>(p, weights, col_begin, col_end);
#endif
    default: return Sweep<ScalarTile, 1, 1>(p, weights, col_begin, col_end);
  }
}

void LinearCpuColumnsIsa(const LinearParams& p, int64_t col_begin, int64_t col_end, LinearIsa isa) {
  if (p.rows <= 0 || col_begin >= col_end) return;
  if (p.w_bf16 != nullptr) return SweepIsa(p, p.w_bf16, col_begin, col_end, isa);
  SweepIsa(p, p.w, col_begin, col_end, isa);
}

void LinearCpuColumns(const LinearParams& p, int64_t col_begin, int64_t col_end) {
  LinearCpuColumnsIsa(p, col_begin, col_end, LinearCpuIsa());
}

void LinearCpu(const LinearParams& p) { LinearCpuColumns(p, 0, p.out_features); }

void LinearNaiveCpu(const LinearParams& p) {
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* x = p.x + r * p.in_features;
    for (int64_t j = 0; j < p.out_features; ++j) {
      double acc = 0.0;
      for (int64_t i = 0; i < p.in_features; ++i) {
        const int64_t at = j * p.in_features + i;
        const float w = p.w_bf16 != nullptr ? WeightValue(p.w_bf16[at]) : p.w[at];
        acc += static_cast<double>(x[i]) * w;
      }
      float y = static_cast<float>(acc);
      if (p.bias != nullptr) y += p.bias[j];
      p.y[r * p.out_features + j] = y;
    }
  }
}

}  // namespace specd
