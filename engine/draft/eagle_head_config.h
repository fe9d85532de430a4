// The config.json of an EAGLE draft head (docs/eagle.md), read against its target's config.
//
// Two kinds of head are read, both in the layout their authors publish:
//   EAGLE-3 (`architectures: ["LlamaForCausalLMEagle3"]`, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
//     and SpecForge's heads): one decoder layer whose attention reads 2H inputs, fc [H, 3 Ht] over
//     three target taps, its own final norm and LM head over a draft vocabulary of
//     draft_vocab_size tokens (d2t/t2d map it to the target's).
//   EAGLE-1/2 (any other architectures entry, `LlamaForCausalLM` in the published heads): fc
//     [H, 2H] (with a bias unless `bias` is false) over concat(embedding, feature),
//     num_hidden_layers Llama layers, the first without an input norm, and the target's LM head.
//     The feature is the target's last hidden state after its final norm.
//
// Taps: specd names a tap by the target layer whose INPUT it is. Tap L is the residual stream
// entering decoder layer L: tap 0 is the token embeddings, tap N (N = the target's
// num_hidden_layers) the last layer's output before the final norm. config.json may name the
// taps in either of two spellings, which differ by one:
//   "specd_tap_layer_inputs": [L0, L1, L2]                     taps as specd names them (the
//       meaning vLLM gives layer ids, and EAGLE's own defaults);
//   "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i0, i1, i2]}   outputs of layers i
//       (SGLang's and SpecForge's meaning), so tap = i + 1.
// When both are present they must name the same taps. With neither, the taps are 2, N/2 and
// N - 3, what EAGLE, SGLang and vLLM capture by default (2, 16, 29 for a 32-layer target).
// fc's input is the three taps concatenated in increasing layer order whatever order a config
// lists them in, as every implementation captures them in layer order.
//
// RoPE: the head's positions run over the serving context, whatever max_position_embeddings its
// config states (2048 for the published 8B head, whose cos/sin table EAGLE grows on demand);
// EagleHeadConfig::head keeps that value only as the file says it.
#ifndef SPECD_ENGINE_DRAFT_EAGLE_HEAD_CONFIG_H_
#define SPECD_ENGINE_DRAFT_EAGLE_HEAD_CONFIG_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model_config.h"

namespace specd {

enum class EagleKind { kEagle3, kEagle1 };

// "eagle3" or "eagle1" (EAGLE-1 and EAGLE-2 share the head; EAGLE-2 only changes the tree).
const char* EagleKindName(EagleKind kind);

struct EagleHeadConfig {
  EagleKind kind = EagleKind::kEagle3;
  // The head's own hyper-parameters as config.json states them: hidden_size (H), heads,
  // head_dim, intermediate_size, num_layers, rms_norm_eps, RoPE theta and scaling.
  ModelConfig head;
  int vocab_size = 0;          // the target's vocabulary: the ids the head reads and proposes
  int draft_vocab_size = 0;    // rows of the head's LM head; vocab_size for EAGLE-1/2
  int target_hidden_size = 0;  // Ht: the width of one tap (EAGLE-3's target_hidden_size)
  // The taps the head reads, increasing, as the verify service is asked for them: EAGLE-3's
  // three layer inputs; for EAGLE-1/2 the one tap FinalNormTap(N) (engine/backend.h), the
  // target's final norm output.
  std::vector<int> taps;
  // EAGLE-3: the residual stream starts from hidden_norm(hidden) instead of hidden (a flag some
  // checkpoints carry, vLLM's norm_before_residual).
  bool norm_before_residual = false;
  // EAGLE-1/2: fc carries a bias (config "bias", true unless stated false).
  bool fc_bias = true;
  std::string dir;  // the folder it was read from

  // Floats of one token's target feature: 3 * Ht (EAGLE-3) or Ht (EAGLE-1/2).
  int feature_size() const {
    return kind == EagleKind::kEagle3 ? 3 * target_hidden_size : target_hidden_size;
  }
};

// 2, N / 2 and N - 3 for an N-layer target.
std::vector<int> DefaultEagleTaps(int target_layers);

// Parses config.json text; `source` names it in errors, which are INVALID_ARGUMENT naming the
// field (a head that does not fit `target`, a feature specd does not implement, bad taps).
absl::StatusOr<EagleHeadConfig> ParseEagleHeadConfig(const std::string& json_text,
                                                     const std::string& source,
                                                     const ModelConfig& target);

// Reads dir/config.json.
absl::StatusOr<EagleHeadConfig> LoadEagleHeadConfig(const std::string& dir,
                                                    const ModelConfig& target);

}  // namespace specd

#endif  // SPECD_ENGINE_DRAFT_EAGLE_HEAD_CONFIG_H_
