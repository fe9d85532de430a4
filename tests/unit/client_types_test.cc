// The C++ SDK's plain types (clients/cpp/include/specd/types.h) and CompletionBuilder.
#include <optional>
#include <vector>

#include "gtest/gtest.h"
#include "specd/client.h"
#include "specd/types.h"

namespace specd {
namespace {

TEST(ClientTypesTest, SpeculationNamesRoundTrip) {
  for (Speculation s :
       {Speculation::kAuto, Speculation::kOff, Speculation::kDraftModel, Speculation::kNgram}) {
    EXPECT_EQ(ParseSpeculation(SpeculationName(s)), s);
  }
  EXPECT_STREQ(SpeculationName(Speculation::kDraftModel), "draft_model");
  EXPECT_EQ(ParseSpeculation("draft-model"), Speculation::kDraftModel);
  EXPECT_EQ(ParseSpeculation("eagle9"), std::nullopt);
  EXPECT_EQ(ParseSpeculation(""), std::nullopt);
}

TEST(ClientTypesTest, FinishReasonNames) {
  EXPECT_STREQ(FinishReasonName(FinishReason::kLength), "length");
  EXPECT_STREQ(FinishReasonName(FinishReason::kEos), "eos");
  EXPECT_STREQ(FinishReasonName(FinishReason::kStopToken), "stop_token");
  EXPECT_STREQ(FinishReasonName(FinishReason::kStopString), "stop_string");
  EXPECT_STREQ(FinishReasonName(FinishReason::kContext), "context");
  EXPECT_STREQ(FinishReasonName(FinishReason::kUnspecified), "unspecified");
}

TEST(ClientTypesTest, SpeculationRates) {
  SpeculationStats s;
  EXPECT_EQ(s.acceptance_rate(), std::nullopt);
  EXPECT_EQ(s.mean_accepted_length(), std::nullopt);
  s.steps = 4;
  s.draft_tokens = 16;
  s.accepted_tokens = 6;
  EXPECT_DOUBLE_EQ(*s.acceptance_rate(), 6.0 / 16);
  EXPECT_DOUBLE_EQ(*s.mean_accepted_length(), 1.0 + 6.0 / 4);
}

TEST(ClientTypesTest, CompletionBuilderJoinsChunksAndNeedsALastOne) {
  CompletionBuilder builder;
  Chunk a;
  a.token_ids = {1, 2};
  a.text = "ab";
  Chunk b;
  b.token_ids = {3};
  b.text = "c";
  b.finish_reason = FinishReason::kStopString;
  b.matched_stop = "d";
  b.usage = {5, 4};
  b.speculation.steps = 1;
  builder.Add(a);
  CompletionBuilder unfinished = builder;
  EXPECT_EQ(std::move(unfinished).Finish().status().code(), absl::StatusCode::kInternal);
  EXPECT_FALSE(a.last());
  EXPECT_TRUE(b.last());
  builder.Add(b);
  absl::StatusOr<Completion> c = std::move(builder).Finish();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->text, "abc");
  EXPECT_EQ(c->token_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(c->finish_reason, FinishReason::kStopString);
  EXPECT_EQ(c->matched_stop, "d");
  EXPECT_EQ(c->usage.prompt_tokens, 5u);
  EXPECT_EQ(c->usage.completion_tokens, 4u);
  EXPECT_EQ(c->speculation.steps, 1u);
}

}  // namespace
}  // namespace specd
