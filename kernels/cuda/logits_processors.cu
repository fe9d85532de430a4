// Logits processors of verify rows (specd/kernels/cuda/logits_processors.h).
#include "kernels/cuda/device_utils.cuh"
#include "specd/kernels/cuda/logits_processors.h"

namespace specd {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// engine/sampling.cc Penalize(), with every operation rounded on its own as the host's (an FMA
// would round once and could differ from the host in the last bit).
__device__ __forceinline__ float Penalize(float logit, bool seen, int32_t count,
                                          const LogitsProcessorSeq& s) {
  if (seen && s.repetition_penalty != 1.0f) {
    logit = logit > 0.0f ? __fdiv_rn(logit, s.repetition_penalty)
                         : __fmul_rn(logit, s.repetition_penalty);
  }
  if (count > 0) {
    logit = __fsub_rn(logit, __fmul_rn(s.frequency_penalty, static_cast<float>(count)));
    logit = __fsub_rn(logit, s.presence_penalty);
  }
  return logit;
}

__device__ __forceinline__ int32_t CountIn(const int32_t* path, int len, int32_t token) {
  int32_t n = 0;
  for (int j = 0; j < len; ++j) n += __ldg(path + j) == token ? 1 : 0;
  return n;
}

// Whether `token` has a history entry (entries sorted by token).
__device__ __forceinline__ bool InHistory(const int32_t* history, int count, int32_t token) {
  int lo = 0, hi = count;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    const int32_t t = __ldg(history + 3 * mid);
    if (t == token) return true;
    if (t < token) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return false;
}

__global__ void __launch_bounds__(kThreads) LogitsProcessorsKernel(LogitsProcessorsParams p) {
  const int64_t row = blockIdx.x;
  const float* in = p.in + row * p.in_stride;
  float* out = p.out + row * p.out_stride;
  const int vocab = static_cast<int>(p.vocab_size);
  for (int i = threadIdx.x; i < vocab; i += kThreads) out[i] = __ldg(in + i);
  const LogitsProcessorRow r = p.rows[row];
  if (r.seq < 0) return;  // uniform over the CTA
  const LogitsProcessorSeq s = p.seqs[r.seq];
  const int32_t* path = p.data + r.path_begin;
  // The edits below read and write ids other threads copied.
  __syncthreads();
  // 1. min_tokens (stop ids may repeat: the same -inf twice is harmless).
  if (s.output_length + r.path_len < s.min_tokens) {
    for (int i = threadIdx.x; i < s.stop_count; i += kThreads) {
      out[__ldg(p.data + s.stop_begin + i)] = -INFINITY;
    }
  }
  __syncthreads();
  // 2. logit_bias (distinct ids).
  for (int i = threadIdx.x; i < s.bias_count; i += kThreads) {
    const int32_t* e = p.data + s.bias_begin + 2 * i;
    const int32_t id = __ldg(e);
    out[id] = __fadd_rn(out[id], __int_as_float(__ldg(e + 1)));
  }
  if (s.repetition_penalty == 1.0f && s.presence_penalty == 0.0f && s.frequency_penalty == 0.0f) {
    return;
  }
  __syncthreads();
  // 3. Penalties: every history token with its count over history and path, then the path's
  // tokens the history lacks (each at its first occurrence on the path, so once).
  const int32_t* history = p.data + s.history_begin;
  for (int i = threadIdx.x; i < s.history_count; i += kThreads) {
    const int32_t id = __ldg(history + 3 * i);
    const int32_t count = __ldg(history + 3 * i + 1) + CountIn(path, r.path_len, id);
    const bool in_prompt = __ldg(history + 3 * i + 2) != 0;
    out[id] = Penalize(out[id], in_prompt || count > 0, count, s);
  }
  for (int j = threadIdx.x; j < r.path_len; j += kThreads) {
    const int32_t id = __ldg(path + j);
    if (CountIn(path, j, id) > 0) continue;  // not its first occurrence
    if (InHistory(history, s.history_count, id)) continue;
    out[id] = Penalize(out[id], true, CountIn(path, r.path_len, id), s);
  }
}

}  // namespace

cudaError_t LogitsProcessorsCuda(const LogitsProcessorsParams& p, cudaStream_t stream) {
  if (p.num_rows < 0 || p.num_rows > 0x7fffffff || p.vocab_size <= 0 ||
      p.vocab_size >= (int64_t{1} << 31) || p.in_stride < p.vocab_size ||
      p.out_stride < p.vocab_size) {
    return cudaErrorInvalidValue;
  }
  if (p.num_rows == 0) return cudaSuccess;
  if (p.in == nullptr || p.out == nullptr || p.rows == nullptr) return cudaErrorInvalidValue;
  LogitsProcessorsKernel<<<static_cast<unsigned>(p.num_rows), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace specd
