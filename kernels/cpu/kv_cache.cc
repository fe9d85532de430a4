#include "specd/kernels/kv_cache.h"

#include <cstring>

namespace specd {

void KvCacheWriteCpu(const KvCacheWriteParams& p) {
  const size_t bytes = sizeof(float) * p.kv_dim;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    std::memcpy(p.k_cache + p.slots[t] * p.kv_dim, p.k + t * p.kv_dim, bytes);
    std::memcpy(p.v_cache + p.slots[t] * p.kv_dim, p.v + t * p.kv_dim, bytes);
  }
}

void KvCacheCopyCpu(const KvCacheCopyParams& p) {
  const size_t bytes = sizeof(float) * p.kv_dim;
  for (int64_t i = 0; i < p.num_copies; ++i) {
    if (p.src_slots[i] == p.dst_slots[i]) continue;
    std::memcpy(p.k_cache + p.dst_slots[i] * p.kv_dim, p.k_cache + p.src_slots[i] * p.kv_dim,
                bytes);
    std::memcpy(p.v_cache + p.dst_slots[i] * p.kv_dim, p.v_cache + p.src_slots[i] * p.kv_dim,
                bytes);
  }
}

}  // namespace specd
