// The tensor-parallel sharding plan (engine/tp/tp_plan.h), checked exhaustively over world sizes
// 1..9 and head layouts that N does not divide; vocabulary-parallel token choice against
// SampleToken(); and the CPU tree-attention kernel on a head slice with offsets.
#include "engine/tp/tp_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/sampling.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "specd/kernels/tree_attention.h"

namespace specd {
namespace {

using ::testing::HasSubstr;

ModelConfig Config(int heads, int kv_heads, int ffn, int vocab) {
  ModelConfig c;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.intermediate_size = ffn;
  c.vocab_size = vocab;
  c.head_dim = 8;
  c.hidden_size = 64;
  return c;
}

// Ranges cover [0, total) exactly once, contiguously in rank order, begin on multiples of
// `align`, and their sizes differ by at most `align` (at most 1 when align is 1).
void ExpectPartition(const std::vector<TpRange>& ranges, int64_t total, int64_t align,
                     const std::string& what) {
  int64_t at = 0, lo = total, hi = 0;
  for (size_t r = 0; r < ranges.size(); ++r) {
    EXPECT_EQ(ranges[r].begin, at) << what << " rank " << r;
    EXPECT_LE(ranges[r].begin, ranges[r].end) << what << " rank " << r;
    EXPECT_EQ(ranges[r].begin % align, 0) << what << " rank " << r;
    at = ranges[r].end;
    lo = std::min(lo, ranges[r].size());
    hi = std::max(hi, ranges[r].size());
  }
  EXPECT_EQ(at, total) << what;
  EXPECT_LE(hi - lo, align) << what;
}

struct Heads {
  int q, kv;
};

TEST(TpPlanTest, EveryHeadFfnColumnAndTokenOwnedOnceWithTheKvHeadsItNeeds) {
  const std::vector<Heads> heads = {{64, 8}, {32, 8}, {28, 4}, {3, 1}, {7, 7},
                                    {5, 1},  {14, 2}, {6, 3},  {1, 1}, {40, 8}};
  const std::vector<int> ffns = {1, 7, 44, 160, 18944, 28672};
  const std::vector<int> vocabs = {5, 299, 128256, 151936};
  const std::vector<int64_t> aligns = {1, 8, 64};
  int plans = 0;
  for (int n = 1; n <= 9; ++n) {
    for (const Heads& h : heads) {
      for (size_t i = 0; i < ffns.size(); ++i) {
        const int64_t align = aligns[(i + n) % aligns.size()];
        const int vocab = vocabs[(i + h.q) % vocabs.size()];
        const std::string what = absl::StrCat("N=", n, " heads ", h.q, "/", h.kv, " ffn ", ffns[i],
                                              " vocab ", vocab, " align ", align);
        TpPlanOptions options;
        options.ffn_align = align;
        options.vocab_align = align;
        absl::StatusOr<TpPlan> plan = MakeTpPlan(Config(h.q, h.kv, ffns[i], vocab), n, options);
        ASSERT_TRUE(plan.ok()) << what << ": " << plan.status();
        ++plans;
        ASSERT_EQ(plan->world_size, n);
        ASSERT_EQ(static_cast<int>(plan->ranks.size()), n);
        const int group = h.q / h.kv;
        EXPECT_EQ(plan->kv_group, group);

        std::vector<TpRange> q, ffn, voc;
        for (const TpRankPlan& rp : plan->ranks) {
          q.push_back(rp.q_heads);
          ffn.push_back(rp.ffn);
          voc.push_back(rp.vocab);
        }
        ExpectPartition(q, h.q, 1, what + " query heads");
        ExpectPartition(ffn, ffns[i], align, what + " ffn");
        ExpectPartition(voc, vocab, align, what + " vocab");

        // KV heads: exactly those the rank's query heads read; replicas counted right.
        std::vector<int> holders(h.kv, 0);
        for (int r = 0; r < n; ++r) {
          const TpRankPlan& rp = plan->ranks[r];
          std::vector<bool> needed(h.kv, false);
          for (int64_t qh = rp.q_heads.begin; qh < rp.q_heads.end; ++qh) {
            needed[qh / group] = true;
            EXPECT_TRUE(rp.kv_heads.contains(qh / group)) << what << " rank " << r;
          }
          for (int kv = 0; kv < h.kv; ++kv) {
            EXPECT_EQ(rp.kv_heads.contains(kv), needed[kv])
                << what << " rank " << r << " kv " << kv;
            holders[kv] += rp.kv_heads.contains(kv) ? 1 : 0;
          }
          EXPECT_EQ(rp.q_heads.empty(), rp.kv_heads.empty()) << what << " rank " << r;
        }
        ASSERT_EQ(static_cast<int>(plan->kv_replicas.size()), h.kv);
        for (int kv = 0; kv < h.kv; ++kv) {
          EXPECT_GE(holders[kv], 1) << what << " kv " << kv;
          EXPECT_EQ(plan->kv_replicas[kv], holders[kv]) << what << " kv " << kv;
        }
      }
    }
  }
  EXPECT_EQ(plans, 9 * 10 * 6);
}

// The reference deployment: Llama-3.1-70B (64 query heads, 8 KV heads, 28672 FFN columns,
// 128256 tokens) on 7 GPUs.
TEST(TpPlanTest, Llama70BOnSevenRanks) {
  TpPlanOptions options;
  options.ffn_align = 64;
  absl::StatusOr<TpPlan> plan = MakeTpPlan(Config(64, 8, 28672, 128256), 7, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<int64_t> sizes;
  for (const TpRankPlan& rp : plan->ranks) sizes.push_back(rp.q_heads.size());
  EXPECT_EQ(sizes, (std::vector<int64_t>{10, 9, 9, 9, 9, 9, 9}));
  // Rank 1 holds heads 10..18: the last six of KV head 1's group and the first three of 2's.
  EXPECT_EQ(plan->ranks[1].q_heads.begin, 10);
  EXPECT_EQ(plan->ranks[1].kv_heads.begin, 1);
  EXPECT_EQ(plan->ranks[1].kv_heads.end, 3);
  EXPECT_EQ(plan->ranks[6].kv_heads.begin, 6);
  EXPECT_EQ(plan->ranks[6].kv_heads.end, 8);
  // KV heads 1..6 have query heads on two ranks, so two copies each; 0 and 7 have one.
  EXPECT_EQ(plan->kv_replicas, (std::vector<int>{1, 2, 2, 2, 2, 2, 2, 1}));
  // 448 units of 64 columns over 7 ranks: 64 each.
  for (const TpRankPlan& rp : plan->ranks) EXPECT_EQ(rp.ffn.size(), 64 * 64);
}

TEST(TpPlanTest, SplitEvenlyPutsTheRemainderLast) {
  const std::vector<TpRange> r = SplitEvenly(100, 3, 8);  // 12 units of 8, 4 left over
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].size(), 32);
  EXPECT_EQ(r[1].size(), 32);
  EXPECT_EQ(r[2].size(), 36);
  const std::vector<TpRange> s = SplitEvenly(3, 7);
  for (int i = 0; i < 7; ++i) EXPECT_EQ(s[i].size(), i < 3 ? 1 : 0);
}

TEST(TpPlanTest, RejectsBadArgumentsByName) {
  absl::StatusOr<TpPlan> zero = MakeTpPlan(Config(8, 2, 16, 32), 0);
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(zero.status().message(), HasSubstr("tensor_parallel"));
  absl::StatusOr<TpPlan> gqa = MakeTpPlan(Config(6, 4, 16, 32), 2);
  EXPECT_EQ(gqa.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(gqa.status().message(), HasSubstr("num_key_value_heads"));
  TpPlanOptions bad;
  bad.ffn_align = 0;
  EXPECT_THAT(MakeTpPlan(Config(8, 2, 16, 32), 2, bad).status().message(), HasSubstr("ffn_align"));
}

// Reducing one candidate per vocabulary shard gives exactly SampleToken() of the whole row,
// for greedy and for unfiltered temperature sampling, including ties across shard borders.
TEST(TpPlanTest, VocabParallelCandidatesReproduceSampleToken) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int vocab = 37;
  int checked = 0;
  for (int trial = 0; trial < 60; ++trial) {
    std::vector<float> logits(vocab);
    for (float& x : logits) x = normal(rng);
    if (trial % 3 == 0) {
      // Ties for the maximum in different shards: the lowest id must win.
      const float top = *std::max_element(logits.begin(), logits.end()) + 1.0f;
      logits[trial % vocab] = top;
      logits[(trial * 7 + 20) % vocab] = top;
    }
    std::vector<SamplingParams> params(4);
    params[1].temperature = 0.7f;
    params[1].seed = 11 + trial;
    params[2].temperature = 1.3f;
    params[2].seed = 99;
    params[3].temperature = 1e-3f;  // nearly greedy, but through the Gumbel path
    params[3].seed = trial;
    for (const SamplingParams& p : params) {
      ASSERT_TRUE(VocabParallelSamplingSupported(p));
      const int32_t want = SampleToken(logits, p, /*position=*/trial * 3 + 1);
      for (int n = 1; n <= 9; ++n) {
        std::vector<VocabCandidate> cands;
        for (const TpRange& r : SplitEvenly(vocab, n)) {
          cands.push_back(ShardCandidate(absl::Span<const float>(logits).subspan(r.begin, r.size()),
                                         r, p, trial * 3 + 1));
        }
        EXPECT_EQ(ReduceCandidates(cands).token, want) << "trial " << trial << " N " << n;
        std::reverse(cands.begin(), cands.end());
        EXPECT_EQ(ReduceCandidates(cands).token, want) << "trial " << trial << " N " << n;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 60 * 4 * 9);
  SamplingParams top_k;
  top_k.temperature = 1.0f;
  top_k.top_k = 5;
  EXPECT_FALSE(VocabParallelSamplingSupported(top_k));
  SamplingParams top_p;
  top_p.temperature = 1.0f;
  top_p.top_p = 0.9f;
  EXPECT_FALSE(VocabParallelSamplingSupported(top_p));
}

// Log-probabilities merged from shard statistics equal ComputeLogprobs() of the whole row, raw
// and processed, greedy and tempered, for 1-9 shards (empty ones at N > vocab / 2 included),
// n up to kMaxLogprobs (more than a shard holds), ties across shards (lowest id first) and a
// row with -inf logits (probability 0, never listed). Shards given in any order.
TEST(TpPlanTest, ShardLogprobStatsMergeToComputeLogprobs) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  int checked = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const int vocab = trial % 4 == 0 ? 13 : 211;
    std::vector<float> logits(vocab);
    for (float& x : logits) x = normal(rng);
    if (trial % 3 == 0) {
      logits[trial % vocab] = logits[(trial * 7 + 5) % vocab] = 9.5f;  // tied best
      logits[(trial + 3) % vocab] = logits[(trial * 5 + 8) % vocab] = 1.25f;
    }
    if (trial % 5 == 0) {
      for (int i = 0; i < vocab; i += 3) logits[i] = -std::numeric_limits<float>::infinity();
    }
    std::vector<SamplingParams> params(3);
    params[1].temperature = 0.7f;
    params[2].temperature = 1.9f;
    for (const SamplingParams& p : params) {
      for (LogprobsMode mode : {LogprobsMode::kRaw, LogprobsMode::kProcessed}) {
        int32_t token = (trial * 13 + 1) % vocab;
        if (std::isinf(logits[token])) token = (token + 1) % vocab;  // emitted: never masked
        for (int n : {0, 1, 7, kMaxLogprobs}) {
          const TokenLogprobs want = ComputeLogprobs(logits, logits, p, mode, token, n);
          const double scale = LogprobScale(p, mode);
          for (int world = 1; world <= 9; ++world) {
            const std::string what = absl::StrCat("trial ", trial, " t ", p.temperature, " mode ",
                                                  static_cast<int>(mode), " n ", n, " N ", world);
            std::vector<ShardLogprobStats> shards;
            for (const TpRange& r : SplitEvenly(vocab, world, vocab < 20 ? 4 : 1)) {
              shards.push_back(ComputeShardLogprobStats(
                  absl::Span<const float>(logits).subspan(r.begin, r.size()), r, scale,
                  logits[token], n));
            }
            std::reverse(shards.begin(), shards.end());
            const TokenLogprobs got = MergeShardLogprobStats(shards, scale, logits[token], n);
            EXPECT_NEAR(got.logprob, want.logprob, 1e-6) << what;
            EXPECT_EQ(got.rank, want.rank) << what;
            ASSERT_EQ(got.top.size(), want.top.size()) << what;
            for (size_t k = 0; k < want.top.size(); ++k) {
              EXPECT_EQ(got.top[k].token, want.top[k].token) << what << " top " << k;
              EXPECT_NEAR(got.top[k].logprob, want.top[k].logprob, 1e-6) << what << " top " << k;
            }
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 40 * 3 * 2 * 4 * 9);
}

// A rank's slice of query heads (with the KV heads it holds) attends exactly as those heads do
// in the unsliced kernel call, bit for bit, for every slice of a 64/8-style layout in small.
TEST(TpPlanTest, TreeAttentionOnAHeadSliceMatchesTheFullCall) {
  const int64_t heads = 12, kv_heads = 3, d = 8, group = 4, block = 4;
  const int64_t prefix = 6, queries = 3, slots = 16;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(queries * heads * d), kc(slots * kv_heads * d), vc(slots * kv_heads * d);
  for (float& x : q) x = normal(rng);
  for (float& x : kc) x = normal(rng);
  for (float& x : vc) x = normal(rng);
  const std::vector<int32_t> table = {2, 0, 3, 1};
  const std::vector<int32_t> query_seq(queries, 0), prefix_len(queries, prefix);
  // A small tree: node 0 under the prefix, nodes 1 and 2 children of node 0.
  const std::vector<int32_t> offsets = {0, 1, 3, 5};
  const std::vector<int32_t> keys = {6, 6, 7, 6, 8};
  TreeAttentionParams full;
  full.q = q.data();
  full.kv.k_cache = kc.data();
  full.kv.v_cache = vc.data();
  full.kv.block_tables = table.data();
  full.query_seq = query_seq.data();
  full.prefix_len = prefix_len.data();
  full.tree_key_offsets = offsets.data();
  full.tree_keys = keys.data();
  full.num_queries = queries;
  full.num_heads = heads;
  full.num_kv_heads = kv_heads;
  full.head_dim = d;
  full.kv.block_size = block;
  full.kv.max_blocks_per_seq = 4;
  full.scale = 0.35f;
  std::vector<float> want(queries * heads * d);
  full.out = want.data();
  TreeAttentionCpu(full);

  for (int n = 1; n <= 7; ++n) {
    for (const TpRange& qr : SplitEvenly(heads, n)) {
      if (qr.empty()) continue;
      const int64_t kv_begin = qr.begin / group, kv_end = (qr.end - 1) / group + 1;
      const int64_t qh = qr.size(), kvh = kv_end - kv_begin;
      // The rank's own buffers: its query heads, and a cache holding only its KV heads.
      std::vector<float> lq(queries * qh * d), lk(slots * kvh * d), lv(slots * kvh * d);
      for (int64_t t = 0; t < queries; ++t) {
        std::copy_n(&q[(t * heads + qr.begin) * d], qh * d, &lq[t * qh * d]);
      }
      for (int64_t s = 0; s < slots; ++s) {
        std::copy_n(&kc[(s * kv_heads + kv_begin) * d], kvh * d, &lk[s * kvh * d]);
        std::copy_n(&vc[(s * kv_heads + kv_begin) * d], kvh * d, &lv[s * kvh * d]);
      }
      TreeAttentionParams p = full;
      std::vector<float> got(queries * qh * d);
      p.q = lq.data();
      p.out = got.data();
      p.kv.k_cache = lk.data();
      p.kv.v_cache = lv.data();
      p.num_heads = qh;
      p.num_kv_heads = kvh;
      p.kv_group = group;
      p.q_head_offset = qr.begin;
      p.kv_head_offset = kv_begin;
      TreeAttentionCpu(p);
      for (int64_t t = 0; t < queries; ++t) {
        for (int64_t i = 0; i < qh * d; ++i) {
          ASSERT_EQ(got[t * qh * d + i], want[(t * heads + qr.begin) * d + i])
              << "N " << n << " heads [" << qr.begin << ", " << qr.end << ") query " << t;
        }
      }
    }
  }
}

}  // namespace
}  // namespace specd
