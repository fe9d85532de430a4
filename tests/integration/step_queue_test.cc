// StepQueue: at most one step per stream per batch, in order; ended streams; closing; the
// gather window that batches several streams' steps.
#include <string>
#include <thread>
#include <vector>

#include "common/service/step_stream.h"
#include "gtest/gtest.h"
#include "specd/v1/verify.pb.h"

namespace specd {
namespace {

using Queue = StepQueue<v1::VerifyStepRequest, v1::VerifyStepResponse>;

v1::VerifyStepRequest Request(uint64_t step_id) {
  v1::VerifyStepRequest r;
  r.set_step_id(step_id);
  return r;
}

TEST(StepQueue, OneStepPerStreamPerBatchInOrder) {
  Queue q;
  const StreamId a = q.NewStream();
  const StreamId b = q.NewStream();
  EXPECT_NE(a, b);
  std::vector<uint64_t> replied;
  auto reply = [&](absl::StatusOr<v1::VerifyStepResponse> r) {
    ASSERT_TRUE(r.ok());
    replied.push_back(r->step_id());
  };
  q.Submit(a, Request(1), reply);
  q.Submit(a, Request(2), reply);
  q.Submit(b, Request(10), reply);
  q.Submit(a, Request(3), reply);

  Queue::Batch first = q.Pop(absl::ZeroDuration());
  ASSERT_EQ(first.steps.size(), 2u);
  EXPECT_EQ(first.steps[0].stream, a);
  EXPECT_EQ(first.steps[0].request.step_id(), 1u);
  EXPECT_EQ(first.steps[1].stream, b);
  EXPECT_EQ(first.steps[1].request.step_id(), 10u);
  Queue::Batch second = q.Pop(absl::ZeroDuration());
  ASSERT_EQ(second.steps.size(), 1u);
  EXPECT_EQ(second.steps[0].request.step_id(), 2u);
  Queue::Batch third = q.Pop(absl::ZeroDuration());
  ASSERT_EQ(third.steps.size(), 1u);
  EXPECT_EQ(third.steps[0].request.step_id(), 3u);
  EXPECT_TRUE(q.Pop(absl::ZeroDuration()).steps.empty());
  for (Queue::Batch* batch : {&first, &second, &third}) {
    for (Queue::Step& step : batch->steps) {
      v1::VerifyStepResponse response;
      response.set_step_id(step.request.step_id());
      step.reply(std::move(response));
    }
  }
  EXPECT_EQ(replied, (std::vector<uint64_t>{1, 10, 2, 3}));
}

TEST(StepQueue, EndedStreamsAndClose) {
  Queue q;
  const StreamId a = q.NewStream();
  q.EndStream(a);
  Queue::Batch batch = q.Pop(absl::Milliseconds(1));
  EXPECT_TRUE(batch.steps.empty());
  ASSERT_EQ(batch.ended_streams.size(), 1u);
  EXPECT_EQ(batch.ended_streams[0], a);
  EXPECT_FALSE(batch.closed);

  q.Submit(a, Request(1), [](absl::StatusOr<v1::VerifyStepResponse>) {});
  q.Close();
  // What was queued before Close() is still handed out; then the queue reports closed.
  batch = q.Pop(absl::ZeroDuration());
  EXPECT_EQ(batch.steps.size(), 1u);
  EXPECT_FALSE(batch.closed);
  EXPECT_TRUE(q.Pop(absl::ZeroDuration()).closed);
  absl::Status late;
  q.Submit(a, Request(2), [&](absl::StatusOr<v1::VerifyStepResponse> r) { late = r.status(); });
  EXPECT_EQ(late.code(), absl::StatusCode::kUnavailable);
}

TEST(StepQueue, CloseAndFailAnswersEverythingQueued) {
  Queue q;
  const StreamId a = q.NewStream();
  std::vector<absl::StatusCode> codes;
  auto reply = [&](absl::StatusOr<v1::VerifyStepResponse> r) {
    codes.push_back(r.status().code());
  };
  q.Submit(a, Request(1), reply);
  q.Submit(a, Request(2), reply);
  q.CloseAndFail(absl::UnavailableError("model failed to load"));
  EXPECT_EQ(codes, (std::vector<absl::StatusCode>{absl::StatusCode::kUnavailable,
                                                  absl::StatusCode::kUnavailable}));
  EXPECT_TRUE(q.Pop(absl::ZeroDuration()).closed);
}

// The gather window: with a step queued, Pop waits for the steps of the other streams that
// stepped recently (two routers batched as one), up to the window; it does not wait when the
// queued streams are all the active ones, nor for a stream that stopped stepping or ended.
TEST(StepQueue, GatherWaitsForOtherActiveStreamsOnly) {
  Queue q;
  const StreamId a = q.NewStream();
  const StreamId b = q.NewStream();
  std::vector<Queue::Step> done;
  auto reply = [](absl::StatusOr<v1::VerifyStepResponse>) {};
  auto pop = [&](absl::Duration gather) {
    Queue::Batch batch = q.Pop(absl::ZeroDuration(), gather);
    for (Queue::Step& step : batch.steps) step.reply(v1::VerifyStepResponse());
    return batch;
  };
  // One stream alone: no wait, however long the window.
  q.Submit(a, Request(1), reply);
  absl::Time start = absl::Now();
  EXPECT_EQ(pop(absl::Seconds(30)).steps.size(), 1u);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(q.gathers(), 0);

  // Both active: a's next step waits for b's, which comes from another thread meanwhile.
  q.Submit(b, Request(10), reply);
  EXPECT_EQ(pop(absl::ZeroDuration()).steps.size(), 1u);
  q.Submit(a, Request(2), reply);
  std::thread late([&] {
    absl::SleepFor(absl::Milliseconds(20));
    q.Submit(b, Request(11), reply);
  });
  Queue::Batch merged = pop(absl::Seconds(30));
  late.join();
  ASSERT_EQ(merged.steps.size(), 2u);
  EXPECT_EQ(merged.steps[0].request.step_id(), 2u);
  EXPECT_EQ(merged.steps[1].request.step_id(), 11u);
  EXPECT_EQ(q.gathers(), 1);

  // b silent: a waits the window, then runs alone.
  q.Submit(a, Request(3), reply);
  start = absl::Now();
  EXPECT_EQ(pop(absl::Milliseconds(50)).steps.size(), 1u);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  EXPECT_EQ(q.gathers(), 2);

  // b silent for longer than kActiveWithin, or ended: a no longer waits for it.
  absl::SleepFor(Queue::kActiveWithin + absl::Milliseconds(50));
  q.Submit(a, Request(4), reply);
  EXPECT_EQ(pop(absl::Seconds(30)).steps.size(), 1u);
  q.Submit(b, Request(12), reply);
  EXPECT_EQ(pop(absl::ZeroDuration()).steps.size(), 1u);
  q.EndStream(b);
  q.Submit(a, Request(5), reply);
  start = absl::Now();
  EXPECT_EQ(pop(absl::Seconds(30)).steps.size(), 1u);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(q.gathers(), 2);
}

}  // namespace
}  // namespace specd
