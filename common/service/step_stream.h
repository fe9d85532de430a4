// The server side of a long-lived bidirectional `Step` stream (proto/specd/v1/draft.proto,
// verify.proto): one reactor per stream that never blocks, handing each request to the thread
// that owns the model through a StepQueue and writing the replies back in order.
//
//   gRPC thread                      model loop thread
//   StepStreamReactor::OnReadDone ─▶ StepQueue::Submit ─▶ StepQueue::Pop ─▶ run the step
//   StartWrite(reply)             ◀─────────── reply callback (any thread) ◀──┘
//
// Flow control: at most kMaxStepsInFlight requests of one stream are read but not yet written
// back; the reactor reads the next message only below that bound, so a router that pipelines
// steps is throttled by HTTP/2 flow control instead of growing our queues.
// When the stream ends (half-close, cancellation, a broken connection), the reactor waits for
// the replies it is owed, finishes, and tells the queue the stream ended so the loop can free
// every sequence the stream created.
#ifndef SPECD_COMMON_SERVICE_STEP_STREAM_H_
#define SPECD_COMMON_SERVICE_STEP_STREAM_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/service/grpc_util.h"
#include "common/service/lenient_wire.h"
#include "grpcpp/grpcpp.h"

namespace specd {

inline constexpr int kMaxStepsInFlight = 4;

// Identifies one Step stream inside a service process; sequence ids are scoped by it because
// every router numbers its own sequences.
using StreamId = uint64_t;

template <typename Request, typename Response>
class StepQueue {
 public:
  // Called exactly once per submitted step, on the loop thread (or on the submitting thread
  // once the queue is closed). A non-OK status ends the whole stream with that status; per
  // sequence errors belong inside the Response.
  using Reply = std::function<void(absl::StatusOr<Response>)>;

  struct Step {
    StreamId stream = 0;
    Request request;
    Reply reply;
  };

  // What the loop takes in one iteration: at most one step per stream (a stream's later steps
  // depend on its earlier ones and wait for the next iteration), and the streams that ended.
  struct Batch {
    std::vector<Step> steps;
    std::vector<StreamId> ended_streams;
    bool closed = false;  // Close() was called and nothing is left
  };

  StreamId NewStream() {
    absl::MutexLock lock(&mu_);
    return next_stream_++;
  }

  void Submit(StreamId stream, Request request, Reply reply) {
    {
      absl::MutexLock lock(&mu_);
      if (!closed_) {
        steps_.push_back(Step{stream, std::move(request), std::move(reply)});
        last_submit_[stream] = absl::Now();
        return;
      }
    }
    reply(absl::UnavailableError("the service is shutting down"));
  }

  // The stream's reactor is done and owes no more steps.
  void EndStream(StreamId stream) {
    absl::MutexLock lock(&mu_);
    ended_.push_back(stream);
    last_submit_.erase(stream);
  }

  // Waits up to `timeout` for work; returns what is there (possibly nothing). With `gather` > 0,
  // once a step is queued it waits up to `gather` more while a stream active within
  // kActiveWithin has no step queued, so that the steps of several routers that step at about
  // the same rate run as one batch instead of one after the other (each then waiting a whole
  // step for the other's); it never waits when the queued streams are all the active ones
  // (one router alone).
  Batch Pop(absl::Duration timeout, absl::Duration gather = absl::ZeroDuration()) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return !steps_.empty() || !ended_.empty() || closed_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    if (gather > absl::ZeroDuration() && !steps_.empty() && !closed_) {
      const absl::Time now = absl::Now();
      std::vector<StreamId> active;
      for (const auto& [stream, at] : last_submit_) {
        if (now - at <= kActiveWithin) active.push_back(stream);
      }
      auto all_queued = [this, &active]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        if (closed_) return true;
        for (StreamId s : active) {
          bool queued = false;
          for (const Step& step : steps_) queued = queued || step.stream == s;
          if (!queued) return false;
        }
        return true;
      };
      if (!all_queued()) {
        ++gathers_;
        mu_.AwaitWithTimeout(absl::Condition(&all_queued), gather);
      }
    }
    Batch batch;
    std::vector<StreamId> taken;
    for (auto it = steps_.begin(); it != steps_.end();) {
      bool seen = false;
      for (StreamId s : taken) seen = seen || s == it->stream;
      if (seen) {
        ++it;
        continue;
      }
      taken.push_back(it->stream);
      batch.steps.push_back(std::move(*it));
      it = steps_.erase(it);
    }
    batch.ended_streams.swap(ended_);
    batch.closed = closed_ && steps_.empty() && batch.steps.empty();
    return batch;
  }

  // Closes the queue and answers everything queued with `status` (no loop will run it).
  void CloseAndFail(const absl::Status& status) {
    std::deque<Step> steps;
    {
      absl::MutexLock lock(&mu_);
      closed_ = true;
      steps.swap(steps_);
    }
    for (Step& step : steps) step.reply(status);
  }

  // Later Submit() calls are answered UNAVAILABLE at once; Pop() keeps returning what was
  // already queued, then `closed`.
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }

  // Pops that waited for another stream's step (a gather window was opened).
  int64_t gathers() {
    absl::MutexLock lock(&mu_);
    return gathers_;
  }

  // A stream whose last step came longer ago than this is not waited for: a router that went
  // idle costs the others a gather window a step for at most this long.
  static constexpr absl::Duration kActiveWithin = absl::Milliseconds(250);

 private:
  absl::Mutex mu_;
  std::deque<Step> steps_ ABSL_GUARDED_BY(mu_);
  std::vector<StreamId> ended_ ABSL_GUARDED_BY(mu_);
  StreamId next_stream_ ABSL_GUARDED_BY(mu_) = 1;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  // When each open stream last submitted a step (Pop's gather window).
  absl::flat_hash_map<StreamId, absl::Time> last_submit_ ABSL_GUARDED_BY(mu_);
  int64_t gathers_ ABSL_GUARDED_BY(mu_) = 0;
};

// One per Step RPC; deletes itself once gRPC is done with it and no reply is being delivered.
// `queue` must outlive it (shut the gRPC server down before destroying the queue).
//
// Threading. Reactions run on gRPC threads, replies arrive on the loop thread. Start*() and
// Finish() are never called under mu_, because gRPC may run a reaction inline inside them.
// Instead an action is decided under mu_ (setting reading_/writing_/finished_ so no other
// thread decides it too) and issued after unlocking; `issuing_` counts decided reads and writes
// not yet issued, and Finish() waits for it to reach zero, so no Start*() follows Finish().
// Memory: gRPC calls OnDone() only after Finish() and after every reaction has returned, but
// the loop thread is outside gRPC's accounting, so it holds a reference while it delivers a
// reply.
template <typename Request, typename Response>
class StepStreamReactor : public grpc::ServerBidiReactor<LenientWire<Request>, Response> {
 public:
  explicit StepStreamReactor(StepQueue<Request, Response>* queue)
      : queue_(queue), stream_(queue->NewStream()) {
    Pump();
  }

  void OnReadDone(bool ok) override {
    std::optional<Request> request;
    {
      absl::MutexLock lock(&mu_);
      if (!ok || finished_) {
        reading_ = false;
        read_closed_ = true;
      } else if (absl::Status wire = WireError(read_message_.message); !wire.ok()) {
        // An unparseable step (lenient_wire.h) fails the stream as a failed step does:
        // INVALID_ARGUMENT once the steps in flight are done, no later step read. Logged
        // here, once per stream, since the stream ends.
        SPECD_LOG(WARNING) << "Step stream: " << wire.message();
        reading_ = false;
        read_closed_ = true;
        if (error_.ok()) error_ = std::move(wire);
        read_message_.message.Clear();
      } else {
        ++in_flight_;
        request.emplace(std::move(read_message_.message));
        read_message_.message.Clear();
      }
    }
    if (request.has_value()) {
      // Outside the lock: a closed queue replies at once, and the reply locks mu_. reading_
      // stays set until the step is queued, so no other thread starts the next read and
      // queues a later step first.
      queue_->Submit(stream_, std::move(*request),
                     [this](absl::StatusOr<Response> response) { OnReply(std::move(response)); });
      absl::MutexLock lock(&mu_);
      reading_ = false;
    }
    Pump();
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) broken_ = true;
    }
    Pump();
  }

  void OnCancel() override {
    {
      absl::MutexLock lock(&mu_);
      broken_ = true;
    }
    Pump();
  }

  void OnDone() override {
    queue_->EndStream(stream_);
    Unref();
  }

 private:
  ~StepStreamReactor() override = default;

  void OnReply(absl::StatusOr<Response> response) {
    {
      absl::MutexLock lock(&mu_);
      // Taken while in_flight_ still keeps Finish() (and so OnDone()) away.
      refs_.fetch_add(1);
      --in_flight_;
      if (!response.ok()) {
        if (error_.ok()) error_ = response.status();
      } else if (error_.ok() && !broken_) {
        replies_.push_back(std::move(*response));
      }
    }
    Pump();
    Unref();
  }

  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  void Pump() {
    bool issued = false;
    for (;;) {
      bool read = false;
      bool write = false;
      std::optional<grpc::Status> finish;
      {
        absl::MutexLock lock(&mu_);
        if (issued) --issuing_;
        if (!finished_ && !writing_ && !broken_ && error_.ok() && !replies_.empty()) {
          write_message_ = std::move(replies_.front());
          replies_.pop_front();
          writing_ = write = true;
        }
        const int owed = in_flight_ + static_cast<int>(replies_.size()) + (writing_ ? 1 : 0);
        if (!finished_ && !reading_ && !read_closed_ && !broken_ && error_.ok() &&
            owed < kMaxStepsInFlight) {
          reading_ = read = true;
        }
        if (!read && !write && !finished_ && issuing_ == 0 && in_flight_ == 0 && !writing_) {
          if (broken_) {
            finish = grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled");
          } else if (!error_.ok()) {
            finish = ToGrpcStatus(error_);
          } else if (read_closed_ && replies_.empty()) {
            finish = grpc::Status::OK;
          }
          if (finish.has_value()) finished_ = true;
        }
        if (read || write) ++issuing_;
      }
      if (write) this->StartWrite(&write_message_);
      if (read) this->StartRead(&read_message_);
      if (finish.has_value()) this->Finish(*finish);
      if (!read && !write) return;
      issued = true;
    }
  }

  StepQueue<Request, Response>* const queue_;
  const StreamId stream_;
  std::atomic<int> refs_{1};  // gRPC's, dropped in OnDone
  absl::Mutex mu_;
  // Owned by the outstanding read or write while reading_ / writing_.
  LenientWire<Request> read_message_;
  Response write_message_;
  std::deque<Response> replies_ ABSL_GUARDED_BY(mu_);
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // submitted to the loop, reply not back yet
  int issuing_ ABSL_GUARDED_BY(mu_) = 0;
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool read_closed_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace specd

#endif  // SPECD_COMMON_SERVICE_STEP_STREAM_H_
