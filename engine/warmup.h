// Warm-up forwards before a model service reports SERVING.
//
// The CUDA backend decides a GEMM algorithm per shape family and row class lazily, on the first
// GEMM whose row count falls in a class not yet decided (kernels/include/specd/kernels/cuda/
// gemm.h, "Row invariance"): a self-check and timing of a few milliseconds, up to ~0.2 s for the
// LM head's largest classes. Left to serving, those decisions land on the first requests that
// reach each class -- a first prompt's prefill, the draft's first catch-up of a prompt -- and on
// the speculation policy's first measurements of those steps, which then price a draft call or
// a verify bucket at many times its real cost. WarmUpBackend runs one forward of each class's
// row count on a throw-away sequence, so every class is decided before the first request, as
// vLLM and SGLang profile and capture before they serve.
#ifndef SPECD_ENGINE_WARMUP_H_
#define SPECD_ENGINE_WARMUP_H_

#include <chrono>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "engine/backend.h"

namespace specd {

// The row counts that reach every GEMM row class up to `invariant_rows` under either class
// scheme of the CUDA backend (classes ending at 2^j + 1, or at 2^j): 1, 2, 17, 33, ..., 2^j + 1
// below it, and `invariant_rows` itself. Empty when `invariant_rows` < 1.
std::vector<int64_t> GemmClassWarmUpRows(int64_t invariant_rows);

struct WarmUpReport {
  std::vector<int64_t> rows;  // the row counts run, in order
  double seconds = 0;
};

// Runs, for each row count m in `rows` (ascending or not), one Forward of a fresh sequence
// holding a chain of m tokens with logits asked for every row, so the model's GEMMs -- the LM
// head included -- run at m rows; then removes the sequence. Row counts above the model's
// positions or the free KV capacity are left out (and not reported). The backend must hold no
// sequence with the id used, the largest SeqId, which a fresh backend does not.
// Leaves the backend's sequences and KV usage as they were.
absl::StatusOr<WarmUpReport> WarmUpBackend(Backend& backend, const std::vector<int64_t>& rows);

// The draft levels of a draft service's model (engine/draft/draft_model_drafter.h), before it
// serves: a CUDA backend captures a level's graph per (batch bucket, tokens a sequence, k) on
// the bucket's second use, and grows its step buffers (dropping every graph captured so far)
// the first time a larger level comes; left to serving, both land on the first draft steps.
struct DraftLevelWarmUp {
  std::vector<int64_t> batches;  // sequences a level, e.g. DraftLevelWarmUpBatches()
  int depth = 4;                 // levels a tree: a chain token, then depth - 1 of children
  int top_k = 4;                 // children a node, <= kMaxForwardTopK
  // The top-k each level asks for, as the drafter asks it (DraftModelDrafter::TopKAsked: one
  // more than the children, for the runner-up); 0: top_k.
  int asked_k = 0;
  int passes = 2;  // each tree this many times (a graph is captured on pass 2)
};

// 1, 2, 4, ... below `max_batch`, then `max_batch` (the CUDA backend's graph batch buckets are
// powers of two). Empty when `max_batch` < 1.
std::vector<int64_t> DraftLevelWarmUpBatches(int64_t max_batch);

// For each batch b of `shape.batches` (skipped when its trees do not fit the free KV, which
// the backend reports as RESOURCE_EXHAUSTED, or the model's positions): adds b throw-away sequences
// (kWarmUpSeq, kWarmUpSeq - 1, ...), then `passes` times grows one tree a sequence as the drafter
// does, one ForwardTopK a level (level 0: one token, no context; each later level top_k children of
// the level before's first node, every row's top-k asked for) and drops its scratch (Commit of an
// empty path); then removes them. report.rows: the batches run. Leaves the backend's sequences and
// KV usage as they were.
absl::StatusOr<WarmUpReport> WarmUpDraftLevels(Backend& backend, const DraftLevelWarmUp& shape);

// What WarmUpBackend and WarmUpEagleHead (engine/draft/eagle_head.h) share.
// The throw-away sequence a warm-up forward runs on.
inline constexpr SeqId kWarmUpSeq = std::numeric_limits<SeqId>::max();
// A warm-up chain of m tokens: ids spread over the vocabulary (only the shapes matter).
std::vector<int32_t> WarmUpTokens(int64_t m, int vocab_size);
// For each m of `rows` within [1, limit]: adds kWarmUpSeq to `model` (a Backend or an
// EagleHead), runs `forward(m)` (one forward of m rows on it) and removes it again; the row
// counts run and the time they took.
template <typename Model, typename Forward>
absl::StatusOr<WarmUpReport> WarmUpRows(Model& model, const std::vector<int64_t>& rows,
                                        int64_t limit, Forward forward) {
  const auto start = std::chrono::steady_clock::now();
  WarmUpReport report;
  for (int64_t m : rows) {
    if (m < 1 || m > limit) continue;
    if (absl::Status s = model.AddSequence(kWarmUpSeq); !s.ok()) {
      return absl::InternalError(absl::StrCat("warm-up at ", m, " rows: ", s.message()));
    }
    absl::Status s = forward(m);
    absl::Status removed = model.RemoveSequence(kWarmUpSeq);
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

#endif  // SPECD_ENGINE_WARMUP_H_
