// The router's scheduler: one thread that runs continuous batching over every active sequence.
//
// The speculation itself (what each service still has to be fed, the depth budget, applying a
// verify outcome, token stops, statistics, the tree shape of each step) is engine/spec's
// SequenceState and GoodputPolicy, the code the in-process Generator runs too; this loop adds
// transport (protos, round trips, stream epochs) and the text stream (stop strings).
//
// Each iteration (one speculation step):
//   1. admits queued requests while fewer than max_batch sequences run, and ends sequences
//      whose client cancelled or whose deadline passed;
//   2. plans every sequence's tree shape: the goodput policy's choice (down to none) for
//      requests that did not name a shape, the named shape for those that did, none for
//      speculation = off or while the drafter is unavailable;
//   3. sends ONE draft Step message to each draft service for every sequence that speculates
//      through it (its new tokens since its last draft step, the tree shape), with the ids of
//      sequences to free; the messages to different draft services go out at once;
//   4. sends ONE verify Step message for every running sequence (pending tokens and the draft
//      tree, an empty tree for target-only sequences), with the ids to free;
//   4b. with overlap, sends at the same moment (from helper threads) ONE pre-draft Step to each
//      draft service for its sequences whose trees are being verified: it guesses each tree's
//      outcome and grows the next tree below the guess. When verify answers, a sequence whose
//      emitted tokens equal the guess (a hit) takes that tree for its next step without
//      drafting; a miss is planned like any sequence (drafted late, or a plain one-token step
//      where the policy finds drafting not worth it);
//   5. feeds each sequence's emitted tokens through its SequenceOutput (stop conditions, text
//      deltas) and streams what is ready.
// The draft and verify services hold state per sequence and per stream, so a sequence that
// ends is named in release_seq_ids of the next message to each service that holds it.
//
// Draft services. The loop holds a Step stream to each draft service it knows (AddDraft,
// RemoveDraft: the group pool keeps the set), and each sequence drafts through the one it was
// submitted with, whatever its verify service: the draft and verify tiers are placed apart. A
// step sends one draft message to each draft service that has sequences to draft, all at once.
//
// Failures. A sequence's draft service down: the sequence continues target-only through the
// verify service (the output is unchanged: verification is lossless), specd_draft_available is
// 0 while none of the loop's draft services is up, and a connector thread reconnects with
// backoff. After a reconnect the new draft stream holds nothing, so each drafting sequence is
// resynced by sending its whole history as new_tokens. A sequence keeps its draft service: one
// placed on a service that is down stays target-only until that service is back.
// N-gram requests (speculation = ngram) draft in the draft service like the others; while it is
// unavailable (or when none is configured) the router runs the same prompt-lookup drafter
// itself: it needs no model and costs microseconds, so there is no reason to lose speculation.
// Auto requests get that drafter too, as a second candidate beside the model drafter (the policy
// picks per sequence and step), also while their draft service is down (router_ngram.cc).
// Verify service down: every running and queued request fails with UNAVAILABLE, health turns
// NOT_SERVING, and new requests are refused until it is back.
#ifndef SPECD_SERVICES_ROUTER_ROUTER_LOOP_H_
#define SPECD_SERVICES_ROUTER_ROUTER_LOOP_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/text/tokenizer.h"
#include "engine/draft/ngram_drafter.h"
#include "engine/spec/overlap_planner.h"
#include "engine/spec/policy.h"
#include "grpcpp/support/status.h"
#include "services/router/output_stream.h"
#include "services/router/request.h"
#include "services/router/router_metrics.h"
#include "services/router/upstream.h"
#include "specd/v1/draft.grpc.pb.h"
#include "specd/v1/generation.pb.h"
#include "specd/v1/verify.grpc.pb.h"

namespace specd {

// Where a request's chunks go: implemented by the Generate reactor. Thread-safe.
class ResponseSink {
 public:
  virtual ~ResponseSink() = default;
  // Queues one chunk for the client; ignored after Finish.
  virtual void Write(v1::GenerateResponse chunk) = 0;
  // Ends the RPC once every queued chunk is written. Only the first call counts.
  virtual void Finish(const grpc::Status& status) = 0;
  // True once the client cancelled or the RPC's deadline passed.
  virtual bool Cancelled() const = 0;
};

// Pre-drafting while verify runs (docs/architecture.md, the overlapped step).
enum class OverlapMode {
  kOff,   // every step drafts, then verifies
  kOn,    // every step that verifies draft-model trees also pre-drafts them
  kAuto,  // only steps where it fits inside the verify step and pays (OverlapPlanner)
};

struct RouterLoopOptions {
  std::string verify_address;
  // With TLS: the name the verify service's certificate is checked against when it is not the
  // address's host (UpstreamOptions::tls_name).
  std::string verify_tls_name;
  // Draft services known from the start (AddDraft adds more). None: every step is target-only
  // (or drafts n-grams in the router).
  std::vector<std::string> draft_addresses;
  std::vector<std::string> draft_tls_names;  // empty, or one per draft address (as above)
  int max_batch = 32;                        // sequences per step
  int max_queue = 256;                       // requests waiting to start
  // vocab_size, max_context, eos ids. max_context is lowered to the verify service's when it
  // reports a smaller one.
  RequestLimits limits;
  absl::Duration probe_timeout = absl::Seconds(2);
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(5);
  // The local n-gram drafter's; max_history 0 is taken as kRouterNgramHistory.
  NgramOptions ngram;
  // false: requests that name no shape get limits.default_shape every step (no policy).
  bool adaptive = true;
  // Auto requests (with `adaptive`) also get the local n-gram drafter as a second drafter
  // (router_ngram.cc).
  bool auto_ngram = true;
  PolicyOptions policy;
  OverlapMode overlap = OverlapMode::kOff;
  // Outcome guesses per pre-drafted sequence at most; the policy's fan-out picks how many
  // (GoodputPolicy::PreDraftFanOut), at least one with kOn; with kOn and adaptive false, this
  // many.
  int overlap_max_fan_out = 1;
  // A sequence the policy is not drafting whose drafter has fallen this many tokens behind is
  // fed them (an ingest-only draft step, sent beside the verify step so that the router does
  // not wait for it), so that drafting it again needs no catch-up. 0: never (a sequence that
  // resumes drafting first feeds everything it missed). Worth it where the draft service has
  // its own device; sharing the verify service's GPU, the ingest slows verify.
  int draft_ingest_tokens = 0;
  // EAGLE sequences: the verify service holds the taps of steps the plan does not draft, and
  // the router fetches them when it drafts the sequence again (FetchHeldTaps). False: every
  // step returns its taps and the router keeps them (an A/B switch for benchmarks).
  bool eagle_hold_taps = true;
  // EAGLE sequences the plan has left undrafted this many steps in a row stop asking the verify
  // service for taps at all: their steps are then plain steps (the code path, the verify
  // bucket and the CUDA graph of a sequence without EAGLE), and holding rows for a drafter
  // that is not expected back soon costs every such step (the device gather, the verify
  // step's tap export). When the plan drafts one again, that step asks for its taps instead
  // of drafting (a wake: ShapeReason::kCatchUp) and it drafts from the next step, the drafter
  // restarting its head from the rows after the gap. New EAGLE sequences start so while no
  // EAGLE sequence has been drafted for this many steps. 0: never (taps held however long).
  int eagle_tap_dormant_steps = 32;
  // TLS (and the client certificate for mutual TLS) towards draft and verify; null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> upstream_credentials;
};

// Whether `verify` exports every tap the EAGLE head of `draft` reads (router_taps.cc): it
// exports taps at all and DraftInfo.eagle_tap_layers stays within VerifyInfo.max_tap_layer (an
// EAGLE-1/2 head reads the final norm's output, one past the layer inputs, which a backend
// exports only where VerifyFeatures::final_norm_tap says so). False without a head. EAGLE is
// offered, and chosen by auto, only then.
bool EagleTapsServed(const v1::DraftInfo& draft, const v1::VerifyInfo& verify);

// The router's n-gram drafter searches at most this many of a sequence's last tokens.
inline constexpr int kRouterNgramHistory = 4096;

class RouterLoop {
 public:
  // `tokenizer` and `metrics` must outlive the loop. `on_serving` is told whether the router
  // can serve (the verify service is up); called from internal threads.
  RouterLoop(RouterLoopOptions options, const Tokenizer* tokenizer, RouterMetrics* metrics,
             std::function<void(bool serving)> on_serving);
  ~RouterLoop();

  void Start();
  // Fails whatever is still running or queued with UNAVAILABLE and joins the threads.
  void Stop();

  // Queues a request that drafts through `draft_address` (one of the loop's draft services;
  // empty or unknown: none). RESOURCE_EXHAUSTED when max_queue requests already wait,
  // UNAVAILABLE while the verify service is down. On success the loop owns finishing `sink`.
  absl::Status Submit(RouterRequest request, std::shared_ptr<ResponseSink> sink,
                      std::string draft_address = "");

  // Opens a Step stream to one more draft service (nothing if the loop has it already);
  // `tls_name` as in RouterLoopOptions::draft_tls_names.
  void AddDraft(const std::string& address, const std::string& tls_name = "");
  // Takes a draft service out: new requests naming it get none. The scheduler lets go of it once
  // no running sequence drafts through it, and ReapDrafts then closes it.
  void RemoveDraft(const std::string& address);
  // Closes the draft services the scheduler has let go of (blocks while their connector threads
  // end; not for the scheduler thread).
  void ReapDrafts();

  // Makes the scheduler look at its queue now (a queued request was cancelled).
  void Wake();

  bool verify_up() const { return verify_->up(); }
  bool draft_up() const;  // any of its draft services
  // specd_draft_available and specd_draft_services_up from the draft streams' state.
  void UpdateDraftGauges();
  bool has_draft() const;
  v1::VerifyInfo verify_info() const { return verify_->info(); }
  // Of the first draft service that is up (the first one while none is).
  v1::DraftInfo draft_info() const;
  // Context length in force: the smaller of the router's model config and the verify
  // service's.
  int max_context() const;

 private:
  struct Sequence;
  struct Queued {
    RouterRequest request;
    std::shared_ptr<ResponseSink> sink;
    std::string draft_address;
  };
  using DraftUpstream = Upstream<v1::Drafter, v1::DraftStepRequest, v1::DraftStepResponse,
                                 v1::DraftInfoRequest, v1::DraftInfo>;
  using VerifyUpstream = Upstream<v1::Verifier, v1::VerifyStepRequest, v1::VerifyStepResponse,
                                  v1::VerifyInfoRequest, v1::VerifyInfo>;
  // Sequences to name in the next Step message to a service.
  struct Releases {
    std::vector<uint64_t> finished;
    std::vector<uint64_t> cancelled;
    bool empty() const { return finished.empty() && cancelled.empty(); }
    void clear() {
      finished.clear();
      cancelled.clear();
    }
    template <typename Request>
    void MoveInto(Request* request) {
      request->mutable_release_seq_ids()->Assign(finished.begin(), finished.end());
      request->mutable_cancel_seq_ids()->Assign(cancelled.begin(), cancelled.end());
      clear();
    }
  };
  // A pre-draft (or ingest) message in flight on a draft stream, answered on a helper thread
  // (router_sequence.h).
  struct PreDraftCall;
  // One draft service and the loop's stream to it.
  struct Draft {
    std::string address;
    std::unique_ptr<DraftUpstream> upstream;
    // Scheduler thread only.
    Releases releases;
    uint64_t epoch = 0;  // the stream epoch `releases` belong to
    bool up = false;     // upstream->up() as of this step's start
    // The message sent beside verify, until its answer is taken; while it is here the stream
    // carries nothing else (one message at a time), so this service drafts nothing.
    std::unique_ptr<PreDraftCall> in_flight;
    // This step's catch-up of held EAGLE taps for its sequences (FetchHeldTaps), which its
    // draft step's cost observation includes: resuming a sequence costs it.
    double catch_up_seconds = 0;
  };

  std::shared_ptr<Draft> MakeDraft(const std::string& address, const std::string& tls_name);
  // EAGLE taps of an EAGLE sequence (router_taps.cc). The drafter backlog the policy prices
  // for `seq`, given the tokens it has not been fed (`backlog`): after a gap in its taps only
  // the rows from the gap on.
  int EagleBacklog(const Sequence& seq, int backlog) const;
  // Applies this step's plan (`shape`, `reason`) to the sequence's taps: dormant after
  // eagle_tap_dormant_steps undrafted steps; a dormant one the head would draft is woken
  // instead (planned plain, the shape deferred to the next step): true then, and the caller
  // plans nothing more. Sets *head_drafted where the head drafts it.
  bool PlanEagleTaps(Sequence& seq, const SpecShape& shape, ShapeReason reason, bool* head_drafted);
  // The draft services in use (a copy, for the scheduler thread's step).
  std::vector<std::shared_ptr<Draft>> Drafts() const;
  // Whether EAGLE-3 can serve a sequence drafting through `draft` now: it is up with an EAGLE
  // head and the verify service exports the taps it reads. AUTO chooses EAGLE-3 when it can.
  bool EagleAvailable(const Draft* draft) const;
  // Lets go of removed draft services that no running sequence drafts through.
  void RetireDrafts();

  void Run();
  // Moves queued requests into running_ (and ends cancelled or expired queued ones). Returns
  // false when there is nothing to do and the loop should wait.
  void Admit();
  void Step();
  void Plan();
  // router_taps.cc. EAGLE sequences the plan drafts again after plain steps: one verify round
  // trip fetches the taps the verify service held for them (VerifySequenceStep.hold_taps), so
  // that their drafter reaches the last token this step.
  void FetchHeldTaps();
  void DraftStep();
  // router_ngram.cc. For an auto sequence, this step's n-gram proposal (Sequence::ngram_tree),
  // whose length goes to the policy (`p`'s ngram_depth).
  void ProposeNgram(Sequence& seq, PolicySequence* p) const;
  // Gives `seq` its tree for `shape` from the router's own n-gram drafter where that drafts it
  // this step (auto's proposal, or speculation = ngram without its draft service); false where
  // the draft service does.
  bool DraftLocally(Sequence& seq, const SpecShape& shape);
  void VerifyStep();
  // router_overlap.cc. What `draft` does while verify runs, in one request (a draft stream
  // carries one message at a time): its sequences that pre-draft this step (overlap), and those
  // that are fed their backlog without a tree (draft_ingest_tokens); empty when none does either.
  // Fills `call`'s request, and its predicted draft time: what drafting them after the outcome
  // would take.
  void PreDraftRequest(uint64_t step_id, const Draft& draft, PreDraftCall* call);
  // Adds this step's pre-drafts of `draft` (stream `epoch`) to `call`, unless overlap is auto
  // and OverlapPlanner keeps the step sequential (the pre-draft would outlast verify, or would
  // not pay).
  void AddPreDrafts(uint64_t epoch, const Draft& draft, PreDraftCall* call);
  // Adds an ingest-only step for `seq` (its drafter's backlog, no tree) to `request`, on stream
  // `epoch`.
  void AddIngest(uint64_t epoch, Sequence& seq, v1::DraftStepRequest* request);
  // Sends PreDraftRequest to each draft service with a free stream, from helper threads, as the
  // verify step `step_id` goes out. Returns the draft services it sent to.
  std::vector<std::shared_ptr<Draft>> StartPreDrafts(uint64_t step_id);
  // Verify answered at `verify_done` after `verify_time`: waits for each of those pre-drafts at
  // most its predicted draft time plus that verify time past the answer, and takes the answers
  // that came. Within the draft time the step is no slower than drafting after the outcome; the
  // verify time on top is the scale of the step itself, so that scheduling noise (a tiny
  // model's draft takes well under a millisecond) does not turn pre-drafts into plain steps;
  // past both, the wait would cost the batch more than one more step. The others are late:
  // their sequences are served as misses this step, and their answers are dropped when they
  // come (PollLatePreDrafts).
  void FinishPreDrafts(const std::vector<std::shared_ptr<Draft>>& drafts,
                       absl::Duration verify_time, absl::Time verify_done);
  // Takes the answers of late pre-drafts that have come, freeing their streams.
  void PollLatePreDrafts();
  // Blocks until every late pre-draft is answered (shutdown: the streams close after).
  void JoinLatePreDrafts();
  // Takes one answer: which ingests the draft service took in and, unless the call was late,
  // each pre-drafted sequence's guessed outcome and the tree below it.
  void TakePreDrafts(PreDraftCall& call);
  // After `seq`'s verify outcome (its `accepted` drafts) is applied: whether its pre-draft hit
  // (the next step verifies the pre-drafted tree without drafting) or missed (counted by how
  // the next step serves it).
  void ResolvePreDraft(Sequence& seq, absl::Span<const int32_t> outcome_tokens, int accepted);
  void ApplyVerifyResult(Sequence& seq, const v1::VerifySequenceResult& result);
  // Streams what the sequence has ready; on finish also sends the last chunk and ends the RPC.
  void Emit(Sequence& seq);
  // Ends the sequence's RPC with `status` (not OK) and schedules its release.
  void Fail(Sequence& seq, const grpc::Status& status);
  // Schedules freeing the sequence in the services that hold it; `finished` tells them whether
  // it ended normally (release_seq_ids) or was cut short (cancel_seq_ids).
  void Release(Sequence& seq, bool finished);
  void FailEverything(const grpc::Status& status);
  // One token's text on its own, for logprobs (special tokens included).
  std::string TokenText(int32_t token) const;
  void RemoveDone();
  void UpdateGauges();

  const RouterLoopOptions options_;
  const Tokenizer* const tokenizer_;
  RouterMetrics* const metrics_;
  const std::function<void(bool)> on_serving_;
  const uint64_t seq_id_base_;

  UpstreamOptions verify_upstream_options_;
  std::unique_ptr<VerifyUpstream> verify_;
  std::unique_ptr<NgramDrafter> local_ngram_;
  GoodputPolicy policy_;  // scheduler thread only
  // --overlap=auto: whether each step pre-drafts (scheduler thread only).
  OverlapPlanner overlap_planner_{&policy_};
  // From the verify service's GetInfo (any thread); handed to the policy each step.
  std::atomic<bool> rows_padded_{false};

  mutable absl::Mutex mu_;
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  int max_context_ ABSL_GUARDED_BY(mu_) = 0;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::shared_ptr<Draft>> drafts_ ABSL_GUARDED_BY(mu_);
  // Removed, until no running sequence drafts through them; then let go, until reaped.
  std::vector<std::shared_ptr<Draft>> removed_drafts_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Draft>> released_drafts_ ABSL_GUARDED_BY(mu_);

  // Scheduler thread only.
  std::thread thread_;
  std::vector<std::unique_ptr<Sequence>> running_;
  // Draft services whose in_flight pre-draft outlasted its wait.
  std::vector<std::shared_ptr<Draft>> late_drafts_;
  Releases verify_releases_;
  uint64_t next_seq_ = 1;
  uint64_t next_step_ = 1;
  uint64_t verify_epoch_ = 0;
  // Steps in a row that ran EAGLE sequences and drafted none of them; whether any ran yet
  // (RouterLoopOptions::eagle_tap_dormant_steps: new EAGLE sequences start dormant past it).
  int eagle_plain_steps_ = 0;
  bool eagle_seen_ = false;
};

}  // namespace specd

#endif  // SPECD_SERVICES_ROUTER_ROUTER_LOOP_H_
