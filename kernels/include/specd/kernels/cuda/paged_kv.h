// The paged KV cache as the kernels see it, one struct for every params struct that reads or
// moves cache slots (FlashInfer's paged_kv_t), instead of the same loose fields in each.
//
// Layout (specd/kernels/kv_cache.h, the CPU reference): a pool of keys and one of values, each
// [num_slots, kv_dim] bf16 (kv_dim = num_kv_heads * head_dim), addressed by physical slot =
// block * block_size + offset; a sequence's row of the block tables maps its logical slot j to
// physical slot block_tables[row * max_blocks_per_seq + j / block_size] * block_size +
// j % block_size. Which layer the pools hold is the params struct's to say (one layer for
// attention, layer 0 of a strided stack for the compaction).
#ifndef SPECD_KERNELS_CUDA_PAGED_KV_H_
#define SPECD_KERNELS_CUDA_PAGED_KV_H_

#include <stdint.h>

#include "specd/kernels/cuda/common.h"

namespace specd {
namespace cuda {

// T is `const bf16` for kernels that only read the cache, `bf16` for those that write it.
template <typename T>
struct PagedKvT {
  T* k_cache = nullptr;  // [num_slots, kv_dim] bf16, device
  T* v_cache = nullptr;  // [num_slots, kv_dim] bf16, device
  // [rows, max_blocks_per_seq] int32, device: physical block of each logical block of a sequence.
  const int32_t* block_tables = nullptr;
  int64_t max_blocks_per_seq = 0;
  int64_t block_size = 0;  // slots per block
};

using PagedKvView = PagedKvT<const bf16>;
using MutablePagedKvView = PagedKvT<bf16>;

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_PAGED_KV_H_
