// Paged KV cache storage. Each layer's keys and values live in a pool of fixed-size blocks,
//   cache[num_blocks * block_size, num_kv_heads, head_dim],
// addressed by physical slot = block * block_size + offset. A sequence owns a block table that
// maps its logical slots (0, 1, 2, ... in the order its tokens were cached) to physical slots.
// These ops write new K/V into slots and move slots (to compact an accepted tree path into the
// committed prefix).
#ifndef SPECD_KERNELS_KV_CACHE_H_
#define SPECD_KERNELS_KV_CACHE_H_

#include <stdint.h>

namespace specd {

struct KvCacheWriteParams {
  const float* k = nullptr;        // [num_tokens, kv_dim] fp32, host (RoPE already applied)
  const float* v = nullptr;        // [num_tokens, kv_dim] fp32, host
  float* k_cache = nullptr;        // [num_slots, kv_dim] fp32, host
  float* v_cache = nullptr;        // [num_slots, kv_dim] fp32, host
  const int64_t* slots = nullptr;  // [num_tokens] int64, host: physical slot of token t
  int64_t num_tokens = 0;
  int64_t kv_dim = 0;  // num_kv_heads * head_dim
};

void KvCacheWriteCpu(const KvCacheWriteParams& p);

struct KvCacheCopyParams {
  float* k_cache = nullptr;  // [num_slots, kv_dim] fp32, host
  float* v_cache = nullptr;  // [num_slots, kv_dim] fp32, host
  // [num_copies] int64, host: slot src[i] is copied to dst[i], in order i = 0, 1, ...; the
  // caller orders them so that no copy overwrites a later copy's source.
  const int64_t* src_slots = nullptr;
  const int64_t* dst_slots = nullptr;
  int64_t num_copies = 0;
  int64_t kv_dim = 0;
};

void KvCacheCopyCpu(const KvCacheCopyParams& p);

}  // namespace specd

#endif  // SPECD_KERNELS_KV_CACHE_H_
