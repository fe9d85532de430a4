// A Backend that forwards every call to a real one and counts the forward calls and the tokens
// they feed: how tests and benchmarks see what a drafter costs its model (accepted KV kept or
// fed again, a level per call).
#ifndef SPECD_TESTS_TESTUTIL_COUNTING_BACKEND_H_
#define SPECD_TESTS_TESTUTIL_COUNTING_BACKEND_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/backend.h"

namespace specd {

class CountingBackend : public Backend {
 public:
  explicit CountingBackend(Backend* model) : model_(model) {}
  const ModelConfig& config() const override { return model_->config(); }
  absl::Status AddSequence(SeqId seq) override { return model_->AddSequence(seq); }
  absl::Status RemoveSequence(SeqId seq) override { return model_->RemoveSequence(seq); }
  bool HasSequence(SeqId seq) const override { return model_->HasSequence(seq); }
  absl::StatusOr<int64_t> CommittedLength(SeqId seq) const override {
    return model_->CommittedLength(seq);
  }
  absl::Status Forward(absl::Span<const ForwardItem> items, std::vector<float>* logits) override {
    Count(items);
    return model_->Forward(items, logits);
  }
  absl::Status ForwardTopK(absl::Span<const ForwardItem> items, int k, TopKRows* out) override {
    Count(items);
    return model_->ForwardTopK(items, k, out);
  }
  absl::Status Commit(SeqId seq, absl::Span<const int32_t> path) override {
    return model_->Commit(seq, path);
  }
  KvUsage Usage() const override { return model_->Usage(); }

  int64_t calls() const { return calls_; }        // Forward and ForwardTopK calls
  int64_t tokens() const { return tokens_; }      // tokens those calls fed
  int64_t max_rows() const { return max_rows_; }  // the most tokens one call fed

 private:
  void Count(absl::Span<const ForwardItem> items) {
    ++calls_;
    int64_t rows = 0;
    for (const ForwardItem& it : items) rows += static_cast<int64_t>(it.tokens.size());
    tokens_ += rows;
    max_rows_ = std::max(max_rows_, rows);
  }

  Backend* model_;
  int64_t calls_ = 0;
  int64_t tokens_ = 0;
  int64_t max_rows_ = 0;
};

}  // namespace specd

#endif  // SPECD_TESTS_TESTUTIL_COUNTING_BACKEND_H_
