#include "services/draft/draft_loop.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/service/grpc_util.h"
#include "common/service/hidden_states_proto.h"
#include "common/service/model_service_main.h"
#include "common/service/tree_proto.h"
#include "engine/topk.h"
#include "engine/warmup.h"

namespace specd {

absl::StatusOr<std::unique_ptr<DraftLoop>> DraftLoop::Create(const DraftLoopOptions& options,
                                                             DraftStepQueue* queue,
                                                             ModelServiceMetrics* metrics) {
  if (options.max_sequences < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_sequences: ", options.max_sequences, " must be at least 1"));
  }
  if (absl::Status s = ValidateDraftParams(options.defaults); !s.ok()) {
    return Prefixed(s, "default tree shape: ");
  }
  std::unique_ptr<Backend> model;
  std::unique_ptr<DraftModelDrafter> model_drafter;
  int vocab_size = options.vocab_size;
  if (!options.model_dir.empty()) {
    absl::StatusOr<std::unique_ptr<Backend>> backend =
        CreateBackend(options.model_dir, options.backend);
    if (!backend.ok()) {
      return absl::Status(backend.status().code(),
                          absl::StrCat("loading the draft model from ", options.model_dir, ": ",
                                       backend.status().message()));
    }
    model = std::move(*backend);
    if (vocab_size != 0 && vocab_size != model->config().vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("vocab_size: ", vocab_size,
                                                     " differs from the draft model's ",
                                                     model->config().vocab_size));
    }
    vocab_size = model->config().vocab_size;
    // The draft levels' graphs and buffers, which the backend's warm-up (GEMM row classes)
    // leaves to the first draft steps: the default tree at every batch bucket up to the CUDA
    // backend's largest graph batch (64).
    if (options.backend.cuda_warmup && absl::StartsWith(options.backend.device, "cuda")) {
      DraftLevelWarmUp levels;
      levels.batches = DraftLevelWarmUpBatches(std::min(options.max_sequences, 64));
      levels.depth = options.defaults.depth;
      levels.top_k = std::min(options.defaults.top_k, kMaxForwardTopK);
      levels.asked_k = DraftModelDrafter::TopKAsked(levels.top_k);
      absl::StatusOr<WarmUpReport> warm = WarmUpDraftLevels(*model, levels);
      if (!warm.ok()) return warm.status();
      SPECD_LOG(INFO) << "draft level warm-up: " << warm->rows.size() << " batch sizes up to "
                      << (warm->rows.empty() ? 0 : warm->rows.back()) << " in " << warm->seconds
                      << " s";
    }
    DraftModelDrafterOptions drafter_options = options.drafter;
    // No draft forward beyond the row classes the warm-up decided.
    if (options.backend.cuda_gemm_invariant_rows > 0) {
      drafter_options.max_forward_rows = options.backend.cuda_gemm_invariant_rows;
    }
    model_drafter = std::make_unique<DraftModelDrafter>(model.get(), drafter_options);
  }
  std::unique_ptr<EagleHead> eagle_head;
  if (!options.eagle_head_dir.empty()) {
    if (options.eagle_target_dir.empty()) {
      return absl::InvalidArgumentError(
          "eagle_target_dir: needed with an EAGLE head (the head reads the target's embedding)");
    }
    EagleHeadOptions head_options;
    head_options.device = options.backend.device;
    head_options.kv_capacity_tokens = options.backend.kv_capacity_tokens;
    head_options.num_threads = options.backend.num_threads;
    head_options.cpu_bf16_weights = options.backend.cpu_bf16_weights;
    absl::StatusOr<std::unique_ptr<EagleHead>> head =
        CreateEagleHead(options.eagle_head_dir, options.eagle_target_dir, head_options);
    if (!head.ok()) {
      return absl::Status(head.status().code(),
                          absl::StrCat("loading the EAGLE head from ", options.eagle_head_dir, ": ",
                                       head.status().message()));
    }
    eagle_head = *std::move(head);
    // A CUDA head decides its GEMM algorithms per row class lazily, as the CUDA backend does:
    // decided on the first draft calls, they would make the policy price EAGLE drafting at many
    // times its cost and stop drafting.
    if (options.backend.cuda_warmup && absl::StartsWith(options.backend.device, "cuda")) {
      absl::StatusOr<WarmUpReport> warm = WarmUpEagleHead(
          *eagle_head, GemmClassWarmUpRows(options.backend.cuda_gemm_invariant_rows));
      if (!warm.ok()) return warm.status();
      SPECD_LOG(INFO) << "EAGLE head warm-up: " << warm->rows.size() << " row counts up to "
                      << (warm->rows.empty() ? 0 : warm->rows.back()) << " in " << warm->seconds
                      << " s";
    }
    const int head_vocab = eagle_head->config().vocab_size;
    if (vocab_size != 0 && vocab_size != head_vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("eagle_head_dir: its target's vocabulary of ", head_vocab, " differs from ",
                       vocab_size, model != nullptr ? " (the draft model's)" : " (vocab_size)"));
    }
    vocab_size = head_vocab;
  }
  if (vocab_size < 1) {
    return absl::InvalidArgumentError(
        "vocab_size: needed (>= 1) when no draft model or EAGLE head is given (n-gram drafting "
        "only)");
  }
  absl::StatusOr<std::unique_ptr<NgramDrafter>> ngram =
      NgramDrafter::Create(vocab_size, options.ngram);
  if (!ngram.ok()) return Prefixed(ngram.status(), "n-gram drafter: ");
  return std::unique_ptr<DraftLoop>(new DraftLoop(options, std::move(model),
                                                  std::move(model_drafter), std::move(*ngram),
                                                  std::move(eagle_head), queue, metrics));
}

DraftLoop::DraftLoop(const DraftLoopOptions& options, std::unique_ptr<Backend> model,
                     std::unique_ptr<DraftModelDrafter> model_drafter,
                     std::unique_ptr<NgramDrafter> ngram, std::unique_ptr<EagleHead> eagle_head,
                     DraftStepQueue* queue, ModelServiceMetrics* metrics)
    : StepLoop(queue, metrics, options.max_gather),
      options_(options),
      model_(std::move(model)),
      model_drafter_(std::move(model_drafter)),
      ngram_(std::move(ngram)),
      eagle_head_(std::move(eagle_head)) {
  info_.set_model(model_ != nullptr ? ModelNameFromPath(options.model_dir) : "ngram");
  info_.set_vocab_size(ngram_->vocab_size());
  const int64_t capacity = model_ != nullptr ? model_->Usage().capacity_tokens : 0;
  info_.mutable_load()->set_kv_capacity_tokens(capacity);
  info_.mutable_load()->set_max_sequences(options.max_sequences);
  capacity_summary_ =
      KvCapacityLine(capacity, model_ != nullptr ? model_->config().max_position_embeddings : 0,
                     options.max_sequences);
  if (eagle_head_ != nullptr) {
    eagle_drafter_ = std::make_unique<EagleDrafter>(eagle_head_.get());
    info_.set_eagle_head(ModelNameFromPath(options.eagle_head_dir));
    info_.set_eagle_head_kind(EagleKindName(eagle_head_->config().kind));
    // EAGLE-3: three layer inputs; EAGLE-1/2: FinalNormTap, the target's final norm output.
    const std::vector<int>& taps = eagle_head_->config().taps;
    info_.mutable_eagle_tap_layers()->Assign(taps.begin(), taps.end());
    // The head's compute type. The CPU head computes in fp32: the taps come as the target's
    // fp32 bits, what the oracle-checked head reads. The CUDA head rounds them to bf16 before
    // fc anyway (round to nearest even, as the wire's conversion), so bf16 halves the bytes and
    // loses nothing it reads.
    info_.set_eagle_tap_dtype(options.backend.device == "cpu" ? v1::TENSOR_DTYPE_FP32
                                                              : v1::TENSOR_DTYPE_BF16);
  }
  Start();
}

DraftLoop::~DraftLoop() { Stop(); }

void DraftLoop::FreeModelState(int64_t seq) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return;
  for (int d : {kModel, kNgram, kEagle}) {
    if (!it->second.added[d]) continue;
    if (absl::Status s = drafter(d)->Release(seq); !s.ok()) {
      SPECD_LOG(WARNING) << "releasing draft sequence " << seq << ": " << s;
    }
  }
  sequences_.erase(it);
}

void DraftLoop::Drop(StreamId stream, uint64_t seq_id, const Slot& slot) {
  table_.Remove(stream, seq_id);
  auto it = sequences_.find(slot.seq);
  if (it == sequences_.end()) return;
  for (int d : {kModel, kNgram, kEagle}) {
    if (it->second.added[d]) drafter(d)->Release(slot.seq).IgnoreError();
  }
  sequences_.erase(it);
}

double DraftLoop::KvCacheUsageRatio() {
  if (model_ == nullptr) return 0.0;
  const KvUsage usage = model_->Usage();
  if (usage.capacity_tokens <= 0) return 0.0;
  return static_cast<double>(usage.used_tokens) / static_cast<double>(usage.capacity_tokens);
}

absl::Status DraftLoop::Admit(StreamId stream, int index, const v1::DraftSequenceStep& step,
                              int64_t* kv_budget, Slot* slot, bool* empty_tree) {
  const std::string where = absl::StrCat("steps[", index, "]");
  const int vocab = ngram_->vocab_size();
  absl::StatusOr<std::optional<int64_t>> found =
      FindLive(stream, step.seq_id(), step.deadline_unix_ms(), where);
  if (!found.ok()) return found.status();
  std::optional<int64_t> live = *found;
  if (step.new_tokens().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".new_tokens: empty (send the prompt at the first step, then the emitted tokens)"));
  }
  if (absl::Status s = CheckTokenIds(step.new_tokens(), vocab, where + ".new_tokens"); !s.ok()) {
    return s;
  }
  if (step.has_accepted_node() &&
      (step.accepted_node() < -1 || step.accepted_node() >= kMaxTreeNodes)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".accepted_node: ", step.accepted_node(),
                                                   " is not -1 or a tree node index"));
  }
  switch (step.method()) {
    case v1::DRAFT_METHOD_MODEL:
      if (model_drafter_ == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat(where,
                         ".method: DRAFT_METHOD_MODEL, but this draft service has no draft model "
                         "(started without --model); use DRAFT_METHOD_NGRAM"));
      }
      slot->drafter = kModel;
      break;
    case v1::DRAFT_METHOD_NGRAM: slot->drafter = kNgram; break;
    case v1::DRAFT_METHOD_EAGLE:
      if (eagle_drafter_ == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat(where,
                         ".method: DRAFT_METHOD_EAGLE, but this draft service has no EAGLE head "
                         "(started without --eagle_head)"));
      }
      slot->drafter = kEagle;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".method: unknown value ", static_cast<int>(step.method())));
  }
  DraftParams& params = slot->request.params;
  // Clamped below INT32_MAX so the cast keeps values ValidateDraftParams refuses by name.
  auto field = [](uint32_t v, int fallback) {
    return v != 0 ? static_cast<int>(std::min<uint32_t>(v, 1 << 20)) : fallback;
  };
  params.depth = field(step.depth(), options_.defaults.depth);
  params.top_k = field(step.top_k(), options_.defaults.top_k);
  params.max_nodes = field(step.max_nodes(), options_.defaults.max_nodes);
  if (absl::Status s = ValidateDraftParams(params); !s.ok()) return Prefixed(s, where + ".");
  if (step.has_taps() && step.taps().tokens() > 0) {
    if (slot->drafter != kEagle) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".taps: only DRAFT_METHOD_EAGLE reads hidden states"));
    }
    const std::vector<int>& want = eagle_head_->config().taps;
    if (!std::equal(want.begin(), want.end(), step.taps().layers().begin(),
                    step.taps().layers().end())) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".taps.layers: the head reads target taps ",
                       absl::StrJoin(want, ", "), " (DraftInfo.eagle_tap_layers), in that order"));
    }
    if (absl::Status s = HiddenStatesFromProto(step.taps(), eagle_head_->config().feature_size(),
                                               where + ".taps", &slot->request.taps);
        !s.ok()) {
      return s;
    }
    slot->request.taps_first_position = step.taps().first_position();
  }

  const int64_t history =
      live.has_value() ? static_cast<int64_t>(sequences_[*live].history.size()) : 0;
  if (history + step.new_tokens_size() > options_.max_history_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".new_tokens: the sequence would hold ", history + step.new_tokens_size(),
        " tokens, more than this draft service keeps (", options_.max_history_tokens, ")"));
  }

  if (!live.has_value()) {
    if (table_.size() >= options_.max_sequences) {
      return absl::ResourceExhaustedError(absl::StrCat(
          where, ": this draft service already holds max_sequences = ", options_.max_sequences,
          " sequences"));
    }
    live = table_.Add(stream, step.seq_id());
    sequences_[*live] = Sequence();
    slot->created = true;
  }
  table_.SetDeadline(stream, step.seq_id(), step.deadline_unix_ms());
  slot->seq = *live;
  Sequence& seq = sequences_[*live];
  seq.history.insert(seq.history.end(), step.new_tokens().begin(), step.new_tokens().end());

  const int d = slot->drafter;
  if (!seq.added[d]) {
    if (absl::Status s = drafter(d)->AddSequence(*live); !s.ok()) return Prefixed(s, where + ": ");
    seq.added[d] = true;
  }
  slot->request.seq = *live;
  slot->request.new_tokens.assign(seq.history.begin() + seq.fed[d], seq.history.end());
  if (step.has_accepted_node()) slot->request.accepted_node = step.accepted_node();
  if (d == kModel) {
    const int64_t reach = static_cast<int64_t>(seq.history.size()) + params.depth;
    if (reach > model_->config().max_position_embeddings) {
      *empty_tree = true;  // past the draft model's context: nothing to propose
      return absl::OkStatus();
    }
    const int64_t need = static_cast<int64_t>(slot->request.new_tokens.size()) + params.max_nodes;
    if (need > *kv_budget) {
      return absl::ResourceExhaustedError(
          absl::StrCat(where, ": the draft KV cache has no room for ", need, " more tokens"));
    }
    *kv_budget -= need;
  }
  if (absl::Status s = drafter(d)->CheckRequest(slot->request); !s.ok()) {
    return Prefixed(s, where + ": ");
  }
  return absl::OkStatus();
}

std::vector<v1::DraftStepResponse> DraftLoop::RunSteps(const DraftStepQueue::Batch& batch) {
  std::vector<v1::DraftStepResponse> responses(batch.steps.size());
  std::array<std::vector<Slot>, kDrafters> slots;  // per drafter
  std::vector<Slot> pre_slots;                     // pre-drafts (model drafter), after the drafts
  std::vector<Slot> ingest_slots;                  // ingest-only steps (model drafter)
  int64_t kv_budget = INT64_MAX;
  if (model_ != nullptr) {
    const KvUsage usage = model_->Usage();
    kv_budget = usage.capacity_tokens - usage.used_tokens;
  }
  for (size_t b = 0; b < batch.steps.size(); ++b) {
    const StreamId stream = batch.steps[b].stream;
    const v1::DraftStepRequest& request = batch.steps[b].request;
    v1::DraftStepResponse& response = responses[b];
    response.set_step_id(request.step_id());
    ReleaseAndCancel(stream, request);
    for (int i = 0; i < request.steps_size(); ++i) {
      const v1::DraftSequenceStep& step = request.steps(i);
      v1::DraftSequenceResult* result = response.add_results();
      result->set_seq_id(step.seq_id());
      if (absl::Status unique = CheckUniqueSeqId(request, i); !unique.ok()) {
        ToSequenceError(unique, result->mutable_error());
        continue;
      }
      Slot slot;
      slot.step = b;
      slot.result = i;
      bool empty_tree = false;
      if (step.ingest_only() && (step.pre_draft() || step.method() != v1::DRAFT_METHOD_MODEL)) {
        ToSequenceError(
            absl::InvalidArgumentError(absl::StrCat(
                "steps[", i, "].ingest_only: DRAFT_METHOD_MODEL steps only, not with pre_draft")),
            result->mutable_error());
        continue;
      }
      if (step.pre_draft()) {
        absl::Status status = AdmitPreDraft(stream, i, step, &kv_budget, &slot, &empty_tree);
        if (!status.ok()) {
          ToSequenceError(status, result->mutable_error());
        } else if (empty_tree) {
          result->mutable_tree();
        } else {
          pre_slots.push_back(std::move(slot));
        }
        continue;
      }
      absl::Status status = Admit(stream, i, step, &kv_budget, &slot, &empty_tree);
      if (!status.ok()) {
        if (slot.created) Drop(stream, step.seq_id(), slot);
        ToSequenceError(status, result->mutable_error());
        continue;
      }
      if (empty_tree || step.ingest_only()) {
        result->mutable_tree();  // present and empty: target-only for this step
        if (!empty_tree) ingest_slots.push_back(std::move(slot));
        continue;
      }
      slots[slot.drafter].push_back(std::move(slot));
    }
  }

  // A step that takes in some sequence's prompt is a prefill step (specd_step_seconds's kind).
  bool prefill = false;
  for (const std::vector<Slot>* group :
       {&slots[kModel], &slots[kNgram], &slots[kEagle], &pre_slots, &ingest_slots}) {
    for (const Slot& slot : *group) prefill = prefill || slot.created;
  }
  const absl::Time start = absl::Now();
  int64_t batch_size = 0;
  int64_t tokens = 0;
  for (int d : {kModel, kNgram, kEagle}) {
    std::vector<Slot>& group = slots[d];
    if (group.empty()) continue;
    batch_size += group.size();
    std::vector<DraftRequest> requests;
    requests.reserve(group.size());
    for (const Slot& slot : group) requests.push_back(slot.request);
    std::vector<absl::StatusOr<TokenTree>> trees(group.size());
    const int64_t fed_before = d == kModel   ? model_drafter_->fed_tokens()
                               : d == kEagle ? eagle_drafter_->fed_tokens()
                                             : 0;
    absl::StatusOr<std::vector<TokenTree>> all = drafter(d)->Draft(requests);
    if (all.ok()) {
      for (size_t k = 0; k < group.size(); ++k) trees[k] = std::move((*all)[k]);
    } else {
      // A failed Draft() leaves every sequence as it was, so each can be retried alone.
      SPECD_LOG(WARNING) << "batched draft of " << group.size()
                         << " sequences failed, retrying one by one: " << all.status();
      for (size_t k = 0; k < group.size(); ++k) {
        absl::StatusOr<std::vector<TokenTree>> one =
            drafter(d)->Draft(absl::MakeConstSpan(&requests[k], 1));
        if (one.ok()) {
          trees[k] = std::move((*one)[0]);
        } else {
          trees[k] = one.status();
        }
      }
    }
    // What went through the draft model: accepted tokens whose KV was kept are not fed again.
    if (d == kModel) tokens += model_drafter_->fed_tokens() - fed_before;
    if (d == kEagle) tokens += eagle_drafter_->fed_tokens() - fed_before;
    for (size_t k = 0; k < group.size(); ++k) {
      const Slot& slot = group[k];
      const StreamId stream = batch.steps[slot.step].stream;
      v1::DraftSequenceResult* result = responses[slot.step].mutable_results(slot.result);
      if (!trees[k].ok()) {
        if (slot.created) Drop(stream, result->seq_id(), slot);
        ToSequenceError(trees[k].status(), result->mutable_error());
        continue;
      }
      Sequence& seq = sequences_[slot.seq];
      seq.fed[d] = seq.history.size();
      const TokenTree& tree = *trees[k];
      TreeToProto(tree, result->mutable_tree());
    }
  }
  if (!pre_slots.empty()) {
    if (options_.test_only_pre_draft_delay > absl::ZeroDuration()) {
      absl::SleepFor(options_.test_only_pre_draft_delay);
    }
    batch_size += pre_slots.size();
    const int64_t fed_before = model_drafter_->fed_tokens();
    RunPreDrafts(pre_slots, &responses);
    tokens += model_drafter_->fed_tokens() - fed_before;
  }
  if (!ingest_slots.empty()) {
    batch_size += ingest_slots.size();
    const int64_t fed_before = model_drafter_->fed_tokens();
    RunIngests(batch, ingest_slots, &responses);
    tokens += model_drafter_->fed_tokens() - fed_before;
  }
  if (batch_size > 0) RecordStep(start, batch_size, tokens, prefill);
  if (model_ != nullptr) {
    const Backend::ExecutionCounts counts = model_->execution_counts();
    metrics_->SetExecutionTotals(counts.graph_captures, counts.graph_replays, counts.eager_steps);
  }
  return responses;
}

void DraftLoop::RunIngests(const DraftStepQueue::Batch& batch, const std::vector<Slot>& group,
                           std::vector<v1::DraftStepResponse>* responses) {
  std::vector<DraftRequest> requests;
  requests.reserve(group.size());
  for (const Slot& slot : group) requests.push_back(slot.request);
  std::vector<absl::Status> results(group.size());
  if (absl::Status all = model_drafter_->Ingest(requests); !all.ok()) {
    // A failed Ingest() can be retried: find the culprit one by one.
    for (size_t k = 0; k < group.size(); ++k) {
      results[k] = model_drafter_->Ingest(absl::MakeConstSpan(&requests[k], 1));
    }
  }
  for (size_t k = 0; k < group.size(); ++k) {
    const Slot& slot = group[k];
    v1::DraftSequenceResult* result = (*responses)[slot.step].mutable_results(slot.result);
    if (!results[k].ok()) {
      if (slot.created) Drop(batch.steps[slot.step].stream, result->seq_id(), slot);
      ToSequenceError(results[k], result->mutable_error());
      continue;
    }
    Sequence& seq = sequences_[slot.seq];
    seq.fed[kModel] = seq.history.size();
  }
}

void DraftLoop::RunPreDrafts(const std::vector<Slot>& group,
                             std::vector<v1::DraftStepResponse>* responses) {
  std::vector<DraftRequest> requests;
  requests.reserve(group.size());
  for (const Slot& slot : group) requests.push_back(slot.request);
  std::vector<absl::StatusOr<DraftModelDrafter::PreDraftResult>> results(group.size());
  auto all = model_drafter_->PreDraft(requests);
  if (all.ok()) {
    for (size_t k = 0; k < group.size(); ++k) results[k] = std::move((*all)[k]);
  } else {
    // Request errors leave every sequence as it was: find the culprit one by one.
    for (size_t k = 0; k < group.size(); ++k) {
      auto one = model_drafter_->PreDraft(absl::MakeConstSpan(&requests[k], 1));
      if (one.ok()) {
        results[k] = std::move((*one)[0]);
      } else {
        results[k] = one.status();
      }
    }
  }
  for (size_t k = 0; k < group.size(); ++k) {
    const Slot& slot = group[k];
    v1::DraftSequenceResult* result = (*responses)[slot.step].mutable_results(slot.result);
    Sequence& seq = sequences_[slot.seq];
    if (!results[k].ok()) {
      // The router resends the new tokens with its next step.
      seq.history.resize(seq.history.size() - slot.appended);
      ToSequenceError(results[k].status(), result->mutable_error());
      continue;
    }
    seq.fed[kModel] += results[k]->consumed;
    TreeToProto(results[k]->tree, result->mutable_tree());
    result->mutable_guess_tokens()->Assign(results[k]->guess_tokens.begin(),
                                           results[k]->guess_tokens.end());
    result->set_guess_node(results[k]->guess_node);
    for (const DraftModelDrafter::PreDraftGuess& guess : results[k]->more) {
      v1::PreDraftGuess* out = result->add_more_guesses();
      out->mutable_tokens()->Assign(guess.tokens.begin(), guess.tokens.end());
      out->set_node(guess.node);
      TreeToProto(guess.tree, out->mutable_tree());
    }
  }
}

absl::Status DraftLoop::AdmitPreDraft(StreamId stream, int index, const v1::DraftSequenceStep& step,
                                      int64_t* kv_budget, Slot* slot, bool* empty_tree) {
  const std::string where = absl::StrCat("steps[", index, "]");
  absl::StatusOr<std::optional<int64_t>> found =
      FindLive(stream, step.seq_id(), step.deadline_unix_ms(), where);
  if (!found.ok()) return found.status();
  if (!found->has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ".pre_draft: sequence ", step.seq_id(),
                     " is not held here; pre-drafting follows a draft step of the sequence"));
  }
  if (step.method() != v1::DRAFT_METHOD_MODEL || model_drafter_ == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".pre_draft: needs DRAFT_METHOD_MODEL and a draft model"));
  }
  if (absl::Status s =
          CheckTokenIds(step.new_tokens(), ngram_->vocab_size(), where + ".new_tokens");
      !s.ok()) {
    return s;
  }
  DraftParams& params = slot->request.params;
  auto field = [](uint32_t v, int fallback) {
    return v != 0 ? static_cast<int>(std::min<uint32_t>(v, 1 << 20)) : fallback;
  };
  params.depth = field(step.depth(), options_.defaults.depth);
  params.top_k = field(step.top_k(), options_.defaults.top_k);
  params.max_nodes = field(step.max_nodes(), options_.defaults.max_nodes);
  if (absl::Status s = ValidateDraftParams(params); !s.ok()) return Prefixed(s, where + ".");
  const int64_t live = **found;
  Sequence& seq = sequences_[live];
  if (static_cast<int64_t>(seq.history.size()) + step.new_tokens_size() >
      options_.max_history_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".new_tokens: more than this draft service keeps (",
                     options_.max_history_tokens, " tokens)"));
  }
  if (!seq.added[kModel]) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ".pre_draft: the draft model has not drafted this sequence yet"));
  }
  table_.SetDeadline(stream, step.seq_id(), step.deadline_unix_ms());
  seq.history.insert(seq.history.end(), step.new_tokens().begin(), step.new_tokens().end());
  slot->appended = step.new_tokens_size();
  slot->seq = live;
  slot->drafter = kModel;
  slot->request.seq = live;
  slot->request.new_tokens.assign(seq.history.begin() + seq.fed[kModel], seq.history.end());
  slot->request.target_samples = step.target_samples();
  if (step.fan_out() > kMaxPreDraftFanOut) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".fan_out: at most ", kMaxPreDraftFanOut, ", got ", step.fan_out()));
  }
  slot->request.fan_out = std::max<int>(static_cast<int>(step.fan_out()), 1);
  if (step.chain_rates_size() > kMaxChainRates) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".chain_rates: at most ", kMaxChainRates,
                                                   ", got ", step.chain_rates_size()));
  }
  for (int d = 0; d < step.chain_rates_size(); ++d) {
    const float rate = step.chain_rates(d);
    if (!(rate >= 0.0f && rate <= 1.0f)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".chain_rates[", d, "]: not in [0, 1]: ", rate));
    }
  }
  slot->request.chain_rates.assign(step.chain_rates().begin(), step.chain_rates().end());
  // The guess adds up to a path and a bonus token before the next tree.
  const int64_t reach = static_cast<int64_t>(seq.history.size()) + 2 * params.depth + 2;
  if (reach > model_->config().max_position_embeddings) {
    *empty_tree = true;
    return absl::OkStatus();
  }
  // Each guess appends its path's unexpanded rest and its tree to the scratch region.
  const int64_t need =
      static_cast<int64_t>(slot->request.fan_out) * (params.depth + 1 + params.max_nodes);
  if (need > *kv_budget) {
    *empty_tree = true;  // no room to guess; the sequence is drafted after its outcome
    return absl::OkStatus();
  }
  *kv_budget -= need;
  return absl::OkStatus();
}

}  // namespace specd
