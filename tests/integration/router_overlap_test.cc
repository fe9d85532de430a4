// The router cluster with overlap (--overlap): pre-drafting while verify runs keeps greedy and
// seeded output identical and sampled output distributed as the target's, with one guess or
// several (a chain's inner outcomes among them), under the goodput policy, and never waits out
// a late pre-draft.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/text/tokenizer.h"
#include "engine/backend.h"
#include "gtest/gtest.h"
#include "specd/v1/generation.grpc.pb.h"
#include "tests/integration/router_cluster_fixture.h"
#include "tests/testutil/chi_square.h"
#include "tests/testutil/random_checkpoint.h"
#include "tests/testutil/service_process.h"

namespace specd {
namespace {

using namespace router_cluster;  // NOLINT: the fixture of this test family

// specd_predraft_outcomes_total{result} summed over the accepted positions.
double PreDraftOutcomes(int port, const char* result) {
  double sum = 0;
  for (const std::string pos : {"0", "1", "2", "3", "4", "5", "6", "7", "8+"}) {
    const double v = Cluster::Metric(port, "specd_predraft_outcomes_total",
                                     {{"position", pos}, {"result", result}});
    sum += std::isnan(v) ? 0 : v;
  }
  return sum;
}

// Overlap: pre-drafts hit (the draft is the target's first layer, so its greedy path is often
// the target's), greedy and seeded outputs stay those of target-only decoding, alone and
// batched, and the metrics count hits, misses and how each miss was served.
void ExpectOverlapLossless(Cluster* c, int clients, bool expect_hits) {
  ExpectGreedyAndSeededMatchOff(*c, Prompts(12), /*tokens=*/40, clients,
                                v1::SPECULATION_DRAFT_MODEL, /*temperature=*/0.8f, /*top_k=*/30,
                                /*seed=*/11);
  const int port = c->router_metrics;
  const double hits = PreDraftOutcomes(port, "hit");
  // A late pre-draft (one that outlasted the router's wait) is served as a miss.
  const double misses = PreDraftOutcomes(port, "miss") + PreDraftOutcomes(port, "late");
  std::printf("pre-drafts: %.0f hits, %.0f misses (%.0f late)\n", hits, misses,
              PreDraftOutcomes(port, "late"));
  if (expect_hits) {
    EXPECT_GT(hits, 0);
    EXPECT_GT(misses, 0);
    // Every miss of a sequence that went on is served by a late draft or a plain step.
    const double late =
        Cluster::Metric(port, "specd_predraft_misses_total", {{"served", "drafted_late"}});
    const double plain =
        Cluster::Metric(port, "specd_predraft_misses_total", {{"served", "plain_step"}});
    EXPECT_GT(late + plain, 0);
    EXPECT_LE(late + plain, misses);
  }
  // Every hit is exactly one guess's, by its rank; a rank hits at most as often as it is guessed.
  double rank_hits = 0;
  for (int rank = 0; rank < 8; ++rank) {
    const std::map<std::string, std::string> label = {{"guess", std::to_string(rank)}};
    const double guessed = Cluster::Metric(port, "specd_predraft_guesses_total", label);
    const double hit = Cluster::Metric(port, "specd_predraft_guess_hits_total", label);
    EXPECT_LE(hit, guessed) << "guess " << rank;
    rank_hits += hit;
  }
  EXPECT_EQ(rank_hits, hits);
  EXPECT_LE(Cluster::Metric(port, "specd_predraft_guesses_total", {{"guess", "0"}}),
            hits + PreDraftOutcomes(port, "miss"));
  EXPECT_GT(Cluster::Metric(port, "specd_router_step_seconds_total"), 0);
  EXPECT_GT(Cluster::Metric(port, "specd_service_busy_seconds_total", {{"service", "verify"}}), 0);
  EXPECT_GT(Cluster::Metric(port, "specd_router_wait_seconds_total", {{"service", "draft"}}), 0);
}

TEST(RouterClusterTest, OverlapKeepsGreedyAndSeededOutputIdentical) {
  ClusterOptions options;
  // Every step drafts the same shape, so every step also pre-drafts; one guess each.
  options.router_args = {"--overlap=on", "--overlap_max_fan_out=1", "--speculation_policy=fixed"};
  std::unique_ptr<Cluster> c = Cluster::Start(options);
  ASSERT_NE(c, nullptr);
  ExpectOverlapLossless(c.get(), 1, /*expect_hits=*/true);
  ExpectOverlapLossless(c.get(), 4, /*expect_hits=*/true);
}

// Several outcome guesses per sequence (as many as the cost model fits in the verify step, up
// to 3): the draft service grows a tree below each, and a hit on any is verified next.
TEST(RouterClusterTest, OverlapWithSeveralGuessesKeepsGreedyAndSeededOutputIdentical) {
  ClusterOptions options;
  options.router_args = {"--overlap=on", "--overlap_max_fan_out=3", "--speculation_policy=fixed"};
  std::unique_ptr<Cluster> c = Cluster::Start(options);
  ASSERT_NE(c, nullptr);
  ExpectOverlapLossless(c.get(), 1, /*expect_hits=*/true);
  ExpectOverlapLossless(c.get(), 4, /*expect_hits=*/true);
  // The further guesses were sent and counted by their rank.
  EXPECT_GT(Cluster::Metric(c->router_metrics, "specd_predraft_guesses_total", {{"guess", "1"}}),
            0);
}

// A top-1 chain's inner outcomes: with several guesses, the draft service guesses "accepted up
// to node a, then the target emits the draft's runner-up below a" beside "all accepted", so
// pre-drafts hit where the chain is cut short too (specd_predraft_outcomes_total at positions
// below the depth), and greedy output stays target-only's.
TEST(RouterClusterTest, OverlapOnAChainHitsAtInnerPositions) {
  ClusterOptions options;
  options.router_args = {"--overlap=on",    "--overlap_max_fan_out=4", "--speculation_policy=fixed",
                         "--draft_depth=4", "--draft_top_k=1",         "--draft_max_nodes=4"};
  std::unique_ptr<Cluster> c = Cluster::Start(options);
  ASSERT_NE(c, nullptr);
  const int kTokens = 48;
  for (const std::string& prompt : Prompts(12)) {
    SCOPED_TRACE(prompt);
    const Result off = c->Generate(Greedy(prompt, kTokens, v1::SPECULATION_OFF));
    const Result on = c->Generate(Greedy(prompt, kTokens, v1::SPECULATION_DRAFT_MODEL));
    ASSERT_TRUE(off.status.ok()) << off.status.error_message();
    ASSERT_TRUE(on.status.ok()) << on.status.error_message();
    EXPECT_EQ(on.tokens, off.tokens);
    EXPECT_EQ(on.text, off.text);
  }
  const int port = c->router_metrics;
  double inner_hits = 0;
  for (const std::string pos : {"0", "1", "2", "3"}) {
    const double v = Cluster::Metric(port, "specd_predraft_outcomes_total",
                                     {{"position", pos}, {"result", "hit"}});
    std::printf("position %s: %.0f hits\n", pos.c_str(), std::isnan(v) ? 0.0 : v);
    inner_hits += std::isnan(v) ? 0 : v;
  }
  EXPECT_GT(inner_hits, 0);
  // The inner outcomes are the further guesses (the first is the whole chain accepted).
  double later = 0;
  for (const char* rank : {"1", "2", "3"}) {
    const double v = Cluster::Metric(port, "specd_predraft_guess_hits_total", {{"guess", rank}});
    later += std::isnan(v) ? 0 : v;
  }
  EXPECT_GT(later, 0);
}

TEST(RouterClusterTest, OverlapAutoUnderTheGoodputPolicyKeepsOutputIdentical) {
  ClusterOptions options;
  options.router_args = {"--overlap=auto"};
  std::unique_ptr<Cluster> c = Cluster::Start(options);
  ASSERT_NE(c, nullptr);
  // Whether auto pre-drafts depends on measured costs, so hits are not required here.
  ExpectOverlapLossless(c.get(), 1, /*expect_hits=*/false);
  ExpectOverlapLossless(c.get(), 4, /*expect_hits=*/false);
  // Every step with trees to pre-draft was judged, and each pre-drafted one was judged to pay
  // or was a probe: a pre-draft's sequences are at most the batch of 4 each.
  double judged = 0;
  for (const char* d : {"pays", "no_fit", "no_gain", "probe", "refresh"}) {
    judged +=
        Cluster::Metric(c->router_metrics, "specd_overlap_decisions_total", {{"decision", d}});
  }
  EXPECT_GT(judged, 0);
  const double sent =
      Cluster::Metric(c->router_metrics, "specd_overlap_decisions_total", {{"decision", "pays"}}) +
      Cluster::Metric(c->router_metrics, "specd_overlap_decisions_total", {{"decision", "probe"}});
  const int port = c->router_metrics;
  EXPECT_LE(PreDraftOutcomes(port, "hit") + PreDraftOutcomes(port, "miss") +
                PreDraftOutcomes(port, "late"),
            4 * sent);
}

// Sampling with overlap follows the target's distribution. Seeded equality
// (OverlapKeepsGreedyAndSeededOutputIdentical) pairs runs that share seeds; here n requests
// sampled target-only and n sampled with pre-drafts use unrelated seeds, and a two-sample
// chi-square test at p = 0.001 compares the pair of tokens at positions 5 and 6 (past the first
// steps, so pre-drafted trees produced many of them), over the pairs seen at least 10 times in
// all (the rest pooled).
TEST(RouterClusterTest, OverlapSamplingFollowsTheTargetDistribution) {
  ClusterOptions options;
  options.router_args = {"--overlap=on", "--speculation_policy=fixed"};
  std::unique_ptr<Cluster> c = Cluster::Start(options);
  ASSERT_NE(c, nullptr);
  constexpr int kRequests = 1500, kTokens = 8, kClients = 8;
  using Pair = std::pair<int32_t, int32_t>;
  auto sample = [&](v1::Speculation speculation, uint64_t seed0) {
    std::vector<Pair> pairs(kRequests);
    std::vector<std::thread> threads;
    std::atomic<int> next{0};
    for (int t = 0; t < kClients; ++t) {
      threads.emplace_back([&] {
        for (int i; (i = next++) < kRequests;) {
          v1::GenerateRequest r = Greedy("def fibonacci(n):", kTokens, speculation);
          r.set_temperature(1.0f);
          r.set_top_k(4);
          r.set_seed(seed0 + i);
          const Result result = c->Generate(r);
          EXPECT_TRUE(result.status.ok()) << result.status.error_message();
          if (result.tokens.size() == kTokens) pairs[i] = {result.tokens[5], result.tokens[6]};
        }
      });
    }
    for (std::thread& t : threads) t.join();
    return pairs;
  };
  const std::vector<Pair> off = sample(v1::SPECULATION_OFF, 1);
  const std::vector<Pair> on = sample(v1::SPECULATION_DRAFT_MODEL, 1000003);
  std::map<Pair, std::pair<int, int>> counts;
  for (const Pair& p : off) ++counts[p].first;
  for (const Pair& p : on) ++counts[p].second;
  std::vector<int> a(1, 0), b(1, 0);  // bin 0: the pool
  for (const auto& [pair, n] : counts) {
    const bool own_bin = n.first + n.second >= 10;
    if (own_bin) {
      a.push_back(n.first);
      b.push_back(n.second);
    } else {
      a[0] += n.first;
      b[0] += n.second;
    }
  }
  const auto [chi2, df] = TwoSampleChiSquare(a, b);
  ASSERT_GE(df, 8) << "too few bins for a meaningful test";
  EXPECT_LT(chi2, ChiSquareCritical001(df)) << "overlap vs target-only, df " << df;
  const int port = c->router_metrics;
  EXPECT_GT(PreDraftOutcomes(port, "hit"), 0);
  std::printf("chi2 %.1f df %d; pre-drafts %.0f hits, %.0f misses, %.0f late\n", chi2, df,
              PreDraftOutcomes(port, "hit"), PreDraftOutcomes(port, "miss"),
              PreDraftOutcomes(port, "late"));
}

// A draft service that answers every pre-draft long after verify (its test-only delay stands
// for a draft device slower than the target's) must not hold the cluster up: the router waits
// for a pre-draft at most the cost model's draft time past verify's answer, serves its sequences
// as misses (plain steps while the late answer holds the draft stream) and drops the answer when
// it comes. Waiting for it even once would take the delay; outputs stay target-only's.
TEST(RouterClusterTest, OverlapNeverWaitsOutALatePreDraft) {
  constexpr int kDelayMs = 4000;
  ClusterOptions options;
  options.router_args = {"--overlap=on", "--speculation_policy=fixed"};
  options.draft_args = {absl::StrCat("--test_only_pre_draft_delay_ms=", kDelayMs)};
  std::unique_ptr<Cluster> c = Cluster::Start(options);
  ASSERT_NE(c, nullptr);
  const int kTokens = 48;
  for (const std::string& prompt : Prompts(4)) {
    SCOPED_TRACE(prompt);
    v1::GenerateRequest sampled = Greedy(prompt, kTokens, v1::SPECULATION_OFF);
    sampled.set_temperature(0.8f);
    sampled.set_seed(5);
    const Result off = c->Generate(Greedy(prompt, kTokens, v1::SPECULATION_OFF));
    const Result seeded_off = c->Generate(sampled);
    absl::Time start = absl::Now();
    const Result on = c->Generate(Greedy(prompt, kTokens, v1::SPECULATION_DRAFT_MODEL));
    const absl::Duration greedy_took = absl::Now() - start;
    sampled.set_speculation(v1::SPECULATION_DRAFT_MODEL);
    start = absl::Now();
    const Result seeded = c->Generate(sampled);
    const absl::Duration seeded_took = absl::Now() - start;
    for (const Result* r : {&off, &seeded_off, &on, &seeded}) {
      ASSERT_TRUE(r->status.ok()) << r->status.error_message();
    }
    EXPECT_EQ(on.tokens, off.tokens);
    EXPECT_EQ(seeded.tokens, seeded_off.tokens);
    EXPECT_LT(greedy_took, absl::Milliseconds(kDelayMs));
    EXPECT_LT(seeded_took, absl::Milliseconds(kDelayMs));
  }
  const int port = c->router_metrics;
  EXPECT_GT(PreDraftOutcomes(port, "late"), 0);
  EXPECT_GT(Cluster::Metric(port, "specd_target_only_steps_total", {{"reason", "draft_busy"}}), 0);
  EXPECT_LT(Cluster::Metric(port, "specd_router_wait_seconds_total", {{"service", "draft"}}),
            kDelayMs / 1000.0);
}

}  // namespace
}  // namespace specd
