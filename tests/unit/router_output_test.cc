// SequenceOutput: stop conditions and streamed text, over the real tokenizer of a random
// checkpoint (byte-level BPE without merges: one token per byte, so every multi-byte stop
// string or character is split across tokens).
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/text/tokenizer.h"
#include "gtest/gtest.h"
#include "services/router/output_stream.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

class Decoder : public TokenTextDecoder {
 public:
  explicit Decoder(const Tokenizer* t) : stream_(t, /*skip_special_tokens=*/true) {}
  std::string Next(int32_t token) override { return stream_.Push(token); }
  std::string Flush() override { return stream_.Flush(); }

 private:
  DecodeStream stream_;
};

class RouterOutputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string dir = MakeTempDir("router_output_test");
    ASSERT_TRUE(WriteRandomCheckpoint(dir, RandomCheckpointSpec()).ok());
    absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromModelDir(dir);
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    ASSERT_TRUE(t.ok()) << t.status();
    tokenizer_ = t->release();
  }

  std::unique_ptr<SequenceOutput> Make(StreamStopConditions stop) {
    if (stop.max_new_tokens == 0) stop.max_new_tokens = 1000;
    return std::make_unique<SequenceOutput>(std::make_unique<Decoder>(tokenizer_), stop);
  }

  std::vector<int32_t> Ids(const std::string& text) { return tokenizer_->Encode(text); }

  // Pushes every token of `text` (stopping at the first finish) and returns what was streamed.
  OutputChunk Run(SequenceOutput& out, const std::string& text) {
    OutputChunk all;
    for (int32_t id : Ids(text)) {
      const bool more = out.Push(id);
      OutputChunk c = out.TakeReady();
      all.text += c.text;
      all.token_ids.insert(all.token_ids.end(), c.token_ids.begin(), c.token_ids.end());
      if (!more) break;
    }
    return all;
  }

  static Tokenizer* tokenizer_;
};

Tokenizer* RouterOutputTest::tokenizer_ = nullptr;

TEST_F(RouterOutputTest, StreamsEveryTokenWithoutStopStrings) {
  auto out = Make({});
  const std::string text = "def f(x):\n    return x";
  OutputChunk got = Run(*out, text);
  EXPECT_EQ(got.text, text);
  EXPECT_EQ(got.token_ids, Ids(text));
  EXPECT_FALSE(out->finished());
  EXPECT_EQ(out->generated(), static_cast<int>(Ids(text).size()));
}

TEST_F(RouterOutputTest, StopStringSplitAcrossTokensIsNotEmitted) {
  StreamStopConditions stop;
  stop.stop = {"END"};
  auto out = Make(stop);
  OutputChunk got = Run(*out, "hello ENDworld");
  EXPECT_EQ(got.text, "hello ");
  EXPECT_EQ(got.token_ids, Ids("hello "));
  EXPECT_EQ(out->finish_reason(), v1::FINISH_REASON_STOP_STRING);
  EXPECT_EQ(out->matched_stop(), "END");
  // The token after the stop string was never consumed.
  EXPECT_EQ(out->generated(), static_cast<int>(Ids("hello END").size()));
}

TEST_F(RouterOutputTest, HoldsBackAPossibleStopPrefixUntilResolved) {
  StreamStopConditions stop;
  stop.stop = {"END"};
  auto out = Make(stop);
  for (int32_t id : Ids("ab E")) ASSERT_TRUE(out->Push(id));
  OutputChunk c = out->TakeReady();
  EXPECT_EQ(c.text, "ab ");
  EXPECT_EQ(c.token_ids, Ids("ab "));
  for (int32_t id : Ids("N")) ASSERT_TRUE(out->Push(id));
  EXPECT_TRUE(out->TakeReady().empty());
  // "ENx" cannot start "END" any more: all of it is released.
  for (int32_t id : Ids("x")) ASSERT_TRUE(out->Push(id));
  c = out->TakeReady();
  EXPECT_EQ(c.text, "ENx");
  EXPECT_EQ(c.token_ids, Ids("ENx"));
}

TEST_F(RouterOutputTest, EarliestOfSeveralStopStringsWins) {
  StreamStopConditions stop;
  stop.stop = {"world", "lo w"};
  auto out = Make(stop);
  OutputChunk got = Run(*out, "hello world");
  EXPECT_EQ(got.text, "hel");
  EXPECT_EQ(out->matched_stop(), "lo w");
}

TEST_F(RouterOutputTest, StopStringInsideAMultiByteCharacterRun) {
  StreamStopConditions stop;
  stop.stop = {"é!"};  // three bytes, so three byte tokens
  auto out = Make(stop);
  OutputChunk got = Run(*out, "café!x");
  EXPECT_EQ(got.text, "caf");
  // The first byte of "é" has no text of its own; it goes with the stop string.
  EXPECT_EQ(got.token_ids, Ids("caf"));
  EXPECT_EQ(out->finish_reason(), v1::FINISH_REASON_STOP_STRING);
}

TEST_F(RouterOutputTest, MultiByteCharacterIsEmittedWhole) {
  auto out = Make({});
  std::string streamed;
  for (int32_t id : Ids("né")) {
    ASSERT_TRUE(out->Push(id));
    OutputChunk c = out->TakeReady();
    // Never half a character.
    EXPECT_TRUE(c.text.empty() || c.text == "n" || c.text == "é") << c.text;
    streamed += c.text;
  }
  EXPECT_EQ(streamed, "né");
}

TEST_F(RouterOutputTest, EosEndsAndIsNotStreamed) {
  StreamStopConditions stop;
  stop.eos_token_ids = {256};
  auto out = Make(stop);
  for (int32_t id : Ids("ab")) ASSERT_TRUE(out->Push(id));
  EXPECT_FALSE(out->Push(256));
  EXPECT_FALSE(out->Push(Ids("c")[0]));  // after the stop: dropped
  OutputChunk c = out->TakeReady();
  EXPECT_EQ(c.text, "ab");
  EXPECT_EQ(c.token_ids, Ids("ab"));
  EXPECT_EQ(out->finish_reason(), v1::FINISH_REASON_EOS);
  EXPECT_EQ(out->generated(), 3);
}

TEST_F(RouterOutputTest, IgnoredEosIsJustAToken) {
  auto out = Make({});  // ignore_eos: no eos ids
  EXPECT_TRUE(out->Push(256));
  EXPECT_FALSE(out->finished());
}

TEST_F(RouterOutputTest, StopTokenIdEnds) {
  StreamStopConditions stop;
  stop.stop_token_ids = {Ids("z")[0]};
  auto out = Make(stop);
  OutputChunk got = Run(*out, "xyzw");
  EXPECT_EQ(got.text, "xy");
  EXPECT_EQ(out->finish_reason(), v1::FINISH_REASON_STOP_TOKEN);
}

TEST_F(RouterOutputTest, LengthReleasesHeldText) {
  StreamStopConditions stop;
  stop.stop = {"END"};
  stop.max_new_tokens = 4;
  auto out = Make(stop);
  OutputChunk got = Run(*out, "abEN");
  EXPECT_EQ(got.text, "abEN");  // "EN" was held, then released: the stop can no longer happen
  EXPECT_EQ(out->finish_reason(), v1::FINISH_REASON_LENGTH);
}

TEST_F(RouterOutputTest, ContextFullEnds) {
  StreamStopConditions stop;
  stop.prompt_tokens = 10;
  stop.max_total_tokens = 13;
  auto out = Make(stop);
  OutputChunk got = Run(*out, "abcdef");
  EXPECT_EQ(got.text, "abc");
  EXPECT_EQ(out->finish_reason(), v1::FINISH_REASON_CONTEXT);
}

}  // namespace
}  // namespace specd
