// EAGLE end to end: specd-verify serving the reference target (models/pycoder-target),
// specd-draft serving its trained EAGLE-3 head (models/pycoder-eagle3, --eagle_head) or an
// EAGLE-1/2 head (tests/fixtures/eagle1_pycoder, which reads the target's final norm output)
// beside the standalone draft model, and specd-router, as processes on loopback. The verify
// service returns the target's taps for EAGLE sequences, the router relays them, the draft
// service's EAGLE drafter grows trees from them; the output must be what target-only decoding
// gives. On a GPU host, SPECD_TEST_VERIFY_ARGS / SPECD_TEST_DRAFT_ARGS (space-separated flags,
// e.g. --device=cuda:0) run the same tests with CUDA services: the CUDA backend's taps, its
// final-norm tap and its device-held taps end to end.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "specd/v1/draft.grpc.pb.h"
#include "specd/v1/generation.grpc.pb.h"
#include "specd/v1/verify.grpc.pb.h"
#include "tests/testutil/hf_fixtures.h"
#include "tests/testutil/service_process.h"

namespace specd {
namespace {

// The space-separated flags in environment variable `name`, if set.
std::vector<std::string> ExtraArgs(const char* name) {
  std::vector<std::string> out;
  if (const char* extra = std::getenv(name); extra != nullptr) {
    for (absl::string_view a : absl::StrSplit(extra, ' ', absl::SkipEmpty())) out.emplace_back(a);
  }
  return out;
}

struct Result {
  grpc::Status status;
  std::vector<int32_t> tokens;
  v1::GenerateResponse last;  // the chunk with the finish reason
};

class Cluster {
 public:
  // verify_flags / router_flags: extra flags of specd-verify / specd-router; head: the draft
  // service's --eagle_head.
  static std::unique_ptr<Cluster> Start(const std::vector<std::string>& verify_flags = {},
                                        const std::string& head = "",
                                        const std::vector<std::string>& router_flags = {}) {
    const std::string models = (testutil::RepoRoot() / "models").string();
    const std::string target = models + "/pycoder-target";
    const std::string eagle_head = head.empty() ? models + "/pycoder-eagle3" : head;
    auto c = std::make_unique<Cluster>();
    const std::string verify_address = absl::StrCat("127.0.0.1:", PickFreePort());
    const std::string draft_address = absl::StrCat("127.0.0.1:", PickFreePort());
    c->router_metrics = PickFreePort();
    const std::string router_address = absl::StrCat("127.0.0.1:", PickFreePort());
    c->draft_options = {
        SpecdBinary("specd-draft"),
        {"--address=" + draft_address, absl::StrCat("--metrics_port=", PickFreePort()),
         "--model=" + models + "/pycoder-draft", "--eagle_head=" + eagle_head,
         "--eagle_target=" + target, "--num_threads=1"},
        draft_address};
    for (std::string& a : ExtraArgs("SPECD_TEST_DRAFT_ARGS")) c->draft_options.args.push_back(a);
    std::vector<std::string> verify_args = {"--address=" + verify_address,
                                            absl::StrCat("--metrics_port=", PickFreePort()),
                                            "--model=" + target, "--num_threads=1"};
    verify_args.insert(verify_args.end(), verify_flags.begin(), verify_flags.end());
    for (std::string& a : ExtraArgs("SPECD_TEST_VERIFY_ARGS")) verify_args.push_back(a);
    std::vector<std::string> router_args = {
        "--address=" + router_address, absl::StrCat("--metrics_port=", c->router_metrics),
        "--model=" + target, "--verify_address=" + verify_address,
        "--draft_address=" + draft_address};
    router_args.insert(router_args.end(), router_flags.begin(), router_flags.end());
    const std::vector<ServiceProcessOptions> all = {
        {SpecdBinary("specd-verify"), verify_args, verify_address},
        c->draft_options,
        {SpecdBinary("specd-router"), router_args, router_address}};
    std::vector<std::unique_ptr<ServiceProcess>*> slots = {&c->verify, &c->draft, &c->router};
    for (size_t i = 0; i < all.size(); ++i) {
      absl::StatusOr<std::unique_ptr<ServiceProcess>> p = ServiceProcess::Spawn(all[i]);
      EXPECT_TRUE(p.ok()) << p.status();
      if (!p.ok()) return nullptr;
      *slots[i] = *std::move(p);
    }
    for (auto* p : slots) {
      const absl::Status s = (*p)->WaitUntilServing(absl::Seconds(60));
      EXPECT_TRUE(s.ok()) << s << "\n" << (*p)->Log();
      if (!s.ok()) return nullptr;
    }
    c->stub = v1::Generation::NewStub(c->router->channel());
    // The router probes the draft service in the background; wait until it uses it.
    const absl::Time end = absl::Now() + absl::Seconds(20);
    while (absl::Now() < end && c->Metric("specd_draft_available") != 1) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_EQ(c->Metric("specd_draft_available"), 1);
    return c;
  }

  double Metric(const std::string& name, const std::map<std::string, std::string>& labels = {}) {
    absl::StatusOr<std::string> text = HttpGet("127.0.0.1", router_metrics, "/metrics");
    if (!text.ok()) return -1;
    absl::StatusOr<double> v = MetricValue(*text, name, labels);
    return v.ok() ? *v : -1;
  }

  Result Generate(const v1::GenerateRequest& request,
                  const std::function<void(int chunk)>& on_chunk = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
    Result r;
    std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
        stub->Generate(&ctx, request);
    v1::GenerateResponse chunk;
    int chunks = 0;
    while (reader->Read(&chunk)) {
      r.tokens.insert(r.tokens.end(), chunk.token_ids().begin(), chunk.token_ids().end());
      if (chunk.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) r.last = chunk;
      if (on_chunk) on_chunk(++chunks);
    }
    r.status = reader->Finish();
    return r;
  }

  ServiceProcessOptions draft_options;
  std::unique_ptr<ServiceProcess> verify, draft, router;
  int router_metrics = 0;
  std::unique_ptr<v1::Generation::Stub> stub;
};

v1::GenerateRequest Request(const std::string& prompt, int max_new_tokens,
                            v1::Speculation speculation) {
  v1::GenerateRequest r;
  r.set_prompt(prompt);
  r.set_max_new_tokens(max_new_tokens);
  r.set_ignore_eos(true);
  r.set_speculation(speculation);
  return r;
}

// GetModelInfo's speculation_modes.
std::vector<int> Modes(v1::Generation::Stub* stub) {
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  const grpc::Status status = stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return {info.speculation_modes().begin(), info.speculation_modes().end()};
}

const std::vector<std::string>& Prompts() {
  static const auto* prompts = new std::vector<std::string>{
      "def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n",
      "class Stack:\n    def __init__(self):\n", "for i in range(10):\n    if i % 2 == 0:\n"};
  return *prompts;
}

// Drafted steps and accepted tokens summed over requests.
struct Drafted {
  uint64_t steps = 0;
  uint64_t accepted = 0;
};

// For every prompt, greedy and seeded (T 0.8, seed 7), 48 tokens: EAGLE with the router's default
// tree drafted at every step gives speculation off's tokens, and so does EAGLE under the policy
// first when `also_policy`. Adds the fixed-tree requests' drafted steps and accepted tokens to
// `drafted`.
void ExpectEagleIdenticalToOff(Cluster* c, bool also_policy, Drafted* drafted) {
  for (const std::string& prompt : Prompts()) {
    for (const bool seeded : {false, true}) {
      SCOPED_TRACE(absl::StrCat(prompt, seeded ? " seeded" : " greedy"));
      v1::GenerateRequest r = Request(prompt, 48, v1::SPECULATION_OFF);
      if (seeded) {
        r.set_temperature(0.8f);
        r.set_seed(7);
      }
      const Result off = c->Generate(r);
      ASSERT_TRUE(off.status.ok()) << off.status.error_message();
      r.set_speculation(v1::SPECULATION_EAGLE3);
      if (also_policy) {
        const Result eagle = c->Generate(r);
        ASSERT_TRUE(eagle.status.ok()) << eagle.status.error_message();
        EXPECT_EQ(eagle.tokens, off.tokens);
      }
      // A fixed tree shape: every step drafts, whatever the policy would choose.
      r.set_draft_depth(4);
      r.set_draft_top_k(4);
      r.set_draft_max_nodes(16);
      const Result fixed = c->Generate(r);
      ASSERT_TRUE(fixed.status.ok()) << fixed.status.error_message();
      EXPECT_EQ(fixed.tokens, off.tokens);
      EXPECT_EQ(fixed.last.speculation().mode(), v1::SPECULATION_EAGLE3);
      drafted->accepted += fixed.last.speculation().accepted_tokens();
      drafted->steps += fixed.last.speculation().steps();
    }
  }
}

TEST(EagleClusterTest, GreedyAndSeededOutputIsIdenticalWithAndWithoutEagle) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  Drafted d;
  ExpectEagleIdenticalToOff(c.get(), /*also_policy=*/true, &d);
  // The trained head's drafts are accepted: more than one token a drafted step on average.
  EXPECT_GT(d.steps, 0u);
  EXPECT_GT(d.accepted, d.steps);
  // AUTO picks the head when the draft service has one.
  const Result autos = c->Generate(Request(Prompts()[0], 16, v1::SPECULATION_AUTO));
  ASSERT_TRUE(autos.status.ok());
  EXPECT_EQ(autos.last.speculation().mode(), v1::SPECULATION_EAGLE3);
  // And GetModelInfo offers it, beside the draft model the same service has.
  EXPECT_EQ(
      Modes(c->stub.get()),
      (std::vector<int>{v1::SPECULATION_AUTO, v1::SPECULATION_OFF, v1::SPECULATION_DRAFT_MODEL,
                        v1::SPECULATION_NGRAM, v1::SPECULATION_EAGLE3}));
}

// An EAGLE-1/2 head (fc over concat(embedding, feature) with a bias, the target's LM head) reads
// the target's final norm output: the draft service announces tap num_layers + 1 and its kind,
// the verify service (CPU) says it exports that tap, the router asks for it, and the head drafts
// from it. The fixture head's fc is fitted to the target's features
// (tools/oracle/make_eagle1_serving_head.py), so its trees are accepted now and then: accepted
// rows' taps reach the drafter too. Greedy and seeded output is target-only decoding's.
TEST(EagleClusterTest, EagleOneTwoHeadIsServedFromTheFinalNormTap) {
  std::unique_ptr<Cluster> c =
      Cluster::Start({}, (testutil::RepoRoot() / "tests" / "fixtures" / "eagle1_pycoder").string());
  ASSERT_NE(c, nullptr);
  {
    grpc::ClientContext ctx;
    v1::DraftInfo info;
    ASSERT_TRUE(v1::Drafter::NewStub(c->draft->channel())
                    ->GetInfo(&ctx, v1::DraftInfoRequest(), &info)
                    .ok());
    EXPECT_EQ(info.eagle_head(), "eagle1_pycoder");
    EXPECT_EQ(info.eagle_head_kind(), "eagle1");
    // The reference target has 5 layers: tap 6 is its final norm's output.
    EXPECT_EQ(std::vector<int>(info.eagle_tap_layers().begin(), info.eagle_tap_layers().end()),
              std::vector<int>{6});
    grpc::ClientContext vctx;
    v1::VerifyInfo verify;
    ASSERT_TRUE(v1::Verifier::NewStub(c->verify->channel())
                    ->GetInfo(&vctx, v1::VerifyInfoRequest(), &verify)
                    .ok());
    EXPECT_TRUE(verify.supports_taps());
    EXPECT_EQ(verify.max_tap_layer(), 6u);
  }
  EXPECT_EQ(Modes(c->stub.get()).back(), v1::SPECULATION_EAGLE3);
  Drafted d;
  ExpectEagleIdenticalToOff(c.get(), /*also_policy=*/false, &d);
  std::printf("EAGLE-1/2 fixture head: %llu drafted steps accepting %llu tokens\n",
              static_cast<unsigned long long>(d.steps),
              static_cast<unsigned long long>(d.accepted));
  // The taps reach the head and its drafts are accepted: more than one token in four drafted
  // steps (fc was fitted to the target's final norm output; a head fed nothing drafts nothing).
  EXPECT_GT(d.steps, 0u);
  EXPECT_GT(d.accepted * 4, d.steps);
  // AUTO picks the head (the goodput policy may keep some steps plain: their taps are held).
  const Result autos = c->Generate(Request(Prompts()[0], 16, v1::SPECULATION_AUTO));
  ASSERT_TRUE(autos.status.ok());
  EXPECT_EQ(autos.last.speculation().mode(), v1::SPECULATION_EAGLE3);
}

// Every prompt of Prompts(), greedy and seeded, 160 new tokens.
std::vector<v1::GenerateRequest> GreedyAndSeededRequests() {
  std::vector<v1::GenerateRequest> requests;
  for (const std::string& prompt : Prompts()) {
    for (const bool seeded : {false, true}) {
      v1::GenerateRequest r = Request(prompt, 160, v1::SPECULATION_OFF);
      if (seeded) {
        r.set_temperature(0.8f);
        r.set_seed(11);
      }
      requests.push_back(r);
    }
  }
  return requests;
}

// `requests` all at once with speculation `mode`.
std::vector<Result> RunTogether(Cluster& c, const std::vector<v1::GenerateRequest>& requests,
                                v1::Speculation mode) {
  std::vector<Result> out(requests.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back([&, i] {
      v1::GenerateRequest r = requests[i];
      r.set_speculation(mode);
      out[i] = c.Generate(r);
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

// `auto`'s results equal `off`'s, token for token, and ran EAGLE-3; their drafted and
// target-only steps are added to *drafted and *plain.
void ExpectAutoMatchesOff(const std::vector<Result>& off, const std::vector<Result>& autos,
                          uint64_t* drafted, uint64_t* plain) {
  for (size_t i = 0; i < off.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("request ", i, " with the others"));
    ASSERT_TRUE(off[i].status.ok()) << off[i].status.error_message();
    ASSERT_TRUE(autos[i].status.ok()) << autos[i].status.error_message();
    EXPECT_EQ(autos[i].tokens, off[i].tokens);
    EXPECT_EQ(autos[i].last.speculation().mode(), v1::SPECULATION_EAGLE3);
    *drafted += autos[i].last.speculation().steps();
    *plain += autos[i].last.speculation().target_only_steps();
  }
}

// Each of `requests` alone with `auto`: the output equals `off`'s; the drafted and target-only
// steps are added to *drafted and *plain.
void ExpectAloneMatchesOff(Cluster& c, const std::vector<v1::GenerateRequest>& requests,
                           const std::vector<Result>& off, uint64_t* drafted, uint64_t* plain) {
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("request ", i, " alone"));
    v1::GenerateRequest r = requests[i];
    r.set_speculation(v1::SPECULATION_AUTO);
    const Result alone = c.Generate(r);
    ASSERT_TRUE(alone.status.ok()) << alone.status.error_message();
    EXPECT_EQ(alone.tokens, off[i].tokens);
    *drafted += alone.last.speculation().steps();
    *plain += alone.last.speculation().target_only_steps();
  }
}

// Under AUTO the goodput policy drafts the EAGLE sequences some steps, drafts others with the
// router's n-gram proposal, and leaves others plain, from the costs it measures (on this CPU
// the head pays at one stream more than at eight). Steps the head does not draft (plain or
// n-gram) leave their taps in the verify service; when it drafts again the router fetches them
// in one round trip (specd_eagle_held_taps_fetched_total). Whatever the schedule, the output is
// target-only decoding's, greedy and seeded.
TEST(EagleClusterTest, AutoSwitchingDraftingOffAndOnIsIdenticalToOff) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  const std::vector<v1::GenerateRequest> requests = GreedyAndSeededRequests();
  const std::vector<Result> off = RunTogether(*c, requests, v1::SPECULATION_OFF);
  uint64_t drafted = 0, plain = 0;
  ExpectAutoMatchesOff(off, RunTogether(*c, requests, v1::SPECULATION_AUTO), &drafted, &plain);
  const double fetched_together = c->Metric("specd_eagle_held_taps_fetched_total");
  std::printf("8 streams: %llu drafted steps, %llu target-only, %.0f held tap rows fetched\n",
              static_cast<unsigned long long>(drafted), static_cast<unsigned long long>(plain),
              fetched_together);
  drafted = plain = 0;
  ExpectAloneMatchesOff(*c, requests, off, &drafted, &plain);
  const double fetched = c->Metric("specd_eagle_held_taps_fetched_total") - fetched_together;
  // Auto's second drafter, the router's n-gram proposal, takes some steps of these code
  // completions and the head others, and the taps of the n-gram steps reach the head all the
  // same (the outputs above). Whether a sequence goes back to the head after n-gram steps is
  // the policy's call from the costs it measures (on an idle machine, a dozen times a run; on
  // a loaded one, possibly never), so only the way to n-gram is required.
  const double to_ngram = c->Metric("specd_auto_drafter_switches_total", {{"to", "ngram"}});
  const double to_head = c->Metric("specd_auto_drafter_switches_total", {{"to", "model"}});
  std::printf("auto drafter switches: %.0f to n-gram, %.0f to the head\n", to_ngram, to_head);
  EXPECT_GT(to_ngram, 0);
  std::printf("1 stream: %llu drafted steps, %llu target-only, %.0f held tap rows fetched\n",
              static_cast<unsigned long long>(drafted), static_cast<unsigned long long>(plain),
              fetched);
  EXPECT_GT(drafted, 0u);
  EXPECT_GE(fetched_together, 0);  // the counter is exported
}

// With --eagle_tap_dormant_steps=1 a sequence the policy leaves plain for two steps in a row
// stops asking for taps (its steps are plain steps, the verify service drops what it held);
// with eight streams at once most are kept plain after their probe. Drafted again, a sequence
// is first woken (a step asking for taps), then drafts, the head restarting from the rows after
// the gap. Output: target-only decoding's, greedy and seeded, together and alone.
TEST(EagleClusterTest, SequencesThatStopAskingForTapsWakeLosslessly) {
  std::unique_ptr<Cluster> c = Cluster::Start({}, "", {"--eagle_tap_dormant_steps=1"});
  ASSERT_NE(c, nullptr);
  const std::vector<v1::GenerateRequest> requests = GreedyAndSeededRequests();
  const std::vector<Result> off = RunTogether(*c, requests, v1::SPECULATION_OFF);
  uint64_t drafted = 0, plain = 0;
  ExpectAutoMatchesOff(off, RunTogether(*c, requests, v1::SPECULATION_AUTO), &drafted, &plain);
  const double wakes_together = c->Metric("specd_eagle_tap_wakes_total");
  std::printf("8 streams: %llu drafted steps, %llu target-only, %.0f wakes\n",
              static_cast<unsigned long long>(drafted), static_cast<unsigned long long>(plain),
              wakes_together);
  // Alone, after a batch that ended undrafted: the first request starts without taps.
  auto head_calls = [&] {  // draft service round trips (n-gram steps make none)
    return c->Metric("specd_draft_latency_seconds_count", {{"kind", "decode"}}) +
           c->Metric("specd_draft_latency_seconds_count", {{"kind", "prefill"}});
  };
  const double calls_together = head_calls();
  drafted = plain = 0;
  ExpectAloneMatchesOff(*c, requests, off, &drafted, &plain);
  const double wakes = c->Metric("specd_eagle_tap_wakes_total") - wakes_together;
  const double calls = head_calls() - calls_together;
  std::printf("1 stream: %llu drafted steps, %llu target-only, %.0f head calls, %.0f wakes\n",
              static_cast<unsigned long long>(drafted), static_cast<unsigned long long>(plain),
              calls, wakes);
  // Whether one stream drafts this pair with the head is the policy's call from the costs it
  // measured (near break-even on this CPU, n-gram often better); where it does, the first
  // request, which started without taps, drafted only after a wake.
  if (calls > 0) {
    EXPECT_GT(wakes, 0);
  } else {
    std::printf("the head drafted nothing alone: the wake was not exercised\n");
  }
}

// A reply's taps budget of eight rows (three fp32 taps of the reference target's 320 values: 3,840
// bytes a row): a long prompt's taps arrive a few rows a step, in order, ahead of the new ones;
// the drafter proposes nothing until they have all arrived, then drafts from them. The output is
// target-only decoding's either way.
TEST(EagleClusterTest, TapsBeyondTheReplyBudgetFollowInLaterReplies) {
  std::unique_ptr<Cluster> c = Cluster::Start({"--max_tap_bytes_per_reply=30720"});
  ASSERT_NE(c, nullptr);
  std::string prompt;
  for (int i = 0; i < 6; ++i) prompt += Prompts()[i % Prompts().size()];
  v1::GenerateRequest r = Request(prompt, 96, v1::SPECULATION_OFF);
  const Result off = c->Generate(r);
  r.set_speculation(v1::SPECULATION_EAGLE3);
  r.set_draft_depth(4);
  r.set_draft_top_k(4);
  r.set_draft_max_nodes(16);
  const Result eagle = c->Generate(r);
  ASSERT_TRUE(off.status.ok()) << off.status.error_message();
  ASSERT_TRUE(eagle.status.ok()) << eagle.status.error_message();
  EXPECT_EQ(eagle.tokens, off.tokens);
  const v1::SpeculationStats& stats = eagle.last.speculation();
  std::printf("%u prompt tokens: %llu target-only steps, then %llu drafted steps accepting %llu\n",
              eagle.last.usage().prompt_tokens(),
              static_cast<unsigned long long>(stats.target_only_steps()),
              static_cast<unsigned long long>(stats.steps()),
              static_cast<unsigned long long>(stats.accepted_tokens()));
  // Catching up on the prompt's taps: steps without a tree; then the head drafts.
  EXPECT_GT(stats.target_only_steps(), 0u);
  EXPECT_GT(stats.steps(), 0u);
  EXPECT_GT(stats.accepted_tokens(), 0u);
}

TEST(EagleClusterTest, KilledDraftServiceLosesNoRequest) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  const int kTokens = 400;
  v1::GenerateRequest r = Request(Prompts()[1], kTokens, v1::SPECULATION_OFF);
  const Result reference = c->Generate(r);
  ASSERT_TRUE(reference.status.ok());
  r.set_speculation(v1::SPECULATION_EAGLE3);
  r.set_draft_depth(4);
  bool killed = false;
  const Result got = c->Generate(r, [&](int chunk) {
    if (chunk == 3 && !killed) {
      killed = true;
      ::kill(c->draft->pid(), SIGKILL);
    }
  });
  ASSERT_TRUE(killed);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.tokens, reference.tokens);
  EXPECT_GT(got.last.speculation().target_only_steps(), 0u);
  EXPECT_GT(got.last.speculation().steps(), 0u);  // it drafted with the head before the kill
  // Without the draft service the router offers what it can still serve itself (as soon as its
  // stream has seen the service go: the request above ran target-only steps after that).
  const std::vector<int> alone = {v1::SPECULATION_AUTO, v1::SPECULATION_OFF, v1::SPECULATION_NGRAM};
  const absl::Time gone_by = absl::Now() + absl::Seconds(10);
  while (absl::Now() < gone_by && Modes(c->stub.get()) != alone) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(Modes(c->stub.get()), alone);

  // A new draft process: new EAGLE requests draft again.
  c->draft.reset();
  absl::StatusOr<std::unique_ptr<ServiceProcess>> draft = ServiceProcess::Start(c->draft_options);
  ASSERT_TRUE(draft.ok()) << draft.status();
  c->draft = *std::move(draft);
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while (absl::Now() < end && c->Metric("specd_draft_available") != 1) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(Modes(c->stub.get()).back(), v1::SPECULATION_EAGLE3);
  r.set_max_new_tokens(64);
  const Result again = c->Generate(r);
  ASSERT_TRUE(again.status.ok());
  EXPECT_EQ(again.tokens,
            std::vector<int32_t>(reference.tokens.begin(), reference.tokens.begin() + 64));
  EXPECT_EQ(again.last.speculation().mode(), v1::SPECULATION_EAGLE3);
  EXPECT_GT(again.last.speculation().accepted_tokens(), 0u);
}

// A draft service restarted while a sequence runs takes it back: the router feeds it the whole
// history and the verify service's taps from then on, and the head starts from where they begin
// (EagleDrafter's base). Verify steps with trees resume; the output stays target-only decoding's.
TEST(EagleClusterTest, RunningSequencesDraftAgainAfterADraftServiceRestart) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  const int kTokens = 900;  // within the target's 1,024 positions
  v1::GenerateRequest r = Request(Prompts()[2], kTokens, v1::SPECULATION_OFF);
  const Result reference = c->Generate(r);
  ASSERT_TRUE(reference.status.ok());
  r.set_speculation(v1::SPECULATION_EAGLE3);
  r.set_draft_depth(4);
  r.set_draft_top_k(4);
  r.set_draft_max_nodes(16);
  bool killed = false, back = false;
  double drafted_when_back = -1;
  const Result got = c->Generate(r, [&](int chunk) {
    if (chunk == 3 && !killed) {
      killed = true;
      ::kill(c->draft->pid(), SIGKILL);
    } else if (chunk == 6 && killed && !back) {
      back = true;
      c->draft.reset();
      absl::StatusOr<std::unique_ptr<ServiceProcess>> draft =
          ServiceProcess::Start(c->draft_options);
      ASSERT_TRUE(draft.ok()) << draft.status();
      c->draft = *std::move(draft);
      const absl::Time end = absl::Now() + absl::Seconds(20);
      while (absl::Now() < end && c->Metric("specd_draft_available") != 1) {
        absl::SleepFor(absl::Milliseconds(20));
      }
      drafted_when_back = c->Metric("specd_spec_decode_steps_total");
    }
  });
  ASSERT_TRUE(killed && back);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.tokens, reference.tokens);
  const double drafted = c->Metric("specd_spec_decode_steps_total");
  std::printf("verify steps with a tree: %.0f by the restart, %.0f in all\n", drafted_when_back,
              drafted);
  EXPECT_GE(drafted_when_back, 0);
  EXPECT_GT(drafted, drafted_when_back);
}

}  // namespace
}  // namespace specd
