// Synthetic target/draft pairs whose cost is that of real models of a named shape and whose
// agreement is set by construction, for benchmarking speculative decoding where no trained
// pair of that shape is at hand (bench/README.md, "Synthetic pairs").
//
// The target has random weights at the shape's sizes. The draft is a layer-skip copy of it:
// the target's embedding, its first `draft_layers` layers, its final norm and its LM head, bit
// for bit. The target's remaining layers have their output projections (o_proj, down_proj)
// scaled by `epsilon`: at 0 they add nothing to the residual stream, so target and draft
// compute the same function and every draft token is accepted; as epsilon grows the skipped
// layers move the residual stream further from what the draft sees and acceptance falls. The
// tokens mean nothing; only the costs and the acceptance are real.
#ifndef SPECD_TOOLS_MAKE_TEST_MODEL_SYNTHETIC_PAIR_H_
#define SPECD_TOOLS_MAKE_TEST_MODEL_SYNTHETIC_PAIR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/draft/drafter.h"

namespace specd {

struct SyntheticShape {
  std::string name;
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int max_position_embeddings = 0;
  double rope_theta = 10000.0;
  // Llama 3.1's rope scaling (factor, original context); factor 0 = plain RoPE.
  double llama3_rope_factor = 0.0;
  int llama3_original_max_position = 8192;
};

// "reference" (models/pycoder-target's sizes), "llama-3.2-1b", "llama-3.1-8b",
// "llama-3.1-70b"; INVALID_ARGUMENT naming the list otherwise.
absl::StatusOr<SyntheticShape> SyntheticShapeByName(const std::string& name);
std::vector<std::string> SyntheticShapeNames();

struct SyntheticPairOptions {
  SyntheticShape shape;
  int draft_layers = 1;  // the draft's layers: the target's first ones, 1..num_layers
  double epsilon = 0.5;  // scale of o_proj/down_proj in the target layers the draft skips
  uint64_t seed = 1;
  // Standard deviation of the logits: the LM head is scaled so that the final norm's unit-RMS
  // output gives logits of about this spread, which makes the next-token distribution peaked
  // enough that sampling at temperature 1 is not uniform noise.
  double logit_std = 6.0;
  // Folder whose tokenizer.json (and tokenizer_config.json, generation_config.json, when
  // present) is copied into both models. Ids beyond its vocabulary decode to nothing.
  std::string tokenizer_dir;
  // Largest safetensors shard; a model larger than this is written as
  // model-0000k-of-0000n.safetensors with model.safetensors.index.json, as Hugging Face does.
  int64_t max_shard_bytes = int64_t{4} << 30;
  int num_threads = 0;  // weight generation threads (0 = all cores)
};

// Writes the target to `target_dir` and, unless `draft_dir` is empty, the draft to `draft_dir`
// (both created if needed) as bf16 Hugging Face folders. Tensors are generated and written in
// slices, never whole, so shapes far larger than memory can be written. Deterministic: the same
// options give the same bytes.
absl::Status WriteSyntheticPair(const SyntheticPairOptions& options, const std::string& target_dir,
                                const std::string& draft_dir);

struct TauOptions {
  std::string device = "cpu";
  int num_threads = 0;
  int num_prompts = 4;
  int prompt_tokens = 16;
  int max_new_tokens = 48;
  DraftParams draft;  // the router's default tree unless set
  uint64_t seed = 7;  // of the random prompts
};

struct TauMeasurement {
  double tau = 0.0;         // tokens emitted per speculative step, bonus token included
  double acceptance = 0.0;  // accepted draft tokens / draft tokens proposed
  int64_t steps = 0;        // speculative steps
  // Distinct tokens / tokens of the greedy outputs: near 0 would mean the random model
  // repeats one token, which would make any acceptance figure meaningless.
  double distinct_fraction = 0.0;
};

// Greedy decoding of random prompts with the target verifying the draft's trees in-process
// (engine/spec/generator.h), as the router does across gRPC.
absl::StatusOr<TauMeasurement> MeasureTau(const std::string& target_dir,
                                          const std::string& draft_dir, const TauOptions& options);

}  // namespace specd

#endif  // SPECD_TOOLS_MAKE_TEST_MODEL_SYNTHETIC_PAIR_H_
