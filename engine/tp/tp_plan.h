// How a model is sharded over N tensor-parallel ranks, for any N >= 1 (docs/architecture.md: the
// reference deployment verifies on 7 GPUs, and 7 divides no common head count). Shared by the
// CPU tensor-parallel backend and the CUDA one.
//
// Megatron-style layout:
//   - attention: each rank owns a contiguous range of query heads (split as evenly as possible:
//     64 heads over 7 ranks -> 10,9,9,9,9,9,9) and holds the contiguous range of KV heads those
//     query heads read. A KV head whose query heads land on several ranks is REPLICATED on each
//     of them (its K/V projection rows are loaded and its cache kept by every such rank), which
//     is also what happens whenever N > num_kv_heads. q/k/v projections are column-parallel
//     (rank reads its rows of the [out, in] weights, and of the Qwen2 biases); o_proj is
//     row-parallel (rank reads its query heads' input columns) followed by an all-reduce.
//   - MLP: gate/up column-parallel over a contiguous range of intermediate columns, down_proj
//     row-parallel over the same range, then an all-reduce.
//   - vocabulary: each rank owns a contiguous vocab range. Embedding = gather of the rank's own
//     rows (zeros for tokens outside its range) + all-reduce (exact: one non-zero addend).
//     LM head = per-rank logits over its range; the token is chosen by reducing per-rank
//     candidates (VocabCandidate below) or, on the CPU, by gathering the shards in rank order.
// A rank may own nothing of some part (N > num_heads leaves ranks without heads); it then
// contributes zeros to that part's all-reduce.
#ifndef SPECD_ENGINE_TP_TP_PLAN_H_
#define SPECD_ENGINE_TP_TP_PLAN_H_

#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/model_config.h"
#include "engine/sampling.h"

namespace specd {

// Half-open index range [begin, end).
struct TpRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
  bool contains(int64_t i) const { return i >= begin && i < end; }
};

// Splits [0, total) into n contiguous ranges in rank order whose sizes differ by at most
// `align` (by at most 1 when align == 1): whole units of `align` elements are dealt out as
// evenly as possible, earlier ranks taking the extra units, and the last total % align elements
// go to the last rank (which never holds more units than any other). align >= 1, n >= 1.
std::vector<TpRange> SplitEvenly(int64_t total, int n, int64_t align = 1);

struct TpRankPlan {
  TpRange q_heads;   // global query heads
  TpRange kv_heads;  // global KV heads read by q_heads (empty when q_heads is)
  TpRange ffn;       // columns of intermediate_size
  TpRange vocab;     // token ids of the embedding and LM head shards
};

struct TpPlanOptions {
  // FFN and vocab ranges are multiples of these (except the last rank's remainder), so GEMM
  // shapes stay friendly (e.g. 64 on GPUs); 1 splits exactly evenly.
  int64_t ffn_align = 1;
  int64_t vocab_align = 1;
};

struct TpPlan {
  int world_size = 1;
  int64_t kv_group = 1;  // query heads per KV head (num_heads / num_kv_heads)
  std::vector<TpRankPlan> ranks;
  // Per global KV head: how many ranks hold a copy (>= 1).
  std::vector<int> kv_replicas;
};

// The slice of a one-rank plan: every head, FFN column and vocabulary row.
TpRankPlan FullModelSlice(const ModelConfig& config);

// INVALID_ARGUMENT naming the field for world_size < 1, alignments < 1, or a config whose
// num_kv_heads does not divide num_heads.
absl::StatusOr<TpPlan> MakeTpPlan(const ModelConfig& config, int world_size,
                                  const TpPlanOptions& options = TpPlanOptions());

// Vocabulary-parallel token choice without gathering the logits: each rank reduces its own
// shard to one candidate, and the candidates reduce across ranks (on a GPU: an all-gather of N
// small structs, or an all-reduce with a max-by-key operator). The result is exactly
// SampleToken() of the full row for greedy decoding and for temperature sampling without top-k
// or top-p (Gumbel-max: the noise is keyed by the global token id, so a shard scores its tokens
// exactly as the full row would). Top-k / top-p / min-p need a global view (the shards' top-k
// lists at least), so callers gather the logits for those, and for the logits processors
// (penalties, bias, min_tokens), which the gathered path applies.
struct VocabCandidate {
  double score = 0.0;  // logit (greedy) or logit / temperature + Gumbel noise
  int32_t token = -1;  // global token id; -1 for an empty shard
  float logit = 0.0f;  // the token's raw logit: what the log-probabilities below need of it
};

bool VocabParallelSamplingSupported(const SamplingParams& params);

// `shard` is [vocab.size()] fp32, host: logits of tokens [vocab.begin, vocab.end).
// Requires VocabParallelSamplingSupported(params).
VocabCandidate ShardCandidate(absl::Span<const float> shard, TpRange vocab,
                              const SamplingParams& params, int64_t position);

// The best candidate: highest score, lowest token id on ties (as SampleToken), skipping empty
// shards. Independent of the order of `candidates`.
VocabCandidate ReduceCandidates(absl::Span<const VocabCandidate> candidates);

// Vocabulary-parallel log-probabilities (VerifyItem::logprobs) for the sampling that
// VocabParallelSamplingSupported() allows, where every token is kept: log_softmax(logits *
// scale) needs only each shard's maximum and sum of exponentials (a log-sum-exp merge), and the
// top n of the row are among the shards' own top n. So each rank reduces its shard to O(n)
// numbers and nothing of size vocab leaves it, as a GPU group would do it.

// The scale log_softmax applies to the raw logits (ComputeLogprobs): 1 / temperature for
// processed log-probabilities of temperature sampling, 1 otherwise. Requires
// VocabParallelSamplingSupported(params).
double LogprobScale(const SamplingParams& params, LogprobsMode mode);

struct ShardLogprobStats {
  double max_logit = -std::numeric_limits<double>::infinity();  // -inf for an empty shard
  double sum_exp = 0.0;  // sum of exp((logit - max_logit) * scale) over the shard
  int64_t above = 0;     // the shard's tokens whose logit is strictly above the emitted one's
  // The shard's `top_n` highest logits, highest first, lowest id first on ties.
  struct Entry {
    int32_t token = 0;
    float logit = 0.0f;
  };
  std::vector<Entry> top;
};

// `shard` is [vocab.size()] fp32, host: logits of tokens [vocab.begin, vocab.end) of one row;
// `emitted_logit` is the raw logit of the row's emitted token (VocabCandidate::logit of the
// reduced candidate); top_n in [0, kMaxLogprobs].
ShardLogprobStats ComputeShardLogprobStats(absl::Span<const float> shard, TpRange vocab,
                                           double scale, float emitted_logit, int top_n);

// ComputeLogprobs() of the whole row from its shards' statistics (any order): equal to it up to
// the double rounding of the merged sum (well below fp32 resolution), with the rank counted on
// the raw logits, which order tokens as their log-probabilities do.
TokenLogprobs MergeShardLogprobStats(absl::Span<const ShardLogprobStats> shards, double scale,
                                     float emitted_logit, int n);

}  // namespace specd

#endif  // SPECD_ENGINE_TP_TP_PLAN_H_
