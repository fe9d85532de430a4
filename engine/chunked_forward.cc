#include "engine/chunked_forward.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace specd {
namespace {

int64_t TotalTokens(absl::Span<const ForwardItem> items) {
  int64_t total = 0;
  for (const ForwardItem& it : items) total += static_cast<int64_t>(it.tokens.size());
  return total;
}

int64_t TotalLogitRows(absl::Span<const ForwardItem> items) {
  int64_t total = 0;
  for (const ForwardItem& it : items) total += static_cast<int64_t>(it.logit_rows.size());
  return total;
}

}  // namespace

std::vector<ForwardChunk> SplitForward(absl::Span<const ForwardItem> items, int64_t max_rows) {
  std::vector<ForwardChunk> chunks;
  if (items.empty()) return chunks;
  if (max_rows < 1 || TotalTokens(items) <= max_rows) {
    ForwardChunk& all = chunks.emplace_back();
    all.items.assign(items.begin(), items.end());
    for (int64_t r = 0, n = TotalLogitRows(items); r < n; ++r) all.out_rows.push_back(r);
    return chunks;
  }
  int64_t used = max_rows;  // full: the first piece opens a forward
  int64_t row_base = 0;     // the first output row of the current item
  for (const ForwardItem& item : items) {
    const int64_t n = static_cast<int64_t>(item.tokens.size());
    for (int64_t begin = 0; begin < n;) {
      if (used == max_rows) {
        chunks.emplace_back();
        used = 0;
      }
      const int64_t end = std::min(n, begin + (max_rows - used));
      ForwardChunk& chunk = chunks.back();
      ForwardItem& piece = chunk.items.emplace_back();
      piece.seq = item.seq;
      piece.tokens.assign(item.tokens.begin() + begin, item.tokens.begin() + end);
      piece.parents.assign(item.parents.begin() + begin, item.parents.begin() + end);
      for (size_t j = 0; j < item.logit_rows.size(); ++j) {
        const int32_t row = item.logit_rows[j];
        if (row < begin || row >= end) continue;
        piece.logit_rows.push_back(static_cast<int32_t>(row - begin));
        chunk.out_rows.push_back(row_base + static_cast<int64_t>(j));
      }
      if (piece.logit_rows.empty()) {
        piece.logit_rows.push_back(static_cast<int32_t>(end - begin - 1));
        chunk.out_rows.push_back(-1);
      }
      used += end - begin;
      begin = end;
    }
    row_base += static_cast<int64_t>(item.logit_rows.size());
  }
  return chunks;
}

absl::Status ChunkedForwardTopK(Backend& backend, absl::Span<const ForwardItem> items, int k,
                                int64_t max_rows, TopKRows* out) {
  if (max_rows < 1 || TotalTokens(items) <= max_rows) {
    return backend.ForwardTopK(items, k, out);
  }
  if (absl::Status s = CheckForwardTopK(k, out); !s.ok()) return s;
  const int64_t rows = TotalLogitRows(items);
  const int kk = std::min<int>(k, backend.config().vocab_size);
  out->k = kk;
  out->ids.assign(static_cast<size_t>(rows * kk), 0);
  out->logprobs.assign(static_cast<size_t>(rows * kk), 0.0f);
  TopKRows part;
  for (const ForwardChunk& chunk : SplitForward(items, max_rows)) {
    if (absl::Status s = backend.ForwardTopK(chunk.items, k, &part); !s.ok()) return s;
    if (part.k != kk || part.rows() != static_cast<int64_t>(chunk.out_rows.size())) {
      return absl::InternalError(absl::StrCat("backend returned ", part.rows(), " top-", part.k,
                                              " rows for ", chunk.out_rows.size(), " asked"));
    }
    for (size_t r = 0; r < chunk.out_rows.size(); ++r) {
      if (chunk.out_rows[r] < 0) continue;
      std::copy_n(part.ids.begin() + r * kk, kk, out->ids.begin() + chunk.out_rows[r] * kk);
      std::copy_n(part.logprobs.begin() + r * kk, kk,
                  out->logprobs.begin() + chunk.out_rows[r] * kk);
    }
  }
  return absl::OkStatus();
}

absl::Status ChunkedForward(Backend& backend, absl::Span<const ForwardItem> items, int64_t max_rows,
                            std::vector<float>* logits) {
  if (max_rows < 1 || TotalTokens(items) <= max_rows) return backend.Forward(items, logits);
  const int64_t vocab = backend.config().vocab_size;
  logits->assign(static_cast<size_t>(TotalLogitRows(items) * vocab), 0.0f);
  std::vector<float> part;
  for (const ForwardChunk& chunk : SplitForward(items, max_rows)) {
    if (absl::Status s = backend.Forward(chunk.items, &part); !s.ok()) return s;
    if (static_cast<int64_t>(part.size()) != static_cast<int64_t>(chunk.out_rows.size()) * vocab) {
      return absl::InternalError(absl::StrCat("backend returned ", part.size(), " logits for ",
                                              chunk.out_rows.size(), " rows"));
    }
    for (size_t r = 0; r < chunk.out_rows.size(); ++r) {
      if (chunk.out_rows[r] < 0) continue;
      std::copy_n(part.begin() + r * vocab, vocab, logits->begin() + chunk.out_rows[r] * vocab);
    }
  }
  return absl::OkStatus();
}

}  // namespace specd
