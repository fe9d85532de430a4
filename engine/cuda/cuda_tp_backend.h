// Tensor-parallel CUDA backend: the model sharded over N GPUs of one process, any N >= 1
// (docs/architecture.md: the reference deployment verifies on 7). One worker thread a GPU
// (RankWorkers), each driving one CudaBackend rank that holds its slice of the weights and KV cache
// (engine/tp/tp_plan.h); the ranks all-reduce through the custom one-shot kernel over NVLink peer
// memory (engine/cuda/custom_allreduce.h) and NCCL (engine/cuda/nccl_group.h).
//
// The sequence bookkeeping (block tables, scratch trees, validation) is the same for every rank,
// so it lives once, here, in a PagedKvTable (engine/kv/paged_kv_table.h) sized to the smallest
// rank's pools: each step is validated and laid out once and the layout handed to every rank.
// The ranks run SPMD on it and reach identical sampling and acceptance decisions (all-reduce and
// candidate reduction give every rank the same bits), so no rank waits on a coordinator inside
// a step and a verify step still needs one host round trip. Results come from rank 0.
//
// Not thread-safe: one thread drives a backend.
#ifndef SPECD_ENGINE_CUDA_CUDA_TP_BACKEND_H_
#define SPECD_ENGINE_CUDA_CUDA_TP_BACKEND_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/kv/paged_kv_table.h"
#include "engine/tp/rank_workers.h"
#include "engine/tp/tp_plan.h"

namespace specd {

struct CudaTpOptions {
  // devices[r]: rank r's CUDA device; distinct devices (NCCL cannot put two ranks on one GPU).
  std::vector<int> devices;
  // Steps whose all-reduce message ([tokens, hidden] bf16) is at most this many bytes use the
  // custom all-reduce; the rest use NCCL. -1: as large as the biggest CUDA-graph bucket, so
  // every decode and verify step takes the same (row-invariant) all-reduce. 0: NCCL only.
  int64_t custom_allreduce_max_bytes = -1;
};

class CudaTensorParallelBackend : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<CudaTensorParallelBackend>> Create(
      const std::string& dir, const BackendOptions& options, const CudaTpOptions& tp);
  ~CudaTensorParallelBackend() override;

  const ModelConfig& config() const override { return ranks_[0]->config(); }
  const TpPlan& plan() const { return plan_; }
  bool custom_allreduce() const { return custom_ != nullptr; }
  // CudaBackend::SetGraphsEnabled on every rank (benchmarks' A/B).
  void SetGraphsEnabled(bool on) {
    for (auto& rank : ranks_) rank->SetGraphsEnabled(on);
  }
  absl::Status AddSequence(SeqId seq) override;
  absl::Status RemoveSequence(SeqId seq) override;
  bool HasSequence(SeqId seq) const override { return table_->HasSequence(seq); }
  absl::StatusOr<int64_t> CommittedLength(SeqId seq) const override {
    return table_->CommittedLength(seq);
  }
  absl::Status Forward(absl::Span<const ForwardItem> items, std::vector<float>* logits) override;
  // The ranks all-gather their vocabulary slices on the device and rank 0 ranks the whole rows
  // (CudaBackend::ForwardTopKLaidOut), so only [rows, k] reach the host.
  absl::Status ForwardTopK(absl::Span<const ForwardItem> items, int k, TopKRows* out) override;
  // The residual stream is whole on every rank after the all-reduce, so rank 0 alone copies it
  // (CudaBackend::ForwardWithTaps' copies) while every rank writes its logit columns.
  absl::Status ForwardWithTaps(absl::Span<const ForwardItem> items,
                               absl::Span<const int> tap_layers, std::vector<float>* logits,
                               std::vector<float>* taps) override;
  absl::Status Commit(SeqId seq, absl::Span<const int32_t> path) override;
  KvUsage Usage() const override { return table_->Usage(); }
  bool pads_rows() const override { return ranks_[0]->pads_rows(); }
  ExecutionCounts execution_counts() const override { return ranks_[0]->execution_counts(); }
  absl::StatusOr<std::vector<VerifyOutcome>> Verify(absl::Span<const VerifyItem> items) override;
  // Rank 0 exports the taps, the final norm's output included (whole on every rank), and holds
  // those of items with hold_tap_rows on its device.
  VerifyFeatures verify_features() const override {
    return {/*logits_processors=*/true, /*logprobs=*/true, /*taps=*/true,
            /*final_norm_tap=*/true, /*held_taps=*/true};
  }
  absl::StatusOr<HeldTapRows> TakeHeldTaps(SeqId seq) override {
    return ranks_[0]->TakeHeldTaps(seq);
  }

 private:
  CudaTensorParallelBackend(TpPlan plan, int world);
  // Verify() on every rank in lockstep (CudaBackend::RunVerify).
  absl::StatusOr<std::vector<VerifyOutcome>> VerifyOnRanks(absl::Span<const VerifyItem> items);

  TpPlan plan_;
  // Declaration order is destruction order reversed: the rank threads stop first, then the
  // ranks go, then the communicators they used.
  std::unique_ptr<NcclGroup> nccl_;
  std::unique_ptr<CustomAllReduceGroup> custom_;
  std::vector<CudaTpRank> rank_info_;
  std::vector<std::unique_ptr<CudaBackend>> ranks_;
  RankWorkers workers_;
  // Every rank's sequences (CudaBackend::MakeKvTable).
  std::unique_ptr<PagedKvTable> table_;
};

}  // namespace specd

#endif  // SPECD_ENGINE_CUDA_CUDA_TP_BACKEND_H_
