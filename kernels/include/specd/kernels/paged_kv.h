// The paged KV cache as the kernels see it (FlashInfer's paged_kv_t): one struct in every params
// struct that reads or moves cache slots through block tables, CPU references and CUDA kernels
// alike, instead of the same loose fields in each.
//
// Layout (specd/kernels/kv_cache.h): a pool of keys and one of values, each [num_slots, kv_dim]
// (kv_dim = num_kv_heads * head_dim), addressed by physical slot = block * block_size + offset; a
// sequence's row of the block tables maps its logical slot j to physical slot
// block_tables[row * max_blocks_per_seq + j / block_size] * block_size + j % block_size. Which
// layer the pools hold, and which rows the sequences use, is the params struct's to say.
#ifndef SPECD_KERNELS_PAGED_KV_H_
#define SPECD_KERNELS_PAGED_KV_H_

#include <stdint.h>

namespace specd {

// T is the element type, const for a reader: `const float` for the CPU references (host
// memory), `const bf16` or `bf16` for the CUDA kernels (device memory; specd/kernels/cuda/
// paged_kv.h).
template <typename T>
struct PagedKvT {
  T* k_cache = nullptr;  // [num_slots, kv_dim] T
  T* v_cache = nullptr;  // [num_slots, kv_dim] T
  // [rows, max_blocks_per_seq] int32, in the pools' memory: the physical block of each logical
  // block of a sequence.
  const int32_t* block_tables = nullptr;
  int64_t max_blocks_per_seq = 0;
  int64_t block_size = 0;  // slots per block
};

}  // namespace specd

#endif  // SPECD_KERNELS_PAGED_KV_H_
