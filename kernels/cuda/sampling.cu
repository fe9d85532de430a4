#include "specd/kernels/cuda/sampling.h"

#include "kernels/cuda/device_utils.cuh"
#include "specd/kernels/philox.h"

namespace specd {
namespace cuda {
namespace {

using internal::kFullMask;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBuckets = 16;  // 4-bit radix digits
// Gumbel noise -log(-log u) for u in [2^-54, 1 - 2^-54] lies in [-log(54 ln 2), 54 ln 2] =
// [-3.622, 37.43]; a token whose scaled logit is more than their difference below the best
// one's can never win. The window adds a margin for fp32 rounding of the screen.
constexpr double kGumbelWindow = 41.5;

struct Smem {
  uint64_t u64[kWarps];
  double f64[kWarps];
  int32_t i32[kWarps];
  uint32_t cnt[kWarps][kBuckets];
  double mass[kWarps][kBuckets];
  uint32_t cnt_total[kBuckets];
  double mass_total[kBuckets];
};

// Monotone map of floats to uint32 (NaN lowest; -0 as +0, as the host's comparisons see them).
__device__ __forceinline__ uint32_t OrderedBits(float x) {
  if (x != x) return 0u;
  if (x == 0.0f) x = 0.0f;
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The host's sort order (logit descending, id ascending) as one descending 64-bit key.
__device__ __forceinline__ uint64_t SortKey(float logit, int id) {
  return (static_cast<uint64_t>(OrderedBits(logit)) << 32) |
         (0xffffffffu - static_cast<uint32_t>(id));
}

__device__ __forceinline__ int KeyId(uint64_t key) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(key));
}

__device__ uint64_t BlockMaxU64(uint64_t v, Smem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t other = __shfl_xor_sync(kFullMask, v, o);
    v = other > v ? other : v;
  }
  __syncthreads();
  if (lane == 0) s.u64[warp] = v;
  __syncthreads();
  v = lane < kWarps ? s.u64[lane] : 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t other = __shfl_xor_sync(kFullMask, v, o);
    v = other > v ? other : v;
  }
  return v;
}

__device__ double BlockSumF64(double v, Smem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  __syncthreads();
  if (lane == 0) s.f64[warp] = v;
  __syncthreads();
  v = lane < kWarps ? s.f64[lane] : 0.0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ float BlockMaxF32(float v, Smem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = internal::WarpMax(v);
  __syncthreads();
  if (lane == 0) s.f64[warp] = v;
  __syncthreads();
  return internal::WarpMax(lane < kWarps ? static_cast<float>(s.f64[lane]) : -INFINITY);
}

// Argmax of (score, id): highest score, lowest id on ties. Returns the id.
__device__ int BlockArgmax(double score, int id, Smem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  auto better = [](double a, int ia, double b, int ib) {
    return ia >= 0 && (ib < 0 || a > b || (a == b && ia < ib));
  };
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const double so = __shfl_xor_sync(kFullMask, score, o);
    const int io = __shfl_xor_sync(kFullMask, id, o);
    if (better(so, io, score, id)) {
      score = so;
      id = io;
    }
  }
  __syncthreads();
  if (lane == 0) {
    s.f64[warp] = score;
    s.i32[warp] = id;
  }
  __syncthreads();
  score = lane < kWarps ? s.f64[lane] : -INFINITY;
  id = lane < kWarps ? s.i32[lane] : -1;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const double so = __shfl_xor_sync(kFullMask, score, o);
    const int io = __shfl_xor_sync(kFullMask, id, o);
    if (better(so, io, score, id)) {
      score = so;
      id = io;
    }
  }
  return id;
}

// Sums per-thread digit histograms over the block; every thread gets the totals.
template <bool kMass>
__device__ void BlockHistogram(uint32_t (&cnt)[kBuckets], double (&mass)[kBuckets], Smem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int b = 0; b < kBuckets; ++b) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      cnt[b] += __shfl_xor_sync(kFullMask, cnt[b], o);
      if constexpr (kMass) mass[b] += __shfl_xor_sync(kFullMask, mass[b], o);
    }
  }
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int b = 0; b < kBuckets; ++b) {
      s.cnt[warp][b] = cnt[b];
      if constexpr (kMass) s.mass[warp][b] = mass[b];
    }
  }
  __syncthreads();
  if (threadIdx.x < kBuckets) {
    uint32_t c = 0;
    double m = 0.0;
    for (int w = 0; w < kWarps; ++w) {
      c += s.cnt[w][threadIdx.x];
      if constexpr (kMass) m += s.mass[w][threadIdx.x];
    }
    s.cnt_total[threadIdx.x] = c;
    s.mass_total[threadIdx.x] = m;
  }
  __syncthreads();
#pragma unroll
  for (int b = 0; b < kBuckets; ++b) {
    cnt[b] = s.cnt_total[b];
    mass[b] = kMass ? s.mass_total[b] : 0.0;
  }
}

// Walks the candidates (keys >= lower) in the host's sorted order, 4 key bits at a time, and
// returns the key of the element where the walk stops:
//   count mode: the rank-th element (1-based), i.e. the last one top-k keeps;
//   mass mode: the first element at which the cumulative probability reaches top_p, i.e. the
//   last one top-p keeps (probability = exp((logit - max_logit) * inv_t) / total).
// Mass mode returns `lower` (keep every candidate) if rounding leaves the total short of top_p.
template <bool kMass>
__device__ uint64_t Descend(const float* logits, int vocab, uint64_t lower, uint32_t rank,
                            double top_p, double max_logit, double inv_t, double total, Smem& s) {
  uint64_t prefix = 0, fixed = 0;
  uint32_t need = rank;
  double above = 0.0;
  for (int shift = 60; shift >= 0; shift -= 4) {
    uint32_t cnt[kBuckets];
    double mass[kBuckets];
#pragma unroll
    for (int b = 0; b < kBuckets; ++b) {
      cnt[b] = 0;
      mass[b] = 0.0;
    }
    for (int id = threadIdx.x; id < vocab; id += kThreads) {
      const float x = logits[id];
      const uint64_t key = SortKey(x, id);
      if (key < lower || (key & fixed) != prefix) continue;
      const uint32_t d = static_cast<uint32_t>(key >> shift) & (kBuckets - 1);
      double w = 0.0;
      if constexpr (kMass) w = exp((static_cast<double>(x) - max_logit) * inv_t) / total;
#pragma unroll
      for (int b = 0; b < kBuckets; ++b) {
        const bool hit = d == static_cast<uint32_t>(b);
        cnt[b] += hit ? 1u : 0u;
        if constexpr (kMass) mass[b] += hit ? w : 0.0;
      }
    }
    BlockHistogram<kMass>(cnt, mass, s);
    int chosen = -1;
    for (int b = kBuckets - 1; b >= 0; --b) {
      if constexpr (kMass) {
        if (cnt[b] > 0 && above + mass[b] >= top_p) {
          chosen = b;
          break;
        }
        above += mass[b];
      } else {
        if (cnt[b] >= need) {
          chosen = b;
          break;
        }
        need -= cnt[b];
      }
    }
    if (chosen < 0) return lower;
    prefix |= static_cast<uint64_t>(chosen) << shift;
    fixed |= static_cast<uint64_t>(kBuckets - 1) << shift;
    if (cnt[chosen] == 1) {
      uint64_t found = 0;
      for (int id = threadIdx.x; id < vocab; id += kThreads) {
        const uint64_t key = SortKey(logits[id], id);
        if (key >= lower && (key & fixed) == prefix) found = key;
      }
      return BlockMaxU64(found, s);
    }
  }
  return prefix;
}

// The noise in fp32, for screening only: -log(-log u), with -log u computed from whichever
// of u and 1 - u keeps its precision in fp32.
__device__ __forceinline__ float GumbelScreen(double u) {
  const float neg_log_u =
      u < 0.5 ? -logf(static_cast<float>(u)) : -log1pf(-static_cast<float>(1.0 - u));
  return -logf(neg_log_u);
}

__global__ void __launch_bounds__(kThreads) SampleKernel(SampleParams p) {
  __shared__ Smem s;
  const int64_t row = blockIdx.x;
  const float* logits = p.logits + row * p.logits_stride;
  const SampleRowParams rp = p.rows[row];
  const int vocab = static_cast<int>(p.vocab_size);

  uint64_t best_key = 0;
  for (int id = threadIdx.x; id < vocab; id += kThreads) {
    const uint64_t key = SortKey(logits[id], id);
    best_key = key > best_key ? key : best_key;
  }
  best_key = BlockMaxU64(best_key, s);
  if (!(rp.temperature > 0.0f)) {
    if (threadIdx.x == 0) p.tokens[row] = KeyId(best_key);
    return;
  }
  const double max_logit = logits[KeyId(best_key)];
  const double inv_t = 1.0 / static_cast<double>(rp.temperature);
  const bool use_k = rp.top_k > 0 && rp.top_k < vocab;
  const bool use_p = rp.top_p < 1.0f;
  uint64_t lower = 0;  // kept: keys >= lower (every key is > 0)
  if (use_k) {
    lower =
        Descend<false>(logits, vocab, 0, static_cast<uint32_t>(rp.top_k), 0.0, 0.0, 0.0, 0.0, s);
  }
  if (use_p) {
    double total = 0.0;
    for (int id = threadIdx.x; id < vocab; id += kThreads) {
      const float x = logits[id];
      if (SortKey(x, id) >= lower) total += exp((static_cast<double>(x) - max_logit) * inv_t);
    }
    total = BlockSumF64(total, s);
    lower = Descend<true>(logits, vocab, lower, 0, static_cast<double>(rp.top_p), max_logit, inv_t,
                          total, s);
  }

  // Gumbel-max over the kept tokens inside the window: screen in fp32, then score the
  // near-best exactly as the host does.
  auto screen = [&](int id, float x, float* score) {
    if (SortKey(x, id) < lower) return false;
    if ((static_cast<double>(x) - max_logit) * inv_t < -kGumbelWindow) return false;
    const double u =
        PhiloxUniform01(rp.seed, static_cast<uint64_t>(rp.position), static_cast<uint32_t>(id));
    *score = static_cast<float>(static_cast<double>(x) * inv_t) + GumbelScreen(u);
    return true;
  };
  float best_screen = -INFINITY;
  for (int id = threadIdx.x; id < vocab; id += kThreads) {
    float sc;
    if (screen(id, logits[id], &sc)) best_screen = fmaxf(best_screen, sc);
  }
  best_screen = BlockMaxF32(best_screen, s);
  const float cutoff = best_screen - 1e-3f * (1.0f + fabsf(best_screen));
  double best = -INFINITY;
  int best_id = -1;
  for (int id = threadIdx.x; id < vocab; id += kThreads) {
    const float x = logits[id];
    float sc;
    if (!screen(id, x, &sc) || !(sc >= cutoff)) continue;
    const double u =
        PhiloxUniform01(rp.seed, static_cast<uint64_t>(rp.position), static_cast<uint32_t>(id));
    const double score = static_cast<double>(x) * inv_t - log(-log(u));
    if (best_id < 0 || score > best) {
      best = score;
      best_id = id;
    }
  }
  best_id = BlockArgmax(best, best_id, s);
  if (threadIdx.x == 0) p.tokens[row] = best_id >= 0 ? best_id : KeyId(best_key);
}

}  // namespace

cudaError_t SampleCuda(const SampleParams& p, cudaStream_t stream) {
  if (p.num_rows < 0 || p.vocab_size <= 0 || p.vocab_size > (int64_t{1} << 30) ||
      p.logits_stride < p.vocab_size || p.num_rows > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  if (p.num_rows == 0) return cudaSuccess;
  if (p.logits == nullptr || p.rows == nullptr || p.tokens == nullptr) {
    return cudaErrorInvalidValue;
  }
  SampleKernel<<<static_cast<unsigned>(p.num_rows), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace specd
