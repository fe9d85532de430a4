#include "engine/warmup.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"

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

absl::StatusOr<WarmUpReport> WarmUpBackend(Backend& backend, const std::vector<int64_t>& rows) {
  const auto start = std::chrono::steady_clock::now();
  const ModelConfig& config = backend.config();
  const KvUsage usage = backend.Usage();
  const int64_t limit =
      std::min<int64_t>(config.max_position_embeddings, usage.capacity_tokens - usage.used_tokens);
  const SeqId seq = std::numeric_limits<SeqId>::max();
  WarmUpReport report;
  std::vector<float> logits;
  for (int64_t m : rows) {
    if (m < 1 || m > limit) continue;
    ForwardItem item;
    item.seq = seq;
    // Token ids spread over the vocabulary: the values do not matter, only the shapes.
    item.tokens.resize(m);
    for (int64_t i = 0; i < m; ++i) {
      item.tokens[i] = static_cast<int32_t>((i * 7919 + 13) % config.vocab_size);
    }
    item.parents.resize(m);
    std::iota(item.parents.begin(), item.parents.end(), -1);
    item.logit_rows.resize(m);
    std::iota(item.logit_rows.begin(), item.logit_rows.end(), 0);
    if (absl::Status s = backend.AddSequence(seq); !s.ok()) {
      return absl::InternalError(absl::StrCat("warm-up at ", m, " rows: ", s.message()));
    }
    absl::Status s = backend.Forward({item}, &logits);
    absl::Status removed = backend.RemoveSequence(seq);
    if (!s.ok()) {
      return absl::InternalError(absl::StrCat("warm-up forward at ", m, " rows: ", s.message()));
    }
    if (!removed.ok()) {
      return absl::InternalError(absl::StrCat("warm-up at ", m, " rows: ", removed.message()));
    }
    report.rows.push_back(m);
  }
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace specd
