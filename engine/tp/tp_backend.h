// Tensor parallelism inside one process (docs/architecture.md: one process, one worker thread per
// GPU): a Backend whose model is sharded over N ranks by a TpPlan (engine/tp/tp_plan.h). Each rank
// has its own worker thread and a TpRankExecutor that owns the rank's weight shards and its KV
// pools (its KV heads only); all ranks run the same step in lockstep and exchange partial sums
// through a TpCommunicator. The sequence bookkeeping (block tables, scratch trees, validation) is
// the same for every rank, so it lives once, here, in a PagedKvTable.
//
// The structure is device-independent: the CPU executor (engine/tp/tp_cpu_backend.h) simulates
// ranks with threads and an in-process all-reduce; a CUDA executor plugs in the same way with
// an NCCL / custom all-reduce communicator per rank thread.
//
// Not thread-safe: one thread drives the backend; the rank threads are internal.
#ifndef SPECD_ENGINE_TP_TP_BACKEND_H_
#define SPECD_ENGINE_TP_TP_BACKEND_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/backend.h"
#include "engine/kv/paged_kv_table.h"
#include "engine/model_config.h"
#include "engine/tp/rank_workers.h"
#include "engine/tp/tp_plan.h"

namespace specd {

// One rank's end of the collectives. Every rank calls the same collectives in the same order.
class TpCommunicator {
 public:
  virtual ~TpCommunicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // data: [n] fp32, host (on the CPU); replaced by the element-wise sum over all ranks. Every
  // rank receives the same bits (the CPU version sums in rank order, so results are also
  // reproducible from run to run).
  virtual void AllReduceSum(float* data, int64_t n) = 0;
};

// The communicators of all ranks of one group, created before the rank threads start (an NCCL
// group creates one communicator per device; the in-process group below shares memory).
class TpCommGroup {
 public:
  virtual ~TpCommGroup() = default;
  virtual TpCommunicator* rank(int r) = 0;
};

// All ranks' communicators of one in-process group: a sleeping barrier and the ranks' buffer
// pointers. AllReduceSum is a reduce-scatter then all-gather through shared memory: rank r sums
// its share of the elements over ranks 0, 1, ..., N-1 in that order into a shared result, and
// every rank copies the result back.
class InProcessCommGroup : public TpCommGroup {
 public:
  explicit InProcessCommGroup(int world_size);
  ~InProcessCommGroup() override;
  TpCommunicator* rank(int r) override;

 private:
  class Rank;
  friend class Rank;
  // Returns when all ranks have called it; the last to arrive first grows result_ to at least
  // `result_size` elements.
  void Barrier(int64_t result_size = 0);

  const int world_size_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::vector<float*> buffers_;
  std::vector<float> result_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

// The per-rank half of a tensor-parallel backend. Every method runs on the rank's own thread.
// Collectives must be reached by all ranks: an executor that can fail must do so before its
// first collective of a step (the CPU executor cannot fail after loading).
class TpRankExecutor {
 public:
  virtual ~TpRankExecutor() = default;
  // Reads this rank's shards (and nothing else) from the checkpoint.
  virtual absl::Status Load() = 0;
  // Makes the KV pools hold physical blocks [0, blocks) (kept contents; only grows).
  virtual void ReserveKvBlocks(int64_t blocks) = 0;
  // One forward step over `layout`, R = layout.logit_tokens.size() requested rows. With
  // `out.logits`, writes this rank's vocabulary columns of it (other ranks write the other
  // columns concurrently: the CPU gathers the LM-head shards in place). With `out.candidates`,
  // reduces each row of its shard to one VocabCandidate instead (engine/tp/tp_plan.h), so the
  // token choice never needs the full logits.
  struct Output {
    float* logits = nullptr;  // [R, vocab_size] fp32, host, or null
    // Per row: how to choose (VocabParallelSamplingSupported) and the absolute position.
    const SamplingParams* const* row_sampling = nullptr;  // [R], or null
    const int64_t* row_position = nullptr;                // [R], or null
    VocabCandidate* candidates = nullptr;  // [R, world_size]: this rank writes column rank
    // Residual-stream taps (Backend::ForwardWithTaps): the stream is whole on every rank after
    // the all-reduces, so rank 0 alone copies it into `taps` ([T, tap_layers.size() * H] fp32,
    // host); null: none.
    absl::Span<const int> tap_layers;
    std::vector<float>* taps = nullptr;
  };
  virtual absl::Status Forward(const StepLayout& layout, TpCommunicator* comm,
                               const Output& out) = 0;
  // Copies KV slot src[i] to dst[i] in order, in every layer.
  virtual void CopyKvSlots(absl::Span<const int64_t> src, absl::Span<const int64_t> dst) = 0;
  // One emitted row of the last Forward() that asks for log-probabilities.
  struct LogprobQuery {
    int64_t row = 0;             // in [0, R) of the last Forward()'s layout
    double scale = 1.0;          // LogprobScale()
    float emitted_logit = 0.0f;  // the raw logit of the row's emitted token
    int top_n = 0;               // [0, kMaxLogprobs]
  };
  // out[q] = ComputeShardLogprobStats() of this rank's vocabulary columns of row queries[q] of
  // the last Forward()'s logits, computed where that shard lives so that only O(top_n) numbers
  // per row leave the rank. `out` has queries.size() entries.
  virtual void ShardLogprobs(absl::Span<const LogprobQuery> queries,
                             absl::Span<ShardLogprobStats> out) = 0;
};

class TensorParallelBackend : public Backend {
 public:
  // Creates the rank threads, gives executor r and communicator r to rank r, and loads every
  // rank in parallel. `executors` and `comm` have plan.world_size ranks. Executors do any
  // per-thread setup (binding a device) in Load().
  static absl::StatusOr<std::unique_ptr<TensorParallelBackend>> Create(
      ModelConfig config, TpPlan plan, std::vector<std::unique_ptr<TpRankExecutor>> executors,
      std::unique_ptr<TpCommGroup> comm, int64_t kv_block_tokens, int64_t kv_capacity_tokens);
  ~TensorParallelBackend() override;

  const ModelConfig& config() const override { return config_; }
  const TpPlan& plan() const { return plan_; }
  absl::Status AddSequence(SeqId seq) override { return table_.AddSequence(seq); }
  absl::Status RemoveSequence(SeqId seq) override { return table_.RemoveSequence(seq); }
  bool HasSequence(SeqId seq) const override { return table_.HasSequence(seq); }
  absl::StatusOr<int64_t> CommittedLength(SeqId seq) const override {
    return table_.CommittedLength(seq);
  }
  absl::Status Forward(absl::Span<const ForwardItem> items, std::vector<float>* logits) override;
  absl::Status ForwardWithTaps(absl::Span<const ForwardItem> items,
                               absl::Span<const int> tap_layers, std::vector<float>* logits,
                               std::vector<float>* taps) override;
  // Forward() into a buffer the backend keeps, then each row's top-k (RowTopKLogprobs) on the
  // rank threads, rows dealt out round robin: the same bits as Forward() and a host top-k,
  // without the [rows, vocab] copy to the caller.
  absl::Status ForwardTopK(absl::Span<const ForwardItem> items, int k, TopKRows* out) override;
  absl::Status Commit(SeqId seq, absl::Span<const int32_t> path) override;
  KvUsage Usage() const override { return table_.Usage(); }
  // When every item's sampling is VocabParallelSamplingSupported (greedy, or temperature
  // without filters or processors) and none asks for taps, tokens are chosen from per-rank
  // candidates without gathering the logits, as a GPU group does, and log-probabilities are
  // merged from per-rank statistics (log-sum-exp and top-n per vocabulary slice, computed on
  // the rank threads); otherwise Backend::Verify on gathered logits. Same tokens; the same
  // log-probabilities up to double rounding of the merged sum.
  absl::StatusOr<std::vector<VerifyOutcome>> Verify(absl::Span<const VerifyItem> items) override;
  VerifyFeatures verify_features() const override { return {true, true, true, true}; }

  absl::StatusOr<int64_t> ScratchLength(SeqId seq) const { return table_.ScratchLength(seq); }
  // Verify() calls served from gathered logits (Backend::Verify) rather than from per-rank
  // candidates and statistics: what tests check to know which path a batch took.
  int64_t gathered_verify_calls() const { return gathered_verify_calls_; }

 private:
  TensorParallelBackend(ModelConfig config, TpPlan plan,
                        std::vector<std::unique_ptr<TpRankExecutor>> executors,
                        std::unique_ptr<TpCommGroup> comm, int64_t kv_block_tokens,
                        int64_t kv_capacity_tokens);
  // One forward step on every rank (growing the KV pools first when the table grew).
  absl::Status RunStep(const StepLayout& layout, const TpRankExecutor::Output& out);
  // Runs fn(rank) on every rank thread and waits; the first failing rank's status wins.
  absl::Status RunOnRanks(const std::function<absl::Status(int)>& fn);

  ModelConfig config_;
  TpPlan plan_;
  std::vector<std::unique_ptr<TpRankExecutor>> executors_;
  std::unique_ptr<TpCommGroup> comm_;
  PagedKvTable table_;
  int64_t reserved_blocks_ = 0;
  int64_t gathered_verify_calls_ = 0;
  std::vector<float> topk_logits_;  // ForwardTopK()'s [rows, vocab] logits, host
  // Declared last: its threads stop (in its destructor) before the executors they use go.
  RankWorkers workers_;
};

}  // namespace specd

#endif  // SPECD_ENGINE_TP_TP_BACKEND_H_
