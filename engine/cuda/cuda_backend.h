// The bf16 CUDA backend: Backend (engine/backend.h) on one NVIDIA GPU with the kernels of
// kernels/cuda. Weights are uploaded as bf16 (q/k/v and gate/up fused into one GEMM each); GEMMs
// go through cuBLASLt with fp32 accumulation; the residual stream is fp32.
//
// The backend in rooms, one concern a file:
//   cuda_weights.h      the weights of one rank's slice and their loading
//   cuda_step_plan.h    the step planner (buckets, metadata layout, masks, verify metadata):
//                       plain C++, unit-tested on the CPU
//   cuda_graph_cache.h  running a planned step eagerly or as a captured CUDA graph
//   cuda_forward.h      the model forward (the mirror of engine/cpu/cpu_model.h), its KV pools
//                       and device buffers, sampling, acceptance and compaction launches
//   cuda_backend.h      this file: the Backend glue (sequences, validation, Forward(),
//                       ForwardTopK(), Verify() and its outcomes)
//
// KV cache. One pool per tensor for all layers, [num_layers, num_slots, kv_dim] bf16, allocated
// at load for BackendOptions::kv_capacity_tokens (clamped to the free device memory), in blocks
// of kKvBlockTokens slots with per-sequence block tables kept by engine/kv/paged_kv_table.h --
// the CPU backend's bookkeeping, so committed prefixes take logical slots [0, L) and scratch
// nodes the slots after them.
//
// Verify() runs on the device end to end for every item: one forward pass over every sequence's
// pending tokens and tree, the logits processors of every tree row (min_tokens, logit_bias and
// the penalties, each node counting its own path after the committed history:
// kernels/cuda/logits_processors.cu), sampling of every row (Philox, the host sampler's
// semantics, min-p/top-k/top-p included), tree acceptance and compaction of the accepted KV,
// then a single copy of the outcomes to the host (and, for items that ask for logprobs, of
// their rows' top-n, sampled-token log-probability and rank, raw from the logits or processed
// from the sampled rows over the sampler's kept set: kernels/cuda/topk.cu). No logit row
// reaches the host.
//
// Attention masks. A scratch node sees the committed prefix, then the run of scratch nodes 0..a
// that form a chain from the committed end (its deepest such ancestor a), then its other
// ancestors through a 256-bit mask; so a node may lie at most 256 scratch slots past a. Verify
// steps (pending chain + a tree of <= 256 nodes) and prefill chains always fit; a Forward()
// whose scratch region grows wider off the chain is refused with UNIMPLEMENTED.
//
// CUDA graphs (BackendOptions::cuda_graphs). A decode or verify step of at most 64 sequences and
// 257 tokens a sequence is padded to a bucket -- batch 1, 2, 4, ..., 64 times 1, 2, 3, 5, 9, ...,
// 257 tokens a sequence (the pending token and a tree of up to 2^k nodes) -- and from its second
// use on replays a graph captured for that bucket: one metadata copy up, one graph launch, one
// copy of the logits, top-k rows or outcomes down. Padding rows write no KV (slot -1), read only,
// and are never sampled into an outcome. Prefill-sized steps run eagerly.
//
// Tensor parallelism (engine/cuda/cuda_tp_backend.h). Given a CudaTpRank, the backend is one
// rank of a group: it loads only its slice of the checkpoint (engine/tp/tp_plan.h: query heads,
// the KV heads they read, FFN columns and vocabulary rows), keeps only its KV heads, and
// all-reduces the row-parallel partial sums (cuda_forward.h). Every rank keeps the same sequence
// bookkeeping and runs the same steps in lockstep, SPMD, so sampling, acceptance and KV
// compaction need no coordinator, and every rank reaches the same outcome.
//
// Not thread-safe: one thread drives a backend. Numerics: logits agree with the fp32 CPU backend
// to bf16 accuracy (tests/gpu/cuda_backend_test.cc). GEMMs of up to
// BackendOptions::cuda_gemm_invariant_rows rows are row-invariant, and the attention split
// ignores padding, so a token's logits do not depend on the bucket, on graphs, or (while the
// attention takes one split, i.e. short contexts or wide batches) on the rest of the batch.
#ifndef SPECD_ENGINE_CUDA_CUDA_BACKEND_H_
#define SPECD_ENGINE_CUDA_CUDA_BACKEND_H_

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_forward.h"
#include "engine/cuda/cuda_graph_cache.h"
#include "engine/cuda/cuda_held_taps.h"
#include "engine/cuda/cuda_step_plan.h"
#include "engine/cuda/cuda_tuning.h"
#include "engine/kv/paged_kv_table.h"
#include "engine/model_config.h"

namespace specd {

class CudaBackend : public Backend {
 public:
  // Where a Verify() step's wall time went, when SetPhaseTiming(true) (benchmarks): host
  // microseconds before the metadata upload (validation, layout, attention plan), from there to
  // the launches' return, then waiting for the device, then reading the outcomes; and the
  // device's microseconds from the upload to the outcomes' copy (events on the stream).
  struct VerifyPhases {
    double prepare_us = 0, launch_us = 0, wait_us = 0, finish_us = 0;
    double device_us = 0;
  };
  // Padded (CUDA-graph) steps have at most this many token rows.
  static constexpr int64_t kGraphMaxTokens = specd::kGraphMaxTokens;
  // Custom all-reduce sites a tensor-parallel step cycles through (the group allocates one
  // buffer each).
  static constexpr int kAllReduceSites = kCudaAllReduceSites;

  // Loads the model folder `dir` onto CUDA device `device`; with `tp`, only that rank's slice of
  // it (call on the rank's own thread). `tuning` holds the switches of docs/tuning.md; nullptr
  // reads them from the environment (CudaTuningFromEnvironment). Creating a backend also sets
  // the kernel library's launches from tuning->launch (cuda::SetLaunchTuning).
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const std::string& dir, int device,
                                                             const BackendOptions& options,
                                                             const CudaTpRank* tp = nullptr,
                                                             const CudaTuning* tuning = nullptr);
  ~CudaBackend() override;

  const ModelConfig& config() const override { return config_; }
  absl::Status AddSequence(SeqId seq) override;
  absl::Status RemoveSequence(SeqId seq) override;
  bool HasSequence(SeqId seq) const override;
  absl::StatusOr<int64_t> CommittedLength(SeqId seq) const override;
  absl::Status Forward(absl::Span<const ForwardItem> items, std::vector<float>* logits) override;
  // The rows' top-k by kernels/cuda/topk.cu, launched after the LM head inside the step's CUDA
  // graph (a bucketed step replays forward and top-k as one graph keyed by bucket and k), the
  // level's metadata and row list in one copy up, [rows, k] ids and log-probabilities in one
  // copy down, one synchronisation.
  absl::Status ForwardTopK(absl::Span<const ForwardItem> items, int k, TopKRows* out) override;
  // The fp32 residual stream the step's norms leave, copied on the device after the norm that
  // completes it (CudaForward::Buffers::taps), then only the items' token rows to the host.
  absl::Status ForwardWithTaps(absl::Span<const ForwardItem> items,
                               absl::Span<const int> tap_layers, std::vector<float>* logits,
                               std::vector<float>* taps) override;
  // The argument checks of ForwardWithTaps() (here and in the tensor-parallel group): `logits`
  // not null, `taps` not null when layers are asked for, the layers distinct and in
  // [0, FinalNormTap(num_layers)] (INVALID_ARGUMENT naming tap_layers).
  static absl::Status CheckForwardWithTaps(absl::Span<const int> tap_layers, int num_layers,
                                           const std::vector<float>* logits,
                                           const std::vector<float>* taps);
  absl::Status Commit(SeqId seq, absl::Span<const int32_t> path) override;
  KvUsage Usage() const override;
  // Processes, samples, accepts and computes the logprobs of every item on the device (a group
  // runs its ranks' RunVerify() in lockstep).
  absl::StatusOr<std::vector<VerifyOutcome>> Verify(absl::Span<const VerifyItem> items) override;
  // Taps: the device path copies the union of the items' tap layers on the device during the
  // step and, after acceptance, only the committed rows (pending tokens, accepted nodes) to the
  // host; the host path takes them from ForwardWithTaps(). FinalNormTap is the final norm's
  // bf16 output (what the LM head reads) widened to fp32. Items with hold_tap_rows leave their
  // committed rows on the device instead (engine/cuda/cuda_held_taps.h), at most
  // kMaxDeviceHeldTapBytes for all sequences together.
  VerifyFeatures verify_features() const override {
    return {/*logits_processors=*/true, /*logprobs=*/true, /*taps=*/true,
            /*final_norm_tap=*/true, /*held_taps=*/true};
  }
  absl::StatusOr<HeldTapRows> TakeHeldTaps(SeqId seq) override;
  // Frees the rows held for `seq` (RemoveSequence() does; a group's does on its rank 0).
  void DropHeldTaps(SeqId seq);
  static constexpr int64_t kMaxDeviceHeldTapBytes = int64_t{256} << 20;

  // A rank of a tensor-parallel group (created with a CudaTpRank) keeps no sequences:
  // the group keeps one PagedKvTable for all ranks (MakeKvTable), lays out each step once and
  // hands the layout to every rank through the calls below; the Backend calls above that touch
  // sequences answer FAILED_PRECONDITION on a rank.
  //
  // The table of a backend whose pools hold `blocks` KV blocks (kv_blocks(); a group's smallest
  // rank's), allocated up front, with this backend's mask limit.
  static std::unique_ptr<PagedKvTable> MakeKvTable(const ModelConfig& config, int64_t blocks);
  // KV blocks this backend's pools hold.
  int64_t kv_blocks() const { return forward_->kv_blocks(); }
  // Forward() of a laid out step (PagedKvTable::PrepareForward of `items`) for one rank: writes
  // this rank's vocabulary columns of `logits`, [rows of all items, vocab_size] fp32, host, which
  // the caller sized (the other ranks write the other columns at the same time).
  // With tap_layers, also the taps of every item token ([sum of tokens, tap_layers.size() *
  // hidden] fp32, host, which the caller sized) into `taps`; one rank of a group is enough (the
  // residual stream is whole on every rank), the others pass none.
  absl::Status ForwardColumns(absl::Span<const ForwardItem> items, const StepLayout& layout,
                              float* logits, absl::Span<const int> tap_layers = {},
                              float* taps = nullptr);
  // ForwardTopK() of a laid out step (PagedKvTable::PrepareForward of `items`), k already
  // capped at the vocabulary. On a rank of a group every rank calls it: the ranks all-gather
  // their logits and rank 0 ranks the whole rows and fills `out` (the others pass null).
  absl::Status ForwardTopKLaidOut(absl::Span<const ForwardItem> items, const StepLayout& layout,
                                  int k, TopKRows* out);
  // Copies K/V of physical slots src[i] to dst[i], in order (PagedKvTable::PrepareCommit's).
  absl::Status CopyKvSlots(absl::Span<const int64_t> src, absl::Span<const int64_t> dst);
  // A verify step, validated and laid out by a table: PrepareVerify (once for a group; `backend`
  // answers CommittedLength), RunVerify (on every rank: processors, sampling, acceptance and KV
  // compaction on the device; the outcomes, with logprobs from rank 0 only and the items' taps
  // where export_taps: one rank of a group exports them), CommitVerify (once: the accepted paths
  // into the table).
  struct VerifyPlan {
    std::vector<ForwardItem> forward;  // per item: the pending chain, then the tree
    std::vector<int64_t> committed;    // per item: the committed length before the step
    StepLayout layout;
  };
  static absl::Status PrepareVerify(const Backend& backend, PagedKvTable* table,
                                    absl::Span<const VerifyItem> items, VerifyPlan* plan);
  absl::StatusOr<std::vector<VerifyOutcome>> RunVerify(
      absl::Span<const VerifyItem> items, const VerifyPlan& plan, bool export_taps = true,
      std::chrono::steady_clock::time_point t_enter = std::chrono::steady_clock::now());
  static absl::Status CommitVerify(PagedKvTable* table, absl::Span<const VerifyItem> items,
                                   const std::vector<VerifyOutcome>& outcomes);

  void SetPhaseTiming(bool on) { phase_timing_ = on; }
  const VerifyPhases& last_verify_phases() const { return last_phases_; }

  // Graph statistics, for tests and benchmarks: graphs captured and graph launches so far.
  int64_t graphs_captured() const { return graphs_.captured(); }
  int64_t graph_launches() const { return graphs_.launches(); }
  bool graphs_enabled() const { return graphs_enabled_; }
  bool pads_rows() const override { return graphs_enabled_; }
  ExecutionCounts execution_counts() const override {
    return {graphs_.captured(), graphs_.launches(), graphs_.eager_steps()};
  }
  // Turns graphs on or off from the next step on (the A/B benchmark); captured graphs are kept.
  void SetGraphsEnabled(bool on) { graphs_enabled_ = on; }
  // Weight shapes whose GEMMs are not row-invariant (BackendOptions::cuda_gemm_invariant_rows).
  int non_invariant_gemm_shapes() const { return forward_->gemm().non_invariant_shapes(); }
  // GEMM row classes whose algorithm has been decided (engine/warmup.h): after a warm-up, a
  // step whose row counts fall in decided classes adds none.
  int gemm_classes_decided() const {
    return forward_->gemm().own_algorithm_classes() + forward_->gemm().base_algorithm_classes();
  }

 private:
  CudaBackend(ModelConfig config, int device, const BackendOptions& options, const CudaTpRank* tp,
              const CudaTuning& tuning);
  // OK when this backend keeps sequences (not a rank of a group).
  absl::Status CheckOwnsTable() const;
  // Plans the forward pass of `items`, which a table laid out in `layout`, into `step` and
  // `pack`; item_tokens: each item's token slots (for the bucket).
  void PlanForward(absl::Span<const ForwardItem> items, const StepLayout& layout,
                   const std::vector<int64_t>& item_tokens, CudaStep* step, StepPacker* pack);
  // Plans a laid out forward pass and uploads its metadata; Execute(*step) then leaves
  // [step.R, vocab rows] fp32 logits in the forward's logits buffer.
  absl::Status PrepareForward(absl::Span<const ForwardItem> items, const StepLayout& layout,
                              CudaStep* step);
  // Runs a prepared step (eagerly, or as a CUDA graph when it is padded).
  absl::Status Execute(const CudaStep& step);
  // Forward() into host rows of stride vocab_size.
  absl::Status ForwardToHost(absl::Span<const ForwardItem> items, float* logits);
  // ForwardToHost() of a laid out step, this rank's columns.
  absl::Status ForwardLaidOut(absl::Span<const ForwardItem> items, const StepLayout& layout,
                              float* logits, absl::Span<const int> tap_layers = {},
                              float* taps = nullptr);
  // Grows host_out_ to at least `count` int32 words.
  absl::Status EnsureHostOut(size_t count);
  // Fills the outcomes' taps of the items that ask for them from a run verify `step`'s taps
  // (its tap_layers: the sorted union of the items'): the committed rows only.
  // Items with hold_tap_rows keep theirs on the device where there is room (held_taps_);
  // `committed` is each item's committed length before the step.
  absl::Status ExportTaps(absl::Span<const VerifyItem> items, const CudaStep& step,
                          absl::Span<const int64_t> committed,
                          std::vector<VerifyOutcome>* outcomes);
  // Copies token rows `rows` (ascending runs go in one copy each) of the last step's taps
  // ([step T, width] fp32, device) to `host` ([rows.size(), width] fp32), then waits for the
  // stream.
  absl::Status CopyTapRows(absl::Span<const int64_t> rows, int64_t width, float* host);
  // Verify(): PrepareVerify, RunVerify and CommitVerify on this backend's table.
  absl::StatusOr<std::vector<VerifyOutcome>> VerifyOnDevice(absl::Span<const VerifyItem> items);

  ModelConfig config_;
  int device_ = 0;
  BackendOptions options_;
  int world_ = 1;  // ranks of the group (1 without tensor parallelism)
  std::unique_ptr<CudaForward> forward_;

  // Sequences, block tables and scratch trees (engine/kv/paged_kv_table.h), sized to the KV
  // pools that forward_ holds; null on a rank of a group.
  std::unique_ptr<PagedKvTable> table_;

  // CUDA graphs, keyed by everything their launches take by value (CudaGraphKey).
  bool graphs_enabled_ = false;
  CudaGraphCache graphs_;
  // Tap rows held for sequences whose taps nobody reads yet (created on first use).
  std::unique_ptr<DeviceHeldTaps> held_taps_;
  // Pinned host memory: the verify outcomes or the top-k rows on their way down.
  int32_t* host_out_ = nullptr;
  size_t host_out_count_ = 0;
  // SetPhaseTiming: events around a verify step's device work (created on first use) and the
  // last step's phases.
  bool phase_timing_ = false;
  cudaEvent_t phase_events_[2] = {nullptr, nullptr};
  VerifyPhases last_phases_;
};

}  // namespace specd

#endif  // SPECD_ENGINE_CUDA_CUDA_BACKEND_H_
