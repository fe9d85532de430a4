// The thread that owns the target model in specd-verify. It takes batched steps from the Step
// streams (StepQueue), merges the steps of all streams that are waiting into one
// Backend::Verify call, and replies per stream. Every per-sequence problem (bad token ids, an
// invalid tree, no KV left, a passed deadline) becomes that sequence's SequenceError; the other
// sequences of the batch are served. For requests with penalties or min_tokens it keeps each
// sequence's token history (engine/sampling.h), from its first step to its release.
#ifndef SPECD_SERVICES_VERIFY_VERIFY_LOOP_H_
#define SPECD_SERVICES_VERIFY_VERIFY_LOOP_H_

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "common/service/metrics.h"
#include "common/service/step_loop.h"
#include "common/service/step_stream.h"
#include "engine/backend.h"
#include "specd/v1/verify.pb.h"

namespace specd {

using VerifyStepQueue = StepQueue<v1::VerifyStepRequest, v1::VerifyStepResponse>;

struct VerifyLoopOptions {
  std::string model_dir;    // Hugging Face folder of the target model
  BackendOptions backend;   // device, tensor-parallel degree, KV capacity, threads
  int max_sequences = 256;  // live sequences over all streams; more get RESOURCE_EXHAUSTED
  // Bytes of taps one reply carries over its sequences; 0: half the services' message limit
  // (kMaxMessageBytes). A sequence's rows past it are held and sent, in order, ahead of its
  // taps in its next replies.
  int64_t max_tap_bytes_per_reply = 0;
  // Bytes of taps (fp32 rows) the service holds per sequence for steps with hold_taps (plain
  // steps of an EAGLE sequence): in the backend where it keeps them (VerifyFeatures::held_taps,
  // a CUDA backend's device, up to its own budget for all sequences), else in host memory. Past
  // it the older half is dropped: the drafter then gets rows that start after a gap and its
  // head restarts from them (docs/eagle.md).
  int64_t max_held_tap_bytes = int64_t{16} << 20;
  // Once one stream's step is queued, how long the loop may wait for the steps of the other
  // active streams (other routers) so that they verify in one batch: at most the recent step
  // time, never when one stream alone is active (StepQueue::Pop). Zero: never wait.
  absl::Duration max_gather = absl::Milliseconds(2);
};

class VerifyLoop final
    : public StepLoop<v1::VerifyStepRequest, v1::VerifyStepResponse, v1::VerifyInfo> {
 public:
  // Loads the model (errors name the folder and what is wrong with it) and starts the loop
  // thread, which from then on is the only user of the model. `queue` and `metrics` must
  // outlive the loop.
  static absl::StatusOr<std::unique_ptr<VerifyLoop>> Create(const VerifyLoopOptions& options,
                                                            VerifyStepQueue* queue,
                                                            ModelServiceMetrics* metrics);
  ~VerifyLoop() override;

  std::string CapacitySummary() const override { return capacity_summary_; }

 private:
  // One sequence of one step on its way through a batch.
  struct Slot {
    size_t step = 0;                                    // index into the batch's steps
    int result = 0;                                     // index into that step's response results
    int64_t seq = 0;                                    // model-side id
    bool created = false;                               // AddSequence ran in this batch
    v1::TensorDtype tap_dtype = v1::TENSOR_DTYPE_BF16;  // of the taps it asked for, if any
    bool hold_taps = false;  // keep its taps in tap_backlog_ (VerifySequenceStep.hold_taps)
  };

  std::vector<v1::VerifyStepResponse> RunSteps(const VerifyStepQueue::Batch& batch) override;
  void FreeModelState(int64_t seq) override;
  double KvCacheUsageRatio() override;
  // Validates one sequence's step and registers it; returns the error to report, or OK with
  // `*item` filled and `slot->seq` set.
  absl::Status Admit(StreamId stream, int index, const v1::VerifySequenceStep& step,
                     int64_t* kv_budget, VerifyItem* item, Slot* slot);

  VerifyLoop(std::unique_ptr<Backend> backend, VerifyStepQueue* queue,
             const VerifyLoopOptions& options, ModelServiceMetrics* metrics);

  // Frees the model state and the history of a sequence the table no longer holds.
  void Forget(int64_t seq);
  // Puts the taps of a sequence's step (`taps`: [rows, layers x hidden] fp32, committed rows
  // from first_position on) behind the rows it still holds for it. Unless `hold`, then sends
  // them (SendHeld); with `hold` they stay, up to max_held_tap_bytes.
  void SendTaps(int64_t seq, const std::vector<int>& layers, v1::TensorDtype dtype,
                const std::vector<float>& taps, int64_t first_position, bool hold,
                int64_t* reply_bytes, v1::HiddenStates* out);
  // Writes to `out` as many of the rows held for `seq`, oldest first, as `*reply_bytes` leaves
  // room for under the reply's budget (adding them to it); the rest wait for its next reply.
  void SendHeld(int64_t seq, int64_t* reply_bytes, v1::HiddenStates* out);
  // The most rows of `layers` taps a sequence holds (max_held_tap_bytes of fp32 rows).
  int64_t MaxHeldRows(size_t layers) const;
  // Moves the rows the backend holds for `seq` (device_held_) into tap_backlog_, ahead of
  // anything sent after: called before a sequence's taps are sent or dropped.
  void TakeBackendHeld(int64_t seq);

  std::unique_ptr<Backend> backend_;
  VerifyLoopOptions options_;
  // Per model-side sequence id, for sequences whose first step had penalties or min_tokens:
  // prompt and output as the processors see them (VerifyItem::history points here; a node map,
  // so those pointers survive later insertions).
  absl::node_hash_map<int64_t, TokenHistory> histories_;
  // Per model-side sequence id: taps rows no reply had room for yet (SendTaps).
  struct TapBacklog {
    std::vector<float> rows;  // [n, layers x hidden] fp32, host
    int64_t first_position = 0;
    std::vector<int> layers;
    v1::TensorDtype dtype = v1::TENSOR_DTYPE_BF16;
  };
  absl::flat_hash_map<int64_t, TapBacklog> tap_backlog_;
  // Sequences whose held taps the backend keeps (VerifyFeatures::held_taps: a CUDA backend, on
  // its device; VerifyItem::hold_tap_rows), with the element type they were asked in. A
  // sequence's rows are held there only while tap_backlog_ holds none of it, so the backend's
  // rows always come first.
  absl::flat_hash_map<int64_t, v1::TensorDtype> backend_held_;
  std::string capacity_summary_;  // fixed at load
};

}  // namespace specd

#endif  // SPECD_SERVICES_VERIFY_VERIFY_LOOP_H_
