// The model-execution interface every backend implements: cpu (fp32 reference), cuda (bf16),
// and tensor-parallel wrappers of either. One object owns one model's weights and the KV cache
// of many sequences; one thread drives it.
//
// KV model. Each sequence has a committed prefix whose keys and values are cached, and a
// scratch region of speculative nodes that hang off the end of the prefix as a tree. Forward()
// appends nodes to the scratch region; each node attends to the whole committed prefix and to
// its own ancestors in the scratch region (tree attention), and sits at RoPE position
// committed_length + depth. Commit() keeps the KV of one root-to-node path of scratch nodes,
// appending it to the prefix, and drops the rest of the scratch region.
//
// A prefill is a chain of the prompt followed by Commit() of the whole chain; a decode step is
// a single node; a verify step is the last accepted token followed by the draft tree.
#ifndef SPECD_ENGINE_BACKEND_H_
#define SPECD_ENGINE_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/token_tree.h"
#include "engine/model_config.h"
#include "engine/sampling.h"
#include "engine/topk.h"

namespace specd {

using SeqId = int64_t;

// Nodes appended to one sequence's scratch region in one Forward() call.
struct ForwardItem {
  SeqId seq = 0;
  // New tokens.
  std::vector<int32_t> tokens;
  // For each new token: the scratch index of its parent, or -1 for a child of the last
  // committed token. Scratch indices count every node appended since the last Commit(), in
  // order, including earlier nodes of this same item. Must be less than the node's own index.
  std::vector<int32_t> parents;
  // Indices into `tokens` whose next-token logits are wanted, in any order.
  std::vector<int32_t> logit_rows;
};

// One verify step of one sequence: feed `pending` (tokens accepted earlier whose KV is not yet
// cached: the prompt at the first step, the bonus token later; never empty) then the draft
// tree hanging below the last pending token; sample along the tree, descending while the
// sampled token is a child; commit the accepted path.
struct VerifyItem {
  SeqId seq = 0;
  std::vector<int32_t> pending;
  TokenTree tree;
  SamplingParams sampling;
  // The sequence's tokens so far, `pending` included (the prompt, then the output), for the
  // logits processors that read them (engine/sampling.h); required when
  // sampling.needs_history(), else ignored. A tree node's row is processed with this history
  // plus its path in the tree, so penalties and min_tokens stay lossless under speculation.
  const TokenHistory* history = nullptr;
  // Log-probabilities of the emitted tokens: -1 none (no cost), 0 the emitted token's, n (up to
  // kMaxLogprobs) also the n most likely tokens at each position.
  int logprobs = -1;
  LogprobsMode logprobs_mode = LogprobsMode::kRaw;
  // Residual-stream taps to return for the tokens this step commits, for an EAGLE drafter:
  // layer ids as engine/draft/eagle_head_config.h names them (L: the stream entering decoder
  // layer L; num_layers: the last layer's output before the final norm; num_layers + 1,
  // FinalNormTap: the final norm's output), in [0, num_layers + 1], at most kMaxTapLayers.
  // Empty: none (no cost).
  std::vector<int> tap_layers;
  // With tap_layers, where VerifyFeatures::held_taps: > 0 keeps this step's committed rows in
  // the backend (a CUDA backend: on the device), after the rows it holds for the sequence,
  // instead of returning them, for TakeHeldTaps(); at most this many rows a sequence (past it
  // the older half is dropped, so the rows taken then start later). A backend without room (or
  // without the feature) returns them in VerifyOutcome::taps as usual and keeps what it held.
  // Held rows that the step's rows do not continue (other layers, or a position gap) are
  // dropped first.
  int64_t hold_tap_rows = 0;
};

inline constexpr int kMaxTapLayers = 8;

// Tap rows a backend held for a sequence (VerifyItem::hold_tap_rows), as TakeHeldTaps() hands
// them over.
struct HeldTapRows {
  int64_t first_position = 0;  // the sequence position of the first row
  std::vector<int> layers;     // the tap ids of each row, in the order they were asked for
  // [rows, layers.size() * hidden_size] fp32, host; empty when nothing is held.
  std::vector<float> rows;
};

// The tap id of the final norm's output, the hidden state the LM head reads: the feature an
// EAGLE-1/2 head drafts from (EAGLE's own code feeds its head the base model's last hidden
// state, which is after the final norm). One past the last layer's output (num_layers).
inline int FinalNormTap(int num_layers) { return num_layers + 1; }

struct VerifyOutcome {
  // Accepted draft tokens followed by one token sampled from the target (the bonus), so
  // never empty. The last one becomes the next step's `pending`.
  std::vector<int32_t> tokens;
  int accepted_draft = 0;  // tokens.size() - 1
  // Tree node index of each accepted draft token, in order (for drafters that reuse KV).
  std::vector<int32_t> accepted_nodes;
  // Empty unless VerifyItem::logprobs >= 0; then one per entry of `tokens`, from the target's
  // row that token was drawn from (the row of its parent in the accepted path).
  std::vector<TokenLogprobs> logprobs;
  // Empty unless VerifyItem::tap_layers is set; then [pending.size() + accepted_draft,
  // tap_layers.size() * hidden_size] fp32, host: one row per token whose KV this step committed
  // (the pending tokens, then the accepted nodes), its taps concatenated in tap_layers' order.
  // Copies of the residual stream the forward pass computed, bit for bit.
  std::vector<float> taps;
};

// What a backend's Verify() does beyond temperature, top-k and top-p. The default Verify()
// (host sampling over gathered logits) does everything; a backend that overrides Verify()
// declares what its own path does, and CheckVerifySupport() turns the rest into UNIMPLEMENTED
// before a request is accepted, never into a silently ignored field. A device backend fills
// VerifyOutcome::logprobs from a device log-sum-exp and top-k of the same rows it samples.
struct VerifyFeatures {
  bool logits_processors = false;  // min_p, logit_bias, min_tokens and the penalties
  bool logprobs = false;
  bool taps = false;  // VerifyItem::tap_layers
  // Taps may name FinalNormTap (the final norm's output) besides the layer inputs.
  bool final_norm_tap = false;
  // VerifyItem::hold_tap_rows and TakeHeldTaps(): the backend keeps held rows where it
  // computed them (the device), so a step whose taps nobody reads yet copies nothing out.
  bool held_taps = false;
};

// The largest tap id a backend with `features` exports for a `num_layers`-layer model:
// FinalNormTap(num_layers) where it exports the final norm's output, else num_layers.
inline int MaxTapLayer(const VerifyFeatures& features, int num_layers) {
  return features.final_norm_tap ? FinalNormTap(num_layers) : num_layers;
}

struct KvUsage {
  int64_t used_tokens = 0;
  int64_t capacity_tokens = 0;
  int sequences = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual const ModelConfig& config() const = 0;

  // Sequences. AddSequence fails with ALREADY_EXISTS for a live id and RESOURCE_EXHAUSTED
  // when no KV capacity is left.
  virtual absl::Status AddSequence(SeqId seq) = 0;
  virtual absl::Status RemoveSequence(SeqId seq) = 0;
  virtual bool HasSequence(SeqId seq) const = 0;
  virtual absl::StatusOr<int64_t> CommittedLength(SeqId seq) const = 0;

  // One batched forward pass over all items (distinct sequences). `logits` receives
  // [sum over items of logit_rows.size(), vocab_size] fp32 (host), items in order and rows in
  // the order each item lists them.
  virtual absl::Status Forward(absl::Span<const ForwardItem> items, std::vector<float>* logits) = 0;

  // Forward() that returns, per logit row (same order), only the min(k, vocab_size) most likely
  // tokens and their log-probabilities (engine/topk.h: order, ties, log-sum-exp), so a
  // device backend copies [rows, k] instead of [rows, vocab] to the host. k in
  // [1, kMaxForwardTopK], else INVALID_ARGUMENT naming k. The default runs Forward() and
  // RowTopKLogprobs() on the host.
  virtual absl::Status ForwardTopK(absl::Span<const ForwardItem> items, int k, TopKRows* out);

  // Forward() that also returns residual-stream taps (VerifyItem::tap_layers' convention) of
  // every token of every item: `taps` receives [sum over items of tokens.size(),
  // tap_layers.size() * hidden_size] fp32 (host), tokens in item order, each row the listed
  // layers' streams concatenated in that order. `tap_layers` are distinct ids in
  // [0, num_layers]. The default is UNIMPLEMENTED (a backend that does not export taps).
  virtual absl::Status ForwardWithTaps(absl::Span<const ForwardItem> items,
                                       absl::Span<const int> tap_layers, std::vector<float>* logits,
                                       std::vector<float>* taps);

  // Keeps the scratch nodes of `path` (scratch indices: path[0] a child of the committed end,
  // each later one a child of the one before) and drops the rest of the scratch region.
  // An empty path drops the whole scratch region.
  virtual absl::Status Commit(SeqId seq, absl::Span<const int32_t> path) = 0;

  virtual KvUsage Usage() const = 0;

  // A whole verify step for a batch of sequences. The default runs Forward() then samples on
  // the host and Commit()s; a GPU backend overrides it to accept on the device.
  virtual absl::StatusOr<std::vector<VerifyOutcome>> Verify(absl::Span<const VerifyItem> items);

  // What Verify() honours. Nothing beyond the basic sampler unless a backend says so: one that
  // overrides Verify() without declaring more gets requests for the rest refused.
  virtual VerifyFeatures verify_features() const { return VerifyFeatures(); }

  // The tap rows held for `seq` (VerifyItem::hold_tap_rows), moved out: the backend holds none
  // of them afterwards. Empty rows when none are held (always, by default). RemoveSequence()
  // drops them.
  virtual absl::StatusOr<HeldTapRows> TakeHeldTaps(SeqId seq) { return HeldTapRows(); }

  // How the backend ran its steps so far. A step replayed from a captured CUDA graph costs a
  // fraction of one launched kernel by kernel, and a capture several steps' worth, so these say
  // whether a step's cost is the steady state. Backends without graphs count nothing.
  struct ExecutionCounts {
    int64_t graph_captures = 0;
    int64_t graph_replays = 0;
    int64_t eager_steps = 0;  // steps launched kernel by kernel
  };
  virtual ExecutionCounts execution_counts() const { return ExecutionCounts(); }
  // Whether a batched step runs every row padded to the longest row's token bucket (so a
  // step's cost follows rows x its longest row, not its total tokens).
  virtual bool pads_rows() const { return false; }
};

// OK when `features` cover what `sampling` and `logprobs` (VerifyItem::logprobs) ask for; else
// UNIMPLEMENTED naming the first field they do not cover (sampling.min_p, sampling.logit_bias,
// sampling.min_tokens, sampling.repetition_penalty, sampling.presence_penalty,
// sampling.frequency_penalty, logprobs) and `backend` (e.g. "the cuda:0 backend").
absl::Status CheckVerifySupport(const VerifyFeatures& features, const SamplingParams& sampling,
                                int logprobs, const std::string& backend);

// Tree acceptance on the host (docs/architecture.md, lossless verification) of `item` (its tree,
// sampling, history and logprobs). `rows` holds the logits of the last pending token followed by
// those of every tree node: [1 + tree.size(), vocab]. `first_position` is the absolute position of
// the token sampled from rows[0]. Only the rows the walk reaches are processed and sampled.
VerifyOutcome AcceptTreeOnHost(const VerifyItem& item, absl::Span<const float> rows, int vocab_size,
                               int64_t first_position);

// AcceptTreeOnHost() of a tree and sampling parameters without processors or logprobs.
VerifyOutcome AcceptTree(const TokenTree& tree, absl::Span<const float> rows, int vocab_size,
                         const SamplingParams& sampling, int64_t first_position);

// The walk AcceptTree does, with the target's choice abstracted: `sample(row, position)` gives
// the token drawn from logit row `row` (0: the last pending token, i + 1: tree node i) at
// absolute position `position`. Backends that choose tokens without gathering full logit rows
// (vocabulary-parallel ranks) walk the same way.
VerifyOutcome WalkTree(const TokenTree& tree, int64_t first_position,
                       absl::FunctionRef<int32_t(int row, int64_t position)> sample);

// The forward pass of one verify step: `item.pending` as a chain, the tree below its last
// token, logits for the last pending token and every node. Validates the item (`index` names it
// in errors: its tree, its sampling against the vocabulary, its logprobs count, a history when
// the sampling needs one) and returns the absolute position sampled from the first logit row.
absl::StatusOr<int64_t> MakeVerifyForward(const Backend& backend, const VerifyItem& item,
                                          size_t index, ForwardItem* forward);

// The scratch path Commit() keeps after a verify step: the pending chain, then the accepted
// nodes (scratch indices are tree indices shifted by the pending count).
std::vector<int32_t> AcceptedScratchPath(int num_pending, const VerifyOutcome& outcome);

// The argument checks of ForwardTopK(): `out` not null, k in [1, kMaxForwardTopK].
absl::Status CheckForwardTopK(int k, const TopKRows* out);

// Fills `out` with the top-k of every row of `logits` ([rows, vocab] fp32, host).
void TopKRowsOnHost(absl::Span<const float> logits, int64_t vocab, int k, TopKRows* out);

// The default of BackendOptions::cuda_gemm_invariant_rows: the largest GEMM row class the
// CUDA backend keeps row-invariant and its warm-up decides (engine/warmup.h), and so the most
// rows a forward should carry (the draft model's catch-up is fed in pieces of at most this).
inline constexpr int64_t kDefaultGemmInvariantRows = 1024;

struct BackendOptions {
  std::string device = "cpu";            // "cpu" or "cuda:N"
  int64_t kv_capacity_tokens = 1 << 20;  // total cached tokens over all sequences
  int num_threads = 0;                   // cpu: 0 = all cores
  // cpu: keep the GEMM matrices of a bf16 checkpoint as bf16 (engine/cpu/cpu_model.h): the same
  // logits bit for bit, half the weight bytes a step reads. False keeps every matrix fp32.
  bool cpu_bf16_weights = true;
  // Ranks the model is sharded over (engine/tp/tp_plan.h), any value >= 1. On "cpu", > 1 selects
  // the simulated tensor-parallel backend (engine/tp/tp_cpu_backend.h), one thread per rank.
  int tensor_parallel = 1;
  // cuda with tensor_parallel > 1: rank r's GPU index (tensor_parallel entries, distinct).
  // Empty: consecutive GPUs from the one `device` names.
  std::vector<int> devices;
  // cuda tensor parallel: all-reduce messages up to this many bytes take the custom one-shot
  // kernel over NVLink peer memory, larger ones NCCL; -1 sizes it to cover every CUDA-graph
  // step, 0 is NCCL only (engine/cuda/cuda_tp_backend.h).
  int64_t cuda_custom_allreduce_max_bytes = -1;
  // cuda: replay decode and verify steps as CUDA graphs captured per (batch, tree size)
  // bucket. The environment variable SPECD_CUDA_GRAPHS=0 turns them off too (debugging, A/B).
  bool cuda_graphs = true;
  // cuda: GEMMs of up to this many rows share one cuBLASLt algorithm per weight, so a token's
  // logits do not depend on how many other tokens share its step (speculative greedy equals
  // target-only greedy bit for bit). 0 lets cuBLASLt pick per shape. The CUDA backend's tuning
  // and A/B switches (SPECD_GEMM_TIMING, SPECD_PDL, ...) are not options: they are read once
  // from the environment when a backend is created (engine/cuda/cuda_tuning.h, docs/tuning.md).
  int64_t cuda_gemm_invariant_rows = kDefaultGemmInvariantRows;
  // cuda: before CreateBackend returns, run one forward at each GEMM row class
  // (engine/warmup.h), so that no request -- and no measurement of the speculation policy --
  // pays for a class's algorithm decision. Off by default for tests and benchmarks; the
  // model services turn it on (--warmup).
  bool cuda_warmup = false;
};

// Loads the model folder `dir` onto the device named in `options`.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& dir,
                                                       const BackendOptions& options);

}  // namespace specd

#endif  // SPECD_ENGINE_BACKEND_H_
