#include "tests/testutil/speculation_models.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <utility>

#include "common/io/safetensors.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testutil/extended_checkpoint.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd::speculation_testing {

std::unique_ptr<Backend> Load(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir, BackendOptions());
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

absl::Status WriteRandomEagleHead(const std::string& dir) {
  std::filesystem::create_directories(dir);
  nlohmann::json config = {{"architectures", {"LlamaForCausalLMEagle3"}},
                           {"model_type", "llama"},
                           {"hidden_act", "silu"},
                           {"vocab_size", kVocab},
                           {"hidden_size", 32},
                           {"intermediate_size", 64},
                           {"num_attention_heads", 4},
                           {"num_key_value_heads", 2},
                           {"head_dim", 8},
                           {"num_hidden_layers", 1},
                           {"rms_norm_eps", 1e-5},
                           {"rope_theta", 10000.0},
                           {"max_position_embeddings", 4096},
                           {"tie_word_embeddings", false},
                           {"torch_dtype", "float32"},
                           {"draft_vocab_size", 100},
                           {"specd_tap_layer_inputs", {0, 1, 2}}};
  {
    std::ofstream out(std::filesystem::path(dir) / "config.json");
    out << config.dump(2);
    if (!out) return absl::InternalError("writing the EAGLE head's config.json");
  }
  std::mt19937 rng(31);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  std::vector<TensorToWrite> tensors;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool ones = false) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> v(n);
    for (float& x : v) x = ones ? 1.0f : normal(rng);
    TensorToWrite t;
    t.name = name;
    t.shape = std::move(shape);
    t.data.resize(v.size() * sizeof(float));
    std::memcpy(t.data.data(), v.data(), t.data.size());
    tensors.push_back(std::move(t));
  };
  add("fc.weight", {32, 96});
  add("midlayer.self_attn.q_proj.weight", {32, 64});
  add("midlayer.self_attn.k_proj.weight", {16, 64});
  add("midlayer.self_attn.v_proj.weight", {16, 64});
  add("midlayer.self_attn.o_proj.weight", {32, 32});
  add("midlayer.mlp.gate_proj.weight", {64, 32});
  add("midlayer.mlp.up_proj.weight", {64, 32});
  add("midlayer.mlp.down_proj.weight", {32, 64});
  for (const char* norm : {"midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                           "midlayer.post_attention_layernorm.weight", "norm.weight"}) {
    add(norm, {32}, /*ones=*/true);
  }
  add("lm_head.weight", {100, 32});
  TensorToWrite d2t;
  d2t.name = "d2t";
  d2t.dtype = DType::kI64;
  d2t.shape = {100};
  std::vector<int64_t> offsets(100, 7);
  d2t.data.resize(offsets.size() * sizeof(int64_t));
  std::memcpy(d2t.data.data(), offsets.data(), d2t.data.size());
  tensors.push_back(std::move(d2t));
  return WriteSafetensors((std::filesystem::path(dir) / "model.safetensors").string(), tensors);
}

Models::Models() {
  root = MakeTempDir("specd_spec_");
  draft_dir = root + "/draft";
  target_dir = root + "/target";
  other_dir = root + "/other";
  RandomCheckpointSpec spec;
  spec.vocab_size = kVocab;
  spec.hidden_size = 32;
  spec.intermediate_size = 64;
  spec.num_layers = 1;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.init_std = 0.3f;
  spec.seed = 21;
  EXPECT_TRUE(WriteRandomCheckpoint(draft_dir, spec).ok());
  ExtendSpec extend;
  extend.extra_layers = 1;
  extend.output_scale = 0.15f;
  extend.init_std = 0.3f;
  extend.seed = 22;
  EXPECT_TRUE(WriteExtendedCheckpoint(draft_dir, target_dir, extend).ok());
  RandomCheckpointSpec other_spec = spec;
  other_spec.seed = 77;
  other_spec.hidden_size = 48;
  other_spec.num_heads = 6;
  other_spec.num_kv_heads = 3;
  other_spec.model_type = "qwen2";
  EXPECT_TRUE(WriteRandomCheckpoint(other_dir, other_spec).ok());
  target = Load(target_dir);
  draft = Load(draft_dir);
  same = Load(target_dir);  // draft == target: its proposals are the target's favourites
  other = Load(other_dir);
  related_drafter = std::make_unique<DraftModelDrafter>(draft.get());
  same_drafter = std::make_unique<DraftModelDrafter>(same.get());
  other_drafter = std::make_unique<DraftModelDrafter>(other.get());
  ngram = *NgramDrafter::Create(kVocab, NgramOptions());
  EXPECT_TRUE(WriteRandomEagleHead(root + "/eagle").ok());
  absl::StatusOr<std::unique_ptr<EagleHead>> head =
      CreateEagleHead(root + "/eagle", target_dir, EagleHeadOptions());
  EXPECT_TRUE(head.ok()) << head.status();
  if (head.ok()) {
    eagle_head = *std::move(head);
    eagle_drafter = std::make_unique<EagleDrafter>(eagle_head.get());
  }
}
Models::~Models() {
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
}

Models& M() {
  static Models* models = new Models();
  return *models;
}

Drafter* GetDrafter(DrafterKind kind) {
  switch (kind) {
    case DrafterKind::kNone: return nullptr;
    case DrafterKind::kRelated: return M().related_drafter.get();
    case DrafterKind::kSame: return M().same_drafter.get();
    case DrafterKind::kOther: return M().other_drafter.get();
    case DrafterKind::kNgram: return M().ngram.get();
    case DrafterKind::kEagle: return M().eagle_drafter.get();
  }
  return nullptr;
}

const char* DrafterName(DrafterKind kind) {
  switch (kind) {
    case DrafterKind::kNone: return "none";
    case DrafterKind::kRelated: return "related";
    case DrafterKind::kSame: return "same";
    case DrafterKind::kOther: return "other";
    case DrafterKind::kNgram: return "ngram";
    case DrafterKind::kEagle: return "eagle";
  }
  return "?";
}

std::vector<GenerationResult> GenerateAll(DrafterKind kind,
                                          const std::vector<GenerationRequest>& requests,
                                          size_t batch, std::vector<std::vector<int32_t>>* streamed,
                                          const GeneratorOptions& options) {
  absl::StatusOr<std::unique_ptr<Generator>> gen =
      Generator::Create(M().target.get(), GetDrafter(kind), options);
  EXPECT_TRUE(gen.ok()) << gen.status();
  if (!gen.ok()) return {};
  std::vector<GenerationResult> out;
  if (streamed != nullptr) streamed->assign(requests.size(), {});
  for (size_t i = 0; i < requests.size(); i += batch) {
    const size_t n = std::min(batch, requests.size() - i);
    TokenCallback cb = nullptr;
    if (streamed != nullptr) {
      cb = [&, i](size_t index, absl::Span<const int32_t> tokens) {
        (*streamed)[i + index].insert((*streamed)[i + index].end(), tokens.begin(), tokens.end());
      };
    }
    absl::StatusOr<std::vector<GenerationResult>> r =
        (*gen)->Generate(absl::MakeConstSpan(requests).subspan(i, n), cb);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    out.insert(out.end(), r->begin(), r->end());
  }
  EXPECT_EQ(M().target->Usage().sequences, 0) << "sequences leaked in the target";
  return out;
}

SpecStats Total(const std::vector<GenerationResult>& results) {
  SpecStats s;
  for (const GenerationResult& r : results) s.Add(r.stats);
  return s;
}

}  // namespace specd::speculation_testing
