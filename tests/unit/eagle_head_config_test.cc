// Reading EAGLE heads: config.json (kinds, the two tap spellings, refusals) and the tensors of
// the published layout (errors name the tensor and the shape expected). The heads are the
// fixtures of tests/fixtures/eagle3, copied and altered one tensor at a time.
#include "engine/draft/eagle_head_config.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/io/safetensors.h"
#include "engine/draft/eagle_head.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testutil/hf_fixtures.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testutil::ReadJson;
using testutil::RepoRoot;

fs::path FixtureDir() { return RepoRoot() / "tests" / "fixtures" / "eagle3"; }

ModelConfig Target() {
  absl::StatusOr<ModelConfig> c = LoadModelConfig((FixtureDir() / "target").string());
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig();
}

json Eagle3Json() { return ReadJson(FixtureDir() / "eagle3_head" / "config.json"); }

absl::StatusOr<EagleHeadConfig> Parse(const json& j, const ModelConfig& target) {
  return ParseEagleHeadConfig(j.dump(), "config.json", target);
}

TEST(EagleHeadConfigTest, ReadsTheFixtureHeads) {
  const ModelConfig target = Target();
  absl::StatusOr<EagleHeadConfig> e3 =
      LoadEagleHeadConfig((FixtureDir() / "eagle3_head").string(), target);
  ASSERT_TRUE(e3.ok()) << e3.status();
  EXPECT_EQ(e3->kind, EagleKind::kEagle3);
  // The taps the reference recorded (tools/oracle/eagle3_reference.py reads both spellings).
  const json oracle = ReadJson(FixtureDir() / "oracle.json");
  EXPECT_EQ(e3->taps, oracle["taps"].get<std::vector<int>>());
  EXPECT_EQ(e3->draft_vocab_size, 64);
  EXPECT_EQ(e3->vocab_size, 256);
  EXPECT_EQ(e3->feature_size(), 3 * 32);
  EXPECT_FLOAT_EQ(e3->head.rope_theta, 5000.0f);  // the head's own, not the target's

  absl::StatusOr<EagleHeadConfig> e1 =
      LoadEagleHeadConfig((FixtureDir() / "eagle1_head").string(), target);
  ASSERT_TRUE(e1.ok()) << e1.status();
  EXPECT_EQ(e1->kind, EagleKind::kEagle1);
  EXPECT_EQ(e1->head.num_layers, 2);
  EXPECT_TRUE(e1->fc_bias);
  // EAGLE-1/2 reads one tap: the target's final norm output, one past its 8 layers' inputs.
  EXPECT_EQ(e1->taps, std::vector<int>{FinalNormTap(8)});
  EXPECT_EQ(e1->taps, std::vector<int>{9});
  EXPECT_EQ(e1->draft_vocab_size, 256);
  EXPECT_EQ(e1->feature_size(), 32);
}

// One layer id convention stated, both spellings read (docs/eagle.md): specd's key names layer
// inputs, SGLang/SpecForge's eagle_aux_hidden_state_layer_ids names layer outputs.
TEST(EagleHeadConfigTest, TapSpellings) {
  const ModelConfig target = Target();  // 8 layers
  const auto taps = [&](const json& j) {
    absl::StatusOr<EagleHeadConfig> c = Parse(j, target);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? c->taps : std::vector<int>{};
  };
  json j = Eagle3Json();
  j.erase("eagle_config");
  EXPECT_THAT(taps(j), ElementsAre(1, 4, 6));  // specd_tap_layer_inputs alone
  j["specd_tap_layer_inputs"] = {6, 1, 4};
  EXPECT_THAT(taps(j), ElementsAre(1, 4, 6));  // concatenated in layer order
  j = Eagle3Json();
  j.erase("specd_tap_layer_inputs");
  EXPECT_THAT(taps(j), ElementsAre(1, 4, 6));             // outputs of layers 0, 3, 5
  EXPECT_THAT(taps(Eagle3Json()), ElementsAre(1, 4, 6));  // both, agreeing
  j.erase("eagle_config");
  EXPECT_EQ(taps(j), DefaultEagleTaps(8));  // neither
  EXPECT_THAT(DefaultEagleTaps(8), ElementsAre(2, 4, 5));

  // Llama-3.1-8B: SpecForge writes the outputs of layers 1, 15, 28, which are the layers EAGLE
  // and vLLM capture the inputs of by default, 2, 16, 29.
  ModelConfig llama8b = target;
  llama8b.num_layers = 32;
  j["eagle_config"] = {{"eagle_aux_hidden_state_layer_ids", {1, 15, 28}}};
  absl::StatusOr<EagleHeadConfig> c = Parse(j, llama8b);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->taps, ElementsAre(2, 16, 29));
  EXPECT_EQ(c->taps, DefaultEagleTaps(32));
}

TEST(EagleHeadConfigTest, BadTapsAreRefused) {
  const ModelConfig target = Target();
  const auto error = [&](const json& j) {
    absl::StatusOr<EagleHeadConfig> c = Parse(j, target);
    EXPECT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(c.status().message());
  };
  json j = Eagle3Json();
  j["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = {1, 4, 6};  // inputs 2, 5, 7
  EXPECT_THAT(error(j), AllOf(HasSubstr("specd_tap_layer_inputs [1, 4, 6]"),
                              HasSubstr("eagle_config.eagle_aux_hidden_state_layer_ids [1, 4, 6]"),
                              HasSubstr("name different taps")));
  j = Eagle3Json();
  j.erase("eagle_config");
  j["specd_tap_layer_inputs"] = {1, 1, 4};
  EXPECT_THAT(error(j), HasSubstr("not three distinct layers"));
  j["specd_tap_layer_inputs"] = {1, 4, 9};
  EXPECT_THAT(error(j), HasSubstr("tap 9 is not a layer input of the 8-layer target"));
  j["specd_tap_layer_inputs"] = {1, 4};
  EXPECT_THAT(error(j), HasSubstr("reads 3 taps, got 2"));
  j["specd_tap_layer_inputs"] = {1, 4, "6"};
  EXPECT_THAT(error(j), HasSubstr("specd_tap_layer_inputs holds a non-integer"));
  // A 5-layer target's defaults collide (2, 2, 2): the config must name its taps.
  j.erase("specd_tap_layer_inputs");
  ModelConfig five = target;
  five.num_layers = 5;
  absl::StatusOr<EagleHeadConfig> c = Parse(j, five);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(),
              AllOf(HasSubstr("default taps"), HasSubstr("specd_tap_layer_inputs"),
                    HasSubstr("not three distinct layers")));
}

TEST(EagleHeadConfigTest, HeadsThatDoNotFitAreRefused) {
  const ModelConfig target = Target();
  const auto error = [&](const std::function<void(json&)>& edit) {
    json j = Eagle3Json();
    edit(j);
    absl::StatusOr<EagleHeadConfig> c = Parse(j, target);
    EXPECT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(c.status().message());
  };
  EXPECT_THAT(error([](json& j) { j["vocab_size"] = 128; }),
              HasSubstr("vocab_size: the head has 128 tokens, the target 256"));
  EXPECT_THAT(error([](json& j) { j["target_hidden_size"] = 64; }),
              HasSubstr("target_hidden_size (hidden_size when absent) is 64"));
  EXPECT_THAT(error([](json& j) { j["num_hidden_layers"] = 2; }),
              HasSubstr("num_hidden_layers: an EAGLE-3 head has one decoder layer, got 2"));
  EXPECT_THAT(error([](json& j) { j["draft_vocab_size"] = 300; }),
              HasSubstr("draft_vocab_size 300 is not in [1, 256]"));
  EXPECT_THAT(error([](json& j) { j["eagle_config"]["use_aux_hidden_state"] = false; }),
              HasSubstr("use_aux_hidden_state"));
  EXPECT_THAT(error([](json& j) { j["attention_bias"] = true; }), HasSubstr("attention_bias"));
  EXPECT_THAT(error([](json& j) { j["hidden_act"] = "gelu"; }), HasSubstr("hidden_act"));
  EXPECT_THAT(error([](json& j) {
                j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 2}};
              }),
              HasSubstr("\"dynamic\" is not supported"));
  EXPECT_THAT(error([](json& j) { j["norm_before_residual"] = "yes"; }),
              HasSubstr("norm_before_residual is not true or false"));
  // EAGLE-1/2 heads (any other architecture) have neither taps nor a reduced vocabulary.
  EXPECT_THAT(error([](json& j) {
                j["architectures"] = {"LlamaForCausalLM"};
                j.erase("draft_vocab_size");
              }),
              HasSubstr("taps belong to EAGLE-3 heads"));
  EXPECT_THAT(error([](json& j) {
                j["architectures"] = {"LlamaForCausalLM"};
                j.erase("eagle_config");
                j.erase("specd_tap_layer_inputs");
              }),
              HasSubstr("draft_vocab_size: an EAGLE-1/2 head proposes from the target's"));
}

// ------------------------------------------------------------------------------------------------
// tensors

// The fixture head `name` copied into a fresh folder with `edit` applied to its tensors (and
// `edit_config` to its config.json); returns the folder.
std::string AlteredHead(const std::string& name,
                        const std::function<void(std::map<std::string, TensorToWrite>&)>& edit,
                        const std::function<void(json&)>& edit_config = nullptr) {
  const fs::path src = FixtureDir() / name;
  absl::StatusOr<std::unique_ptr<TensorStore>> store = TensorStore::OpenFolder(src.string());
  EXPECT_TRUE(store.ok()) << store.status();
  std::map<std::string, TensorToWrite> tensors;
  for (const std::string& n : (*store)->Names()) {
    const TensorView* v = *(*store)->Get(n);
    tensors[n] = {n, v->dtype, v->shape, std::vector<uint8_t>(v->data, v->data + v->nbytes)};
  }
  edit(tensors);
  const std::string dir = MakeTempDir("eagle_head_");
  std::vector<TensorToWrite> list;
  for (auto& [n, t] : tensors) list.push_back(t);
  EXPECT_TRUE(WriteSafetensors(dir + "/model.safetensors", list).ok());
  json config = ReadJson(src / "config.json");
  if (edit_config) edit_config(config);
  std::ofstream(dir + "/config.json") << config.dump(2);
  return dir;
}

absl::Status LoadStatus(const std::string& head_dir) {
  return CreateEagleHead(head_dir, (FixtureDir() / "target").string(), EagleHeadOptions()).status();
}

TensorToWrite F32(const std::string& name, std::vector<int64_t> shape, float value) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v(n, value);
  TensorToWrite t{name, DType::kF32, shape, std::vector<uint8_t>(n * 4)};
  std::memcpy(t.data.data(), v.data(), n * 4);
  return t;
}

TEST(EagleHeadWeightsTest, UnalteredCopiesLoad) {
  EXPECT_TRUE(LoadStatus(AlteredHead("eagle3_head", [](auto&) {})).ok());
  EXPECT_TRUE(LoadStatus(AlteredHead("eagle1_head", [](auto&) {})).ok());
}

TEST(EagleHeadWeightsTest, ErrorsNameTheTensorAndTheShape) {
  const auto error = [](const std::string& head,
                        const std::function<void(std::map<std::string, TensorToWrite>&)>& edit,
                        const std::function<void(json&)>& edit_config = nullptr) {
    const absl::Status s = LoadStatus(AlteredHead(head, edit, edit_config));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    return std::string(s.message());
  };
  EXPECT_THAT(error("eagle3_head", [](auto& t) { t.erase("midlayer.hidden_norm.weight"); }),
              AllOf(HasSubstr("missing tensor midlayer.hidden_norm.weight"),
                    HasSubstr("expected shape [32]"), HasSubstr("EAGLE-3 head")));
  EXPECT_THAT(error("eagle3_head",
                    [](auto& t) {
                      t["fc.weight"] = F32("fc.weight", {32, 64}, 0);
                    }),
              AllOf(HasSubstr("fc.weight has shape [32, 64], expected [32, 96]")));
  EXPECT_THAT(error("eagle3_head",
                    [](auto& t) {
                      t["midlayer.self_attn.q_proj.weight"] =
                          F32("midlayer.self_attn.q_proj.weight", {32, 32}, 0);
                    }),
              HasSubstr("midlayer.self_attn.q_proj.weight has shape [32, 32], expected [32, 64]"));
  EXPECT_THAT(error("eagle3_head",
                    [](auto& t) {
                      t["midlayer.self_attn.q_proj.bias"] =
                          F32("midlayer.self_attn.q_proj.bias", {32}, 0);
                    }),
              HasSubstr("tensor midlayer.self_attn.q_proj.bias is not part of an EAGLE-3 head"));
  EXPECT_THAT(error("eagle3_head", [](auto& t) { t.erase("d2t"); }),
              HasSubstr("missing tensor d2t, expected I64 [64]"));
  EXPECT_THAT(error("eagle3_head",
                    [](auto& t) {
                      int64_t big = 1000;
                      std::memcpy(t["d2t"].data.data() + 8 * 5, &big, 8);
                    }),
              HasSubstr("d2t[5] = 1000 maps draft id 5 to 1005, outside the vocabulary"));
  EXPECT_THAT(error("eagle3_head",
                    [](auto& t) {
                      for (uint8_t& b : t["t2d"].data) b = 1;
                    }),
              HasSubstr("but d2t does not map a draft id to"));
  EXPECT_THAT(error("eagle3_head",
                    [](auto& t) {
                      t["embed_tokens.weight"] = F32("embed_tokens.weight", {256, 16}, 0);
                    }),
              HasSubstr("embed_tokens.weight has shape [256, 16], expected [256, 32]"));
  EXPECT_THAT(
      error("eagle1_head", [](auto& t) { t.erase("fc.bias"); }),
      AllOf(HasSubstr("missing tensor fc.bias, expected shape [32]"), HasSubstr("EAGLE-1/2 head")));
  EXPECT_THAT(error(
                  "eagle1_head", [](auto&) {}, [](json& c) { c["bias"] = false; }),
              HasSubstr("tensor fc.bias is not part of an EAGLE-1/2 head"));
  EXPECT_THAT(error("eagle1_head", [](auto& t) { t.erase("layers.1.input_layernorm.weight"); }),
              HasSubstr("missing tensor layers.1.input_layernorm.weight, expected shape [32]"));
  // The first EAGLE-1 layer has no input norm; one in the file would be ignored, so it is refused.
  EXPECT_THAT(error("eagle1_head",
                    [](auto& t) {
                      t["layers.0.input_layernorm.weight"] =
                          F32("layers.0.input_layernorm.weight", {32}, 1);
                    }),
              HasSubstr("tensor layers.0.input_layernorm.weight is not part of an EAGLE-1/2 head"));
}

// A head that carries its own embedding uses it: with the target's rows it computes what the
// fixture head computes, with other rows something else.
TEST(EagleHeadWeightsTest, AnEmbeddingInTheHeadFileIsUsed) {
  absl::StatusOr<std::unique_ptr<TensorStore>> target =
      TensorStore::OpenFolder((FixtureDir() / "target").string());
  ASSERT_TRUE(target.ok());
  const TensorView* embed = *(*target)->Get("model.embed_tokens.weight");
  const TensorToWrite same{"embed_tokens.weight", embed->dtype, embed->shape,
                           std::vector<uint8_t>(embed->data, embed->data + embed->nbytes)};
  const auto run = [](const std::string& dir) {
    EagleHeadOptions options;
    options.num_threads = 1;
    absl::StatusOr<std::unique_ptr<EagleHead>> head =
        CreateEagleHead(dir, (FixtureDir() / "target").string(), options);
    EXPECT_TRUE(head.ok()) << head.status();
    if (!head.ok()) return std::vector<float>();
    EXPECT_TRUE((*head)->AddSequence(1).ok());
    std::vector<float> feats(3 * (*head)->config().feature_size(), 0.5f);
    EagleHeadItem item;
    item.seq = 1;
    item.tokens = {7, 8, 9};
    item.parents = {-1, 0, 1};
    item.inputs = feats;
    item.output_rows = {2};
    EagleHeadOutputs out;
    EXPECT_TRUE((*head)->Forward({item}, &out).ok());
    return out.logits;
  };
  const std::vector<float> base = run((FixtureDir() / "eagle3_head").string());
  ASSERT_FALSE(base.empty());
  EXPECT_EQ(run(AlteredHead("eagle3_head", [&](auto& t) { t["embed_tokens.weight"] = same; })),
            base);
  EXPECT_NE(
      run(AlteredHead("eagle3_head",
                      [](auto& t) {
                        t["embed_tokens.weight"] = F32("embed_tokens.weight", {256, 32}, 0.1f);
                      })),
      base);
}

}  // namespace
}  // namespace specd
