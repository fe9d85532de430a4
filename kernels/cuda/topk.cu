// Per-row top-k log-probabilities (specd/kernels/cuda/topk.h).
#include <algorithm>
#include <cstdint>

#include "device_utils.cuh"
#include "specd/kernels/cuda/topk.h"

namespace specd {
namespace cuda {
namespace {

constexpr int32_t kNoId = INT32_MAX;  // sentinel candidates lose to every real one

// The host order: larger key, then smaller id.
__device__ __forceinline__ bool Better(float a, int32_t a_id, float b, int32_t b_id) {
  return a > b || (a == b && a_id < b_id);
}

__device__ __forceinline__ float OrderKey(float v) { return isnan(v) ? -INFINITY : v; }

// Reads a logits row as the ranking sees it. Processed mode: the row scaled by 1 / temperature
// over the kept tokens only (the others have probability 0: listed never, counted in no rank and
// no sum).
struct RowReader {
  const float* row;  // [vocab] fp32, device: the row's logits
  uint64_t lower;    // the kept set's sort-key threshold; 0: every token
  double scale;      // 1 / temperature (processed mode), else 1
  bool processed;

  __device__ RowReader(const TopKLogprobsParams& p, int64_t in_row)
      : row(p.logits + in_row * p.logits_stride),
        lower(p.sampling != nullptr ? p.kept_lower[in_row] : 0),
        scale(1.0),
        processed(p.sampling != nullptr) {
    if (processed && p.sampling[in_row].temperature > 0.0f) {
      scale = 1.0 / static_cast<double>(p.sampling[in_row].temperature);
    }
  }
  __device__ float operator()(int i) const {
    const float x = row[i];
    return lower == 0 || internal::SortKey(x, i) >= lower ? OrderKey(x) : -INFINITY;
  }
  // Raw: x - log_z, as engine/topk.h; processed: engine/sampling.cc's scaled log_softmax.
  __device__ float Logprob(float x, double max_l, double total) const {
    return static_cast<float>(processed ? (static_cast<double>(x) - max_l) * scale - log(total)
                                        : static_cast<double>(x) - (max_l + log(total)));
  }
};

// One step of a warp's k-way merge: every lane offers the best head of its `kLists` sorted
// lists (list m of lane t is list t + 32 m; head[m] indexes it, `at(list, j)` reads entry j,
// `len` entries a list); the warp's best is returned in *best / *best_id on every lane, and the
// lane that offered it advances that list. Real ids are unique, so at most one lane wins;
// when only sentinels are left nobody advances and the sentinel is returned.
template <int kLists, typename At>
__device__ __forceinline__ void MergeStep(int (&head)[kLists], int len, const At& at, float* best,
                                          int32_t* best_id) {
  const int t = threadIdx.x & 31;
  float v_best = -INFINITY;
  int32_t i_best = kNoId;
  int from = -1;
#pragma unroll
  for (int m = 0; m < kLists; ++m) {
    if (head[m] < len) {
      float v;
      int32_t i;
      at(t + 32 * m, head[m], &v, &i);
      if (Better(v, i, v_best, i_best)) {
        v_best = v;
        i_best = i;
        from = m;
      }
    }
  }
  const int32_t mine = i_best;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(internal::kFullMask, v_best, o);
    const int32_t oi = __shfl_xor_sync(internal::kFullMask, i_best, o);
    if (Better(ov, oi, v_best, i_best)) {
      v_best = ov;
      i_best = oi;
    }
  }
  if (from >= 0 && mine == i_best) {
#pragma unroll
    for (int m = 0; m < kLists; ++m) head[m] += (m == from) ? 1 : 0;
  }
  *best = v_best;
  *best_id = i_best;
}

// The best `merged` (<= K) of tokens [begin, end) of a row into s_best_val / s_best_id (best
// first; (-inf, kNoId) sentinels where the range holds fewer). K: the candidates each thread
// keeps, a power of two >= merged, so the lists live in registers (every index is static after
// unrolling). Every thread of the CTA calls it; it ends with __syncthreads().
template <int K, int kThreads>
__device__ void CtaTopK(const RowReader& value, int begin, int end, int merged, float* s_best_val,
                        int32_t* s_best_id) {
  constexpr int kLists = kThreads / 32;  // lists each lane of the merging warp owns
  __shared__ float s_val[K][kThreads];
  __shared__ int32_t s_id[K][kThreads];
  const int t = threadIdx.x;
  float val[K];
  int32_t id[K];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    val[j] = -INFINITY;
    id[j] = kNoId;
  }
  // Ids arrive in increasing order per thread, so an equal key never displaces a kept one.
  for (int i = begin + t; i < end; i += kThreads) {
    const float x = value(i);
    if (!Better(x, i, val[K - 1], id[K - 1])) continue;
    bool placed = false;
#pragma unroll
    for (int j = K - 1; j > 0; --j) {
      if (!placed) {
        if (Better(x, i, val[j - 1], id[j - 1])) {
          val[j] = val[j - 1];
          id[j] = id[j - 1];
        } else {
          val[j] = x;
          id[j] = i;
          placed = true;
        }
      }
    }
    if (!placed) {
      val[0] = x;
      id[0] = i;
    }
  }
#pragma unroll
  for (int j = 0; j < K; ++j) {
    s_val[j][t] = val[j];
    s_id[j][t] = id[j];
  }
  __syncthreads();
  if (t < 32) {
    int head[kLists];
#pragma unroll
    for (int m = 0; m < kLists; ++m) head[m] = 0;
    auto at = [&](int list, int j, float* v, int32_t* i) {
      *v = s_val[j][list];
      *i = s_id[j][list];
    };
    for (int r = 0; r < merged; ++r) {
      float best;
      int32_t best_id;
      MergeStep<kLists>(head, K, at, &best, &best_id);
      if (t == 0) {
        s_best_val[r] = best;
        s_best_id[r] = best_id;
      }
    }
  }
  __syncthreads();
}

// Over tokens [begin, end): the fp64 sum of exp((x - max_l) * scale) and the count of tokens
// ranked strictly above `token_key`, reduced over the CTA (the same on every thread). Every
// thread of the CTA calls it, once a kernel.
template <int kThreads>
__device__ void CtaSumAndRank(const RowReader& value, int begin, int end, double max_l,
                              float token_key, double* sum_out, int32_t* higher_out) {
  __shared__ double s_sum[kThreads / 32];
  __shared__ int32_t s_higher[kThreads / 32];
  const int t = threadIdx.x;
  double sum = 0.0;
  int32_t higher = 0;
  for (int i = begin + t; i < end; i += kThreads) {
    const float x = value(i);
    sum += exp((static_cast<double>(x) - max_l) * value.scale);
    higher += x > token_key ? 1 : 0;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    sum += __shfl_xor_sync(internal::kFullMask, sum, o);
    higher += __shfl_xor_sync(internal::kFullMask, higher, o);
  }
  if ((t & 31) == 0) {
    s_sum[t >> 5] = sum;
    s_higher[t >> 5] = higher;
  }
  __syncthreads();
  double total = 0.0;
  int32_t count = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    total += s_sum[w];
    count += s_higher[w];
  }
  *sum_out = total;
  *higher_out = count;
}

// One CTA a row (grid = rows).
template <int K, int kThreads>
__global__ void __launch_bounds__(kThreads) TopKLogprobsKernel(TopKLogprobsParams p) {
  __shared__ float s_best_val[K];
  __shared__ int32_t s_best_id[K];
  const int64_t out_row = blockIdx.x;
  const int64_t in_row = p.row_index != nullptr ? p.row_index[out_row] : out_row;
  const RowReader value(p, in_row);
  const int vocab = static_cast<int>(p.vocab_size);
  // At least the best one: the log-sum-exp shifts by the row's maximum even when k = 0.
  CtaTopK<K, kThreads>(value, 0, vocab, p.k > 0 ? p.k : 1, s_best_val, s_best_id);

  const double max_l = static_cast<double>(s_best_val[0]);
  const bool with_token = p.tokens != nullptr;
  const int32_t token = with_token ? p.tokens[in_row] : 0;
  const float token_key = with_token ? value(token) : 0.0f;
  double total;
  int32_t higher;
  CtaSumAndRank<kThreads>(value, 0, vocab, max_l, token_key, &total, &higher);
  const int t = threadIdx.x;
  if (t < p.k) {
    p.ids[out_row * p.k + t] = s_best_id[t];
    p.logprobs[out_row * p.k + t] = value.Logprob(s_best_val[t], max_l, total);
  }
  if (with_token && t == 0) {
    p.token_logprobs[out_row] = value.Logprob(token_key, max_l, total);
    p.token_ranks[out_row] = 1 + higher;
  }
}

// The split path's workspace, `entries` = rows * chunks (entry row * chunks + chunk): the
// chunks' fp64 sums, maxima and counts above the token, then their `len` best values and ids.
struct SplitLayout {
  double* sum;      // [entries] fp64: sum of exp((x - chunk max) * scale) over the chunk
  float* max;       // [entries] fp32: the chunk's best key (-inf: nothing ranks in it)
  int32_t* higher;  // [entries] int32: tokens of the chunk above the row's token
  float* val;       // [entries, len] fp32: the chunk's best keys, best first
  int32_t* id;      // [entries, len] int32: their ids (kNoId: sentinel)
  int chunks;
  int len;  // max(k, 1)
  int chunk_size;

  static int64_t Bytes(int64_t entries, int len) {
    return entries * static_cast<int64_t>(sizeof(double) + sizeof(float) + sizeof(int32_t) +
                                          len * (sizeof(float) + sizeof(int32_t)));
  }
  static SplitLayout Make(void* workspace, int64_t rows, int chunks, int len, int64_t vocab) {
    const int64_t e = rows * chunks;
    SplitLayout w;
    w.sum = static_cast<double*>(workspace);
    w.max = reinterpret_cast<float*>(w.sum + e);
    w.higher = reinterpret_cast<int32_t*>(w.max + e);
    w.val = reinterpret_cast<float*>(w.higher + e);
    w.id = reinterpret_cast<int32_t*>(w.val + e * len);
    w.chunks = chunks;
    w.len = len;
    w.chunk_size = static_cast<int>((vocab + chunks - 1) / chunks);
    return w;
  }
};

// grid = (chunks, rows): CTA (c, r) ranks chunk c of output row r into the workspace.
template <int K, int kThreads>
__global__ void __launch_bounds__(kThreads) TopKChunkKernel(TopKLogprobsParams p, SplitLayout w) {
  __shared__ float s_best_val[K];
  __shared__ int32_t s_best_id[K];
  const int chunk = blockIdx.x;
  const int64_t out_row = blockIdx.y;
  const int64_t in_row = p.row_index != nullptr ? p.row_index[out_row] : out_row;
  const RowReader value(p, in_row);
  const int vocab = static_cast<int>(p.vocab_size);
  // Empty past the vocabulary (forced splits of more chunks than tokens).
  const int64_t first = int64_t{chunk} * w.chunk_size;
  const int begin = static_cast<int>(first < vocab ? first : vocab);
  const int end = static_cast<int>(first + w.chunk_size < vocab ? first + w.chunk_size : vocab);
  CtaTopK<K, kThreads>(value, begin, end, w.len, s_best_val, s_best_id);
  const double max_c = static_cast<double>(s_best_val[0]);
  const float token_key = p.tokens != nullptr ? value(p.tokens[in_row]) : 0.0f;
  double total;
  int32_t higher;
  CtaSumAndRank<kThreads>(value, begin, end, max_c, token_key, &total, &higher);
  const int64_t e = out_row * w.chunks + chunk;
  const int t = threadIdx.x;
  if (t < w.len) {
    w.val[e * w.len + t] = s_best_val[t];
    w.id[e * w.len + t] = s_best_id[t];
  }
  if (t == 0) {
    w.sum[e] = total;
    w.max[e] = s_best_val[0];
    w.higher[e] = higher;
  }
}

// One warp a row (grid = rows, 32 threads): merges the row's chunk lists into its best k, and
// its chunk sums, each rescaled from its chunk's maximum to the row's.
__global__ void __launch_bounds__(32) TopKMergeKernel(TopKLogprobsParams p, SplitLayout w) {
  constexpr int kLists = kMaxTopKChunks / 32;
  __shared__ float s_best_val[kMaxTopK];
  __shared__ int32_t s_best_id[kMaxTopK];
  const int64_t out_row = blockIdx.x;
  const int64_t in_row = p.row_index != nullptr ? p.row_index[out_row] : out_row;
  const RowReader value(p, in_row);
  const int t = threadIdx.x;
  const int64_t first = out_row * w.chunks;
  // The row's lists, staged once: the merge reads a head of each lane every round.
  __shared__ float s_val[kMaxTopKChunks * kMaxTopK];
  __shared__ int32_t s_id[kMaxTopKChunks * kMaxTopK];
  for (int i = t; i < w.chunks * w.len; i += 32) {
    s_val[i] = w.val[first * w.len + i];
    s_id[i] = w.id[first * w.len + i];
  }
  __syncwarp();
  // Lists beyond w.chunks start exhausted.
  int head[kLists];
#pragma unroll
  for (int m = 0; m < kLists; ++m) head[m] = t + 32 * m < w.chunks ? 0 : w.len;
  auto at = [&](int list, int j, float* v, int32_t* i) {
    *v = s_val[list * w.len + j];
    *i = s_id[list * w.len + j];
  };
  for (int r = 0; r < w.len; ++r) {
    float best;
    int32_t best_id;
    MergeStep<kLists>(head, w.len, at, &best, &best_id);
    if (t == 0) {
      s_best_val[r] = best;
      s_best_id[r] = best_id;
    }
  }
  __syncwarp();
  const double max_l = static_cast<double>(s_best_val[0]);
  // A chunk whose best is -inf adds nothing (its own sum is NaN or 0); a row whose best is
  // -inf has the one-CTA path's NaN total, exp(-inf - -inf) summed.
  double total = 0.0;
  int32_t higher = 0;
  for (int c = t; c < w.chunks; c += 32) {
    const float m = w.max[first + c];
    if (m > -INFINITY)
      total += w.sum[first + c] * exp((static_cast<double>(m) - max_l) * value.scale);
    higher += w.higher[first + c];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    total += __shfl_xor_sync(internal::kFullMask, total, o);
    higher += __shfl_xor_sync(internal::kFullMask, higher, o);
  }
  if (!(max_l > -INFINITY)) total = NAN;
  for (int j = t; j < p.k; j += 32) {
    p.ids[out_row * p.k + j] = s_best_id[j];
    p.logprobs[out_row * p.k + j] = value.Logprob(s_best_val[j], max_l, total);
  }
  if (p.tokens != nullptr && t == 0) {
    p.token_logprobs[out_row] = value.Logprob(value(p.tokens[in_row]), max_l, total);
    p.token_ranks[out_row] = 1 + higher;
  }
}

constexpr int kTargetCtas = 1024;  // the split's CTAs over all rows: a few per SM of an H200
constexpr int kMinChunkTokens = 1024;

template <int K, int kThreads>
cudaError_t Launch(const TopKLogprobsParams& p, int chunks, cudaStream_t stream) {
  if (chunks <= 1) {
    TopKLogprobsKernel<K, kThreads><<<static_cast<unsigned>(p.num_rows), kThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }
  const SplitLayout w =
      SplitLayout::Make(p.workspace, p.num_rows, chunks, std::max(p.k, 1), p.vocab_size);
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(p.num_rows));
  TopKChunkKernel<K, kThreads><<<grid, kThreads, 0, stream>>>(p, w);
  TopKMergeKernel<<<static_cast<unsigned>(p.num_rows), 32, 0, stream>>>(p, w);
  return cudaGetLastError();
}

}  // namespace

int TopKChunks(int64_t num_rows, int64_t vocab_size) {
  if (num_rows <= 0 || vocab_size <= 0) return 1;
  const int64_t by_vocab = (vocab_size + kMinChunkTokens - 1) / kMinChunkTokens;
  const int64_t by_ctas = (kTargetCtas + num_rows - 1) / num_rows;
  return static_cast<int>(
      std::max<int64_t>(1, std::min({by_vocab, by_ctas, int64_t{kMaxTopKChunks}})));
}

int64_t TopKWorkspaceBytes(int64_t num_rows, int64_t vocab_size, int k, int chunks) {
  const int len = std::max(k, 1);
  if (chunks > 0) return chunks > 1 ? SplitLayout::Bytes(num_rows * chunks, len) : 0;
  // rows * TopKChunks(rows) over every rows <= num_rows: at most the cap times the rows, and
  // below kTargetCtas + rows (the ceiling adds less than one CTA a row).
  const int64_t cap =
      std::min<int64_t>(kMaxTopKChunks, (vocab_size + kMinChunkTokens - 1) / kMinChunkTokens);
  if (num_rows <= 0 || cap < 2) return 0;
  return SplitLayout::Bytes(std::min(num_rows * cap, kTargetCtas + num_rows), len);
}

cudaError_t TopKLogprobsCuda(const TopKLogprobsParams& p, cudaStream_t stream) {
  const bool with_token = p.tokens != nullptr;
  if (with_token != (p.token_logprobs != nullptr) || with_token != (p.token_ranks != nullptr) ||
      (p.sampling != nullptr) != (p.kept_lower != nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (p.k < (with_token ? 0 : 1) || p.k > kMaxTopK || p.vocab_size < std::max(p.k, 1) ||
      p.vocab_size >= (int64_t{1} << 31) || p.num_rows < 0 || p.logits_stride < p.vocab_size ||
      p.logits == nullptr || (p.k > 0 && (p.ids == nullptr || p.logprobs == nullptr)) ||
      p.chunks < 0 || p.chunks > kMaxTopKChunks) {
    return cudaErrorInvalidValue;
  }
  if (p.num_rows == 0) return cudaSuccess;
  int chunks = p.chunks;
  if (chunks == 0) chunks = p.workspace != nullptr ? TopKChunks(p.num_rows, p.vocab_size) : 1;
  if (chunks > 1 &&
      (p.workspace == nullptr || reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0 ||
       p.workspace_bytes < TopKWorkspaceBytes(p.num_rows, p.vocab_size, p.k, chunks) ||
       p.num_rows > 65535)) {
    return cudaErrorInvalidValue;
  }
  // k = 0 still finds the row's maximum (the log-sum-exp's shift) through the K = 1 build.
  if (p.k <= 1) return Launch<1, 256>(p, chunks, stream);
  if (p.k <= 2) return Launch<2, 256>(p, chunks, stream);
  if (p.k <= 4) return Launch<4, 256>(p, chunks, stream);
  if (p.k <= 8) return Launch<8, 256>(p, chunks, stream);
  if (p.k <= 16) return Launch<16, 256>(p, chunks, stream);
  // Fewer threads for the largest K, so that the lists fit the static shared memory.
  return Launch<32, 128>(p, chunks, stream);
}

}  // namespace cuda
}  // namespace specd
