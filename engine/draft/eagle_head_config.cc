#include "engine/draft/eagle_head_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/backend.h"
#include "nlohmann/json.hpp"

namespace specd {
namespace {

using nlohmann::json;

constexpr const char* kEagle3Architectures[] = {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"};
constexpr const char* kTapKey = "specd_tap_layer_inputs";
constexpr const char* kLayerIdsKey = "eagle_aux_hidden_state_layer_ids";

absl::Status Bad(const std::string& src, const std::string& msg) {
  return absl::InvalidArgumentError(absl::StrCat(src, ": ", msg));
}

// A JSON array of integers at j[key] (where `path` names it in errors).
absl::StatusOr<std::vector<int>> IntList(const json& j, const char* key, const std::string& src,
                                         const std::string& path) {
  const json& v = j[key];
  if (!v.is_array()) return Bad(src, absl::StrCat(path, " is not a list of layer ids"));
  std::vector<int> out;
  for (const json& e : v) {
    if (!e.is_number_integer()) return Bad(src, absl::StrCat(path, " holds a non-integer"));
    out.push_back(e.get<int>());
  }
  return out;
}

absl::StatusOr<bool> OptionalBool(const json& j, const char* key, const std::string& src,
                                  bool fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean()) return Bad(src, absl::StrCat(key, " is not true or false"));
  return j[key].get<bool>();
}

// The taps of an EAGLE-3 head (see the header): checked, in increasing order.
absl::StatusOr<std::vector<int>> ReadTaps(const json& j, const std::string& src, int layers) {
  std::vector<int> inputs, ids, from_ids;
  const bool has_inputs = j.contains(kTapKey) && !j[kTapKey].is_null();
  bool has_ids = false;
  if (has_inputs) {
    absl::StatusOr<std::vector<int>> v = IntList(j, kTapKey, src, kTapKey);
    if (!v.ok()) return v.status();
    inputs = *std::move(v);
  }
  const std::string ids_path = absl::StrCat("eagle_config.", kLayerIdsKey);
  if (j.contains("eagle_config") && j["eagle_config"].contains(kLayerIdsKey) &&
      !j["eagle_config"][kLayerIdsKey].is_null()) {
    absl::StatusOr<std::vector<int>> v = IntList(j["eagle_config"], kLayerIdsKey, src, ids_path);
    if (!v.ok()) return v.status();
    ids = *std::move(v);
    for (int id : ids) from_ids.push_back(id + 1);  // output of layer id = input of layer id + 1
    has_ids = true;
  }
  const auto sorted = [](std::vector<int> v) {
    std::sort(v.begin(), v.end());
    return v;
  };
  if (has_inputs && has_ids && sorted(inputs) != sorted(from_ids)) {
    return Bad(src, absl::StrCat(kTapKey, " [", absl::StrJoin(inputs, ", "), "] and ", ids_path,
                                 " [", absl::StrJoin(ids, ", "), "] (layer outputs, so inputs [",
                                 absl::StrJoin(from_ids, ", "), "]) name different taps"));
  }
  std::vector<int> taps;
  std::string what;
  if (has_inputs) {
    taps = inputs;
    what = kTapKey;
  } else if (has_ids) {
    taps = from_ids;
    what = absl::StrCat(ids_path, " + 1");
  } else {
    taps = DefaultEagleTaps(layers);
    what = absl::StrCat("the default taps 2, N/2, N-3 for N = ", layers, " (name them with ",
                        kTapKey, ")");
  }
  if (taps.size() != 3) {
    return Bad(src, absl::StrCat(what, ": an EAGLE-3 head reads 3 taps, got ", taps.size()));
  }
  taps = sorted(taps);
  for (size_t i = 0; i < taps.size(); ++i) {
    if (taps[i] < 0 || taps[i] > layers) {
      return Bad(src, absl::StrCat(what, ": tap ", taps[i], " is not a layer input of the ", layers,
                                   "-layer target (0..", layers, ")"));
    }
    if (i > 0 && taps[i] == taps[i - 1]) {
      return Bad(src, absl::StrCat(what, ": taps [", absl::StrJoin(taps, ", "),
                                   "] are not three distinct layers"));
    }
  }
  return taps;
}

}  // namespace

const char* EagleKindName(EagleKind kind) {
  return kind == EagleKind::kEagle3 ? "eagle3" : "eagle1";
}

std::vector<int> DefaultEagleTaps(int target_layers) {
  return {2, target_layers / 2, target_layers - 3};
}

absl::StatusOr<EagleHeadConfig> ParseEagleHeadConfig(const std::string& json_text,
                                                     const std::string& src,
                                                     const ModelConfig& target) {
  absl::StatusOr<ModelConfig> head = ParseModelConfig(json_text, src);
  if (!head.ok()) return head.status();
  const json j = json::parse(json_text);  // ParseModelConfig accepted it
  EagleHeadConfig c;
  c.head = *std::move(head);
  const ModelConfig& h = c.head;

  bool eagle3 = false;
  if (j.contains("architectures")) {
    if (!j["architectures"].is_array()) return Bad(src, "architectures is not a list");
    for (const json& a : j["architectures"]) {
      if (!a.is_string()) return Bad(src, "architectures holds a non-string");
      for (const char* name : kEagle3Architectures) eagle3 = eagle3 || a.get<std::string>() == name;
    }
  }
  c.kind = eagle3 ? EagleKind::kEagle3 : EagleKind::kEagle1;

  if (h.attention_bias) return Bad(src, "attention_bias: q/k/v biases are not supported in a head");
  if (h.qk_norm) return Bad(src, "model_type qwen3: q/k norms are not supported in a head");
  if (j.contains("hidden_act") && j["hidden_act"] != "silu") {
    return Bad(src,
               absl::StrCat("hidden_act ", j["hidden_act"].dump(), " is not supported (silu)"));
  }
  if (j.contains("mlp_bias") && j["mlp_bias"] == true) {
    return Bad(src, "mlp_bias: MLP biases are not supported in a head");
  }
  c.vocab_size = h.vocab_size;
  if (c.vocab_size != target.vocab_size) {
    return Bad(src, absl::StrCat("vocab_size: the head has ", c.vocab_size, " tokens, the target ",
                                 target.vocab_size));
  }
  c.target_hidden_size = h.hidden_size;
  if (j.contains("target_hidden_size") && !j["target_hidden_size"].is_null()) {
    if (!j["target_hidden_size"].is_number_integer()) {
      return Bad(src, "target_hidden_size is not an integer");
    }
    c.target_hidden_size = j["target_hidden_size"].get<int>();
  }
  if (c.target_hidden_size != target.hidden_size) {
    return Bad(
        src, absl::StrCat("target_hidden_size (hidden_size when absent) is ", c.target_hidden_size,
                          ", the target's hidden_size is ", target.hidden_size));
  }
  const bool has_taps = j.contains(kTapKey) ||
                        (j.contains("eagle_config") && j["eagle_config"].contains(kLayerIdsKey));
  if (j.contains("eagle_config") && !j["eagle_config"].is_object()) {
    return Bad(src, "eagle_config is not an object");
  }

  if (c.kind == EagleKind::kEagle3) {
    if (h.num_layers != 1) {
      return Bad(src, absl::StrCat("num_hidden_layers: an EAGLE-3 head has one decoder layer, got ",
                                   h.num_layers));
    }
    c.draft_vocab_size = c.vocab_size;
    if (j.contains("draft_vocab_size") && !j["draft_vocab_size"].is_null()) {
      if (!j["draft_vocab_size"].is_number_integer()) {
        return Bad(src, "draft_vocab_size is not an integer");
      }
      c.draft_vocab_size = j["draft_vocab_size"].get<int>();
    }
    if (c.draft_vocab_size < 1 || c.draft_vocab_size > c.vocab_size) {
      return Bad(src, absl::StrCat("draft_vocab_size ", c.draft_vocab_size, " is not in [1, ",
                                   c.vocab_size, "]"));
    }
    if (j.contains("eagle_config")) {
      absl::StatusOr<bool> aux = OptionalBool(j["eagle_config"], "use_aux_hidden_state", src, true);
      if (!aux.ok()) return aux.status();
      if (!*aux) {
        return Bad(src,
                   "eagle_config.use_aux_hidden_state: false (a head without fc over the "
                   "taps) is not supported");
      }
    }
    absl::StatusOr<std::vector<int>> taps = ReadTaps(j, src, target.num_layers);
    if (!taps.ok()) return taps.status();
    c.taps = *std::move(taps);
    absl::StatusOr<bool> nbr = OptionalBool(j, "norm_before_residual", src, false);
    if (!nbr.ok()) return nbr.status();
    c.norm_before_residual = *nbr;
  } else {
    if (c.target_hidden_size != h.hidden_size) {
      return Bad(
          src, absl::StrCat("target_hidden_size: an EAGLE-1/2 head's hidden_size (", h.hidden_size,
                            ") must be the target's (", c.target_hidden_size, ")"));
    }
    if (j.contains("draft_vocab_size") && j["draft_vocab_size"] != c.vocab_size) {
      return Bad(src,
                 "draft_vocab_size: an EAGLE-1/2 head proposes from the target's "
                 "vocabulary (a reduced vocabulary needs architectures "
                 "[\"LlamaForCausalLMEagle3\"])");
    }
    if (has_taps) {
      return Bad(src, absl::StrCat(kTapKey, " / eagle_config.", kLayerIdsKey,
                                   ": taps belong to EAGLE-3 heads; this one's architectures do "
                                   "not name LlamaForCausalLMEagle3"));
    }
    c.draft_vocab_size = c.vocab_size;
    c.taps = {FinalNormTap(target.num_layers)};
    absl::StatusOr<bool> bias = OptionalBool(j, "bias", src, true);
    if (!bias.ok()) return bias.status();
    c.fc_bias = *bias;
  }
  return c;
}

absl::StatusOr<EagleHeadConfig> LoadEagleHeadConfig(const std::string& dir,
                                                    const ModelConfig& target) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open (not a head folder?)"));
  std::stringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<EagleHeadConfig> c = ParseEagleHeadConfig(ss.str(), path, target);
  if (!c.ok()) return c.status();
  c->dir = dir;
  c->head.dir = dir;
  return c;
}

}  // namespace specd
