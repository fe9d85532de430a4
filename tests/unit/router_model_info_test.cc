// What the router's GetModelInfo derives rather than passes on: where the model folder's chat
// template is (on real folders, in ChatTemplate::Load's order) and which speculation modes the
// draft and verify services' info allow. The whole RPC runs in tests/integration/
// model_info_test.cc.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "services/router/router_loop.h"
#include "services/router/router_service.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

TEST(RouterModelInfoTest, ChatTemplateSourceFollowsTheLoadersOrder) {
  const std::string dir = MakeTempDir("router_model_info_test");
  EXPECT_EQ(ChatTemplateSourceOf(dir), "");               // no tokenizer_config.json
  EXPECT_EQ(ChatTemplateSourceOf(dir + "/missing"), "");  // no folder
  WriteFile(dir + "/tokenizer_config.json", R"({"bos_token": "<s>"})");
  EXPECT_EQ(ChatTemplateSourceOf(dir), "");
  WriteFile(dir + "/tokenizer_config.json", R"({"chat_template": null})");
  EXPECT_EQ(ChatTemplateSourceOf(dir), "");
  WriteFile(dir + "/tokenizer_config.json", R"({"chat_template": "{{ messages }}"})");
  EXPECT_EQ(ChatTemplateSourceOf(dir), "tokenizer_config.json");
  // A list of named templates counts when it has the "default" specd-http would render.
  WriteFile(dir + "/tokenizer_config.json",
            R"({"chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D"}]})");
  EXPECT_EQ(ChatTemplateSourceOf(dir), "tokenizer_config.json");
  WriteFile(dir + "/tokenizer_config.json",
            R"({"chat_template": [{"name": "tool_use", "template": "T"}]})");
  EXPECT_EQ(ChatTemplateSourceOf(dir), "");
  WriteFile(dir + "/tokenizer_config.json", "{not json");
  EXPECT_EQ(ChatTemplateSourceOf(dir), "");
  // chat_template.jinja wins over the config, as in transformers.
  WriteFile(dir + "/tokenizer_config.json", R"({"chat_template": "{{ messages }}"})");
  WriteFile(dir + "/chat_template.jinja", "{{ messages }}");
  EXPECT_EQ(ChatTemplateSourceOf(dir), "chat_template.jinja");
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

TEST(RouterModelInfoTest, SpeculationModesFollowTheServicesInfo) {
  using Modes = std::vector<v1::Speculation>;
  const Modes always = {v1::SPECULATION_AUTO, v1::SPECULATION_OFF, v1::SPECULATION_NGRAM};
  v1::DraftInfo draft_model;
  draft_model.set_model("draft");
  draft_model.mutable_load()->set_kv_capacity_tokens(4096);
  v1::DraftInfo ngram_only;
  ngram_only.set_model("ngram");
  v1::DraftInfo eagle = draft_model;
  eagle.set_eagle_head("head");
  for (int layer : {2, 16, 29}) eagle.add_eagle_tap_layers(layer);  // EAGLE-3, 32 layers
  v1::DraftInfo eagle1 = draft_model;
  eagle1.set_eagle_head("head");
  eagle1.add_eagle_tap_layers(33);  // an EAGLE-1/2 head: FinalNormTap(32)
  v1::VerifyInfo verify;
  v1::VerifyInfo taps;
  taps.set_supports_taps(true);
  taps.set_max_tap_layer(32);
  v1::VerifyInfo final_norm = taps;
  final_norm.set_max_tap_layer(33);

  EXPECT_EQ(AvailableSpeculationModes(false, v1::DraftInfo(), verify), always);
  EXPECT_EQ(AvailableSpeculationModes(false, eagle, taps), always);  // the service is down
  EXPECT_EQ(AvailableSpeculationModes(true, ngram_only, taps), always);
  const Modes with_model = {v1::SPECULATION_AUTO, v1::SPECULATION_OFF, v1::SPECULATION_DRAFT_MODEL,
                            v1::SPECULATION_NGRAM};
  EXPECT_EQ(AvailableSpeculationModes(true, draft_model, taps), with_model);
  // An EAGLE head needs a verify service that exports its taps.
  EXPECT_EQ(AvailableSpeculationModes(true, eagle, verify), with_model);
  Modes all = with_model;
  all.push_back(v1::SPECULATION_EAGLE3);
  EXPECT_EQ(AvailableSpeculationModes(true, eagle, taps), all);
  // An EAGLE-1/2 head reads the final norm's output, which not every backend exports.
  EXPECT_EQ(AvailableSpeculationModes(true, eagle1, taps), with_model);
  EXPECT_FALSE(EagleTapsServed(eagle1, taps));
  EXPECT_EQ(AvailableSpeculationModes(true, eagle1, final_norm), all);
  EXPECT_TRUE(EagleTapsServed(eagle1, final_norm));
  EXPECT_TRUE(EagleTapsServed(eagle, final_norm));
  EXPECT_FALSE(EagleTapsServed(draft_model, final_norm));  // no head
}

}  // namespace
}  // namespace specd
