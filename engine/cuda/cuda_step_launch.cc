#include "engine/cuda/cuda_step_launch.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_status.h"
#include "engine/kv/paged_kv_table.h"
#include "specd/kernels/cuda/embedding.h"
#include "specd/kernels/cuda/rope.h"
#include "specd/kernels/cuda/tree_attention.h"

namespace specd {

absl::Status EnsureDeviceScratch(DeviceScratch* s, size_t bytes, cudaStream_t stream, bool* grown) {
  if (grown != nullptr) *grown = false;
  if (s->bytes >= bytes) return absl::OkStatus();
  if (s->ptr != nullptr) {
    SPECD_CUDA_RETURN_(cudaStreamSynchronize(stream), "synchronizing");
    FreeDeviceScratch(s);
  }
  const size_t size = std::max<size_t>(bytes + bytes / 4, 4096);
  SPECD_CUDA_RETURN_(cudaMalloc(&s->ptr, size), absl::StrCat("allocating ", size, " bytes"));
  s->bytes = size;
  if (grown != nullptr) *grown = true;
  return absl::OkStatus();
}

void FreeDeviceScratch(DeviceScratch* s) {
  if (s->ptr != nullptr) cudaFree(s->ptr);
  s->ptr = nullptr;
  s->bytes = 0;
}

PinnedUploader::~PinnedUploader() {
  if (host_ != nullptr) cudaFreeHost(host_);
}

absl::Status PinnedUploader::Upload(absl::Span<const uint8_t> bytes, void* device,
                                    cudaStream_t stream) {
  if (bytes_ < bytes.size()) {
    if (host_ != nullptr) cudaFreeHost(host_);
    host_ = nullptr;
    bytes_ = 0;
    const size_t size = std::max<size_t>(bytes.size() + bytes.size() / 4, 1 << 16);
    SPECD_CUDA_RETURN_(cudaMallocHost(&host_, size), "allocating pinned staging memory");
    bytes_ = size;
  }
  std::memcpy(host_, bytes.data(), bytes.size());
  SPECD_CUDA_RETURN_(cudaMemcpyAsync(device, host_, bytes.size(), cudaMemcpyHostToDevice, stream),
                     "uploading step metadata");
  return absl::OkStatus();
}

absl::StatusOr<KvPools> AllocateKvPools(int layers, int64_t kv_dim, int64_t wanted_tokens,
                                        size_t reserve_bytes, int device, absl::string_view what) {
  size_t free_bytes = 0, total_bytes = 0;
  SPECD_CUDA_RETURN_(cudaMemGetInfo(&free_bytes, &total_bytes), "reading free memory");
  const size_t block_bytes = size_t{2} * layers * kKvBlockTokens * kv_dim * sizeof(__nv_bfloat16);
  const int64_t fit = free_bytes > reserve_bytes
                          ? static_cast<int64_t>((free_bytes - reserve_bytes) / block_bytes)
                          : 0;
  KvPools pools;
  pools.num_blocks = std::min((wanted_tokens + kKvBlockTokens - 1) / kKvBlockTokens, fit);
  if (pools.num_blocks <= 0) {
    return absl::ResourceExhaustedError(absl::StrCat("cuda:", device,
                                                     ": no device memory left for ", what, " (",
                                                     free_bytes >> 20, " MiB free)"));
  }
  pools.layer_stride = pools.num_blocks * kKvBlockTokens * kv_dim;
  const size_t pool_bytes =
      static_cast<size_t>(layers) * pools.layer_stride * sizeof(__nv_bfloat16);
  for (__nv_bfloat16** pool : {&pools.k, &pools.v}) {
    void* p = nullptr;
    SPECD_CUDA_RETURN_(cudaMalloc(&p, pool_bytes), absl::StrCat("allocating ", what));
    *pool = static_cast<__nv_bfloat16*>(p);
    SPECD_CUDA_RETURN_(cudaMemset(p, 0, pool_bytes), absl::StrCat("clearing ", what));
  }
  SPECD_CUDA_RETURN_(cudaDeviceSynchronize(), absl::StrCat("initialising ", what));
  return pools;
}

absl::Status EnqueueStepAttention(const CudaStep& step, void* meta, __nv_bfloat16* qkv,
                                  __nv_bfloat16* out, const AttentionLaunch& a,
                                  cudaStream_t stream) {
  const int64_t QD = a.heads * a.head_dim, KVD = a.kv_heads * a.head_dim;
  const int64_t QKVD = QD + 2 * KVD;
  cuda::RopeParams rope;
  rope.q = qkv;
  rope.q_stride = QKVD;
  rope.num_q_heads = a.heads;
  rope.k = qkv + QD;
  rope.k_stride = QKVD;
  rope.num_k_heads = a.kv_heads;
  rope.positions = MetaAt<int32_t>(meta, step.o_positions);
  rope.inv_freq = a.inv_freq;
  rope.q_norm_weight = a.q_norm;
  rope.k_norm_weight = a.k_norm;
  rope.norm_eps = a.norm_eps;
  rope.num_tokens = step.T;
  rope.head_dim = a.head_dim;
  // The rotated keys and the values go straight to their KV-cache slots.
  rope.v = qkv + QD + KVD;
  rope.v_stride = QKVD;
  rope.k_cache = a.k_cache;
  rope.v_cache = a.v_cache;
  rope.slots = MetaAt<int64_t>(meta, step.o_slots);
  SPECD_CUDA_RETURN_(cuda::RopeCuda(rope, stream), "RoPE and KV write");

  cuda::TreeAttentionParams ap;
  ap.q = qkv;
  ap.q_stride = QKVD;
  ap.out = out;
  ap.out_stride = QD;
  ap.kv.k_cache = a.k_cache;
  ap.kv.v_cache = a.v_cache;
  ap.kv.block_tables = MetaAt<int32_t>(meta, step.o_tables);
  ap.kv.max_blocks_per_seq = step.max_blocks;
  ap.kv.block_size = kKvBlockTokens;
  ap.query_seq = MetaAt<int32_t>(meta, step.o_query_seq);
  ap.kv_end = MetaAt<int32_t>(meta, step.o_kv_end);
  // Chains only (decode, prefill): null masks select the kernel build without the tree-tail
  // code (same bits).
  ap.mask_begin = step.tree_masks ? MetaAt<int32_t>(meta, step.o_mask_begin) : nullptr;
  ap.mask = step.tree_masks ? MetaAt<uint32_t>(meta, step.o_mask) : nullptr;
  ap.tile_begin = MetaAt<int32_t>(meta, step.o_tile_begin);
  ap.tile_end = MetaAt<int32_t>(meta, step.o_tile_end);
  ap.kv_stable_end = MetaAt<int32_t>(meta, step.o_kv_stable);
  ap.num_tiles = step.num_tiles;
  ap.num_splits = step.num_splits;
  ap.chunks_per_cta = step.chunks_per_cta;
  ap.workspace = a.workspace;
  ap.discard_workspace = a.discard_workspace;
  ap.num_queries = step.T;
  ap.num_heads = a.heads;
  ap.num_kv_heads = a.kv_heads;
  ap.q_head_offset = a.q_head_offset;
  ap.kv_head_offset = a.kv_head_offset;
  ap.kv_group = a.kv_group;
  ap.head_dim = a.head_dim;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(a.head_dim));
  SPECD_CUDA_RETURN_(cuda::TreeAttentionCuda(ap, stream), "attention");
  return absl::OkStatus();
}

absl::Status EnqueueGatherRows(const CudaStep& step, void* meta, const __nv_bfloat16* rows,
                               int64_t hidden, __nv_bfloat16* out, cudaStream_t stream) {
  cuda::EmbeddingParams gather;  // a row gather: the "table" is the step's rows
  gather.tokens = MetaAt<int32_t>(meta, step.o_rows);
  gather.table = rows;
  gather.out = out;
  gather.num_tokens = step.R;
  gather.vocab_size = step.T;
  gather.hidden = hidden;
  SPECD_CUDA_RETURN_(cuda::EmbeddingCuda(gather, stream), "gathering output rows");
  return absl::OkStatus();
}

absl::Status RunGemm(cuda::Gemm& gemm, const cuda::GemmParams& p, cudaStream_t stream,
                     absl::string_view who) {
  if (cublasStatus_t st = gemm.Run(p, stream); st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat(who, ": GEMM [", p.m, ", ", p.k, "] x [", p.n, ", ",
                                            p.k, "]^T: ", cublasLtGetStatusString(st)));
  }
  return absl::OkStatus();
}

}  // namespace specd
