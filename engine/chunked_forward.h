// A batched forward fed as consecutive forwards of bounded size.
//
// A forward's row count (its tokens over all items) picks the GEMM row class the CUDA backend
// runs it in, and the largest class the warm-up decides is BackendOptions::
// cuda_gemm_invariant_rows (engine/warmup.h). A forward above it pays a cuBLASLt decision on
// each new row count, runs GEMMs that are not row-invariant, and grows the backend's step
// buffers. A catch-up of a few new prompts fed as one chain batch is such a forward; split at
// `max_rows` it is not. Splitting is exact: scratch indices count every node appended since the
// last Commit() in order, so an item cut into consecutive pieces keeps its parents, and each
// token attends to the same keys whichever forward it is in.
#ifndef SPECD_ENGINE_CHUNKED_FORWARD_H_
#define SPECD_ENGINE_CHUNKED_FORWARD_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/backend.h"
#include "engine/topk.h"

namespace specd {

// One forward of a split batch.
struct ForwardChunk {
  std::vector<ForwardItem> items;
  // Per logit row of this forward (items in order, rows in each item's order): the row of the
  // whole batch's output it is, or -1 for a row asked only so that every item asks for one.
  std::vector<int64_t> out_rows;
};

// Cuts `items` into forwards of at most `max_rows` tokens each, in order: items are packed
// whole while they fit, and one that does not fit is cut into consecutive pieces (a sequence
// appears at most once per forward). Every piece asks for at least one logit row (its last
// token's, discarded, when it holds none of the item's). `max_rows` < 1: one forward.
std::vector<ForwardChunk> SplitForward(absl::Span<const ForwardItem> items, int64_t max_rows);

// Backend::ForwardTopK() of `items` run as SplitForward()'s forwards; `out` as one call would
// fill it. A failed forward returns its error: the sequences keep the scratch nodes of the
// forwards before it, which the caller drops as it would a failed single forward's.
absl::Status ChunkedForwardTopK(Backend& backend, absl::Span<const ForwardItem> items, int k,
                                int64_t max_rows, TopKRows* out);

// Backend::Forward() likewise: `logits` receives [logit rows, vocab] fp32 (host) as one call's.
absl::Status ChunkedForward(Backend& backend, absl::Span<const ForwardItem> items, int64_t max_rows,
                            std::vector<float>* logits);

}  // namespace specd

#endif  // SPECD_ENGINE_CHUNKED_FORWARD_H_
