#include "engine/warmup.h"

#include <algorithm>
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

}  // namespace specd
