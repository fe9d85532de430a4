// The router scheduler's state of one running sequence, shared by the files that define
// RouterLoop's members (router_loop.cc: planning, drafting, verifying, streaming;
// router_overlap.cc: pre-drafting while verify runs). Internal to specd_router_lib.
#ifndef SPECD_SERVICES_ROUTER_ROUTER_SEQUENCE_H_
#define SPECD_SERVICES_ROUTER_ROUTER_SEQUENCE_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/token_tree.h"
#include "engine/spec/policy.h"
#include "engine/spec/sequence_state.h"
#include "services/router/output_stream.h"
#include "services/router/request.h"
#include "services/router/router_loop.h"
#include "specd/v1/draft.pb.h"
#include "specd/v1/generation.pb.h"

namespace specd {

// A deadline as the services' deadline_unix_ms field: 0 for none.
inline int64_t ToUnixMillisOrZero(absl::Time t) {
  return t == absl::InfiniteFuture() ? 0 : absl::ToUnixMillis(t);
}

struct RouterLoop::Sequence {
  uint64_t id = 0;
  RouterRequest request;
  std::shared_ptr<ResponseSink> sink;
  std::shared_ptr<Draft> draft;  // the draft service it drafts through; null: none
  // The speculation core: tokens, what each service still has to be fed, the depth budget,
  // the tree shape of this step, acceptance and statistics.
  std::optional<SequenceState> core;
  std::unique_ptr<SequenceOutput> output;  // text, stop strings
  // With request.logprobs >= 0: those of the tokens pushed into `output` and not streamed yet,
  // in order. The output streams a prefix of what it was pushed, so chunk i's n token ids take
  // the first n entries.
  std::deque<TokenLogprobs> logprobs;
  v1::Speculation mode = v1::SPECULATION_OFF;  // what it speculated with in the end
  // What it drafts with: the request's mode, AUTO resolved when the sequence starts (EAGLE-3
  // where the draft service has a head and the verify service exports taps, else the draft
  // model).
  v1::Speculation spec = v1::SPECULATION_OFF;
  // EAGLE: the target's taps the verify service returned since the last draft step, to relay.
  v1::HiddenStates taps;
  // EAGLE: steps the plan did not draft asked the verify service to hold their taps
  // (hold_taps); FetchHeldTaps fetches them when the plan drafts the sequence again.
  bool taps_held = false;
  // EAGLE: its steps ask for no taps (RouterLoopOptions::eagle_tap_dormant_steps), and the
  // steps in a row the policy has planned it without a tree.
  bool taps_dormant = false;
  int undrafted_steps = 0;
  // EAGLE, woken from taps_dormant: the sequence position from which the drafter gets taps
  // again (the head restarts there, so its catch-up is the tokens from there on); -1: no gap
  // pending.
  int64_t taps_from = -1;
  absl::Time last_emit;
  bool streamed_any = false;
  bool done = false;

  // The stream epoch of each service that holds this sequence (0: not held). After a draft
  // reconnect the epoch differs and the whole history is fed again.
  uint64_t verify_epoch = 0;
  uint64_t draft_epoch = 0;
  bool draft_failed = false;  // the draft service rejected this sequence: stop drafting it
  // The draft service answered this step, and the deepest node of its tree that verify
  // accepted (-1 none, -2 unknown), which the next draft step reports (accepted_node).
  bool draft_replied = false;
  int32_t draft_accepted = -2;
  int32_t draft_report = -2;  // draft_accepted as of this step's plan, sent with its draft step

  // Overlap. This step's pre-draft: the tokens it guessed verify emits, and the tree below them.
  bool pre_sent = false;
  std::vector<int32_t> pre_guess;
  int pre_node = -1;
  TokenTree pre_tree;
  // With a fan-out above one: the further guesses, each with the tree below it.
  struct Guess {
    std::vector<int32_t> tokens;
    TokenTree tree;
    int rank = 1;  // its place in the draft service's order (0: pre_guess, the most likely)
  };
  std::vector<Guess> pre_more;
  SpecShape pre_shape;
  // The planned shape pre_shape was cut from (GoodputPolicy::PlanPreDraft's depth). A step that
  // verifies a hit runs the cut shape, but its own pre-draft plans from this one again, so a cut
  // lasts only while the verify step has no room for more.
  SpecShape pre_uncut;
  bool on_hit = false;  // this step verifies a pre-drafted tree
  // The chance OverlapPlanner gave this step's guess (auto; the measured hits calibrate it).
  double pre_guess_rate = 0;
  ShapeReason pre_reason = ShapeReason::kPolicy;
  // A hit: the next step verifies hit_tree (shape hit_shape) without drafting.
  bool hit_ready = false;
  TokenTree hit_tree;
  SpecShape hit_shape;
  ShapeReason hit_reason = ShapeReason::kPolicy;  // why the pre-drafted step had its shape
  bool missed = false;       // the last pre-draft missed: count how this step serves it
  bool ingest_sent = false;  // this step feeds the drafter without a tree (draft_ingest_tokens)
  // The policy has the drafter fed this sequence's backlog beside this verify step, so that the
  // catch-up stalls no draft call (ShapeReason::kCatchUp); it drafts from the next step.
  bool ingest_now = false;
  // This step's pre-draft outlasted its wait: its verify outcome is counted as late, a miss.
  bool pre_late = false;
  // The sequence's length when its pre-draft or ingest went out: its new_tokens feed the drafter
  // that far, whenever the answer is taken.
  int64_t pre_fed_to = 0;

  // Before feeding the drafter on the draft stream of `epoch`: where the sequence is not held
  // there (new, or lost with an older stream), its drafter's feed starts again from the
  // sequence's first token; true then (the feed is the drafter's prefill).
  bool ResyncDrafter(uint64_t epoch) {
    if (draft_epoch == epoch) return false;
    core->ResetDrafter();
    return true;
  }

  // This step.
  TokenTree tree;
  // Auto: this step's n-gram proposal, a chain (RouterLoop::ProposeNgram; empty: no match), and
  // whether the policy chose it over the model drafter (the step verifies it, cut to the
  // planned depth).
  TokenTree ngram_tree;
  bool ngram_now = false;
  // Which drafter gave its last verified tree (specd_auto_drafter_switches_total): 0 none yet,
  // 1 the model drafter, 2 n-gram.
  int last_drafter = 0;
  bool draft_down = false;  // wanted a draft the drafter could not give
  bool draft_busy = false;  // its draft service's stream still carries a late pre-draft
  bool no_drafter = false;  // no drafter serves it (none configured, or it was rejected)
};

struct RouterLoop::PreDraftCall {
  Draft* draft = nullptr;  // which owns it (Draft::in_flight)
  uint64_t epoch = 0;      // of the stream it went out on
  v1::DraftStepRequest request;
  absl::Time start;
  // The cost model's draft time of its pre-drafts (and ingests), which bounds the wait for it.
  double draft_seconds = 0;
  // Its pre-drafts' work as CostModel::DraftSeconds prices it (rows 0: none), and whether it
  // carries ingests too.
  int rows = 0, levels = 0, nodes = 0;
  bool ingests = false;
  // Some ingest feeds a sequence's drafter from its start (a new sequence's prompt, a resync):
  // a call of ingests alone is then the drafter's prefill, timed as one (kind="prefill").
  bool prefill = false;
  bool late = false;  // it outlasted that wait: its trees are dropped
  std::thread thread;
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  // Written by the helper thread before it sets `done`.
  absl::Status status;
  v1::DraftStepResponse response;
  double seconds = 0;  // the round trip
};

}  // namespace specd

#endif  // SPECD_SERVICES_ROUTER_ROUTER_SEQUENCE_H_
