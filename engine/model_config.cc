#include "engine/model_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace specd {
namespace {

using nlohmann::json;

absl::Status GetInt(const json& j, const char* key, const std::string& src, int* out,
                    bool required) {
  if (!j.contains(key) || j[key].is_null()) {
    if (required) return absl::InvalidArgumentError(absl::StrCat(src, ": missing field ", key));
    return absl::OkStatus();
  }
  if (!j[key].is_number_integer()) {
    return absl::InvalidArgumentError(absl::StrCat(src, ": field ", key, " is not an integer"));
  }
  // get<int>() would silently keep the low 32 bits of 2^40; out-of-range values are refused.
  if (j[key].is_number_unsigned()
          ? j[key].get<uint64_t>() > uint64_t{INT32_MAX}
          : (j[key].get<int64_t>() > INT32_MAX || j[key].get<int64_t>() < INT32_MIN)) {
    return absl::InvalidArgumentError(
        absl::StrCat(src, ": field ", key, " is out of the 32-bit integer range"));
  }
  *out = j[key].get<int>();
  return absl::OkStatus();
}

// An id the embedding cannot hold would pass loading and then make every request fail.
absl::Status CheckEos(const std::vector<int32_t>& eos, int vocab_size, const std::string& src) {
  for (int32_t id : eos) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          src, ": eos_token_id ", id, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status GetFloat(const json& j, const char* key, const std::string& src, float* out) {
  if (!j.contains(key) || j[key].is_null()) return absl::OkStatus();
  if (!j[key].is_number()) {
    return absl::InvalidArgumentError(absl::StrCat(src, ": field ", key, " is not a number"));
  }
  *out = j[key].get<float>();
  return absl::OkStatus();
}

absl::Status ReadEos(const json& j, const std::string& src, std::vector<int32_t>* out) {
  if (!j.contains("eos_token_id") || j["eos_token_id"].is_null()) return absl::OkStatus();
  const json& e = j["eos_token_id"];
  out->clear();
  auto push = [&](const json& v) -> absl::Status {
    if (!v.is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat(src, ": eos_token_id holds a non-integer"));
    }
    if (v.is_number_unsigned() ? v.get<uint64_t>() > uint64_t{INT32_MAX}
                               : (v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)) {
      return absl::InvalidArgumentError(
          absl::StrCat(src, ": eos_token_id ", v.dump(), " is not a token id"));
    }
    out->push_back(v.get<int32_t>());
    return absl::OkStatus();
  };
  if (e.is_number_integer()) {
    if (absl::Status s = push(e); !s.ok()) return s;
  } else if (e.is_array()) {
    for (const auto& v : e) {
      if (absl::Status s = push(v); !s.ok()) return s;
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat(src, ": eos_token_id is not an id or a list"));
  }
  return absl::OkStatus();
}

#define SPECD_RETURN_IF_ERROR_(expr)           \
  do {                                         \
    absl::Status _s = (expr);                  \
    if (!_s.ok()) return _s;                   \
  } while (0)

}  // namespace

int64_t ModelConfig::ParameterCount() const {
  const int64_t h = hidden_size, q = int64_t{num_heads} * head_dim,
                kv = int64_t{num_kv_heads} * head_dim, f = intermediate_size;
  int64_t per_layer = h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h;
  if (attention_bias) per_layer += q + 2 * kv;
  if (qk_norm) per_layer += 2 * head_dim;
  int64_t total = per_layer * num_layers + int64_t{vocab_size} * h + h;
  if (!tie_word_embeddings) total += int64_t{vocab_size} * h;
  return total;
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& src) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(src, ": malformed JSON: ", e.what()));
  }
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(src, ": not a JSON object"));
  ModelConfig c;
  if (j.contains("model_type") && j["model_type"].is_string()) {
    c.model_type = j["model_type"].get<std::string>();
  } else {
    return absl::InvalidArgumentError(absl::StrCat(src, ": missing field model_type"));
  }
  if (c.model_type != "llama" && c.model_type != "mistral" && c.model_type != "qwen2" &&
      c.model_type != "qwen3") {
    return absl::InvalidArgumentError(absl::StrCat(
        src, ": model_type \"", c.model_type, "\" is not supported (llama, mistral, qwen2, qwen3)"));
  }
  SPECD_RETURN_IF_ERROR_(GetInt(j, "vocab_size", src, &c.vocab_size, true));
  SPECD_RETURN_IF_ERROR_(GetInt(j, "hidden_size", src, &c.hidden_size, true));
  SPECD_RETURN_IF_ERROR_(GetInt(j, "intermediate_size", src, &c.intermediate_size, true));
  SPECD_RETURN_IF_ERROR_(GetInt(j, "num_hidden_layers", src, &c.num_layers, true));
  SPECD_RETURN_IF_ERROR_(GetInt(j, "num_attention_heads", src, &c.num_heads, true));
  c.num_kv_heads = c.num_heads;
  SPECD_RETURN_IF_ERROR_(GetInt(j, "num_key_value_heads", src, &c.num_kv_heads, false));
  SPECD_RETURN_IF_ERROR_(GetInt(j, "max_position_embeddings", src, &c.max_position_embeddings,
                                false));
  // Mistral applies sliding_window whenever it is set; Qwen2/Qwen3 only with
  // use_sliding_window (their configs carry a window that is otherwise unused).
  bool window_active = c.model_type == "mistral";
  if (c.model_type == "qwen2" || c.model_type == "qwen3") {
    window_active = j.contains("use_sliding_window") && j["use_sliding_window"].is_boolean() &&
                    j["use_sliding_window"].get<bool>();
  }
  if (window_active) {
    SPECD_RETURN_IF_ERROR_(GetInt(j, "sliding_window", src, &c.sliding_window, false));
    if (c.sliding_window < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(src, ": sliding_window ", c.sliding_window, " is negative"));
    }
    if (c.sliding_window > 0 && c.sliding_window < c.max_position_embeddings) {
      c.max_position_embeddings = c.sliding_window;
    }
  }
  if (c.vocab_size <= 0 || c.hidden_size <= 0 || c.intermediate_size <= 0 || c.num_layers <= 0 ||
      c.num_heads <= 0 || c.num_kv_heads <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(src, ": sizes must be positive"));
  }
  // A context of 0 positions loads but refuses every prompt; a service must not report
  // SERVING with it. The upper bound keeps position arithmetic (positions + tree depth) in int.
  if (c.max_position_embeddings <= 0 || c.max_position_embeddings > kMaxPositionEmbeddings) {
    return absl::InvalidArgumentError(absl::StrCat(src, ": max_position_embeddings ",
                                                   c.max_position_embeddings, " must be in [1, ",
                                                   kMaxPositionEmbeddings, "]"));
  }
  if (c.num_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(src, ": num_attention_heads ", c.num_heads,
                                                   " is not a multiple of num_key_value_heads ",
                                                   c.num_kv_heads));
  }
  c.head_dim = c.hidden_size / c.num_heads;
  SPECD_RETURN_IF_ERROR_(GetInt(j, "head_dim", src, &c.head_dim, false));
  if (c.head_dim <= 0 || c.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(src, ": head_dim ", c.head_dim,
                                                   " must be positive and even"));
  }
  SPECD_RETURN_IF_ERROR_(GetFloat(j, "rms_norm_eps", src, &c.rms_norm_eps));
  SPECD_RETURN_IF_ERROR_(GetFloat(j, "rope_theta", src, &c.rope_theta));
  // transformers 5 moved rope_theta into rope_parameters; accept both.
  const char* rope_key = j.contains("rope_scaling") && !j["rope_scaling"].is_null()
                             ? "rope_scaling"
                             : (j.contains("rope_parameters") ? "rope_parameters" : nullptr);
  if (rope_key != nullptr && !j[rope_key].is_null()) {
    const json& r = j[rope_key];
    if (!r.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(src, ": ", rope_key, " is not an object"));
    }
    SPECD_RETURN_IF_ERROR_(GetFloat(r, "rope_theta", src, &c.rope_theta));
    std::string type;
    if (r.contains("rope_type") && r["rope_type"].is_string()) {
      type = r["rope_type"].get<std::string>();
    } else if (r.contains("type") && r["type"].is_string()) {
      type = r["type"].get<std::string>();
    }
    if (type == "default" || type.empty()) {
      type.clear();
    } else if (type != "llama3" && type != "linear") {
      return absl::InvalidArgumentError(
          absl::StrCat(src, ": ", rope_key, ".rope_type \"", type, "\" is not supported"));
    }
    c.rope_scaling.type = type;
    SPECD_RETURN_IF_ERROR_(GetFloat(r, "factor", src, &c.rope_scaling.factor));
    SPECD_RETURN_IF_ERROR_(GetFloat(r, "low_freq_factor", src, &c.rope_scaling.low_freq_factor));
    SPECD_RETURN_IF_ERROR_(GetFloat(r, "high_freq_factor", src, &c.rope_scaling.high_freq_factor));
    SPECD_RETURN_IF_ERROR_(GetInt(r, "original_max_position_embeddings", src,
                                  &c.rope_scaling.original_max_position_embeddings, false));
  }
  if (j.contains("tie_word_embeddings") && j["tie_word_embeddings"].is_boolean()) {
    c.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  }
  if (c.model_type == "qwen2") c.attention_bias = true;
  if (j.contains("attention_bias") && j["attention_bias"].is_boolean()) {
    c.attention_bias = j["attention_bias"].get<bool>();
  }
  c.qk_norm = c.model_type == "qwen3";
  SPECD_RETURN_IF_ERROR_(GetInt(j, "bos_token_id", src, &c.bos_token_id, false));
  SPECD_RETURN_IF_ERROR_(ReadEos(j, src, &c.eos_token_ids));
  SPECD_RETURN_IF_ERROR_(CheckEos(c.eos_token_ids, c.vocab_size, src));
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(dir) / "config.json").string();
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open (not a model folder?)"));
  std::stringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<ModelConfig> c = ParseModelConfig(ss.str(), path);
  if (!c.ok()) return c.status();
  c->dir = dir;
  const std::string gen = (fs::path(dir) / "generation_config.json").string();
  std::error_code ec;
  if (fs::exists(gen, ec)) {
    std::ifstream gin(gen);
    if (!gin) return absl::NotFoundError(absl::StrCat(gen, ": cannot open"));
    std::stringstream gs;
    gs << gin.rdbuf();
    SPECD_RETURN_IF_ERROR_(ApplyGenerationConfig(gs.str(), gen, &*c));
  }
  return c;
}

absl::Status ApplyGenerationConfig(const std::string& json_text, const std::string& src,
                                   ModelConfig* config) {
  json g;
  try {
    g = json::parse(json_text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(src, ": malformed JSON: ", e.what()));
  }
  if (!g.is_object()) return absl::InvalidArgumentError(absl::StrCat(src, ": not an object"));
  SPECD_RETURN_IF_ERROR_(ReadEos(g, src, &config->eos_token_ids));
  SPECD_RETURN_IF_ERROR_(CheckEos(config->eos_token_ids, config->vocab_size, src));
  SPECD_RETURN_IF_ERROR_(GetInt(g, "bos_token_id", src, &config->bos_token_id, false));
  return absl::OkStatus();
}

std::vector<float> RopeInvFreq(const ModelConfig& c) {
  const int half = c.head_dim / 2;
  std::vector<float> inv(half);
  for (int i = 0; i < half; ++i) {
    inv[i] = static_cast<float>(1.0 / std::pow(static_cast<double>(c.rope_theta),
                                               2.0 * i / c.head_dim));
  }
  const RopeScaling& s = c.rope_scaling;
  if (s.type == "linear") {
    for (float& f : inv) f /= s.factor;
  } else if (s.type == "llama3") {
    // As in transformers' _compute_llama3_parameters: long wavelengths are slowed by `factor`,
    // short ones kept, and the band between blended smoothly.
    const double low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
    const double high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
    for (float& f : inv) {
      const double wavelen = 2.0 * M_PI / f;
      if (wavelen > low_wavelen) {
        f = static_cast<float>(f / s.factor);
      } else if (wavelen >= high_wavelen) {
        const double smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) /
                              (s.high_freq_factor - s.low_freq_factor);
        f = static_cast<float>((1.0 - smooth) * f / s.factor + smooth * f);
      }
    }
  }
  return inv;
}

}  // namespace specd
