#include "engine/warmup.h"

#include <algorithm>
#include <chrono>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "engine/topk.h"

namespace specd {

std::vector<int64_t> GemmClassWarmUpRows(int64_t invariant_rows) {
  std::vector<int64_t> rows;
  if (invariant_rows < 1) return rows;
  rows.push_back(1);
  if (invariant_rows >= 2) rows.push_back(2);
  for (int64_t p = 16; p + 1 < invariant_rows; p *= 2) rows.push_back(p + 1);
  if (invariant_rows > rows.back()) rows.push_back(invariant_rows);
  return rows;
}

std::vector<int32_t> WarmUpTokens(int64_t m, int vocab_size) {
  std::vector<int32_t> tokens(m);
  for (int64_t i = 0; i < m; ++i) tokens[i] = static_cast<int32_t>((i * 7919 + 13) % vocab_size);
  return tokens;
}

absl::StatusOr<WarmUpReport> WarmUpBackend(Backend& backend, const std::vector<int64_t>& rows) {
  const ModelConfig& config = backend.config();
  const KvUsage usage = backend.Usage();
  const int64_t limit =
      std::min<int64_t>(config.max_position_embeddings, usage.capacity_tokens - usage.used_tokens);
  std::vector<float> logits;
  return WarmUpRows(backend, rows, limit, [&](int64_t m) {
    ForwardItem item;
    item.seq = kWarmUpSeq;
    item.tokens = WarmUpTokens(m, config.vocab_size);
    item.parents.resize(m);
    std::iota(item.parents.begin(), item.parents.end(), -1);
    item.logit_rows.resize(m);
    std::iota(item.logit_rows.begin(), item.logit_rows.end(), 0);
    return backend.Forward({item}, &logits);
  });
}

std::vector<int64_t> DraftLevelWarmUpBatches(int64_t max_batch) {
  std::vector<int64_t> batches;
  for (int64_t b = 1; b < max_batch; b *= 2) batches.push_back(b);
  if (max_batch >= 1) batches.push_back(max_batch);
  return batches;
}

absl::StatusOr<WarmUpReport> WarmUpDraftLevels(Backend& backend, const DraftLevelWarmUp& shape) {
  const int asked = shape.asked_k > 0 ? shape.asked_k : shape.top_k;
  if (shape.top_k < 1 || shape.top_k > kMaxForwardTopK || asked > kMaxForwardTopK ||
      shape.depth < 1) {
    return absl::InvalidArgumentError(absl::StrCat("draft level warm-up: top_k ", shape.top_k,
                                                   ", asked_k ", asked, ", depth ", shape.depth));
  }
  const auto start = std::chrono::steady_clock::now();
  const ModelConfig& config = backend.config();
  const int64_t tree = 1 + int64_t{shape.depth - 1} * shape.top_k;  // tokens a sequence
  WarmUpReport report;
  for (int64_t b : shape.batches) {
    const KvUsage usage = backend.Usage();
    if (b < 1 || tree > config.max_position_embeddings ||
        b * tree > usage.capacity_tokens - usage.used_tokens) {
      continue;
    }
    std::vector<SeqId> seqs;
    absl::Status s;
    for (int64_t i = 0; i < b && s.ok(); ++i) {
      s = backend.AddSequence(kWarmUpSeq - i);
      if (s.ok()) seqs.push_back(kWarmUpSeq - i);
    }
    const std::vector<int32_t> tokens = WarmUpTokens(tree, config.vocab_size);
    TopKRows top;
    for (int pass = 0; pass < shape.passes && s.ok(); ++pass) {
      // Level 0 (scratch index 0), then each level's top_k children of the first node of the
      // level before (its scratch index `anchor`).
      int32_t anchor = -1, next = 0;
      for (int level = 0; level < shape.depth && s.ok(); ++level) {
        const int n = level == 0 ? 1 : shape.top_k;
        std::vector<ForwardItem> items(seqs.size());
        for (size_t i = 0; i < seqs.size(); ++i) {
          items[i].seq = seqs[i];
          for (int j = 0; j < n; ++j) {
            items[i].tokens.push_back(tokens[next + j]);
            items[i].parents.push_back(anchor);
            items[i].logit_rows.push_back(j);
          }
        }
        s = backend.ForwardTopK(items, asked, &top);
        anchor = next;
        next += n;
      }
      for (SeqId seq : seqs) {
        if (s.ok()) s = backend.Commit(seq, {});
      }
    }
    for (SeqId seq : seqs) {
      if (absl::Status removed = backend.RemoveSequence(seq); s.ok()) s = removed;
    }
    // A KV cache allocated in blocks a sequence may hold fewer trees than its free tokens
    // say: such a batch is left out, as one over the free tokens is.
    if (s.code() == absl::StatusCode::kResourceExhausted) continue;
    if (!s.ok()) {
      return absl::InternalError(
          absl::StrCat("draft level warm-up at ", b, " sequences: ", s.message()));
    }
    report.rows.push_back(b);
  }
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace specd
