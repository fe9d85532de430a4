// EAGLE draft heads (EAGLE-3 and EAGLE-1/2): loading a head in its published layout and running
// its forward over many sequences with its own paged KV cache. The EAGLE drafter (draft service)
// drives an EagleHead the way DraftModelDrafter drives a Backend: per step, one batched Forward()
// of every sequence's new pairs as a chain, one batched Forward() per tree level, then Commit()
// of the chain. config.json and the taps: engine/draft/eagle_head_config.h; the math:
// docs/eagle.md and the PyTorch reference tools/oracle/eagle3_reference.py, which wrote the
// fixtures the tests compare against.
//
// KV model (as engine/backend.h, one "token" being one pair). Position p of a sequence holds the
// pair (target feature at position p, target token at position p + 1): a prompt of n tokens
// t_0..t_{n-1} whose verify step sampled t_n is fed as the chain (f_0, t_1) .. (f_{n-1}, t_n) at
// positions 0..n-1, and the output at n - 1 scores t_{n+1}. Each later verify step feeds the
// pairs of the tokens it committed. A draft node is a pair (its parent's output hidden state, its
// own token) at position committed + depth, attending to the committed pairs and its ancestors;
// Commit() keeps one root-to-node path and drops the rest of the scratch region.
//
// Inputs. A node's input vector is either the target's feature (kTargetFeatures:
// feature_size() floats, the three taps concatenated for EAGLE-3, the final normed hidden state
// for EAGLE-1/2) or an H-wide hidden state (kHidden: a head output for deeper nodes; for EAGLE-3
// also fc(taps) computed elsewhere, e.g. by the verify service). EAGLE-3 applies fc to target
// features only; EAGLE-1/2 applies its fc to concat(embedding, input) for both kinds.
//
// Outputs, per requested row: the layer output before the final norm (what a child takes as its
// kHidden input) and the logits over the draft vocabulary; draft_to_target() maps a draft id to
// the target id a tree proposes.
#ifndef SPECD_ENGINE_DRAFT_EAGLE_HEAD_H_
#define SPECD_ENGINE_DRAFT_EAGLE_HEAD_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/io/safetensors.h"
#include "engine/backend.h"
#include "engine/draft/eagle_head_config.h"
#include "engine/model_config.h"
#include "engine/warmup.h"

namespace specd {

enum class EagleInput {
  kTargetFeatures,  // feature_size() floats a node
  kHidden,          // hidden_size floats a node
};

// New nodes of one sequence in one Forward() call.
struct EagleHeadItem {
  SeqId seq = 0;
  // The target token of each node (the token paired with its input), and its parent as in
  // ForwardItem::parents (-1: a child of the last committed pair).
  std::vector<int32_t> tokens;
  std::vector<int32_t> parents;
  EagleInput input = EagleInput::kTargetFeatures;
  // [tokens.size(), width of `input`] fp32, host; read during Forward() only.
  absl::Span<const float> inputs;
  // Indices into `tokens` whose outputs are wanted, in any order.
  std::vector<int32_t> output_rows;
};

struct EagleHeadOutputs {
  // Requested rows, items in order and rows in the order each item lists them:
  std::vector<float> hidden;  // [R, hidden_size] fp32, host: layer outputs before the final norm
  std::vector<float> logits;  // [R, draft_vocab_size] fp32, host
};

// A head's weights in fp32 on the host, as the CPU forward uses them and a device backend would
// upload them. Shapes use H = hidden_size, Ht = target_hidden_size, F = intermediate_size,
// Q = heads * head_dim, KV = kv_heads * head_dim.
struct EagleHeadWeights {
  // [vocab, H]: the head file's embed_tokens.weight when it has one, else the target's embedding.
  std::vector<float> embed;
  std::vector<float> fc;       // EAGLE-3 [H, 3 Ht]; EAGLE-1/2 [H, 2H]
  std::vector<float> fc_bias;  // [H] (EAGLE-1/2 with a bias), else empty
  struct Layer {
    std::vector<float> input_norm;          // [H]; empty for EAGLE-1/2's first layer
    std::vector<float> hidden_norm;         // [H] EAGLE-3, else empty
    std::vector<float> post_norm;           // [H]
    std::vector<float> q_proj;              // [Q, in]; in = 2H (EAGLE-3) or H
    std::vector<float> k_proj, v_proj;      // [KV, in]
    std::vector<float> o_proj;              // [H, Q]
    std::vector<float> gate_proj, up_proj;  // [F, H]
    std::vector<float> down_proj;           // [H, F]
  };
  std::vector<Layer> layers;
  std::vector<float> norm;  // [H] EAGLE-3's final norm, else empty
  // EAGLE-3 [draft vocab, H]; EAGLE-1/2 the target's LM head [vocab, H].
  std::vector<float> lm_head;
  std::vector<int32_t> draft_to_target;  // [draft vocab]: target id of each draft id
};

// Reads a head's tensors: `head` is the head folder's store, `target` the target's (for the
// embedding and, EAGLE-1/2, the LM head). EAGLE-3 tensors: fc.weight, midlayer.self_attn.
// {q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight, midlayer.{input_layernorm,
// hidden_norm,post_attention_layernorm}.weight, norm.weight, lm_head.weight, and d2t (int64
// offsets: target id = draft id + d2t[draft id]) / t2d (bool [vocab]) when the draft vocabulary
// is smaller (t2d optional; when present it must agree with d2t). EAGLE-1/2: fc.weight, fc.bias,
// layers.<i>.{self_attn,mlp}.*, layers.<i>.post_attention_layernorm.weight and, from the second
// layer on, layers.<i>.input_layernorm.weight. Either may carry embed_tokens.weight. Errors
// (INVALID_ARGUMENT) name the file, the tensor and the shape expected; a tensor the head does not
// use is an error too, so nothing in the file is silently ignored.
absl::StatusOr<EagleHeadWeights> LoadEagleHeadWeights(const EagleHeadConfig& config,
                                                      const TensorStore& head,
                                                      const TensorStore& target,
                                                      const ModelConfig& target_config);

class EagleHead {
 public:
  virtual ~EagleHead() = default;

  virtual const EagleHeadConfig& config() const = 0;
  // draft id -> target id, [draft_vocab_size].
  virtual absl::Span<const int32_t> draft_to_target() const = 0;
  // Positions a sequence may reach: the serving context, not the head's own RoPE table.
  virtual int context_length() const = 0;

  // As Backend: ALREADY_EXISTS for a live id, RESOURCE_EXHAUSTED without KV room, NOT_FOUND.
  virtual absl::Status AddSequence(SeqId seq) = 0;
  virtual absl::Status RemoveSequence(SeqId seq) = 0;
  virtual bool HasSequence(SeqId seq) const = 0;
  virtual absl::StatusOr<int64_t> CommittedLength(SeqId seq) const = 0;

  // One batched pass over all items (distinct sequences). The whole batch is checked first
  // (INVALID_ARGUMENT naming items[i] and the field): on error no sequence changes.
  virtual absl::Status Forward(absl::Span<const EagleHeadItem> items, EagleHeadOutputs* out) = 0;
  // Forward() that returns, per requested row (same order), the min(k, draft_vocab_size) most
  // likely draft ids (not target ids: draft_to_target() maps them) and their log-probabilities
  // in `top` (engine/topk.h: order, ties, fp64 log-sum-exp) instead of the logits: out->logits
  // stays empty, out->hidden is Forward()'s. So a device head copies [rows, k] instead of
  // [rows, draft vocab] to the host. k in [1, kMaxForwardTopK], else INVALID_ARGUMENT naming k.
  // The default runs Forward() and RowTopKLogprobs() on the host.
  virtual absl::Status ForwardTopK(absl::Span<const EagleHeadItem> items, int k,
                                   EagleHeadOutputs* out, TopKRows* top);
  // As Backend::Commit.
  virtual absl::Status Commit(SeqId seq, absl::Span<const int32_t> path) = 0;
  virtual KvUsage Usage() const = 0;
};

struct EagleHeadOptions {
  // "cpu" (fp32, EagleHeadCpu) or "cuda" / "cuda:N" (bf16 on GPU N, EAGLE-3 and EAGLE-1/2
  // heads: engine/draft/eagle_head_cuda.h; UNIMPLEMENTED in a build without CUDA).
  std::string device = "cpu";
  int64_t kv_capacity_tokens = 1 << 20;  // pairs cached over all sequences
  // Longest sequence, in positions; 0: the target's max_position_embeddings.
  int context_length = 0;
  int num_threads = 0;  // 0: all cores
  // CPU head: keep a GEMM matrix whose every value is a bf16 value (a bf16 checkpoint's,
  // widened) as those bf16 bit patterns. The head's steps stream their weights (the LM head
  // alone is draft vocab x H) once per forward, so at a few rows a forward is bound by those
  // bytes; LinearCpu widens bf16 exactly, so the outputs do not change by a bit.
  bool cpu_bf16_weights = true;
};

// Loads the head in `head_dir` for the target model in `target_dir`.
absl::StatusOr<std::unique_ptr<EagleHead>> CreateEagleHead(const std::string& head_dir,
                                                           const std::string& target_dir,
                                                           const EagleHeadOptions& options);

// WarmUpBackend for a head (engine/warmup.h says why): for each row count m in `rows`, one
// Forward of a fresh sequence holding a chain of m target-feature pairs with every row's output
// asked for, so the head's GEMMs -- fc, the layer and the LM head -- run at m rows; then the
// sequence is removed. Row counts above the head's context or its free KV capacity are left out
// (and not reported). The head must hold no sequence with the largest SeqId, which a fresh head
// does not. Leaves the head's sequences and KV usage as they were.
absl::StatusOr<WarmUpReport> WarmUpEagleHead(EagleHead& head, const std::vector<int64_t>& rows);

}  // namespace specd

#endif  // SPECD_ENGINE_DRAFT_EAGLE_HEAD_H_
