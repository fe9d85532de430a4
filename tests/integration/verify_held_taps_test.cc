// specd-verify as a real process: the EAGLE taps of steps that set hold_taps stay in the service
// and come back, through VerifyStepRequest.send_held_taps, as the same rows (bit for bit, fp32)
// that steps without hold_taps return one step at a time; past --max_held_tap_bytes the oldest
// go; releases free them; bad input names the field. On a GPU host, SPECD_TEST_VERIFY_ARGS
// (space-separated flags, e.g. --device=cuda:0) runs them on a CUDA backend, which holds the rows
// on its device (engine/cuda/cuda_held_taps.h).
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/service/hidden_states_proto.h"
#include "common/token_tree.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "specd/v1/verify.grpc.pb.h"
#include "tests/testutil/model_service_fixture.h"
#include "tests/testutil/random_checkpoint.h"
#include "tests/testutil/service_process.h"

namespace specd {
namespace {

using ::testing::HasSubstr;
using VerifyStream = StepStreamClient<v1::Verifier, v1::VerifyStepRequest, v1::VerifyStepResponse>;

constexpr int kVocab = 320;
constexpr int kRowBytes = 3 * 64 * 4;  // three fp32 taps of the checkpoint's 64 values

void AddStep(v1::VerifyStepRequest* request, uint64_t seq, const std::vector<int32_t>& pending,
             bool hold, const TokenTree& tree = {}) {  // greedy: default sampling
  v1::VerifySequenceStep* step = request->add_steps();
  step->set_seq_id(seq);
  step->mutable_pending()->Add(pending.begin(), pending.end());
  step->mutable_tree()->mutable_tokens()->Add(tree.tokens.begin(), tree.tokens.end());
  step->mutable_tree()->mutable_parents()->Add(tree.parents.begin(), tree.parents.end());
  for (int layer : {0, 1, 2}) step->add_tap_layers(layer);
  step->set_tap_dtype(v1::TENSOR_DTYPE_FP32);
  step->set_hold_taps(hold);
}

class VerifyHeldTapsTest : public ModelServiceTest {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(MakeTempDir("specd-verify-held-taps"));
    RandomCheckpointSpec spec;
    spec.vocab_size = kVocab;
    spec.init_std = 0.3f;
    spec.seed = 11;
    spec.max_position_embeddings = 256;
    ASSERT_TRUE(WriteRandomCheckpoint(*dir_, spec).ok());
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*dir_, ec);
    delete dir_;
  }

  std::unique_ptr<ServiceProcess> StartVerify(std::vector<std::string> extra = {}) {
    extra.insert(extra.begin(), "--model=" + *dir_);
    if (const char* more = std::getenv("SPECD_TEST_VERIFY_ARGS"); more != nullptr) {
      for (absl::string_view a : absl::StrSplit(more, ' ', absl::SkipEmpty())) {
        extra.emplace_back(a);
      }
    }
    return StartService(SpecdBinary("specd-verify"), extra);
  }

  // Runs sequence 1 (holding its taps) and sequence 2 (taps every step) through the same steps:
  // a 20-token prompt, then `steps` steps of one bonus token, one of them with a two-node tree.
  // Returns sequence 2's taps, appended in order; sequence 1's replies must carry none.
  v1::HiddenStates RunBoth(VerifyStream& stream, int steps, uint64_t* step_id) {
    std::vector<int32_t> pending;
    for (int i = 0; i < 20; ++i) pending.push_back(17 + 13 * i % 290);
    v1::HiddenStates every;
    for (int s = 0; s <= steps; ++s) {
      v1::VerifyStepRequest request;
      request.set_step_id((*step_id)++);
      TokenTree tree;
      if (s == 2) tree = TokenTree{{5, 6}, {-1, 0}};
      AddStep(&request, 1, pending, /*hold=*/true, tree);
      AddStep(&request, 2, pending, /*hold=*/false, tree);
      const v1::VerifyStepResponse response = stream.Step(request);
      EXPECT_EQ(response.results_size(), 2);
      if (response.results_size() != 2) return every;
      const v1::VerifySequenceResult& held = response.results(0);
      const v1::VerifySequenceResult& sent = response.results(1);
      EXPECT_FALSE(held.has_error()) << held.error().message();
      EXPECT_FALSE(sent.has_error()) << sent.error().message();
      EXPECT_EQ(held.taps().tokens(), 0u);
      EXPECT_GT(sent.taps().tokens(), 0u);
      EXPECT_EQ(std::vector<int32_t>(held.tokens().begin(), held.tokens().end()),
                std::vector<int32_t>(sent.tokens().begin(), sent.tokens().end()));
      AppendHiddenStates(sent.taps(), &every);
      pending = {sent.tokens(sent.tokens_size() - 1)};
    }
    return every;
  }

  static v1::VerifyStepResponse Fetch(VerifyStream& stream, uint64_t step_id,
                                      const std::vector<uint64_t>& ids) {
    v1::VerifyStepRequest request;
    request.set_step_id(step_id);
    for (uint64_t id : ids) request.add_send_held_taps(id);
    return stream.Step(request);
  }

  static std::string* dir_;
};

std::string* VerifyHeldTapsTest::dir_ = nullptr;

TEST_F(VerifyHeldTapsTest, HeldTapsComeBackAsTheStepsWouldHaveSentThem) {
  std::unique_ptr<ServiceProcess> p = StartVerify();
  ASSERT_NE(p, nullptr);
  VerifyStream stream(p->channel());
  uint64_t step_id = 1;
  const v1::HiddenStates every = RunBoth(stream, 6, &step_id);
  ASSERT_GE(every.tokens(), 26u);  // the prompt and at least one token a step
  EXPECT_EQ(every.first_position(), 0);

  // Sequence 1's rows, fetched at once, are sequence 2's; 2 holds none and 77 is unknown.
  v1::VerifyStepResponse fetched = Fetch(stream, step_id++, {1, 2, 77});
  EXPECT_EQ(fetched.results_size(), 0);
  ASSERT_EQ(fetched.held_taps_size(), 3);
  EXPECT_EQ(fetched.held_taps(0).seq_id(), 1u);
  const v1::HiddenStates& held = fetched.held_taps(0).taps();
  EXPECT_EQ(held.first_position(), 0);
  EXPECT_EQ(held.tokens(), every.tokens());
  EXPECT_EQ(held.width(), every.width());
  EXPECT_EQ(held.dtype(), v1::TENSOR_DTYPE_FP32);
  EXPECT_THAT(held.layers(), ::testing::ElementsAre(0, 1, 2));
  EXPECT_TRUE(held.data() == every.data()) << "held rows differ from the rows sent every step";
  EXPECT_EQ(fetched.held_taps(1).taps().tokens(), 0u);
  EXPECT_EQ(fetched.held_taps(2).taps().tokens(), 0u);
  // Sent once: nothing is held any more.
  fetched = Fetch(stream, step_id++, {1});
  ASSERT_EQ(fetched.held_taps_size(), 1);
  EXPECT_EQ(fetched.held_taps(0).taps().tokens(), 0u);

  // hold_taps without tap_layers names the field; the other sequence is served.
  v1::VerifyStepRequest bad;
  bad.set_step_id(step_id++);
  AddStep(&bad, 3, {1, 2, 3}, /*hold=*/true);
  bad.mutable_steps(0)->clear_tap_layers();
  AddStep(&bad, 4, {1, 2, 3}, /*hold=*/true);
  v1::VerifyStepResponse response = stream.Step(bad);
  ASSERT_EQ(response.results_size(), 2);
  EXPECT_EQ(response.results(0).error().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(response.results(0).error().message(), HasSubstr("steps[0].hold_taps"));
  EXPECT_FALSE(response.results(1).has_error());

  // A released sequence's held rows go with it.
  v1::VerifyStepRequest release;
  release.set_step_id(step_id++);
  release.add_release_seq_ids(4);
  release.add_send_held_taps(4);
  response = stream.Step(release);
  ASSERT_EQ(response.held_taps_size(), 1);
  EXPECT_EQ(response.held_taps(0).taps().tokens(), 0u);
  EXPECT_TRUE(stream.Close().ok());
}

// A bound of ten rows: the 20-row prompt keeps its last five, the plain steps add theirs; what
// comes back is the newest rows, equal to those sent every step at the same positions.
TEST_F(VerifyHeldTapsTest, PastTheBoundTheOldestHeldRowsAreDropped) {
  std::unique_ptr<ServiceProcess> p =
      StartVerify({absl::StrCat("--max_held_tap_bytes=", 10 * kRowBytes)});
  ASSERT_NE(p, nullptr);
  VerifyStream stream(p->channel());
  uint64_t step_id = 1;
  const v1::HiddenStates every = RunBoth(stream, 3, &step_id);
  const v1::VerifyStepResponse fetched = Fetch(stream, step_id++, {1});
  ASSERT_EQ(fetched.held_taps_size(), 1);
  const v1::HiddenStates& held = fetched.held_taps(0).taps();
  ASSERT_GT(held.tokens(), 0u);
  EXPECT_LE(held.tokens(), 10u);
  EXPECT_EQ(held.first_position() + held.tokens(), every.first_position() + every.tokens());
  EXPECT_EQ(held.first_position(), 15);
  const size_t skip = static_cast<size_t>(held.first_position()) * kRowBytes;
  EXPECT_TRUE(held.data() == every.data().substr(skip));
  EXPECT_TRUE(stream.Close().ok());
}

}  // namespace
}  // namespace specd
