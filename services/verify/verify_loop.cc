#include "services/verify/verify_loop.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/service/grpc_util.h"
#include "common/service/hidden_states_proto.h"
#include "common/service/model_service_main.h"
#include "common/service/tree_proto.h"
#include "services/verify/sampling_proto.h"

namespace specd {

absl::StatusOr<std::unique_ptr<VerifyLoop>> VerifyLoop::Create(const VerifyLoopOptions& options,
                                                               VerifyStepQueue* queue,
                                                               ModelServiceMetrics* metrics) {
  if (options.max_sequences < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_sequences: ", options.max_sequences, " must be at least 1"));
  }
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      CreateBackend(options.model_dir, options.backend);
  if (!backend.ok()) {
    return absl::Status(backend.status().code(),
                        absl::StrCat("loading the target model from ", options.model_dir, ": ",
                                     backend.status().message()));
  }
  return std::unique_ptr<VerifyLoop>(new VerifyLoop(std::move(*backend), queue, options, metrics));
}

VerifyLoop::VerifyLoop(std::unique_ptr<Backend> backend, VerifyStepQueue* queue,
                       const VerifyLoopOptions& options, ModelServiceMetrics* metrics)
    : StepLoop(queue, metrics, options.max_gather),
      backend_(std::move(backend)),
      options_(options) {
  const ModelConfig& config = backend_->config();
  info_.set_model(ModelNameFromPath(options.model_dir));
  info_.set_vocab_size(config.vocab_size);
  info_.set_max_context(config.max_position_embeddings);
  info_.mutable_eos_token_ids()->Add(config.eos_token_ids.begin(), config.eos_token_ids.end());
  info_.set_tensor_parallel(options.backend.tensor_parallel);
  const VerifyFeatures features = backend_->verify_features();
  info_.set_supports_logprobs(features.logprobs);
  info_.set_supports_logits_processors(features.logits_processors);
  info_.set_rows_padded(backend_->pads_rows());
  const KvUsage usage = backend_->Usage();
  info_.mutable_load()->set_kv_capacity_tokens(usage.capacity_tokens);
  info_.mutable_load()->set_max_sequences(options.max_sequences);
  capacity_summary_ =
      KvCapacityLine(usage.capacity_tokens, config.max_position_embeddings, options.max_sequences);
  info_.set_supports_taps(features.taps);
  if (features.taps) info_.set_max_tap_layer(MaxTapLayer(features, backend_->config().num_layers));
  Start();
}

VerifyLoop::~VerifyLoop() { Stop(); }

void VerifyLoop::FreeModelState(int64_t seq) {
  histories_.erase(seq);
  tap_backlog_.erase(seq);
  backend_held_.erase(seq);  // RemoveSequence() drops the backend's rows
  if (absl::Status s = backend_->RemoveSequence(seq); !s.ok()) {
    SPECD_LOG(WARNING) << "freeing sequence " << seq << ": " << s;
  }
}

void VerifyLoop::Forget(int64_t seq) {
  histories_.erase(seq);
  tap_backlog_.erase(seq);
  backend_held_.erase(seq);
  (void)backend_->RemoveSequence(seq);
}

void VerifyLoop::SendTaps(int64_t seq, const std::vector<int>& layers, v1::TensorDtype dtype,
                          const std::vector<float>& taps, int64_t first_position, bool hold,
                          int64_t* reply_bytes, v1::HiddenStates* out) {
  const int64_t width = static_cast<int64_t>(layers.size()) * backend_->config().hidden_size;
  TapBacklog& held = tap_backlog_[seq];
  const int64_t held_rows = static_cast<int64_t>(held.rows.size()) / width;
  // Held rows continue only into rows of the same layers and type that follow them; otherwise
  // they are dropped, and the drafter sees a gap (its head restarts from the rows after it).
  if (held.rows.empty() || held.layers != layers || held.dtype != dtype ||
      held.first_position + held_rows != first_position) {
    if (!held.rows.empty()) {
      SPECD_LOG(WARNING) << "sequence " << seq << ": " << held_rows
                         << " held tap rows dropped (their layers or positions no longer follow)";
    }
    held.rows.clear();
    held.first_position = first_position;
    held.layers = layers;
    held.dtype = dtype;
  }
  held.rows.insert(held.rows.end(), taps.begin(), taps.end());
  if (!hold) {
    SendHeld(seq, reply_bytes, out);
    return;
  }
  // Bounded: past the bound the older half goes (halving keeps the drops rare, so a long
  // plain run costs amortised O(1) a row). The drafter then restarts its head from the newer
  // half: lossless, with a shorter context for the head.
  const int64_t max_rows = MaxHeldRows(layers.size());
  const int64_t rows = static_cast<int64_t>(held.rows.size()) / width;
  if (rows > max_rows) {
    const int64_t drop = rows - max_rows / 2;
    held.rows.erase(held.rows.begin(), held.rows.begin() + drop * width);
    held.first_position += drop;
  }
}

int64_t VerifyLoop::MaxHeldRows(size_t layers) const {
  const int64_t width = static_cast<int64_t>(layers) * backend_->config().hidden_size;
  return std::max<int64_t>(1, options_.max_held_tap_bytes / (width * 4));
}

void VerifyLoop::TakeBackendHeld(int64_t seq) {
  auto it = backend_held_.find(seq);
  if (it == backend_held_.end()) return;
  const v1::TensorDtype dtype = it->second;
  backend_held_.erase(it);
  absl::StatusOr<HeldTapRows> held = backend_->TakeHeldTaps(seq);
  if (!held.ok()) {
    // The rows after them then follow a gap, and the drafter restarts its head (lossless).
    SPECD_LOG(WARNING) << "sequence " << seq << ": taking its held taps failed: " << held.status();
    return;
  }
  if (held->rows.empty()) return;
  SendTaps(seq, held->layers, dtype, held->rows, held->first_position, /*hold=*/true, nullptr,
           nullptr);
}

void VerifyLoop::SendHeld(int64_t seq, int64_t* reply_bytes, v1::HiddenStates* out) {
  auto it = tap_backlog_.find(seq);
  if (it == tap_backlog_.end()) return;
  TapBacklog& held = it->second;
  const int64_t width = static_cast<int64_t>(held.layers.size()) * backend_->config().hidden_size;
  const int64_t row_bytes = width * (held.dtype == v1::TENSOR_DTYPE_FP32 ? 4 : 2);
  const int64_t budget = options_.max_tap_bytes_per_reply > 0 ? options_.max_tap_bytes_per_reply
                                                              : kMaxMessageBytes / 2;
  const int64_t rows = static_cast<int64_t>(held.rows.size()) / width;
  const int64_t n = std::min(rows, std::max<int64_t>(0, (budget - *reply_bytes) / row_bytes));
  if (n > 0) {
    HiddenStatesToProto(absl::MakeConstSpan(held.rows).first(n * width), n, width, held.layers,
                        held.first_position, held.dtype, out);
    *reply_bytes += n * row_bytes;
  }
  if (n == rows) {
    tap_backlog_.erase(it);
    return;
  }
  held.rows.erase(held.rows.begin(), held.rows.begin() + n * width);
  held.first_position += n;
}

double VerifyLoop::KvCacheUsageRatio() {
  const KvUsage usage = backend_->Usage();
  return usage.capacity_tokens > 0
             ? static_cast<double>(usage.used_tokens) / static_cast<double>(usage.capacity_tokens)
             : 0.0;
}

absl::Status VerifyLoop::Admit(StreamId stream, int index, const v1::VerifySequenceStep& step,
                               int64_t* kv_budget, VerifyItem* item, Slot* slot) {
  const ModelConfig& config = backend_->config();
  const std::string where = absl::StrCat("steps[", index, "]");
  absl::StatusOr<std::optional<int64_t>> found =
      FindLive(stream, step.seq_id(), step.deadline_unix_ms(), where);
  if (!found.ok()) return found.status();
  std::optional<int64_t> live = *found;
  if (step.pending().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".pending: empty (send the prompt at the first step, then the bonus token)"));
  }
  if (absl::Status s = CheckTokenIds(step.pending(), config.vocab_size, where + ".pending");
      !s.ok()) {
    return s;
  }
  item->tree = TreeFromProto(step.tree());
  if (absl::Status s = ValidateTree(item->tree, config.vocab_size); !s.ok()) {
    return Prefixed(s, where + ".");
  }
  if (absl::Status s = SamplingFromProto(step.sampling(), config.eos_token_ids, config.vocab_size,
                                         &item->sampling);
      !s.ok()) {
    return Prefixed(s, where + ".sampling.");
  }
  if (step.has_logprobs()) {
    if (step.logprobs() > static_cast<uint32_t>(kMaxLogprobs)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".logprobs: ", step.logprobs(), " must be at most ", kMaxLogprobs));
    }
    item->logprobs = static_cast<int>(step.logprobs());
  }
  switch (step.logprobs_mode()) {
    case v1::LOGPROBS_MODE_RAW: item->logprobs_mode = LogprobsMode::kRaw; break;
    case v1::LOGPROBS_MODE_PROCESSED: item->logprobs_mode = LogprobsMode::kProcessed; break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".logprobs_mode: unknown value ", step.logprobs_mode()));
  }
  if (absl::Status s =
          CheckVerifySupport(backend_->verify_features(), item->sampling, item->logprobs,
                             absl::StrCat("the ", options_.backend.device, " backend"));
      !s.ok()) {
    return Prefixed(s, where + ".");
  }
  if (step.hold_taps() && step.tap_layers_size() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".hold_taps: set without tap_layers (there are no taps to hold)"));
  }
  if (step.tap_layers_size() > 0) {
    if (!backend_->verify_features().taps) {
      return absl::UnimplementedError(
          absl::StrCat(where, ".tap_layers: the ", options_.backend.device,
                       " backend does not export hidden states (EAGLE drafting needs them)"));
    }
    if (step.tap_layers_size() > kMaxTapLayers) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".tap_layers: ", step.tap_layers_size(),
                                                     " layers, at most ", kMaxTapLayers));
    }
    const int max_tap = MaxTapLayer(backend_->verify_features(), config.num_layers);
    for (int i = 0; i < step.tap_layers_size(); ++i) {
      const int layer = step.tap_layers(i);
      if (layer < 0 || layer > max_tap) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ".tap_layers[", i, "]: ", layer, " is not a tap in [0, ", max_tap, "]",
            max_tap == config.num_layers
                ? " (this backend does not export the final norm's output, tap num_layers + 1)"
                : ""));
      }
      for (int j = 0; j < i; ++j) {
        if (step.tap_layers(j) == layer) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ".tap_layers[", i, "]: ", layer, " is listed twice"));
        }
      }
    }
    if (step.tap_dtype() != v1::TENSOR_DTYPE_BF16 && step.tap_dtype() != v1::TENSOR_DTYPE_FP32) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".tap_dtype: unknown value ", static_cast<int>(step.tap_dtype())));
    }
    item->tap_layers.assign(step.tap_layers().begin(), step.tap_layers().end());
    slot->tap_dtype = step.tap_dtype();
    slot->hold_taps = step.hold_taps();
  }
  const bool needs_history = item->sampling.needs_history();
  if (needs_history && live.has_value() && !histories_.contains(*live)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where,
                     ".sampling: penalties and min_tokens must be set from a sequence's first step "
                     "(this one started without them, so its history was not kept)"));
  }
  // Checked before the sequence is created, so a refused first step leaves nothing behind.
  if (step.has_prompt_length()) {
    if (live.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".prompt_length: only a sequence's first step may set it (this one is live)"));
    }
    if (step.prompt_length() < 1 ||
        step.prompt_length() > static_cast<uint32_t>(step.pending_size())) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".prompt_length: ", step.prompt_length(), " must be in [1, ",
                       step.pending_size(), "] (the pending size)"));
    }
  }
  int64_t committed = 0;
  if (live.has_value()) {
    absl::StatusOr<int64_t> len = backend_->CommittedLength(*live);
    if (!len.ok()) return len.status();
    committed = *len;
  }
  const int depth = TreeMaxDepth(item->tree);
  // The bonus token after the deepest accepted node must still have a position.
  const int64_t reach = committed + step.pending_size() + depth + 1;
  if (reach > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the sequence would reach ", reach,
                                                   " tokens, beyond the model's context of ",
                                                   config.max_position_embeddings));
  }
  const int64_t need = step.pending_size() + item->tree.size();
  if (need > *kv_budget) {
    return absl::ResourceExhaustedError(
        absl::StrCat(where, ": the KV cache has no room for ", need, " more tokens"));
  }
  if (!live.has_value()) {
    if (table_.size() >= options_.max_sequences) {
      return absl::ResourceExhaustedError(absl::StrCat(
          where, ": this verify service already holds max_sequences = ", options_.max_sequences,
          " sequences"));
    }
    const int64_t seq = table_.Add(stream, step.seq_id());
    if (absl::Status s = backend_->AddSequence(seq); !s.ok()) {
      table_.Remove(stream, step.seq_id());
      return Prefixed(s, where + ": ");
    }
    live = seq;
    slot->created = true;
  }
  table_.SetDeadline(stream, step.seq_id(), step.deadline_unix_ms());
  *kv_budget -= need;
  slot->seq = *live;
  item->seq = *live;
  item->pending.assign(step.pending().begin(), step.pending().end());
  // A kept history follows every step, also one that (against the contract) drops the
  // penalties, so that it is still right if a later step sets them again.
  TokenHistory* history = nullptr;
  if (needs_history) {
    history = &histories_[*live];
  } else if (auto h = histories_.find(*live); h != histories_.end()) {
    history = &h->second;
  }
  if (history != nullptr) {
    // The history covers the pending tokens too: the prompt at the first step (the output
    // after prompt_length, when a resync feeds it again), output after.
    if (slot->created) {
      const size_t prompt = step.has_prompt_length() ? step.prompt_length() : item->pending.size();
      const absl::Span<const int32_t> pending(item->pending);
      history->AddPrompt(pending.first(prompt));
      if (prompt < pending.size()) history->AddOutput(pending.subspan(prompt));
    } else {
      history->AddOutput(item->pending);
    }
    item->history = history;
  }
  return absl::OkStatus();
}

std::vector<v1::VerifyStepResponse> VerifyLoop::RunSteps(const VerifyStepQueue::Batch& batch) {
  std::vector<v1::VerifyStepResponse> responses(batch.steps.size());
  std::vector<VerifyItem> items;
  std::vector<Slot> slots;
  const KvUsage usage = backend_->Usage();
  int64_t kv_budget = usage.capacity_tokens - usage.used_tokens;
  std::vector<int64_t> tap_bytes(responses.size(), 0);  // per reply
  for (size_t b = 0; b < batch.steps.size(); ++b) {
    const StreamId stream = batch.steps[b].stream;
    const v1::VerifyStepRequest& request = batch.steps[b].request;
    v1::VerifyStepResponse& response = responses[b];
    response.set_step_id(request.step_id());
    ReleaseAndCancel(stream, request);
    for (uint64_t id : request.send_held_taps()) {
      v1::HeldTaps* held = response.add_held_taps();
      held->set_seq_id(id);
      if (std::optional<int64_t> live = table_.Find(stream, id); live.has_value()) {
        TakeBackendHeld(*live);
        SendHeld(*live, &tap_bytes[b], held->mutable_taps());
      }
    }
    for (int i = 0; i < request.steps_size(); ++i) {
      const v1::VerifySequenceStep& step = request.steps(i);
      v1::VerifySequenceResult* result = response.add_results();
      result->set_seq_id(step.seq_id());
      VerifyItem item;
      Slot slot{b, i, 0, false};
      absl::Status status = CheckUniqueSeqId(request, i);
      if (status.ok()) status = Admit(stream, i, step, &kv_budget, &item, &slot);
      if (!status.ok()) {
        ToSequenceError(status, result->mutable_error());
        continue;
      }
      // A plain step's taps stay where the backend computed them when it can keep them (a CUDA
      // backend: on its device, copied down only when fetched) and nothing is held here yet.
      if (slot.hold_taps && backend_->verify_features().held_taps &&
          !tap_backlog_.contains(slot.seq)) {
        item.hold_tap_rows = MaxHeldRows(item.tap_layers.size());
      }
      items.push_back(std::move(item));
      slots.push_back(slot);
    }
  }

  if (!items.empty()) {
    int64_t tokens = 0;
    for (const VerifyItem& item : items) tokens += item.pending.size() + item.tree.size();
    // Committed lengths before the step tell, if the batch fails, which sequences it had
    // already advanced (the default Verify commits item by item).
    std::vector<int64_t> committed_before(items.size());
    for (size_t k = 0; k < items.size(); ++k) {
      committed_before[k] = backend_->CommittedLength(items[k].seq).value_or(-1);
    }
    const absl::Time start = absl::Now();
    absl::StatusOr<std::vector<VerifyOutcome>> outcomes = backend_->Verify(items);
    std::vector<absl::StatusOr<VerifyOutcome>> each(items.size());
    if (outcomes.ok()) {
      for (size_t k = 0; k < items.size(); ++k) each[k] = std::move((*outcomes)[k]);
    } else {
      // One bad sequence must not fail the others (the usual cause is KV blocks running out
      // sooner than the token count predicts): drop whatever the failed batch left in the
      // scratch regions and run every sequence alone. A sequence the failed batch already
      // committed cannot be replayed; it fails and is freed.
      SPECD_LOG(WARNING) << "batched verify of " << items.size()
                         << " sequences failed, retrying one by one: " << outcomes.status();
      for (size_t k = 0; k < items.size(); ++k) {
        (void)backend_->Commit(items[k].seq, {});
        if (backend_->CommittedLength(items[k].seq).value_or(-1) != committed_before[k]) {
          each[k] =
              absl::InternalError(absl::StrCat("the sequence's state was lost in a failed batch (",
                                               outcomes.status().message(), "); it was freed"));
          continue;
        }
        absl::StatusOr<std::vector<VerifyOutcome>> one =
            backend_->Verify(absl::MakeConstSpan(&items[k], 1));
        if (one.ok()) {
          each[k] = std::move((*one)[0]);
        } else {
          (void)backend_->Commit(items[k].seq, {});
          each[k] = one.status();
        }
      }
    }
    const bool prefill =
        std::any_of(slots.begin(), slots.end(), [](const Slot& s) { return s.created; });
    RecordStep(start, items.size(), tokens, prefill);
    const Backend::ExecutionCounts counts = backend_->execution_counts();
    metrics_->SetExecutionTotals(counts.graph_captures, counts.graph_replays, counts.eager_steps);

    for (size_t k = 0; k < items.size(); ++k) {
      const Slot& slot = slots[k];
      v1::VerifySequenceResult* result = responses[slot.step].mutable_results(slot.result);
      if (!each[k].ok()) {
        if (slot.created || each[k].status().code() == absl::StatusCode::kInternal) {
          // A sequence whose first step failed holds nothing worth keeping, and one whose
          // state was lost cannot go on.
          const StreamId stream = batch.steps[slot.step].stream;
          table_.Remove(stream, result->seq_id());
          Forget(slot.seq);
          if (!slot.created) {
            table_.SetTombstone(stream, result->seq_id(), absl::StatusCode::kInternal);
          }
        } else if (auto h = histories_.find(slot.seq); h != histories_.end()) {
          h->second.RemoveOutput(items[k].pending);  // the step did not happen
        }
        ToSequenceError(each[k].status(), result->mutable_error());
        continue;
      }
      const VerifyOutcome& outcome = *each[k];
      result->mutable_tokens()->Add(outcome.tokens.begin(), outcome.tokens.end());
      result->set_accepted_draft(outcome.accepted_draft);
      result->mutable_accepted_nodes()->Add(outcome.accepted_nodes.begin(),
                                            outcome.accepted_nodes.end());
      for (const TokenLogprobs& lp : outcome.logprobs) LogprobsToProto(lp, result->add_logprobs());
      if (!items[k].tap_layers.empty() && items[k].hold_tap_rows > 0 && outcome.taps.empty()) {
        backend_held_[slot.seq] = slot.tap_dtype;  // the backend keeps them
      } else if (!items[k].tap_layers.empty()) {
        // Chunked across replies: a reply carries taps up to its budget (half the message
        // limit by default), so a batch of long prompts never breaks the stream; the rest go
        // out, in order, with the sequence's next replies. Until they have all arrived the
        // drafter proposes nothing for it (target-only steps, still lossless). Rows the
        // backend held go first (and here, when it had no room for this step's).
        TakeBackendHeld(slot.seq);
        SendTaps(slot.seq, items[k].tap_layers, slot.tap_dtype, outcome.taps, committed_before[k],
                 slot.hold_taps, &tap_bytes[slot.step], result->mutable_taps());
      } else {
        // Nobody reads taps of this sequence now (its drafter is gone or not EAGLE's).
        tap_backlog_.erase(slot.seq);
        if (backend_held_.erase(slot.seq) > 0) (void)backend_->TakeHeldTaps(slot.seq);
      }
      if (auto h = histories_.find(slot.seq); h != histories_.end()) {
        // The accepted drafts are committed; the bonus token comes back as the next pending.
        h->second.AddOutput(absl::MakeConstSpan(outcome.tokens).first(outcome.accepted_draft));
      }
    }
  }
  return responses;
}

}  // namespace specd
