#include "specd/kernels/tree_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace specd {

void TreeAttentionCpuItems(const TreeAttentionParams& p, int64_t item_begin, int64_t item_end) {
  const int64_t d = p.head_dim;
  const int64_t group = p.kv_group > 0 ? p.kv_group : p.num_heads / p.num_kv_heads;
  const int64_t kv_stride = p.num_kv_heads * d;
  std::vector<int64_t> slots;  // physical slot of each key, in visiting order
  std::vector<float> scores;
  std::vector<float> acc(d);
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
    scores.resize(slots.size());
    float max_score = -std::numeric_limits<float>::infinity();
    for (size_t j = 0; j < slots.size(); ++j) {
      const float* k = p.kv.k_cache + slots[j] * kv_stride + kvh * d;
      float dot = 0.0f;
      for (int64_t i = 0; i < d; ++i) dot += q[i] * k[i];
      scores[j] = dot * p.scale;
      max_score = std::max(max_score, scores[j]);
    }
    float denom = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (size_t j = 0; j < slots.size(); ++j) {
      const float w = std::exp(scores[j] - max_score);
      denom += w;
      const float* v = p.kv.v_cache + slots[j] * kv_stride + kvh * d;
      for (int64_t i = 0; i < d; ++i) acc[i] += w * v[i];
    }
    const float inv = 1.0f / denom;
    for (int64_t i = 0; i < d; ++i) out[i] = acc[i] * inv;
  }
}

void TreeAttentionCpu(const TreeAttentionParams& p) {
  TreeAttentionCpuItems(p, 0, p.num_queries * p.num_heads);
}

}  // namespace specd
