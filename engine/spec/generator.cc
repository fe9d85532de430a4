#include "engine/spec/generator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace specd {

absl::StatusOr<std::unique_ptr<Generator>> Generator::Create(Backend* target, Drafter* drafter,
                                                             GeneratorOptions options) {
  if (target == nullptr) return absl::InvalidArgumentError("target: null backend");
  if (drafter != nullptr && drafter->vocab_size() != target->config().vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("drafter: vocab_size ", drafter->vocab_size(),
                                                   " differs from the target's ",
                                                   target->config().vocab_size));
  }
  std::unique_ptr<NgramDrafter> ngram;
  if (options.auto_ngram && drafter != nullptr) {
    absl::StatusOr<std::unique_ptr<NgramDrafter>> created =
        NgramDrafter::Create(target->config().vocab_size, options.ngram);
    if (!created.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("ngram.", created.status().message()));
    }
    ngram = *std::move(created);
  }
  return std::unique_ptr<Generator>(
      new Generator(target, drafter, std::move(options), std::move(ngram)));
}

absl::StatusOr<std::vector<GenerationResult>> Generator::Generate(
    absl::Span<const GenerationRequest> requests, const TokenCallback& on_tokens) {
  const ModelConfig& config = target_->config();
  std::vector<SequenceState> states;
  states.reserve(requests.size());
  // Each request's sampling as the target sees it (min_tokens_stop_ids completed), and the
  // history its processors read, kept only for requests whose sampling needs one.
  std::vector<SamplingParams> sampling(requests.size());
  std::vector<TokenHistory> histories(requests.size());
  std::vector<int64_t> history_fed(requests.size(), 0);  // tokens added to histories[i]
  std::vector<std::vector<TokenLogprobs>> logprobs(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerationRequest& r = requests[i];
    auto prefix = [i](const absl::Status& s) {
      return absl::Status(s.code(), absl::StrCat("requests[", i, "].", s.message()));
    };
    sampling[i] = r.sampling;
    if (r.sampling.min_tokens > 0) {
      std::vector<int32_t>& ids = sampling[i].min_tokens_stop_ids;
      for (const std::vector<int32_t>* more : {&config.eos_token_ids, &r.stop_token_ids}) {
        for (int32_t id : *more) {
          if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
        }
      }
    }
    if (absl::Status s = ValidateSamplingParams(sampling[i], config.vocab_size); !s.ok()) {
      return prefix(absl::InvalidArgumentError(absl::StrCat("sampling.", s.message())));
    }
    if (r.logprobs < -1 || r.logprobs > kMaxLogprobs) {
      return prefix(absl::InvalidArgumentError(
          absl::StrCat("logprobs: ", r.logprobs, " must be in [-1, ", kMaxLogprobs, "]")));
    }
    if (absl::Status s = CheckVerifySupport(target_->verify_features(), sampling[i], r.logprobs,
                                            "the target backend");
        !s.ok()) {
      return prefix(s);
    }
    if (drafter_ != nullptr && r.speculate) {
      if (absl::Status s = ValidateDraftParams(r.draft); !s.ok()) {
        return prefix(absl::InvalidArgumentError(absl::StrCat("draft.", s.message())));
      }
    }
    StopConditions stop;
    stop.max_new_tokens = r.max_new_tokens;
    stop.eos_token_ids = config.eos_token_ids;
    stop.stop_token_ids = r.stop_token_ids;
    stop.ignore_eos = r.ignore_eos;
    stop.max_total_tokens = config.max_position_embeddings;
    absl::StatusOr<SequenceState> st = SequenceState::Create(r.prompt, stop, config.vocab_size);
    if (!st.ok()) return prefix(st.status());
    states.push_back(*std::move(st));
  }

  // Sequence ids of this call; live[i] while request i holds KV in the target / drafter.
  std::vector<SeqId> ids(requests.size());
  std::vector<char> in_target(requests.size(), 0), in_drafter(requests.size(), 0);
  auto release = [&](size_t i) {
    if (in_target[i]) target_->RemoveSequence(ids[i]).IgnoreError();
    if (in_drafter[i]) drafter_->Release(ids[i]).IgnoreError();
    in_target[i] = in_drafter[i] = 0;
  };
  auto release_all = [&] {
    for (size_t i = 0; i < requests.size(); ++i) release(i);
  };
  for (size_t i = 0; i < requests.size(); ++i) {
    ids[i] = next_seq_++;
    if (absl::Status s = target_->AddSequence(ids[i]); !s.ok()) {
      release_all();
      return s;
    }
    in_target[i] = 1;
    if (drafter_ != nullptr && requests[i].speculate) {
      if (absl::Status s = drafter_->AddSequence(ids[i]); !s.ok()) {
        release_all();
        return s;
      }
      in_drafter[i] = 1;
    }
  }

  std::vector<size_t> active(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) active[i] = i;
  std::vector<DraftRequest> draft_requests;
  std::vector<size_t> drafted;                    // request index of each draft request
  std::vector<int> tree_of(requests.size(), -1);  // index into `trees` per request
  std::vector<VerifyItem> verify_items;
  std::vector<PolicySequence> plan_inputs;
  // A drafter that reads the target's taps (EAGLE) gets those of every committed token, kept
  // per request until its next draft step.
  const std::vector<int> tap_layers =
      drafter_ != nullptr ? drafter_->tap_layers() : std::vector<int>();
  std::vector<std::vector<float>> taps(requests.size());
  std::vector<int64_t> taps_first(requests.size(), 0);
  std::vector<int64_t> committed_before;
  // Per request: the deepest node of the drafter's last verified tree that the target accepted
  // (-1 none), reported with its next draft step, however many steps without its trees came
  // between, so that a drafter keeping that step's KV commits the accepted path instead of
  // feeding it again (DraftRequest::accepted_node, as the router reports it); kNoOutcome once
  // reported, or when the drafter's tree did not reach verify.
  std::vector<int32_t> draft_outcome(requests.size(), DraftRequest::kNoOutcome);
  std::vector<char> verified_draft;  // per active request: its tree came from the drafter
  // Per request: this step's n-gram proposal (GeneratorOptions::auto_ngram), and whether the
  // plan chose it.
  std::vector<TokenTree> ngram_trees(requests.size());
  std::vector<char> ngram_now(requests.size(), 0);
  int ngram_max_depth = 0;
  for (const int d : policy_.options().ngram_depths) ngram_max_depth = std::max(ngram_max_depth, d);
  while (!active.empty()) {
    // Plan: every sequence's shape for this step, from one decision over the whole batch.
    plan_inputs.clear();
    for (size_t i : active) {
      PolicySequence p = states[i].PolicyInput(/*model_draft=*/true);
      if (!in_drafter[i]) {
        p.fixed = true;  // speculation off: none
      } else if (!requests[i].auto_shape) {
        p.fixed = true;
        p.fixed_shape = SpecShape{requests[i].draft.depth, requests[i].draft.top_k,
                                  requests[i].draft.max_nodes};
      } else if (ngram_ != nullptr) {
        const int depth = std::min(ngram_max_depth, states[i].MaxUsefulDraftDepth());
        ngram_trees[i] =
            depth > 0 ? ngram_->Propose(states[i].tokens(), {depth, 1, depth}) : TokenTree();
        p.ngram_depth = TreeMaxDepth(ngram_trees[i]);
      }
      plan_inputs.push_back(p);
    }
    policy_.set_padded_rows(target_->pads_rows());
    const PolicyDecision plan = policy_.Decide(plan_inputs);
    draft_requests.clear();
    drafted.clear();
    int levels = 0, nodes = 0;
    for (size_t a = 0; a < active.size(); ++a) {
      const size_t i = active[a];
      ngram_now[i] = plan.ngram[a];
      states[i].Plan(plan.shapes[a], plan.reasons[a], ngram_now[i]);
      if (ngram_now[i]) {
        // A chain: its first `depth` nodes are the proposal cut to the planned depth.
        TokenTree& tree = ngram_trees[i];
        const int depth = std::min(plan.shapes[a].depth, tree.size());
        tree.tokens.resize(depth);
        tree.parents.resize(depth);
        if (!tree.draft_logprobs.empty()) tree.draft_logprobs.resize(depth);
      }
      // The drafter keeps its last tree until its next step for the sequence, which reports that
      // tree's outcome; steps between (plain, or n-gram) leave it to report.
      if (plan.shapes[a].none() || ngram_now[i]) continue;
      const int32_t outcome = draft_outcome[i];
      draft_outcome[i] = DraftRequest::kNoOutcome;
      DraftRequest d;
      d.seq = ids[i];
      d.accepted_node = outcome;
      const absl::Span<const int32_t> fresh = states[i].DrafterPending();
      d.new_tokens.assign(fresh.begin(), fresh.end());
      d.params = DraftParams{plan.shapes[a].depth, plan.shapes[a].top_k, plan.shapes[a].max_nodes};
      d.taps = std::move(taps[i]);
      d.taps_first_position = taps_first[i];
      taps[i].clear();
      levels = std::max(levels, d.params.depth);
      nodes += d.params.max_nodes;
      draft_requests.push_back(std::move(d));
      drafted.push_back(i);
    }
    std::vector<TokenTree> trees;
    if (!draft_requests.empty()) {
      const absl::Time start = absl::Now();
      absl::StatusOr<std::vector<TokenTree>> t = drafter_->Draft(draft_requests);
      if (!t.ok()) {
        release_all();
        return t.status();
      }
      int fed = 0;
      for (const DraftRequest& d : draft_requests) fed += static_cast<int>(d.new_tokens.size());
      policy_.costs().ObserveDraft(static_cast<int>(draft_requests.size()), levels, nodes, fed,
                                   absl::ToDoubleSeconds(absl::Now() - start));
      trees = *std::move(t);
      for (size_t k = 0; k < drafted.size(); ++k) {
        states[drafted[k]].MarkDrafterFed();
        tree_of[drafted[k]] = static_cast<int>(k);
      }
    }

    verify_items.assign(active.size(), VerifyItem());
    committed_before.assign(active.size(), 0);
    verified_draft.assign(active.size(), 0);
    for (size_t a = 0; a < active.size(); ++a) {
      const size_t i = active[a];
      VerifyItem& v = verify_items[a];
      v.seq = ids[i];
      if (in_drafter[i] && !tap_layers.empty()) {
        v.tap_layers = tap_layers;
        committed_before[a] = target_->CommittedLength(ids[i]).value_or(0);
      }
      const absl::Span<const int32_t> pending = states[i].TargetPending();
      v.pending.assign(pending.begin(), pending.end());
      v.sampling = sampling[i];
      if (tree_of[i] >= 0) {
        v.tree = std::move(trees[tree_of[i]]);
        verified_draft[a] = 1;
      } else if (ngram_now[i]) {
        v.tree = std::move(ngram_trees[i]);
      }
      tree_of[i] = -1;
      ngram_now[i] = 0;
      v.logprobs = requests[i].logprobs;
      v.logprobs_mode = requests[i].logprobs_mode;
      if (sampling[i].needs_history()) {
        // The history covers every token so far, the pending ones included.
        const absl::Span<const int32_t> prompt = states[i].prompt();
        const absl::Span<const int32_t> output = states[i].output();
        const int64_t np = static_cast<int64_t>(prompt.size());
        if (history_fed[i] < np) histories[i].AddPrompt(prompt.subspan(history_fed[i]));
        histories[i].AddOutput(output.subspan(std::max<int64_t>(0, history_fed[i] - np)));
        history_fed[i] = np + static_cast<int64_t>(output.size());
        v.history = &histories[i];
      }
    }
    int verify_tokens = 0, longest = 0;
    for (const VerifyItem& v : verify_items) {
      verify_tokens += static_cast<int>(v.pending.size() + v.tree.size());
      longest = std::max(longest, static_cast<int>(v.pending.size() + v.tree.size()));
    }
    const absl::Time verify_start = absl::Now();
    absl::StatusOr<std::vector<VerifyOutcome>> outcomes = target_->Verify(verify_items);
    if (!outcomes.ok()) {
      release_all();
      return outcomes.status();
    }
    const int rows = static_cast<int>(verify_items.size());
    policy_.costs().ObserveVerify(
        rows, VerifyStepTokens(policy_.options().padded_rows, rows, verify_tokens, longest),
        absl::ToDoubleSeconds(absl::Now() - verify_start));
    std::vector<size_t> still_active;
    for (size_t a = 0; a < active.size(); ++a) {
      const size_t i = active[a];
      const VerifyOutcome& outcome = (*outcomes)[a];
      const absl::Span<const int32_t> emitted = states[i].Apply(outcome, verify_items[a].tree);
      if (verified_draft[a]) {
        draft_outcome[i] = outcome.accepted_nodes.empty() ? -1 : outcome.accepted_nodes.back();
      }
      if (!outcome.taps.empty()) {
        if (taps[i].empty()) taps_first[i] = committed_before[a];
        taps[i].insert(taps[i].end(), outcome.taps.begin(), outcome.taps.end());
      }
      if (!outcome.logprobs.empty()) {
        // Emitted tokens are a prefix of the outcome's (a stop cuts the rest).
        const size_t n = std::min(emitted.size(), outcome.logprobs.size());
        logprobs[i].insert(logprobs[i].end(), outcome.logprobs.begin(),
                           outcome.logprobs.begin() + n);
      }
      if (on_tokens && !emitted.empty()) on_tokens(i, emitted);
      if (states[i].finished()) {
        release(i);
      } else {
        still_active.push_back(i);
      }
    }
    active.swap(still_active);
  }

  std::vector<GenerationResult> results(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    results[i].tokens.assign(states[i].output().begin(), states[i].output().end());
    results[i].finish_reason = states[i].finish_reason();
    results[i].stats = states[i].stats();
    results[i].logprobs = std::move(logprobs[i]);
  }
  return results;
}

}  // namespace specd
