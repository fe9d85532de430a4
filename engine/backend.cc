#include "engine/backend.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace specd {

VerifyOutcome WalkTree(const TokenTree& tree, int64_t first_position,
                       absl::FunctionRef<int32_t(int row, int64_t position)> sample) {
  const std::vector<std::vector<int32_t>> children = TreeChildren(tree);
  VerifyOutcome out;
  int node = -1;  // -1: the last pending token, whose logits are row 0
  for (int64_t pos = first_position;; ++pos) {
    const int32_t y = sample(node + 1, pos);
    out.tokens.push_back(y);
    int next = -1;
    for (int32_t c : children[node < 0 ? tree.size() : node]) {
      if (tree.tokens[c] == y) {
        next = c;
        break;
      }
    }
    if (next < 0) break;
    out.accepted_nodes.push_back(next);
    node = next;
  }
  out.accepted_draft = static_cast<int>(out.accepted_nodes.size());
  return out;
}

absl::Status CheckForwardTopK(int k, const TopKRows* out) {
  if (out == nullptr) return absl::InvalidArgumentError("out is null");
  if (k < 1 || k > kMaxForwardTopK) {
    return absl::InvalidArgumentError(
        absl::StrCat("k: ", k, " must be in [1, ", kMaxForwardTopK, "]"));
  }
  return absl::OkStatus();
}

absl::Status Backend::ForwardTopK(absl::Span<const ForwardItem> items, int k, TopKRows* out) {
  if (absl::Status s = CheckForwardTopK(k, out); !s.ok()) return s;
  std::vector<float> logits;
  if (absl::Status s = Forward(items, &logits); !s.ok()) return s;
  const int64_t vocab = config().vocab_size;
  TopKRowsOnHost(logits, vocab, k, out);
  return absl::OkStatus();
}

void TopKRowsOnHost(absl::Span<const float> logits, int64_t vocab, int k, TopKRows* out) {
  const int64_t rows = vocab > 0 ? static_cast<int64_t>(logits.size()) / vocab : 0;
  out->k = static_cast<int>(std::min<int64_t>(k, vocab));
  out->ids.resize(static_cast<size_t>(rows * out->k));
  out->logprobs.resize(out->ids.size());
  for (int64_t r = 0; r < rows; ++r) {
    RowTopKLogprobs(logits.subspan(static_cast<size_t>(r * vocab), static_cast<size_t>(vocab)),
                    out->k, &out->ids[r * out->k], &out->logprobs[r * out->k]);
  }
}

VerifyOutcome AcceptTreeOnHost(const VerifyItem& item, absl::Span<const float> rows,
                               int vocab_size, int64_t first_position) {
  const SamplingParams& sampling = item.sampling;
  const bool process = sampling.has_processors();
  std::vector<float> processed;
  std::vector<int32_t> path;
  std::vector<TokenLogprobs> logprobs;
  VerifyOutcome out = WalkTree(item.tree, first_position, [&](int row, int64_t position) {
    const absl::Span<const float> raw =
        rows.subspan(static_cast<size_t>(row) * vocab_size, vocab_size);
    absl::Span<const float> logits = raw;
    if (process) {
      // Row 0 continues the history; row i + 1 continues node i, after its ancestors.
      path.clear();
      for (int node = row - 1; node >= 0; node = item.tree.parents[node]) {
        path.push_back(item.tree.tokens[node]);
      }
      ProcessLogits(raw, sampling, item.history, path, &processed);
      logits = processed;
    }
    const int32_t token = SampleToken(logits, sampling, position);
    if (item.logprobs >= 0) {
      logprobs.push_back(
          ComputeLogprobs(raw, logits, sampling, item.logprobs_mode, token, item.logprobs));
    }
    return token;
  });
  out.logprobs = std::move(logprobs);
  return out;
}

VerifyOutcome AcceptTree(const TokenTree& tree, absl::Span<const float> rows, int vocab_size,
                         const SamplingParams& sampling, int64_t first_position) {
  return WalkTree(tree, first_position, [&](int row, int64_t position) {
    return SampleToken(rows.subspan(static_cast<size_t>(row) * vocab_size, vocab_size), sampling,
                       position);
  });
}

absl::Status CheckVerifySupport(const VerifyFeatures& features, const SamplingParams& sampling,
                                int logprobs, const std::string& backend) {
  auto refuse = [&](const char* field) {
    return absl::UnimplementedError(
        absl::StrCat(field, ": not supported by ", backend, " yet (the CPU backend has it)"));
  };
  if (!features.logits_processors) {
    if (sampling.min_p > 0.0f) return refuse("sampling.min_p");
    if (!sampling.logit_bias.empty()) return refuse("sampling.logit_bias");
    if (sampling.min_tokens > 0) return refuse("sampling.min_tokens");
    if (sampling.repetition_penalty != 1.0f) return refuse("sampling.repetition_penalty");
    if (sampling.presence_penalty != 0.0f) return refuse("sampling.presence_penalty");
    if (sampling.frequency_penalty != 0.0f) return refuse("sampling.frequency_penalty");
  }
  if (!features.logprobs && logprobs >= 0) return refuse("logprobs");
  return absl::OkStatus();
}

absl::StatusOr<int64_t> MakeVerifyForward(const Backend& backend, const VerifyItem& item,
                                          size_t index, ForwardItem* f) {
  if (item.pending.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("verify item ", index, ": no pending token"));
  }
  const int vocab = backend.config().vocab_size;
  if (absl::Status s = ValidateTree(item.tree, vocab); !s.ok()) return s;
  // Processors index the row by these ids, so they are checked here, whoever the caller is.
  if (absl::Status s = ValidateSamplingParams(item.sampling, vocab); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("verify item ", index, ": sampling.", s.message()));
  }
  if (item.sampling.needs_history() && item.history == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "verify item ", index, ": its sampling (penalties or min_tokens) needs the history"));
  }
  if (item.logprobs < -1 || item.logprobs > kMaxLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("verify item ", index, ": logprobs ",
                                                   item.logprobs, " must be in [-1, ",
                                                   kMaxLogprobs, "]"));
  }
  if (item.tap_layers.size() > static_cast<size_t>(kMaxTapLayers)) {
    return absl::InvalidArgumentError(absl::StrCat("verify item ", index,
                                                   ": tap_layers: ", item.tap_layers.size(),
                                                   " layers, at most ", kMaxTapLayers));
  }
  for (size_t i = 0; i < item.tap_layers.size(); ++i) {
    const int layer = item.tap_layers[i];
    const int max_tap = MaxTapLayer(backend.verify_features(), backend.config().num_layers);
    if (layer < 0 || layer > max_tap) {
      return absl::InvalidArgumentError(absl::StrCat("verify item ", index, ": tap_layers[", i,
                                                     "]: ", layer, " is not in [0, ", max_tap,
                                                     "]"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (item.tap_layers[j] == layer) {
        return absl::InvalidArgumentError(absl::StrCat("verify item ", index, ": tap_layers[", i,
                                                       "]: ", layer, " is listed twice"));
      }
    }
  }
  absl::StatusOr<int64_t> len = backend.CommittedLength(item.seq);
  if (!len.ok()) return len.status();
  const int p = static_cast<int>(item.pending.size());
  f->seq = item.seq;
  f->tokens = item.pending;
  f->tokens.insert(f->tokens.end(), item.tree.tokens.begin(), item.tree.tokens.end());
  f->parents.clear();
  for (int i = 0; i < p; ++i) f->parents.push_back(i - 1);
  for (int32_t parent : item.tree.parents) f->parents.push_back(parent < 0 ? p - 1 : parent + p);
  f->logit_rows.clear();
  for (int i = p - 1; i < static_cast<int>(f->tokens.size()); ++i) f->logit_rows.push_back(i);
  return *len + p;
}

absl::Status Backend::ForwardWithTaps(absl::Span<const ForwardItem> /*items*/,
                                      absl::Span<const int> /*tap_layers*/,
                                      std::vector<float>* /*logits*/,
                                      std::vector<float>* /*taps*/) {
  return absl::UnimplementedError(
      "this backend does not export hidden states (tap_layers); EAGLE drafting needs a "
      "backend that does");
}

std::vector<int32_t> AcceptedScratchPath(int num_pending, const VerifyOutcome& outcome) {
  std::vector<int32_t> path;
  for (int i = 0; i < num_pending; ++i) path.push_back(i);
  for (int32_t n : outcome.accepted_nodes) path.push_back(n + num_pending);
  return path;
}

absl::StatusOr<std::vector<VerifyOutcome>> Backend::Verify(absl::Span<const VerifyItem> items) {
  const int vocab = config().vocab_size;
  std::vector<ForwardItem> forward(items.size());
  std::vector<int64_t> first_position(items.size());
  for (size_t b = 0; b < items.size(); ++b) {
    absl::StatusOr<int64_t> first = MakeVerifyForward(*this, items[b], b, &forward[b]);
    if (!first.ok()) return first.status();
    first_position[b] = *first;
  }
  // Taps: one capture of the union of the layers any item asks for, sliced per item below.
  std::vector<int> tap_union;
  for (const VerifyItem& item : items) {
    tap_union.insert(tap_union.end(), item.tap_layers.begin(), item.tap_layers.end());
  }
  std::sort(tap_union.begin(), tap_union.end());
  tap_union.erase(std::unique(tap_union.begin(), tap_union.end()), tap_union.end());
  std::vector<float> logits, taps;
  if (tap_union.empty()) {
    if (absl::Status s = Forward(forward, &logits); !s.ok()) return s;
  } else if (absl::Status s = ForwardWithTaps(forward, tap_union, &logits, &taps); !s.ok()) {
    return s;
  }
  const int64_t hidden = config().hidden_size;
  const int64_t union_width = static_cast<int64_t>(tap_union.size()) * hidden;
  std::vector<VerifyOutcome> outcomes(items.size());
  size_t row = 0;
  int64_t token_base = 0;  // the item's first token in the step
  for (size_t b = 0; b < items.size(); ++b) {
    const size_t nrows = forward[b].logit_rows.size();
    outcomes[b] = AcceptTreeOnHost(
        items[b], absl::Span<const float>(logits).subspan(row * vocab, nrows * vocab), vocab,
        first_position[b]);
    row += nrows;
    const std::vector<int32_t> path =
        AcceptedScratchPath(static_cast<int>(items[b].pending.size()), outcomes[b]);
    const std::vector<int>& want = items[b].tap_layers;
    if (!want.empty()) {
      std::vector<float>& out = outcomes[b].taps;
      out.resize(path.size() * want.size() * hidden);
      float* dst = out.data();
      for (int32_t token : path) {
        const float* src = &taps[(token_base + token) * union_width];
        for (int layer : want) {
          const int64_t u =
              std::lower_bound(tap_union.begin(), tap_union.end(), layer) - tap_union.begin();
          std::copy_n(src + u * hidden, hidden, dst);
          dst += hidden;
        }
      }
    }
    token_base += static_cast<int64_t>(forward[b].tokens.size());
    if (absl::Status s = Commit(items[b].seq, path); !s.ok()) return s;
  }
  return outcomes;
}

}  // namespace specd
