// The thread that owns the draft model in specd-draft. It takes batched steps from the Step
// streams (StepQueue), grows one token tree per sequence with the drafter each sequence asks
// for (the standalone draft model or n-gram prompt lookup), batching all waiting streams into
// one Draft() call per drafter, and replies per stream.
//
// Per-sequence state. The loop keeps every sequence's token history, so a sequence may switch
// method between steps: a drafter that has not seen some of the history is fed it first (the
// catch-up rule of engine/draft/drafter.h). A step's accepted_node (the outcome of the tree
// returned last step) goes to the model drafter, which then commits the KV it kept for that
// path instead of feeding those tokens again (engine/draft/draft_model_drafter.h).
//
// Errors are per sequence (SequenceError) and leave the others served:
//   INVALID_ARGUMENT, FAILED_PRECONDITION (no draft model loaded): nothing changes; the step's
//     new_tokens are not recorded, so the router resends them or releases the sequence.
//   DEADLINE_EXCEEDED: the sequence is freed; later steps for it get DEADLINE_EXCEEDED until
//     the router releases the id.
//   RESOURCE_EXHAUSTED (max_sequences, KV cache) and drafting failures: new_tokens are recorded
//     (the router need not resend them) but no tree is proposed; a new sequence is not kept.
// A sequence whose prefix no longer fits the draft model's context gets an empty tree.
//
// Pre-draft steps (pre_draft, the router's overlap) run after the batch's draft steps: the
// model drafter guesses the outcome of the tree it returned last for the sequence and grows the
// next tree below the guess (DraftModelDrafter::PreDraft). Their new_tokens count as fed only
// as far as the drafter took them (a confirmed guess); the rest waits for the next draft step.
#ifndef SPECD_SERVICES_DRAFT_DRAFT_LOOP_H_
#define SPECD_SERVICES_DRAFT_DRAFT_LOOP_H_

#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "common/service/metrics.h"
#include "common/service/step_loop.h"
#include "common/service/step_stream.h"
#include "engine/backend.h"
#include "engine/draft/draft_model_drafter.h"
#include "engine/draft/eagle_drafter.h"
#include "engine/draft/eagle_head.h"
#include "engine/draft/ngram_drafter.h"
#include "specd/v1/draft.pb.h"

namespace specd {

using DraftStepQueue = StepQueue<v1::DraftStepRequest, v1::DraftStepResponse>;

struct DraftLoopOptions {
  // Hugging Face folder of the draft model; empty serves n-gram drafting only, which then
  // needs vocab_size.
  std::string model_dir;
  int vocab_size = 0;      // without a model: the target's vocabulary size
  BackendOptions backend;  // device, KV capacity, threads (draft model only)
  NgramOptions ngram;
  // EAGLE head folder (docs/eagle.md) and its target's folder (the head reads the target's
  // embedding); empty: no EAGLE drafting. The head's KV capacity and threads come from
  // `backend`.
  std::string eagle_head_dir;
  std::string eagle_target_dir;
  // Tree shape for fields a step leaves 0.
  DraftParams defaults;
  // The draft-model drafter's switches (device top-k, kept KV; the same trees either way).
  // max_forward_rows is set from backend.cuda_gemm_invariant_rows when that is > 0.
  DraftModelDrafterOptions drafter;
  int max_sequences = 256;  // live sequences over all streams; more get RESOURCE_EXHAUSTED
  // Tokens one sequence's history may reach; a step that would exceed it is INVALID_ARGUMENT.
  // The default is above the longest context of the families served (Qwen2.5-1M: 1010000).
  int64_t max_history_tokens = int64_t{1} << 20;
  // Once one stream's step is queued, how long the loop may wait for the steps of the other
  // active streams (other routers) so that they draft in one batch: at most the recent step
  // time, never when one stream alone is active (StepQueue::Pop). Zero: never wait.
  absl::Duration max_gather = absl::Milliseconds(2);
  // Tests only: every step message with pre-drafts is answered this much later (a draft device
  // slower than the verify step, to exercise the router's bound on waiting for one).
  absl::Duration test_only_pre_draft_delay = absl::ZeroDuration();
};

class DraftLoop final
    : public StepLoop<v1::DraftStepRequest, v1::DraftStepResponse, v1::DraftInfo> {
 public:
  // Loads the draft model if any (errors name the folder and what is wrong) and starts the
  // loop thread, from then on the only user of the model and drafters. `queue` and `metrics`
  // must outlive the loop.
  static absl::StatusOr<std::unique_ptr<DraftLoop>> Create(const DraftLoopOptions& options,
                                                           DraftStepQueue* queue,
                                                           ModelServiceMetrics* metrics);
  ~DraftLoop() override;

 private:
  static constexpr int kModel = 0;  // index of the draft-model drafter (DRAFT_METHOD_MODEL)
  static constexpr int kNgram = 1;  // DRAFT_METHOD_NGRAM
  static constexpr int kEagle = 2;  // DRAFT_METHOD_EAGLE
  static constexpr int kDrafters = 3;
  static constexpr uint32_t kMaxPreDraftFanOut = 8;  // DraftSequenceStep.fan_out
  static constexpr int kMaxChainRates = 64;          // DraftSequenceStep.chain_rates

  struct Sequence {
    std::vector<int32_t> history;         // every token the router sent, in order
    std::array<size_t, kDrafters> fed{};  // history prefix each drafter has consumed
    std::array<bool, kDrafters> added{};
  };

  // One sequence of one step on its way through a batch.
  struct Slot {
    size_t step = 0;  // index into the batch's steps
    int result = 0;   // index into that step's response results
    int64_t seq = 0;  // model-side id
    int drafter = kModel;
    bool created = false;  // the sequence was registered in this batch
    int appended = 0;      // pre-draft: new tokens added to the history
    DraftRequest request;
  };

  DraftLoop(const DraftLoopOptions& options, std::unique_ptr<Backend> model,
            std::unique_ptr<DraftModelDrafter> model_drafter, std::unique_ptr<NgramDrafter> ngram,
            std::unique_ptr<EagleHead> eagle_head, DraftStepQueue* queue,
            ModelServiceMetrics* metrics);

  std::vector<v1::DraftStepResponse> RunSteps(const DraftStepQueue::Batch& batch) override;
  void FreeModelState(int64_t seq) override;
  double KvCacheUsageRatio() override;
  std::string CapacitySummary() const override { return capacity_summary_; }
  absl::Status Admit(StreamId stream, int index, const v1::DraftSequenceStep& step,
                     int64_t* kv_budget, Slot* slot, bool* empty_tree);
  // A pre_draft step: the sequence must be live and drafted by the model; never creates one.
  absl::Status AdmitPreDraft(StreamId stream, int index, const v1::DraftSequenceStep& step,
                             int64_t* kv_budget, Slot* slot, bool* empty_tree);
  // Ingest-only steps: the model drafter's Ingest() over `group`, one by one on a failure.
  void RunIngests(const DraftStepQueue::Batch& batch, const std::vector<Slot>& group,
                  std::vector<v1::DraftStepResponse>* responses);
  void RunPreDrafts(const std::vector<Slot>& group, std::vector<v1::DraftStepResponse>* responses);
  void Drop(StreamId stream, uint64_t seq_id, const Slot& slot);
  Drafter* drafter(int index) {
    if (index == kModel) return model_drafter_.get();
    if (index == kEagle) return eagle_drafter_.get();
    return ngram_.get();
  }

  DraftLoopOptions options_;
  std::string capacity_summary_;    // fixed at load
  std::unique_ptr<Backend> model_;  // null without a draft model
  std::unique_ptr<DraftModelDrafter> model_drafter_;
  std::unique_ptr<NgramDrafter> ngram_;
  std::unique_ptr<EagleHead> eagle_head_;  // null without --eagle_head
  std::unique_ptr<EagleDrafter> eagle_drafter_;
  absl::flat_hash_map<int64_t, Sequence> sequences_;
};

}  // namespace specd

#endif  // SPECD_SERVICES_DRAFT_DRAFT_LOOP_H_
