// Model hyper-parameters read from a Hugging Face folder's config.json and
// generation_config.json.
#ifndef SPECD_ENGINE_MODEL_CONFIG_H_
#define SPECD_ENGINE_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace specd {

struct RopeScaling {
  std::string type;  // "" (none), "llama3", "linear"
  float factor = 1.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  int original_max_position_embeddings = 8192;
};

// Covers the Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5 (QKV bias), Qwen3 (q/k norm).
// The longest context a config may declare (Llama 4 Scout's 10 M fits); larger values are
// refused at load rather than overflowing position arithmetic.
inline constexpr int kMaxPositionEmbeddings = 1 << 24;

struct ModelConfig {
  std::string model_type;  // "llama", "mistral", "qwen2", "qwen3"
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // hidden_size / num_heads unless config.json says otherwise
  float rms_norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  RopeScaling rope_scaling;
  // The longest sequence served. With an active sliding window (Mistral's sliding_window;
  // Qwen2/Qwen3 when use_sliding_window is true) it is capped at the window: a sequence no
  // longer than the window attends exactly as full attention does, and the backends implement
  // full attention only, so longer sequences are refused rather than silently computed wrong.
  int max_position_embeddings = 2048;  // in [1, kMaxPositionEmbeddings]
  int sliding_window = 0;  // the checkpoint's window, 0 when none is active
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v projections carry a bias (Qwen2)
  bool qk_norm = false;         // per-head RMSNorm of q and k before RoPE (Qwen3)
  int bos_token_id = -1;
  std::vector<int32_t> eos_token_ids;  // from generation_config.json, else config.json
  std::string dir;                     // the folder it was read from

  int64_t ParameterCount() const;
};

// Reads dir/config.json and, when present, dir/generation_config.json. Errors name the file
// and the field.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir);

// Applies generation_config.json (its eos_token_id and bos_token_id override config.json's);
// `src` names it in errors.
absl::Status ApplyGenerationConfig(const std::string& json_text, const std::string& src,
                                   ModelConfig* config);

// Parses the text of config.json (generation config left empty); `source` names it in errors.
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source);

// RoPE inverse frequencies, [head_dim / 2], with llama3 or linear scaling applied.
std::vector<float> RopeInvFreq(const ModelConfig& config);

}  // namespace specd

#endif  // SPECD_ENGINE_MODEL_CONFIG_H_
