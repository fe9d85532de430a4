// The goodput policy run against a model of a GPU serving an 8B-shape pair with a one-layer
// draft (acceptance about 0.6 a level, a chain of 4 giving tau about 2.4), with sequences that
// arrive, generate and leave at a fixed concurrency, as the serving benchmark drives the router.
// The device's costs are the shape the H200 showed for that pair (bench/CURRENT.md): verify
// nearly flat in tokens at one row, steeply dearer per token at four rows, moderately at 16 and
// 64; a draft level costing about a millisecond whatever the batch; a prompt fed to the drafter
// at ~11 us a token. Against it, `auto` must be within a few percent of the better of
// speculation off and the best fixed shape at every concurrency, and never clearly below off:
// the policy learns the costs from the steps it runs, as in production, starting from the CPU
// priors.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <vector>

#include "engine/spec/policy.h"
#include "gtest/gtest.h"

namespace specd {
namespace {

// A device's step costs, in seconds.
class Device {
 public:
  virtual ~Device() = default;
  // A verify step of `rows` rows scoring `tokens` tokens (padded, where the backend pads).
  virtual double Verify(int rows, int tokens) const = 0;
  // A draft call: `levels` forwards, `nodes` nodes in all, after feeding `catch_up` tokens.
  virtual double Draft(int levels, int nodes, int catch_up) const = 0;
  // Whether the verify backend pads rows (VerifyStepTokens).
  virtual bool padded() const = 0;
};

class GpuDevice : public Device {
 public:
  // Verify: base(rows) + slope(rows) * (padded tokens - rows), seconds; rows between the
  // measured counts take the next measured count's figures (as a padded backend runs them).
  double Verify(int rows, int tokens) const override {
    struct Point {
      int rows;
      double base_ms, slope_ms;
    };
    static constexpr Point kPoints[] = {
        {1, 5.3, 0.02}, {4, 5.35, 0.245}, {16, 6.0, 0.033}, {64, 9.8, 0.05}, {256, 30.0, 0.05}};
    for (const Point& p : kPoints) {
      if (rows <= p.rows) return 1e-3 * (p.base_ms + p.slope_ms * std::max(0, tokens - rows));
    }
    return 1e-3 * (30.0 + 0.1 * tokens);
  }
  // A draft call: its gRPC round trip, one forward per level, and the catch-up tokens fed first.
  double Draft(int levels, int nodes, int catch_up) const override {
    const double per_level = static_cast<double>(nodes) / std::max(levels, 1);
    return 1e-3 * (0.6 + levels * (0.75 + 0.015 * per_level)) + 11e-6 * catch_up;
  }
  bool padded() const override { return true; }
};

// The CPU of the GPU host serving the reference pair (pycoder-target verified, pycoder-draft
// drafting), each service on a core of its own with one engine thread, overlap off
// (bench/CURRENT.md, policy section): a verify step costs about its tokens, whatever the rows
// (a CPU forward is compute-bound from the first token), from ~11.5 ms for one token to ~60 ms
// for 16 and ~115 ms for 32; a draft level ~2.6 ms for one sequence and ~4.4 ms for four,
// sequential with verify; a token of catch-up fed to the drafter ~80 us.
class CpuDevice : public Device {
 public:
  CpuDevice() = default;
  // A draft level costing `level_ms` + `level_token_ms` per token at that level, and a token
  // of catch-up `catch_up_ms`.
  CpuDevice(double level_ms, double level_token_ms, double catch_up_ms)
      : level_ms_(level_ms), level_token_ms_(level_token_ms), catch_up_ms_(catch_up_ms) {}
  double Verify(int rows, int tokens) const override {
    struct Point {
      int tokens;
      double ms;
    };
    static constexpr Point kPoints[] = {{1, 11.5},  {4, 19.0},   {8, 26.0},
                                        {16, 60.0}, {32, 115.0}, {64, 215.0}};
    tokens = std::max(tokens, rows);
    const Point* lo = &kPoints[0];
    for (const Point& p : kPoints) {
      if (tokens <= p.tokens) {
        if (p.tokens == lo->tokens) return 1e-3 * p.ms;
        const double f = static_cast<double>(tokens - lo->tokens) / (p.tokens - lo->tokens);
        return 1e-3 * (lo->ms + f * (p.ms - lo->ms));
      }
      lo = &p;
    }
    return 1e-3 * (215.0 + 3.2 * (tokens - 64));
  }
  double Draft(int levels, int nodes, int catch_up) const override {
    const double per_level = static_cast<double>(nodes) / std::max(levels, 1);
    return 1e-3 *
           (0.5 + levels * (level_ms_ + level_token_ms_ * per_level) + catch_up_ms_ * catch_up);
  }
  bool padded() const override { return false; }

 private:
  double level_ms_ = 2.0;
  double level_token_ms_ = 0.6;
  double catch_up_ms_ = 0.08;
};

// The true conditional acceptance of a level `width` wide (siblings add less than a second
// independent guess each).
double TrueLevelRate(double p, double width) {
  return 1.0 - (1.0 - p) * std::pow(0.75, std::max(0.0, width - 1.0));
}

struct SimSequence {
  int generated = 0;
  int fed_to_drafter = 0;  // tokens of prompt + output the drafter has been fed
  int prompt = 150;
  int draft_steps = 0;
  bool probed = false;
  int steps_without_draft = 1 << 20;
  SpecShape previous;
  AcceptanceEstimate acceptance;
  double u_phase = 0;  // low-discrepancy source of this sequence's outcomes
  int step = 0;
};

struct SimResult {
  double tokens_per_s = 0;
  double drafted_share = 0;  // of sequence-steps
};

// Runs `concurrency` slots for `total_sequences` sequences of `length` tokens each. `fixed`:
// every sequence runs that shape (none: speculation off); otherwise the policy decides.
// `ingest`: the caller feeds catch-ups beside the verify step as the router does
// (PolicySequence::can_ingest), where they cost the step only what outlasts its verify;
// otherwise every catch-up is fed in the draft call, before verify.
SimResult Simulate(const Device& device, int concurrency, int total_sequences, int length,
                   bool use_policy, SpecShape fixed, double p, bool ingest = true) {
  PolicyOptions options;
  options.padded_rows = device.padded();
  GoodputPolicy policy(options);
  std::vector<SimSequence> slots(concurrency);
  int started = concurrency, finished = 0;
  for (int i = 0; i < concurrency; ++i) slots[i].u_phase = 0.137 * i;
  double seconds = 0, tokens = 0, drafted = 0, seq_steps = 0;
  while (finished < total_sequences) {
    std::vector<PolicySequence> batch(slots.size());
    for (size_t i = 0; i < slots.size(); ++i) {
      SimSequence& s = slots[i];
      PolicySequence& in = batch[i];
      in.pending = 1;
      in.max_depth = std::max(0, std::min(length - s.generated - 1, 64));
      in.acceptance = &s.acceptance;
      in.previous = s.previous;
      in.steps_without_draft = s.steps_without_draft;
      in.never_drafted = s.draft_steps == 0 && !s.probed;
      in.draft_backlog = s.prompt + s.generated - s.fed_to_drafter;
      // As the router has it: where the draft shares a GPU with verify, a feed beside verify
      // slows verify, and catch-ups stay in the draft call.
      in.can_ingest = ingest && !device.padded();
      if (!use_policy) {
        in.fixed = true;
        in.fixed_shape = fixed;
      }
    }
    const PolicyDecision d = policy.Decide(batch);
    int total_tokens = 0, longest = 0, drafting = 0, levels = 0, nodes = 0, catch_up = 0;
    int ingested = 0;
    for (size_t i = 0; i < slots.size(); ++i) {
      const SpecShape& s = d.shapes[i];
      if (d.ingest[i]) {
        EXPECT_TRUE(ingest && s.none());
        ingested += batch[i].draft_backlog;
        slots[i].fed_to_drafter = slots[i].prompt + slots[i].generated;
      }
      total_tokens += 1 + s.nodes();
      longest = std::max(longest, 1 + s.nodes());
      if (!s.none()) {
        ++drafting;
        levels = std::max(levels, s.depth);
        nodes += s.nodes();
        catch_up += batch[i].draft_backlog;
      }
    }
    const int rows = static_cast<int>(slots.size());
    const int step_tokens = VerifyStepTokens(device.padded(), rows, total_tokens, longest);
    const double verify_s = device.Verify(rows, step_tokens);
    const double draft_s = drafting > 0 ? device.Draft(levels, nodes, catch_up) : 0.0;
    // An ingest call beside verify (its round trip and the tokens it feeds) delays the next
    // step by what it outlasts verify.
    const double ingest_s =
        ingested > 0 ? std::max(0.0, device.Draft(0, 0, ingested) - verify_s) : 0.0;
    seconds += verify_s + draft_s + ingest_s;
    policy.costs().ObserveVerify(rows, step_tokens, verify_s);
    if (drafting > 0) policy.costs().ObserveDraft(drafting, levels, nodes, catch_up, draft_s);
    for (size_t i = 0; i < slots.size(); ++i) {
      SimSequence& s = slots[i];
      const SpecShape& shape = d.shapes[i];
      int accepted = 0;
      if (!shape.none()) {
        // Accepted length drawn from the true per-level rates with a golden-ratio sequence.
        const double u = std::fmod(s.u_phase + s.draft_steps * 0.6180339887498949, 1.0);
        const double width = std::clamp(static_cast<double>(shape.nodes()) / shape.depth, 1.0,
                                        static_cast<double>(std::max(shape.top_k, 1)));
        double reach = 1.0;
        for (int level = 1; level <= shape.depth; ++level) {
          reach *= TrueLevelRate(p, width);
          if (u < reach) accepted = level;
        }
        s.acceptance.Observe(shape, accepted, options);
        s.probed = true;
        ++s.draft_steps;
        s.steps_without_draft = 0;
        // The drafter was fed everything up to the last step's bonus token.
        s.fed_to_drafter = s.prompt + s.generated;
        ++drafted;
      } else {
        ++s.steps_without_draft;
      }
      ++seq_steps;
      const int emitted = std::min(1 + accepted, length - s.generated);
      s.generated += emitted;
      tokens += emitted;
      s.previous = shape;
      ++s.step;
      if (s.generated >= length) {
        ++finished;
        const double phase = 0.291 * started;
        s = SimSequence();
        s.u_phase = std::fmod(phase, 1.0);
        ++started;
      }
    }
  }
  return {tokens / seconds, drafted / seq_steps};
}

// p: the draft's conditional acceptance a level (0.3: tau about 1.4 for a chain of 4, where
// speculation barely pays; 0.62: about 2.4, as measured; 0.85: about 3.7).
// Runs off, chain4, tree16 and auto on `device` at each acceptance and concurrency and checks
// auto against the best of them and against off.
void ExpectAutoNearBest(const Device& device, std::initializer_list<double> rates) {
  for (const double p : rates) {
    for (const int c : {1, 4, 16, 64}) {
      const int total = std::max(8, 2 * c);
      const SimResult off = Simulate(device, c, total, 128, false, SpecShape(), p);
      const SimResult chain4 = Simulate(device, c, total, 128, false, SpecShape{4, 1, 4}, p);
      const SimResult tree16 = Simulate(device, c, total, 128, false, SpecShape{5, 4, 16}, p);
      const SimResult autop = Simulate(device, c, total, 128, true, SpecShape(), p);
      const SimResult in_call = Simulate(device, c, total, 128, true, SpecShape(), p, false);
      const double best = std::max({off.tokens_per_s, chain4.tokens_per_s, tree16.tokens_per_s});
      std::printf(
          "p=%.2f c=%d: off %.0f, chain4 %.2fx, tree16 %.2fx, auto %.4fx (drafted %.2f; catch-ups "
          "in the draft call %.4fx)\n",
          p, c, off.tokens_per_s, chain4.tokens_per_s / off.tokens_per_s,
          tree16.tokens_per_s / off.tokens_per_s, autop.tokens_per_s / off.tokens_per_s,
          autop.drafted_share, in_call.tokens_per_s / off.tokens_per_s);
      EXPECT_GE(autop.tokens_per_s, 0.94 * best) << "p " << p << ", concurrency " << c;
      // Learning what drafting costs and what each new sequence accepts is paid in steps that
      // draft where it turns out not to pay: a few percent over these short runs.
      EXPECT_GE(autop.tokens_per_s, 0.96 * off.tokens_per_s) << "p " << p << ", concurrency " << c;
    }
  }
}

// p: the draft's conditional acceptance a level (0.3: tau about 1.4 for a chain of 4, where
// speculation barely pays; 0.62: about 2.4, as measured; 0.85: about 3.7).
TEST(SpecPolicyReplayTest, AutoIsWithinAFewPercentOfTheBestChoiceAtEveryConcurrency) {
  ExpectAutoNearBest(GpuDevice(), {0.3, 0.62, 0.85});
}

// On the CPU a verify step costs about its tokens, so drafting pays only at one or two streams;
// 0.62 and 0.78 a level give the 0.53-0.61 accepted per drafted token of short chains the
// reference pair showed there.
TEST(SpecPolicyReplayTest, AutoOnTheCpuIsNeverBelowOff) {
  ExpectAutoNearBest(CpuDevice(), {0.62, 0.78});
}

// The synthetic pair at a small perturbation on the same CPU: the draft accepts nearly
// everything (tau about 4 for a chain of 4), but its one layer carries the full LM head, so a
// level costs ~4.7 ms at one sequence and ~12 ms at eleven, and a catch-up token ~0.3 ms: no
// fixed shape pays beyond one stream, and auto must not lose to off chasing the acceptance.
TEST(SpecPolicyReplayTest, AutoOnTheCpuWithADearDraftIsNeverBelowOff) {
  ExpectAutoNearBest(CpuDevice(4.0, 0.7, 0.3), {0.9});
}

}  // namespace
}  // namespace specd
