#include "specd/kernels/cuda/kv_cache.h"

#include <algorithm>

#include "kernels/cuda/device_utils.cuh"

namespace specd {
namespace cuda {
namespace {

// One block per token, kVec elements per access.
template <int kVec>
__global__ void KvCacheWriteKernel(KvCacheWriteParams p) {
  const int64_t t = blockIdx.x;
  const int64_t slot = p.slots[t];
  if (slot < 0) return;
  const bf16* k = p.k + t * p.k_stride;
  const bf16* v = p.v + t * p.v_stride;
  bf16* kc = p.k_cache + slot * p.kv_dim;
  bf16* vc = p.v_cache + slot * p.kv_dim;
  for (int64_t i = threadIdx.x * kVec; i < p.kv_dim; i += blockDim.x * kVec) {
    if constexpr (kVec == 8) {
      *reinterpret_cast<uint4*>(kc + i) = *reinterpret_cast<const uint4*>(k + i);
      *reinterpret_cast<uint4*>(vc + i) = *reinterpret_cast<const uint4*>(v + i);
    } else {
      kc[i] = k[i];
      vc[i] = v[i];
    }
  }
}

// Copies must happen in order, but each thread owns one (layer, column) of every slot, so the
// order is kept by a sequential loop per thread and no synchronisation is needed.
template <int kVec>
__device__ __forceinline__ void CopyColumn(bf16* cache, int64_t src, int64_t dst, int64_t kv_dim,
                                           int64_t col) {
  if (src == dst) return;
  if constexpr (kVec == 8) {
    *reinterpret_cast<uint4*>(cache + dst * kv_dim + col) =
        *reinterpret_cast<const uint4*>(cache + src * kv_dim + col);
  } else {
    cache[dst * kv_dim + col] = cache[src * kv_dim + col];
  }
}

// grid.x covers columns of kVec elements, grid.y the layers.
template <int kVec>
__global__ void KvCacheCopyKernel(KvCacheCopyParams p) {
  const int64_t col = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * kVec;
  if (col >= p.kv_dim) return;
  bf16* kc = p.k_cache + blockIdx.y * p.layer_stride;
  bf16* vc = p.v_cache + blockIdx.y * p.layer_stride;
  for (int64_t i = 0; i < p.num_copies; ++i) {
    const int64_t src = p.src_slots[i], dst = p.dst_slots[i];
    CopyColumn<kVec>(kc, src, dst, p.kv_dim, col);
    CopyColumn<kVec>(vc, src, dst, p.kv_dim, col);
  }
}

// grid.x covers columns, grid.y the layers, grid.z the sequences.
template <int kVec>
__global__ void KvCacheCompactKernel(KvCacheCompactParams p) {
  const int64_t col = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * kVec;
  if (col >= p.kv_dim) return;
  const int s = blockIdx.z;
  bf16* kc = p.kv.k_cache + blockIdx.y * p.layer_stride;
  bf16* vc = p.kv.v_cache + blockIdx.y * p.layer_stride;
  const int32_t* table = p.kv.block_tables + p.seq_rows[s] * p.kv.max_blocks_per_seq;
  const int32_t* nodes = p.nodes + s * p.node_stride;
  const int64_t base = p.base_slot[s];
  auto physical = [&](int64_t logical) {
    return static_cast<int64_t>(table[logical / p.kv.block_size]) * p.kv.block_size +
           logical % p.kv.block_size;
  };
  const int n = p.num_nodes[s];
  for (int j = 0; j < n; ++j) {
    const int64_t src = physical(base + nodes[j]), dst = physical(base + j);
    CopyColumn<kVec>(kc, src, dst, p.kv_dim, col);
    CopyColumn<kVec>(vc, src, dst, p.kv_dim, col);
  }
}

dim3 ColumnGrid(int64_t kv_dim, int vec, int threads, int64_t y, int64_t z) {
  const int64_t cols = kv_dim / vec;
  return dim3(static_cast<unsigned>((cols + threads - 1) / threads), static_cast<unsigned>(y),
              static_cast<unsigned>(z));
}

}  // namespace

cudaError_t KvCacheWriteCuda(const KvCacheWriteParams& p, cudaStream_t stream) {
  if (p.num_tokens < 0 || p.kv_dim <= 0 || p.k_stride < p.kv_dim || p.v_stride < p.kv_dim) {
    return cudaErrorInvalidValue;
  }
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.k == nullptr || p.v == nullptr || p.k_cache == nullptr || p.v_cache == nullptr ||
      p.slots == nullptr) {
    return cudaErrorInvalidValue;
  }
  const bool vec = p.kv_dim % 8 == 0 && p.k_stride % 8 == 0 && p.v_stride % 8 == 0 &&
                   IsAligned(p.k, 16) && IsAligned(p.v, 16) && IsAligned(p.k_cache, 16) &&
                   IsAligned(p.v_cache, 16);
  const int threads = 128;
  if (vec) {
    KvCacheWriteKernel<8><<<static_cast<unsigned>(p.num_tokens), threads, 0, stream>>>(p);
  } else {
    KvCacheWriteKernel<1><<<static_cast<unsigned>(p.num_tokens), threads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t KvCacheCopyCuda(const KvCacheCopyParams& p, cudaStream_t stream) {
  if (p.num_copies < 0 || p.kv_dim <= 0 || p.num_layers <= 0 || p.num_layers > 65535 ||
      (p.num_layers > 1 && p.layer_stride < p.kv_dim)) {
    return cudaErrorInvalidValue;
  }
  if (p.num_copies == 0) return cudaSuccess;
  if (p.k_cache == nullptr || p.v_cache == nullptr || p.src_slots == nullptr ||
      p.dst_slots == nullptr) {
    return cudaErrorInvalidValue;
  }
  const bool vec = p.kv_dim % 8 == 0 && p.layer_stride % 8 == 0 && IsAligned(p.k_cache, 16) &&
                   IsAligned(p.v_cache, 16);
  const int threads = 128;
  if (vec) {
    KvCacheCopyKernel<8>
        <<<ColumnGrid(p.kv_dim, 8, threads, p.num_layers, 1), threads, 0, stream>>>(p);
  } else {
    KvCacheCopyKernel<1>
        <<<ColumnGrid(p.kv_dim, 1, threads, p.num_layers, 1), threads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t KvCacheCompactCuda(const KvCacheCompactParams& p, cudaStream_t stream) {
  if (p.num_seqs < 0 || p.num_seqs > 65535 || p.kv_dim <= 0 || p.num_layers <= 0 ||
      p.num_layers > 65535 || (p.num_layers > 1 && p.layer_stride < p.kv_dim) ||
      p.kv.block_size <= 0 || p.kv.max_blocks_per_seq <= 0 || p.node_stride < 0) {
    return cudaErrorInvalidValue;
  }
  if (p.num_seqs == 0) return cudaSuccess;
  if (p.kv.k_cache == nullptr || p.kv.v_cache == nullptr || p.kv.block_tables == nullptr ||
      p.seq_rows == nullptr || p.base_slot == nullptr || p.nodes == nullptr ||
      p.num_nodes == nullptr) {
    return cudaErrorInvalidValue;
  }
  const bool vec = p.kv_dim % 8 == 0 && p.layer_stride % 8 == 0 && IsAligned(p.kv.k_cache, 16) &&
                   IsAligned(p.kv.v_cache, 16);
  const int threads = 128;
  if (vec) {
    KvCacheCompactKernel<8>
        <<<ColumnGrid(p.kv_dim, 8, threads, p.num_layers, p.num_seqs), threads, 0, stream>>>(p);
  } else {
    KvCacheCompactKernel<1>
        <<<ColumnGrid(p.kv_dim, 1, threads, p.num_layers, p.num_seqs), threads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace specd
