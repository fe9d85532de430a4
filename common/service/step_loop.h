// What the model loops of specd-draft and specd-verify share: the one thread that owns the
// model and drains the StepQueue, the SequenceTable that maps (stream, seq_id) to model-side
// ids, the bookkeeping around every batch (streams that ended, deadlines that passed, releases
// and cancellations, duplicate and freed ids), and the ModelServiceMetrics kept on the way.
// A subclass supplies what a batch's steps do with its model and how a sequence is freed.
#ifndef SPECD_COMMON_SERVICE_STEP_LOOP_H_
#define SPECD_COMMON_SERVICE_STEP_LOOP_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/service/metrics.h"
#include "common/service/model_service_main.h"
#include "common/service/sequence_table.h"
#include "common/service/step_stream.h"

namespace specd {

// `status` with `prefix` before its message (e.g. the field path of a step).
inline absl::Status Prefixed(const absl::Status& status, const std::string& prefix) {
  return absl::Status(status.code(), absl::StrCat(prefix, status.message()));
}

// Request and Response are a service's Step messages; Info is what its GetInfo answers, with a
// model() name.
template <typename Request, typename Response, typename Info>
class StepLoop : public ModelLoop {
 public:
  using Queue = StepQueue<Request, Response>;

  // The subclass's destructor must call Stop() itself: the thread calls its virtual methods.
  ~StepLoop() override { Stop(); }

  // What GetInfo answers; fixed once loaded.
  const Info& info() const { return info_; }
  const std::string& model_name() const override { return info_.model(); }

  void BeginDrain() override { draining_.store(true); }
  int64_t LiveSequences() const override { return live_sequences_.load(); }
  double KvCacheUsage() const override { return kv_usage_.load(); }

  // Answers what is queued, frees every sequence and joins the thread. Call after the gRPC
  // server has shut down, so no reactor waits on a step that will never run.
  void Stop() override {
    if (!thread_.joinable()) return;
    queue_->Close();
    thread_.join();
  }

 protected:
  // `queue` and `metrics` must outlive the loop. `max_gather` bounds GatherWindow(); zero:
  // never wait for other streams.
  StepLoop(Queue* queue, ModelServiceMetrics* metrics, absl::Duration max_gather)
      : queue_(queue), metrics_(metrics), max_gather_(max_gather) {}

  // Starts the thread; call last in the subclass's constructor, once info_ is filled.
  void Start() {
    UpdateGauges();
    thread_ = std::thread([this] { Run(); });
  }

  // Answers every step of `batch` (the table already knows which streams ended and which
  // deadlines passed): one response per step, in order.
  virtual std::vector<Response> RunSteps(const typename Queue::Batch& batch) = 0;
  // Frees a sequence's model state; errors are only logged, the sequence is gone either way.
  virtual void FreeModelState(int64_t seq) = 0;
  // Fraction of the KV cache in use (0 where there is none).
  virtual double KvCacheUsageRatio() = 0;
  // How long Pop may wait for other streams' steps once one is queued (StepQueue::Pop's
  // `gather`): the recent step time, up to `max_gather`. Waiting for another router's step then
  // costs it no more than running it a whole step later would, and the verify steps of routers
  // that step together come back together, so their next draft steps meet in the draft
  // service's window.
  absl::Duration GatherWindow() const { return std::min(max_gather_, step_cost_); }

  // Frees `seq` and counts it in specd_sequences_freed_total.
  void Free(int64_t seq, bool finished) {
    FreeModelState(seq);
    (finished ? metrics_->freed_finished : metrics_->freed_cancelled).Increment();
  }

  // Frees the sequences `request` releases (finished) or cancels.
  void ReleaseAndCancel(StreamId stream, const Request& request) {
    for (uint64_t id : request.release_seq_ids()) {
      if (std::optional<int64_t> seq = table_.Remove(stream, id)) Free(*seq, /*finished=*/true);
    }
    for (uint64_t id : request.cancel_seq_ids()) {
      if (std::optional<int64_t> seq = table_.Remove(stream, id)) Free(*seq, /*finished=*/false);
    }
  }

  // INVALID_ARGUMENT when an earlier entry of request.steps has the seq_id of steps[i].
  static absl::Status CheckUniqueSeqId(const Request& request, int i) {
    const uint64_t seq_id = request.steps(i).seq_id();
    for (int j = 0; j < i; ++j) {
      if (request.steps(j).seq_id() == seq_id) {
        return absl::InvalidArgumentError(absl::StrCat("steps[", i, "].seq_id: ", seq_id,
                                                       " appears more than once in this step"));
      }
    }
    return absl::OkStatus();
  }

  // The model-side id of (stream, seq_id), or nullopt for a sequence the table does not hold
  // (a new one). Errors: the id was freed by the service (its tombstone), or the step's
  // deadline has passed (then a live sequence is freed and tombstoned). `where` names the step.
  absl::StatusOr<std::optional<int64_t>> FindLive(StreamId stream, uint64_t seq_id,
                                                  int64_t deadline_unix_ms,
                                                  const std::string& where) {
    std::optional<int64_t> live = table_.Find(stream, seq_id);
    if (!live.has_value()) {
      if (absl::Status freed = table_.Tombstone(stream, seq_id); !freed.ok()) return freed;
    }
    if (deadline_unix_ms != 0 && deadline_unix_ms < absl::ToUnixMillis(absl::Now())) {
      if (live.has_value()) {
        table_.Remove(stream, seq_id);
        Free(*live, /*finished=*/false);
        table_.SetTombstone(stream, seq_id, absl::StatusCode::kDeadlineExceeded);
      }
      return absl::DeadlineExceededError(
          absl::StrCat(where, ".deadline_unix_ms: ", deadline_unix_ms, " has passed"));
    }
    if (!live.has_value() && draining_.load()) {
      return absl::UnavailableError(
          absl::StrCat(where, ".seq_id: ", seq_id, " is new, and the service is shutting down"));
    }
    return live;
  }

  // Records one model step of `batch_size` sequences and `tokens` tokens, begun at `start`;
  // `prefill`: some sequence of the step was new to the service (fed its prompt).
  void RecordStep(absl::Time start, int64_t batch_size, int64_t tokens, bool prefill) {
    (prefill ? metrics_->prefill_step_seconds : metrics_->decode_step_seconds)
        .Observe(absl::ToDoubleSeconds(absl::Now() - start));
    metrics_->step_batch_size.Observe(static_cast<double>(batch_size));
    metrics_->step_tokens.Increment(static_cast<double>(tokens));
  }

  Info info_;
  Queue* const queue_;
  ModelServiceMetrics* const metrics_;
  SequenceTable table_;

 private:
  // How often an idle loop looks for sequences whose deadline passed.
  static constexpr absl::Duration kIdleTick = absl::Milliseconds(200);

  void Run() {
    for (;;) {
      typename Queue::Batch batch = queue_->Pop(kIdleTick, GatherWindow());
      ProcessBatch(batch);
      if (batch.closed) break;
    }
    // Shutting down: nothing can reach these sequences any more.
    for (int64_t seq : table_.RemoveAll()) Free(seq, /*finished=*/false);
    UpdateGauges();
  }

  void ProcessBatch(typename Queue::Batch& batch) {
    for (StreamId stream : batch.ended_streams) {
      for (int64_t seq : table_.RemoveStream(stream)) Free(seq, /*finished=*/false);
    }
    for (int64_t seq : table_.RemoveExpired(absl::ToUnixMillis(absl::Now()))) {
      Free(seq, /*finished=*/false);
    }
    if (batch.steps.empty()) {
      UpdateGauges();
      return;
    }
    const absl::Time start = absl::Now();
    std::vector<Response> responses = RunSteps(batch);
    const absl::Duration took = absl::Now() - start;
    step_cost_ = step_cost_ == absl::ZeroDuration() ? took : (step_cost_ * 3 + took) / 4;
    // Pop takes one step a stream: more than one step is several streams (routers) batched.
    if (batch.steps.size() > 1) metrics_->merged_steps.Increment();
    UpdateGauges();
    for (size_t b = 0; b < batch.steps.size(); ++b) {
      batch.steps[b].reply(std::move(responses[b]));
    }
  }

  void UpdateGauges() {
    live_sequences_.store(static_cast<int64_t>(table_.size()));
    metrics_->sequences.Set(table_.size());
    const double kv = KvCacheUsageRatio();
    kv_usage_.store(kv);
    metrics_->kv_cache_usage_ratio.Set(kv);
  }

  const absl::Duration max_gather_;
  // The recent cost of a batch's RunSteps: an exponential average of the last few (zero before
  // the first). Loop thread only.
  absl::Duration step_cost_ = absl::ZeroDuration();
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> live_sequences_{0};
  std::atomic<double> kv_usage_{0.0};
  std::thread thread_;
};

}  // namespace specd

#endif  // SPECD_COMMON_SERVICE_STEP_LOOP_H_
