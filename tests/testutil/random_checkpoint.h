// Writes small random-weight Hugging Face model folders (config.json, model.safetensors,
// generation_config.json, tokenizer.json) so tests and the demo exercise the real loaders.
#ifndef SPECD_TESTS_TESTUTIL_RANDOM_CHECKPOINT_H_
#define SPECD_TESTS_TESTUTIL_RANDOM_CHECKPOINT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "common/io/safetensors.h"

namespace specd {

struct RandomCheckpointSpec {
  std::string model_type = "llama";  // llama, mistral, qwen2, qwen3
  int vocab_size = 320;              // >= 257: 256 byte tokens, then <|eos|> and specials
  int hidden_size = 64;
  int intermediate_size = 160;
  int num_layers = 2;
  int num_heads = 4;
  int num_kv_heads = 2;
  int head_dim = 0;  // 0: hidden_size / num_heads
  float rope_theta = 10000.0f;
  bool llama3_rope_scaling = false;
  bool tie_word_embeddings = false;
  int max_position_embeddings = 4096;
  DType dtype = DType::kF32;
  uint64_t seed = 1;
  float init_std = 0.08f;      // weight scale; larger gives peakier next-token distributions
  int shards = 1;              // > 1 writes model-0000k-of-0000n.safetensors and an index
};

// Writes the folder `dir` (created if needed). Token 256 is <|eos|>, named in
// generation_config.json; the tokenizer is byte-level BPE over the 256 byte tokens with no
// merges, so every byte string round-trips.
absl::Status WriteRandomCheckpoint(const std::string& dir, const RandomCheckpointSpec& spec);

// A fresh, empty temporary folder under $TMPDIR (or /tmp) whose name starts with `prefix`.
std::string MakeTempDir(const std::string& prefix);

// The shapes of models/pycoder-target (vocabulary 8192, hidden 320, FFN 864, 5 layers, 5 query
// heads of 64 over 1 KV head, tied embeddings), for benchmarks that time the reference target's
// sizes on random weights; the other fields keep their defaults.
RandomCheckpointSpec PycoderTargetShape();

}  // namespace specd

#endif  // SPECD_TESTS_TESTUTIL_RANDOM_CHECKPOINT_H_
