// Paged KV cache storage on the GPU, in the layout of specd/kernels/kv_cache.h (the CPU
// reference): each layer's keys and values are a pool [num_slots, kv_dim] (kv_dim =
// num_kv_heads * head_dim) addressed by physical slot = block * block_size + offset, and a
// sequence's block table maps its logical slots to blocks. The CUDA backend keeps all layers in
// one allocation, [num_layers, num_slots, kv_dim], so that one launch moves a slot in every layer.
#ifndef SPECD_KERNELS_CUDA_KV_CACHE_H_
#define SPECD_KERNELS_CUDA_KV_CACHE_H_

#include "specd/kernels/cuda/common.h"
#include "specd/kernels/cuda/paged_kv.h"

namespace specd {
namespace cuda {

struct KvCacheWriteParams {
  // [num_tokens, k_stride] bf16, device: token t's kv_dim keys (RoPE applied) at k + t * k_stride
  // (the K columns of the fused QKV projection's output, say).
  const bf16* k = nullptr;
  int64_t k_stride = 0;
  const bf16* v = nullptr;  // [num_tokens, v_stride] bf16, device, likewise
  int64_t v_stride = 0;
  bf16* k_cache = nullptr;  // [num_slots, kv_dim] bf16, device (one layer)
  bf16* v_cache = nullptr;  // [num_slots, kv_dim] bf16, device
  // [num_tokens] int64, device: physical slot of token t; a negative slot skips the token.
  const int64_t* slots = nullptr;
  int64_t num_tokens = 0;
  int64_t kv_dim = 0;
};

cudaError_t KvCacheWriteCuda(const KvCacheWriteParams& p, cudaStream_t stream);

struct KvCacheCopyParams {
  bf16* k_cache = nullptr;  // [num_layers, layer_stride] bf16, device: layer l's pool
  bf16* v_cache = nullptr;  // [num_layers, layer_stride] bf16, device  [num_slots, kv_dim]
  int64_t num_layers = 1;
  int64_t layer_stride = 0;  // elements between layers' pools (>= num_slots * kv_dim)
  // [num_copies] int64, device: slot src[i] is copied to dst[i] in every layer, in order
  // i = 0, 1, ...; the caller orders them so that no copy overwrites a later copy's source.
  const int64_t* src_slots = nullptr;
  const int64_t* dst_slots = nullptr;
  int64_t num_copies = 0;
  int64_t kv_dim = 0;
};

cudaError_t KvCacheCopyCuda(const KvCacheCopyParams& p, cudaStream_t stream);

// Moves the KV of accepted tree paths into place without a host round trip: reads the path
// that TreeAcceptCuda wrote on the device. For sequence s, scratch node i sits at logical slot
// base_slot[s] + i; the path's j-th node (nodes[s * node_stride + j], j < num_nodes[s]) moves
// to logical slot base_slot[s] + j, in every layer. Path nodes increase along the path (a
// topologically ordered tree), so moving them in path order never overwrites a later source.
struct KvCacheCompactParams {
  // The pools of layer 0 and the block tables; layer l's pools are kv.k_cache + l * layer_stride
  // and kv.v_cache + l * layer_stride ([num_layers, layer_stride] bf16, device, in all).
  MutablePagedKvView kv;
  int64_t num_layers = 1;
  int64_t layer_stride = 0;
  int64_t kv_dim = 0;
  const int32_t* seq_rows = nullptr;   // [num_seqs] int32, device: block-table row of sequence s
  const int32_t* base_slot = nullptr;  // [num_seqs] int32, device
  const int32_t* nodes = nullptr;      // [num_seqs, node_stride] int32, device: scratch indices
  const int32_t* num_nodes = nullptr;  // [num_seqs] int32, device
  int64_t node_stride = 0;
  int64_t num_seqs = 0;
};

cudaError_t KvCacheCompactCuda(const KvCacheCompactParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_KV_CACHE_H_
