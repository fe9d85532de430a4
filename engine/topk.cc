#include "engine/topk.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace specd {

namespace {

inline float OrderKey(float v) {
  return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v;
}

}  // namespace

void RowTopKLogprobs(absl::Span<const float> row, int k, int32_t* ids, float* logprobs) {
  const int vocab = static_cast<int>(row.size());
  k = std::max(0, std::min(k, vocab));
  if (k == 0) return;
  // `ids`/`logprobs` double as the sorted candidate list (logprobs holding order keys until the
  // end). Ids are visited in increasing order, so a later id never displaces an equal key.
  int filled = 0;
  float max_l = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < vocab; ++i) {
    const float v = OrderKey(row[i]);
    max_l = std::max(max_l, v);
    if (filled == k && !(v > logprobs[k - 1])) continue;
    int j = filled < k ? filled++ : k - 1;
    while (j > 0 && v > logprobs[j - 1]) {
      logprobs[j] = logprobs[j - 1];
      ids[j] = ids[j - 1];
      --j;
    }
    logprobs[j] = v;
    ids[j] = i;
  }
  double sum = 0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(OrderKey(row[i])) - max_l);
  const double log_z = max_l + std::log(sum);
  for (int j = 0; j < k; ++j) logprobs[j] = static_cast<float>(logprobs[j] - log_z);
}

}  // namespace specd
