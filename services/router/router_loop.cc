#include "services/router/router_loop.h"

#include <algorithm>
#include <deque>
#include <optional>
#include <random>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/service/grpc_util.h"
#include "common/service/hidden_states_proto.h"
#include "common/service/tree_proto.h"
#include "common/token_tree.h"
#include "engine/spec/sequence_state.h"
#include "services/router/router_sequence.h"
#include "services/verify/sampling_proto.h"

namespace specd {
namespace {

// A client whose deadline passes cancels its stream, and the cancellation reaches the router
// before the router's copy of the deadline does: the server-side deadline is the client's
// timeout counted from when the request arrived, so it lags the client's by the request's
// one-way latency. A cancellation this close to the deadline is the deadline passing.
constexpr absl::Duration kDeadlineLag = absl::Milliseconds(250);

// Why a request that was cancelled or whose deadline passed ends, or OK while it is live.
grpc::Status EndedStatus(const RouterRequest& request, bool cancelled, absl::Time now,
                         const char* deadline_message) {
  // No deadline stays InfiniteFuture() after the subtraction, so such a request is never late.
  if (now >= request.deadline || (cancelled && now >= request.deadline - kDeadlineLag)) {
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, deadline_message);
  }
  if (cancelled) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
  return grpc::Status::OK;
}

class StreamDecoder : public TokenTextDecoder {
 public:
  explicit StreamDecoder(const Tokenizer* tokenizer)
      : stream_(tokenizer, /*skip_special_tokens=*/true) {}
  std::string Next(int32_t token) override { return stream_.Push(token); }
  std::string Flush() override { return stream_.Flush(); }

 private:
  DecodeStream stream_;
};

}  // namespace

RouterLoop::RouterLoop(RouterLoopOptions options, const Tokenizer* tokenizer,
                       RouterMetrics* metrics, std::function<void(bool)> on_serving)
    : options_(std::move(options)),
      tokenizer_(tokenizer),
      metrics_(metrics),
      on_serving_(std::move(on_serving)),
      // Draft and verify services may serve several routers; a random high half keeps this
      // router's sequence ids apart from theirs (and positive as a signed 64-bit id).
      seq_id_base_((std::random_device{}() & 0x7fffffffULL) << 32),
      policy_(options_.policy) {
  max_context_ = options_.limits.max_context;
  UpstreamOptions& vo = verify_upstream_options_;
  vo.name = "verify";
  vo.address = options_.verify_address;
  vo.tls_name = options_.verify_tls_name;
  vo.probe_timeout = options_.probe_timeout;
  vo.initial_backoff = options_.initial_backoff;
  vo.max_backoff = options_.max_backoff;
  vo.credentials = options_.upstream_credentials;
  verify_ = std::make_unique<VerifyUpstream>(
      vo,
      [this](const v1::VerifyInfo& info) -> absl::Status {
        if (static_cast<int>(info.vocab_size()) != options_.limits.vocab_size) {
          return absl::FailedPreconditionError(absl::StrCat(
              "the verify service's model has a vocabulary of ", info.vocab_size(),
              " tokens; the router's tokenizer and config have ", options_.limits.vocab_size));
        }
        rows_padded_.store(info.rows_padded());
        absl::MutexLock lock(&mu_);
        if (info.max_context() > 0) {
          max_context_ =
              std::min(options_.limits.max_context, static_cast<int>(info.max_context()));
        }
        return absl::OkStatus();
      },
      [this](bool up) {
        if (up) Wake();
        if (on_serving_) on_serving_(up);
      });
  for (size_t i = 0; i < options_.draft_addresses.size(); ++i) {
    absl::MutexLock lock(&mu_);
    drafts_.push_back(MakeDraft(options_.draft_addresses[i], i < options_.draft_tls_names.size()
                                                                 ? options_.draft_tls_names[i]
                                                                 : std::string()));
  }
  metrics_->draft_available.Set(0);
  NgramOptions ngram_options = options_.ngram;
  // It looks every auto sequence up every step: the search is bounded on long contexts.
  if (ngram_options.max_history == 0) ngram_options.max_history = kRouterNgramHistory;
  absl::StatusOr<std::unique_ptr<NgramDrafter>> ngram =
      NgramDrafter::Create(options_.limits.vocab_size, ngram_options);
  if (ngram.ok()) {
    local_ngram_ = *std::move(ngram);
  } else {
    SPECD_LOG(WARNING) << "local n-gram drafter disabled: " << ngram.status();
  }
}

RouterLoop::~RouterLoop() { Stop(); }

std::shared_ptr<RouterLoop::Draft> RouterLoop::MakeDraft(const std::string& address,
                                                         const std::string& tls_name) {
  auto draft = std::make_shared<Draft>();
  draft->address = address;
  UpstreamOptions options = verify_upstream_options_;
  options.name = "draft";
  options.address = address;
  options.tls_name = tls_name;
  draft->upstream = std::make_unique<DraftUpstream>(
      options,
      [this](const v1::DraftInfo& info) -> absl::Status {
        if (static_cast<int>(info.vocab_size()) != options_.limits.vocab_size) {
          return absl::FailedPreconditionError(
              absl::StrCat("the draft model has a vocabulary of ", info.vocab_size(),
                           " tokens; the target's has ", options_.limits.vocab_size));
        }
        return absl::OkStatus();
      },
      [this](bool) { UpdateDraftGauges(); });
  return draft;
}

void RouterLoop::Start() {
  verify_->Start();
  for (const auto& d : Drafts()) d->upstream->Start();
  {
    absl::MutexLock lock(&mu_);
    started_ = true;
  }
  thread_ = std::thread([this] { Run(); });
}

void RouterLoop::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  verify_->Stop();
  std::vector<std::shared_ptr<Draft>> drafts;
  {
    absl::MutexLock lock(&mu_);
    for (auto* list : {&drafts_, &removed_drafts_, &released_drafts_}) {
      drafts.insert(drafts.end(), list->begin(), list->end());
      list->clear();
    }
  }
  for (const auto& d : drafts) d->upstream->Stop();
}

void RouterLoop::AddDraft(const std::string& address, const std::string& tls_name) {
  std::shared_ptr<Draft> draft;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    for (const auto& d : drafts_) {
      if (d->address == address) return;
    }
    draft = MakeDraft(address, tls_name);
    drafts_.push_back(draft);
    if (!started_) return;  // Start() starts it
  }
  draft->upstream->Start();
}

void RouterLoop::RemoveDraft(const std::string& address) {
  absl::MutexLock lock(&mu_);
  for (auto it = drafts_.begin(); it != drafts_.end(); ++it) {
    if ((*it)->address == address) {
      removed_drafts_.push_back(std::move(*it));
      drafts_.erase(it);
      wake_ = true;
      return;
    }
  }
}

void RouterLoop::RetireDrafts() {
  absl::MutexLock lock(&mu_);
  for (auto it = removed_drafts_.begin(); it != removed_drafts_.end();) {
    const bool used =
        (*it)->in_flight != nullptr || std::any_of(running_.begin(), running_.end(),
                                                   [&](const auto& s) { return s->draft == *it; });
    if (used) {
      ++it;
    } else {
      released_drafts_.push_back(std::move(*it));
      it = removed_drafts_.erase(it);
    }
  }
}

void RouterLoop::ReapDrafts() {
  std::vector<std::shared_ptr<Draft>> released;
  {
    absl::MutexLock lock(&mu_);
    released.swap(released_drafts_);
  }
  // The stream is cancelled: the service frees whatever it still held on it.
  for (const auto& d : released) d->upstream->Stop();
  if (!released.empty()) UpdateDraftGauges();
}

std::vector<std::shared_ptr<RouterLoop::Draft>> RouterLoop::Drafts() const {
  absl::MutexLock lock(&mu_);
  return drafts_;
}

void RouterLoop::UpdateDraftGauges() {
  int up = 0;
  for (const auto& d : Drafts()) up += d->upstream->up() ? 1 : 0;
  metrics_->draft_available.Set(up > 0 ? 1 : 0);
  metrics_->draft_services_up.Set(up);
}

bool RouterLoop::draft_up() const {
  for (const auto& d : Drafts()) {
    if (d->upstream->up()) return true;
  }
  return false;
}

bool RouterLoop::has_draft() const {
  absl::MutexLock lock(&mu_);
  return !drafts_.empty();
}

v1::DraftInfo RouterLoop::draft_info() const {
  const std::vector<std::shared_ptr<Draft>> drafts = Drafts();
  for (const auto& d : drafts) {
    if (d->upstream->up()) return d->upstream->info();
  }
  return drafts.empty() ? v1::DraftInfo() : drafts[0]->upstream->info();
}

bool RouterLoop::EagleAvailable(const Draft* draft) const {
  return draft != nullptr && draft->upstream->up() &&
         EagleTapsServed(draft->upstream->info(), verify_->info());
}

int RouterLoop::max_context() const {
  absl::MutexLock lock(&mu_);
  return max_context_;
}

absl::Status RouterLoop::Submit(RouterRequest request, std::shared_ptr<ResponseSink> sink,
                                std::string draft_address) {
  if (!verify_->up()) {
    return absl::UnavailableError(absl::StrCat("the verify service at ", options_.verify_address,
                                               " is not available; retry later"));
  }
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the router is shutting down");
  if (static_cast<int>(queue_.size()) >= options_.max_queue) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the router's queue is full (", options_.max_queue, " requests waiting); retry later"));
  }
  queue_.push_back({std::move(request), std::move(sink), std::move(draft_address)});
  metrics_->requests_waiting.Set(queue_.size());
  wake_ = true;
  return absl::OkStatus();
}

void RouterLoop::Wake() {
  absl::MutexLock lock(&mu_);
  wake_ = true;
}

void RouterLoop::Run() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      // Releases for a stream that a late pre-draft holds wait for its answer, which wakes us.
      const bool releases = std::any_of(drafts_.begin(), drafts_.end(), [](const auto& d) {
        return !d->releases.empty() && d->in_flight == nullptr;
      });
      if (running_.empty() && verify_releases_.empty() && !releases) {
        // Idle: sleep until a request arrives, something is cancelled, or a service changes
        // state; the timeout bounds how long a cancelled queued request can linger.
        auto woken = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return wake_ || stopping_; };
        mu_.AwaitWithTimeout(absl::Condition(&woken), absl::Milliseconds(100));
        wake_ = false;
        if (stopping_) break;
      }
    }
    if (!verify_->up()) {
      FailEverything(grpc::Status(
          grpc::StatusCode::UNAVAILABLE,
          absl::StrCat("the verify service at ", options_.verify_address, " is not available")));
      // The old verify stream (and every sequence on it) is gone with it; the draft services
      // are told now, so that nothing is left to send and the loop can sleep.
      verify_releases_.clear();
      PollLatePreDrafts();
      DraftStep();
      continue;
    }
    Admit();
    Step();
  }
  FailEverything(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the router is shutting down"));
  JoinLatePreDrafts();
  verify_->CloseGracefully();
  for (const auto& d : Drafts()) d->upstream->CloseGracefully();
}

void RouterLoop::Admit() {
  std::vector<std::pair<Queued, grpc::Status>> expired;
  std::vector<std::pair<Queued, std::shared_ptr<Draft>>> admitted;
  const absl::Time now = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      grpc::Status ended = EndedStatus(it->request, it->sink->Cancelled(), now,
                                       "the deadline passed while the request was queued");
      if (!ended.ok()) {
        expired.emplace_back(std::move(*it), std::move(ended));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    while (static_cast<int>(running_.size() + admitted.size()) < options_.max_batch &&
           !queue_.empty()) {
      std::shared_ptr<Draft> draft;
      for (const auto& d : drafts_) {
        if (d->address == queue_.front().draft_address) draft = d;
      }
      admitted.emplace_back(std::move(queue_.front()), std::move(draft));
      queue_.pop_front();
    }
    metrics_->requests_waiting.Set(queue_.size());
  }
  for (auto& [q, status] : expired) {
    q.sink->Finish(status);
    metrics_->CountOutcome(status.error_code());
  }
  const int max_context = this->max_context();
  for (auto& [q, draft] : admitted) {
    auto seq = std::make_unique<Sequence>();
    seq->id = seq_id_base_ | (next_seq_++ & 0xffffffffULL);
    seq->request = std::move(q.request);
    seq->sink = std::move(q.sink);
    seq->draft = std::move(draft);
    StopConditions core_stop;
    core_stop.max_new_tokens = seq->request.max_new_tokens;
    core_stop.eos_token_ids = options_.limits.eos_token_ids;
    core_stop.stop_token_ids = seq->request.stop_token_ids;
    core_stop.ignore_eos = seq->request.ignore_eos;
    core_stop.max_total_tokens = max_context;
    absl::StatusOr<SequenceState> core =
        SequenceState::Create(seq->request.prompt, core_stop, options_.limits.vocab_size);
    const int64_t prompt_len = static_cast<int64_t>(seq->request.prompt.size());
    if (!core.ok()) {
      // The verify service reported a smaller context than the router's config.
      Fail(*seq, ToGrpcStatus(core.status()));
      continue;
    }
    seq->core = *std::move(core);
    StreamStopConditions stop;
    stop.max_new_tokens = core_stop.max_new_tokens;
    stop.eos_token_ids = core_stop.ActiveEosIds();
    stop.stop_token_ids = core_stop.stop_token_ids;
    stop.stop = seq->request.stop;
    stop.max_total_tokens = max_context;
    stop.prompt_tokens = prompt_len;
    seq->output = std::make_unique<SequenceOutput>(std::make_unique<StreamDecoder>(tokenizer_),
                                                   std::move(stop));
    // What the sequence will speculate with; steps downgrade it to OFF while the draft
    // service is unavailable.
    v1::Speculation mode = seq->request.speculation;
    if (mode == v1::SPECULATION_AUTO) {
      mode =
          EagleAvailable(seq->draft.get()) ? v1::SPECULATION_EAGLE3 : v1::SPECULATION_DRAFT_MODEL;
    }
    seq->spec = mode;
    // While no EAGLE sequence is being drafted, a new one would hold its prompt's taps (the
    // verify step's export and gather) for a drafter that is not expected to draft it soon.
    seq->taps_dormant = mode == v1::SPECULATION_EAGLE3 && options_.eagle_tap_dormant_steps > 0 &&
                        eagle_seen_ && eagle_plain_steps_ >= options_.eagle_tap_dormant_steps;
    seq->mode = mode == v1::SPECULATION_OFF      ? v1::SPECULATION_OFF
                : mode == v1::SPECULATION_NGRAM  ? v1::SPECULATION_NGRAM
                : seq->draft == nullptr          ? v1::SPECULATION_OFF
                : mode == v1::SPECULATION_EAGLE3 ? v1::SPECULATION_EAGLE3
                                                 : v1::SPECULATION_DRAFT_MODEL;
    metrics_->queue_time.Observe(absl::ToDoubleSeconds(now - seq->request.arrival));
    metrics_->prompt_tokens.Increment(static_cast<double>(prompt_len));
    metrics_->request_prompt_tokens.Observe(static_cast<double>(prompt_len));
    running_.push_back(std::move(seq));
  }
  UpdateGauges();
}

void RouterLoop::Step() {
  const absl::Time now = absl::Now();
  for (auto& seq : running_) {
    const grpc::Status ended =
        EndedStatus(seq->request, seq->sink->Cancelled(), now, "the deadline passed");
    if (!ended.ok()) Fail(*seq, ended);
  }
  RemoveDone();
  PollLatePreDrafts();
  RetireDrafts();
  const absl::Time start = absl::Now();
  Plan();
  FetchHeldTaps();
  DraftStep();
  VerifyStep();
  if (!running_.empty()) {
    metrics_->step_seconds.Increment(absl::ToDoubleSeconds(absl::Now() - start));
  }
  RemoveDone();
  UpdateGauges();
}

void RouterLoop::Plan() {
  for (const auto& s : running_) {
    if (s->draft != nullptr) s->draft->up = s->draft->upstream->up();
  }
  std::vector<PolicySequence> inputs;
  inputs.reserve(running_.size());
  for (auto& s : running_) {
    Sequence& seq = *s;
    seq.tree = TokenTree();
    seq.draft_down = false;
    seq.draft_busy = false;
    seq.no_drafter = false;
    seq.draft_report = seq.draft_accepted;
    seq.draft_replied = false;
    seq.draft_accepted = -2;
    const v1::Speculation mode = seq.spec;
    PolicySequence p = seq.core->PolicyInput(/*model_draft=*/mode != v1::SPECULATION_NGRAM);
    ProposeNgram(seq, &p);
    // Where the model drafter cannot serve an auto sequence, its n-gram proposal still can.
    auto model_unavailable = [&p] {
      p.model_available = false;
      p.fixed = p.ngram_depth <= 0;
    };
    // Whether a drafter can serve this sequence this step: the draft service, or for n-gram
    // also the router's own n-gram drafter.
    const bool service = seq.draft != nullptr && !seq.draft_failed;
    const bool draft_up = seq.draft != nullptr && seq.draft->up;
    // Its draft service is still answering a late pre-draft: this step cannot draft there.
    const bool busy = seq.draft != nullptr && seq.draft->in_flight != nullptr;
    if (seq.hit_ready) {
      p.fixed = true;  // the pre-drafted tree is ready
      p.fixed_shape = seq.hit_shape;
    } else if (mode == v1::SPECULATION_OFF) {
      p.fixed = true;  // none
    } else if (mode == v1::SPECULATION_NGRAM
                   ? !(service && draft_up && !busy) && local_ngram_ == nullptr
                   : !service) {
      model_unavailable();
      seq.no_drafter = true;
    } else if (mode != v1::SPECULATION_NGRAM && !draft_up) {
      model_unavailable();
      seq.draft_down = true;
    } else if (mode != v1::SPECULATION_NGRAM && busy) {
      model_unavailable();
      seq.draft_busy = true;
    } else if (seq.request.shape_explicit || !options_.adaptive) {
      p.fixed = true;
      p.fixed_shape =
          SpecShape{seq.request.shape.depth, seq.request.shape.top_k, seq.request.shape.max_nodes};
    }
    // The ingest-only step beside verify feeds a draft model (EAGLE heads read taps). On a GPU
    // the draft shares with verify the feed slows verify while it runs, but fed in the draft
    // call it would stall the whole batch for as long, and a new sequence's first token with
    // it: beside verify is never the dearer place, and on a draft GPU of its own it is free.
    p.can_ingest = mode == v1::SPECULATION_DRAFT_MODEL && service && draft_up && !busy;
    if (mode == v1::SPECULATION_EAGLE3) p.draft_backlog = EagleBacklog(seq, p.draft_backlog);
    inputs.push_back(p);
  }
  if (inputs.empty()) return;
  policy_.set_padded_rows(rows_padded_.load());
  const PolicyDecision decision = policy_.Decide(inputs);
  bool eagle_ran = false, eagle_drafted = false;
  for (size_t i = 0; i < running_.size(); ++i) {
    Sequence& seq = *running_[i];
    ShapeReason reason = decision.reasons[i];
    seq.ngram_now = decision.ngram[i] != 0 && !seq.hit_ready;
    if (!seq.ngram_now) {
      if (seq.draft_down) reason = ShapeReason::kDraftDown;
      if (seq.draft_busy) reason = ShapeReason::kDraftBusy;
      if (seq.no_drafter) reason = ShapeReason::kNoDrafter;
    }
    if (seq.hit_ready) reason = seq.hit_reason;
    seq.ingest_now = decision.ingest[i] != 0 && !seq.hit_ready;
    if (seq.spec == v1::SPECULATION_EAGLE3) {
      eagle_ran = true;
      if (PlanEagleTaps(seq, decision.shapes[i], reason, &eagle_drafted)) continue;  // a wake
    }
    seq.core->Plan(decision.shapes[i], reason, seq.ngram_now);
    if (seq.ingest_now) seq.core->Defer(decision.deferred[i]);
  }
  if (eagle_ran) {
    eagle_seen_ = true;
    eagle_plain_steps_ = eagle_drafted ? 0 : eagle_plain_steps_ + 1;
  }
  metrics_->policy_goodput.Set(decision.predicted_goodput);
  metrics_->policy_verify_one_token.Set(policy_.costs().VerifyOneTokenSeconds());
  metrics_->policy_verify_chain4.Set(policy_.costs().VerifyChain4Seconds());
  metrics_->policy_draft_level.Set(policy_.costs().DraftLevelSeconds());
}

void RouterLoop::DraftStep() {
  // One message per draft service, sent together: a step waits for the slowest, not the sum.
  struct Batch {
    Draft* draft = nullptr;
    uint64_t epoch = 0;
    v1::DraftStepRequest request;
    absl::flat_hash_map<uint64_t, Sequence*> by_id;
    int levels = 0, nodes = 0;
    absl::Status status;
    v1::DraftStepResponse response;
    double seconds = 0;
    bool prefill = false;  // some step feeds the drafter a sequence from its start
  };
  const std::vector<std::shared_ptr<Draft>> drafts = Drafts();
  std::vector<Batch> batches;
  absl::flat_hash_map<const Draft*, size_t> batch_of;
  auto batch_for = [&](Draft* d) -> Batch& {
    auto [it, inserted] = batch_of.try_emplace(d, batches.size());
    if (inserted) {
      Batch b;
      b.draft = d;
      d->up = d->upstream->up();
      b.epoch = d->up ? d->upstream->epoch() : 0;
      batches.push_back(std::move(b));
    }
    return batches[it->second];
  };
  // Every draft service, so that releases held for a stream that is gone are dropped.
  for (const auto& d : drafts) batch_for(d.get());
  for (auto& s : running_) {
    if (s->draft != nullptr) batch_for(s->draft.get());
  }
  for (auto& s : running_) {
    Sequence& seq = *s;
    const SpecShape shape = seq.core->planned();
    seq.on_hit = seq.hit_ready;
    if (seq.hit_ready) {
      seq.hit_ready = false;
      seq.tree = std::move(seq.hit_tree);
      seq.mode = v1::SPECULATION_DRAFT_MODEL;
      seq.draft_replied = true;
      continue;
    }
    if (seq.missed) {
      seq.missed = false;
      metrics_->CountPreDraftMiss(shape.none() || seq.ngram_now ? "plain_step" : "drafted_late");
    }
    if (seq.draft_down) seq.mode = v1::SPECULATION_OFF;
    if (shape.none()) continue;
    const v1::Speculation mode = seq.spec;
    if (DraftLocally(seq, shape)) continue;
    if (seq.draft == nullptr) continue;  // planned with no drafter: not reached
    Batch& b = batch_for(seq.draft.get());
    const uint64_t epoch = b.epoch;
    if (seq.ResyncDrafter(epoch)) b.prefill = true;
    const absl::Span<const int32_t> fresh = seq.core->DrafterPending();
    v1::DraftSequenceStep* step = b.request.add_steps();
    step->set_seq_id(seq.id);
    step->mutable_new_tokens()->Assign(fresh.begin(), fresh.end());
    step->set_method(mode == v1::SPECULATION_NGRAM    ? v1::DRAFT_METHOD_NGRAM
                     : mode == v1::SPECULATION_EAGLE3 ? v1::DRAFT_METHOD_EAGLE
                                                      : v1::DRAFT_METHOD_MODEL);
    if (mode == v1::SPECULATION_EAGLE3 && seq.taps.tokens() > 0) {
      *step->mutable_taps() = std::move(seq.taps);
      seq.taps.Clear();
    }
    step->set_depth(shape.depth);
    step->set_top_k(shape.top_k);
    step->set_max_nodes(shape.max_nodes);
    step->set_deadline_unix_ms(ToUnixMillisOrZero(seq.request.deadline));
    if (seq.draft_report >= -1 && seq.draft_epoch == epoch) {
      step->set_accepted_node(seq.draft_report);
    }
    seq.draft_report = -2;  // told
    seq.core->MarkDrafterFed();
    seq.draft_epoch = epoch;
    seq.mode = mode == v1::SPECULATION_NGRAM    ? v1::SPECULATION_NGRAM
               : mode == v1::SPECULATION_EAGLE3 ? v1::SPECULATION_EAGLE3
                                                : v1::SPECULATION_DRAFT_MODEL;
    if (mode != v1::SPECULATION_NGRAM) {
      b.levels = std::max(b.levels, shape.depth);
      b.nodes += shape.max_nodes;
    }
    b.by_id[seq.id] = &seq;
  }
  std::vector<Batch*> sending;
  for (Batch& b : batches) {
    Draft& d = *b.draft;
    if (b.epoch != d.epoch) {
      // Sequences named here lived on a stream that is gone; the service freed them with it.
      d.epoch = b.epoch;
      d.releases.clear();
    }
    if (!d.up) {
      // Drafted sequences only ever join a batch that is up; these wanted a draft.
      continue;
    }
    if (d.in_flight != nullptr) continue;  // a late pre-draft holds the stream; nothing drafts
    if (b.request.steps_size() == 0 && d.releases.empty()) continue;
    b.request.set_step_id(next_step_);
    d.releases.MoveInto(&b.request);
    sending.push_back(&b);
  }
  auto round_trip = [](Batch* b) {
    const absl::Time start = absl::Now();
    b->status = b->draft->upstream->RoundTrip(b->request, &b->response, b->epoch);
    b->seconds = absl::ToDoubleSeconds(absl::Now() - start);
  };
  std::vector<std::thread> threads;
  for (size_t i = 1; i < sending.size(); ++i) threads.emplace_back(round_trip, sending[i]);
  if (!sending.empty()) round_trip(sending[0]);
  for (std::thread& t : threads) t.join();
  double slowest = 0;
  for (Batch* b : sending) {
    slowest = std::max(slowest, b->seconds);
    if (b->request.steps_size() > 0) {
      (b->prefill ? metrics_->draft_latency_prefill : metrics_->draft_latency).Observe(b->seconds);
    }
    metrics_->CountBusy("draft", b->seconds);
  }
  if (!sending.empty()) metrics_->CountWait("draft", slowest);
  for (Batch* b : sending) {
    if (!b->status.ok()) {
      SPECD_LOG(WARNING) << b->status.message() << "; its sequences continue target-only";
      for (auto& [id, seq] : b->by_id) {
        seq->draft_down = true;
        seq->mode = v1::SPECULATION_OFF;
      }
      continue;
    }
    if (b->levels > 0) {
      int drafting = 0, fed = 0;
      for (const v1::DraftSequenceStep& step : b->request.steps()) {
        if (step.method() == v1::DRAFT_METHOD_NGRAM) continue;
        ++drafting;
        fed += step.new_tokens_size();
      }
      policy_.costs().ObserveDraft(drafting, b->levels, b->nodes, fed,
                                   b->seconds + b->draft->catch_up_seconds);
    }
    for (const v1::DraftSequenceResult& result : b->response.results()) {
      auto it = b->by_id.find(result.seq_id());
      if (it == b->by_id.end()) continue;
      Sequence& seq = *it->second;
      if (result.has_error() && result.error().code() != 0) {
        SPECD_LOG(WARNING) << "draft service at " << b->draft->address << " rejected sequence "
                           << seq.id << " (request '" << seq.request.request_id
                           << "'): " << result.error().message() << "; it continues target-only";
        seq.draft_failed = true;
        seq.draft_down = true;
        b->draft->releases.cancelled.push_back(seq.id);
        seq.draft_epoch = 0;
        continue;
      }
      seq.draft_replied = true;
      TokenTree tree = TreeFromProto(result.tree());
      if (absl::Status valid = ValidateTree(tree, options_.limits.vocab_size); !valid.ok()) {
        SPECD_LOG(WARNING) << "draft service sent a bad tree for sequence " << seq.id << ": "
                           << valid.message();
        continue;
      }
      seq.tree = std::move(tree);
    }
    // Trees deeper than what was asked would run past the context: drop them.
    for (const v1::DraftSequenceStep& step : b->request.steps()) {
      Sequence& seq = *b->by_id[step.seq_id()];
      if (!seq.tree.empty() && TreeMaxDepth(seq.tree) > static_cast<int>(step.depth())) {
        SPECD_LOG(WARNING) << "draft tree deeper than " << step.depth() << " dropped";
        seq.tree = TokenTree();
      }
    }
  }
}

void RouterLoop::VerifyStep() {
  const uint64_t epoch = verify_->epoch();
  if (epoch != verify_epoch_) {
    verify_epoch_ = epoch;
    verify_releases_.clear();  // released with the old stream
  }
  v1::VerifyStepRequest request;
  absl::flat_hash_map<uint64_t, Sequence*> by_id;
  int tokens = 0, longest = 0;
  // EAGLE sequences ask for the taps the draft service's head reads while it can use them.
  // Without a verify service that exports them (every tap the head reads, up to
  // VerifyInfo.max_tap_layer: EagleTapsServed), EAGLE sequences get no taps and so empty trees:
  // target-only, never a failed request.
  const v1::VerifyInfo verify_info = verify_->info();
  const bool taps = verify_info.supports_taps();
  absl::flat_hash_map<const Draft*, v1::DraftInfo> draft_infos;  // of those up, when taps
  for (auto& s : running_) {
    Sequence& seq = *s;
    v1::VerifySequenceStep* step = request.add_steps();
    if (taps && seq.spec == v1::SPECULATION_EAGLE3 && !seq.draft_failed && seq.draft != nullptr &&
        seq.draft->upstream->up()) {
      auto it = draft_infos.find(seq.draft.get());
      if (it == draft_infos.end()) {
        it = draft_infos.emplace(seq.draft.get(), seq.draft->upstream->info()).first;
      }
      const v1::DraftInfo& draft_info = it->second;
      if (draft_info.eagle_tap_layers_size() > 0 && EagleTapsServed(draft_info, verify_info) &&
          !seq.taps_dormant) {
        *step->mutable_tap_layers() = draft_info.eagle_tap_layers();
        step->set_tap_dtype(draft_info.eagle_tap_dtype());
        // A step the EAGLE head does not draft (none, or auto's n-gram proposal) sends no
        // taps: the verify service keeps them until the plan drafts the sequence again
        // (FetchHeldTaps), so plain steps cost what plain steps without EAGLE cost.
        const bool hold = options_.eagle_hold_taps && (seq.core->planned().none() || seq.ngram_now);
        step->set_hold_taps(hold);
        seq.taps_held = seq.taps_held || hold;
      }
    }
    if (step->tap_layers_size() == 0) seq.taps_held = false;  // the verify service drops them
    step->set_seq_id(seq.id);
    // A sequence held under an older stream (the verify service was replaced between steps)
    // is fed its whole history again; sampling depends only on the prefix, the seed and the
    // position, so its output is unchanged.
    if (seq.verify_epoch != 0 && seq.verify_epoch != epoch) seq.core->ResetTarget();
    const absl::Span<const int32_t> pending = seq.core->TargetPending();
    step->mutable_pending()->Assign(pending.begin(), pending.end());
    // A feed from the start (the first step, or a resync) tells the verifier where the prompt
    // ends, so that the penalties and min_tokens count a resynced output as output.
    if (static_cast<int64_t>(pending.size()) == seq.core->length()) {
      step->set_prompt_length(static_cast<uint32_t>(seq.core->prompt().size()));
    }
    tokens += static_cast<int>(pending.size() + seq.tree.size());
    longest = std::max(longest, static_cast<int>(pending.size() + seq.tree.size()));
    if (!seq.tree.empty()) TreeToProto(seq.tree, step->mutable_tree());
    SamplingToProto(seq.request.sampling, seq.request.stop_token_ids, step->mutable_sampling());
    if (seq.request.logprobs >= 0) {
      step->set_logprobs(static_cast<uint32_t>(seq.request.logprobs));
      step->set_logprobs_mode(seq.request.logprobs_mode == LogprobsMode::kProcessed
                                  ? v1::LOGPROBS_MODE_PROCESSED
                                  : v1::LOGPROBS_MODE_RAW);
    }
    step->set_deadline_unix_ms(ToUnixMillisOrZero(seq.request.deadline));
    seq.verify_epoch = epoch;
    by_id[seq.id] = &seq;
  }
  if (request.steps_size() == 0 && verify_releases_.empty()) return;
  request.set_step_id(next_step_++);
  verify_releases_.MoveInto(&request);
  v1::VerifyStepResponse response;
  // The pre-drafts (one message per draft service) go out with the verify step.
  const std::vector<std::shared_ptr<Draft>> pre = StartPreDrafts(request.step_id());
  const absl::Time start = absl::Now();
  const absl::Status status = verify_->RoundTrip(request, &response, epoch);
  const absl::Time verify_done = absl::Now();
  const double seconds = absl::ToDoubleSeconds(verify_done - start);
  metrics_->CountWait("verify", seconds);
  metrics_->CountBusy("verify", seconds);
  // Whether a pre-draft (not only ingests) ran beside this verify step.
  const bool overlapped =
      std::any_of(pre.begin(), pre.end(), [](const auto& d) { return d->in_flight->rows > 0; });
  FinishPreDrafts(pre, verify_done - start, verify_done);
  if (request.steps_size() > 0) {
    const bool prefill = std::any_of(request.steps().begin(), request.steps().end(),
                                     [](const auto& s) { return s.has_prompt_length(); });
    (prefill ? metrics_->verify_latency_prefill : metrics_->verify_latency).Observe(seconds);
    if (status.ok()) {
      const int rows = request.steps_size();
      const int step_tokens =
          VerifyStepTokens(policy_.options().padded_rows, rows, tokens, longest);
      // With auto the buckets learn verify alone: an overlapped step's time less the measured
      // slowdown of pre-drafting beside it (nothing until that is measured).
      const double learned =
          options_.overlap == OverlapMode::kAuto
              ? overlap_planner_.ObserveVerify(rows, step_tokens, seconds, overlapped)
              : seconds;
      if (learned > 0) policy_.costs().ObserveVerify(rows, step_tokens, learned);
    }
  }
  if (!status.ok()) {
    SPECD_LOG(ERROR) << status.message();
    FailEverything(ToGrpcStatus(status));
    return;
  }
  for (const v1::VerifySequenceResult& result : response.results()) {
    auto it = by_id.find(result.seq_id());
    if (it == by_id.end()) continue;
    Sequence& seq = *it->second;
    by_id.erase(it);
    if (result.has_error() && result.error().code() != 0) {
      Fail(seq, grpc::Status(static_cast<grpc::StatusCode>(result.error().code()),
                             absl::StrCat("verify service: ", result.error().message())));
      continue;
    }
    ApplyVerifyResult(seq, result);
  }
  for (auto& [id, seq] : by_id) {
    Fail(*seq, grpc::Status(grpc::StatusCode::INTERNAL,
                            "the verify service's reply has no result for this sequence"));
  }
}

void RouterLoop::ApplyVerifyResult(Sequence& seq, const v1::VerifySequenceResult& result) {
  VerifyOutcome outcome;
  outcome.tokens.assign(result.tokens().begin(), result.tokens().end());
  outcome.accepted_draft = static_cast<int>(result.accepted_draft());
  outcome.accepted_nodes.assign(result.accepted_nodes().begin(), result.accepted_nodes().end());
  if (absl::Status s = SequenceState::CheckOutcome(outcome, seq.tree, options_.limits.vocab_size);
      !s.ok()) {
    Fail(seq, grpc::Status(grpc::StatusCode::INTERNAL, std::string(s.message())));
    return;
  }
  if (seq.request.logprobs >= 0 && result.logprobs_size() != result.tokens_size()) {
    Fail(seq, grpc::Status(grpc::StatusCode::INTERNAL,
                           absl::StrCat("the verify service returned ", result.logprobs_size(),
                                        " logprobs for ", result.tokens_size(), " tokens")));
    return;
  }
  const int accepted = outcome.accepted_draft;
  const SpecShape planned = seq.core->planned();
  const ShapeReason reason =
      seq.draft_down && !seq.ngram_now ? ShapeReason::kDraftDown : seq.core->planned_reason();
  const int nodes = static_cast<int>(seq.tree.size());
  metrics_->CountStep(TreeSizeBucket(nodes), ShapeReasonName(reason, planned.none()));
  if (!seq.tree.empty()) {
    const int drafter = seq.ngram_now ? 2 : 1;
    if (seq.last_drafter != 0 && drafter != seq.last_drafter) {
      (seq.ngram_now ? metrics_->switches_to_ngram : metrics_->switches_to_model)->Increment();
    }
    seq.last_drafter = drafter;
    metrics_->spec_decode_steps.Increment();
    metrics_->spec_decode_draft_tokens.Increment(nodes);
    metrics_->spec_decode_accepted_tokens.Increment(accepted);
    metrics_->CountAcceptedPositions(accepted);
  } else {
    metrics_->CountTargetOnlyStep(reason == ShapeReason::kOff ? TargetOnlyReason::kOff
                                  : reason == ShapeReason::kDraftDown
                                      ? TargetOnlyReason::kDraftUnavailable
                                  : reason == ShapeReason::kDraftBusy ? TargetOnlyReason::kDraftBusy
                                                                      : TargetOnlyReason::kNoDraft);
  }
  if (result.has_taps()) AppendHiddenStates(result.taps(), &seq.taps);
  if (seq.draft_replied) {
    seq.draft_accepted = result.accepted_nodes_size() > 0
                             ? result.accepted_nodes(result.accepted_nodes_size() - 1)
                             : -1;
  } else {
    // The draft service was not told this step (a plain or n-gram step): it still keeps its
    // last tree, whose outcome the next step that reaches it reports.
    seq.draft_accepted = seq.draft_report;
  }
  // The core keeps the tokens the verifier emitted up to a token stop; the text stream may end
  // earlier, at a stop string.
  // The kept tokens are a prefix of the emitted ones, so result.logprobs(i) is token i's.
  int i = 0;
  for (int32_t t : seq.core->Apply(outcome, seq.tree)) {
    if (seq.request.logprobs >= 0) seq.logprobs.push_back(LogprobsFromProto(result.logprobs(i)));
    ++i;
    if (!seq.output->Push(t)) break;
  }
  ResolvePreDraft(seq, outcome.tokens, accepted);
  Emit(seq);
}

void RouterLoop::Emit(Sequence& seq) {
  OutputChunk chunk = seq.output->TakeReady();
  const bool finished = seq.output->finished();
  if (chunk.empty() && !finished) return;
  const absl::Time now = absl::Now();
  v1::GenerateResponse response;
  response.mutable_token_ids()->Assign(chunk.token_ids.begin(), chunk.token_ids.end());
  response.set_text(std::move(chunk.text));
  const int n = static_cast<int>(chunk.token_ids.size());
  for (int i = 0; i < n && !seq.logprobs.empty(); ++i) {
    const TokenLogprobs& lp = seq.logprobs.front();
    v1::TokenLogprob* out = response.add_logprobs();
    out->set_token_id(chunk.token_ids[i]);
    out->set_token(TokenText(chunk.token_ids[i]));
    out->set_logprob(lp.logprob);
    out->set_rank(static_cast<uint32_t>(lp.rank));
    for (const TokenLogprob& top : lp.top) {
      v1::TopLogprob* alt = out->add_top_logprobs();
      alt->set_token_id(top.token);
      alt->set_token(TokenText(top.token));
      alt->set_logprob(top.logprob);
    }
    seq.logprobs.pop_front();
  }
  if (n > 0) {
    if (!seq.streamed_any) {
      metrics_->time_to_first_token.Observe(absl::ToDoubleSeconds(now - seq.request.arrival));
      seq.streamed_any = true;
    } else {
      // Tokens accepted together arrive together; spread the gap over them, as a client
      // reading tokens/s would.
      const double per_token = absl::ToDoubleSeconds(now - seq.last_emit) / n;
      for (int i = 0; i < n; ++i) metrics_->inter_token_latency.Observe(per_token);
    }
    seq.last_emit = now;
    metrics_->generation_tokens.Increment(n);
  }
  if (finished) {
    response.set_finish_reason(seq.output->finish_reason());
    response.mutable_usage()->set_prompt_tokens(static_cast<uint32_t>(seq.core->prompt().size()));
    response.mutable_usage()->set_completion_tokens(seq.output->generated());
    const SpecStats& st = seq.core->stats();
    v1::SpeculationStats* stats = response.mutable_speculation();
    stats->set_steps(st.draft_steps);
    stats->set_draft_tokens(st.draft_tokens);
    stats->set_accepted_tokens(st.accepted_tokens);
    stats->mutable_accepted_per_position()->Assign(st.accepted_per_position.begin(),
                                                   st.accepted_per_position.end());
    stats->set_target_only_steps(st.target_only_steps);
    stats->set_shape_changes(st.shape_changes);
    stats->set_mode(seq.mode);
    if (seq.output->finish_reason() == v1::FINISH_REASON_STOP_STRING) {
      response.set_matched_stop(seq.output->matched_stop());
    }
    seq.sink->Write(std::move(response));
    seq.sink->Finish(grpc::Status::OK);
    metrics_->CountOutcome(grpc::StatusCode::OK);
    // A request that ended normally has a finish reason; an unset one would be counted as
    // "length", the reason a generation without another stops for.
    const v1::FinishReason reason = seq.output->finish_reason();
    metrics_->CountFinish(FinishReasonName(
        reason == v1::FINISH_REASON_UNSPECIFIED ? v1::FINISH_REASON_LENGTH : reason));
    metrics_->request_generation_tokens.Observe(seq.output->generated());
    metrics_->e2e_request_latency.Observe(absl::ToDoubleSeconds(now - seq.request.arrival));
    Release(seq, /*finished=*/true);
    return;
  }
  seq.sink->Write(std::move(response));
}

std::string RouterLoop::TokenText(int32_t token) const {
  return tokenizer_->Decode(absl::MakeConstSpan(&token, 1), /*skip_special_tokens=*/false);
}

void RouterLoop::Fail(Sequence& seq, const grpc::Status& status) {
  if (seq.done) return;
  if (status.error_code() != grpc::StatusCode::CANCELLED &&
      status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
    SPECD_LOG(WARNING) << "request '" << seq.request.request_id << "' (sequence " << seq.id
                       << ") failed: " << status.error_message();
  }
  seq.sink->Finish(status);
  metrics_->CountOutcome(status.error_code());
  Release(seq, /*finished=*/false);
}

void RouterLoop::Release(Sequence& seq, bool finished) {
  seq.done = true;
  if (seq.verify_epoch != 0 && seq.verify_epoch == verify_->epoch()) {
    (finished ? verify_releases_.finished : verify_releases_.cancelled).push_back(seq.id);
  }
  if (seq.draft != nullptr && seq.draft_epoch != 0 &&
      seq.draft_epoch == seq.draft->upstream->epoch()) {
    Releases& releases = seq.draft->releases;
    (finished ? releases.finished : releases.cancelled).push_back(seq.id);
  }
}

void RouterLoop::FailEverything(const grpc::Status& status) {
  for (auto& seq : running_) Fail(*seq, status);
  RemoveDone();
  std::deque<Queued> queued;
  {
    absl::MutexLock lock(&mu_);
    queued.swap(queue_);
    metrics_->requests_waiting.Set(0);
  }
  for (Queued& q : queued) {
    q.sink->Finish(status);
    metrics_->CountOutcome(status.error_code());
  }
  UpdateGauges();
}

void RouterLoop::RemoveDone() {
  running_.erase(std::remove_if(running_.begin(), running_.end(),
                                [](const std::unique_ptr<Sequence>& s) { return s->done; }),
                 running_.end());
}

void RouterLoop::UpdateGauges() { metrics_->requests_running.Set(running_.size()); }

}  // namespace specd
