// The CUDA backend's model forward, the mirror of engine/cpu/cpu_model.h: one rank's slice of
// the model on one GPU (the whole model without tensor parallelism) with its weights
// (engine/cuda/cuda_weights.h), its KV pools, the per-step device buffers, the GEMMs, and the
// launches of a planned step (engine/cuda/cuda_step_plan.h): embedding, the decoder layers,
// the final norm and LM head, and for a verify step sampling, tree acceptance and KV compaction.
//
// KV pools. One pool per tensor for all layers, [num_layers, num_slots, local kv_dim] bf16,
// allocated once at Init() for BackendOptions::kv_capacity_tokens (clamped to the free device
// memory) in blocks of kKvBlockTokens slots; the block tables that map a sequence's logical
// slots onto them are the caller's.
//
// Tensor parallelism: the row-parallel partial sums (vocabulary-parallel embedding, o_proj,
// down_proj) are all-reduced with the custom one-shot all-reduce fused with the residual add and
// the RMSNorm that follows it (NCCL when a step is larger than the custom buffers), and verify
// rows are sampled from per-rank vocabulary candidates gathered with NCCL (greedy and plain
// temperature) or from logits gathered whole (top-k / top-p).
//
// Not thread-safe: one thread drives it.
#ifndef SPECD_ENGINE_CUDA_CUDA_FORWARD_H_
#define SPECD_ENGINE_CUDA_CUDA_FORWARD_H_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_step_launch.h"
#include "engine/cuda/cuda_step_plan.h"
#include "engine/cuda/cuda_tuning.h"
#include "engine/cuda/cuda_weights.h"
#include "engine/model_config.h"
#include "engine/tp/tp_plan.h"
#include "specd/kernels/cuda/common.h"
#include "specd/kernels/cuda/gemm.h"

namespace specd {

class CustomAllReduceGroup;
class NcclGroup;

// One rank's place in a tensor-parallel group; the group outlives the backend.
struct CudaTpRank {
  const TpPlan* plan = nullptr;  // the group's plan (every rank's slice)
  int rank = 0;
  NcclGroup* nccl = nullptr;  // required when the plan has more than one rank
  // Null: NCCL only. Otherwise steps whose all-reduce messages fit its buffers
  // ([tokens, hidden] bf16) use it.
  CustomAllReduceGroup* custom = nullptr;
};

// Custom all-reduce sites a tensor-parallel step cycles through (the group allocates one buffer
// each).
inline constexpr int kCudaAllReduceSites = 3;

class CudaForward {
 public:
  using Scratch = DeviceScratch;
  // Per-step device buffers. T: the step's token rows, R: its logit rows.
  struct Buffers {
    Scratch meta;      // the step's metadata (StepPacker), uploaded in one copy
    Scratch residual;  // [T, hidden] fp32
    Scratch x;         // [T, hidden] bf16: embedding, then each sublayer's output
    // [residual_splits, T, hidden] fp32: the K ranges' slabs of a sublayer's output GEMM,
    // which the next RMSNorm adds (one rank only).
    Scratch split;
    Scratch normed;     // [T, hidden] bf16
    Scratch qkv;        // [T, q_dim + 2 kv_dim] bf16
    Scratch attn;       // [T, q_dim] bf16
    Scratch gate_up;    // [T, 2 intermediate] bf16
    Scratch act;        // [T, intermediate] bf16
    Scratch last;       // [R, hidden] bf16
    Scratch logits;     // [R, vocab_rows()] fp32 (stride vocab_rows(), room for vocab_rows_max())
    Scratch attn_ws;    // split-KV workspace
    Scratch sample_ws;  // split-vocabulary sampling workspace (SampleWorkspaceBytes)
    Scratch verify;     // Commit()'s slot lists
    // ForwardTopK(): [step.topk_rows, k] int32 ids, then [step.topk_rows, k] fp32
    // log-probabilities, then from TopKWorkspaceOffset() the top-k kernel's split-path scratch
    // (EnqueueTopK); Verify() logprobs: the row index, ids,
    // log-probabilities, then the sampled tokens' log-probabilities and ranks.
    Scratch topk;
    // Tensor parallel verify: this rank's candidates [R] and everyone's [world, R]
    // (cuda::SampleCandidate); or everyone's logits [world, R, vocab_rows_max()] fp32 and the
    // whole rows [R, vocab] fp32.
    Scratch cand_local, cand_all, gathered, full_logits;
    // Verify with logits processors: the processed rows [R, vocab] fp32 that are sampled.
    Scratch processed;
    // [T, step.tap_layers.size() * hidden] fp32: copies of the residual stream entering each
    // tap layer (CudaStep::tap_layers' order), for steps that ask for taps.
    Scratch taps;
  };

  // `tp`: this rank's group, or null for the whole model on one GPU.
  CudaForward(const ModelConfig& config, int device, const BackendOptions& options,
              const CudaTpRank* tp, const CudaTuning& tuning);
  CudaForward(const CudaForward&) = delete;
  CudaForward& operator=(const CudaForward&) = delete;
  ~CudaForward();

  // Selects the device, creates the stream and the GEMM runner, uploads the weights, then
  // allocates and zeros the KV pools.
  absl::Status Init();

  cudaStream_t stream() const { return stream_; }
  cuda::Gemm& gemm() { return *gemm_; }
  const TpRankPlan& slice() const { return slice_; }
  int world() const { return world_; }
  int rank() const { return tp_.rank; }
  // This rank's vocabulary rows, and the largest rank's.
  int64_t vocab_rows() const { return vocab_rows_; }
  int64_t vocab_rows_max() const { return vocab_rows_max_; }
  // Blocks the KV pools hold.
  int64_t kv_blocks() const { return num_blocks_; }
  // What the step planner needs of this model and GPU.
  StepPlanOptions PlanOptions() const;

  Buffers& buffers() { return buffers_; }
  // Where a verify step left its whole rows, [step.R, *stride] fp32, device: the raw logits
  // (this rank's buffer, or the gathered rows of a group when step.gather_logits), or, with
  // `processed`, the rows that were sampled (after the logits processors when step.processors).
  const float* VerifyLogits(const CudaStep& step, bool processed, int64_t* stride);
  // Grows `s` to at least `bytes` (synchronising the stream first when it reallocates).
  absl::Status Ensure(Scratch* s, size_t bytes);
  // Counts the reallocations of the buffers that graphs point into (not verify and topk, which
  // only launches outside Enqueue() use).
  uint64_t buffer_generation() const { return buffer_generation_; }

  // Sizes the buffers for `step` with `meta_bytes` of metadata.
  absl::Status PrepareBuffers(const CudaStep& step, size_t meta_bytes);
  // Copies the packed metadata up through pinned memory (asynchronously, on stream()).
  absl::Status UploadMeta(const StepPacker& pack);
  // Enqueues the model (and for a verify step sampling, acceptance and compaction; for a
  // top-k step, step.topk_k > 0, the rows' top-k into buffers().topk) on stream(); leaves
  // [step.R, vocab_rows()] fp32 logits in buffers().logits, and the step's taps
  // (CudaStep::tap_layers) in buffers().taps. Allocates nothing,
  // synchronises nothing and reads nothing back, so that it can be captured into a CUDA graph.
  absl::Status Enqueue(const CudaStep& step);
  // Copies K/V of physical slots src[i] to dst[i], in order, in every layer (on stream()).
  absl::Status CopyKvSlots(absl::Span<const int64_t> src, absl::Span<const int64_t> dst);

 private:
  using bf16 = __nv_bfloat16;

  absl::Status AllocateKvPools();
  // Sizes the step buffers for ReservedStepShape() and the top-k buffer for its rows at
  // kMaxForwardTopK, so that graphs captured later are not dropped by their growth.
  absl::Status ReserveStepBuffers();
  absl::Status Gemm(const bf16* x, const bf16* w, const bf16* bias, void* y, bool y_fp32, int64_t m,
                    int64_t n, int64_t k, int k_splits = 1);
  // The K split of the GEMM whose output reaches the residual stream at `site` (o_proj,
  // down_proj): residual_splits_ where Gemm::KSplitFits its depth, else 1 (and 1 for the
  // embedding, which has no GEMM).
  int SiteSplits(int site) const;
  // Where a row-parallel GEMM writes its [T, hidden] partial sums for the all-reduce at `site`
  // (buffers_.x without tensor parallelism).
  bf16* Partial(const CudaStep& step, int site);
  // Sums the partials of `site` over the ranks into the residual stream (starting it when
  // `init`) and writes RMSNorm(residual) * weight to buffers_.normed. Where SiteSplits(site) > 1
  // (one rank only), the sublayer's output is the fp32 slabs of its K-split GEMM in
  // buffers_.split, added up by the norm. `dead`: [T, row_bytes] buffers that nothing reads again
  // (the GEMMs' inputs before it), which the norm drops from L2 when l2_discard_ (as it does the
  // slabs).
  absl::Status ReduceNorm(const CudaStep& step, int site, bool init, const float* weight,
                          cuda::DeadRows dead0 = {}, cuda::DeadRows dead1 = {});
  // Turns the [R, local vocab] logits into sampled tokens (verify steps).
  absl::Status SampleRows(const CudaStep& step, int32_t* tokens);
  // Tensor parallel: all-gathers every rank's [R, rows_r] logits into buffers_.gathered and,
  // when `place`, lays them side by side as whole rows in buffers_.full_logits ([R, vocab]).
  absl::Status GatherLogits(const CudaStep& step, bool place);
  // The top-k of a ForwardTopK() step's rows (step.topk_k > 0) into buffers_.topk; under
  // tensor parallelism on rank 0 only, over the gathered rows.
  absl::Status EnqueueTopK(const CudaStep& step);
  // buffers_.topk for a top-k step of `rows` rows at k: the results, then the kernel's
  // workspace at TopKWorkspaceOffset() (cuda::TopKWorkspaceBytes covers smaller rows and k).
  size_t TopKBufferBytes(int64_t rows, int k) const;
  static size_t TopKWorkspaceOffset(int64_t rows, int k);
  // l2_discard_, for a step of step.T tokens.
  bool DropDead(const CudaStep& step) const;

  const ModelConfig config_;
  const int device_;
  const BackendOptions options_;
  // The switches of docs/tuning.md, parsed once before this model was made.
  const CudaTuning tuning_;
  // This rank's part of the model (all of it without tensor parallelism) and its sizes: query
  // heads, KV heads, FFN columns, vocabulary rows.
  CudaTpRank tp_;
  int world_ = 1;
  TpRankPlan slice_;
  int64_t heads_ = 0, kv_heads_ = 0, ffn_ = 0, vocab_rows_ = 0;
  int64_t vocab_rows_max_ = 0;  // the largest rank's vocabulary rows
  // A sublayer's output GEMM (o_proj, down_proj) cut into this many K ranges whose fp32 slabs
  // the following RMSNorm adds: split-K without cuBLASLt's separate reduction kernel. 1 under
  // tensor parallelism (the all-reduce takes bf16 partials) or with SPECD_RESIDUAL_SPLITS=1.
  int residual_splits_ = 1;
  // Whether the kernels drop a layer's dead intermediates (the attention workspace, the gate_up
  // and K-split outputs, the GEMM inputs) from L2 without write-back (cuda::DeadRows);
  // SPECD_L2_DISCARD=0 turns it off.
  bool l2_discard_ = true;
  // The fewest tokens of a step whose kernels drop (SPECD_L2_DISCARD_MIN_TOKENS overrides it; 1
  // drops on every step, as tests do to exercise the drops). A drop costs an L2 round trip in
  // the kernel that issues it, while a few rows' intermediates cost little write-back: the
  // break-even lies between decode and a 64-node verify (bench/history/).
  int64_t l2_discard_min_tokens_ = 16;

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<cuda::Gemm> gemm_;
  int num_sms_ = 0;
  CudaWeights weights_;

  int64_t kv_dim_ = 0;  // this rank's KV heads * head_dim
  int64_t num_blocks_ = 0;
  int64_t layer_stride_ = 0;  // elements between layers in the pools
  // [num_layers, num_blocks_ * kKvBlockTokens, kv_dim_] bf16, device.
  bf16* k_pool_ = nullptr;
  bf16* v_pool_ = nullptr;

  Buffers buffers_;
  uint64_t buffer_generation_ = 0;
  PinnedUploader uploader_;  // the step's metadata on its way up
};

}  // namespace specd

#endif  // SPECD_ENGINE_CUDA_CUDA_FORWARD_H_
