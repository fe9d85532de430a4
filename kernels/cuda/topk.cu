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

// K: the candidates each thread keeps, a power of two >= the requested k, so the lists live in
// registers (every index is static after unrolling); the first k of the merged K are the top k.
// kThreads: the CTA, fewer for the largest K so that the lists fit the static shared memory.
template <int K, int kThreads>
__global__ void __launch_bounds__(kThreads) TopKLogprobsKernel(TopKLogprobsParams p) {
  constexpr int kLists = kThreads / 32;  // lists each lane of the merging warp owns
  __shared__ float s_val[K][kThreads];
  __shared__ int32_t s_id[K][kThreads];
  __shared__ float s_best_val[K];
  __shared__ int32_t s_best_id[K];
  __shared__ double s_sum[kThreads / 32];
  __shared__ int32_t s_higher[kThreads / 32];

  const int64_t out_row = blockIdx.x;
  const int64_t in_row = p.row_index != nullptr ? p.row_index[out_row] : out_row;
  const float* row = p.logits + in_row * p.logits_stride;
  const int vocab = static_cast<int>(p.vocab_size);
  const int t = threadIdx.x;
  // Processed mode: the row scaled by 1 / temperature over the kept tokens only (the others
  // have probability 0: listed never, counted in no rank and no sum).
  const bool processed = p.sampling != nullptr;
  const uint64_t lower = processed ? p.kept_lower[in_row] : 0;
  double scale = 1.0;
  if (processed && p.sampling[in_row].temperature > 0.0f) {
    scale = 1.0 / static_cast<double>(p.sampling[in_row].temperature);
  }
  auto value = [&](int i) {
    const float x = row[i];
    return lower == 0 || internal::SortKey(x, i) >= lower ? OrderKey(x) : -INFINITY;
  };

  float val[K];
  int32_t id[K];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    val[j] = -INFINITY;
    id[j] = kNoId;
  }
  // Ids arrive in increasing order per thread, so an equal key never displaces a kept one.
  for (int i = t; i < vocab; i += kThreads) {
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
    // At least the best one: the log-sum-exp shifts by the row's maximum even when k = 0.
    const int merged = p.k > 0 ? p.k : 1;
    for (int r = 0; r < merged; ++r) {
      float best = -INFINITY;
      int32_t best_id = kNoId;
      int from = -1;
#pragma unroll
      for (int m = 0; m < kLists; ++m) {
        const int list = t + 32 * m;
        if (head[m] < K) {
          const float v = s_val[head[m]][list];
          const int32_t i = s_id[head[m]][list];
          if (Better(v, i, best, best_id)) {
            best = v;
            best_id = i;
            from = m;
          }
        }
      }
      const int32_t mine = best_id;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(internal::kFullMask, best, o);
        const int32_t oi = __shfl_xor_sync(internal::kFullMask, best_id, o);
        if (Better(ov, oi, best, best_id)) {
          best = ov;
          best_id = oi;
        }
      }
      // Real ids are unique and at least k exist (vocab_size >= k), so one lane wins.
      if (from >= 0 && mine == best_id) {
#pragma unroll
        for (int m = 0; m < kLists; ++m) head[m] += (m == from) ? 1 : 0;
      }
      if (t == 0) {
        s_best_val[r] = best;
        s_best_id[r] = best_id;
      }
    }
  }
  __syncthreads();

  const double max_l = static_cast<double>(s_best_val[0]);
  const bool with_token = p.tokens != nullptr;
  const int32_t token = with_token ? p.tokens[in_row] : 0;
  const float token_key = with_token ? value(token) : 0.0f;
  double sum = 0.0;
  int32_t higher = 0;
  for (int i = t; i < vocab; i += kThreads) {
    const float x = value(i);
    sum += exp((static_cast<double>(x) - max_l) * scale);
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
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += s_sum[w];
  const double log_z = max_l + log(total);
  // Raw: x - log_z, as engine/topk.h; processed: engine/sampling.cc's scaled log_softmax.
  auto logprob = [&](float x) {
    return static_cast<float>(processed ? (static_cast<double>(x) - max_l) * scale - log(total)
                                        : static_cast<double>(x) - log_z);
  };
  if (t < p.k) {
    p.ids[out_row * p.k + t] = s_best_id[t];
    p.logprobs[out_row * p.k + t] = logprob(s_best_val[t]);
  }
  if (with_token && t == 0) {
    int32_t rank = 1;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) rank += s_higher[w];
    p.token_logprobs[out_row] = logprob(token_key);
    p.token_ranks[out_row] = rank;
  }
}

}  // namespace

cudaError_t TopKLogprobsCuda(const TopKLogprobsParams& p, cudaStream_t stream) {
  const bool with_token = p.tokens != nullptr;
  if (with_token != (p.token_logprobs != nullptr) || with_token != (p.token_ranks != nullptr) ||
      (p.sampling != nullptr) != (p.kept_lower != nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (p.k < (with_token ? 0 : 1) || p.k > kMaxTopK || p.vocab_size < std::max(p.k, 1) ||
      p.vocab_size >= (int64_t{1} << 31) || p.num_rows < 0 || p.logits_stride < p.vocab_size ||
      p.logits == nullptr || (p.k > 0 && (p.ids == nullptr || p.logprobs == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (p.num_rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(p.num_rows));
  // k = 0 still finds the row's maximum (the log-sum-exp's shift) through the K = 1 build.
  if (p.k <= 1) {
    TopKLogprobsKernel<1, 256><<<grid, 256, 0, stream>>>(p);
  } else if (p.k <= 2) {
    TopKLogprobsKernel<2, 256><<<grid, 256, 0, stream>>>(p);
  } else if (p.k <= 4) {
    TopKLogprobsKernel<4, 256><<<grid, 256, 0, stream>>>(p);
  } else if (p.k <= 8) {
    TopKLogprobsKernel<8, 256><<<grid, 256, 0, stream>>>(p);
  } else if (p.k <= 16) {
    TopKLogprobsKernel<16, 256><<<grid, 256, 0, stream>>>(p);
  } else {
    TopKLogprobsKernel<32, 128><<<grid, 128, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace specd
