// The bf16 CUDA backend: Backend (engine/backend.h) on one NVIDIA GPU with the
// kernels of kernels/cuda. Weights are uploaded as bf16 (q/k/v and gate/up
// fused into one GEMM each); GEMMs go through cuBLASLt with fp32 accumulation;
// the residual stream is fp32.
//
// KV cache. One pool per tensor for all layers, [num_layers, num_slots, kv_dim]
// bf16, allocated at load for BackendOptions::kv_capacity_tokens (clamped to
// the free device memory), in blocks of kKvBlockTokens slots with per-sequence
// block tables -- the CPU backend's bookkeeping, so committed prefixes take
// logical slots [0, L) and scratch nodes the slots after them.
//
// Verify() runs on the device end to end: one forward pass over every
// sequence's pending tokens and tree, sampling of every tree row (Philox, the
// host sampler's semantics), tree acceptance and compaction of the accepted KV,
// then a single copy of the outcomes to the host (and, for items that ask for
// logprobs, of their rows' top-n, sampled-token log-probability and rank,
// kernels/cuda/topk.cu). Items whose sampling the device sampler lacks (logits
// processors, processed logprobs of sampled rows) take the host acceptance
// path over this backend's Forward() rows instead (VerifySplit).
//
// Attention masks. A scratch node sees the committed prefix, then the run of
// scratch nodes 0..a that form a chain from the committed end (its deepest such
// ancestor a), then its other ancestors through a 256-bit mask; so a node may
// lie at most 256 scratch slots past a. Verify steps (pending chain + a tree of
// <= 256 nodes) and prefill chains always fit; a Forward() whose scratch region
// grows wider off the chain is refused with UNIMPLEMENTED.
//
// CUDA graphs (BackendOptions::cuda_graphs). A decode or verify step of at most
// 64 sequences and 257 tokens a sequence is padded to a bucket -- batch 1, 2,
// 4, ..., 64 times 1, 2, 3, 5, 9, ..., 257 tokens a sequence (the pending token
// and a tree of up to 2^k nodes) -- and from its second use on replays a graph
// captured for that bucket: one metadata copy up, one graph launch, one copy of
// the logits or outcomes down. Padding rows write no KV (slot -1), read only,
// and are never sampled into an outcome. Prefill-sized steps run eagerly.
//
// Tensor parallelism (engine/cuda/cuda_tp_backend.h). Given a CudaTpRank, the
// backend is one rank of a group: it loads only its slice of the checkpoint
// (engine/tp/tp_plan.h: query heads, the KV heads they read, FFN columns and
// vocabulary rows), keeps only its KV heads, and all-reduces the row-parallel
// partial sums (vocabulary-parallel embedding, o_proj, down_proj) with the
// custom one-shot all-reduce fused with the residual add and the RMSNorm that
// follows it (NCCL when a step is larger than the custom buffers). Every rank
// keeps the same sequence bookkeeping and runs the same steps in lockstep,
// SPMD, so sampling, acceptance and KV compaction need no coordinator: rows
// are chosen from per-rank vocabulary candidates gathered with NCCL (greedy and
// plain temperature), or from logits gathered whole (top-k / top-p), and every
// rank reaches the same outcome.
//
// Not thread-safe: one thread drives a backend. Numerics: logits agree with the
// fp32 CPU backend to bf16 accuracy (tests/gpu/cuda_backend_test.cc). GEMMs of
// up to BackendOptions::cuda_gemm_invariant_rows rows are row-invariant, and
// the attention split ignores padding, so a token's logits do not depend on the
// bucket, on graphs, or (while the attention takes one split, i.e. short
// contexts or wide batches) on the rest of the batch.
#ifndef SPECD_ENGINE_CUDA_CUDA_BACKEND_H_
#define SPECD_ENGINE_CUDA_CUDA_BACKEND_H_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_tuning.h"
#include "engine/model_config.h"
#include "common/io/load_progress.h"
#include "common/io/safetensors.h"
#include "engine/tp/tp_plan.h"
#include "engine/tp/weight_shard.h"
#include "specd/kernels/cuda/gemm.h"

namespace specd {

class CustomAllReduceGroup;
class NcclGroup;

// One rank's place in a tensor-parallel group; the group outlives the backend.
struct CudaTpRank {
  const TpPlan* plan = nullptr;  // the group's plan (every rank's slice)
  int rank = 0;
  NcclGroup* nccl = nullptr;     // required when the plan has more than one rank
  // Null: NCCL only. Otherwise steps whose all-reduce messages fit its buffers
  // ([tokens, hidden] bf16) use it.
  CustomAllReduceGroup* custom = nullptr;
};

class CudaBackend : public Backend {
public:
  // Where a Verify() step's wall time went, when SetPhaseTiming(true)
  // (benchmarks): host microseconds before the metadata upload (validation,
  // layout, attention plan), from there to the launches' return, then waiting
  // for the device, then reading the outcomes; and the device's microseconds
  // from the upload to the outcomes' copy (events on the stream).
  struct VerifyPhases {
    double prepare_us = 0, launch_us = 0, wait_us = 0, finish_us = 0;
    double device_us = 0;
  };
  static constexpr int64_t kKvBlockTokens = 16;
  // Padded (CUDA-graph) steps have at most this many token rows.
  static constexpr int64_t kGraphMaxTokens = 4096;
  // Custom all-reduce sites a tensor-parallel step cycles through (the group
  // allocates one buffer each).
  static constexpr int kAllReduceSites = 3;

  // Loads the model folder `dir` onto CUDA device `device`; with `tp`, only
  // that rank's slice of it (call on the rank's own thread). `tuning` holds the
  // switches of docs/tuning.md; nullptr reads them from the environment
  // (CudaTuningFromEnvironment). Creating a backend also sets the kernel
  // library's launches from tuning->launch (cuda::SetLaunchTuning).
  static absl::StatusOr<std::unique_ptr<CudaBackend>>
  Create(const std::string &dir, int device, const BackendOptions &options,
         const CudaTpRank *tp = nullptr, const CudaTuning *tuning = nullptr);
  ~CudaBackend() override;

  const ModelConfig &config() const override { return config_; }
  absl::Status AddSequence(SeqId seq) override;
  absl::Status RemoveSequence(SeqId seq) override;
  bool HasSequence(SeqId seq) const override;
  absl::StatusOr<int64_t> CommittedLength(SeqId seq) const override;
  absl::Status Forward(absl::Span<const ForwardItem> items,
                       std::vector<float> *logits) override;
  // The rows' top-k by kernels/cuda/topk.cu, so only [rows, k] ids and
  // log-probabilities reach the host (the host path for a rank of a group).
  absl::Status ForwardTopK(absl::Span<const ForwardItem> items, int k,
                           TopKRows *out) override;
  absl::Status Commit(SeqId seq, absl::Span<const int32_t> path) override;
  KvUsage Usage() const override;
  // Items VerifiesOnDevice() accepts sample, accept and compute their
  // logprobs on the device; the rest (logits processors, processed logprobs
  // of sampled rows) take the host path over this backend's Forward()
  // rows (VerifySplit). A rank of a group serves SamplesOnDevice() items
  // without logprobs only: CudaTensorParallelBackend splits the batch.
  absl::StatusOr<std::vector<VerifyOutcome>>
  Verify(absl::Span<const VerifyItem> items) override;
  VerifyFeatures verify_features() const override {
    return {/*logits_processors=*/true, /*logprobs=*/true, /*taps=*/false};
  }
  // Whether the device sampler serves `item`'s sampling (temperature, min_p,
  // top-k, top-p): no logits processor.
  static bool SamplesOnDevice(const VerifyItem &item);
  // Whether the device computes `item`'s logprobs: none asked for, raw mode,
  // or processed mode of a greedy row (log_softmax of the row itself when no
  // processor edits it).
  static bool LogprobsOnDevice(const VerifyItem &item);
  static bool VerifiesOnDevice(const VerifyItem &item) {
    return SamplesOnDevice(item) && LogprobsOnDevice(item);
  }

  // Forward() for one rank of a group: writes this rank's vocabulary columns
  // of `logits`, [rows of all items, vocab_size] fp32, host, which the caller
  // sized (the other ranks write the other columns at the same time).
  absl::Status ForwardColumns(absl::Span<const ForwardItem> items,
                              float *logits);
  // KV blocks this backend can hold, and a cap on them: the ranks of a group
  // must run out of KV blocks at the same moment.
  int64_t kv_blocks() const { return num_blocks_; }
  void LimitKvBlocks(int64_t blocks);

private:
  using bf16 = __nv_bfloat16;

  // Norm weights are fp32 (RmsNormParams::weight says why); the rest bf16.
  struct LayerWeights {
    float *input_norm = nullptr; // [hidden]
    bf16 *qkv =
        nullptr; // [q_dim + 2 kv_dim, hidden]: q_proj, k_proj, v_proj rows
    bf16 *qkv_bias = nullptr;  // [q_dim + 2 kv_dim] or null
    float *q_norm = nullptr;   // [head_dim] or null
    float *k_norm = nullptr;   // [head_dim] or null
    bf16 *o_proj = nullptr;    // [hidden, q_dim]
    float *post_norm = nullptr; // [hidden]
    bf16 *gate_up =
        nullptr;          // [2 intermediate, hidden]: gate_proj, up_proj rows
    bf16 *down = nullptr; // [hidden, intermediate]
  };
  struct Sequence {
    int64_t committed = 0;
    std::vector<int32_t> blocks;
    std::vector<int32_t> scratch_parents;
    std::vector<int32_t> scratch_depth;
    int64_t tokens() const {
      return committed + static_cast<int64_t>(scratch_parents.size());
    }
  };
  // A device allocation that grows on demand (contents not preserved).
  struct Scratch {
    void *ptr = nullptr;
    size_t bytes = 0;
  };
  // A validated batch: per item its sequence, the new nodes' depths, and for
  // each new node its deepest ancestor on the chain from the committed end (-1
  // if none).
  struct Batch {
    std::vector<Sequence *> seqs;
    std::vector<std::vector<int32_t>> depth;
    std::vector<std::vector<int32_t>> spine;
    int64_t tokens = 0;
    int64_t rows = 0;
  };

  // Packs host arrays into one buffer with 16-byte aligned sections (defined in
  // the .cc).
  class Packer;
  // The launches of one step (see "Step layout" in the .cc): sizes as the
  // kernels see them and where each metadata array sits in meta_ (byte
  // offsets).
  struct Step {
    bool verify = false;
    bool padded = false; // rounded up to a (batch, tokens a sequence) bucket
    int64_t batch = 0;   // sequences launched (padding sequences included)
    int64_t per_seq =
        0;         // token slots (and logit rows) of each sequence when padded
    int64_t T = 0; // token rows launched
    int64_t R = 0; // logit rows launched
    int64_t max_blocks = 0; // block-table stride
    int64_t num_tiles = 0;
    int num_splits = 1;
    int chunks_per_cta = 1;
    int64_t ws_floats = 0; // split-KV workspace
    int64_t out_stride = 0;
    // Tensor parallel: all-reduces take the custom kernel; verify rows need the
    // whole logits (top-k / top-p) rather than per-rank candidates.
    bool custom_allreduce = false;
    bool gather_logits = false;
    // Some query sees keys through a tree mask (else every query is a chain).
    bool tree_masks = false;
    std::vector<int64_t> item_row_begin; // first logit row of each item
    size_t o_tokens = 0, o_positions = 0, o_query_seq = 0, o_kv_end = 0,
           o_mask_begin = 0, o_mask = 0, o_slots = 0, o_tables = 0, o_rows = 0,
           o_tile_begin = 0, o_tile_end = 0, o_kv_stable = 0;
    size_t o_row_params = 0, o_sample_offset = 0, o_node_offset = 0,
           o_num_nodes = 0, o_tree_tokens = 0, o_tree_parents = 0,
           o_seq_rows = 0, o_base_slot = 0, o_sampled = 0, o_out = 0;
  };
  struct GraphEntry {
    cudaGraphExec_t exec = nullptr;
    int uses = 0;
    bool failed = false;
  };

  CudaBackend(ModelConfig config, int device, const BackendOptions &options,
              const CudaTpRank *tp, const CudaTuning &tuning);
  absl::Status Init();
  // One checkpoint tensor, or this rank's rows or columns of it (`shape` is
  // the full shape, checked).
  struct WeightPart {
    std::string name;
    std::vector<int64_t> shape;
    ShardSlice slice = ShardSlice::kAll;
    TpRange range;
  };
  // Uploads the parts one after another into one bf16 device allocation (the
  // fused q/k/v and gate/up weights).
  absl::Status UploadWeights(const TensorStore &st,
                             const std::vector<WeightPart> &parts, bf16 **out);
  // Uploads a whole 1-D tensor (a norm weight, replicated on every rank) as
  // fp32, whatever its checkpoint dtype.
  absl::Status UploadFp32(const TensorStore &st, const std::string &name,
                          int64_t size, float **out);
  absl::Status Ensure(Scratch *s, size_t bytes);
  absl::StatusOr<Batch> Validate(absl::Span<const ForwardItem> items);
  // Picks the step's bucket when graphs are on and the step fits one; false:
  // run unpadded.
  bool ChooseBuckets(const std::vector<int64_t> &item_tokens, Step *step) const;
  // Appends the batch to the scratch regions and lays out the forward pass's
  // metadata.
  absl::Status LayoutForward(absl::Span<const ForwardItem> items,
                             const Batch &batch, Step *step, Packer *pack);
  absl::Status PrepareBuffers(const Step &step, size_t meta_bytes);
  absl::Status UploadMeta(const Packer &pack);
  // Enqueues the model (and for a verify step sampling, acceptance and
  // compaction); leaves [step.R, vocab] fp32 logits in logits_.
  absl::Status Enqueue(const Step &step);
  absl::Status Execute(const Step &step);
  void ClearGraphs();
  void ReleaseBlocks(Sequence *s, int64_t keep_blocks);
  int64_t PhysicalSlot(const Sequence &s, int64_t logical) const;
  absl::Status Gemm(const bf16 *x, const bf16 *w, const bf16 *bias, void *y,
                    bool y_fp32, int64_t m, int64_t n, int64_t k,
                    int k_splits = 1);
  // The K split of the GEMM whose output reaches the residual stream at `site`
  // (o_proj, down_proj): residual_splits_ where Gemm::KSplitFits its depth,
  // else 1 (and 1 for the embedding, which has no GEMM).
  int SiteSplits(int site) const;
  // Lays out a validated batch's forward pass and uploads its metadata;
  // Execute(*step) then leaves [step.R, vocab rows] fp32 logits in logits_.
  absl::Status PrepareForward(absl::Span<const ForwardItem> items,
                              const Batch &batch, Step *step);
  // Forward() into host rows of stride vocab_size, this rank's columns.
  absl::Status ForwardToHost(absl::Span<const ForwardItem> items, float *logits);
  // Where a row-parallel GEMM writes its [T, hidden] partial sums for the
  // all-reduce at `site` (x_ without tensor parallelism).
  bf16 *Partial(const Step &step, int site);
  // Sums the partials of `site` over the ranks into the residual stream
  // (starting it when `init`) and writes RMSNorm(residual) * weight to normed_.
  // Where SiteSplits(site) > 1 (one rank only), the sublayer's output is the
  // fp32 slabs of its K-split GEMM in split_, added up by the norm. `dead`:
  // [T, row_bytes] buffers that nothing reads again (the GEMMs' inputs before
  // it), which the norm drops from L2 when l2_discard_ (as it does the slabs).
  absl::Status ReduceNorm(const Step &step, int site, bool init,
                          const float *weight,
                          cuda::DeadRows dead0 = {},
                          cuda::DeadRows dead1 = {});
  // Verify() of items that VerifiesOnDevice(): sampling, acceptance and KV
  // compaction on the device.
  absl::StatusOr<std::vector<VerifyOutcome>>
  VerifyOnDevice(absl::Span<const VerifyItem> items);
  // Turns the [R, local vocab] logits into sampled tokens (verify steps).
  absl::Status SampleRows(const Step &step, int32_t *tokens);

  ModelConfig config_;
  int device_ = 0;
  BackendOptions options_;
  // The switches of docs/tuning.md, parsed once before this backend was made.
  CudaTuning tuning_;
  // This rank's part of the model (all of it without tensor parallelism) and
  // its sizes: query heads, KV heads, FFN columns, vocabulary rows.
  CudaTpRank tp_;
  int world_ = 1;
  // A sublayer's output GEMM (o_proj, down_proj) cut into this many K ranges
  // whose fp32 slabs the following RMSNorm adds: split-K without cuBLASLt's
  // separate reduction kernel. 1 under tensor parallelism (the all-reduce
  // takes bf16 partials) or with SPECD_RESIDUAL_SPLITS=1.
  int residual_splits_ = 1;
  // Whether the kernels drop a layer's dead intermediates (the attention
  // workspace, the gate_up and K-split outputs, the GEMM inputs) from L2
  // without write-back (cuda::DeadRows); SPECD_L2_DISCARD=0 turns it off.
  bool l2_discard_ = true;
  // The fewest tokens of a step whose kernels drop (SPECD_L2_DISCARD_MIN_TOKENS
  // overrides it; 1 drops on every step, as tests do to exercise the drops). A
  // drop costs an L2 round trip in the kernel that issues it, while a few
  // rows' intermediates cost little write-back: the measured break-even lies
  // between decode (1 token: drops cost ~1 us a layer) and a 64-node verify
  // (65 tokens: the GEMMs 3.6 us a layer faster), bench/history/.
  int64_t l2_discard_min_tokens_ = 16;
  // l2_discard_, for a step of step.T tokens.
  bool DropDead(const Step &step) const;
  TpRankPlan slice_;
  int64_t heads_ = 0, kv_heads_ = 0, ffn_ = 0, vocab_rows_ = 0;
  int64_t vocab_rows_max_ = 0;  // the largest rank's vocabulary rows
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<cuda::Gemm> gemm_;
  int num_sms_ = 0;
  std::vector<void *> allocations_; // weights and pools, freed at destruction
  // Weights placed so far on this device; only while Init() runs.
  std::unique_ptr<LoadProgress> load_progress_;

  float *inv_freq_ = nullptr; // [head_dim / 2] fp32
  bf16 *embed_ = nullptr;     // [vocab, hidden]
  float *final_norm_ = nullptr;
  bf16 *lm_head_ = nullptr; // embed_ when tied
  std::vector<LayerWeights> layers_;

  int64_t kv_dim_ = 0;
  int64_t num_blocks_ = 0;
  int64_t layer_stride_ = 0; // elements between layers in the pools
  bf16 *k_pool_ = nullptr;
  bf16 *v_pool_ = nullptr;
  std::vector<int32_t> free_blocks_;
  absl::flat_hash_map<SeqId, Sequence> seqs_;

  // Per-call device buffers.
  Scratch meta_;     // step metadata, uploaded in one copy
  Scratch residual_; // [T, hidden] fp32
  Scratch x_;        // [T, hidden] bf16: embedding, then each sublayer's output
  // [residual_splits_, T, hidden] fp32: the K ranges' slabs of a sublayer's
  // output GEMM, which the next RMSNorm adds (one rank only).
  Scratch split_;
  Scratch normed_;   // [T, hidden] bf16
  Scratch qkv_;      // [T, q_dim + 2 kv_dim] bf16
  Scratch attn_;     // [T, q_dim] bf16
  Scratch gate_up_;  // [T, 2 intermediate] bf16
  Scratch act_;      // [T, intermediate] bf16
  Scratch last_;     // [R, hidden] bf16
  Scratch logits_;   // [R, vocab] fp32
  Scratch attn_ws_;  // split-KV workspace
  Scratch sample_ws_;  // split-vocabulary sampling workspace (SampleWorkspaceBytes)
  Scratch verify_;   // sampling and acceptance outputs
  // ForwardTopK(): row index, ids, log-probabilities; Verify() logprobs: the
  // same, then the sampled tokens' log-probabilities and ranks.
  Scratch topk_;
  // Tensor parallel verify: this rank's candidates [R] and everyone's
  // [world, R] (cuda::SampleCandidate); or everyone's logits [world, R,
  // vocab_rows_max_] fp32 and the whole rows [R, vocab] fp32.
  Scratch cand_local_, cand_all_, gathered_, full_logits_;

  // CUDA graphs, keyed by everything their launches take by value. Graphs point
  // into the buffers above; buffer_generation_ counts their reallocations, and
  // graphs captured under an older generation are dropped.
  bool graphs_enabled_ = false;
  uint64_t buffer_generation_ = 0;
  uint64_t graphs_generation_ = 0;
  absl::flat_hash_map<std::vector<int64_t>, GraphEntry> graphs_;
  int64_t graphs_captured_ = 0;
  int64_t graph_launches_ = 0;
  int64_t eager_steps_ = 0;
  // Pinned host memory: the step's metadata on its way up, the verify outcomes
  // on their way down.
  void *host_stage_ = nullptr;
  size_t host_stage_bytes_ = 0;
  int32_t *host_out_ = nullptr;
  size_t host_out_count_ = 0;
  // SetPhaseTiming: events around a verify step's device work (created on first
  // use) and the last step's phases.
  bool phase_timing_ = false;
  cudaEvent_t phase_events_[2] = {nullptr, nullptr};
  VerifyPhases last_phases_;

public:
  void SetPhaseTiming(bool on) { phase_timing_ = on; }
  const VerifyPhases &last_verify_phases() const { return last_phases_; }

  // Graph statistics, for tests and benchmarks: graphs captured and graph
  // launches so far.
  int64_t graphs_captured() const { return graphs_captured_; }
  int64_t graph_launches() const { return graph_launches_; }
  bool graphs_enabled() const { return graphs_enabled_; }
  bool pads_rows() const override { return graphs_enabled_; }
  ExecutionCounts execution_counts() const override {
    return {graphs_captured_, graph_launches_, eager_steps_};
  }
  // Turns graphs on or off from the next step on (the A/B benchmark); captured
  // graphs are kept.
  void SetGraphsEnabled(bool on) { graphs_enabled_ = on; }
  // Weight shapes whose GEMMs are not row-invariant
  // (BackendOptions::cuda_gemm_invariant_rows).
  int non_invariant_gemm_shapes() const {
    return gemm_->non_invariant_shapes();
  }
  // GEMM row classes whose algorithm has been decided (engine/warmup.h): after a warm-up, a
  // step whose row counts fall in decided classes adds none.
  int gemm_classes_decided() const {
    return gemm_->own_algorithm_classes() + gemm_->base_algorithm_classes();
  }
};

} // namespace specd

#endif // SPECD_ENGINE_CUDA_CUDA_BACKEND_H_
