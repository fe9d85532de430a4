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

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
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

}  // namespace specd

#endif  // SPECD_ENGINE_WARMUP_H_
