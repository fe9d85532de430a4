#include "specd/kernels/tree_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/lanes.h"
#include "specd/kernels/linear.h"

namespace specd {
namespace {

// The two inner loops of one (query, head) item over its n keys, whose rows are at
// base + slots[j] * stride: scores[j] = (q . k_j) * scale, and acc += w[j] * v_j in key order.
// q, acc: [d] fp32; scores, w: [n] fp32; base: the cache plus the KV head's offset; all host.
// Each ISA has one fixed arithmetic per key (the same as LinearCpu's per-output one for the dot
// products), so an item's result depends only on its own keys, in order. The ISA is
// LinearCpuIsa(): one per process.
struct KeyLoops {
  void (*scores)(const float* q, const float* base, const int64_t* slots, int64_t n, int64_t stride,
                 int64_t d, float scale, float* scores);
  void (*accumulate)(const float* base, const int64_t* slots, int64_t n, int64_t stride, int64_t d,
                     const float* w, float* acc);
};

void ScoresScalar(const float* q, const float* base, const int64_t* slots, int64_t n,
                  int64_t stride, int64_t d, float scale, float* scores) {
  for (int64_t j = 0; j < n; ++j) {
    const float* k = base + slots[j] * stride;
    float dot = 0.0f;
    for (int64_t i = 0; i < d; ++i) dot += q[i] * k[i];
    scores[j] = dot * scale;
  }
}

void AccumulateScalar(const float* base, const int64_t* slots, int64_t n, int64_t stride, int64_t d,
                      const float* w, float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const float* v = base + slots[j] * stride;
    for (int64_t i = 0; i < d; ++i) acc[i] += w[j] * v[i];
  }
}

#ifdef SPECD_KERNELS_X86
__attribute__((target("avx512f"))) void ScoresAvx512(const float* q, const float* base,
                                                     const int64_t* slots, int64_t n,
                                                     int64_t stride, int64_t d, float scale,
                                                     float* scores) {
  const int64_t dv = d & ~int64_t{15};
  const __mmask16 tail = static_cast<__mmask16>((1u << (d - dv)) - 1u);
  // Four keys at a time only for instruction-level parallelism: each has its own accumulator.
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* k0 = base + slots[j] * stride;
    const float* k1 = base + slots[j + 1] * stride;
    const float* k2 = base + slots[j + 2] * stride;
    const float* k3 = base + slots[j + 3] * stride;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < dv; i += 16) {
      const __m512 qv = _mm512_loadu_ps(q + i);
      a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + i), a0);
      a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k1 + i), a1);
      a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k2 + i), a2);
      a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k3 + i), a3);
    }
    if (dv < d) {
      const __m512 qv = _mm512_maskz_loadu_ps(tail, q + dv);
      a0 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, k0 + dv), a0);
      a1 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, k1 + dv), a1);
      a2 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, k2 + dv), a2);
      a3 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, k3 + dv), a3);
    }
    scores[j] = lanes::Reduce16Avx512(a0) * scale;
    scores[j + 1] = lanes::Reduce16Avx512(a1) * scale;
    scores[j + 2] = lanes::Reduce16Avx512(a2) * scale;
    scores[j + 3] = lanes::Reduce16Avx512(a3) * scale;
  }
  for (; j < n; ++j) {
    const float* k0 = base + slots[j] * stride;
    __m512 a0 = _mm512_setzero_ps();
    for (int64_t i = 0; i < dv; i += 16) {
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k0 + i), a0);
    }
    if (dv < d) {
      a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, q + dv),
                           _mm512_maskz_loadu_ps(tail, k0 + dv), a0);
    }
    scores[j] = lanes::Reduce16Avx512(a0) * scale;
  }
}

__attribute__((target("avx512f"))) void AccumulateAvx512(const float* base, const int64_t* slots,
                                                         int64_t n, int64_t stride, int64_t d,
                                                         const float* w, float* acc) {
  // acc[i] = fma(w[j], v_j[i], acc[i]) for j in order: lanes are independent, so blocking the
  // columns (64 at a time in registers, then 16, then the masked tail) changes no bit.
  const int64_t dv = d & ~int64_t{15};
  int64_t i0 = 0;
  for (; i0 + 64 <= dv; i0 += 64) {
    __m512 a0 = _mm512_loadu_ps(acc + i0), a1 = _mm512_loadu_ps(acc + i0 + 16);
    __m512 a2 = _mm512_loadu_ps(acc + i0 + 32), a3 = _mm512_loadu_ps(acc + i0 + 48);
    for (int64_t j = 0; j < n; ++j) {
      const float* v = base + slots[j] * stride + i0;
      const __m512 wv = _mm512_set1_ps(w[j]);
      a0 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(v), a0);
      a1 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(v + 16), a1);
      a2 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(v + 32), a2);
      a3 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(v + 48), a3);
    }
    _mm512_storeu_ps(acc + i0, a0);
    _mm512_storeu_ps(acc + i0 + 16, a1);
    _mm512_storeu_ps(acc + i0 + 32, a2);
    _mm512_storeu_ps(acc + i0 + 48, a3);
  }
  for (; i0 < dv; i0 += 16) {
    __m512 a = _mm512_loadu_ps(acc + i0);
    for (int64_t j = 0; j < n; ++j) {
      a = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), _mm512_loadu_ps(base + slots[j] * stride + i0), a);
    }
    _mm512_storeu_ps(acc + i0, a);
  }
  if (dv < d) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (d - dv)) - 1u);
    __m512 a = _mm512_maskz_loadu_ps(tail, acc + dv);
    for (int64_t j = 0; j < n; ++j) {
      const float* v = base + slots[j] * stride + dv;
      a = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), _mm512_maskz_loadu_ps(tail, v), a);
    }
    _mm512_mask_storeu_ps(acc + dv, tail, a);
  }
}

__attribute__((target("avx2,fma"))) void ScoresAvx2(const float* q, const float* base,
                                                    const int64_t* slots, int64_t n, int64_t stride,
                                                    int64_t d, float scale, float* scores) {
  const int64_t dv = d & ~int64_t{7};
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(d - dv)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int64_t j = 0; j < n; ++j) {
    const float* k = base + slots[j] * stride;
    __m256 a = _mm256_setzero_ps();
    for (int64_t i = 0; i < dv; i += 8) {
      a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a);
    }
    if (dv < d) {
      a = _mm256_fmadd_ps(_mm256_maskload_ps(q + dv, mask), _mm256_maskload_ps(k + dv, mask), a);
    }
    scores[j] = lanes::Reduce8Avx2(a) * scale;
  }
}

__attribute__((target("avx2,fma"))) void AccumulateAvx2(const float* base, const int64_t* slots,
                                                        int64_t n, int64_t stride, int64_t d,
                                                        const float* w, float* acc) {
  const int64_t dv = d & ~int64_t{7};
  for (int64_t i = 0; i < dv; i += 8) {
    __m256 a = _mm256_loadu_ps(acc + i);
    for (int64_t j = 0; j < n; ++j) {
      a = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(base + slots[j] * stride + i), a);
    }
    _mm256_storeu_ps(acc + i, a);
  }
  for (int64_t i = dv; i < d; ++i) {
    float a = acc[i];
    for (int64_t j = 0; j < n; ++j) a = std::fma(w[j], base[slots[j] * stride + i], a);
    acc[i] = a;
  }
}
#endif  // SPECD_KERNELS_X86

KeyLoops ChooseKeyLoops() {
  switch (LinearCpuIsa()) {
#ifdef SPECD_KERNELS_X86
    case LinearIsa::kAvx512: return {ScoresAvx512, AccumulateAvx512};
    case LinearIsa::kAvx2: return {ScoresAvx2, AccumulateAvx2};
#endif
    default: return {ScoresScalar, AccumulateScalar};
  }
}

}  // namespace

void TreeAttentionCpuItems(const TreeAttentionParams& p, int64_t item_begin, int64_t item_end) {
  const int64_t d = p.head_dim;
  const int64_t group = p.kv_group > 0 ? p.kv_group : p.num_heads / p.num_kv_heads;
  const int64_t kv_stride = p.num_kv_heads * d;
  std::vector<int64_t> slots;  // physical slot of each key, in visiting order
  std::vector<float> scores;
  std::vector<float> acc(d);
  static const KeyLoops loops = ChooseKeyLoops();
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int64_t t = item / p.num_heads;
    const int64_t h = item % p.num_heads;
    const int64_t kvh = (p.q_head_offset + h) / group - p.kv_head_offset;
    const int32_t* table = p.kv.block_tables + p.query_seq[t] * p.kv.max_blocks_per_seq;
    const auto physical = [&](int64_t logical) {
      return static_cast<int64_t>(table[logical / p.kv.block_size]) * p.kv.block_size +
             logical % p.kv.block_size;
    };
    slots.clear();
    for (int64_t j = 0; j < p.prefix_len[t]; ++j) slots.push_back(physical(j));
    for (int32_t i = p.tree_key_offsets[t]; i < p.tree_key_offsets[t + 1]; ++i) {
      slots.push_back(physical(p.tree_keys[i]));
    }
    const float* q = p.q + (t * p.num_heads + h) * d;
    float* out = p.out + (t * p.num_heads + h) * d;
    if (slots.empty()) {
      std::fill(out, out + d, 0.0f);
      continue;
    }
    const int64_t n = static_cast<int64_t>(slots.size());
    scores.resize(n);
    loops.scores(q, p.kv.k_cache + kvh * d, slots.data(), n, kv_stride, d, p.scale, scores.data());
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) max_score = std::max(max_score, scores[j]);
    float denom = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      scores[j] = std::exp(scores[j] - max_score);  // now the weights
      denom += scores[j];
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    loops.accumulate(p.kv.v_cache + kvh * d, slots.data(), n, kv_stride, d, scores.data(),
                     acc.data());
    const float inv = 1.0f / denom;
    for (int64_t i = 0; i < d; ++i) out[i] = acc[i] * inv;
  }
}

void TreeAttentionCpu(const TreeAttentionParams& p) {
  TreeAttentionCpuItems(p, 0, p.num_queries * p.num_heads);
}

}  // namespace specd
