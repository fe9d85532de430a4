// Linear layers on the GPU through cuBLASLt, bf16 inputs with fp32
// accumulation: y = x w^T
// (+ bias), w in Hugging Face [out_features, in_features] layout (the CPU
// reference is specd/kernels/linear.h). The LM head is the same call with an
// fp32 output.
#ifndef SPECD_KERNELS_CUDA_GEMM_H_
#define SPECD_KERNELS_CUDA_GEMM_H_

#include <cublasLt.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "specd/kernels/cuda/common.h"

namespace specd {
namespace cuda {

struct GemmParams {
  const bf16* x = nullptr;     // [m, k] bf16, device, row-major
  const bf16* w = nullptr;     // [n, k] bf16, device, row-major
  const bf16* bias = nullptr;  // [n] bf16, device, or null (only with a bf16 output)
  // [m, n] device, row-major: fp32 if y_fp32, else bf16. With k_splits > 1:
  // [k_splits, m, n] fp32 (y_fp32 must be set).
  void* y = nullptr;
  bool y_fp32 = false;
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  // > 1: K is cut into k_splits equal ranges and y[s] = x[:, K_s] w[:, K_s]^T
  // for range s, each partial product in fp32, left for the caller to add
  // (RmsNormParams::partials adds them inside the norm that reads them). This
  // is a split-K GEMM without cuBLASLt's separate reduction launch: one
  // strided-batched GEMM. k must be a multiple of 8 * k_splits (16-byte
  // aligned ranges, Gemm::KSplitFits); no bias. Row invariance holds per
  // range, as for any family (the split is part of the family, not of m).
  int k_splits = 1;
};

// Owns a cuBLASLt handle, a workspace and, per problem shape, the algorithm
// cuBLASLt's heuristic picked (the heuristic query costs far more than a small
// GEMM). One thread uses an instance at a time.
//
// Row invariance. cuBLASLt's heuristic picks a different algorithm (tile shape,
// split-K) for different row counts m, so the same row of x can give different
// bits in a GEMM of 1 row and one of 40: a token's logits would then depend on
// what else shares its step, and speculative greedy output could drift from
// target-only greedy output after a near-tie. With `invariant_rows` > 0, every
// GEMM of m <= invariant_rows rows gives each output row the bits that row gets
// alone (tests/gpu/gemm_invariance_test.cc checks this bit for bit):
//
// - Per shape family (n, k, output, bias, alignment of x, w, y) one base
//   algorithm, valid for every m in [1, invariant_rows] within the workspace.
//   A fixed algorithm cuts K and reduces partial sums the same way whatever m
//   is, so each output row is a function of its input row alone. A split of K
//   over CTAs (split-K) qualifies only with a deterministic reduction scheme
//   (INPLACE, sequential through counters, or COMPUTE_TYPE / OUTPUT_TYPE, a
//   separate reduction pass); its split count is part of the configuration,
//   not of m.
// - The base is chosen by measurement, on the first GEMM of the family outside
//   a graph capture, on the real weights. Candidates: up to 6 potential bases
//   (deterministic, valid over the whole row range), the first of cuBLASLt's
//   list for m = `plan_rows` (the untimed choice) and then the others taken in
//   turn from its lists for m = 1, plan_rows, 64, 256 and invariant_rows;
//   plus, as helpers, cuBLASLt's first pick for m = 1, 64 and 256. Each runs
//   once at m = 1, 64 and 256 (a fingerprint of the whole output tells which
//   give the same bits) and is then timed there, L2 evicted. Every row class
//   later runs the fastest candidate bit-identical to the base, so a base is
//   worth what its group of identical candidates is worth:
//     cost(base) = t(1) + 0.5 * t(64) + 0.25 * t(256),
//   t(m) the least time at m among the candidates (the base, other bases,
//   helpers) with the base's K split and output there. Row counts above
//   invariant_rows are capped to it (a term that coincides with an earlier one
//   is dropped). Decode weighs most: a one-row step streams all the weights
//   for one token, while a verify step shares that stream among many; 64 and
//   256 stand for the verify classes (17 to 256 rows). They are in the cost
//   because a split-K base, often the fastest decode for narrow weights, binds
//   every class to its split count. The least cost wins (a later candidate
//   must be 3% cheaper to displace an earlier one). This costs up to 4
//   launches of each of at most 9 candidates at each of the three m (a few
//   ms; some 0.1 s for the LM head). While the stream captures a CUDA graph,
//   or when the measurement cannot run (no scratch memory, a failed CUDA
//   call), the base is the untimed choice (counted by untimed_bases()). With
//   `timed_picks` false nothing is timed: every base is the untimed choice and
//   every class runs the first candidate that passes its self-check, so two
//   processes pick the same algorithms (A/B runs of other changes; timed picks
//   can differ between processes when candidates are within noise). With
//   `retile` (and timed picks), a class of up to 256 rows also tries its
//   candidates re-tiled to every tile width with its token extent and at four
//   more cluster shapes, and checks them fastest first by one quick timing at
//   its largest m (DecideClass says why). That makes a class's decision take
//   up to ~0.2 s instead of a few ms, once per process and shape.
// - One algorithm serving every m up to 1024 is slow, though: its tile covers a
//   fixed number of token rows (~64) and each further tile of tokens streams
//   the whole weight matrix again. So m is split into row classes, [1, 1],
//   [2, plan_rows], then doubling ranges up to invariant_rows (e.g. [17, 32],
//   [33, 64], ..., [513, 1024]); with `bucket_classes`, the classes end one
//   row later, at plan_rows + 1 and then 2^j + 1 ([2, 17], [18, 33], [34, 65],
//   ..., [514, 1024]): a batch-1 verify step is padded to the pending token
//   plus a tree of 2^j nodes (engine/cuda/cuda_backend.h), so each such step is
//   the largest m of its class, where the class's algorithm was timed, rather
//   than the smallest of a class whose algorithm also serves twice as many
//   rows (bits are the same either way). For a class, cuBLASLt's candidates for its
//   largest (then smallest) m go, in that order, through a self-check: on the
//   family's real weights, their output rows at the class's smallest, middle
//   and largest m must be bit-identical to the base algorithm's for the same
//   input rows (random bf16 of several magnitudes, at many positions in the
//   tiles). Without a split of K over CTAs a tensor-core kernel adds up K in
//   the same order whatever its tile width, so many candidates pass. Then
//   come the base's group (the candidates found identical when the base was
//   chosen), and last the candidates whose K split or reduction scheme
//   differs from the base's (they cannot pass as they are) with the base's
//   split count and scheme set in their configuration. The first few that
//   pass (of at most 16 checked) and the base (when it passes the same check)
//   are timed at the class's smallest and largest m, the weights evicted from
//   L2 before each launch when they could sit there, and the fastest runs the
//   class (a later one must be 3% faster to displace an earlier one). All
//   classes thus agree with the base bit for bit; the check, not the argument
//   about K order, is what this relies on.
// - The check runs on `Run`'s stream and synchronizes with it, on the first
//   GEMM of a family whose m falls in a class not yet decided (a few ms, up to
//   ~0.1 s for the LM head's largest classes). While the stream is capturing a
//   CUDA graph it is deferred: that GEMM runs the base algorithm (bit-identical
//   anyway; an untimed one if the family is new too) and the next GEMM of the
//   same shape outside a capture decides the class. It allocates, and frees
//   before `Run` returns, scratch of about max_m * (n * output bytes + 2 k)
//   bytes for the class's largest m (for the base's choice, m = 256), plus
//   twice the L2 size for small weights; without that memory the class stays
//   on the base (the base is the untimed choice).
class Gemm {
 public:
  // Allocates `workspace_bytes` of device memory on the current device.
  static cublasStatus_t Create(size_t workspace_bytes, std::unique_ptr<Gemm>* out,
                               int64_t invariant_rows = 0, int64_t plan_rows = 16,
                               bool bucket_classes = false, bool timed_picks = true,
                               bool retile = true);

  // Whether GemmParams::k_splits may cut a depth of k: k_splits >= 1 ranges of
  // whole 16-byte pieces.
  static bool KSplitFits(int64_t k, int k_splits) {
    return k_splits >= 1 && k % (int64_t{8} * k_splits) == 0;
  }

  int64_t invariant_rows() const { return invariant_rows_; }
  // Shape families (weights) for which cuBLASLt offered no candidate valid over
  // the whole row range; their GEMMs fall back to a per-shape pick and are not
  // row-invariant.
  int non_invariant_shapes() const { return non_invariant_shapes_; }
  // Shape families whose base algorithm was not chosen by timing (first used
  // while the stream captured a graph, or the measurement failed; Summary()
  // says which). Still row-invariant, possibly slower.
  int untimed_bases() const { return untimed_bases_; }

  // The row classes' upper bounds (ascending; the first class starts at 1);
  // empty without invariance.
  const std::vector<int64_t>& row_class_limits() const { return class_hi_; }
  // Decided (family, row class) pairs so far: those that run an algorithm of
  // their own (not the base), and those that run the base algorithm (because
  // it timed fastest among the identical ones, or no other candidate passed,
  // or the check could not run: Summary() says which).
  int own_algorithm_classes() const { return own_classes_; }
  int base_algorithm_classes() const { return base_classes_; }
  // Classes left on the base algorithm whose self-check found that even the
  // base gives other bits at the class's row counts than in an 8-row GEMM of
  // the same rows: the base's output depends on m there, so row invariance is
  // broken for those m. Should be 0.
  int self_check_failures() const { return self_check_failures_; }
  // Per family, its base (cuBLASLt's algo id, tile, stages, split-K, ...), how
  // it was chosen and what it cost at m = 1, 64 and 256; then one line per
  // decided or pending row class: the algorithm chosen and why. For tests and
  // benchmarks.
  std::string Summary() const;

  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // Enqueues y = x w^T (+ bias) on `stream`. CUBLAS_STATUS_INVALID_VALUE for
  // bad params, CUBLAS_STATUS_NOT_SUPPORTED when cuBLASLt offers no algorithm
  // for the shape. May synchronize `stream` once per new (shape family, row
  // class) while the stream is not capturing (see the class comment).
  cublasStatus_t Run(const GemmParams& p, cudaStream_t stream);

 private:
  struct Plan;
  // (m, n, k, y_fp32, has_bias, alignment of x, w, y in bytes, capped at 256,
  // k_splits)
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, int, int, int, int>;

  // (n, k, y_fp32, has_bias, alignment of x, w, y, k_splits): the shape family
  // a base algorithm serves.
  using FamilyKey = std::tuple<int64_t, int64_t, bool, bool, int, int, int, int>;
  struct RowClass {
    bool decided = false;
    bool own = false;  // runs `algo`; else the family's base
    cublasLtMatmulAlgo_t algo = {};
    int checked = 0;             // candidates run through the self-check
    int mismatched = 0;          // of those, how many gave other bits than the base
    int passed = 0;              // identical candidates timed (the base among them)
    bool base_mismatch = false;  // see self_check_failures()
    // Microseconds a launch of the chosen algorithm and of the base took at
    // the class's smallest and largest m (negative: not timed).
    float us[2] = {-1.0f, -1.0f};
    float base_us[2] = {-1.0f, -1.0f};
    const char* why = "";    // how the decision came about
    float decide_ms = 0.0f;  // host time the decision took (Summary)
    // Re-tiled candidates joined the pool and the pool was ordered by a quick
    // timing at the class's largest m (`retile`, classes up to 256 rows).
    bool retiled = false;
  };
  struct Family {
    bool found = false;  // has a base algorithm (else not row-invariant)
    cublasLtMatmulAlgo_t base = {};
    // The base's choice: how it came about, the candidates timed (potential
    // bases; helpers), the row counts timed and their weights, the chosen
    // base's own time and its identical group's best time at each, its cost
    // and the cost of the untimed choice (the plan_rows list's first), and
    // the time of cuBLASLt's first m = 1 pick (what a per-shape GEMM runs).
    // Times negative where not measured.
    bool timed = false;
    const char* why = "";
    int bases_timed = 0, helpers_timed = 0;
    std::vector<int64_t> timed_rows;
    std::vector<float> weights, base_us, group_us;
    float cost_us = -1.0f, first_cost_us = -1.0f;
    float m1_pick_us = -1.0f;
    // Timed candidates with the base's K split whose outputs equalled the
    // base's wherever both ran: offered to every row class's self-check.
    std::vector<cublasLtMatmulAlgo_t> group;
    float choose_ms = 0.0f;         // host time the choice took (Summary)
    std::vector<RowClass> classes;  // one per row_class_limits() entry
  };

  Gemm() = default;
  cublasStatus_t ChooseAlgo(const Key& key, const GemmParams& p, cudaStream_t stream, Plan* plan);
  cublasStatus_t MakeLayouts(const Key& key, Plan* plan);
  // The family of `key`, its base algorithm chosen on first use (ChooseBase;
  // untimed while `capturing`).
  Family& FamilyFor(const Key& key, const GemmParams& p, cudaStream_t stream, bool capturing);
  // Picks `family`'s base as the class comment describes. Synchronizes
  // `stream` unless `capturing`.
  void ChooseBase(const FamilyKey& fk, const GemmParams& p, cudaStream_t stream, bool capturing,
                  Family* family);
  // Index of the row class of m (1 <= m <= invariant_rows).
  size_t ClassOf(int64_t m) const;
  // Runs the self-check of row class `c` of `family` and records the decision.
  // Synchronizes `stream`; never called while it captures.
  void DecideClass(const FamilyKey& fk, Family* family, size_t c, const GemmParams& p,
                   cudaStream_t stream);
  bool AlgoFits(const cublasLtMatmulAlgo_t& algo, const Plan& plan);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, std::unique_ptr<Plan>> plans_;
  int64_t invariant_rows_ = 0;
  int64_t plan_rows_ = 16;
  bool timed_picks_ = true;
  bool retile_ = true;
  std::vector<int64_t> class_hi_;
  int non_invariant_shapes_ = 0;
  int untimed_bases_ = 0;
  int own_classes_ = 0;
  int base_classes_ = 0;
  int self_check_failures_ = 0;
  std::map<FamilyKey, Family> families_;
};

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_GEMM_H_
