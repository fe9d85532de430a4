// The launch code a planned step (engine/cuda/cuda_step_plan.h) needs in every model that runs
// on it, shared by the CUDA backend's forward (engine/cuda/cuda_forward.h) and the CUDA EAGLE
// head (engine/draft/eagle_head_cuda.h): grow-on-demand device buffers, the pinned upload of a
// step's packed metadata, the paged K/V pools, one attention sublayer (RoPE with the fused KV
// write, then tree attention), the gather of the output rows, and a GEMM whose failure is a
// status. One copy of each, so that a change to the step layout or a kernel's parameters
// reaches both models.
#ifndef SPECD_ENGINE_CUDA_CUDA_STEP_LAUNCH_H_
#define SPECD_ENGINE_CUDA_CUDA_STEP_LAUNCH_H_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/cuda/cuda_step_plan.h"
#include "specd/kernels/cuda/gemm.h"

namespace specd {

// A device allocation that grows on demand (contents not preserved).
struct DeviceScratch {
  void* ptr = nullptr;
  size_t bytes = 0;
};

// Grows `s` to at least `bytes` (a quarter more, at least 4 KiB), synchronising `stream` first
// when it reallocates: work queued there may still read the old buffer. `*grown` (when given)
// is set to whether it reallocated.
absl::Status EnsureDeviceScratch(DeviceScratch* s, size_t bytes, cudaStream_t stream,
                                 bool* grown = nullptr);
void FreeDeviceScratch(DeviceScratch* s);

// Pinned host memory through which a step's packed metadata goes up in one asynchronous copy.
// Its owner synchronises the stream at the end of every step, so when the buffer has to grow
// the previous step's copy out of it has finished.
class PinnedUploader {
 public:
  PinnedUploader() = default;
  PinnedUploader(const PinnedUploader&) = delete;
  PinnedUploader& operator=(const PinnedUploader&) = delete;
  ~PinnedUploader();

  // Copies `bytes` to `device` on `stream` (asynchronously: `bytes` may change once this
  // returns; the pinned copy may not until the stream has passed the copy).
  absl::Status Upload(absl::Span<const uint8_t> bytes, void* device, cudaStream_t stream);

 private:
  void* host_ = nullptr;
  size_t bytes_ = 0;
};

// Paged K and V pools: [layers, num_blocks * kKvBlockTokens, kv_dim] bf16 each, device, zeroed
// (no slot holds NaN bit patterns: a masked key's value is multiplied by a zero probability,
// which would not cancel a NaN).
struct KvPools {
  __nv_bfloat16* k = nullptr;
  __nv_bfloat16* v = nullptr;
  int64_t num_blocks = 0;
  int64_t layer_stride = 0;  // elements between layers
};

// Allocates pools for `wanted_tokens` (rounded up to blocks), clamped to what the current
// device's free memory holds beyond `reserve_bytes`; synchronises the device (the clears run on
// the legacy stream, which non-blocking streams do not wait for). RESOURCE_EXHAUSTED naming
// `what` when not one block fits. The caller frees k and v.
absl::StatusOr<KvPools> AllocateKvPools(int layers, int64_t kv_dim, int64_t wanted_tokens,
                                        size_t reserve_bytes, int device, absl::string_view what);

// What an attention sublayer's launch needs beyond the step: this rank's heads, the layer's
// pools and RoPE, the step's workspace.
struct AttentionLaunch {
  int64_t heads = 0;     // this rank's query heads
  int64_t kv_heads = 0;  // this rank's KV heads
  int64_t kv_group = 1;  // query heads per KV head (the whole model's ratio)
  int64_t head_dim = 0;
  // This rank's first query and KV heads (tensor parallelism; 0 for a whole model).
  int64_t q_head_offset = 0, kv_head_offset = 0;
  const float* inv_freq = nullptr;  // [head_dim / 2] fp32, device
  // Per-head RMSNorm weights of q and k before RoPE ([head_dim] fp32, device), or null.
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float norm_eps = 0.0f;
  // The layer's pools: [num_slots, kv_heads * head_dim] bf16, device.
  __nv_bfloat16* k_cache = nullptr;
  __nv_bfloat16* v_cache = nullptr;
  float* workspace = nullptr;  // [step.ws_floats] fp32, device: the split-KV partials
  bool discard_workspace = false;
};

// RoPE of the step's queries and keys in `qkv` ([step.T, Q + 2 KV] bf16, device: q, k and v side
// by side), the rotated keys and the values written to their KV slots, then the tree attention
// of every query over its sequence's keys into `out` ([step.T, Q] bf16, device). `meta`: the
// step's metadata on the device (StepPacker's layout, CudaStep's offsets).
absl::Status EnqueueStepAttention(const CudaStep& step, void* meta, __nv_bfloat16* qkv,
                                  __nv_bfloat16* out, const AttentionLaunch& a,
                                  cudaStream_t stream);

// The step's step.R output rows (its o_rows list) of `rows` ([step.T, hidden] bf16, device) into
// `out` ([step.R, hidden] bf16, device).
absl::Status EnqueueGatherRows(const CudaStep& step, void* meta, const __nv_bfloat16* rows,
                               int64_t hidden, __nv_bfloat16* out, cudaStream_t stream);

// gemm.Run(p, stream), its failure INTERNAL naming `who` and the shape.
absl::Status RunGemm(cuda::Gemm& gemm, const cuda::GemmParams& p, cudaStream_t stream,
                     absl::string_view who);

// `base` + `offset` bytes as a T*: a field of a step's metadata.
template <typename T>
T* MetaAt(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(base) + offset);
}

}  // namespace specd

#endif  // SPECD_ENGINE_CUDA_CUDA_STEP_LAUNCH_H_
