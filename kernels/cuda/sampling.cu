#include "kernels/cuda/device_utils.cuh"
#include "specd/kernels/cuda/sampling.h"
#include "specd/kernels/philox.h"

namespace specd {
namespace cuda {
namespace {

using internal::kFullMask;
using internal::SortKey;

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

// Argmax of (score, id): highest score, lowest id on ties; every thread gets the winner.
__device__ void BlockArgmax(double* score_io, int* id_io, Smem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double score = *score_io;
  int id = *id_io;
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
  *score_io = score;
  *id_io = id;
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

// Whether a row needs the top-k/top-p threshold search (else the split path can take it).
__device__ __forceinline__ bool IsFiltered(const SampleRowParams& rp, int vocab) {
  return rp.temperature > 0.0f &&
         ((rp.top_k > 0 && rp.top_k < vocab) || rp.top_p < 1.0f || rp.min_p > 0.0f);
}

// Rows candidate mode accepts (engine/tp/tp_plan.h VocabParallelSamplingSupported): top_k is judged
// against the global vocabulary, which a shard does not know, so only "no limit" passes.
__device__ __forceinline__ bool CandidateAllowed(const SampleRowParams& rp) {
  return !(rp.temperature > 0.0f) || (rp.top_k == 0 && rp.top_p >= 1.0f && !(rp.min_p > 0.0f));
}

// Whether SampleSplitKernel takes the row (with a workspace); SampleKernel takes the others.
// In candidate mode those are exactly the rows that get the empty candidate.
__device__ __forceinline__ bool SplitTakes(const SampleParams& p, const SampleRowParams& rp,
                                           int vocab) {
  return p.candidates != nullptr ? CandidateAllowed(rp) : !IsFiltered(rp, vocab);
}

// The host's Gumbel score of a token, for the rare fallback winner that was never scored.
__device__ double GumbelScore(const SampleRowParams& rp, uint32_t global_id, float x,
                              double inv_t) {
  const double u = PhiloxUniform01(rp.seed, static_cast<uint64_t>(rp.position), global_id);
  return static_cast<double>(x) * inv_t - log(-log(u));
}

// Writes the row's result for local id `id`: its global token id, or in candidate mode the
// (score, global id) candidate.
__device__ __forceinline__ void WriteResult(const SampleParams& p, int64_t row, int id,
                                            double score) {
  const int32_t token = static_cast<int32_t>(p.vocab_offset + id);
  if (p.candidates != nullptr) {
    SampleCandidate c;
    c.score = score;
    c.token = token;
    c.pad = 0;
    p.candidates[row] = c;
  } else {
    p.tokens[row] = token;
  }
}

__device__ __forceinline__ void WriteEmptyCandidate(const SampleParams& p, int64_t row) {
  SampleCandidate c;
  c.score = -INFINITY;
  c.token = -1;
  c.pad = 0;
  p.candidates[row] = c;
}

// One CTA per row. With `only_filtered`, rows the split kernel took are skipped.
__global__ void __launch_bounds__(kThreads) SampleKernel(SampleParams p, bool only_filtered) {
  __shared__ Smem s;
  const int64_t row = blockIdx.x;
  const float* logits = p.logits + row * p.logits_stride;
  const SampleRowParams rp = p.rows[row];
  const int vocab = static_cast<int>(p.vocab_size);
  // Rows that keep every token (greedy, unfiltered; the split kernel's) report threshold 0.
  if (p.kept_lower != nullptr && threadIdx.x == 0) p.kept_lower[row] = 0;
  if (only_filtered && SplitTakes(p, rp, vocab)) return;  // uniform over the CTA
  if (p.candidates != nullptr && !CandidateAllowed(rp)) {
    if (threadIdx.x == 0) WriteEmptyCandidate(p, row);
    return;
  }
  const uint32_t id0 = static_cast<uint32_t>(p.vocab_offset);  // global id of local id 0

  uint64_t best_key = 0;
  for (int id = threadIdx.x; id < vocab; id += kThreads) {
    const uint64_t key = SortKey(logits[id], id);
    best_key = key > best_key ? key : best_key;
  }
  best_key = BlockMaxU64(best_key, s);
  if (!(rp.temperature > 0.0f)) {
    if (threadIdx.x == 0) WriteResult(p, row, KeyId(best_key), logits[KeyId(best_key)]);
    return;
  }
  const double max_logit = logits[KeyId(best_key)];
  const double inv_t = 1.0 / static_cast<double>(rp.temperature);
  const bool use_k = rp.top_k > 0 && rp.top_k < vocab;
  const bool use_p = rp.top_p < 1.0f;
  uint64_t lower = 0;  // kept: keys >= lower (every key is > 0)
  if (rp.min_p > 0.0f) {
    // The host's test, exp((x - max) / T) >= min_p in fp64, keeps a prefix of the sorted order
    // (the argmax always): its smallest kept key is the threshold.
    uint64_t smallest = ~uint64_t{0};
    for (int id = threadIdx.x; id < vocab; id += kThreads) {
      const float x = logits[id];
      const uint64_t key = SortKey(x, id);
      if (exp((static_cast<double>(x) - max_logit) * inv_t) >= static_cast<double>(rp.min_p) &&
          key < smallest) {
        smallest = key;
      }
    }
    lower = ~BlockMaxU64(~smallest, s);
  }
  if (use_k) {
    // Top-k of what min-p kept (all of it when fewer remain).
    lower = Descend<false>(logits, vocab, lower, static_cast<uint32_t>(rp.top_k), 0.0, 0.0, 0.0,
                           0.0, s);
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

  if (p.kept_lower != nullptr && threadIdx.x == 0) p.kept_lower[row] = lower;

  // Gumbel-max over the kept tokens inside the window: screen in fp32, then score the
  // near-best exactly as the host does.
  auto screen = [&](int id, float x, float* score) {
    if (SortKey(x, id) < lower) return false;
    if ((static_cast<double>(x) - max_logit) * inv_t < -kGumbelWindow) return false;
    const double u = PhiloxUniform01(rp.seed, static_cast<uint64_t>(rp.position),
                                     id0 + static_cast<uint32_t>(id));
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
    const double u = PhiloxUniform01(rp.seed, static_cast<uint64_t>(rp.position),
                                     id0 + static_cast<uint32_t>(id));
    const double score = static_cast<double>(x) * inv_t - log(-log(u));
    if (best_id < 0 || score > best) {
      best = score;
      best_id = id;
    }
  }
  BlockArgmax(&best, &best_id, s);
  if (threadIdx.x == 0) {
    if (best_id >= 0) {
      WriteResult(p, row, best_id, best);
    } else {
      const int id = KeyId(best_key);
      WriteResult(p, row, id, GumbelScore(rp, id0 + static_cast<uint32_t>(id), logits[id], inv_t));
    }
  }
}

// ---- Split path: greedy and unfiltered temperature rows over many CTAs per row. ----

constexpr int kSplitThreads = 256;
constexpr int kSplitWarps = kSplitThreads / 32;
constexpr int kSplitPerThread = 16;
constexpr int kSplitChunk = kSplitThreads * kSplitPerThread;  // tokens per CTA

// One chunk's result: its best sort key (greedy; fallback) and its Gumbel-max winner.
struct __align__(16) SplitPartial {
  uint64_t best_key;
  double score;
  int32_t id;  // -1: no candidate in the chunk
  int32_t pad;
};

struct SplitSmem {
  uint64_t u64[kSplitWarps];
  double f64[kSplitWarps];
  int32_t i32[kSplitWarps];
  float f32[kSplitWarps];
  bool last;
};

__host__ __device__ int64_t NumSplitChunks(int64_t vocab) {
  return (vocab + kSplitChunk - 1) / kSplitChunk;
}

// Host-side workspace layout: partials [num_rows, chunks], then tickets [num_rows] uint32.
__host__ __device__ int64_t SplitTicketsOffset(int64_t num_rows, int64_t vocab) {
  return num_rows * NumSplitChunks(vocab) * static_cast<int64_t>(sizeof(SplitPartial));
}

// (score, id) order of the host's Gumbel loop: higher score, then lower id; id < 0 loses.
__device__ __forceinline__ bool Better(double a, int ia, double b, int ib) {
  return ia >= 0 && (ib < 0 || a > b || (a == b && ia < ib));
}

__device__ __forceinline__ uint64_t WarpMaxU64(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t other = __shfl_xor_sync(kFullMask, v, o);
    v = other > v ? other : v;
  }
  return v;
}

__device__ __forceinline__ void WarpArgmax(double* score, int* id) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const double so = __shfl_xor_sync(kFullMask, *score, o);
    const int io = __shfl_xor_sync(kFullMask, *id, o);
    if (Better(so, io, *score, *id)) {
      *score = so;
      *id = io;
    }
  }
}

// Block reductions of the split kernel (kSplitThreads threads; every thread gets the result).
__device__ uint64_t SplitBlockMaxU64(uint64_t v, SplitSmem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = WarpMaxU64(v);
  __syncthreads();
  if (lane == 0) s.u64[warp] = v;
  __syncthreads();
  return WarpMaxU64(lane < kSplitWarps ? s.u64[lane] : 0);
}

__device__ float SplitBlockMaxF32(float v, SplitSmem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = internal::WarpMax(v);
  __syncthreads();
  if (lane == 0) s.f32[warp] = v;
  __syncthreads();
  return internal::WarpMax(lane < kSplitWarps ? s.f32[lane] : -INFINITY);
}

__device__ void SplitBlockArgmax(double* score, int* id, SplitSmem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  WarpArgmax(score, id);
  __syncthreads();
  if (lane == 0) {
    s.f64[warp] = *score;
    s.i32[warp] = *id;
  }
  __syncthreads();
  *score = lane < kSplitWarps ? s.f64[lane] : -INFINITY;
  *id = lane < kSplitWarps ? s.i32[lane] : -1;
  WarpArgmax(score, id);
}

// grid = (chunks, rows). Each CTA reduces its chunk of kSplitChunk tokens (loaded once, kept in
// registers) to a SplitPartial; the row's last CTA to finish reduces the partials in chunk
// order and writes the token. Rows with top-k/top-p are left to SampleKernel.
__global__ void __launch_bounds__(kSplitThreads) SampleSplitKernel(SampleParams p) {
  __shared__ SplitSmem s;
  const int chunk = blockIdx.x;
  const int64_t row = blockIdx.y;
  const int num_chunks = gridDim.x;
  const int tid = threadIdx.x;
  const SampleRowParams rp = p.rows[row];
  const int vocab = static_cast<int>(p.vocab_size);
  if (!SplitTakes(p, rp, vocab)) return;  // uniform over the CTA, before any barrier
  const uint32_t id0 = static_cast<uint32_t>(p.vocab_offset);  // global id of local id 0
  const bool greedy = !(rp.temperature > 0.0f);
  const float* logits = p.logits + row * p.logits_stride;
  const int base = chunk * kSplitChunk + tid;

  // All loads in flight at once; token i of this thread is base + i * kSplitThreads.
  float x[kSplitPerThread];
#pragma unroll
  for (int i = 0; i < kSplitPerThread; ++i) {
    const int id = base + i * kSplitThreads;
    x[i] = id < vocab ? __ldg(logits + id) : -INFINITY;
  }
  uint64_t key = 0;  // every real key is > 0 (ids < 2^30)
#pragma unroll
  for (int i = 0; i < kSplitPerThread; ++i) {
    const int id = base + i * kSplitThreads;
    if (id < vocab) {
      const uint64_t k = SortKey(x[i], id);
      key = k > key ? k : key;
    }
  }
  key = SplitBlockMaxU64(key, s);

  double best = -INFINITY;
  int best_id = -1;
  if (!greedy) {
    // Gumbel-max over the chunk. A token more than the Gumbel window below the chunk's best
    // scaled logit loses to that token, so it needs no noise (the global best only raises the
    // bar). Screen in fp32, then re-score exactly (as the host does) what is near the chunk's
    // best screen: the chunk's winner is among those, as in SampleKernel.
    const double chunk_max = logits[KeyId(key)];
    const double inv_t = 1.0 / static_cast<double>(rp.temperature);
    float sc[kSplitPerThread];
    float best_screen = -INFINITY;
#pragma unroll
    for (int i = 0; i < kSplitPerThread; ++i) {
      const int id = base + i * kSplitThreads;
      sc[i] = NAN;  // not a candidate: fails every comparison
      if (id < vocab && !((static_cast<double>(x[i]) - chunk_max) * inv_t < -kGumbelWindow)) {
        const double u = PhiloxUniform01(rp.seed, static_cast<uint64_t>(rp.position),
                                         id0 + static_cast<uint32_t>(id));
        sc[i] = static_cast<float>(static_cast<double>(x[i]) * inv_t) + GumbelScreen(u);
        best_screen = fmaxf(best_screen, sc[i]);
      }
    }
    best_screen = SplitBlockMaxF32(best_screen, s);
    const float cutoff = best_screen - 1e-3f * (1.0f + fabsf(best_screen));
#pragma unroll
    for (int i = 0; i < kSplitPerThread; ++i) {
      if (!(sc[i] >= cutoff)) continue;
      const int id = base + i * kSplitThreads;
      const double u = PhiloxUniform01(rp.seed, static_cast<uint64_t>(rp.position),
                                       id0 + static_cast<uint32_t>(id));
      const double score = static_cast<double>(x[i]) * inv_t - log(-log(u));
      if (best_id < 0 || score > best) {  // ids ascend with i: the lowest id wins ties
        best = score;
        best_id = id;
      }
    }
    SplitBlockArgmax(&best, &best_id, s);
  }

  // Publish the partial, then take a ticket; the last CTA of the row sees every partial.
  SplitPartial* partials = static_cast<SplitPartial*>(p.workspace) + row * num_chunks;
  uint32_t* tickets = reinterpret_cast<uint32_t*>(static_cast<char*>(p.workspace) +
                                                  SplitTicketsOffset(p.num_rows, vocab));
  if (tid == 0) {
    SplitPartial part;
    part.best_key = key;
    part.score = best;
    part.id = best_id;
    part.pad = 0;
    partials[chunk] = part;
    __threadfence();
    s.last = atomicAdd(&tickets[row], 1u) == static_cast<uint32_t>(num_chunks - 1);
  }
  __syncthreads();
  if (!s.last) return;
  __threadfence();
  uint64_t row_key = 0;
  double row_best = -INFINITY;
  int row_best_id = -1;
  for (int c = tid; c < num_chunks; c += kSplitThreads) {
    // L2 reads: the partials were written by other CTAs.
    const uint64_t k = __ldcg(&partials[c].best_key);
    const double sc = __ldcg(&partials[c].score);
    const int id = __ldcg(&partials[c].id);
    row_key = k > row_key ? k : row_key;
    if (Better(sc, id, row_best, row_best_id)) {
      row_best = sc;
      row_best_id = id;
    }
  }
  row_key = SplitBlockMaxU64(row_key, s);
  if (!greedy) SplitBlockArgmax(&row_best, &row_best_id, s);
  if (tid == 0) {
    const int id = KeyId(row_key);
    if (greedy) {
      WriteResult(p, row, id, logits[id]);
    } else if (row_best_id >= 0) {
      WriteResult(p, row, row_best_id, row_best);
    } else {
      WriteResult(p, row, id,
                  GumbelScore(rp, id0 + static_cast<uint32_t>(id), logits[id],
                              1.0 / static_cast<double>(rp.temperature)));
    }
  }
}

// One thread per row: the best of the ranks' candidates, in the order of ReduceCandidates.
__global__ void ReduceCandidatesKernel(ReduceCandidatesParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= p.num_rows) return;
  double best = -INFINITY;
  int best_id = -1;
  for (int r = 0; r < p.world_size; ++r) {
    const SampleCandidate c = p.candidates[r * p.num_rows + row];
    if (Better(c.score, c.token, best, best_id)) {
      best = c.score;
      best_id = c.token;
    }
  }
  p.tokens[row] = best_id;
}

}  // namespace

int64_t SampleWorkspaceBytes(int64_t num_rows, int64_t vocab_size) {
  if (num_rows <= 0 || vocab_size <= 0) return 0;
  return SplitTicketsOffset(num_rows, vocab_size) +
         num_rows * static_cast<int64_t>(sizeof(uint32_t));
}

cudaError_t SampleCuda(const SampleParams& p, cudaStream_t stream) {
  if (p.num_rows < 0 || p.vocab_size <= 0 || p.vocab_size > (int64_t{1} << 30) ||
      p.logits_stride < p.vocab_size || p.num_rows > 0x7fffffff || p.vocab_offset < 0 ||
      p.vocab_offset + p.vocab_size > (int64_t{1} << 31)) {
    return cudaErrorInvalidValue;
  }
  if (p.num_rows == 0) return cudaSuccess;
  if (p.logits == nullptr || p.rows == nullptr ||
      (p.tokens == nullptr && p.candidates == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (p.candidates != nullptr && !IsAligned(p.candidates, 16)) return cudaErrorInvalidValue;
  if (p.candidates != nullptr && p.kept_lower != nullptr) return cudaErrorInvalidValue;
  if (p.workspace != nullptr && !IsAligned(p.workspace, 16)) return cudaErrorInvalidValue;
  // The split grid's rows are its y dimension (at most 65535); beyond, one CTA per row.
  if (p.workspace == nullptr || p.num_rows > 65535) {
    SampleKernel<<<static_cast<unsigned>(p.num_rows), kThreads, 0, stream>>>(p, false);
    return cudaGetLastError();
  }
  // The tickets start at zero on every launch (a memset node when captured in a graph).
  const int64_t tickets = SplitTicketsOffset(p.num_rows, p.vocab_size);
  if (cudaError_t e = cudaMemsetAsync(static_cast<char*>(p.workspace) + tickets, 0,
                                      p.num_rows * sizeof(uint32_t), stream);
      e != cudaSuccess) {
    return e;
  }
  const dim3 grid(static_cast<unsigned>(NumSplitChunks(p.vocab_size)),
                  static_cast<unsigned>(p.num_rows));
  SampleSplitKernel<<<grid, kSplitThreads, 0, stream>>>(p);
  // Rows with top-k/top-p: one CTA each (the others return at once).
  SampleKernel<<<static_cast<unsigned>(p.num_rows), kThreads, 0, stream>>>(p, true);
  return cudaGetLastError();
}

cudaError_t ReduceCandidatesCuda(const ReduceCandidatesParams& p, cudaStream_t stream) {
  if (p.world_size < 1 || p.num_rows < 0 || p.num_rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (p.num_rows == 0) return cudaSuccess;
  if (p.candidates == nullptr || p.tokens == nullptr || !IsAligned(p.candidates, 16)) {
    return cudaErrorInvalidValue;
  }
  const int threads = 256;
  const int64_t blocks = (p.num_rows + threads - 1) / threads;
  ReduceCandidatesKernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace specd
